// Packing a QuantWeight (the reference's codes, scales and exponents) into quant_gemm.h's layout,
// once at load: the form that keeps the file's bytes (float16 scales, the K-quants' super-blocks)
// where the scales allow it, else the wide form.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include <unistd.h>

#include "kernels.h"
#include "quant_gemm.h"

namespace tf {
namespace {

using namespace quant;

// Whether every scale of the weight is a float16's significand and exponent (so the packed form
// can keep the float16 bits): the 32-weight types as GGUF stores them.
bool f16_scales(int kind, const int32_t* scale, const int32_t* scale_exp, const int32_t* min, const int32_t* min_exp,
                int64_t N, int64_t K) {
  if (kind > 2) return false;
  const int64_t count = N * (K / BLOCK);
  for (int64_t i = 0; i < count; ++i) {
    if (float16_bits(scale[i], scale_exp[i]) < 0) return false;
    if (min != nullptr && float16_bits(min[i], min_exp[i]) < 0) return false;
  }
  return true;
}

// The values v[0..n) as f dm with one float16 significand dm at exponent e and every factor f in
// [lo, hi] (lo <= 0 < hi): a K-quant super-block's S = dm sc (or M = -dminm m) as the file had it.
// Any such dm gives the same products, so the first found serves: dm divides g = gcd(v), and the
// file's own dm is g over a divisor of gcd(f), so few candidates are tried. False where none
// exists (scales that did not come from a K-quant file).
bool factor_scales(const int32_t* v, int n, int e, int lo, int hi, int32_t* dm, int32_t* f) {
  int64_t g = 0;
  for (int i = 0; i < n; ++i) g = std::gcd(g, static_cast<int64_t>(v[i] < 0 ? -static_cast<int64_t>(v[i]) : v[i]));
  if (g == 0) {  // all zero: any float16 at e
    for (int32_t cand : {0, 1024}) {
      if (float16_bits(cand, e) < 0) continue;
      *dm = cand;
      std::fill_n(f, n, 0);
      return true;
    }
    return false;
  }
  for (int64_t t = 1; t <= std::max(-lo, hi) && g / t > 0; ++t) {
    if (g % t != 0) continue;
    for (int sign : {1, -1}) {
      const int64_t d = sign * (g / t);
      if (float16_bits(static_cast<int32_t>(d), e) < 0) continue;
      bool ok = true;
      for (int i = 0; i < n && ok; ++i) {
        f[i] = static_cast<int32_t>(v[i] / d);
        ok = f[i] >= lo && f[i] <= hi;
      }
      if (ok) {
        *dm = static_cast<int32_t>(d);
        return true;
      }
    }
  }
  return false;
}

// One column's super-block sb in the SUPER form: d's and dmin's float16 bits, the sub-block
// factors (q4_k: sc and m, 8 each; q6_k: sc, 16). False where the scales do not factor so.
struct SuperScales {
  uint16_t d = 0, dmin = 0;
  int32_t sc[16] = {}, m[8] = {};
};

bool super_scales_of(int kind, const int32_t* scale, const int32_t* scale_exp, const int32_t* min,
                     const int32_t* min_exp, int64_t n, int64_t sb, int64_t K, SuperScales* out) {
  const int64_t blocks = K / BLOCK, b0 = n * blocks + sb * SUPER_BLOCKS;
  for (int i = 1; i < SUPER_BLOCKS; ++i)
    if (scale_exp[b0 + i] != scale_exp[b0] || (min_exp != nullptr && min_exp[b0 + i] != min_exp[b0])) return false;
  int32_t dm;
  if (kind == Q6K) {
    if (!factor_scales(scale + n * (K / 16) + sb * 16, 16, scale_exp[b0], -128, 127, &dm, out->sc)) return false;
    out->d = static_cast<uint16_t>(float16_bits(dm, scale_exp[b0]));
    return true;
  }
  if (!factor_scales(scale + b0, SUPER_BLOCKS, scale_exp[b0], 0, 63, &dm, out->sc)) return false;
  out->d = static_cast<uint16_t>(float16_bits(dm, scale_exp[b0]));
  int32_t neg;  // M = neg m with neg = -dminm
  if (!factor_scales(min + b0, SUPER_BLOCKS, min_exp[b0], 0, 63, &neg, out->m)) return false;
  if (float16_bits(-neg, min_exp[b0]) < 0) return false;
  out->dmin = static_cast<uint16_t>(float16_bits(-neg, min_exp[b0]));
  return true;
}

// q5_k's fifth bits of a column's block (codes u[32]) into its four bytes of the bit plane: quad
// q's in bit q (code_at).
void write_fifth_bits(const uint8_t* u, uint8_t* at) {
  uint8_t bits[4] = {};
  for (int q = 0; q < 8; ++q)
    for (int i = 0; i < 4; ++i) bits[i] |= static_cast<uint8_t>(((u[4 * q + i] >> 4) & 1) << q);
  std::memcpy(at, bits, 4);
}

// Column j of a SUPER record's head (head: the record's start) from its super-block's scales.
void write_super_head(int kind, const SuperScales& s, int j, uint8_t* head) {
  std::memcpy(head + 2 * j, &s.d, 2);
  if (kind == Q6K) {
    for (int t = 0; t < 16; ++t) head[2 * GROUP + 16 * t + j] = static_cast<uint8_t>(static_cast<int8_t>(s.sc[t]));
    return;
  }
  std::memcpy(head + 2 * GROUP + 2 * j, &s.dmin, 2);
  uint8_t bytes[12];  // k_scale's packing, inverted
  for (int i = 0; i < 4; ++i) {
    bytes[i] = static_cast<uint8_t>((s.sc[i] & 63) | ((s.sc[i + 4] >> 4) << 6));
    bytes[i + 4] = static_cast<uint8_t>((s.m[i] & 63) | ((s.m[i + 4] >> 4) << 6));
    bytes[i + 8] = static_cast<uint8_t>((s.sc[i + 4] & 15) | ((s.m[i + 4] & 15) << 4));
  }
  for (int t = 0; t < 12; ++t) head[4 * GROUP + 16 * t + j] = bytes[t];
}

// Column n's codes, scales, and (SUPER) its super-blocks' heads into its group's records (t: its top).
void pack_column(const Layout& L, int kind, const int8_t* codes, const int32_t* scale, const int32_t* scale_exp,
                 const int32_t* min, const int32_t* min_exp, uint8_t* packed, int64_t n, int64_t K, int32_t t) {
  const QKind& kd = L.kind;
  const int64_t g = n / GROUP, scales_per_row = K / kd.sub;
  const int j = static_cast<int>(n % GROUP);
  const bool nibbles = kd.nibbles || L.form == SUPER;
  for (int64_t b = 0; b < L.blocks; ++b) {
    uint8_t* rec = const_cast<uint8_t*>(record_at(packed, L, g, b));
    const int8_t* c = codes + n * K + b * BLOCK;
    uint8_t u[BLOCK];
    for (int k = 0; k < BLOCK; ++k) u[k] = static_cast<uint8_t>(c[k] + kd.offset);
    if (!nibbles) {
      for (int q = 0; q < 8; ++q) std::memcpy(rec + code_index(false, j, 4 * q), u + 4 * q, 4);
    } else {  // quad q's nibbles low, quad q + 4's high, in the four bytes at code_index(q)
      for (int q = 0; q < 4; ++q) {
        uint8_t quad[4];
        for (int i = 0; i < 4; ++i) quad[i] = static_cast<uint8_t>((u[4 * q + i] & 15) | ((u[4 * q + 16 + i] & 15) << 4));
        std::memcpy(rec + code_index(true, j, 4 * q), quad, 4);
      }
      if (L.form == SUPER && kind == Q6K) {  // code_at's top two bits: quad q's in bits 2 (q % 4) of row q / 4
        for (int row = 0; row < 2; ++row) {
          uint8_t bits[4] = {};
          for (int q = 4 * row; q < 4 * row + 4; ++q)
            for (int i = 0; i < 4; ++i) bits[i] |= static_cast<uint8_t>((u[4 * q + i] >> 4) << (2 * (q % 4)));
          std::memcpy(rec + L.code_bytes + row * 64 + j * 4, bits, 4);
        }
      }
      if (L.form == SUPER && kind == Q5K) write_fifth_bits(u, rec + L.code_bytes + j * 4);
    }
    const int64_t nb = n * L.blocks + b;
    if (L.form == SUPER) {
      if (b % SUPER_BLOCKS == 0) {
        SuperScales s;
        super_scales_of(kind, scale, scale_exp, min, min_exp, n, b / SUPER_BLOCKS, K, &s);
        write_super_head(kind, s, j, const_cast<uint8_t*>(super_head(rec, L, b)));
      }
    } else if (L.form == F16) {
      const uint16_t d = static_cast<uint16_t>(float16_bits(scale[nb], scale_exp[nb]));
      std::memcpy(rec + L.code_bytes + 2 * j, &d, 2);
      if (kd.has_min) {
        const uint16_t m = static_cast<uint16_t>(float16_bits(min[nb], min_exp[nb]));
        std::memcpy(rec + L.min_at + 2 * j, &m, 2);
      }
    } else {
      for (int hh = 0; hh < L.per; ++hh)
        std::memcpy(rec + L.code_bytes + 4 * (hh * GROUP + j), &scale[n * scales_per_row + b * L.per + hh], 4);
      rec[L.sexp_at + j] = static_cast<uint8_t>(static_cast<int8_t>(scale_exp[nb] - t));
      if (kd.has_min) {
        std::memcpy(rec + L.min_at + 4 * j, &min[nb], 4);
        rec[L.mexp_at + j] = static_cast<uint8_t>(static_cast<int8_t>(min_exp[nb] - t));
      }
    }
  }
}

}  // namespace

// The form a weight packs in: SUPER for q4_k, q5_k and q6_k whose scales factor as their file's do,
// F16 for the 32-weight types with float16 scales, else WIDE.
int quant_pack_form(int kind, const int32_t* scale, const int32_t* scale_exp, const int32_t* min,
                    const int32_t* min_exp, int64_t N, int64_t K, int threads) {
  if (f16_scales(kind, scale, scale_exp, min, min_exp, N, K)) return F16;
  if ((kind != Q4K && kind != Q5K && kind != Q6K) || K % (BLOCK * SUPER_BLOCKS) != 0) return WIDE;
  const int64_t per_row = K / (BLOCK * SUPER_BLOCKS);
  int factors = 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && N * per_row >= 4096) reduction(&& : factors)
  for (int64_t n = 0; n < N; ++n) {
    SuperScales s;
    for (int64_t sb = 0; sb < per_row && factors; ++sb)
      factors = factors && super_scales_of(kind, scale, scale_exp, min, min_exp, n, sb, K, &s);
  }
  return factors ? SUPER : WIDE;
}

