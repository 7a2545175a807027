// The exact quantized GEMM: kernels/quant_gemm.py's steps, bitwise its torch reference, on the
// packed weights of quant_gemm.h (packed by quant_pack.cpp).
//
// Activations are quantized per row and group to int8 as llama.cpp's Q8 blocks round them: groups
// of 32 for q8_0, q4_0, q4_1 and q5_1 (Q8_0 / Q8_1), of 256 for the K-quants q4_k, q5_k, q6_k
// (Q8_K). A sub-block's dot is an integer (sum u xq - offset sum xq). The 32-column kinds take a
// dot term (and a minimum term) per block; the K-quants one dot term per super-block of 256, the
// exact sum of its sub-blocks' S A times the group's m, and for q4_k / q5_k one minimum term, the
// exact sum of M times each block's sum of xq, times m. Each term is an integer times a power of
// two, rounded onto the output's grid once and summed in int64. Every sum is exact, so threads,
// tiling and the other rows cannot change a bit.
//
// With AVX-512 VNNI the block dots of 16 columns are 8 vpdpbusd (u8 x s8 -> int32); a K-quant
// super-block's products are summed in int32 (the file's form: sc A with vpmulld, dm applied once)
// or in float64 lanes (the wide form: every product an integer times the super-block's one power
// of two, the sums below 2^53), and each term is rounded to int64 once. AMX-INT8 tiles take the
// dots of 16 rows at a time. With AVX2, vpmaddubsw and vpmaddwd on 8 columns at a time, the
// super-block sums in int64; elsewhere plain C++ over the same layout.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include "exact.h"
#include "kernels.h"
#include "lanes.h"
#include "prefetch.h"
#include "quant_gemm.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define TF_QUANT_VNNI 1
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>
#define TF_QUANT_AMX 1
#endif
#elif defined(__AVX2__)
#include <immintrin.h>
#define TF_QUANT_AVX2 1
#endif

namespace tf {
namespace {

using namespace quant;

// How far ahead of the record in use a group's loop asks for the next ones (about 2 KiB, whole
// records). A thread streams its groups' records front to back, but the hardware prefetcher stops
// at each 4 KiB page: without this, one-stream decode of the default model (dtype auto) ran
// 142-155 tok/s against 206-223 with it, four streams 330-343 against 434-459 (an Intel Xeon).
// Into L1: the L2 hint, which the dense GEMM takes, was slower here (one stream 179-200).
constexpr int64_t PREFETCH_BYTES = 2048;
constexpr float X_MAX = 127.0f;     // |xq| <= 127
constexpr int64_t TILE_ROWS = 16;    // an AMX tile's rows (the activation buffer's slack after the last row)
constexpr int64_t ROWS_PER_PASS = 64;  // rows whose activations stay in cache while a group runs
// The fewest rows of a pass that take the AMX tiles (where they are allowed): fewer rows run on
// VNNI register tiles, which unpack a block once for up to 4 rows without a tile round trip.
// (8192 x 2048 q4_0, one thread: 8 rows 2.24 ms on tiles against 1.61 on VNNI; 16 rows 3.26 against 3.63.)
constexpr int64_t AMX_MIN_ROWS = 16;
constexpr int64_t AMX_BLOCKS = 8;  // blocks whose dots a row tile keeps at once (8 KiB: in L1 till their terms)
static_assert(AMX_BLOCKS == SUPER_BLOCKS, "group_amx's runs are the K-quants' super-blocks");
std::atomic<bool> amx_allowed{true};  // set_quant_amx
// Which GEMM call a thread runs (quant_linears_impl counts them): a column group made ready for
// the AMX tiles serves only its own call, since a later weight may sit where a freed one was.
std::atomic<uint64_t> gemm_calls{0};
thread_local uint64_t current_call = 0;

constexpr float F16_MAX = 65504.0f;  // float16 scales saturate here

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

// float32 -> float16 bits, rounded to nearest even (|f| <= 65504: no overflow).
inline uint16_t float16_from(float f) {
  const uint32_t u = f32_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
  if (a >= 0x38800000u) {  // >= 2^-14: a normal float16
    const uint32_t mant = a & 0x7FFFFFu, rem = mant & 0x1FFFu;
    uint32_t r = ((((a >> 23) - 112u) << 10) | (mant >> 13));
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r += 1;  // a carry moves to the exponent
    return static_cast<uint16_t>(sign | r);
  }
  const double units = round_even(static_cast<double>(f32_from_bits(a)) * pow2(24));  // subnormal: 2^-24 steps
  return static_cast<uint16_t>(sign | static_cast<uint32_t>(units));
}

// One row's activations (quant_gemm.quantize_activations): per group of the kind's act columns
// (32, or 256 for the K-quants), xq int8 as llama.cpp rounds it (float32: d = amax / 127,
// xq = round_even(x (127 / amax))), the group's scale float16(d) = m 2^k with k - kmax kept (kmax
// the row's largest k), the sums of xq per sub-block, and for the 32-column kinds with a minimum
// the minimum term's float16(d sum xq) = sm 2^se per block (se - kmax kept). The K-quants'
// minimum takes the exact block sums of xq instead (xsum: their sub-blocks are the blocks).
struct RowQ {
  int8_t* xq = nullptr;  // blocks * 32 codes, in the batch's buffer: a GEMM's rows K apart (quant_linears_impl)
  std::vector<int32_t> m, kdelta;  // per activation group
  std::vector<int32_t> xsum;       // per sub-block
  std::vector<int32_t> sm, sdelta;  // per block (the 32-column kinds with a minimum)
  std::vector<double> mf, smf;  // m 2^kdelta and sm 2^sdelta (exact), the vector kernels' row factors
  int kmax = 0;
  // the smallest kdelta of the groups whose m is not 0, and the smallest shift of a nonzero
  // minimum term's row factor (sdelta; the K-quants': kdelta), 0 where none
  int kmin = 0, smin = 0;
};

// A block's codes xq = round_even(x inverse) within +-127 (0 for a zero block) and the sums of its
// sub-blocks of `sub`: the product rounded once in float32, then to the nearest integer, ties to
// even; a NaN gives -127 (std::max(-127, NaN) is -127).
template <typename T>
void quantize_block(const T* v, float inverse, bool zero, int sub, int8_t* xq, int32_t* xsum) {
#if defined(__AVX512F__)
  if (sub % 16 == 0) {  // sixteen lanes: vroundscaleps rounds ties to even, vmaxps(r, -127) gives -127 for NaN
    const __m512 inv = _mm512_set1_ps(inverse), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    for (int h = 0; h < BLOCK / sub; ++h) {
      __m512i sum = _mm512_setzero_si512();
      for (int i = h * sub; i < (h + 1) * sub; i += 16) {
        __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(load16(v + i), inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
        const __m512i q = zero ? _mm512_setzero_si512() : _mm512_cvtps_epi32(r);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + i), _mm512_cvtepi32_epi8(q));
        sum = _mm512_add_epi32(sum, q);
      }
      xsum[h] = _mm512_reduce_add_epi32(sum);
    }
    return;
  }
#endif
  for (int h = 0; h < BLOCK / sub; ++h) {
    int32_t sum = 0;
    for (int i = h * sub; i < (h + 1) * sub; ++i) {
      const float scaled = to_f32(v[i]) * inverse;
      double r = zero ? 0.0 : round_even(static_cast<double>(scaled));
      r = std::min(127.0, std::max(-127.0, r));
      xq[i] = static_cast<int8_t>(r);
      sum += static_cast<int32_t>(r);
    }
    xsum[h] = sum;
  }
}

template <typename T>
void quantize_row(const T* x, int64_t blocks, const QKind& kd, RowQ* row) {
  const int per = BLOCK / kd.sub, bpg = kd.act / BLOCK;
  const int64_t groups = blocks / bpg;
  const bool block_min = kd.has_min && bpg == 1;  // Q8_1's float16(d sum xq) per block
  row->m.resize(groups);
  row->kdelta.resize(groups);
  row->mf.resize(groups);
  row->xsum.resize(blocks * per);
  row->sm.resize(block_min ? blocks : 0);
  row->sdelta.resize(block_min ? blocks : 0);
  row->smf.resize(block_min ? blocks : 0);
  int kmax = -(1 << 20);
  for (int64_t gi = 0; gi < groups; ++gi) {
    const T* v = x + gi * kd.act;
    const float amax = max_abs(v, kd.act);
    const bool zero = exponent(amax) < -120;  // below 2^-120 (127 / amax would overflow): a zero group
    const float d = zero ? 0.0f : amax / X_MAX, inverse = zero ? 0.0f : X_MAX / amax;
    for (int i = 0; i < bpg; ++i) {
      const int64_t b = gi * bpg + i;
      quantize_block(v + i * BLOCK, inverse, zero, kd.sub, row->xq + b * BLOCK, row->xsum.data() + b * per);
      if (block_min) {
        int32_t total = 0;
        for (int h = 0; h < per; ++h) total += row->xsum[b * per + h];
        const float s = d * static_cast<float>(total);  // sdelta holds se until kmax is known
        significand16(float16_from(std::min(F16_MAX, std::max(-F16_MAX, s))), &row->sm[b], &row->sdelta[b]);
      }
    }
    // kdelta holds k until kmax is known
    significand16(float16_from(std::min(d, F16_MAX)), &row->m[gi], &row->kdelta[gi]);
    kmax = std::max(kmax, row->kdelta[gi]);
  }
  row->kmin = row->smin = 0;
  for (int64_t gi = 0; gi < groups; ++gi) {
    row->kdelta[gi] = std::max(row->kdelta[gi] - kmax, -1000);
    if (row->m[gi] != 0) row->kmin = std::min(row->kmin, row->kdelta[gi]);
    row->mf[gi] = static_cast<double>(row->m[gi]) * pow2(row->kdelta[gi]);
  }
  if (block_min) {
    for (int64_t b = 0; b < blocks; ++b) {
      row->sdelta[b] = std::max(row->sdelta[b] - kmax, -1000);
      if (row->sm[b] != 0) row->smin = std::min(row->smin, row->sdelta[b]);
      row->smf[b] = static_cast<double>(row->sm[b]) * pow2(row->sdelta[b]);
    }
  } else {
    row->smin = row->kmin;  // the K-quants' minimum terms take the group's m 2^k
  }
  row->kmax = kmax;
}

// How far ahead of record_at a group's first row tile asks for records: PREFETCH_BYTES in whole
// records (past the group's last block, the next group's first, which the task streams next); 0
// (nothing) for the later row tiles, which find the group in cache.
inline int64_t prefetch_distance(const Layout& L, int64_t r0) {
  return r0 == 0 ? (PREFETCH_BYTES + L.record - 1) / L.record * L.record : 0;
}

// Block b of group g's record, asking for the one `ahead` bytes on (none when ahead is 0).
inline const uint8_t* streamed_record(const uint8_t* packed, const Layout& L, int64_t g, int64_t b, int64_t ahead) {
  const uint8_t* rec = record_at(packed, L, g, b);
  if (ahead > 0) prefetch_lines(rec + ahead, L.record);
  return rec;
}

// Rows [r0, r1) of the output against column group g, in plain C++: acc[r][j] the int64 sums.
// The 32-column kinds: a dot term (and a minimum term) per block; the K-quants: per super-block
// the exact int64 sums over its blocks of S A (and of M times the block's sum of xq), then one
// dot term and one minimum term, each times the group's m and rounded onto the grid once.
[[maybe_unused]] void group_scalar(const Layout& L, const uint8_t* packed, const RowQ* rows, int64_t r0,
                                   int64_t r1, int64_t g, int shift0, const int32_t* top, int64_t* acc) {
  const QKind& kd = L.kind;
  const int bpg = kd.act / BLOCK;
  for (int64_t r = r0; r < r1; ++r) {
    const RowQ& row = rows[r];
    int64_t* a = acc + (r - r0) * GROUP;
    for (int j = 0; j < GROUP; ++j) a[j] = 0;
    int64_t dots[GROUP] = {}, mins[GROUP] = {};  // a super-block's sums so far
    int sexp[GROUP] = {}, mexp[GROUP] = {};
    for (int64_t b = 0; b < L.blocks; ++b) {
      const uint8_t* rec = record_at(packed, L, g, b);
      const int8_t* xq = row.xq + b * BLOCK;
      const int64_t gi = b / bpg;
      const int kd_g = row.kdelta[gi] + shift0;
      for (int j = 0; j < GROUP; ++j) {
        const ColumnScales c = column_scales(rec, L, b, j, top[j]);
        int64_t sa = 0;  // sum over the block's sub-blocks of S A
        for (int h = 0; h < L.per; ++h) {
          int32_t dot = 0;
          for (int k = h * kd.sub; k < (h + 1) * kd.sub; ++k) dot += code_at(rec, L, j, k) * static_cast<int32_t>(xq[k]);
          dot -= kd.offset * row.xsum[b * L.per + h];
          sa += static_cast<int64_t>(c.s[h]) * dot;
        }
        if (bpg == 1) {
          a[j] += on_grid(sa * row.m[gi], c.sexp + kd_g, kd.term_bits);
          if (kd.has_min)
            a[j] += on_grid(static_cast<int64_t>(c.min) * row.sm[b], c.mexp + row.sdelta[b] + shift0, kd.term_bits);
          continue;
        }
        dots[j] += sa;
        if (kd.has_min) mins[j] += static_cast<int64_t>(c.min) * row.xsum[b];  // sub 32: a block's sum
        sexp[j] = c.sexp, mexp[j] = c.mexp;  // one per super-block (pack_quant checks)
        if (b % bpg == bpg - 1) {
          a[j] += on_grid(dots[j] * row.m[gi], sexp[j] + kd_g, kd.term_bits);
          if (kd.has_min) a[j] += on_grid(mins[j] * row.m[gi], mexp[j] + kd_g, kd.term_bits);
          dots[j] = mins[j] = 0;
        }
      }
    }
  }
}

#if defined(TF_QUANT_VNNI)
// The same with 16 columns to a register, the terms carried exactly in float64 lanes (row_terms).

// 16 float16 scales (their bits) as significands dm and shifts de - top (significand16).
inline void decode_f16(const uint8_t* p, __m512i top, __m512i* dm, __m512i* shift) {
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i e = _mm512_and_si512(_mm512_srli_epi32(v, 10), _mm512_set1_epi32(0x1F));
  const __m512i f = _mm512_and_si512(v, _mm512_set1_epi32(0x3FF));
  const __mmask16 normal = _mm512_test_epi32_mask(e, e);
  const __m512i mag = _mm512_mask_or_epi32(f, normal, f, _mm512_set1_epi32(0x400));
  const __mmask16 negative = _mm512_test_epi32_mask(v, _mm512_set1_epi32(0x8000));
  *dm = _mm512_mask_sub_epi32(mag, negative, _mm512_setzero_si512(), mag);
  const __m512i de = _mm512_mask_sub_epi32(_mm512_set1_epi32(-24), normal, e, _mm512_set1_epi32(25));
  *shift = _mm512_sub_epi32(de, top);
}

inline __m512i load_i8x16(const uint8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// q6_k's top two bits into its codes' nibbles u[0..8): quad q's in bits 2 (q % 4) of row q / 4 of `bits`.
inline void add_top_bits(const uint8_t* bits, __m512i* u) {
  const __m512i three = _mm512_set1_epi8(3);
  for (int row = 0; row < 2; ++row) {
    const __m512i v = _mm512_loadu_si512(bits + 64 * row);
    for (int i = 0; i < 4; ++i) {
      const __m512i two = _mm512_and_si512(_mm512_srli_epi16(v, 2 * i), three);  // bits of the byte itself
      u[4 * row + i] = _mm512_or_si512(u[4 * row + i], _mm512_slli_epi16(two, 4));
    }
  }
}

// q5_k's fifth bits into its codes' nibbles u[0..8): quad q's in bit q of each byte of `bits`
// (16-bit shifts that move bit q to bit 4 of the same byte).
inline void add_fifth_bit(const uint8_t* bits, __m512i* u) {
  const __m512i v = _mm512_loadu_si512(bits), bit4 = _mm512_set1_epi8(0x10);
  for (int q = 0; q < 8; ++q) {
    const __m512i at4 = q <= 4 ? _mm512_slli_epi16(v, 4 - q) : _mm512_srli_epi16(v, q - 4);
    u[q] = _mm512_or_si512(u[q], _mm512_and_si512(at4, bit4));
  }
}

inline __m512i plane_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// A SUPER record's scales for 16 columns (k_scale, column_scales), once per super-block: into
// sup, S = dm sc of each sub-block (q4_k: sup[0..8), then M = -(dminm m) in sup[8..16); q6_k:
// sup[0..16)), and the shifts E - top and q4_k's F - top.
inline void super_scales(const uint8_t* head, bool q6, __m512i top, int32_t (*sup)[GROUP], __m512i* sexp,
                         __m512i* mexp) {
  __m512i dm;
  decode_f16(head, top, &dm, sexp);
  if (q6) {
    for (int t = 0; t < 16; ++t) {
      const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(head + 2 * GROUP + 16 * t)));
      _mm512_store_si512(sup[t], _mm512_mullo_epi32(dm, sc));
    }
    return;
  }
  __m512i mm;
  decode_f16(head + 2 * GROUP, top, &mm, mexp);
  const uint8_t* planes = head + 4 * GROUP;
  const auto byte = [&](int t) { return plane_u8(planes + 16 * t); };
  const __m512i low6 = _mm512_set1_epi32(63), low4 = _mm512_set1_epi32(15);
  for (int i = 0; i < SUPER_BLOCKS; ++i) {
    __m512i sc, m;
    if (i < 4) {
      sc = _mm512_and_si512(byte(i), low6);
      m = _mm512_and_si512(byte(i + 4), low6);
    } else {
      const __m512i rest = byte(i + 4);
      sc = _mm512_or_si512(_mm512_and_si512(rest, low4), _mm512_slli_epi32(_mm512_srli_epi32(byte(i - 4), 6), 4));
      m = _mm512_or_si512(_mm512_srli_epi32(rest, 4), _mm512_slli_epi32(_mm512_srli_epi32(byte(i), 6), 4));
    }
    _mm512_store_si512(sup[i], _mm512_mullo_epi32(dm, sc));
    _mm512_store_si512(sup[SUPER_BLOCKS + i], _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_mullo_epi32(mm, m)));
  }
}

