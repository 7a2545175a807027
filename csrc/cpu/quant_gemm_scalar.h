// The plain C++ path, which group_rows takes where the build has neither AVX-512 VNNI nor AVX2:
// the vector paths' sums spelled out in int64, row by row and column by column over the same
// packed records, so that every target computes the reference's bits.
#pragma once

#include <cstdint>

#include "quant_gemm.h"
#include "quant_gemm_common.h"

namespace tf {
namespace {

using namespace quant;

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

}  // namespace
}  // namespace tf
