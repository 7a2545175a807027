// quant_gemm: quant_gemm.linear's steps 2-4 (kernels/quant_gemm.py), bitwise, every kind.
// One thread per output y[row, col] (col = weight row n), a plain loop over the activation
// groups of K (ACT columns: one block of 32, or a K-quant's super-block of 8 blocks):
// 2. per sub-block h the integer dot A = sum c xq (int: |A| < 2^19); per group the dot term
//    I = (sum over its sub-blocks of S A) m at exponent E + k (one E per group: its first
//    block's), and with a minimum, per block of 32 (ACT 32) M sm at exponent F + se, per
//    super-block (ACT 256) (sum over its blocks of M xsum) m at exponent F + k; the sums are
//    exact in long (a super-block's sum of S A < 2^38, times m < 2^49);
// 3. each term onto the grid 2^g, g = top[n] + kmax[row] + grid_bias (grid_bias = T - 62 +
//    ceil(log2 #terms), from the host), rounded half to even where bits drop; one long sum,
//    exact in any order;
// 4. y = float32(float64(total) 2^g) on integers (float32_of_int).
// Template constants: SUB (weights per scale S: 32, or 16 for q6_k), HAS_MIN (q4_1, q5_1, q4_k,
// q5_k), ACT (32, or 256 for q4_k, q5_k, q6_k).
// Inputs: xq [num_rows, K] int8, m, k [num_rows, K / ACT] and sm, se, xsum [num_rows, num_blocks]
// (quantize_activations); codes [num_cols, K] int8, scale [num_cols, K / SUB], scale_exp,
// w_min, w_min_exp [num_cols, num_blocks] int32 (the last two a dummy without a minimum), top
// [num_cols] int32.
uint col = thread_position_in_grid.x;
uint row = thread_position_in_grid.y;
if (col >= uint(num_cols) || row >= uint(num_rows)) return;
const int per = TF_QBLOCK / SUB;
const int bpg = ACT / TF_QBLOCK;  // blocks per group
int num_groups = num_blocks / bpg;
ulong x_groups = ulong(row) * ulong(num_groups);
ulong x_blocks = ulong(row) * ulong(num_blocks);
ulong w_blocks = ulong(col) * ulong(num_blocks);
ulong x_first = x_blocks * TF_QBLOCK;
ulong w_first = w_blocks * TF_QBLOCK;

int kmax = k[x_groups];
for (int s = 1; s < num_groups; ++s) kmax = k[x_groups + s] > kmax ? k[x_groups + s] : kmax;
int g = top[col] + kmax + grid_bias;

long total = 0;
for (int s = 0; s < num_groups; ++s) {
  long scaled = 0;
  long low_sum = 0;  // ACT 256: sum of M xsum over the super-block's blocks
  for (int j = 0; j < bpg; ++j) {
    int b = s * bpg + j;
    for (int h = 0; h < per; ++h) {
      int dot_sum = 0;
      ulong at = ulong(b) * TF_QBLOCK + ulong(h) * SUB;
      for (int i = 0; i < SUB; ++i) dot_sum += int(codes[w_first + at + i]) * int(xq[x_first + at + i]);
      scaled += long(scale[w_blocks * per + ulong(b) * per + h]) * long(dot_sum);
    }
    if (HAS_MIN && bpg > 1) low_sum += long(w_min[w_blocks + b]) * long(xsum[x_blocks + b]);
  }
  ulong lead = w_blocks + ulong(s) * bpg;  // the group's first block: its E and F
  long term = scaled * long(m[x_groups + s]);
  total += shift_by(term, scale_exp[lead] + k[x_groups + s] - g);
  if (HAS_MIN && bpg == 1) {
    long low = long(w_min[lead]) * long(sm[x_blocks + s]);
    total += shift_by(low, w_min_exp[lead] + se[x_blocks + s] - g);
  } else if (HAS_MIN) {
    total += shift_by(low_sum * long(m[x_groups + s]), w_min_exp[lead] + k[x_groups + s] - g);
  }
}
y[ulong(row) * ulong(num_cols) + col] = float32_of_int(total, g);
