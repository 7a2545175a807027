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
// Each instruction set's path has an internal header of its own, which only this file includes
// (one translation unit, so the compiler inlines across them as before): quant_gemm_common.h what
// they all read (RowQ, on_grid, the records' stream), quant_gemm_scalar.h the plain C++ path,
// quant_gemm_vnni.h AVX-512 VNNI (vpdpbusd), quant_gemm_amx.h AMX-INT8 tiles of 16 rows,
// quant_gemm_avx2.h AVX2 (vpmaddubsw, vpmaddwd). This file keeps what they share: the
// activations' quantization, and which path runs which rows (group_rows, quant_linears_impl).
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
#include "quant_gemm.h"
#include "quant_gemm_common.h"
#include "quant_gemm_scalar.h"
#include "quant_gemm_vnni.h"
#include "quant_gemm_amx.h"
#include "quant_gemm_avx2.h"

namespace tf {
namespace {

using namespace quant;

constexpr float X_MAX = 127.0f;     // |xq| <= 127
constexpr int64_t ROWS_PER_PASS = 64;  // rows whose activations stay in cache while a group runs
// The fewest rows of a pass that take the AMX tiles (where they are allowed): fewer rows run on
// VNNI register tiles, which unpack a block once for up to 4 rows without a tile round trip.
// (8192 x 2048 q4_0, one thread: 8 rows 2.24 ms on tiles against 1.61 on VNNI; 16 rows 3.26 against 3.63.)
constexpr int64_t AMX_MIN_ROWS = 16;
std::atomic<bool> amx_allowed{true};  // set_quant_amx

constexpr float F16_MAX = 65504.0f;  // float16 scales saturate here

int log2_ceil(int64_t n) {
  int l = 0;
  while ((int64_t{1} << l) < n) ++l;
  return l;
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

#if defined(TF_QUANT_VNNI) || defined(TF_QUANT_AVX2)
// How far a tile of R rows' terms against a group can reach below the grid's top, in binades:
// the group's lows (its smallest E - top and F - top) plus the rows' kmin and smin. No term of
// the tile can have a negative shift where this is at most shift0.
inline int tile_spread(const QKind& kd, const int32_t* lows, const RowQ* rows, int R) {
  int spread = 0;
  for (int i = 0; i < R; ++i) {
    spread = std::max(spread, -(lows[0] + rows[i].kmin));
    if (kd.has_min) spread = std::max(spread, -(lows[1] + rows[i].smin));
  }
  return spread;
}
#endif

#if defined(TF_QUANT_VNNI)
// A bound on one block's terms for one output, 2^(bits + shift0) on the grid. The F16 form's S
// and M are float16 significands (below 2^11), as the rows' m and sm are, so a dot term is below
// 32 |c|max 127 2^22 and a minimum term below 2^34 (M sm 2^(F + se - g): F <= top, se <= k + 12);
// the WIDE form's integers keep only the reference's bound, 2^T a term.
constexpr int block_term_bits(const QKind& kd, int form) {
  if (form != F16) return kd.term_bits + (kd.has_min ? 1 : 0);
  const int64_t c_max = kd.offset != 0 ? kd.offset : (1 << kd.code_bits) - 1;
  const int64_t dot_max = BLOCK * c_max * 127;  // |A|, as |xq| <= 127
  int bits = 0;
  while ((int64_t{1} << bits) <= dot_max) ++bits;
  return bits + 22 + (kd.has_min ? 1 : 0);
}
static_assert(block_term_bits(KINDS[1], F16) == 37 && block_term_bits(KINDS[2], F16) == 39 &&
              block_term_bits(KINDS[0], F16) == 41, "q4_0, q4_1, q8_0 in the float16 form");

// For how many blocks a tile's terms against a group (the 32-column kinds) may be summed in
// float64 before the sums are converted to int64 (group_blocks, CHUNKED), or 0 where not even two.
// Where no term can have a negative shift (spread <= shift0: tile_spread) each is an integer on
// the grid, a multiple of 2^(shift0 - spread), so n blocks' sums, below n 2^(bits + shift0), stay
// exact while that is at most 2^(53 + shift0 - spread).
template <int KIND, int FORM>
int float_chunk(int spread, int shift0) {
  static_assert(KINDS[KIND].act == BLOCK, "the 32-column kinds");
  const int log_blocks = 53 - block_term_bits(KINDS[KIND], FORM) - spread;
  if (spread > shift0 || log_blocks < 1) return 0;
  return 1 << std::min(log_blocks, 6);
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
      if constexpr (decltype(form)::value != SUPER) {  // (the file's K-quant form checks its few shifts itself)
        if (tile_spread(L.kind, lows, rows + r, R) <= shift0)  // no nonzero term can have a negative shift
          return group_unchecked<R, decltype(form)::value, decltype(kind_id)::value>(L, packed, rows, r, g, shift0,
                                                                                      top, acc + (r - r0) * GROUP);
      }
#endif
#if defined(TF_QUANT_VNNI)
      if constexpr (decltype(form)::value != SUPER && KINDS[decltype(kind_id)::value].act == BLOCK) {
        const int chunk =
            float_chunk<decltype(kind_id)::value, decltype(form)::value>(tile_spread(L.kind, lows, rows + r, R), shift0);
        if (chunk > 1)
          return group_blocks<R, decltype(form)::value, decltype(kind_id)::value, true>(L, packed, rows, r, g, shift0,
                                                                                         top, acc + (r - r0) * GROUP, chunk);
      }
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
  const int64_t out_stride = q.out_stride > 0 ? q.out_stride : q.N;
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
          out[r * out_stride + g * GROUP + c] = from_f32<T>(static_cast<float>(y));
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
