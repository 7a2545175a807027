// The exact quantized GEMM: kernels/quant_gemm.py's steps, bitwise its torch reference.
//
// Weights are GGUF blocks of 32 (codes as bytes, one per weight, and float16 scales); activations
// are quantized per row and block to int8 against a power of two; each block's dot is an integer
// and each term an integer times a power of two; one output's terms are summed in int64 on one
// grid. Integer arithmetic throughout, so the threads, the order of the blocks and the other rows
// cannot change a bit. This first version is plain C++ (the compiler vectorizes the int8 dots);
// the VNNI spelling comes next, against the same reference.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "exact.h"
#include "kernels.h"

namespace tf {
namespace {

constexpr int BLOCK = 32;
constexpr int X_BITS = 7;     // |xq| < 2^7
constexpr int TERM_BITS = 31; // every block term's integer is below 2^31

// A float16 (its bits) as dm 2^de, dm its integer significand (quant_gemm.significand).
inline void significand16(uint16_t bits, int64_t* dm, int* de) {
  const int64_t frac = bits & 0x3FF;
  const int exp = (bits >> 10) & 0x1F;
  const int64_t magnitude = exp > 0 ? (frac | 0x400) : frac;
  *dm = (bits >> 15) ? -magnitude : magnitude;
  *de = exp > 0 ? exp - 25 : -24;
}

// One row's blocks: xq = clamp(round_even(x 2^(6 - e)), -127, 127), k = e - 6, xsum = sum xq.
template <typename T>
void quantize_row(const T* x, int64_t blocks, int8_t* xq, int* k, int64_t* xsum) {
  for (int64_t b = 0; b < blocks; ++b) {
    const T* v = x + b * BLOCK;
    uint32_t top = 0;
    for (int i = 0; i < BLOCK; ++i) top = std::max(top, f32_bits(to_f32(v[i])) & 0x7FFFFFFFu);
    const int e = exponent(f32_from_bits(top));
    const double scale = pow2(X_BITS - 1 - e);
    int64_t sum = 0;
    for (int i = 0; i < BLOCK; ++i) {
      double r = round_even(static_cast<double>(to_f32(v[i])) * scale);
      r = std::min(127.0, std::max(-127.0, r));
      xq[b * BLOCK + i] = static_cast<int8_t>(r);
      sum += static_cast<int64_t>(r);
    }
    k[b] = e - (X_BITS - 1);
    xsum[b] = sum;
  }
}

// I 2^shift as an integer: a left shift, or a right shift rounded half to even.
inline int64_t on_grid(int64_t value, int shift) {
  if (shift >= 0) return value << shift;
  const int down = std::min(-shift, TERM_BITS + 1);
  const int64_t floor = value >> down;
  const int64_t rem = value - (floor << down);
  const int64_t half = int64_t{1} << (down - 1);
  return floor + ((rem > half || (rem == half && (floor & 1))) ? 1 : 0);
}

template <typename C>
inline int64_t block_dot(const C* codes, const int8_t* xq, int offset) {
  int32_t a = 0;
  for (int i = 0; i < BLOCK; ++i) a += (static_cast<int32_t>(codes[i]) - offset) * static_cast<int32_t>(xq[i]);
  return a;
}

template <typename T, typename C>
void quant_linear_impl(const T* x, const C* codes, const uint16_t* d, const uint16_t* m, T* out, int64_t M,
                       int64_t N, int64_t K, int offset, int threads) {
  const int64_t blocks = K / BLOCK;
  std::vector<int8_t> xq(M * K);
  std::vector<int> kexp(M * blocks);
  std::vector<int64_t> xsum(M * blocks);
  for (int64_t r = 0; r < M; ++r)
    quantize_row(x + r * K, blocks, xq.data() + r * K, kexp.data() + r * blocks, xsum.data() + r * blocks);
  const int64_t terms = m != nullptr ? 2 * blocks : blocks;
  int log_terms = 0;
  while ((int64_t{1} << log_terms) < terms) ++log_terms;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && N >= 16)
  for (int64_t n = 0; n < N; ++n) {
    std::vector<int64_t> ints(terms);
    std::vector<int> exps(terms);
    for (int64_t r = 0; r < M; ++r) {
      const int8_t* xr = xq.data() + r * K;
      const int* kr = kexp.data() + r * blocks;
      int top = -(1 << 30);
      for (int64_t b = 0; b < blocks; ++b) {
        int64_t dm;
        int de;
        significand16(d[n * blocks + b], &dm, &de);
        ints[b] = dm * block_dot(codes + n * K + b * BLOCK, xr + b * BLOCK, offset);
        exps[b] = de + kr[b];
        top = std::max(top, exps[b]);
        if (m != nullptr) {
          int64_t mm;
          int me;
          significand16(m[n * blocks + b], &mm, &me);
          ints[blocks + b] = mm * xsum[r * blocks + b];
          exps[blocks + b] = me + kr[b];
          top = std::max(top, exps[blocks + b]);
        }
      }
      const int g = top + TERM_BITS - 62 + log_terms;
      int64_t total = 0;
      for (int64_t t = 0; t < terms; ++t) total += on_grid(ints[t], exps[t] - g);
      out[r * N + n] = from_f32<T>(static_cast<float>(static_cast<double>(total) * pow2(g)));
    }
  }
}

}  // namespace

void quant_linear(int dtype, int kind, const void* x, const void* codes, const uint16_t* d, const uint16_t* m,
                  void* out, int64_t M, int64_t N, int64_t K, int threads) {
  const int offset = kind == 1 ? 8 : 0;  // q4_0 codes are q - 8
  auto run = [&](auto* x_typed, auto* out_typed) {
    if (kind == 0)
      quant_linear_impl(x_typed, static_cast<const int8_t*>(codes), d, m, out_typed, M, N, K, offset, threads);
    else
      quant_linear_impl(x_typed, static_cast<const uint8_t*>(codes), d, m, out_typed, M, N, K, offset, threads);
  };
  if (dtype == 0)
    run(static_cast<const float*>(x), static_cast<float*>(out));
  else
    run(static_cast<const bf16*>(x), static_cast<bf16*>(out));
}

}  // namespace tf