// Block b's 16 columns' codes u = c + offset as eight rows of 64 bytes: quad q (k = 4q..4q+3)
// of every column in row q, which is vpdpbusd's operand and an AMX tile's B rows alike.
template <int FORM, int KIND>
inline void block_codes(const uint8_t* rec, const Layout& L, __m512i* u) {
  constexpr bool NIBBLES = KINDS[KIND].nibbles || FORM == SUPER;
  if constexpr (NIBBLES) {
    const __m512i nib = _mm512_set1_epi8(0x0F);
    for (int q = 0; q < 4; ++q) {
      const __m512i v = _mm512_loadu_si512(rec + q * 64);
      u[q] = _mm512_and_si512(v, nib);
      u[q + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
    }
  } else {
    for (int q = 0; q < 8; ++q) u[q] = _mm512_loadu_si512(rec + q * 64);
  }
  if constexpr (FORM == SUPER && KIND == Q6K) add_top_bits(rec + L.code_bytes, u);  // a nibble and two bits
  if constexpr (FORM == SUPER && KIND == Q5K) add_fifth_bit(rec + L.code_bytes, u);  // a nibble and a bit
}

// A block's scales for its 16 columns, shared by every row, as float64: S 2^(E - top + shift0)
// per half of the block (q6_k has two), and M 2^(F - top + shift0) for the kinds with a minimum,
// each as columns 0-7 and 8-15. Every one is an integer of at most 32 bits times a power of two
// well inside float64's range, so exact.
struct BlockScales {
  __m512d s[2][2], mn[2];  // [half][columns 0-7, 8-15], [columns 0-7, 8-15]
};

// x 2^e, lane by lane, for int32 x and e (vscalefpd: exact, as nothing leaves float64's range).
inline void scaled_pd(__m512i x, __m512i e, __m512d* out) {
  const __m256i x_lo = _mm512_castsi512_si256(x), x_hi = _mm512_extracti64x4_epi64(x, 1);
  const __m256i e_lo = _mm512_castsi512_si256(e), e_hi = _mm512_extracti64x4_epi64(e, 1);
  out[0] = _mm512_scalef_pd(_mm512_cvtepi32_pd(x_lo), _mm512_cvtepi32_pd(e_lo));
  out[1] = _mm512_scalef_pd(_mm512_cvtepi32_pd(x_hi), _mm512_cvtepi32_pd(e_hi));
}

// 16 float16s (their bits at p) as float64, columns 0-7 and 8-15 (exact: every float16, its
// subnormals too, is a normal float32).
inline void f16_pd(const uint8_t* p, __m512d* out) {
  const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  out[0] = _mm512_cvtps_pd(_mm512_castps512_ps256(f));
  out[1] = _mm512_cvtps_pd(_mm512_extractf32x8_ps(f, 1));
}

// A column group's 2^(shift0 - top) per column (columns 0-7, 8-15): what turns its float16
// scales into block_scales' S 2^(E - top + shift0).
inline void group_units(__m512i topv, int shift0, __m512d* units) {
  scaled_pd(_mm512_set1_epi32(1), _mm512_sub_epi32(_mm512_set1_epi32(shift0), topv), units);
}

// Group g's block b (codes at rec); units: group_units. The float16 scales (F16) are the file's
// d = S 2^E itself, so S 2^(E - top + shift0) = d units. SUPER records decode their super-block's
// scales at its first block into sup / sup_sexp / sup_mexp, which the next seven blocks read.
template <int FORM, int KIND>
inline BlockScales block_scales(const uint8_t* rec, const Layout& L, int64_t b, __m512i topv, int shift0,
                                const __m512d* units, int32_t (*sup)[GROUP], __m512i* sup_sexp, __m512i* sup_mexp) {
  constexpr QKind KD = KINDS[KIND];
  constexpr bool HAS_MIN = KD.has_min;
  constexpr int PER = BLOCK / KD.sub;
  __m512i s0, s1 = _mm512_setzero_si512(), mv = s1, sexp, mexp = s1;
  if constexpr (FORM == SUPER) {  // the super-block's scales decoded at its first block
    const int i = static_cast<int>(b % SUPER_BLOCKS);
    if (i == 0) super_scales(super_head(rec, L, b), KIND == Q6K, topv, sup, sup_sexp, sup_mexp);
    s0 = _mm512_load_si512(sup[KIND == Q6K ? 2 * i : i]);
    if constexpr (KIND == Q6K) s1 = _mm512_load_si512(sup[2 * i + 1]);
    if constexpr (HAS_MIN) mv = _mm512_load_si512(sup[SUPER_BLOCKS + i]);
    sexp = *sup_sexp;
    mexp = *sup_mexp;
  } else if constexpr (FORM == F16) {
    BlockScales c;
    f16_pd(rec + L.code_bytes, c.s[0]);
    if constexpr (HAS_MIN) f16_pd(rec + L.min_at, c.mn);
    for (int h = 0; h < 2; ++h) {
      c.s[0][h] = _mm512_mul_pd(c.s[0][h], units[h]);
      if constexpr (HAS_MIN) c.mn[h] = _mm512_mul_pd(c.mn[h], units[h]);
    }
    return c;
  } else {
    s0 = _mm512_loadu_si512(rec + L.code_bytes);
    sexp = load_i8x16(rec + L.sexp_at);
    if constexpr (HAS_MIN) {
      mv = _mm512_loadu_si512(rec + L.min_at);
      mexp = load_i8x16(rec + L.mexp_at);
    }
    if constexpr (PER == 2) s1 = _mm512_loadu_si512(rec + L.code_bytes + 4 * GROUP);  // the second half's
  }
  BlockScales c;
  const __m512i grid = _mm512_set1_epi32(shift0);
  sexp = _mm512_add_epi32(sexp, grid);
  scaled_pd(s0, sexp, c.s[0]);
  if constexpr (PER == 2) scaled_pd(s1, sexp, c.s[1]);
  if constexpr (HAS_MIN) scaled_pd(mv, _mm512_add_epi32(mexp, grid), c.mn);
  return c;
}

// float64 lanes that hold integers times powers of two, rounded to int64 to nearest, ties to
// even: on_grid's rounding of a term whose shift is negative, its value where it is not.
inline __m512i round_pd(__m512d v) {
  return _mm512_cvt_roundpd_epi64(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// The 32-column kinds: one row's terms of a block for 16 columns, added to its int64 sums lo (columns 0-7) and hi
// (8-15): dot0 the block's dots u . xq (PER == 2: the first half's, dot1 the second's), less
// offset times the row's sums, times the columns' S 2^(E - top + shift0), times the row's
// m 2^(k - kmax), rounded onto the grid; then, for the kinds with a minimum, M sm on the grid.
//
// Exact, though in float64: each term is the reference's integer (|I| < 2^T, T = 41 for the
// 32-column kinds this serves) times a power of two. Its factors are integers times powers of two and every
// product and the halves' sum stay below 2^53 times their power of two, so no operation rounds
// (exponents stay far inside float64's range), and the conversion's one rounding, to nearest even,
// is on_grid's where the shift is negative. The same order of operations for every row.
// SIGNED_DOTS: the dots are already c . xq (the AMX tiles multiply the signed codes), no offset.
template <int KIND, bool SIGNED_DOTS = false>
inline void row_terms(__m512i dot0, __m512i dot1, const BlockScales& c, const RowQ& row, int64_t b, __m512i* lo,
                      __m512i* hi) {
  constexpr QKind KD = KINDS[KIND];
  constexpr int PER = BLOCK / KD.sub, OFFSET = SIGNED_DOTS ? 0 : KD.offset;
  const int32_t* xsum = row.xsum.data() + b * PER;
  const __m512d m = _mm512_set1_pd(row.mf[b]);
  __m512d t[2];
  const auto halves = [](__m512i v, __m512d* out) {  // int32 columns 0-7 and 8-15 as float64
    out[0] = _mm512_cvtepi32_pd(_mm512_castsi512_si256(v));
    out[1] = _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(v, 1));
  };
  __m512d d0[2];
  halves(OFFSET != 0 ? _mm512_sub_epi32(dot0, _mm512_set1_epi32(OFFSET * xsum[0])) : dot0, d0);
  if constexpr (PER == 1) {
    for (int h = 0; h < 2; ++h) t[h] = _mm512_mul_pd(_mm512_mul_pd(d0[h], c.s[0][h]), m);
  } else {  // two halves of 16, each with its own scale: A0 S0 + A1 S1, then times m
    __m512d d1[2];
    halves(OFFSET != 0 ? _mm512_sub_epi32(dot1, _mm512_set1_epi32(OFFSET * xsum[1])) : dot1, d1);
    for (int h = 0; h < 2; ++h)
      t[h] = _mm512_mul_pd(_mm512_add_pd(_mm512_mul_pd(d0[h], c.s[0][h]), _mm512_mul_pd(d1[h], c.s[1][h])), m);
  }
  *lo = _mm512_add_epi64(*lo, round_pd(t[0]));
  *hi = _mm512_add_epi64(*hi, round_pd(t[1]));
  if constexpr (KD.has_min) {
    const __m512d sm = _mm512_set1_pd(row.smf[b]);
    *lo = _mm512_add_epi64(*lo, round_pd(_mm512_mul_pd(c.mn[0], sm)));
    *hi = _mm512_add_epi64(*hi, round_pd(_mm512_mul_pd(c.mn[1], sm)));
  }
}

// The K-quants (act 256): one row's products of a block for 16 columns added to its super-block's
// float64 sums: dsum += A S 2^(E - top + shift0) per sub-block (A = dot0, dot1 less offset times
// the row's sub-block sums), and for q4_k / q5_k msum += M 2^(F - top + shift0) times the block's
// sum of xq. Exact: E (and F) is one per super-block (pack_quant checks it), so every product is
// an integer times the same power of two, and the integers' sums stay below 2^53 (a super-block's
// S A below 2^38, M sum(xq) below 2^32: quant_gemm.KINDS' bounds), so the fused multiply-adds
// round nothing. row_super_terms then rounds each sum once, as the reference rounds its one term.
template <int KIND, bool SIGNED_DOTS = false>
inline void row_super_products(__m512i dot0, __m512i dot1, const BlockScales& c, const RowQ& row, int64_t b,
                               __m512d* dsum, __m512d* msum) {
  constexpr QKind KD = KINDS[KIND];
  constexpr int PER = BLOCK / KD.sub, OFFSET = SIGNED_DOTS ? 0 : KD.offset;
  const int32_t* xsum = row.xsum.data() + b * PER;
  const auto halves = [](__m512i v, __m512d* out) {  // int32 columns 0-7 and 8-15 as float64
    out[0] = _mm512_cvtepi32_pd(_mm512_castsi512_si256(v));
    out[1] = _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(v, 1));
  };
  __m512d d0[2];
  halves(OFFSET != 0 ? _mm512_sub_epi32(dot0, _mm512_set1_epi32(OFFSET * xsum[0])) : dot0, d0);
  for (int h = 0; h < 2; ++h) dsum[h] = _mm512_fmadd_pd(d0[h], c.s[0][h], dsum[h]);
  if constexpr (PER == 2) {
    __m512d d1[2];
    halves(OFFSET != 0 ? _mm512_sub_epi32(dot1, _mm512_set1_epi32(OFFSET * xsum[1])) : dot1, d1);
    for (int h = 0; h < 2; ++h) dsum[h] = _mm512_fmadd_pd(d1[h], c.s[1][h], dsum[h]);
  }
  if constexpr (KD.has_min) {
    const __m512d xs = _mm512_set1_pd(static_cast<double>(xsum[0]));  // sub 32: the block's sum
    for (int h = 0; h < 2; ++h) msum[h] = _mm512_fmadd_pd(xs, c.mn[h], msum[h]);
  }
}

// A super-block s's terms from its sums (row_super_products): each times the row's m 2^(k - kmax)
// of the super-block (one rounding: the integer term, below 2^T, times its power of two, exact
// before the conversion), rounded onto the grid and added to lo (columns 0-7) and hi (8-15).
template <int KIND>
inline void row_super_terms(const __m512d* dsum, const __m512d* msum, const RowQ& row, int64_t s, __m512i* lo,
                            __m512i* hi) {
  const __m512d m = _mm512_set1_pd(row.mf[s]);
  *lo = _mm512_add_epi64(*lo, round_pd(_mm512_mul_pd(dsum[0], m)));
  *hi = _mm512_add_epi64(*hi, round_pd(_mm512_mul_pd(dsum[1], m)));
  if constexpr (KINDS[KIND].has_min) {
    *lo = _mm512_add_epi64(*lo, round_pd(_mm512_mul_pd(msum[0], m)));
    *hi = _mm512_add_epi64(*hi, round_pd(_mm512_mul_pd(msum[1], m)));
  }
}

// The K-quants in their file's form (q4_k, q6_k as SUPER records): a super-block's factors for its
// 16 columns, decoded once from its head. sc: the sub-block scales as int32 (q4_k: sc of blocks
// 0-7 in sc[0..8), their minimums m in sc[8..16); q6_k: the 16 signed scales), and as float64
// (columns 0-7, 8-15) dd = dm 2^(E - top + shift0) and q4_k's dmin = -dminm 2^(F - top + shift0),
// so that S = dm sc and M = -(dminm m) (column_scales) factor out of a super-block's sums.
template <bool Q6>
inline void super_factors(const uint8_t* head, __m512i topv, int shift0, int32_t (*sc)[GROUP], __m512d* dd,
                          __m512d* dmin) {
  const __m512i grid = _mm512_set1_epi32(shift0);
  __m512i dm, sexp;
  decode_f16(head, topv, &dm, &sexp);
  scaled_pd(dm, _mm512_add_epi32(sexp, grid), dd);
  if constexpr (Q6) {
    for (int t = 0; t < 16; ++t)
      _mm512_store_si512(sc[t], _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(head + 2 * GROUP + 16 * t))));
    return;
  }
  __m512i mm, mexp;
  decode_f16(head + 2 * GROUP, topv, &mm, &mexp);
  scaled_pd(_mm512_sub_epi32(_mm512_setzero_si512(), mm), _mm512_add_epi32(mexp, grid), dmin);
  const uint8_t* planes = head + 4 * GROUP;
  const auto byte = [&](int t) { return plane_u8(planes + 16 * t); };
  const __m512i low6 = _mm512_set1_epi32(63), low4 = _mm512_set1_epi32(15);
  for (int i = 0; i < SUPER_BLOCKS; ++i) {
    __m512i s, m;
    if (i < 4) {
      s = _mm512_and_si512(byte(i), low6);
      m = _mm512_and_si512(byte(i + 4), low6);
    } else {
      const __m512i rest = byte(i + 4);
      s = _mm512_or_si512(_mm512_and_si512(rest, low4), _mm512_slli_epi32(_mm512_srli_epi32(byte(i - 4), 6), 4));
      m = _mm512_or_si512(_mm512_srli_epi32(rest, 4), _mm512_slli_epi32(_mm512_srli_epi32(byte(i), 6), 4));
    }
    _mm512_store_si512(sc[i], s);
    _mm512_store_si512(sc[SUPER_BLOCKS + i], m);
  }
}