int64_t quant_packed_bytes(int kind, int form, int64_t N, int64_t K) { return Layout(kind, form, N, K).total; }

void pack_quant(int kind, int form, const int8_t* codes, const int32_t* scale, const int32_t* scale_exp,
                const int32_t* min, const int32_t* min_exp, uint8_t* packed, int64_t N, int64_t K, int threads) {
  const Layout L(kind, form, N, K);
  const QKind& kd = L.kind;
  const Header h{MAGIC, kind, N, K, form};
  std::memset(packed, 0, 64);
  std::memcpy(packed, &h, sizeof(h));
  int32_t* top = reinterpret_cast<int32_t*>(packed + L.top);
  int32_t* lows = reinterpret_cast<int32_t*>(packed + L.lows);
  const int64_t scales_per_row = K / kd.sub, group_bytes = L.blocks * L.record;
  // the alignment padding after the records, the tops and the lows
  std::memset(packed + 64 + L.groups * group_bytes, 0, L.top - 64 - L.groups * group_bytes);
  std::memset(packed + L.top + L.groups * GROUP * 4, 0, L.lows - L.top - L.groups * GROUP * 4);
  std::memset(packed + L.lows + L.groups * 2 * 4, 0, L.total - L.lows - L.groups * 2 * 4);
  // Groups in parallel, each writing its own records (zeroed first: codes are or-ed in, and the
  // padding columns stay zero), column tops and lows.
#pragma omp parallel for schedule(dynamic, 4) num_threads(threads) if (threads > 1 && L.groups > 1)
  for (int64_t g = 0; g < L.groups; ++g) {
    std::memset(packed + 64 + g * group_bytes, 0, group_bytes);
    int32_t low[2] = {1 << 20, 1 << 20};
    for (int j = 0; j < GROUP; ++j) {
      const int64_t n = g * GROUP + j;
      top[n] = 0;
      if (n >= N) continue;
      int t = -(1 << 20);
      for (int64_t b = 0; b < L.blocks; ++b) {
        t = std::max(t, scale_exp[n * L.blocks + b]);
        if (kd.has_min) t = std::max(t, min_exp[n * L.blocks + b]);
      }
      top[n] = t;
      for (int64_t b = 0; b < L.blocks; ++b) {  // a zero scale's or minimum's terms are 0 at any shift
        bool any = false;
        for (int64_t hh = 0; hh < L.per; ++hh) any = any || scale[n * scales_per_row + b * L.per + hh] != 0;
        if (any) low[0] = std::min(low[0], scale_exp[n * L.blocks + b] - t);
        if (kd.has_min && min[n * L.blocks + b] != 0) low[1] = std::min(low[1], min_exp[n * L.blocks + b] - t);
      }
      pack_column(L, kind, codes, scale, scale_exp, min, min_exp, packed, n, K, t);
    }
    for (int i = 0; i < 2; ++i) lows[2 * g + i] = low[i] == 1 << 20 ? 0 : low[i];
  }
}

