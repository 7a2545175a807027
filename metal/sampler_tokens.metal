// sampler_tokens: the keyed sampler's per-token arithmetic (sampling/sampler.py `_keys`,
// `_scores`; keyed.py `gumbel`), bitwise, in software float64 (float64_soft.metal.h).
// One thread per (token t, row) of a sampled row (mode != 0; greedy rows are skipped):
// - m = float64(max of the row's chunk maxima) / T (the exact global max of z);
// - a drawable token (bitmask bit set, logit not -inf): z = float64(x) / T,
//   q = floor(exp64(z - m) 2^32), key = q << 30 | (2^30 - 1 - t), score = z + gumbel(row key, t);
// - otherwise key -1 and score -inf.
// Inputs: temperature [num_rows] and row_key [num_rows] as 64-bit words (a float64's bits; the
// row's stream key, keyed.row_key), mode [num_rows] int32, chunk_max (sampler_chunk_max).
// Outputs: keys [num_rows, vocab] int64, scores [num_rows, vocab] uint64 (float64 bits).
uint t = thread_position_in_grid.x;
uint row = thread_position_in_grid.y;
if (t >= uint(vocab) || row >= uint(num_rows)) return;
ulong at = ulong(row) * ulong(vocab) + t;
float x = logits[at];
bool allowed = !HAS_MASK || ((int(t) >> 5) < mask_words
    && ((uint(bitmask[ulong(row) * ulong(mask_words) + (t >> 5)]) >> (t & 31)) & 1u));
if (mode[row] == 0 || !allowed || x == as_type<float>(0xFF800000u)) {
  keys[at] = -1;
  scores[at] = TF_F64_SIGN | TF_F64_INF;
  return;
}
float x_max = chunk_max[ulong(row) * ulong(num_chunks)];
for (int c = 1; c < num_chunks; ++c) {
  float v = chunk_max[ulong(row) * ulong(num_chunks) + c];
  x_max = v > x_max ? v : x_max;
}
ulong temp = temperature[row];
ulong m = f64_div(f64_of_f32(x_max), temp);
ulong z = f64_div(f64_of_f32(x), temp);
ulong weight = exp64(f64_sub(z, m));
long q = f64_floor_nonneg(f64_mul(weight, TF_TWO32_BITS));
keys[at] = long(ulong(q) << TF_ID_BITS) | (TF_ID_MASK - long(t));
scores[at] = f64_add(z, gumbel64(row_key[row], long(t)));