// A super-block s's two terms for one row from its int32 sums: dsum = sum of sc A over its
// sub-blocks, msum = sum of m sum(xq) over its blocks (q4_k). Each times dd (or dmin) and the
// row's m 2^(k - kmax): the reference's integer dm (dsum) m_s (below 2^49) times its power of
// two, exact in float64 before the one rounding onto the grid.
template <bool HAS_MIN>
inline void super_int_terms(__m512i dsum, __m512i msum, const __m512d* dd, const __m512d* dmin, double mf,
                            __m512i* lo, __m512i* hi) {
  const __m512d m = _mm512_set1_pd(mf);
  const __m512d d0 = _mm512_cvtepi32_pd(_mm512_castsi512_si256(dsum));
  const __m512d d1 = _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(dsum, 1));
  *lo = _mm512_add_epi64(*lo, round_pd(_mm512_mul_pd(_mm512_mul_pd(d0, dd[0]), m)));
  *hi = _mm512_add_epi64(*hi, round_pd(_mm512_mul_pd(_mm512_mul_pd(d1, dd[1]), m)));
  if constexpr (HAS_MIN) {
    const __m512d m0 = _mm512_cvtepi32_pd(_mm512_castsi512_si256(msum));
    const __m512d m1 = _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(msum, 1));
    *lo = _mm512_add_epi64(*lo, round_pd(_mm512_mul_pd(_mm512_mul_pd(m0, dmin[0]), m)));
    *hi = _mm512_add_epi64(*hi, round_pd(_mm512_mul_pd(_mm512_mul_pd(m1, dmin[1]), m)));
  }
}

// group_vector for the SUPER form: per row and super-block the integer sums of sc A (vpmulld,
// below 2^25 for q4_k, 2^27 for q6_k) and of m sum(xq) (below 2^21), then two terms
// (super_int_terms). Per block and row that is the dots and one or two multiply-adds of int32.
template <int R, int KIND>
void group_super(const Layout& L, const uint8_t* packed, const RowQ* rows, int64_t r0, int64_t g, int shift0,
                 const int32_t* top, int64_t* acc) {
  constexpr bool Q6 = KIND == Q6K;
  __m512i lo[R], hi[R];  // columns 0-7 and 8-15
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
  const __m512i topv = _mm512_loadu_si512(top);
  const int64_t ahead = prefetch_distance(L, r0);
  alignas(64) int32_t sc[16][GROUP];
  __m512d dd[2], dmin[2];
  for (int64_t sb = 0; sb < L.blocks / SUPER_BLOCKS; ++sb) {
    __m512i dsum[R], msum[R];
    for (int r = 0; r < R; ++r) dsum[r] = msum[r] = _mm512_setzero_si512();
    for (int i = 0; i < SUPER_BLOCKS; ++i) {
      const int64_t b = sb * SUPER_BLOCKS + i;
      const uint8_t* rec = streamed_record(packed, L, g, b, ahead);
      if (i == 0) super_factors<Q6>(super_head(rec, L, b), topv, shift0, sc, dd, dmin);
      __m512i u[8];
      block_codes<SUPER, KIND>(rec, L, u);
      const __m512i s0 = _mm512_load_si512(sc[Q6 ? 2 * i : i]);
      const __m512i s1 = _mm512_load_si512(sc[Q6 ? 2 * i + 1 : SUPER_BLOCKS + i]);  // q4_k: the minimums m
      for (int r = 0; r < R; ++r) {
        const RowQ& row = rows[r0 + r];
        const int32_t* xq = reinterpret_cast<const int32_t*>(row.xq + b * BLOCK);
        __m512i d[4];
        for (int ch = 0; ch < 4; ++ch) {
          const int q = (ch & 1) + (ch >> 1) * 4;  // chains start at quads 0, 1, 4, 5
          d[ch] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[q], _mm512_set1_epi32(xq[q]));
          d[ch] = _mm512_dpbusd_epi32(d[ch], u[q + 2], _mm512_set1_epi32(xq[q + 2]));
        }
        const __m512i h0 = _mm512_add_epi32(d[0], d[1]), h1 = _mm512_add_epi32(d[2], d[3]);  // quads 0-3, 4-7
        if constexpr (Q6) {  // halves of 16, offset 32: A = u . xq - 32 sum(xq)
          const int32_t* xsum = row.xsum.data() + 2 * b;
          const __m512i a0 = _mm512_sub_epi32(h0, _mm512_set1_epi32(32 * xsum[0]));
          const __m512i a1 = _mm512_sub_epi32(h1, _mm512_set1_epi32(32 * xsum[1]));
          dsum[r] = _mm512_add_epi32(dsum[r], _mm512_add_epi32(_mm512_mullo_epi32(a0, s0), _mm512_mullo_epi32(a1, s1)));
        } else {  // offset 0: A = u . xq
          dsum[r] = _mm512_add_epi32(dsum[r], _mm512_mullo_epi32(_mm512_add_epi32(h0, h1), s0));
          msum[r] = _mm512_add_epi32(msum[r], _mm512_mullo_epi32(s1, _mm512_set1_epi32(row.xsum[b])));
        }
      }
    }
    for (int r = 0; r < R; ++r) super_int_terms<!Q6>(dsum[r], msum[r], dd, dmin, rows[r0 + r].mf[sb], &lo[r], &hi[r]);
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_si512(acc + r * GROUP, lo[r]);
    _mm512_storeu_si512(acc + r * GROUP + 8, hi[r]);
  }
}

