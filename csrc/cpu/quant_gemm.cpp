// The exact quantized GEMM: kernels/quant_gemm.py's steps, bitwise its torch reference.
//
// Weights are packed once (pack_quant) from the reference's form (signed codes c, integer scales
// S with exponents E, optional minimums M 2^F) into column groups of 16: per group and block of
// 32, the codes as unsigned bytes u = c + offset (4-bit types two to a byte), then S, E - top,
// M, F - top for the 16 columns. Activations are quantized per row and block to int8 against a
// power of two. A block's dot is an integer (sum u xq - offset sum xq); each term an integer
// times a power of two, shifted onto the output's grid and summed in int64. Integer arithmetic
// throughout, so threads, tiling and the other rows cannot change a bit.
//
// With AVX-512 VNNI the block dots of 16 columns are 8 vpdpbusd (u8 x s8 -> int32), and the
// terms are shifted in int64 lanes; elsewhere plain C++ over the same layout.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "exact.h"
#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define TF_QUANT_VNNI 1
#endif

namespace tf {
namespace {

constexpr int BLOCK = 32;
constexpr int GROUP = 16;     // columns per packed group (one zmm of int32)
constexpr int X_BITS = 7;     // |xq| < 2^7
constexpr int64_t MAGIC = 0x544651554e540001;  // "TFQUNT" v1

struct QKind {
  int sub;         // weights per scale S
  int term_bits;   // T
  bool has_min;
  int offset;      // u = c + offset is a byte
  bool nibbles;    // u < 16: two codes to a byte
};
// In quant_gemm.KINDS order: q8_0, q4_0, q4_1, q4_k, q5_k, q6_k.
constexpr QKind KINDS[] = {{32, 31, false, 128, false}, {32, 31, false, 8, true}, {32, 31, true, 0, true},
                           {32, 33, true, 0, true},     {32, 34, true, 0, false}, {16, 35, false, 32, false}};

inline int64_t align64(int64_t n) { return (n + 63) / 64 * 64; }

// Where each section of a packed weight starts (bytes from the blob's start).
struct Layout {
  QKind kind;
  int64_t groups, blocks, per, code_bytes;  // per: scales per block (32 / sub)
  int64_t codes, scale, sexp, min, mexp, top, total;
  Layout(int kind_id, int64_t N, int64_t K) : kind(KINDS[kind_id]) {
    groups = (N + GROUP - 1) / GROUP;
    blocks = K / BLOCK;
    per = BLOCK / kind.sub;
    code_bytes = kind.nibbles ? GROUP * BLOCK / 2 : GROUP * BLOCK;
    const int64_t gb = groups * blocks;
    codes = 64;
    scale = codes + align64(gb * code_bytes);
    sexp = scale + align64(gb * per * GROUP * 4);
    min = sexp + align64(gb * GROUP);
    mexp = min + (kind.has_min ? align64(gb * GROUP * 4) : 0);
    top = mexp + (kind.has_min ? align64(gb * GROUP) : 0);
    total = top + align64(groups * GROUP * 4);
  }
};

struct Header {
  int64_t magic, kind, N, K;
};

// Where code u of column j (0..15) at k (0..31) of a block sits: quads of 4 consecutive k per
// column, 16 columns to a 64-byte row; 4-bit codes hold quad q + 4 in the high nibble of quad q.
inline int64_t code_index(bool nibbles, int j, int k) {
  const int quad = k / 4, i = k % 4;
  return ((nibbles ? quad % 4 : quad) * GROUP + j) * 4 + i;
}

int log2_ceil(int64_t n) {
  int l = 0;
  while ((int64_t{1} << l) < n) ++l;
  return l;
}

// I 2^shift as an integer: a left shift, or a right shift rounded half to even.
inline int64_t on_grid(int64_t value, int shift, int term_bits) {
  if (shift >= 0) return value << shift;
  const int down = std::min(-shift, term_bits + 1);
  const int64_t floor = value >> down;
  const int64_t rem = value - (floor << down);
  const int64_t half = int64_t{1} << (down - 1);
  return floor + ((rem > half || (rem == half && (floor & 1))) ? 1 : 0);
}

// One row's activations: xq = clamp(round_even(x 2^(6 - e)), -127, 127) per block of 32,
// k - kmax per block (kmax the row's largest k = e - 6), and sums of xq per sub-block.
struct RowQ {
  std::vector<int8_t> xq;
  std::vector<int32_t> kdelta, xsum;
  int kmax = 0;
};

template <typename T>
void quantize_row(const T* x, int64_t blocks, int sub, RowQ* row) {
  const int per = BLOCK / sub;
  row->xq.resize(blocks * BLOCK);
  row->kdelta.resize(blocks);
  row->xsum.resize(blocks * per);
  std::vector<int> k(blocks);
  int kmax = -(1 << 20);
  for (int64_t b = 0; b < blocks; ++b) {
    const T* v = x + b * BLOCK;
    uint32_t top = 0;
    for (int i = 0; i < BLOCK; ++i) top = std::max(top, f32_bits(to_f32(v[i])) & 0x7FFFFFFFu);
    const int e = exponent(f32_from_bits(top));
    const double scale = pow2(X_BITS - 1 - e);
    for (int h = 0; h < per; ++h) {
      int32_t sum = 0;
      for (int i = h * sub; i < (h + 1) * sub; ++i) {
        double r = round_even(static_cast<double>(to_f32(v[i])) * scale);
        r = std::min(127.0, std::max(-127.0, r));
        row->xq[b * BLOCK + i] = static_cast<int8_t>(r);
        sum += static_cast<int32_t>(r);
      }
      row->xsum[b * per + h] = sum;
    }
    k[b] = e - (X_BITS - 1);
    kmax = std::max(kmax, k[b]);
  }
  for (int64_t b = 0; b < blocks; ++b) row->kdelta[b] = std::max(k[b] - kmax, -1000);
  row->kmax = kmax;
}

// The packed sections of one group and block.
struct GroupBlock {
  const uint8_t* codes;
  const int32_t* scale;  // [per][16]
  const int8_t* sexp;    // [16]: E - top
  const int32_t* min;    // [16] or null
  const int8_t* mexp;
};

inline GroupBlock group_block(const uint8_t* packed, const Layout& L, int64_t g, int64_t b) {
  const int64_t gb = g * L.blocks + b;
  GroupBlock p;
  p.codes = packed + L.codes + gb * L.code_bytes;
  p.scale = reinterpret_cast<const int32_t*>(packed + L.scale) + gb * L.per * GROUP;
  p.sexp = reinterpret_cast<const int8_t*>(packed + L.sexp) + gb * GROUP;
  p.min = L.kind.has_min ? reinterpret_cast<const int32_t*>(packed + L.min) + gb * GROUP : nullptr;
  p.mexp = L.kind.has_min ? reinterpret_cast<const int8_t*>(packed + L.mexp) + gb * GROUP : nullptr;
  return p;
}

// Rows [r0, r1) of the output against column group g, in plain C++: acc[r][j] the int64 sums.
[[maybe_unused]] void group_scalar(const Layout& L, const uint8_t* packed, const RowQ* rows, int64_t r0, int64_t r1, int64_t g,
                  int shift0, int64_t* acc) {
  const QKind& kd = L.kind;
  for (int64_t r = r0; r < r1; ++r) {
    const RowQ& row = rows[r];
    int64_t* a = acc + (r - r0) * GROUP;
    for (int j = 0; j < GROUP; ++j) a[j] = 0;
    for (int64_t b = 0; b < L.blocks; ++b) {
      const GroupBlock p = group_block(packed, L, g, b);
      const int8_t* xq = row.xq.data() + b * BLOCK;
      const int kd_b = row.kdelta[b] + shift0;
      for (int j = 0; j < GROUP; ++j) {
        int64_t term = 0;
        for (int h = 0; h < L.per; ++h) {
          int32_t dot = 0;
          for (int k = h * kd.sub; k < (h + 1) * kd.sub; ++k) {
            const uint8_t byte = p.codes[code_index(kd.nibbles, j, k)];
            const int u = kd.nibbles ? (k / 4 >= 4 ? byte >> 4 : byte & 0x0F) : byte;
            dot += u * static_cast<int32_t>(xq[k]);
          }
          dot -= kd.offset * row.xsum[b * L.per + h];
          term += static_cast<int64_t>(p.scale[h * GROUP + j]) * dot;
        }
        a[j] += on_grid(term, p.sexp[j] + kd_b, kd.term_bits);
        if (p.min != nullptr) {
          const int64_t xsum = L.per == 1 ? row.xsum[b] : row.xsum[2 * b] + row.xsum[2 * b + 1];
          a[j] += on_grid(static_cast<int64_t>(p.min[j]) * xsum, p.mexp[j] + kd_b, kd.term_bits);
        }
      }
    }
  }
}

#if defined(TF_QUANT_VNNI)
// The same with 16 columns to a register. Terms whose shift is negative (rare: a block far below
// the row's largest) are added by on_grid, lane by lane, after the vector shift added nothing
// for them (vpsllvq by a negative count gives 0).
inline void add_terms(__m512i* lo, __m512i* hi, __m512i ilo, __m512i ihi, __m512i shift, int term_bits) {
  *lo = _mm512_add_epi64(*lo, _mm512_sllv_epi64(ilo, _mm512_cvtepi32_epi64(_mm512_castsi512_si256(shift))));
  *hi = _mm512_add_epi64(*hi, _mm512_sllv_epi64(ihi, _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(shift, 1))));
  const __mmask16 negative = _mm512_cmplt_epi32_mask(shift, _mm512_setzero_si512());
  if (negative == 0) return;
  alignas(64) int64_t ints[16], fix[16];
  alignas(64) int32_t shifts[16];
  _mm512_store_si512(ints, ilo);
  _mm512_store_si512(ints + 8, ihi);
  _mm512_store_si512(shifts, shift);
  for (int j = 0; j < 16; ++j)
    fix[j] = (negative >> j & 1) && ints[j] != 0 ? on_grid(ints[j], shifts[j], term_bits) : 0;
  *lo = _mm512_add_epi64(*lo, _mm512_load_si512(fix));
  *hi = _mm512_add_epi64(*hi, _mm512_load_si512(fix + 8));
}

inline __m512i widen_lo(__m512i v) { return _mm512_cvtepi32_epi64(_mm512_castsi512_si256(v)); }
inline __m512i widen_hi(__m512i v) { return _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(v, 1)); }

