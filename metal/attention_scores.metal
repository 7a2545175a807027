// attention_scores: paged attention's step 1 (kernels/paged_attention.py, paged_attention_ref),
// bitwise. One thread per (key j, head h, query row r); row r belongs to sequence row_seq[r] at
// absolute position positions[r], and key j sits in block block_tables[seq, j / block_size] of
// the paged cache [blocks, block_size, num_kv_heads, head_dim] (KV: the cache's dtype); head h
// reads kv head h / (num_heads / num_kv_heads) (GQA).
// - a key the row does not see (j > position, or before the sliding window when window > 0):
//   score -inf, no v exponent (TF_NO_KEY_EXPONENT);
// - otherwise q and k as grid integers (QK_BITS against their largest element) and their dot T,
//   an exact long sum; score = float32(T 2^(qe + ke - 2 (QK_BITS - 1))) (float32_of_int), then
//   times float32(scale); and e_j, the exponent of the key's largest |v| (step 3's v grid).
// Outputs: scores [num_rows, num_heads, num_keys] float32, v_exp [same] int32.
uint j = thread_position_in_grid.x;
uint h = thread_position_in_grid.y;
uint r = thread_position_in_grid.z;
if (j >= uint(num_keys) || h >= uint(num_heads) || r >= uint(num_rows)) return;
ulong out_at = (ulong(r) * ulong(num_heads) + h) * ulong(num_keys) + j;
int position = positions[r];
bool seen = int(j) <= position && (window <= 0 || int(j) > position - window);
if (!seen) {
  scores[out_at] = as_type<float>(0xFF800000u);
  v_exp[out_at] = TF_NO_KEY_EXPONENT;
  return;
}
int kv_head = int(h) / (num_heads / num_kv_heads);
long slot = long(block_tables[long(row_seq[r]) * table_width + int(j) / block_size]) * block_size
    + int(j) % block_size;
ulong q_first = (ulong(r) * ulong(num_heads) + h) * ulong(head_dim);
ulong kv_first = (ulong(slot) * ulong(num_kv_heads) + ulong(kv_head)) * ulong(head_dim);

float q_max = 0.0f, k_max = 0.0f, v_max = 0.0f;
for (int d = 0; d < head_dim; ++d) {
  float qa = as_type<float>(as_type<uint>(q[q_first + d]) & 0x7FFFFFFFu);
  float ka = as_type<float>(as_type<uint>(float(k_cache[kv_first + d])) & 0x7FFFFFFFu);
  float va = as_type<float>(as_type<uint>(float(v_cache[kv_first + d])) & 0x7FFFFFFFu);
  q_max = qa > q_max ? qa : q_max;
  k_max = ka > k_max ? ka : k_max;
  v_max = va > v_max ? va : v_max;
}
int qe = exponent_of(q_max), ke = exponent_of(k_max);
long dot_sum = 0;
for (int d = 0; d < head_dim; ++d) {
  long qi = to_grid(q[q_first + d], qe, TF_QK_BITS);
  long ki = to_grid(float(k_cache[kv_first + d]), ke, TF_QK_BITS);
  dot_sum += qi * ki;  // |qi ki| < 2^44, head_dim <= 512 (paged_attention.MAX_HEAD_DIM): < 2^53
}
float score = float32_of_int(dot_sum, qe + ke - 2 * (TF_QK_BITS - 1));
score = score * scale;
scores[out_at] = score;
v_exp[out_at] = exponent_of(v_max);