// R rows at once against group g: the codes are unpacked once per block and serve every row.
// Each block dot runs as four independent vpdpbusd chains (an integer sum: any split gives the
// same value).
template <int R, int FORM, int KIND>
void group_blocks(const Layout& L, const uint8_t* packed, const RowQ* rows, int64_t r0, int64_t g, int shift0,
                  const int32_t* top, int64_t* acc) {
  constexpr int PER = BLOCK / KINDS[KIND].sub;
  __m512i lo[R], hi[R];  // columns 0-7 and 8-15
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
  const __m512i topv = _mm512_loadu_si512(top);
  __m512d units[2];
  group_units(topv, shift0, units);
  const int64_t ahead = prefetch_distance(L, r0);
  alignas(64) int32_t sup[16][GROUP];  // SUPER: the super-block's scales (super_scales)
  __m512i sup_sexp = _mm512_setzero_si512(), sup_mexp = sup_sexp;
  constexpr bool SUPER_TERMS = KINDS[KIND].act != BLOCK;  // the K-quants: terms per super-block
  __m512d dsum[R][2], msum[R][2];  // SUPER_TERMS: the super-block's sums so far (row_super_products)
  for (int64_t b = 0; b < L.blocks; ++b) {
    const uint8_t* rec = streamed_record(packed, L, g, b, ahead);
    __m512i u[8];
    block_codes<FORM, KIND>(rec, L, u);
    const BlockScales c = block_scales<FORM, KIND>(rec, L, b, topv, shift0, units, sup, &sup_sexp, &sup_mexp);
    if constexpr (SUPER_TERMS)
      if (b % SUPER_BLOCKS == 0)
        for (int r = 0; r < R; ++r) dsum[r][0] = dsum[r][1] = msum[r][0] = msum[r][1] = _mm512_setzero_pd();
    for (int r = 0; r < R; ++r) {
      const int32_t* xq = reinterpret_cast<const int32_t*>(rows[r0 + r].xq + b * BLOCK);
      // Quads c and c + 2 share a chain: four chains of two, summed per half (PER == 2) or whole.
      __m512i d[4];
      for (int ch = 0; ch < 4; ++ch) {
        const int q = (ch & 1) + (ch >> 1) * 4;  // chains start at quads 0, 1, 4, 5
        d[ch] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[q], _mm512_set1_epi32(xq[q]));
        d[ch] = _mm512_dpbusd_epi32(d[ch], u[q + 2], _mm512_set1_epi32(xq[q + 2]));
      }
      const __m512i h0 = _mm512_add_epi32(d[0], d[1]), h1 = _mm512_add_epi32(d[2], d[3]);  // quads 0-3, 4-7
      const __m512i first = PER == 1 ? _mm512_add_epi32(h0, h1) : h0;
      if constexpr (SUPER_TERMS)
        row_super_products<KIND>(first, h1, c, rows[r0 + r], b, dsum[r], msum[r]);
      else
        row_terms<KIND>(first, h1, c, rows[r0 + r], b, &lo[r], &hi[r]);
    }
    if constexpr (SUPER_TERMS)
      if (b % SUPER_BLOCKS == SUPER_BLOCKS - 1)
        for (int r = 0; r < R; ++r) row_super_terms<KIND>(dsum[r], msum[r], rows[r0 + r], b / SUPER_BLOCKS, &lo[r], &hi[r]);
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_si512(acc + r * GROUP, lo[r]);
    _mm512_storeu_si512(acc + r * GROUP + 8, hi[r]);
  }
}

// R rows against group g: the SUPER form by its integer sums (group_super), the others block by block.
template <int R, int FORM, int KIND>
void group_vector(const Layout& L, const uint8_t* packed, const RowQ* rows, int64_t r0, int64_t g, int shift0,
                  const int32_t* top, int64_t* acc) {
  if constexpr (FORM == SUPER)
    group_super<R, KIND>(L, packed, rows, r0, g, shift0, top, acc);
  else
    group_blocks<R, FORM, KIND>(L, packed, rows, r0, g, shift0, top, acc);
}

#if defined(TF_QUANT_AMX)
// AMX-INT8: the block dots of 16 rows and 16 columns in one tile multiply (tdpbssd: s8 x s8 ->
// int32, the codes made signed once per group), K the block's 32 (or a q6_k half's 16), so each C
// tile holds one block's dots c . xq, which the vpdpbusd chains reach as u . xq - offset sum xq;
// the terms then run per row as in group_vector.

// The tile registers, named by literals in the intrinsics (which paste them into the assembly
// text): A (the rows' codes) tmm0 and tmm1, B (the columns') tmm2 and tmm3, C (the dots) tmm4..7;
// group_amx says which block or half each holds. These are their indices in the tile config.
constexpr int A0 = 0, B0 = 2, C0 = 4;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Whether this process may use the tile state: Linux grants it on request (arch_prctl), once.
bool amx_granted() {
  static const bool granted = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return granted;
}

// A column group made ready once for all its row tiles (group_amx): its blocks' signed codes
// c = u - offset as B rows (so the tiles' dots need no offset term), and their scales.
struct alignas(64) CodeRows {
  uint8_t v[8 * 64];
};
struct alignas(64) DotTile {
  int32_t v[TILE_ROWS][GROUP];
};
// A SUPER super-block's factors (super_factors), made once per group for all its row tiles.
struct alignas(64) SuperInts {
  int32_t sc[16][GROUP];
  int32_t m_pairs[SUPER_BLOCKS / 2][GROUP];  // with a minimum: m of blocks 2p (low int16) and 2p + 1 (high)
  __m512d dd[2], dmin[2];
};
struct AmxGroup {
  uint64_t call = 0;  // which call, weight and group it was made for
  const uint8_t* packed = nullptr;
  int64_t g = -1;
  std::vector<CodeRows> codes;  // per block: its B rows
  std::vector<BlockScales> scales;  // per block (not SUPER)
  std::vector<SuperInts> supers;  // per super-block (SUPER)
  std::vector<DotTile> dots;  // per block of a run (and half): a row tile's dots
};

template <int FORM, int KIND>
void prepare_group(const Layout& L, const uint8_t* packed, int64_t g, int shift0, const int32_t* top, AmxGroup* G) {
  if (G->call == current_call && G->packed == packed && G->g == g) return;
  G->call = current_call, G->packed = packed, G->g = g;
  G->codes.resize(L.blocks);
  if constexpr (FORM == SUPER)
    G->supers.resize(L.blocks / SUPER_BLOCKS);
  else
    G->scales.resize(L.blocks);
  G->dots.resize(AMX_BLOCKS * (BLOCK / KINDS[KIND].sub));
  const __m512i topv = _mm512_loadu_si512(top);
  __m512d units[2];
  group_units(topv, shift0, units);
  const int64_t ahead = prefetch_distance(L, 0);
  alignas(64) int32_t sup[16][GROUP];
  __m512i sup_sexp = _mm512_setzero_si512(), sup_mexp = sup_sexp;
  for (int64_t b = 0; b < L.blocks; ++b) {
    const uint8_t* rec = streamed_record(packed, L, g, b, ahead);
    __m512i u[8];
    block_codes<FORM, KIND>(rec, L, u);
    const __m512i offset = _mm512_set1_epi8(static_cast<char>(KINDS[KIND].offset));
    for (int q = 0; q < 8; ++q) _mm512_store_si512(G->codes[b].v + 64 * q, _mm512_sub_epi8(u[q], offset));  // mod 256
    if constexpr (FORM == SUPER) {
      if (b % SUPER_BLOCKS == 0) {
        SuperInts& si = G->supers[b / SUPER_BLOCKS];
        super_factors<KIND == Q6K>(super_head(rec, L, b), topv, shift0, si.sc, si.dd, si.dmin);
        if constexpr (KINDS[KIND].has_min)
          for (int p = 0; p < SUPER_BLOCKS / 2; ++p)  // m < 64: each fits an int16 half
            _mm512_store_si512(si.m_pairs[p], _mm512_or_si512(_mm512_load_si512(si.sc[SUPER_BLOCKS + 2 * p]),
                                                              _mm512_slli_epi32(_mm512_load_si512(si.sc[SUPER_BLOCKS + 2 * p + 1]), 16)));
      }
    } else {
      G->scales[b] = block_scales<FORM, KIND>(rec, L, b, topv, shift0, units, sup, &sup_sexp, &sup_mexp);
    }
  }
}

