// Packing a QuantWeight (the reference's codes, scales and exponents) into quant_gemm.h's layout,
// once at load: the form that keeps the file's bytes (float16 scales, the K-quants' super-blocks)
// where the scales allow it, else the wide form.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>

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

// The form a weight packs in: SUPER for q4_k and q6_k whose scales factor as their file's do,
// F16 for the 32-weight types with float16 scales, else WIDE.
int quant_pack_form(int kind, const int32_t* scale, const int32_t* scale_exp, const int32_t* min,
                    const int32_t* min_exp, int64_t N, int64_t K, int threads) {
  if (f16_scales(kind, scale, scale_exp, min, min_exp, N, K)) return F16;
  if ((kind != Q4K && kind != Q6K) || K % (BLOCK * SUPER_BLOCKS) != 0) return WIDE;
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
                       (h->form == SUPER && (h->kind == Q4K || h->kind == Q6K) && K % (BLOCK * SUPER_BLOCKS) == 0);
  return h->magic == MAGIC && h->N == N && h->K == K && h->kind >= 0 && h->kind < 6 && form_ok &&
         bytes == Layout(static_cast<int>(h->kind), static_cast<int>(h->form), N, K).total;
}

}  // namespace tf
