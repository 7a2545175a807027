"""The mlx backend's model and ops: MLX arrays (Apple's array framework: Metal on a Mac, its CPU
device on Linux), exact without float64.

Metal has no float64, and the torch references finish their exact sums in float64
(tensorfold/exact). Here every sum is an int64 sum (products of integers on the fixed-point
grid, computed as float32 matmuls of 8-bit limbs, each exact) and every other step is one
float32 IEEE operation or an integer operation on the bits. On MLX's CPU device, which has
float64, the same integers ride in float64 instead (grid.float64_carrier: exact, and far
cheaper than int64 there). Which steps give the torch
references' bits and which are this backend's own is listed in grid.py and ops.py and in
docs/kernels.md ("The mlx backend").

    grid.py   the fixed-point grid in integers: exponents, rounding shifts, exact int matmul,
              float32(float64(T) 2^g) without float64, exp_neg
    ops.py    the op set: norms, rope, SwiGLU, the K/V cache write, paged attention, the GEMMs
    delta_net.py  Gated DeltaNet: the gates (exp64/log64 in float64 on MLX's CPU stream), the conv,
              the grid dot products, the delta rule, the state per block
    moe.py    the mixture-of-experts feed-forward: routing, experts, the fixed-order sum
    model.py  the decoder (llama, qwen3, the Qwen hybrids) on those ops over a paged cache and recurrent states
    gemma4.py Gemma 4's layers and model-level parts (and GeGLU, tanh, soft-capping)
"""
