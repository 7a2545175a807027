// The AVX-512 VNNI path, 16 columns to a register: a block's dots are 8 vpdpbusd (u8 x s8 ->
// int32); the 32-column kinds carry their terms exactly in float64 lanes (row_terms); a K-quant
// super-block's products are summed in int32 (the file's form: sc A with vpmulld, dm applied once,
// group_super) or in float64 lanes (the wide form: every product an integer times the
// super-block's one power of two, the sums below 2^53), and each term is rounded to int64 once.
// The AMX path (quant_gemm_amx.h) takes its codes, scales and terms from here.
#pragma once

#include <cstdint>

#include "quant_gemm.h"
#include "quant_gemm_common.h"

#if defined(TF_QUANT_VNNI)

namespace tf {
namespace {

using namespace quant;

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

// u | (bits & mask), byte by byte, in one vpternlogd.
inline __m512i or_masked(__m512i u, __m512i bits, __m512i mask) { return _mm512_ternarylogic_epi32(u, bits, mask, 0xF8); }

// q6_k's top two bits into its codes' nibbles u[0..8): quad q's in bits 2 (q % 4) of row q / 4 of
// `bits`, moved to bits 4-5 by a 16-bit shift (the mask keeps the byte's own two).
inline void add_top_bits(const uint8_t* bits, __m512i* u) {
  const __m512i at45 = _mm512_set1_epi8(0x30);
  for (int row = 0; row < 2; ++row) {
    const __m512i v = _mm512_loadu_si512(bits + 64 * row);
    __m512i* quads = u + 4 * row;
    quads[0] = or_masked(quads[0], _mm512_slli_epi16(v, 4), at45);
    quads[1] = or_masked(quads[1], _mm512_slli_epi16(v, 2), at45);
    quads[2] = or_masked(quads[2], v, at45);
    quads[3] = or_masked(quads[3], _mm512_srli_epi16(v, 2), at45);
  }
}

// q5_k's fifth bits into its codes' nibbles u[0..8): quad q's in bit q of each byte of `bits`
// (16-bit shifts that move bit q to bit 4 of the same byte).
inline void add_fifth_bit(const uint8_t* bits, __m512i* u) {
  const __m512i v = _mm512_loadu_si512(bits), bit4 = _mm512_set1_epi8(0x10);
  for (int q = 0; q < 8; ++q)
    u[q] = or_masked(u[q], q == 4 ? v : q < 4 ? _mm512_slli_epi16(v, 4 - q) : _mm512_srli_epi16(v, q - 4), bit4);
}

inline __m512i plane_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// A zmm's 16 int32 lanes as unpack_k_scale's V (the casts to and from __m512i move no bits).
typedef uint32_t u32x16 __attribute__((vector_size(64)));

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

// 16 int32 lanes as float64, columns 0-7 and 8-15 (exact).
inline void int32_pd(__m512i v, __m512d* out) {
  out[0] = _mm512_cvtepi32_pd(_mm512_castsi512_si256(v));
  out[1] = _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(v, 1));
}

// x 2^e, lane by lane, for int32 x and e (vscalefpd: exact, as nothing leaves float64's range).
inline void scaled_pd(__m512i x, __m512i e, __m512d* out) {
  __m512d xd[2], ed[2];
  int32_pd(x, xd);
  int32_pd(e, ed);
  for (int h = 0; h < 2; ++h) out[h] = _mm512_scalef_pd(xd[h], ed[h]);
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

// Group g's block b (codes at rec) in the WIDE or F16 form (the file's K-quant form takes its
// super-block's factors instead: super_factors); units: group_units. The float16 scales (F16) are
// the file's d = S 2^E itself, so S 2^(E - top + shift0) = d units.
template <int FORM, int KIND>
inline BlockScales block_scales(const uint8_t* rec, const Layout& L, __m512i topv, int shift0, const __m512d* units) {
  static_assert(FORM != SUPER, "the SUPER form's scales are super_factors'");
  constexpr QKind KD = KINDS[KIND];
  constexpr bool HAS_MIN = KD.has_min;
  constexpr int PER = BLOCK / KD.sub;
  __m512i s0, s1 = _mm512_setzero_si512(), mv = s1, sexp, mexp = s1;
  if constexpr (FORM == F16) {
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
// (8-15): a0 the block's dots less the offset term (block_dots; PER == 2: the first half's, a1
// the second's), times the columns' S 2^(E - top + shift0), times the row's
// m 2^(k - kmax), rounded onto the grid; then, for the kinds with a minimum, M sm on the grid.
//
// Exact, though in float64: each term is the reference's integer (|I| < 2^T, T = 41 for the
// 32-column kinds this serves) times a power of two. Its factors are integers times powers of two and every
// product and the halves' sum stay below 2^53 times their power of two, so no operation rounds
// (exponents stay far inside float64's range), and the conversion's one rounding, to nearest even,
// is on_grid's where the shift is negative. The same order of operations for every row.
template <int KIND>
inline void row_terms(__m512i a0, __m512i a1, const BlockScales& c, const RowQ& row, int64_t b, __m512i* lo,
                      __m512i* hi) {
  constexpr QKind KD = KINDS[KIND];
  constexpr int PER = BLOCK / KD.sub;
  const __m512d m = _mm512_set1_pd(row.mf[b]);
  __m512d t[2];
  __m512d d0[2];
  int32_pd(a0, d0);
  if constexpr (PER == 1) {
    for (int h = 0; h < 2; ++h) t[h] = _mm512_mul_pd(_mm512_mul_pd(d0[h], c.s[0][h]), m);
  } else {  // two halves of 16, each with its own scale: A0 S0 + A1 S1, then times m
    __m512d d1[2];
    int32_pd(a1, d1);
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

// The 32-column kinds where the tile's terms may be summed before they are rounded (float_chunk
// says for how many blocks): one row's terms of a block for 16 columns added to its float64 sums,
// A m 2^(k - kmax) times S 2^(E - top + shift0), and for the kinds with a minimum M sm on the grid.
// Exact: A m is below 2^30 and each product below 2^53 times its power of two; every term is an
// integer on the grid (no shift is negative) and a chunk's sums stay below 2^53 times the smallest
// term's power of two, so no fused multiply-add rounds, and the sums' conversion (flush_sums) is
// the sum of the reference's terms.
template <int KIND>
inline void row_chunk_products(__m512i a, const BlockScales& c, const RowQ& row, int64_t b, __m512d* sum) {
  const __m512d m = _mm512_set1_pd(row.mf[b]);
  __m512d d[2];
  int32_pd(a, d);
  for (int h = 0; h < 2; ++h) sum[h] = _mm512_fmadd_pd(_mm512_mul_pd(d[h], m), c.s[0][h], sum[h]);
  if constexpr (KINDS[KIND].has_min) {
    const __m512d sm = _mm512_set1_pd(row.smf[b]);
    for (int h = 0; h < 2; ++h) sum[h] = _mm512_fmadd_pd(c.mn[h], sm, sum[h]);
  }
}

// A chunk's float64 sums (integers, exact) into the int64 sums lo and hi, and zeroed (group_blocks, CHUNKED).
inline void flush_sums(__m512d* sum, __m512i* lo, __m512i* hi) {
  *lo = _mm512_add_epi64(*lo, round_pd(sum[0]));
  *hi = _mm512_add_epi64(*hi, round_pd(sum[1]));
  sum[0] = sum[1] = _mm512_setzero_pd();
}

// The K-quants (act 256): one row's products of a block for 16 columns added to its super-block's
// float64 sums: dsum += A S 2^(E - top + shift0) per sub-block (A = a0, a1: the dots less the offset
// term, block_dots), and for q4_k / q5_k msum += M 2^(F - top + shift0) times the block's
// sum of xq. Exact: E (and F) is one per super-block (pack_quant checks it), so every product is
// an integer times the same power of two, and the integers' sums stay below 2^53 (a super-block's
// S A below 2^38, M sum(xq) below 2^32: quant_gemm.KINDS' bounds), so the fused multiply-adds
// round nothing. row_super_terms then rounds each sum once, as the reference rounds its one term.
template <int KIND>
inline void row_super_products(__m512i a0, __m512i a1, const BlockScales& c, const RowQ& row, int64_t b,
                               __m512d* dsum, __m512d* msum) {
  constexpr QKind KD = KINDS[KIND];
  constexpr int PER = BLOCK / KD.sub;
  const int32_t* xsum = row.xsum.data() + b * PER;
  __m512d d0[2];
  int32_pd(a0, d0);
  for (int h = 0; h < 2; ++h) dsum[h] = _mm512_fmadd_pd(d0[h], c.s[0][h], dsum[h]);
  if constexpr (PER == 2) {
    __m512d d1[2];
    int32_pd(a1, d1);
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
  const auto byte = [&](int t) { return (u32x16)plane_u8(planes + 16 * t); };
  for (int i = 0; i < SUPER_BLOCKS; ++i) {
    u32x16 s, m;
    unpack_k_scale(byte, i, &s, &m);
    _mm512_store_si512(sc[i], (__m512i)s);
    _mm512_store_si512(sc[SUPER_BLOCKS + i], (__m512i)m);
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

// A block's dots less the kind's offset times the row's sums, A = u . xq - offset sum(xq) = c . xq,
// for 16 columns against one row's 32 codes xq: h0 over its first four quads (k 0-15), h1 over
// its last four (k 16-31), each a chain of vpdpbusd that starts at minus the offset term
// (offset_starts), so that no subtraction follows. SPLIT: each half as two chains of two joined by
// an add, for a row alone (R == 1), whose blocks wait on the chains' latency; tiles of rows have
// other rows' chains to run meanwhile and take one chain of four, without the zeros and the adds.
// (An integer sum: any order gives the same value.) Always inlined: as a call (GCC's choice
// without it) the eight code registers went through the stack for every block and row.
template <bool SPLIT>
__attribute__((always_inline)) inline void block_dots(const __m512i* u, const int8_t* row_xq, __m512i start0,
                                                      __m512i start1, __m512i* h0, __m512i* h1) {
  const int32_t* xq = reinterpret_cast<const int32_t*>(row_xq);
  const auto dot = [&](__m512i acc, int q) { return _mm512_dpbusd_epi32(acc, u[q], _mm512_set1_epi32(xq[q])); };
  if constexpr (SPLIT) {
    *h0 = _mm512_add_epi32(dot(dot(start0, 0), 2), dot(dot(_mm512_setzero_si512(), 1), 3));
    *h1 = _mm512_add_epi32(dot(dot(start1, 4), 6), dot(dot(_mm512_setzero_si512(), 5), 7));
  } else {
    *h0 = dot(dot(dot(dot(start0, 0), 1), 2), 3);
    *h1 = dot(dot(dot(dot(start1, 4), 5), 6), 7);
  }
}

// Where block_dots' chains start for block b of a row: minus the kind's offset times the row's
// sums of xq over each half (PER == 2: sub-blocks of 16) or over the whole block (PER == 1: all
// of it on the first half, whose dots the second's join).
template <int KIND>
inline void offset_starts(const RowQ& row, int64_t b, __m512i* start0, __m512i* start1) {
  constexpr QKind KD = KINDS[KIND];
  constexpr int PER = BLOCK / KD.sub;
  *start0 = *start1 = _mm512_setzero_si512();
  if constexpr (KD.offset != 0) {
    const int32_t* xsum = row.xsum.data() + b * PER;
    *start0 = _mm512_set1_epi32(-KD.offset * xsum[0]);
    if constexpr (PER == 2) *start1 = _mm512_set1_epi32(-KD.offset * xsum[1]);
  }
}

// R rows' int64 sums, columns 0-7 (lo) and 8-15 (hi), into acc [R][16].
template <int R>
inline void store_sums(const __m512i* lo, const __m512i* hi, int64_t* acc) {
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_si512(acc + r * GROUP, lo[r]);
    _mm512_storeu_si512(acc + r * GROUP + 8, hi[r]);
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
        __m512i a0, a1, start0, start1;  // quads 0-3, 4-7, less the offset term
        offset_starts<KIND>(row, b, &start0, &start1);
        block_dots<R == 1>(u, row.xq + b * BLOCK, start0, start1, &a0, &a1);
        if constexpr (Q6) {  // halves of 16, each with its scale
          dsum[r] = _mm512_add_epi32(dsum[r], _mm512_add_epi32(_mm512_mullo_epi32(a0, s0), _mm512_mullo_epi32(a1, s1)));
        } else {  // one sub-block of 32
          dsum[r] = _mm512_add_epi32(dsum[r], _mm512_mullo_epi32(_mm512_add_epi32(a0, a1), s0));
          msum[r] = _mm512_add_epi32(msum[r], _mm512_mullo_epi32(s1, _mm512_set1_epi32(row.xsum[b])));
        }
      }
    }
    for (int r = 0; r < R; ++r) super_int_terms<!Q6>(dsum[r], msum[r], dd, dmin, rows[r0 + r].mf[sb], &lo[r], &hi[r]);
  }
  store_sums<R>(lo, hi, acc);
}

// R rows at once against group g: the codes are unpacked once per block and serve every row
// (block_dots). CHUNKED (the 32-column kinds, where group_rows found that the tile's terms may be
// summed before they are rounded: float_chunk): each row's terms go to float64 sums converted to
// int64 once every `chunk` blocks, two multiplies and two fused multiply-adds a block (three with
// a minimum) instead of a rounding of each term.
template <int R, int FORM, int KIND, bool CHUNKED = false>
void group_blocks(const Layout& L, const uint8_t* packed, const RowQ* rows, int64_t r0, int64_t g, int shift0,
                  const int32_t* top, int64_t* acc, int chunk = 0) {
  static_assert(!CHUNKED || KINDS[KIND].act == BLOCK, "the 32-column kinds");
  constexpr int PER = BLOCK / KINDS[KIND].sub;
  __m512i lo[R], hi[R];  // columns 0-7 and 8-15
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
  const __m512i topv = _mm512_loadu_si512(top);
  __m512d units[2];
  group_units(topv, shift0, units);
  const int64_t ahead = prefetch_distance(L, r0);
  constexpr bool SUPER_TERMS = KINDS[KIND].act != BLOCK;  // the K-quants: terms per super-block
  __m512d dsum[R][2], msum[R][2];  // SUPER_TERMS: the super-block's sums so far (row_super_products); CHUNKED: the chunk's
  if constexpr (CHUNKED)
    for (int r = 0; r < R; ++r) dsum[r][0] = dsum[r][1] = _mm512_setzero_pd();
  for (int64_t b = 0; b < L.blocks; ++b) {
    const uint8_t* rec = streamed_record(packed, L, g, b, ahead);
    __m512i u[8];
    block_codes<FORM, KIND>(rec, L, u);
    const BlockScales c = block_scales<FORM, KIND>(rec, L, topv, shift0, units);
    if constexpr (SUPER_TERMS)
      if (b % SUPER_BLOCKS == 0)
        for (int r = 0; r < R; ++r) dsum[r][0] = dsum[r][1] = msum[r][0] = msum[r][1] = _mm512_setzero_pd();
    for (int r = 0; r < R; ++r) {
      __m512i a0, a1, start0, start1;  // quads 0-3, 4-7 less the offset term: per half (PER == 2) or whole below
      offset_starts<KIND>(rows[r0 + r], b, &start0, &start1);
      block_dots<R == 1>(u, rows[r0 + r].xq + b * BLOCK, start0, start1, &a0, &a1);
      const __m512i first = PER == 1 ? _mm512_add_epi32(a0, a1) : a0;
      if constexpr (SUPER_TERMS)
        row_super_products<KIND>(first, a1, c, rows[r0 + r], b, dsum[r], msum[r]);
      else if constexpr (CHUNKED)
        row_chunk_products<KIND>(first, c, rows[r0 + r], b, dsum[r]);
      else
        row_terms<KIND>(first, a1, c, rows[r0 + r], b, &lo[r], &hi[r]);
    }
    if constexpr (CHUNKED)
      if (((b + 1) & (chunk - 1)) == 0 || b + 1 == L.blocks)  // (chunk: a power of two)
        for (int r = 0; r < R; ++r) flush_sums(dsum[r], &lo[r], &hi[r]);
    if constexpr (SUPER_TERMS)
      if (b % SUPER_BLOCKS == SUPER_BLOCKS - 1)
        for (int r = 0; r < R; ++r) row_super_terms<KIND>(dsum[r], msum[r], rows[r0 + r], b / SUPER_BLOCKS, &lo[r], &hi[r]);
  }
  store_sums<R>(lo, hi, acc);
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

}  // namespace
}  // namespace tf

#endif
