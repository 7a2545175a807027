// The AVX2 path (builds without AVX-512 VNNI), eight columns to a register. A block dot's groups
// of four bytes are vpmaddubsw (u8 x s8, adjacent pairs summed in int16, saturating) then vpmaddwd
// by ones (-> int32). No pair may saturate: |u x + u' x'| <= 2 (2^code_bits - 1) 127 < 2^15 for
// codes of up to 6 bits, and q8_0's codes (u up to 255) run signed instead: |c| <= 128 against x
// with c's sign, 2 128 127. Quads are summed in int16 while their bound allows (SUM16), so most
// take one vpmaddwd per block. The terms go onto the grid in int64 lanes.
#pragma once

#include <cstdint>

#include "quant_gemm.h"
#include "quant_gemm_common.h"

#if defined(TF_QUANT_AVX2)

namespace tf {
namespace {

using namespace quant;

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

// A ymm's 8 int32 lanes as unpack_k_scale's V (the casts to and from __m256i move no bits).
typedef uint32_t u32x8 __attribute__((vector_size(32)));

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
            const auto byte = [&](int q) { return (u32x8)plane_u8x8(planes + 16 * q); };
            for (int j = 0; j < SUPER_BLOCKS; ++j) {
              u32x8 s, m;
              unpack_k_scale(byte, j, &s, &m);
              put(sc[j], (__m256i)s);
              put(sc[SUPER_BLOCKS + j], (__m256i)m);
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

// R rows against group g, block by block, for the WIDE and F16 forms (the file's K-quant form
// has its own kernel, group_super8).
template <int R, int FORM, int KIND>
void group_blocks8(const Layout& L, const uint8_t* packed, const RowQ* rows, int64_t r0, int64_t g, int shift0,
                   const int32_t* top, int64_t* acc) {
  static_assert(FORM != SUPER, "the SUPER form runs group_super8");
  constexpr QKind KD = KINDS[KIND];  // the kind's traits as constants: no branch left in the block loop
  constexpr bool NIBBLES = KD.nibbles, HAS_MIN = KD.has_min;
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
    }
    __m256i s0[2], sexp[2], mv[2], mexp[2], s1[2];
    for (int h = 0; h < 2; ++h) {
      mv[h] = mexp[h] = s1[h] = _mm256_setzero_si256();
      const __m256i t = h == 0 ? top_lo : top_hi;
      if constexpr (FORM == F16) {
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
  static_assert(FORM != SUPER, "the SUPER form runs group_super8");
  constexpr QKind KD = KINDS[KIND];
  constexpr bool NIBBLES = KD.nibbles, HAS_MIN = KD.has_min;
  constexpr int PER = BLOCK / KD.sub;
  constexpr bool SIGNED = KD.code_bits == 8;
  constexpr int BPG = KD.act / BLOCK;  // blocks per activation group: 1, or 8 (the K-quants)
  __m256i even[R][2], odd[R][2];  // [row][half]
  __m256i sde[R][2], sdo[R][2], sme[R][2], smo[R][2];  // BPG > 1: the super-block's sums so far
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) even[r][h] = odd[r][h] = sde[r][h] = sdo[r][h] = sme[r][h] = smo[r][h] = _mm256_setzero_si256();
  const __m256i nib = _mm256_set1_epi8(0x0F), low32 = _mm256_set1_epi64x(0xFFFFFFFF);
  const int64_t ahead = prefetch_distance(L, r0);
  for (int64_t b = 0; b < L.blocks; ++b) {
    const uint8_t* rec = streamed_record(packed, L, g, b, ahead);
    for (int h = 0; h < 2; ++h) {
      const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(top + 8 * h));
      __m256i s0, sexp, mv = _mm256_setzero_si256(), mexp = mv, s1 = mv;
      if constexpr (FORM == F16) {
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
        if constexpr (NIBBLES) {
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

// R rows against group g: the file's K-quant form by its own kernel (group_super8, which checks
// its few shifts itself), the other forms block by block (group_blocks8; group_unchecked where
// group_rows found that no term of the tile can have a negative shift).
template <int R, int FORM, int KIND>
void group_vector(const Layout& L, const uint8_t* packed, const RowQ* rows, int64_t r0, int64_t g, int shift0,
                  const int32_t* top, int64_t* acc) {
  if constexpr (FORM == SUPER)
    group_super8<R, KIND>(L, packed, rows, r0, g, shift0, top, acc);
  else
    group_blocks8<R, FORM, KIND>(L, packed, rows, r0, g, shift0, top, acc);
}

}  // namespace
}  // namespace tf

#endif
