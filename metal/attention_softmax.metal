// attention_softmax: paged attention's steps 2-3 weights (kernels/paged_attention.py), bitwise.
// One thread per (head h, query row r), a loop over the keys the row sees (attention_scores):
// - m = the largest score seen (0 if none, or if it is infinite), E = the largest v exponent
//   seen (0 if none);
// - p_j = exp_neg(score_j - m) (float32, exact/float32.py's steps), 0 for unseen keys;
// - den = sum round(p_j 2^L_BITS) and w_j = round(p_j 2^(e_j - E + W_BITS)): the reference's
//   integers, from p's significand (exact shifts rounded half to even), den a long sum.
// Outputs: weights [num_rows, num_heads, num_keys] int64 (0 where unseen), top [num_rows,
// num_heads] int32 (E), den [same] int64.
uint h = thread_position_in_grid.x;
uint r = thread_position_in_grid.y;
if (h >= uint(num_heads) || r >= uint(num_rows)) return;
ulong lane = ulong(r) * ulong(num_heads) + h;
ulong first_key = lane * ulong(num_keys);
int position = positions[r];
int last = position < num_keys - 1 ? position : num_keys - 1;
int first = window > 0 && position - window + 1 > 0 ? position - window + 1 : 0;

float row_max = as_type<float>(0xFF800000u);
int e_top = TF_NO_KEY_EXPONENT;
for (int j = first; j <= last; ++j) {
  float s = scores[first_key + j];
  row_max = s > row_max ? s : row_max;
  e_top = v_exp[first_key + j] > e_top ? v_exp[first_key + j] : e_top;
}
if ((as_type<uint>(row_max) & 0x7FFFFFFFu) == 0x7F800000u) row_max = 0.0f;  // a lane that sees nothing
if (e_top == TF_NO_KEY_EXPONENT) e_top = 0;

long total = 0;
for (int j = 0; j < num_keys; ++j) {
  if (j < first || j > last) {
    weights[first_key + j] = 0;
    continue;
  }
  float diff = scores[first_key + j] - row_max;
  Significand p = significand(exp_neg(diff));
  total += shift_by(p.m, p.e + TF_L_BITS);
  weights[first_key + j] = shift_by(p.m, p.e + v_exp[first_key + j] + TF_W_BITS - e_top);
}
top[lane] = e_top;
den[lane] = total;
