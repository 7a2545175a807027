// attention_output: paged attention's steps 3-4 (kernels/paged_attention.py), bitwise.
// One thread per output element (d, head h, query row r):
// - num = sum_j w_j v_int[j, d] over the keys the row sees, v_int = v 2^(V_BITS - 1 - e_j) (the
//   cached v is on its grid: an exact integer), an exact long sum (|w v| <= 2^44);
// - out = float32(num 2^(E - V_BITS - W_BITS + 1)) / (float32(den) 2^-L_BITS): both conversions
//   on integers (float32_of_int), the scaling an exact float32 product, the division correctly
//   rounded (div_rn).
// Output: out [num_rows, num_heads, head_dim] float32 (the host casts it to q's dtype).
uint d = thread_position_in_grid.x;
uint h = thread_position_in_grid.y;
uint r = thread_position_in_grid.z;
if (d >= uint(head_dim) || h >= uint(num_heads) || r >= uint(num_rows)) return;
ulong lane = ulong(r) * ulong(num_heads) + h;
ulong first_key = lane * ulong(num_keys);
int position = positions[r];
int last = position < num_keys - 1 ? position : num_keys - 1;
int first = window > 0 && position - window + 1 > 0 ? position - window + 1 : 0;
int kv_head = int(h) / (num_heads / num_kv_heads);
long table_row = long(row_seq[r]) * table_width;

long num = 0;
for (int j = first; j <= last; ++j) {
  long w = weights[first_key + j];
  if (w == 0) continue;
  long slot = long(block_tables[table_row + j / block_size]) * block_size + j % block_size;
  float v = float(v_cache[(ulong(slot) * ulong(num_kv_heads) + ulong(kv_head)) * ulong(head_dim) + d]);
  num += w * to_grid(v, v_exp[first_key + j], TF_V_BITS);
}
int e_top = top[lane];
float weighted = float32_of_int(num, e_top - TF_V_BITS - TF_W_BITS + 1);
long total = den[lane] == 0 ? 1 : den[lane];
float sum_p = float32_of_int(total, 0);
sum_p = sum_p * pow2f(-TF_L_BITS);  // exact: total >= 1
out[lane * ulong(head_dim) + d] = div_rn(weighted, sum_p);