// Rows [r0, r1) against group g into acc [r1 - r0][16], the rows' codes `stride` bytes apart, a
// tile of 16 rows at a time (a last tile of fewer reads past the GEMM's rows into the buffer's
// slack and keeps only its own). First every block's dots of the tile, on the tiles (tdpbssd: s8
// rows x s8 columns, int32 sums; four blocks in flight, each C tile stored three blocks after its
// multiply), then each row's terms over the blocks, its sums in registers.
template <int FORM, int KIND>
void group_amx(const Layout& L, const uint8_t* packed, const RowQ* rows, int64_t r0, int64_t r1, int64_t g,
               int shift0, const int32_t* top, int64_t stride, int64_t* acc) {
  constexpr QKind KD = KINDS[KIND];
  constexpr int PER = BLOCK / KD.sub;
  static thread_local AmxGroup G;
  prepare_group<FORM, KIND>(L, packed, g, shift0, top, &G);
  TileConfig cfg;
  for (int t = 0; t < 2; ++t) cfg.rows[A0 + t] = TILE_ROWS, cfg.colsb[A0 + t] = KD.sub;
  for (int t = 0; t < 2; ++t) cfg.rows[B0 + t] = KD.sub / 4, cfg.colsb[B0 + t] = 64;
  for (int t = 0; t < 4; ++t) cfg.rows[C0 + t] = TILE_ROWS, cfg.colsb[C0 + t] = 64;
  _tile_loadconfig(&cfg);
  DotTile* dots = G.dots.data();
  alignas(64) int64_t sums[TILE_ROWS][GROUP];  // the tile's rows' sums between runs of blocks
  for (int64_t t0 = r0; t0 < r1; t0 += TILE_ROWS) {
    const int8_t* a = rows[t0].xq;
    const int64_t n = std::min<int64_t>(TILE_ROWS, r1 - t0);
    std::memset(sums, 0, sizeof(sums));
    // Runs of AMX_BLOCKS blocks, whose dots stay in L1 between their multiplies and their terms.
    for (int64_t b0 = 0; b0 < L.blocks; b0 += AMX_BLOCKS) {
      const int64_t blocks = std::min(AMX_BLOCKS, L.blocks - b0);
      if constexpr (PER == 1) {  // block b: A tmm0/1, B tmm2/3 by b % 2, C tmm 4 + b % 4
        for (int64_t b = 0; b < blocks + 3; ++b) {
          if (b < blocks) {
            const uint8_t* bb = G.codes[b0 + b].v;
            const int8_t* ab = a + (b0 + b) * BLOCK;
            switch (b % 4) {
              case 0: _tile_loadd(2, bb, 64); _tile_loadd(0, ab, stride); _tile_zero(4); _tile_dpbssd(4, 0, 2); break;
              case 1: _tile_loadd(3, bb, 64); _tile_loadd(1, ab, stride); _tile_zero(5); _tile_dpbssd(5, 1, 3); break;
              case 2: _tile_loadd(2, bb, 64); _tile_loadd(0, ab, stride); _tile_zero(6); _tile_dpbssd(6, 0, 2); break;
              default: _tile_loadd(3, bb, 64); _tile_loadd(1, ab, stride); _tile_zero(7); _tile_dpbssd(7, 1, 3); break;
            }
          }
          const int64_t s = b - 3;  // the block whose C tile is stored now
          if (s < 0) continue;
          switch (s % 4) {
            case 0: _tile_stored(4, dots[s].v, 64); break;
            case 1: _tile_stored(5, dots[s].v, 64); break;
            case 2: _tile_stored(6, dots[s].v, 64); break;
            default: _tile_stored(7, dots[s].v, 64); break;
          }
        }
      } else {  // halves of 16: block b's in C tmm 4, 5 (b even) or 6, 7 (b odd); A and B by half
        for (int64_t b = 0; b < blocks + 1; ++b) {
          if (b < blocks) {
            const uint8_t* bb = G.codes[b0 + b].v;
            const int8_t* ab = a + (b0 + b) * BLOCK;
            _tile_loadd(2, bb, 64);
            _tile_loadd(3, bb + 4 * 64, 64);  // quads 4-7: k 16..31
            _tile_loadd(0, ab, stride);
            _tile_loadd(1, ab + 16, stride);
            if (b % 2 == 0) {
              _tile_zero(4); _tile_dpbssd(4, 0, 2); _tile_zero(5); _tile_dpbssd(5, 1, 3);
            } else {
              _tile_zero(6); _tile_dpbssd(6, 0, 2); _tile_zero(7); _tile_dpbssd(7, 1, 3);
            }
          }
          const int64_t s = b - 1;
          if (s < 0) continue;
          if (s % 2 == 0) {
            _tile_stored(4, dots[2 * s].v, 64); _tile_stored(5, dots[2 * s + 1].v, 64);
          } else {
            _tile_stored(6, dots[2 * s].v, 64); _tile_stored(7, dots[2 * s + 1].v, 64);
          }
        }
      }
      for (int64_t i = 0; i < n; ++i) {
        const RowQ& row = rows[t0 + i];
        __m512i lo = _mm512_load_si512(sums[i]), hi = _mm512_load_si512(sums[i] + 8);
        if constexpr (FORM == SUPER) {  // a run is one super-block: its int32 sums, then two terms (group_super)
          const SuperInts& si = G.supers[b0 / SUPER_BLOCKS];
          __m512i dsum = _mm512_setzero_si512(), msum = dsum;
          for (int64_t b = 0; b < blocks; ++b) {
            const __m512i d0 = _mm512_load_si512(dots[PER * b].v[i]);  // c . xq: the codes signed
            if constexpr (PER == 2) {
              const __m512i d1 = _mm512_load_si512(dots[PER * b + 1].v[i]);
              dsum = _mm512_add_epi32(dsum, _mm512_add_epi32(_mm512_mullo_epi32(d0, _mm512_load_si512(si.sc[2 * b])),
                                                             _mm512_mullo_epi32(d1, _mm512_load_si512(si.sc[2 * b + 1]))));
            } else {
              dsum = _mm512_add_epi32(dsum, _mm512_mullo_epi32(d0, _mm512_load_si512(si.sc[b])));
            }
          }
          if constexpr (KD.has_min) {  // m sum(xq) two blocks at a time: |sum(xq)| <= 32 127 fits an int16
            const int32_t* xs = row.xsum.data() + b0;
            for (int p = 0; p < SUPER_BLOCKS / 2; ++p) {
              const int32_t pair = static_cast<int32_t>((static_cast<uint32_t>(xs[2 * p]) & 0xFFFF) |
                                                        (static_cast<uint32_t>(xs[2 * p + 1]) << 16));
              msum = _mm512_dpwssd_epi32(msum, _mm512_load_si512(si.m_pairs[p]), _mm512_set1_epi32(pair));
            }
          }
          super_int_terms<KD.has_min>(dsum, msum, si.dd, si.dmin, row.mf[b0 / SUPER_BLOCKS], &lo, &hi);
        } else if constexpr (KD.act != BLOCK) {  // a run is one super-block (AMX_BLOCKS = SUPER_BLOCKS, K a multiple of 256)
          __m512d dsum[2] = {_mm512_setzero_pd(), _mm512_setzero_pd()}, msum[2] = {dsum[0], dsum[0]};
          for (int64_t b = 0; b < blocks; ++b) {
            const __m512i d0 = _mm512_load_si512(dots[PER * b].v[i]);
            const __m512i d1 = _mm512_load_si512(dots[PER * b + PER - 1].v[i]);
            row_super_products<KIND, true>(d0, d1, G.scales[b0 + b], row, b0 + b, dsum, msum);
          }
          row_super_terms<KIND>(dsum, msum, row, b0 / SUPER_BLOCKS, &lo, &hi);
        } else {
          for (int64_t b = 0; b < blocks; ++b) {
            const __m512i d0 = _mm512_load_si512(dots[PER * b].v[i]);
            const __m512i d1 = _mm512_load_si512(dots[PER * b + PER - 1].v[i]);
            row_terms<KIND, true>(d0, d1, G.scales[b0 + b], row, b0 + b, &lo, &hi);
          }
        }
        _mm512_store_si512(sums[i], lo);
        _mm512_store_si512(sums[i] + 8, hi);
      }
    }
    for (int64_t i = 0; i < n; ++i) std::memcpy(acc + (t0 - r0 + i) * GROUP, sums[i], sizeof(sums[i]));
  }
  _tile_release();
}
#endif

#endif

#if defined(TF_QUANT_AVX2)
// The same on AVX2, eight columns to a register. A block dot's groups of four bytes are vpmaddubsw
// (u8 x s8, adjacent pairs summed in int16, saturating) then vpmaddwd by ones (-> int32). No pair
// may saturate: |u x + u' x'| <= 2 (2^code_bits - 1) 127 < 2^15 for codes of up to 6 bits, and
// q8_0's codes (u up to 255) run signed instead: |c| <= 128 against x with c's sign, 2 128 127.
// Quads are summed in int16 while their bound allows (SUM16), so most take one vpmaddwd per block.
inline __m256i widen4_lo(__m256i v) { return _mm256_cvtepi32_epi64(_mm256_castsi256_si128(v)); }
inline __m256i widen4_hi(__m256i v) { return _mm256_cvtepi32_epi64(_mm256_extracti128_si256(v, 1)); }

// acc[c] += ints[c] 2^shifts[c] over N registers of four int64 lanes; lanes with a negative shift
// (the vector shift adds 0 for them: rare, a block far below the row's largest) are then added by
// on_grid, found by one test over all N.
template <int N>
inline void add_terms4(__m256i* acc, const __m256i* ints, const __m256i* shifts, int term_bits) {
  __m256i any = _mm256_setzero_si256();
  for (int c = 0; c < N; ++c) {
    acc[c] = _mm256_add_epi64(acc[c], _mm256_sllv_epi64(ints[c], shifts[c]));  // a negative count adds 0
    any = _mm256_or_si256(any, shifts[c]);
  }
  if (_mm256_movemask_pd(_mm256_castsi256_pd(any)) == 0) return;  // no lane's sign bit set
  for (int c = 0; c < N; ++c) {
    alignas(32) int64_t iv[4], sv[4], fix[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(iv), ints[c]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(sv), shifts[c]);
    for (int j = 0; j < 4; ++j) fix[j] = sv[j] < 0 && iv[j] != 0 ? on_grid(iv[j], static_cast<int>(sv[j]), term_bits) : 0;
    acc[c] = _mm256_add_epi64(acc[c], _mm256_load_si256(reinterpret_cast<const __m256i*>(fix)));
  }
}

// Eight float16 scales (their bits) as significands dm and shifts de - top (significand16).
inline void decode_f16x8(const uint8_t* p, __m256i top, __m256i* dm, __m256i* shift) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i e = _mm256_and_si256(_mm256_srli_epi32(v, 10), _mm256_set1_epi32(0x1F));
  const __m256i f = _mm256_and_si256(v, _mm256_set1_epi32(0x3FF));
  const __m256i subnormal = _mm256_cmpeq_epi32(e, _mm256_setzero_si256());
  const __m256i mag = _mm256_or_si256(f, _mm256_andnot_si256(subnormal, _mm256_set1_epi32(0x400)));
  const __m256i sign = _mm256_srai_epi32(_mm256_slli_epi32(v, 16), 31);  // -1 where negative, else 0
  *dm = _mm256_sub_epi32(_mm256_xor_si256(mag, sign), sign);
  const __m256i de = _mm256_blendv_epi8(_mm256_sub_epi32(e, _mm256_set1_epi32(25)), _mm256_set1_epi32(-24), subnormal);
  *shift = _mm256_sub_epi32(de, top);
}

inline __m256i load_i8x8(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

constexpr int sum16(int code_bits, int per) {  // quads whose vpmaddubsw pairs may be summed in int16
  const int pair = code_bits == 8 ? 2 * 128 * 127 : 2 * ((1 << code_bits) - 1) * 127;
  int n = 1;
  while (2 * n * pair <= 32767 && 2 * n <= 8 / per) n *= 2;
  return n;
}

// Sub-block p's dots of 8 columns with one row, times the row's block scale m: codes(q) gives quad
// q's bytes (for q8_0, c + 128), xq the row's block as int32 quads, xsum its sub-block sums. The
// vpmaddubsw pairs are summed in int16 SUM16 quads at a time, then in int32; A m < 2^19 2^11.
template <int KIND, typename Codes, bool SCALED = true>
inline __m256i scaled_dots8(const int32_t* xq, const int32_t* xsum, __m256i m, int p, Codes codes) {
  constexpr QKind KD = KINDS[KIND];
  constexpr int PER = BLOCK / KD.sub, OFFSET = KD.offset;
  constexpr bool SIGNED = KD.code_bits == 8;
  constexpr int SUM16 = sum16(KD.code_bits, PER);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i d32 = _mm256_setzero_si256();
  for (int q0 = p * 8 / PER; q0 < (p + 1) * 8 / PER; q0 += SUM16) {
    __m256i d16 = _mm256_setzero_si256();
    for (int q = q0; q < q0 + SUM16; ++q) {
      const __m256i x = _mm256_set1_epi32(xq[q]);
      const __m256i c = codes(q);
      if constexpr (SIGNED)
        d16 = _mm256_add_epi16(d16, _mm256_maddubs_epi16(_mm256_abs_epi8(c), _mm256_sign_epi8(x, c)));
      else
        d16 = _mm256_add_epi16(d16, _mm256_maddubs_epi16(c, x));
    }
    d32 = _mm256_add_epi32(d32, _mm256_madd_epi16(d16, ones));
  }
  if constexpr (OFFSET != 0 && !SIGNED) d32 = _mm256_sub_epi32(d32, _mm256_set1_epi32(OFFSET * xsum[p]));
  if constexpr (!SCALED) return d32;  // A itself (group_super8)
  return _mm256_mullo_epi32(d32, m);
}

// q6_k's top two bits into the nibbles of columns 8h..8h+7 (add_top_bits, eight columns).
inline void add_top_bits8(const uint8_t* bits, int h, __m256i* u) {
  const __m256i three = _mm256_set1_epi8(3);
  for (int row = 0; row < 2; ++row) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits + 64 * row + 32 * h));
    for (int i = 0; i < 4; ++i) {
      const __m256i two = _mm256_and_si256(_mm256_srli_epi16(v, 2 * i), three);
      u[4 * row + i] = _mm256_or_si256(u[4 * row + i], _mm256_slli_epi16(two, 4));
    }
  }
}

inline __m256i plane_u8x8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// super_scales for columns 8h..8h+7: into sup[t][8h..8h + 8).
inline void super_scales8(const uint8_t* head, bool q6, int h, __m256i top, int32_t (*sup)[GROUP], __m256i* sexp,
                          __m256i* mexp) {
  __m256i dm;
  decode_f16x8(head + 16 * h, top, &dm, sexp);
  const auto put = [&](int t, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(sup[t] + 8 * h), v); };
  if (q6) {
    for (int t = 0; t < 16; ++t) put(t, _mm256_mullo_epi32(dm, load_i8x8(head + 2 * GROUP + 16 * t + 8 * h)));
    return;
  }
  __m256i mm;
  decode_f16x8(head + 2 * GROUP + 16 * h, top, &mm, mexp);
  const uint8_t* planes = head + 4 * GROUP + 8 * h;
  const auto byte = [&](int t) { return plane_u8x8(planes + 16 * t); };
  const __m256i low6 = _mm256_set1_epi32(63), low4 = _mm256_set1_epi32(15);
  for (int i = 0; i < SUPER_BLOCKS; ++i) {
    __m256i sc, m;
    if (i < 4) {
      sc = _mm256_and_si256(byte(i), low6);
      m = _mm256_and_si256(byte(i + 4), low6);
    } else {
      const __m256i rest = byte(i + 4);
      sc = _mm256_or_si256(_mm256_and_si256(rest, low4), _mm256_slli_epi32(_mm256_srli_epi32(byte(i - 4), 6), 4));
      m = _mm256_or_si256(_mm256_srli_epi32(rest, 4), _mm256_slli_epi32(_mm256_srli_epi32(byte(i), 6), 4));
    }
    put(i, _mm256_mullo_epi32(dm, sc));
    put(SUPER_BLOCKS + i, _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_mullo_epi32(mm, m)));
  }
}