// R rows at once against group g: the codes are unpacked once per block and serve every row.
template <int R>
void group_vnni(const Layout& L, const uint8_t* packed, const RowQ* rows, int64_t r0, int64_t g, int shift0,
                int64_t* acc) {
  const QKind& kd = L.kind;
  __m512i lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
  const __m512i nib = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < L.blocks; ++b) {
    const GroupBlock p = group_block(packed, L, g, b);
    __m512i u[8];
    if (kd.nibbles) {
      for (int q = 0; q < 4; ++q) {
        const __m512i v = _mm512_loadu_si512(p.codes + q * 64);
        u[q] = _mm512_and_si512(v, nib);
        u[q + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
      }
    } else {
      for (int q = 0; q < 8; ++q) u[q] = _mm512_loadu_si512(p.codes + q * 64);
    }
    const __m512i s0 = _mm512_loadu_si512(p.scale);
    const __m512i s0lo = widen_lo(s0), s0hi = widen_hi(s0);
    __m512i s1lo = s0lo, s1hi = s0hi;
    if (L.per == 2) {
      const __m512i s1 = _mm512_loadu_si512(p.scale + GROUP);
      s1lo = widen_lo(s1);
      s1hi = widen_hi(s1);
    }
    const __m512i sexp = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.sexp)));
    __m512i mlo = _mm512_setzero_si512(), mhi = mlo, mexp = mlo;
    if (p.min != nullptr) {
      const __m512i mv = _mm512_loadu_si512(p.min);
      mlo = widen_lo(mv);
      mhi = widen_hi(mv);
      mexp = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p.mexp)));
    }
    for (int r = 0; r < R; ++r) {
      const RowQ& row = rows[r0 + r];
      const int32_t* xq = reinterpret_cast<const int32_t*>(row.xq.data() + b * BLOCK);
      const int32_t* xsum = row.xsum.data() + b * L.per;
      const __m512i kshift = _mm512_set1_epi32(row.kdelta[b] + shift0);
      __m512i ilo, ihi;
      if (L.per == 1) {
        __m512i dot = _mm512_setzero_si512();
        for (int q = 0; q < 8; ++q) dot = _mm512_dpbusd_epi32(dot, u[q], _mm512_set1_epi32(xq[q]));
        if (kd.offset) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(kd.offset * xsum[0]));
        ilo = _mm512_mul_epi32(widen_lo(dot), s0lo);
        ihi = _mm512_mul_epi32(widen_hi(dot), s0hi);
      } else {
        __m512i d0 = _mm512_setzero_si512(), d1 = d0;
        for (int q = 0; q < 4; ++q) d0 = _mm512_dpbusd_epi32(d0, u[q], _mm512_set1_epi32(xq[q]));
        for (int q = 4; q < 8; ++q) d1 = _mm512_dpbusd_epi32(d1, u[q], _mm512_set1_epi32(xq[q]));
        d0 = _mm512_sub_epi32(d0, _mm512_set1_epi32(kd.offset * xsum[0]));
        d1 = _mm512_sub_epi32(d1, _mm512_set1_epi32(kd.offset * xsum[1]));
        ilo = _mm512_add_epi64(_mm512_mul_epi32(widen_lo(d0), s0lo), _mm512_mul_epi32(widen_lo(d1), s1lo));
        ihi = _mm512_add_epi64(_mm512_mul_epi32(widen_hi(d0), s0hi), _mm512_mul_epi32(widen_hi(d1), s1hi));
      }
      add_terms(&lo[r], &hi[r], ilo, ihi, _mm512_add_epi32(sexp, kshift), kd.term_bits);
      if (p.min != nullptr) {
        const __m512i xs = _mm512_set1_epi64(L.per == 1 ? xsum[0] : xsum[0] + xsum[1]);
        add_terms(&lo[r], &hi[r], _mm512_mul_epi32(mlo, xs), _mm512_mul_epi32(mhi, xs),
                  _mm512_add_epi32(mexp, kshift), kd.term_bits);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_si512(acc + r * GROUP, lo[r]);
    _mm512_storeu_si512(acc + r * GROUP + 8, hi[r]);
  }
}
#endif

