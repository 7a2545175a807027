// sampler_draw: one row's token (sampling/sampler.py `sample`, `_decide`, `_draw`), bitwise.
// One thread per row:
// - greedy and free rows (mode 0, 1): the chunks' winners folded: the largest score, ties to
//   the lowest id;
// - ordered rows (mode 2): the cut rule on the head of the row's key order, head_keys [num_rows,
//   head_size] sorted descending (-1 pads) with their scores: top-k keeps the first k; top-p keeps
//   token i while the q-mass before it is below ceil(Z P40 / 2^40) (Z the q-sum over what top-k
//   kept, P40 = floor(top_p 2^40), off: -1; the product, up to 2^102, as two 64-bit words); min_p
//   keeps q >= min_q; the kept token with the largest score, ties to the lowest id. `decided`
//   says whether the kept set provably lies inside the head (else the host retries a longer one).
// Outputs: token [num_rows] int64 (TF_NO_TOKEN: nothing drawable), decided [num_rows] int32.
uint row = thread_position_in_grid.x;
if (row >= uint(num_rows)) return;
ulong chunks = ulong(row) * ulong(num_chunks);
int row_mode = mode[row];
if (row_mode != 2) {
  ulong best = best_score[chunks];
  long best_token = best_id[chunks];
  for (int c = 1; c < num_chunks; ++c) {
    ulong s = best_score[chunks + c];
    long id = best_id[chunks + c];
    if (f64_order(s) > f64_order(best) || (s == best && id < best_token)) {
      best = s;
      best_token = id;
    }
  }
  token[row] = (best & TF_F64_ABS) == TF_F64_INF && (best & TF_F64_SIGN) ? TF_NO_TOKEN : best_token;
  decided[row] = 1;
  return;
}
long total = 0, num_drawable = 0;
for (int c = 0; c < num_chunks; ++c) {
  total += q_sum[chunks + c];
  num_drawable += count[chunks + c];
}
ulong head = ulong(row) * ulong(head_size);
long k = top_k[row] > 0 ? top_k[row] : TF_OFF;
bool all_k = k >= num_drawable;
long z_sum = total;
if (!all_k) {
  z_sum = 0;
  for (int i = 0; i < head_size && i < k; ++i) z_sum += head_keys[head + i] >= 0 ? head_keys[head + i] >> TF_ID_BITS : 0;
}
bool z_known = all_k || k <= head_size;
bool p_on = top_p40[row] >= 0;
long threshold = TF_OFF;
if (p_on) {  // ceil(Z P40 / 2^40) = floor((Z P40 + 2^40 - 1) / 2^40), Z P40 < 2^102
  ulong high, low;
  mul_wide(ulong(z_sum), ulong(top_p40[row]), high, low);
  ulong bump = (ulong(1) << TF_P_BITS) - 1;
  ulong sum_low = low + bump;
  high += sum_low < low ? 1 : 0;
  threshold = long((sum_low >> TF_P_BITS) | (high << (64 - TF_P_BITS)));
}
long mass = 0;
bool keep_last = false;
ulong best = TF_F64_SIGN | TF_F64_INF;
long best_token = TF_NO_TOKEN;
for (int i = 0; i < head_size; ++i) {
  long key = head_keys[head + i];
  long q = key >= 0 ? key >> TF_ID_BITS : 0;
  bool keep = key >= 0 && i < k && (i == 0 || mass < threshold) && q >= min_q[row];
  mass += q;
  keep_last = keep;
  if (!keep) continue;
  ulong s = head_scores[head + i];
  long id = TF_ID_MASK - (key & TF_ID_MASK);
  if (f64_order(s) > f64_order(best) || (s == best && id < best_token)) {
    best = s;
    best_token = id;
  }
}
bool done = num_drawable <= head_size || !keep_last || k <= head_size || mass >= threshold;
token[row] = best_token;
decided[row] = (done && (!p_on || z_known)) ? 1 : 0;