// The SUPER form on AVX2 (group_super's sums, eight columns to a register): per super-block the
// head decoded once into int32 sub-block scales (and Q4_K's minimums) and, per column, dm, -dminm
// and the shifts E - top, F - top; per row and block the dots A (not yet times m) times sc added
// to int32 sums (below 2^27), and Q4_K's m times the block's sum of xq (below 2^21); at the
// super-block's end each sum times dm m (or -dminm m, below 2^22: vpmuldq gives the int64 term,
// below 2^49) goes onto the grid once (add_terms4: a negative shift rounds as on_grid does).
template <int R, int KIND>
void group_super8(const Layout& L, const uint8_t* packed, const RowQ* rows, int64_t r0, int64_t g, int shift0,
                  const int32_t* top, int64_t* acc) {
  constexpr bool Q6 = KIND == Q6K;
  constexpr int PER = Q6 ? 2 : 1;
  const int term_bits = L.kind.term_bits;
  __m256i a[R][4];  // int64 sums of columns 4c..4c+3
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) a[r][c] = _mm256_setzero_si256();
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const int64_t ahead = prefetch_distance(L, r0);
  alignas(32) int32_t sc[16][GROUP];
  alignas(32) int32_t dm[2][GROUP], sexp[2][GROUP];  // [dot, minimum][column]: dm and -dminm, E - top and F - top
  for (int64_t sb = 0; sb < L.blocks / SUPER_BLOCKS; ++sb) {
    __m256i dsum[R][2], msum[R][2];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) dsum[r][h] = msum[r][h] = _mm256_setzero_si256();
    for (int i = 0; i < SUPER_BLOCKS; ++i) {
      const int64_t b = sb * SUPER_BLOCKS + i;
      const uint8_t* rec = streamed_record(packed, L, g, b, ahead);
      if (i == 0) {
        const uint8_t* head = super_head(rec, L, b);
        for (int h = 0; h < 2; ++h) {
          const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(top + 8 * h));
          const auto put = [&](int32_t* at, __m256i v) { _mm256_store_si256(reinterpret_cast<__m256i*>(at + 8 * h), v); };
          __m256i d, e;
          decode_f16x8(head + 16 * h, t, &d, &e);
          put(dm[0], d);
          put(sexp[0], e);
          if constexpr (Q6) {
            for (int q = 0; q < 16; ++q) put(sc[q], load_i8x8(head + 2 * GROUP + 16 * q + 8 * h));
          } else {
            decode_f16x8(head + 2 * GROUP + 16 * h, t, &d, &e);
            put(dm[1], _mm256_sub_epi32(_mm256_setzero_si256(), d));
            put(sexp[1], e);
            const uint8_t* planes = head + 4 * GROUP + 8 * h;
            const auto byte = [&](int q) { return plane_u8x8(planes + 16 * q); };
            const __m256i low6 = _mm256_set1_epi32(63), low4 = _mm256_set1_epi32(15);
            for (int j = 0; j < SUPER_BLOCKS; ++j) {
              __m256i s, m;
              if (j < 4) {
                s = _mm256_and_si256(byte(j), low6);
                m = _mm256_and_si256(byte(j + 4), low6);
              } else {
                const __m256i rest = byte(j + 4);
                s = _mm256_or_si256(_mm256_and_si256(rest, low4), _mm256_slli_epi32(_mm256_srli_epi32(byte(j - 4), 6), 4));
                m = _mm256_or_si256(_mm256_srli_epi32(rest, 4), _mm256_slli_epi32(_mm256_srli_epi32(byte(j), 6), 4));
              }
              put(sc[j], s);
              put(sc[SUPER_BLOCKS + j], m);
            }
          }
        }
      }
      for (int h = 0; h < 2; ++h) {
        __m256i u[8];  // quad q of columns 8h..8h+7
        for (int q = 0; q < 4; ++q) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + q * 64 + 32 * h));
          u[q] = _mm256_and_si256(v, nib);
          u[q + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        }
        if constexpr (Q6) add_top_bits8(rec + L.code_bytes, h, u);
        if constexpr (KIND == Q5K) {  // the fifth bits (add_fifth_bit, eight columns)
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + L.code_bytes + 32 * h));
          for (int q = 0; q < 8; ++q) {
            const __m256i at4 = q <= 4 ? _mm256_slli_epi16(v, 4 - q) : _mm256_srli_epi16(v, q - 4);
            u[q] = _mm256_or_si256(u[q], _mm256_and_si256(at4, _mm256_set1_epi8(0x10)));
          }
        }
        const auto get = [&](int q) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(sc[q] + 8 * h)); };
        const __m256i s0 = get(Q6 ? 2 * i : i), s1 = get(Q6 ? 2 * i + 1 : SUPER_BLOCKS + i);
        for (int r = 0; r < R; ++r) {
          const RowQ& row = rows[r0 + r];
          const int32_t* xq = reinterpret_cast<const int32_t*>(row.xq + b * BLOCK);
          const int32_t* xsum = row.xsum.data() + b * PER;
          const auto codes = [&](int q) { return u[q]; };
          const __m256i one = _mm256_set1_epi32(1);
          const __m256i a0 = scaled_dots8<KIND, decltype(codes), false>(xq, xsum, one, 0, codes);
          if constexpr (Q6) {
            const __m256i a1 = scaled_dots8<KIND, decltype(codes), false>(xq, xsum, one, 1, codes);
            dsum[r][h] = _mm256_add_epi32(dsum[r][h], _mm256_add_epi32(_mm256_mullo_epi32(a0, s0), _mm256_mullo_epi32(a1, s1)));
          } else {
            dsum[r][h] = _mm256_add_epi32(dsum[r][h], _mm256_mullo_epi32(a0, s0));
            msum[r][h] = _mm256_add_epi32(msum[r][h], _mm256_mullo_epi32(s1, _mm256_set1_epi32(xsum[0])));
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const RowQ& row = rows[r0 + r];
      const __m256i m = _mm256_set1_epi32(row.m[sb]);
      const __m256i kshift = _mm256_set1_epi64x(row.kdelta[sb] + shift0);
      for (int t = 0; t < (Q6 ? 1 : 2); ++t) {  // the dot term, then Q4_K's minimum term
        __m256i ints[4], shifts[4];
        for (int h = 0; h < 2; ++h) {
          const __m256i f = _mm256_mullo_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(dm[t] + 8 * h)), m);
          const __m256i e = _mm256_load_si256(reinterpret_cast<const __m256i*>(sexp[t] + 8 * h));
          const __m256i v = t == 0 ? dsum[r][h] : msum[r][h];
          ints[2 * h] = _mm256_mul_epi32(widen4_lo(v), widen4_lo(f));
          ints[2 * h + 1] = _mm256_mul_epi32(widen4_hi(v), widen4_hi(f));
          shifts[2 * h] = _mm256_add_epi64(widen4_lo(e), kshift);
          shifts[2 * h + 1] = _mm256_add_epi64(widen4_hi(e), kshift);
        }
        add_terms4<4>(a[r], ints, shifts, term_bits);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * GROUP + 4 * c), a[r][c]);
}

// Sub-block i's scales of columns 8h..8h+7 from super_scales8's sup.
inline void super_block_scales8(const int32_t (*sup)[GROUP], int i, bool q6, int h, __m256i* s0, __m256i* s1,
                                __m256i* mv) {
  const auto get = [&](int t) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sup[t] + 8 * h)); };
  *s0 = get(q6 ? 2 * i : i);
  if (q6)
    *s1 = get(2 * i + 1);
  else
    *mv = get(SUPER_BLOCKS + i);
}

template <int R, int FORM, int KIND>
void group_vector(const Layout& L, const uint8_t* packed, const RowQ* rows, int64_t r0, int64_t g, int shift0,
                  const int32_t* top, int64_t* acc) {
  if constexpr (FORM == SUPER) {  // the file's form: its own kernel
    group_super8<R, KIND>(L, packed, rows, r0, g, shift0, top, acc);
    return;
  }
  constexpr QKind KD = KINDS[KIND];  // the kind's traits as constants: no branch left in the block loop
  constexpr bool NIBBLES = KD.nibbles || FORM == SUPER, HAS_MIN = KD.has_min;
  constexpr bool TOP_BITS = FORM == SUPER && KIND == Q6K;  // q6_k's codes: a nibble and two bits
  constexpr int PER = BLOCK / KD.sub;
  constexpr bool SIGNED = KD.code_bits == 8;  // q8_0: c = u - 128 as a signed byte
  constexpr int BPG = KD.act / BLOCK;  // blocks per activation group: 1, or 8 (the K-quants)
  const int term_bits = L.kind.term_bits;
  __m256i a[R][4];
  __m256i sdot[R][4], smin[R][4];  // BPG > 1: the super-block's sums so far
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) a[r][c] = sdot[r][c] = smin[r][c] = _mm256_setzero_si256();
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i top_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(top));
  const __m256i top_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(top + 8));
  const int64_t ahead = prefetch_distance(L, r0);
  alignas(32) int32_t sup[16][GROUP];  // SUPER: the super-block's scales (super_scales8), both halves
  __m256i sup_sexp[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, sup_mexp[2] = {sup_sexp[0], sup_sexp[0]};
  for (int64_t b = 0; b < L.blocks; ++b) {
    const uint8_t* rec = streamed_record(packed, L, g, b, ahead);
    __m256i u[8][2];  // quad q, columns 8h..8h+7
    for (int h = 0; h < 2; ++h) {
      if constexpr (NIBBLES) {
        for (int q = 0; q < 4; ++q) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + q * 64 + 32 * h));
          u[q][h] = _mm256_and_si256(v, nib);
          u[q + 4][h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        }
      } else {
        for (int q = 0; q < 8; ++q) {
          u[q][h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + q * 64 + 32 * h));
          if constexpr (SIGNED) u[q][h] = _mm256_xor_si256(u[q][h], _mm256_set1_epi8(static_cast<char>(0x80)));
        }
      }
      if constexpr (TOP_BITS) {
        __m256i half[8];
        for (int q = 0; q < 8; ++q) half[q] = u[q][h];
        add_top_bits8(rec + L.code_bytes, h, half);
        for (int q = 0; q < 8; ++q) u[q][h] = half[q];
      }
    }
    __m256i s0[2], sexp[2], mv[2], mexp[2], s1[2];
    for (int h = 0; h < 2; ++h) {
      mv[h] = mexp[h] = s1[h] = _mm256_setzero_si256();
      const __m256i t = h == 0 ? top_lo : top_hi;
      if constexpr (FORM == SUPER) {  // the super-block's scales decoded at its first block
        const int i = static_cast<int>(b % SUPER_BLOCKS);
        if (i == 0) super_scales8(super_head(rec, L, b), KIND == Q6K, h, t, sup, &sup_sexp[h], &sup_mexp[h]);
        super_block_scales8(sup, i, KIND == Q6K, h, &s0[h], &s1[h], &mv[h]);
        sexp[h] = sup_sexp[h];
        mexp[h] = sup_mexp[h];
      } else if constexpr (FORM == F16) {
        decode_f16x8(rec + L.code_bytes + 16 * h, t, &s0[h], &sexp[h]);
        if constexpr (HAS_MIN) decode_f16x8(rec + L.min_at + 16 * h, t, &mv[h], &mexp[h]);
      } else {
        s0[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + L.code_bytes + 32 * h));
        sexp[h] = load_i8x8(rec + L.sexp_at + 8 * h);
        if constexpr (HAS_MIN) {
          mv[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + L.min_at + 32 * h));
          mexp[h] = load_i8x8(rec + L.mexp_at + 8 * h);
        }
      }
    }
    // The scales and shifts of columns 4c..4c+3 as int64 lanes, shared by the rows.
    __m256i s64[4], sexp64[4], m64[4], mexp64[4], s1_64[4];
    for (int h = 0; h < 2; ++h) {
      s64[2 * h] = widen4_lo(s0[h]), s64[2 * h + 1] = widen4_hi(s0[h]);
      sexp64[2 * h] = widen4_lo(sexp[h]), sexp64[2 * h + 1] = widen4_hi(sexp[h]);
      m64[2 * h] = widen4_lo(mv[h]), m64[2 * h + 1] = widen4_hi(mv[h]);
      mexp64[2 * h] = widen4_lo(mexp[h]), mexp64[2 * h + 1] = widen4_hi(mexp[h]);
      if constexpr (PER == 2) {
        if constexpr (FORM != SUPER)
          s1[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + L.code_bytes + 4 * GROUP + 32 * h));
        s1_64[2 * h] = widen4_lo(s1[h]), s1_64[2 * h + 1] = widen4_hi(s1[h]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const RowQ& row = rows[r0 + r];
      const int32_t* xq = reinterpret_cast<const int32_t*>(row.xq + b * BLOCK);
      const int32_t* xsum = row.xsum.data() + b * PER;
      const int64_t gi = b / BPG;  // the row's activation group
      const int row_shift = row.kdelta[gi] + shift0;
      const __m256i m = _mm256_set1_epi32(row.m[gi]);
      __m256i dots[PER][2];  // per scale (half of the block), per 8 columns
      for (int h = 0; h < 2; ++h)
        for (int p = 0; p < PER; ++p) dots[p][h] = scaled_dots8<KIND>(xq, xsum, m, p, [&](int q) { return u[q][h]; });
      const __m256i kshift = _mm256_set1_epi64x(row_shift);
      __m256i ints[4], shifts[4];
      for (int c = 0; c < 4; ++c) {
        const int h = c / 2;
        const auto quarter = [&](__m256i v) { return c % 2 == 0 ? widen4_lo(v) : widen4_hi(v); };
        ints[c] = _mm256_mul_epi32(quarter(dots[0][h]), s64[c]);
        if constexpr (PER == 2) ints[c] = _mm256_add_epi64(ints[c], _mm256_mul_epi32(quarter(dots[1][h]), s1_64[c]));
        shifts[c] = _mm256_add_epi64(sexp64[c], kshift);
      }
      if constexpr (BPG > 1) {
        // the K-quants: the super-block's exact sums (m is its one scale: S (A m) summed is
        // (S A summed) m), each put on the grid once at its last block
        for (int c = 0; c < 4; ++c) sdot[r][c] = _mm256_add_epi64(sdot[r][c], ints[c]);
        if constexpr (HAS_MIN) {
          const __m256i xs = _mm256_set1_epi64x(xsum[0] * row.m[gi]);  // the block's sum times m: below 2^23
          for (int c = 0; c < 4; ++c) smin[r][c] = _mm256_add_epi64(smin[r][c], _mm256_mul_epi32(m64[c], xs));
        }
        if (b % BPG == BPG - 1) {
          add_terms4<4>(a[r], sdot[r], shifts, term_bits);
          if constexpr (HAS_MIN) {
            for (int c = 0; c < 4; ++c) shifts[c] = _mm256_add_epi64(mexp64[c], kshift);
            add_terms4<4>(a[r], smin[r], shifts, term_bits);
          }
          for (int c = 0; c < 4; ++c) sdot[r][c] = smin[r][c] = _mm256_setzero_si256();
        }
        continue;
      }
      add_terms4<4>(a[r], ints, shifts, term_bits);
      if constexpr (HAS_MIN) {
        const __m256i xs = _mm256_set1_epi64x(row.sm[b]);
        const __m256i mshift = _mm256_set1_epi64x(row.sdelta[b] + shift0);
        for (int c = 0; c < 4; ++c) {
          ints[c] = _mm256_mul_epi32(m64[c], xs);
          shifts[c] = _mm256_add_epi64(mexp64[c], mshift);
        }
        add_terms4<4>(a[r], ints, shifts, term_bits);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * GROUP + 4 * c), a[r][c]);
}

