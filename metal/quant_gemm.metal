// quant_gemm: quant_gemm.linear's steps 2-4 (kernels/quant_gemm.py), bitwise, every kind.
// One thread per output y[row, col] (col = weight row n), a plain loop over the blocks of K:
// 2. per block b and sub-block h the integer dot A = sum c xq (int: |A| < 2^19), the block term
//    I = (sum_h S A) m at exponent E + k, and with a minimum M sm at exponent F + se;
// 3. each term onto the grid 2^g, g = top[n] + kmax[row] + grid_bias (grid_bias = T - 62 +
//    ceil(log2 #terms), from the host), rounded half to even where bits drop; one long sum,
//    exact in any order;
// 4. y = float32(float64(total) 2^g) on integers (float32_of_int).
// Template constants: SUB (weights per scale S: 32, or 16 for q6_k), HAS_MIN (q4_1, q4_k, q5_k).
// Inputs: xq [num_rows, K] int8 and m, k, sm, se [num_rows, num_blocks] (quantize_activations);
// codes [num_cols, K] int8, scale [num_cols, K / SUB], scale_exp, w_min, w_min_exp
// [num_cols, num_blocks] int32 (the last two a dummy without a minimum), top [num_cols] int32.
uint col = thread_position_in_grid.x;
uint row = thread_position_in_grid.y;
if (col >= uint(num_cols) || row >= uint(num_rows)) return;
const int per = TF_QBLOCK / SUB;
ulong x_blocks = ulong(row) * ulong(num_blocks);
ulong w_blocks = ulong(col) * ulong(num_blocks);
ulong x_first = x_blocks * TF_QBLOCK;
ulong w_first = w_blocks * TF_QBLOCK;

int kmax = k[x_blocks];
for (int b = 1; b < num_blocks; ++b) kmax = k[x_blocks + b] > kmax ? k[x_blocks + b] : kmax;
int g = top[col] + kmax + grid_bias;

long total = 0;
for (int b = 0; b < num_blocks; ++b) {
  long scaled = 0;
  for (int h = 0; h < per; ++h) {
    int dot_sum = 0;
    ulong at = ulong(b) * TF_QBLOCK + ulong(h) * SUB;
    for (int i = 0; i < SUB; ++i) dot_sum += int(codes[w_first + at + i]) * int(xq[x_first + at + i]);
    scaled += long(scale[w_blocks * per + ulong(b) * per + h]) * long(dot_sum);
  }
  long term = scaled * long(m[x_blocks + b]);
  total += shift_by(term, scale_exp[w_blocks + b] + k[x_blocks + b] - g);
  if (HAS_MIN) {
    long low = long(w_min[w_blocks + b]) * long(sm[x_blocks + b]);
    total += shift_by(low, w_min_exp[w_blocks + b] + se[x_blocks + b] - g);
  }
}
y[ulong(row) * ulong(num_cols) + col] = float32_of_int(total, g);