constexpr int ROW_TILE = 4;

// Rows [r0, r1) against group g into acc [r1 - r0][16].
void group_rows(const Layout& L, const uint8_t* packed, const RowQ* rows, int64_t r0, int64_t r1, int64_t g,
                int shift0, int64_t* acc) {
#if defined(TF_QUANT_VNNI)
  int64_t r = r0;
  for (; r + ROW_TILE <= r1; r += ROW_TILE) group_vnni<ROW_TILE>(L, packed, rows, r, g, shift0, acc + (r - r0) * GROUP);
  switch (r1 - r) {
    case 3: group_vnni<3>(L, packed, rows, r, g, shift0, acc + (r - r0) * GROUP); break;
    case 2: group_vnni<2>(L, packed, rows, r, g, shift0, acc + (r - r0) * GROUP); break;
    case 1: group_vnni<1>(L, packed, rows, r, g, shift0, acc + (r - r0) * GROUP); break;
    default: break;
  }
#else
  group_scalar(L, packed, rows, r0, r1, g, shift0, acc);
#endif
}

template <typename T>
void quant_linear_impl(const T* x, const uint8_t* packed, T* out, int64_t M, int64_t N, int64_t K, int threads) {
  const Header* h = reinterpret_cast<const Header*>(packed);
  const Layout L(static_cast<int>(h->kind), N, K);
  const QKind& kd = L.kind;
  std::vector<RowQ> rows(M);
  for (int64_t r = 0; r < M; ++r) quantize_row(x + r * K, L.blocks, kd.sub, &rows[r]);
  const int log_terms = log2_ceil(L.blocks * (kd.has_min ? 2 : 1));
  const int shift0 = 62 - log_terms - kd.term_bits;  // a term's shift: (E - top) + (k - kmax) + shift0
  const int32_t* top = reinterpret_cast<const int32_t*>(packed + L.top);
  constexpr int64_t ROWS_PER_PASS = 64;  // rows whose activations stay in cache while a group runs
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && L.groups > 1)
  for (int64_t g = 0; g < L.groups; ++g) {
    int64_t acc[ROWS_PER_PASS * GROUP];
    const int64_t cols = std::min<int64_t>(GROUP, N - g * GROUP);
    for (int64_t r0 = 0; r0 < M; r0 += ROWS_PER_PASS) {
      const int64_t r1 = std::min(M, r0 + ROWS_PER_PASS);
      group_rows(L, packed, rows.data(), r0, r1, g, shift0, acc);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t j = 0; j < cols; ++j) {
          const int grid = top[g * GROUP + j] + rows[r].kmax + kd.term_bits - 62 + log_terms;
          const double y = static_cast<double>(acc[(r - r0) * GROUP + j]) * pow2(grid);
          out[r * N + g * GROUP + j] = from_f32<T>(static_cast<float>(y));
        }
    }
  }
}

}  // namespace