// The same sums where no term of the tile can have a negative shift (group_rows checks the
// group's lows against the rows' kmin, smin): nothing to check, and each half of the group (8
// columns) runs on its own, so that its codes, scales and the rows' sums fit the sixteen
// registers. Terms are kept as the even and the odd columns' int64 lanes (vpmuldq multiplies the
// low int32 of each 64-bit lane: the odd columns shift down once, nothing widens), and a shift in
// [0, 63] reads from its int32 lane by a mask (even) or a shift (odd); a negative count, which
// only a zero term can have here, reads as more than 63 and adds 0, as the term itself would.
template <int R, int FORM, int KIND>
void group_unchecked(const Layout& L, const uint8_t* packed, const RowQ* rows, int64_t r0, int64_t g, int shift0,
                     const int32_t* top, int64_t* acc) {
  if constexpr (FORM == SUPER) {  // the file's form: its own kernel, which checks its few shifts
    group_super8<R, KIND>(L, packed, rows, r0, g, shift0, top, acc);
    return;
  }
  constexpr QKind KD = KINDS[KIND];
  constexpr bool NIBBLES = KD.nibbles || FORM == SUPER, HAS_MIN = KD.has_min;
  constexpr bool TOP_BITS = FORM == SUPER && KIND == Q6K;  // q6_k's codes: a nibble and two bits
  constexpr int PER = BLOCK / KD.sub;
  constexpr bool SIGNED = KD.code_bits == 8;
  constexpr int BPG = KD.act / BLOCK;  // blocks per activation group: 1, or 8 (the K-quants)
  __m256i even[R][2], odd[R][2];  // [row][half]
  __m256i sde[R][2], sdo[R][2], sme[R][2], smo[R][2];  // BPG > 1: the super-block's sums so far
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) even[r][h] = odd[r][h] = sde[r][h] = sdo[r][h] = sme[r][h] = smo[r][h] = _mm256_setzero_si256();
  const __m256i nib = _mm256_set1_epi8(0x0F), low32 = _mm256_set1_epi64x(0xFFFFFFFF);
  const int64_t ahead = prefetch_distance(L, r0);
  alignas(32) int32_t sup[16][GROUP];  // SUPER: the super-block's scales (super_scales8), both halves
  __m256i sup_sexp[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, sup_mexp[2] = {sup_sexp[0], sup_sexp[0]};
  for (int64_t b = 0; b < L.blocks; ++b) {
    const uint8_t* rec = streamed_record(packed, L, g, b, ahead);
    for (int h = 0; h < 2; ++h) {
      const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(top + 8 * h));
      __m256i s0, sexp, mv = _mm256_setzero_si256(), mexp = mv, s1 = mv;
      if constexpr (FORM == SUPER) {  // the super-block's scales decoded at its first block
        const int i = static_cast<int>(b % SUPER_BLOCKS);
        if (i == 0) super_scales8(super_head(rec, L, b), KIND == Q6K, h, t, sup, &sup_sexp[h], &sup_mexp[h]);
        super_block_scales8(sup, i, KIND == Q6K, h, &s0, &s1, &mv);
        sexp = sup_sexp[h];
        mexp = sup_mexp[h];
      } else if constexpr (FORM == F16) {
        decode_f16x8(rec + L.code_bytes + 16 * h, t, &s0, &sexp);
        if constexpr (HAS_MIN) decode_f16x8(rec + L.min_at + 16 * h, t, &mv, &mexp);
      } else {
        s0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + L.code_bytes + 32 * h));
        sexp = load_i8x8(rec + L.sexp_at + 8 * h);
        if constexpr (PER == 2) s1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + L.code_bytes + 4 * GROUP + 32 * h));
        if constexpr (HAS_MIN) {
          mv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + L.min_at + 32 * h));
          mexp = load_i8x8(rec + L.mexp_at + 8 * h);
        }
      }
      const __m256i s0_odd = _mm256_srli_epi64(s0, 32), s1_odd = _mm256_srli_epi64(s1, 32);
      const __m256i m_odd = _mm256_srli_epi64(mv, 32);
      // quad q of this half's 8 columns as bytes (R == 1 reads them where they are used)
      const auto codes = [&](int q) {
        if constexpr (TOP_BITS) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + (q % 4) * 64 + 32 * h));
          const __m256i low = q < 4 ? _mm256_and_si256(v, nib) : _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
          const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + L.code_bytes + 64 * (q / 4) + 32 * h));
          const __m256i two = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * (q % 4)), _mm256_set1_epi8(3));
          return _mm256_or_si256(low, _mm256_slli_epi16(two, 4));
        } else if constexpr (NIBBLES) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + (q % 4) * 64 + 32 * h));
          return q < 4 ? _mm256_and_si256(v, nib) : _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        } else {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + q * 64 + 32 * h));
          return SIGNED ? _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80))) : v;
        }
      };
      __m256i u[8];
      if constexpr (R > 1)
        for (int q = 0; q < 8; ++q) u[q] = codes(q);
      for (int r = 0; r < R; ++r) {
        const RowQ& row = rows[r0 + r];
        const int32_t* xq = reinterpret_cast<const int32_t*>(row.xq + b * BLOCK);
        const int32_t* xsum = row.xsum.data() + b * PER;
        const int64_t gi = b / BPG;  // the row's activation group
        const __m256i m = _mm256_set1_epi32(row.m[gi]);
        __m256i ints_even, ints_odd;
        for (int p = 0; p < PER; ++p) {
          const __m256i dot = scaled_dots8<KIND>(xq, xsum, m, p, [&](int q) { return R > 1 ? u[q] : codes(q); });
          const __m256i e = _mm256_mul_epi32(dot, p == 0 ? s0 : s1);
          const __m256i o = _mm256_mul_epi32(_mm256_srli_epi64(dot, 32), p == 0 ? s0_odd : s1_odd);
          ints_even = p == 0 ? e : _mm256_add_epi64(ints_even, e);
          ints_odd = p == 0 ? o : _mm256_add_epi64(ints_odd, o);
        }
        const __m256i shift = _mm256_add_epi32(sexp, _mm256_set1_epi32(row.kdelta[gi] + shift0));
        if constexpr (BPG > 1) {  // the K-quants: exact sums over the super-block, on the grid at its last block
          sde[r][h] = _mm256_add_epi64(sde[r][h], ints_even);
          sdo[r][h] = _mm256_add_epi64(sdo[r][h], ints_odd);
          if constexpr (HAS_MIN) {
            const __m256i xs = _mm256_set1_epi64x(xsum[0] * row.m[gi]);  // the block's sum times m
            sme[r][h] = _mm256_add_epi64(sme[r][h], _mm256_mul_epi32(mv, xs));
            smo[r][h] = _mm256_add_epi64(smo[r][h], _mm256_mul_epi32(m_odd, xs));
          }
          if (b % BPG == BPG - 1) {
            even[r][h] = _mm256_add_epi64(even[r][h], _mm256_sllv_epi64(sde[r][h], _mm256_and_si256(shift, low32)));
            odd[r][h] = _mm256_add_epi64(odd[r][h], _mm256_sllv_epi64(sdo[r][h], _mm256_srli_epi64(shift, 32)));
            if constexpr (HAS_MIN) {
              const __m256i mshift = _mm256_add_epi32(mexp, _mm256_set1_epi32(row.kdelta[gi] + shift0));
              even[r][h] = _mm256_add_epi64(even[r][h], _mm256_sllv_epi64(sme[r][h], _mm256_and_si256(mshift, low32)));
              odd[r][h] = _mm256_add_epi64(odd[r][h], _mm256_sllv_epi64(smo[r][h], _mm256_srli_epi64(mshift, 32)));
            }
            sde[r][h] = sdo[r][h] = sme[r][h] = smo[r][h] = _mm256_setzero_si256();
          }
          continue;
        }
        even[r][h] = _mm256_add_epi64(even[r][h], _mm256_sllv_epi64(ints_even, _mm256_and_si256(shift, low32)));
        odd[r][h] = _mm256_add_epi64(odd[r][h], _mm256_sllv_epi64(ints_odd, _mm256_srli_epi64(shift, 32)));
        if constexpr (HAS_MIN) {
          const __m256i xs = _mm256_set1_epi64x(row.sm[b]);
          const __m256i mshift = _mm256_add_epi32(mexp, _mm256_set1_epi32(row.sdelta[b] + shift0));
          even[r][h] = _mm256_add_epi64(even[r][h], _mm256_sllv_epi64(_mm256_mul_epi32(mv, xs), _mm256_and_si256(mshift, low32)));
          odd[r][h] = _mm256_add_epi64(odd[r][h], _mm256_sllv_epi64(_mm256_mul_epi32(m_odd, xs), _mm256_srli_epi64(mshift, 32)));
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) {
      alignas(32) int64_t e[4], o[4];
      _mm256_store_si256(reinterpret_cast<__m256i*>(e), even[r][h]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(o), odd[r][h]);
      for (int i = 0; i < 4; ++i) {
        acc[r * GROUP + 8 * h + 2 * i] = e[i];
        acc[r * GROUP + 8 * h + 2 * i + 1] = o[i];
      }
    }
}

#endif

