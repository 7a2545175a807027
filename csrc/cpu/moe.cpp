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
// route_sigmoid (kernels/moe.route_sigmoid: GLM-5's and Nemotron-H's noaux_tc), per row of logits [E]:
//   1. s_e = sigmoid32(l_e); c_e = s_e + bias_e (float32);
//   2. with n_group > 1: each group's two best c (step 1 of route's order) added (float32); the
//      topk_group best groups by that sum (the same order, ties to the lower group) kept, c_e = -inf
//      for the experts of the others;
//   3. the top k of c in route's order (step 1 there);
//   4. w_j = s_{chosen_j}; normalize: total = w_0 + w_1 + ... in rank order (float32), then
//      w_j = w_j / (total + float32(1e-20)); last w_j = w_j * float32(scale).
// combine (kernels/moe.combine, MoE.compose's sum), per row: acc = 0; for its experts in ascending index:
//   acc = acc + float(y) * w (the product rounded first); then, with a shared expert,
//   acc = acc + sigmoid32(float(gate)) * float(shared), or acc + float(shared) without a gate
//   (GLM-5's shared experts); out = acc in the dtype.
#include <algorithm>
#include <cmath>
#include <limits>
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

// Steps 1-4 of route_sigmoid for one row; c: the row's scratch [E].
void route_sigmoid_row(const float* l, const float* bias, int64_t E, int64_t k, int64_t n_group, int64_t topk_group,
                       bool normalize, float scale, float* c, int64_t* chosen, float* w) {
  for (int64_t e = 0; e < E; ++e) c[e] = sigmoid32(l[e]) + bias[e];
  if (n_group > 1) {
    const int64_t size = E / n_group;
    std::vector<float> group(n_group);
    std::vector<int64_t> kept(topk_group);
    for (int64_t g = 0; g < n_group; ++g) {  // the two best of the group, by route's order
      const float* cg = c + g * size;
      int64_t a = before(cg[1], 1, cg[0], 0) ? 1 : 0, b = 1 - a;
      for (int64_t e = 2; e < size; ++e) {
        if (before(cg[e], e, cg[a], a)) b = a, a = e;
        else if (before(cg[e], e, cg[b], b)) b = e;
      }
      group[g] = cg[a] + cg[b];
    }
    int64_t n = 0;
    for (int64_t g = 0; g < n_group; ++g) {
      if (n == topk_group && !before(group[g], g, group[kept[n - 1]], kept[n - 1])) continue;
      int64_t at = n < topk_group ? n++ : topk_group - 1;
      for (; at > 0 && before(group[g], g, group[kept[at - 1]], kept[at - 1]); --at) kept[at] = kept[at - 1];
      kept[at] = g;
    }
    for (int64_t g = 0; g < n_group; ++g)
      if (std::find(kept.begin(), kept.end(), g) == kept.end())
        std::fill(c + g * size, c + (g + 1) * size, -std::numeric_limits<float>::infinity());
  }
  int64_t n = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (n == k && !before(c[e], e, c[chosen[k - 1]], chosen[k - 1])) continue;
    int64_t at = n < k ? n++ : k - 1;
    for (; at > 0 && before(c[e], e, c[chosen[at - 1]], chosen[at - 1]); --at) chosen[at] = chosen[at - 1];
    chosen[at] = e;
  }
  for (int64_t j = 0; j < k; ++j) w[j] = sigmoid32(l[chosen[j]]);
  if (normalize) {
    float total = w[0];
    for (int64_t j = 1; j < k; ++j) total = total + w[j];
    const float denominator = total + static_cast<float>(1e-20);
    for (int64_t j = 0; j < k; ++j) w[j] = w[j] / denominator;
  }
  for (int64_t j = 0; j < k; ++j) w[j] = w[j] * scale;
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
      if (shared != nullptr && shared_gate != nullptr) {
        const float g = sigmoid32(to_f32(shared_gate[r]));
        const T* sr = shared + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) {
          const float term = g * to_f32(sr[i]);
          acc[i] = acc[i] + term;
        }
      } else if (shared != nullptr) {
        const T* sr = shared + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) acc[i] = acc[i] + to_f32(sr[i]);
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

void moe_route_sigmoid(const float* logits, const float* bias, int64_t rows, int64_t experts, int64_t top_k,
                       int64_t n_group, int64_t topk_group, bool normalize, double scale, int64_t* chosen,
                       float* weights, int threads) {
  const float scale32 = static_cast<float>(scale);
#pragma omp parallel num_threads(threads) if (rows > 64)
  {
    std::vector<float> c(experts);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      route_sigmoid_row(logits + r * experts, bias, experts, top_k, n_group, topk_group, normalize, scale32, c.data(),
                        chosen + r * top_k, weights + r * top_k);
  }
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
