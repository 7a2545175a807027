// quantize_activations: quant_gemm.quantize_activations (kernels/quant_gemm.py, step 1), bitwise.
// One thread per (group of ACT columns, row) of x [num_rows, num_groups * ACT] float32, ACT the
// kind's activation group (template: 32, or 256 for the K-quants):
// 1. amax = max |x| over the group; a group with amax < 2^-120 is zero (xq = 0, d = 0);
// 2. d = amax / 127 and inverse = 127 / amax, correctly rounded (div_rn);
// 3. xq = round_even(x inverse) clamped to [-127, 127] (one float32 product, rounded on integers);
// 4. (m, k) = float16(min(d, 65504)) per group, and per block of 32 (sm, se) =
//    float16(clamp(d sum(xq), +-65504)) as significands and exponents (half_parts), d sum(xq) one
//    float32 product, and xsum = sum(xq) itself (exact: the K-quants' minimum terms use it).
// Outputs: xq [num_rows, K] int8; m, k [num_rows, num_groups], sm, se, xsum [num_rows, K / 32] int32.
uint group = thread_position_in_grid.x;
uint row = thread_position_in_grid.y;
if (group >= uint(num_groups) || row >= uint(num_rows)) return;
const int per = ACT / TF_QBLOCK;  // blocks of 32 per group
ulong at = ulong(row) * ulong(num_groups) + group;
ulong first = at * ACT;
ulong first_block = at * per;

float amax = 0.0f;
for (int i = 0; i < ACT; ++i) {
  float mag = as_type<float>(as_type<uint>(x[first + i]) & 0x7FFFFFFFu);
  amax = mag > amax ? mag : amax;
}
bool zero = exponent_of(amax) < -120;  // below: 127 / amax overflows
float d = zero ? 0.0f : div_rn(amax, float(TF_X_MAX));
float inverse = zero ? 0.0f : div_rn(float(TF_X_MAX), amax);
for (int b = 0; b < per; ++b) {
  int code_sum = 0;
  for (int i = b * TF_QBLOCK; i < (b + 1) * TF_QBLOCK; ++i) {
    float scaled = x[first + i] * inverse;
    float mag = as_type<float>(as_type<uint>(scaled) & 0x7FFFFFFFu);
    int code;
    if (zero) {
      code = 0;
    } else if (mag >= float(TF_X_MAX)) {  // round(|v| >= 127) >= 127: clamped
      code = scaled < 0.0f ? -TF_X_MAX : TF_X_MAX;
    } else {
      Significand s = significand(scaled);
      code = int(shift_by(s.m, s.e));  // |scaled| < 127 < 2^23: round half to even
    }
    xq[first + i] = int8_t(code);
    code_sum += code;
  }
  float s = d * float(code_sum);  // exact code_sum (|sum| <= 32 127): one rounding
  s = s < -TF_F16_MAX ? -TF_F16_MAX : (s > TF_F16_MAX ? TF_F16_MAX : s);
  Significand minimum = half_parts(s);
  sm[first_block + b] = int(minimum.m);
  se[first_block + b] = minimum.e;
  xsum[first_block + b] = code_sum;
}
float d16 = d < TF_F16_MAX ? d : TF_F16_MAX;
Significand scale = half_parts(d16);
m[at] = int(scale.m);
k[at] = scale.e;