bool quant_packed_matches(const uint8_t* packed, int64_t bytes, int64_t N, int64_t K) {
  if (bytes < static_cast<int64_t>(sizeof(Header))) return false;
  const Header* h = reinterpret_cast<const Header*>(packed);
  const bool form_ok = h->form == WIDE || h->form == F16 ||
                       (h->form == SUPER && (h->kind == Q4K || h->kind == Q5K || h->kind == Q6K) && K % (BLOCK * SUPER_BLOCKS) == 0);
  return h->magic == MAGIC && h->N == N && h->K == K && h->kind >= 0 && h->kind < NUM_KINDS && form_ok &&
         bytes == Layout(static_cast<int>(h->kind), static_cast<int>(h->form), N, K).total;
}

}  // namespace tf

namespace tf {

// ---- Packing straight from a GGUF's block bytes ------------------------------------------------
//
// pack_quant_file writes the bytes pack_quant(quant_weight(raw)) writes, from the file's blocks
// (gguf_quants.py's layouts) without widening them: for each group of 16 rows, (1) pread the rows'
// bytes into a buffer of the thread's, (2) per row decode every block's float16 scales to their
// significands and exponents (the column's top and the group's lows, as pack_quant finds them),
// (3) per block re-lay the codes u = c + offset into the record (4-bit codes: the file's q4_0 /
// q4_1 bytes are already quad q's nibbles low and quad q + 4's high), (4) write the scales in the
// form a file's blocks always pack in: F16 for q8_0 / q4_0 / q4_1 (the file's float16 bits, a
// -0 as +0), SUPER for q4_k / q5_k / q6_k (the super-block's d, dmin and sub-block scales,
// factored from S = dm sc exactly as pack_quant factors them: the file's own bytes whenever d > 0
// and the sub-block scales have gcd 1, the common case, else factor_scales' pick).
// Q5_1's blocks (kind q5_1) are not read here: they take pack_quant's route (module.cpp refuses).
namespace {

using namespace quant;

struct FileKind {
  int weights, bytes;  // per block in the file
};
constexpr FileKind FILE_KINDS[] = {{32, 34}, {32, 18}, {32, 20}, {256, 144}, {256, 176}, {256, 210}};

inline uint16_t load16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline bool finite16(uint16_t bits) { return ((bits >> 10) & 0x1F) != 0x1F; }

int small_gcd(const int32_t* v, int n) {
  int g = 0;
  for (int i = 0; i < n && g != 1; ++i) g = std::gcd(g, v[i] < 0 ? -v[i] : v[i]);
  return g;
}

// q4_k / q5_k's 12 scale bytes -> sc[8], m[8] (gguf_quants._k_scales).
inline void file_k_scales(const uint8_t* s, int32_t* sc, int32_t* m) {
  for (int i = 0; i < 8; ++i) unpack_k_scale([&](int t) { return static_cast<int32_t>(s[t]); }, i, &sc[i], &m[i]);
}

// The codes u of block b (32 weights) of a row whose file bytes start at `row`.
inline void file_codes(int kind, const uint8_t* row, int64_t b, uint8_t* u) {
  switch (kind) {
    case 0: {  // q8_0: c = q, u = c + 128
      const uint8_t* q = row + b * 34 + 2;
      for (int k = 0; k < BLOCK; ++k) u[k] = static_cast<uint8_t>(q[k] ^ 0x80);
      return;
    }
    case 4: {  // q5_k: the nibble of sub-block b, the fifth bit from qh
      const uint8_t* sb = row + (b / 8) * 176;
      const uint8_t* qs = sb + 48 + 32 * ((b % 8) / 2);
      const int shift = 4 * (b % 2), bit = b % 8;
      for (int k = 0; k < BLOCK; ++k)
        u[k] = static_cast<uint8_t>(((qs[k] >> shift) & 15) | (((sb[16 + k] >> bit) & 1) << 4));
      return;
    }
    case 5: {  // q6_k: half h, quarter r: low nibble s of ql, top two bits r of qh
      const uint8_t* sb = row + (b / 8) * 210;
      const int h = static_cast<int>((b % 8) / 4), r = static_cast<int>(b % 4);
      const uint8_t* ql = sb + 64 * h + 32 * (r % 2);
      const uint8_t* qh = sb + 128 + 32 * h;
      const int shift = 4 * (r / 2);
      for (int k = 0; k < BLOCK; ++k)
        u[k] = static_cast<uint8_t>(((ql[k] >> shift) & 15) | (((qh[k] >> (2 * r)) & 3) << 4));
      return;
    }
    default: {  // q4_k: sub-block b's nibbles (q4_0 / q4_1 are copied as bytes: never here)
      const uint8_t* qs = row + (b / 8) * 144 + 16 + 32 * ((b % 8) / 2);
      const int shift = 4 * (b % 2);
      for (int k = 0; k < BLOCK; ++k) u[k] = static_cast<uint8_t>((qs[k] >> shift) & 15);
    }
  }
}

// Block b's codes of column j into its record (pack_column's placement).
inline void write_codes(const Layout& L, int kind, const uint8_t* u, uint8_t* rec, int j) {
  const bool nibbles = L.kind.nibbles || L.form == SUPER;
  if (!nibbles) {
    for (int q = 0; q < 8; ++q) std::memcpy(rec + code_index(false, j, 4 * q), u + 4 * q, 4);
    return;
  }
  uint8_t bytes[16];
  for (int x = 0; x < 16; ++x) bytes[x] = static_cast<uint8_t>((u[x] & 15) | ((u[x + 16] & 15) << 4));
  for (int q = 0; q < 4; ++q) std::memcpy(rec + code_index(true, j, 4 * q), bytes + 4 * q, 4);
  if (kind == Q6K) {
    for (int row = 0; row < 2; ++row) {
      uint8_t bits[4] = {};
      for (int q = 4 * row; q < 4 * row + 4; ++q)
        for (int i = 0; i < 4; ++i) bits[i] |= static_cast<uint8_t>((u[4 * q + i] >> 4) << (2 * (q % 4)));
      std::memcpy(rec + L.code_bytes + row * 64 + j * 4, bits, 4);
    }
  }
  if (kind == Q5K) write_fifth_bits(u, rec + L.code_bytes + j * 4);
}

// v = dm f (f in [lo, hi]) as factor_scales would factor it: (dm, f) themselves where dm > 0 and
// gcd(f) = 1 (then its first candidate, t = 1, is exactly that), else factor_scales' answer.
bool canonical_factors(int32_t dm, const int32_t* f_in, int n, int e, int lo, int hi, int32_t* dm_out,
                       int32_t* f_out) {
  if (dm > 0 && small_gcd(f_in, n) == 1) {
    *dm_out = dm;
    std::copy_n(f_in, n, f_out);
    return true;
  }
  int32_t v[16];
  for (int i = 0; i < n; ++i) v[i] = dm * f_in[i];
  return factor_scales(v, n, e, lo, hi, dm_out, f_out);
}

// Row n's (column j's) scales of every block into the group's records, and its top and lows.
// Returns false on an infinite or NaN scale.
bool file_column_scales(const Layout& L, int kind, const uint8_t* row, uint8_t* packed, int64_t g, int j,
                        int32_t* top, int32_t* low) {
  const int64_t blocks = L.blocks;
  if (kind <= 2) {  // F16: one d (and q4_1's m) per block
    const int stride = FILE_KINDS[kind].bytes;
    int t = -(1 << 20);
    for (int64_t b = 0; b < blocks; ++b) {
      const uint16_t d = load16(row + b * stride);
      if (!finite16(d)) return false;
      int32_t dm, de;
      significand16(d, &dm, &de);
      t = std::max(t, de);
      if (kind == 2) {
        const uint16_t m = load16(row + b * stride + 2);
        if (!finite16(m)) return false;
        int32_t mm, me;
        significand16(m, &mm, &me);
        t = std::max(t, me);
      }
    }
    *top = t;
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* rec = const_cast<uint8_t*>(record_at(packed, L, g, b));
      int32_t dm, de;
      significand16(load16(row + b * stride), &dm, &de);
      const uint16_t bits = static_cast<uint16_t>(float16_bits(dm, de));  // -0 -> +0
      std::memcpy(rec + L.code_bytes + 2 * j, &bits, 2);
      if (dm != 0) low[0] = std::min(low[0], de - t);
      if (kind == 2) {
        int32_t mm, me;
        significand16(load16(row + b * stride + 2), &mm, &me);
        const uint16_t mbits = static_cast<uint16_t>(float16_bits(mm, me));
        std::memcpy(rec + L.min_at + 2 * j, &mbits, 2);
        if (mm != 0) low[1] = std::min(low[1], me - t);
      }
    }
    return true;
  }
  // K-quants: per super-block d (and dmin), sub-block scales
  const int stride = FILE_KINDS[kind].bytes;
  const int64_t supers = blocks / SUPER_BLOCKS;
  const int d_at = kind == Q6K ? 208 : 0;
  int t = -(1 << 20);
  for (int64_t s = 0; s < supers; ++s) {
    const uint16_t d = load16(row + s * stride + d_at);
    if (!finite16(d)) return false;
    int32_t dm, de;
    significand16(d, &dm, &de);
    t = std::max(t, de);
    if (kind != Q6K) {
      const uint16_t dmin = load16(row + s * stride + 2);
      if (!finite16(dmin)) return false;
      int32_t mm, me;
      significand16(dmin, &mm, &me);
      t = std::max(t, me);
    }
  }
  *top = t;
  for (int64_t s = 0; s < supers; ++s) {
    const uint8_t* sb = row + s * stride;
    int32_t dm, de, mm = 0, me = 0;
    significand16(load16(sb + d_at), &dm, &de);
    int32_t sc[16], m[8];
    if (kind == Q6K) {
      for (int i = 0; i < 16; ++i) sc[i] = static_cast<int8_t>(sb[192 + i]);
    } else {
      significand16(load16(sb + 2), &mm, &me);
      file_k_scales(sb + 4, sc, m);
    }
    for (int i = 0; i < SUPER_BLOCKS; ++i) {  // pack_quant's lows: a zero S or M has no shift
      const bool any = kind == Q6K ? (dm * sc[2 * i] != 0 || dm * sc[2 * i + 1] != 0) : dm * sc[i] != 0;
      if (any) low[0] = std::min(low[0], de - t);
      if (kind != Q6K && mm * m[i] != 0) low[1] = std::min(low[1], me - t);
    }
    if (L.form == SUPER) {
      SuperScales out;
      int32_t dm2;
      if (kind == Q6K) {
        if (!canonical_factors(dm, sc, 16, de, -128, 127, &dm2, out.sc)) return false;
        out.d = static_cast<uint16_t>(float16_bits(dm2, de));
      } else {
        if (!canonical_factors(dm, sc, 8, de, 0, 63, &dm2, out.sc)) return false;
        out.d = static_cast<uint16_t>(float16_bits(dm2, de));
        int32_t neg, negm[8];  // M = -(mm m): factor -mm m as factor_scales would
        for (int i = 0; i < 8; ++i) negm[i] = -m[i];
        int32_t v[8];
        if (mm > 0 && small_gcd(m, 8) == 1) {  // factor_scales: t = 1 fails its sign, -mm with m succeeds
          neg = -mm;
          std::copy_n(m, 8, out.m);
        } else {
          for (int i = 0; i < 8; ++i) v[i] = mm * negm[i];
          if (!factor_scales(v, 8, me, 0, 63, &neg, out.m)) return false;
        }
        if (float16_bits(-neg, me) < 0) return false;
        out.dmin = static_cast<uint16_t>(float16_bits(-neg, me));
      }
      uint8_t* rec = const_cast<uint8_t*>(record_at(packed, L, g, s * SUPER_BLOCKS));
      write_super_head(kind, out, j, const_cast<uint8_t*>(super_head(rec, L, s * SUPER_BLOCKS)));
    } else {  // WIDE (no file kind packs so now): S = dm sc, E - top, M = -(mm m), F - top per block
      for (int i = 0; i < SUPER_BLOCKS; ++i) {
        uint8_t* rec = const_cast<uint8_t*>(record_at(packed, L, g, s * SUPER_BLOCKS + i));
        const int32_t S = dm * sc[i], M = -(mm * m[i]);
        std::memcpy(rec + L.code_bytes + 4 * j, &S, 4);
        rec[L.sexp_at + j] = static_cast<uint8_t>(static_cast<int8_t>(de - t));
        std::memcpy(rec + L.min_at + 4 * j, &M, 4);
        rec[L.mexp_at + j] = static_cast<uint8_t>(static_cast<int8_t>(me - t));
      }
    }
  }
  return true;
}

}  // namespace