int64_t quant_packed_bytes(int kind, int64_t N, int64_t K) { return Layout(kind, N, K).total; }

void pack_quant(int kind, const int8_t* codes, const int32_t* scale, const int32_t* scale_exp, const int32_t* min,
                const int32_t* min_exp, uint8_t* packed, int64_t N, int64_t K) {
  const Layout L(kind, N, K);
  const QKind& kd = L.kind;
  std::memset(packed, 0, L.total);
  const Header h{MAGIC, kind, N, K};
  std::memcpy(packed, &h, sizeof(h));
  int32_t* top = reinterpret_cast<int32_t*>(packed + L.top);
  const int64_t scales_per_row = K / kd.sub;
  for (int64_t n = 0; n < N; ++n) {
    int t = -(1 << 20);
    for (int64_t b = 0; b < L.blocks; ++b) {
      t = std::max(t, scale_exp[n * L.blocks + b]);
      if (kd.has_min) t = std::max(t, min_exp[n * L.blocks + b]);
    }
    top[n] = t;
    const int64_t g = n / GROUP;
    const int j = static_cast<int>(n % GROUP);
    for (int64_t b = 0; b < L.blocks; ++b) {
      const int64_t gb = g * L.blocks + b;
      uint8_t* c = packed + L.codes + gb * L.code_bytes;
      for (int k = 0; k < BLOCK; ++k) {
        const uint8_t u = static_cast<uint8_t>(codes[n * K + b * BLOCK + k] + kd.offset);
        const int64_t at = code_index(kd.nibbles, j, k);
        c[at] |= kd.nibbles && k / 4 >= 4 ? static_cast<uint8_t>(u << 4) : u;
      }
      int32_t* s = reinterpret_cast<int32_t*>(packed + L.scale) + gb * L.per * GROUP;
      for (int hh = 0; hh < L.per; ++hh) s[hh * GROUP + j] = scale[n * scales_per_row + b * L.per + hh];
      reinterpret_cast<int8_t*>(packed + L.sexp)[gb * GROUP + j] = static_cast<int8_t>(scale_exp[n * L.blocks + b] - t);
      if (kd.has_min) {
        reinterpret_cast<int32_t*>(packed + L.min)[gb * GROUP + j] = min[n * L.blocks + b];
        reinterpret_cast<int8_t*>(packed + L.mexp)[gb * GROUP + j] = static_cast<int8_t>(min_exp[n * L.blocks + b] - t);
      }
    }
  }
}

bool quant_packed_matches(const uint8_t* packed, int64_t bytes, int64_t N, int64_t K) {
  if (bytes < static_cast<int64_t>(sizeof(Header))) return false;
  const Header* h = reinterpret_cast<const Header*>(packed);
  return h->magic == MAGIC && h->N == N && h->K == K && h->kind >= 0 && h->kind < 6 &&
         bytes == quant_packed_bytes(static_cast<int>(h->kind), N, K);
}

void quant_linear(int dtype, const void* x, const uint8_t* packed, void* out, int64_t M, int64_t N, int64_t K,
                  int threads) {
  if (dtype == 0)
    quant_linear_impl(static_cast<const float*>(x), packed, static_cast<float*>(out), M, N, K, threads);
  else
    quant_linear_impl(static_cast<const bf16*>(x), packed, static_cast<bf16*>(out), M, N, K, threads);
}

}  // namespace tf
