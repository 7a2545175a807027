// sampler_chunk_fold: each chunk's share of a row's draw (sampling/sampler.py), exact folds only.
// One thread per (chunk, row), a loop over its TF_SAMPLER_CHUNK tokens, by the row's mode:
// - 0 greedy: the largest drawable logit, ties to the lowest id (its float64 as the score);
// - 1 free (no top-k / top-p): among drawable tokens with q >= min_q, the largest score,
//   ties to the lowest id;
// - 2 ordered (top-k / top-p): the integer q-sum and the drawable count (sampler_draw cuts).
// No winner: score -inf, id TF_NO_TOKEN.
// Outputs: best_score [num_rows, num_chunks] uint64 (float64 bits), best_id, q_sum, count
// [num_rows, num_chunks] int64.
uint chunk = thread_position_in_grid.x;
uint row = thread_position_in_grid.y;
if (chunk >= uint(num_chunks) || row >= uint(num_rows)) return;
ulong out_at = ulong(row) * ulong(num_chunks) + chunk;
int start = int(chunk) * TF_SAMPLER_CHUNK;
int end = start + TF_SAMPLER_CHUNK < vocab ? start + TF_SAMPLER_CHUNK : vocab;
int row_mode = mode[row];
ulong best = TF_F64_SIGN | TF_F64_INF;
long best_token = TF_NO_TOKEN;
long q_total = 0, drawable = 0;
for (int t = start; t < end; ++t) {
  ulong at = ulong(row) * ulong(vocab) + t;
  if (row_mode == 0) {
    float x = logits[at];
    bool allowed = !HAS_MASK || ((t >> 5) < mask_words
        && ((uint(bitmask[ulong(row) * ulong(mask_words) + (t >> 5)]) >> (t & 31)) & 1u));
    ulong score = f64_of_f32(x);
    if (allowed && x != as_type<float>(0xFF800000u) && f64_order(score) > f64_order(best)) {
      best = score;
      best_token = t;
    }
    continue;
  }
  long key = keys[at];
  if (key < 0) continue;
  long q = key >> TF_ID_BITS;
  drawable += 1;
  q_total += q;
  if (row_mode == 1 && q >= min_q[row] && f64_order(scores[at]) > f64_order(best)) {
    best = scores[at];
    best_token = t;
  }
}
best_score[out_at] = best;
best_id[out_at] = best_token;
q_sum[out_at] = q_total;
count[out_at] = drawable;