#if defined(TF_QUANT_VNNI) || defined(TF_QUANT_AVX2)
// Rows [r0, r1) in register tiles of up to 4 rows (the codes of a block unpacked once serve them
// all; AVX2 over 30 layers at 4 rows: 13.3 ms against 17.7-19.8 with 2-row tiles): run(R, r) per
// tile, R an integral constant.
template <typename Run>
void by_row_tiles(int64_t r0, int64_t r1, const Run& run) {
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) run(std::integral_constant<int, 4>{}, r);
  switch (r1 - r) {
    case 3: return run(std::integral_constant<int, 3>{}, r);
    case 2: return run(std::integral_constant<int, 2>{}, r);
    case 1: return run(std::integral_constant<int, 1>{}, r);
    default: return;
  }
}
#endif

// Rows [r0, r1) against group g into acc [r1 - r0][16]; top: the group's 16 column tops.
void group_rows(const Layout& L, int kind, const uint8_t* packed, const RowQ* rows, int64_t r0, int64_t r1,
                int64_t g, int shift0, const int32_t* top, int64_t* acc) {
#if defined(TF_QUANT_VNNI) || defined(TF_QUANT_AVX2)
  [[maybe_unused]] const int32_t* lows = reinterpret_cast<const int32_t*>(packed + L.lows) + 2 * g;
  const auto tiles = [&](auto form, auto kind_id) {
#if defined(TF_QUANT_AMX)
    if (r1 - r0 >= AMX_MIN_ROWS && amx_allowed.load(std::memory_order_relaxed) && amx_granted())
      return group_amx<decltype(form)::value, decltype(kind_id)::value>(L, packed, rows, r0, r1, g, shift0, top,
                                                                         L.blocks * BLOCK, acc);
#endif
    by_row_tiles(r0, r1, [&](auto tile_rows, int64_t r) {
      constexpr int R = decltype(tile_rows)::value;
#if defined(TF_QUANT_AVX2)
      bool checked = false;  // whether a nonzero term of these rows can have a negative shift
      for (int i = 0; i < R; ++i)
        checked = checked || lows[0] + rows[r + i].kmin + shift0 < 0 ||
                  (L.kind.has_min && lows[1] + rows[r + i].smin + shift0 < 0);
      if (!checked)
        return group_unchecked<R, decltype(form)::value, decltype(kind_id)::value>(L, packed, rows, r, g, shift0, top,
                                                                                    acc + (r - r0) * GROUP);
#endif
      group_vector<R, decltype(form)::value, decltype(kind_id)::value>(L, packed, rows, r, g, shift0, top,
                                                                       acc + (r - r0) * GROUP);
    });
  };
  using F16_FORM = std::integral_constant<int, F16>;
  using WIDE_FORM = std::integral_constant<int, WIDE>;
  if (L.form == SUPER) {  // q4_k, q5_k or q6_k only
    if (kind == Q4K)
      tiles(std::integral_constant<int, SUPER>{}, std::integral_constant<int, Q4K>{});
    else if (kind == Q5K)
      tiles(std::integral_constant<int, SUPER>{}, std::integral_constant<int, Q5K>{});
    else
      tiles(std::integral_constant<int, SUPER>{}, std::integral_constant<int, Q6K>{});
  } else if (L.form == F16) {  // the 32-weight types with the file's float16 scales
    switch (kind) {
      case 0: return tiles(F16_FORM{}, std::integral_constant<int, 0>{});
      case 1: return tiles(F16_FORM{}, std::integral_constant<int, 1>{});
      default: return tiles(F16_FORM{}, std::integral_constant<int, 2>{});
    }
  } else {
    switch (kind) {  // quant_gemm.TYPES order, as KINDS
      case 0: return tiles(WIDE_FORM{}, std::integral_constant<int, 0>{});
      case 1: return tiles(WIDE_FORM{}, std::integral_constant<int, 1>{});
      case 2: return tiles(WIDE_FORM{}, std::integral_constant<int, 2>{});
      case 3: return tiles(WIDE_FORM{}, std::integral_constant<int, 3>{});
      case 4: return tiles(WIDE_FORM{}, std::integral_constant<int, 4>{});
      case 5: return tiles(WIDE_FORM{}, std::integral_constant<int, 5>{});
      default: return tiles(WIDE_FORM{}, std::integral_constant<int, 6>{});
    }
  }
#else
  (void)kind;
  group_scalar(L, packed, rows, r0, r1, g, shift0, top, acc);
#endif
}

// One GEMM of a batch (quant_linears): its layout and its rows' place in the batch's RowQ buffer.
struct GemmJob {
  const QuantJob* job;
  Layout L;
  int log_terms, shift0;
  int64_t row0;  // its rows' first index in the batch's activation blocks
  int64_t code0;  // where its rows' int8 codes start in the batch's code buffer (M rows of K)
  uint64_t call;  // the quant_linears call it belongs to (gemm_calls)
};

// Groups [g0, g1) of a job against all its rows, written to its out.
template <typename T>
void job_groups(const GemmJob& j, const RowQ* row_q, int64_t g0, int64_t g1) {
  const QuantJob& q = *j.job;
  const Layout& L = j.L;
  const uint8_t* packed = q.packed;
  const int kind = static_cast<int>(reinterpret_cast<const Header*>(packed)->kind);
  const int32_t* top = reinterpret_cast<const int32_t*>(packed + L.top);
  const RowQ* rows = row_q + j.row0;
  T* out = static_cast<T*>(q.out);
  int64_t acc[ROWS_PER_PASS * GROUP];
  current_call = j.call;
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t cols = std::min<int64_t>(GROUP, q.N - g * GROUP);
    for (int64_t r0 = 0; r0 < q.M; r0 += ROWS_PER_PASS) {
      const int64_t r1 = std::min(q.M, r0 + ROWS_PER_PASS);
      group_rows(L, kind, packed, rows, r0, r1, g, j.shift0, top + g * GROUP, acc);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const int grid = top[g * GROUP + c] + rows[r].kmax + L.kind.term_bits - 62 + j.log_terms;
          const double y = static_cast<double>(acc[(r - r0) * GROUP + c]) * pow2(grid);
          out[r * q.N + g * GROUP + c] = from_f32<T>(static_cast<float>(y));
        }
    }
  }
}

// The GEMMs of `jobs` in one parallel region: every job's rows quantized first, then tasks (runs
// of a job's neighbouring groups: one weight stream each) taken dynamically across all jobs, so a
// batch of small GEMMs (a token's experts) pays one fork and two barriers, not one per GEMM.
template <typename T>
void quant_linears_impl(const QuantJob* jobs, int64_t count, int threads) {
  // The batch's jobs and tasks, in buffers each calling thread keeps (a decode round runs a
  // hundred GEMMs: no allocation each).
  static thread_local std::vector<GemmJob> js;
  static thread_local std::vector<std::pair<int64_t, int64_t>> tasks;  // (job, first group); a task runs to the next's
  static thread_local std::vector<int64_t> task_end;
  js.clear();
  tasks.clear();
  task_end.clear();
  int64_t total_rows = 0, total_groups = 0, total_codes = 0, widest = 0;
  const uint64_t call = ++gemm_calls;
  for (int64_t i = 0; i < count; ++i) {
    const QuantJob& q = jobs[i];
    if (q.M == 0 || q.N == 0) continue;
    const Header* h = reinterpret_cast<const Header*>(q.packed);
    const Layout L(static_cast<int>(h->kind), static_cast<int>(h->form), q.N, q.K);
    // the reference's #terms: per activation group one dot term, and one minimum term
    const int log_terms = log2_ceil(L.blocks / (L.kind.act / BLOCK) * (L.kind.has_min ? 2 : 1));
    js.push_back({&q, L, log_terms, 62 - log_terms - L.kind.term_bits, total_rows, total_codes, call});
    total_rows += q.M;
    total_codes += q.M * q.K;
    widest = std::max(widest, q.K);
    total_groups += L.groups;
  }
  // The rows' activation blocks, in buffers each calling thread keeps across calls (their vectors
  // keep their capacity: a decode step's GEMMs allocate nothing after the first).
  static thread_local std::vector<RowQ> rows;
  if (static_cast<int64_t>(rows.size()) < total_rows) rows.resize(total_rows);
  RowQ* row_q = rows.data();  // (inside the parallel region `rows` would name each thread's own)
  // Their int8 codes in one buffer, a GEMM's rows K apart (tile loads read rows at a stride), and
  // TILE_ROWS rows of slack after the last, which a tile of a GEMM's last rows may read past them.
  static thread_local std::vector<int8_t> codes;
  if (static_cast<int64_t>(codes.size()) < total_codes + TILE_ROWS * widest) codes.resize(total_codes + TILE_ROWS * widest);
  for (const GemmJob& j : js)
    for (int64_t r = 0; r < j.job->M; ++r) row_q[j.row0 + r].xq = codes.data() + j.code0 + r * j.job->K;
  // Tasks: a few per thread, taken dynamically, so a thread the OS parks takes fewer instead of
  // stalling all; each within one job.
  const int64_t wanted = threads > 1 ? 4 * threads : 1, per_task = std::max<int64_t>(1, total_groups / wanted);
  for (int64_t i = 0; i < static_cast<int64_t>(js.size()); ++i) {
    const int64_t groups = js[i].L.groups, n = std::max<int64_t>(1, std::min(groups, (groups + per_task / 2) / per_task));
    for (int64_t t = 0; t < n; ++t) {
      tasks.emplace_back(i, t * groups / n);
      task_end.push_back((t + 1) * groups / n);
    }
  }
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  // (inside the parallel region the thread_local names would be each thread's own)
  const GemmJob *job_p = js.data(), *job_end = js.data() + js.size();
  const std::pair<int64_t, int64_t>* task_p = tasks.data();
  const int64_t* end_p = task_end.data();
#pragma omp parallel num_threads(threads) if (num_tasks > 1)
  {
    // Each row's activations quantized by one thread (row-local: which one cannot matter); every
    // row is done before any group starts (the implicit barrier).
#pragma omp for schedule(static)
    for (int64_t r = 0; r < total_rows; ++r) {
      const GemmJob* it = std::upper_bound(job_p, job_end, r,
                                           [](int64_t row, const GemmJob& j) { return row < j.row0; }) - 1;
      const QuantJob& q = *it->job;
      quantize_row(static_cast<const T*>(q.x) + (r - it->row0) * q.K, it->L.blocks, it->L.kind, &row_q[r]);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < num_tasks; ++t) job_groups<T>(job_p[task_p[t].first], row_q, task_p[t].second, end_p[t]);
  }
}

}  // namespace

void quant_rows(const uint8_t* packed, const int64_t* ids, int64_t count, float* out, int64_t N, int64_t K) {
  const Header* h = reinterpret_cast<const Header*>(packed);
  const Layout L(static_cast<int>(h->kind), static_cast<int>(h->form), N, K);
  const QKind& kd = L.kind;
  const int32_t* top = reinterpret_cast<const int32_t*>(packed + L.top);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = ids[i], g = n / GROUP;
    const int j = static_cast<int>(n % GROUP);
    for (int64_t b = 0; b < L.blocks; ++b) {
      const uint8_t* rec = record_at(packed, L, g, b);
      const ColumnScales c = column_scales(rec, L, b, j, top[n]);
      const float low = kd.has_min ? static_cast<float>(static_cast<double>(c.min) * pow2(c.mexp + top[n])) : 0.0f;
      for (int k = 0; k < BLOCK; ++k) {
        const int code = code_at(rec, L, j, k) - kd.offset;
        const int64_t sc = c.s[k / kd.sub];
        float w = static_cast<float>(static_cast<double>(sc * code) * pow2(c.sexp + top[n]));
        if (kd.has_min) w = w + low;
        out[i * K + b * BLOCK + k] = w;
      }
    }
  }
}

const char* quant_amx_path() {
#if defined(TF_QUANT_AMX)
  if (!amx_granted()) return "off: the kernel refused the tile state (arch_prctl ARCH_REQ_XCOMP_PERM)";
  return amx_allowed.load() ? "amx" : "off: set_quant_amx(False)";
#else
  return "off: not built with AMX-INT8 (-march without amx-tile and amx-int8)";
#endif
}

bool set_quant_amx(bool allowed) { return amx_allowed.exchange(allowed); }

void quant_linear(int dtype, const void* x, const uint8_t* packed, void* out, int64_t M, int64_t N, int64_t K,
                  int threads) {
  const QuantJob job{x, packed, out, M, N, K};
  quant_linears(dtype, &job, 1, threads);
}

void quant_linears(int dtype, const QuantJob* jobs, int64_t count, int threads) {
  if (dtype == 0)
    quant_linears_impl<float>(jobs, count, threads);
  else
    quant_linears_impl<bf16>(jobs, count, threads);
}

}  // namespace tf
