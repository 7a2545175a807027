"""Order-free arithmetic: the rule that makes a kernel and its torch reference agree bit for bit.

A float sum depends on the order of its terms, and a GPU kernel, a CPU BLAS and Triton's
interpreter all add in different orders. So every reduction in attention and RMSNorm is done on
integers instead: each vector is written in fixed point against its own largest power of two,

    x = x_int * 2^(e - bits + 1),   e = exponent of max|x|,   |x_int| <= 2^bits,

the products and sums of those integers are carried in float64 where every partial sum stays
below 2^53 (so any order, any tiling, any GEMM gives the exact integer), or in int64 across
chunks (and everywhere on the mlx backend, which has no float64). A result is then rounded once.
The remaining steps of the forward are single float32 IEEE operations (+, -, *, /, sqrt, floor,
conversions), correctly rounded on every device (torch's own float32 sqrt is not, on the CPU:
float32.sqrt_rn stands in for it), written in the same order on every side; the kernels are
launched with FMA contraction off. Only the sampler (and the hybrids' gates) compute in float64. exp and log are not libm calls
(libm, libdevice and numpy differ in the last bit) but fixed sequences of those operations,
spelled out identically in kernels/exact_triton.py (and in csrc/cpu/exact.h, exact64.h).

What this costs in precision: a value is kept to `bits` significant bits relative to its
vector's largest element (22 for attention's q and k, 20 for v and for RMSNorm's sum of squares),
which is finer than bf16 and within a few fp32 ulps of the largest term.

The modules, each plain torch (any device; nothing here imports triton or the C++ extension, so
the kernels and the sampler can both import it):
- grid.py: the fixed-point grid (exponent, pow2, round_even, to_fixed, on_grid) and scale32,
  float32 times a power of two;
- float32.py: exp_neg, the float32 exp of attention's softmax and SiLU; sqrt_rn, a correctly
  rounded float32 square root in torch;
- float64.py: exp64 and log64, the float64 exp and log of the keyed sampler.
"""
