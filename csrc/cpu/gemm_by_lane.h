// The row-invariant GEMM computed one lane at a time (gemm_by_lane.cpp): AVX2's form of gemm.cpp.
//
// gemm.cpp keeps each output's sixteen lanes side by side in a V16 and folds them at the end.
// With AVX2's sixteen 8-float registers that leaves room for four outputs' accumulators, and the
// row tiles reload W for every two rows. Here a register holds one lane of eight columns
// instead: lane l's sum of every output of a 16-column panel runs as broadcast x times a W
// vector, the textbook register tile (6 rows x 16 columns: twelve accumulators), and the
// sixteen lanes' sums are folded by the same halving tree. Each lane's sum takes the same steps
// in the same order, so the bits are gemm.cpp's; only the packed layout differs.
#pragma once

#include <cstdint>

#include "exact.h"
#include "vec16.h"

#if defined(TF_AVX2)
#define TF_GEMM_BY_LANE 1
#else
#define TF_GEMM_BY_LANE 0
#endif

namespace tf::by_lane {

// For T = float and bf16 (gemm.cpp's entry points choose the dtype).
template <typename T>
int64_t packed_numel(int64_t N, int64_t K);
template <typename T>
void pack_weight(const T* w, T* packed, int64_t N, int64_t K);
template <typename T>
void linear(const T* x, const T* packed, T* out, int64_t M, int64_t N, int64_t K, int threads);

}  // namespace tf::by_lane
