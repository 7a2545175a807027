// The mixture of experts' own arithmetic (models/moe.py, kernels/moe.py): the router's choice and
// weights, and the sum of a token's expert outputs. The experts' GEMMs are the GEMM kernels';
// MoEBlock (layer.cpp) strings the steps together.
//
// route (kernels/moe.route), per row of logits [E]:
//   1. the top k by a stable descending sort: a before b when a > b, or a == b and a's index is
//      lower; NaN first (torch's sort puts NaN above +inf), NaNs by index;
//   2. p_j = exp_neg(l_j - l_0) in float32 for the chosen j (rank order; p_0 is 1);
//   3. normalize: total = p_0 + p_1 + ... + p_{k-1} in float32, in rank order; otherwise total is
//      the sum over every expert of round_even(exp_neg(l - l_0) 2^39), exact in float64 (each
//      term <= 2^39, at most 2^13 of them), times 2^-39, rounded to float32;
//   4. w_j = p_j / total (float32 division).
// combine (kernels/moe.combine, MoE.compose's sum), per row: acc = 0; for its experts in ascending index:
//   acc = acc + float(y) * w (the product rounded first); then, with a shared expert,
//   acc = acc + sigmoid32(float(gate)) * float(shared); out = acc in the dtype.
#include <algorithm>
#include <cmath>
#include <vector>

#include "exact.h"
#include "kernels.h"

namespace tf {

namespace {

constexpr int SUM_BITS = 40;

// Whether logit a (index ia) sorts before b (index ib): step 1.
inline bool before(float a, int64_t ia, float b, int64_t ib) {
  const bool na = std::isnan(a), nb = std::isnan(b);
  if (na != nb) return na;
  if (na || a == b) return ia < ib;
  return a > b;
}

void route_row(const float* l, int64_t E, int64_t k, bool normalize, int64_t* chosen, float* w) {
  int64_t n = 0;  // chosen[0, n) in order: an insertion into the k best
  for (int64_t e = 0; e < E; ++e) {
    if (n == k && !before(l[e], e, l[chosen[k - 1]], chosen[k - 1])) continue;
    int64_t at = n < k ? n++ : k - 1;
    for (; at > 0 && before(l[e], e, l[chosen[at - 1]], chosen[at - 1]); --at) chosen[at] = chosen[at - 1];
    chosen[at] = e;
  }
  const float top = l[chosen[0]];
  for (int64_t j = 0; j < k; ++j) w[j] = exp_neg(l[chosen[j]] - top);
  float total;
  if (normalize) {
    total = w[0];
    for (int64_t j = 1; j < k; ++j) total = total + w[j];
  } else {
    const double up = std::ldexp(1.0, SUM_BITS - 1), down = std::ldexp(1.0, 1 - SUM_BITS);
    double sum = 0.0;  // integers below 2^53: exact in any order
    for (int64_t e = 0; e < E; ++e) sum += round_even(static_cast<double>(exp_neg(l[e] - top)) * up);
    total = static_cast<float>(sum * down);
  }
  for (int64_t j = 0; j < k; ++j) w[j] = w[j] / total;
}

template <typename T>
void combine_rows(const T* y, const int64_t* y_rows, const int64_t* chosen, const float* w, int64_t rows, int64_t k,
                  const T* shared_gate, const T* shared, T* out, int64_t hidden, int threads) {
#pragma omp parallel num_threads(threads)
  {
    std::vector<int64_t> order(k);
    std::vector<float> acc(hidden);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t* c = chosen + r * k;
      for (int64_t j = 0; j < k; ++j) order[j] = j;
      std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return c[a] < c[b]; });
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j : order) {
        const T* yr = y + y_rows[r * k + j] * hidden;
        const float wj = w[r * k + j];
        for (int64_t i = 0; i < hidden; ++i) {
          const float term = to_f32(yr[i]) * wj;
          acc[i] = acc[i] + term;
        }
      }
      if (shared != nullptr) {
        const float g = sigmoid32(to_f32(shared_gate[r]));
        const T* sr = shared + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) {
          const float term = g * to_f32(sr[i]);
          acc[i] = acc[i] + term;
        }
      }
      T* o = out + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) o[i] = from_f32<T>(acc[i]);
    }
  }
}

}  // namespace

void moe_route(const float* logits, int64_t rows, int64_t experts, int64_t top_k, bool normalize, int64_t* chosen,
               float* weights, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 64)
  for (int64_t r = 0; r < rows; ++r)
    route_row(logits + r * experts, experts, top_k, normalize, chosen + r * top_k, weights + r * top_k);
}

void moe_combine(int dtype, const void* y, const int64_t* y_rows, const int64_t* chosen, const float* weights,
                 int64_t rows, int64_t top_k, const void* shared_gate, const void* shared, void* out, int64_t hidden,
                 int threads) {
  if (dtype == 0)
    combine_rows(static_cast<const float*>(y), y_rows, chosen, weights, rows, top_k,
                 static_cast<const float*>(shared_gate), static_cast<const float*>(shared), static_cast<float*>(out),
                 hidden, threads);
  else
    combine_rows(static_cast<const bf16*>(y), y_rows, chosen, weights, rows, top_k,
                 static_cast<const bf16*>(shared_gate), static_cast<const bf16*>(shared), static_cast<bf16*>(out),
                 hidden, threads);
}

}  // namespace tf