int quant_file_form(int kind) { return kind <= 2 ? F16 : (kind == Q4K || kind == Q5K || kind == Q6K) ? SUPER : WIDE; }

int64_t quant_file_row_bytes(int kind, int64_t K) { return K / FILE_KINDS[kind].weights * FILE_KINDS[kind].bytes; }

std::string pack_quant_file(int kind, int fd, const int64_t* row_offsets, int64_t N, int64_t K, uint8_t* packed,
                            int threads) {
  const Layout L(kind, quant_file_form(kind), N, K);
  const int64_t row_bytes = quant_file_row_bytes(kind, K), group_bytes = L.blocks * L.record;
  const Header h{MAGIC, kind, N, K, L.form};
  std::memset(packed, 0, 64);
  std::memcpy(packed, &h, sizeof(h));
  int32_t* top = reinterpret_cast<int32_t*>(packed + L.top);
  int32_t* lows = reinterpret_cast<int32_t*>(packed + L.lows);
  std::memset(packed + 64 + L.groups * group_bytes, 0, L.top - 64 - L.groups * group_bytes);
  std::memset(packed + L.top + L.groups * GROUP * 4, 0, L.lows - L.top - L.groups * GROUP * 4);
  std::memset(packed + L.lows + L.groups * 2 * 4, 0, L.total - L.lows - L.groups * 2 * 4);
  std::string error;
  // Groups in parallel as pack_quant runs them; each thread reads its group's 16 rows itself.
#pragma omp parallel num_threads(threads) if (threads > 1 && L.groups > 1)
  {
    std::vector<uint8_t> buffer(GROUP * row_bytes);
#pragma omp for schedule(dynamic, 4)
    for (int64_t g = 0; g < L.groups; ++g) {
      std::string failed;
      // (1) the group's rows, one pread per run of rows that follow each other in the file
      const int64_t first = g * GROUP, count = std::min<int64_t>(GROUP, N - first);
      for (int64_t done = 0; done < count && failed.empty();) {
        int64_t run = 1;
        while (done + run < count && row_offsets[first + done + run] == row_offsets[first + done] + run * row_bytes)
          ++run;
        const int64_t want = run * row_bytes;
        int64_t got = 0;
        while (got < want) {
          const ssize_t r = pread(fd, buffer.data() + done * row_bytes + got, want - got,
                                  row_offsets[first + done] + got);
          if (r <= 0) break;
          got += r;
        }
        if (got < want)
          failed = "is cut short (a read came back with " + std::to_string(got) + " of " + std::to_string(want) +
                   " bytes)";
        done += run;
      }
      if (count < GROUP) std::memset(packed + 64 + g * group_bytes, 0, group_bytes);  // else every byte is written
      int32_t low[2] = {1 << 20, 1 << 20};
      for (int j = 0; j < GROUP && failed.empty(); ++j) {
        top[first + j] = 0;
        if (j >= count) continue;
        const uint8_t* row = buffer.data() + j * row_bytes;
        // (2) the scales, (3) the codes
        if (!file_column_scales(L, kind, row, packed, g, j, &top[first + j], low)) {
          failed = "has an infinite or NaN block scale";
          break;
        }
        for (int64_t b = 0; b < L.blocks; ++b) {
          uint8_t* rec = const_cast<uint8_t*>(record_at(packed, L, g, b));
          if (kind == 1 || kind == 2) {  // the file's 16 bytes are the packed nibbles already
            const uint8_t* qs = row + b * FILE_KINDS[kind].bytes + (kind == 1 ? 2 : 4);
            for (int q = 0; q < 4; ++q) std::memcpy(rec + code_index(true, j, 4 * q), qs + 4 * q, 4);
            continue;
          }
          uint8_t u[BLOCK];
          file_codes(kind, row, b, u);
          write_codes(L, kind, u, rec, j);
        }
      }
      for (int i = 0; i < 2; ++i) lows[2 * g + i] = low[i] == 1 << 20 ? 0 : low[i];
      if (!failed.empty()) {
#pragma omp critical(pack_quant_file)
        if (error.empty()) error = failed;
      }
    }
  }
  return error;
}

}  // namespace tf
