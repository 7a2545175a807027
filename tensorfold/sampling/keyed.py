"""Keyed randomness: the request seed and the Gumbel noise of (seed, position, token id).

Invariants:
- A token's noise is a pure function of (seed, absolute reply position, global token id). It never
  depends on the shard layout, the row order, the batch or the tensor the id sits in, nor on the
  machine: the hash is elementwise integer arithmetic, and the log is not libm's but
  `exact.float64.log64`, a fixed sequence of correctly rounded float64 operations, so the noise has the
  same bits on every CPU kind and in the Triton sampler on any device (tests/test_exact_math.py
  checks the Triton spelling against this one bit for bit; tests/test_sampler.py re-checks layout
  independence through the sharded sampler).
- There is no global RNG anywhere: randomness is always an argument (the seed).

The hash is splitmix64's finalizer (`mix64`, Stafford's variant 13), applied twice:

    row_key(seed, position) = mix64(mix64(seed) + (position + 1) * GAMMA_POS)      (mod 2^64)
    token_hash(key, v)      = mix64(key + (v + 1) * GAMMA)                          (mod 2^64)

i.e. each (seed, position) row walks its own splitmix64 stream, indexed by token id. Tensors
carry the 64-bit words as two's-complement int64: torch's int64 add/mul/xor wrap mod 2^64, and
its `>>` is arithmetic, so a logical shift is emulated by masking off the sign-extended bits.

The uniform takes the top 52 bits k of the hash: u = (2k + 1) / 2^53. That is the midpoint grid
of 2^52 cells, exact in float64 and never 0 or 1 (a 53-bit k with a half offset would need 54
significand bits and round 1 - 2^-54 up to 1.0). Gumbel noise is g = -log(-log(u)) in float64,
both logs `log64` (within 1 ulp of the true log; -log(u) lies in [2^-53, 36.8])."""
import hashlib

import torch

from tensorfold.exact.float64 import log64
from tensorfold.sampling.params import MASK64

GAMMA = 0x9E3779B97F4A7C15        # splitmix64's increment (odd, golden ratio)
GAMMA_POS = 0xD1B54A32D192ED03    # a second odd increment for positions
MIX_MUL1 = 0xBF58476D1CE4E5B9
MIX_MUL2 = 0x94D049BB133111EB


def _signed(x: int) -> int:
    """A 64-bit word as the int64 value with the same bits."""
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


def derive_seed(prompt_ids: list[int]) -> int:
    """The seed of a request that gives none: the first 8 bytes, big-endian, of
    SHA-256(",".join(str(i) for i in prompt_ids) as ASCII), an unsigned 64-bit int."""
    text = ",".join(str(int(i)) for i in prompt_ids)
    return int.from_bytes(hashlib.sha256(text.encode("ascii")).digest()[:8], "big")


def request_seed(seed: int | None, prompt_ids: list[int]) -> int:
    """The request's sampling key in [0, 2^64): its `seed` mod 2^64 (so -1 is 2^64 - 1, the
    two's-complement reading), else `derive_seed(prompt_ids)`."""
    if seed is None:
        return derive_seed(prompt_ids)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
    return seed & MASK64


def mix64(x: int) -> int:
    """splitmix64's finalizer on a Python int (mod 2^64): a bijection with full avalanche."""
    x &= MASK64
    x = ((x ^ (x >> 30)) * MIX_MUL1) & MASK64
    x = ((x ^ (x >> 27)) * MIX_MUL2) & MASK64
    return x ^ (x >> 31)


def row_key(seed: int, position: int) -> int:
    """The stream key of one draw: (seed, absolute reply position) -> 64-bit word."""
    if not 0 <= seed <= MASK64 or position < 0:
        raise ValueError(f"need 0 <= seed < 2^64 and position >= 0, got {seed}, {position}")
    return mix64(mix64(seed) + (position + 1) * GAMMA_POS)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 words (torch's >> sign-extends)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """`mix64` elementwise on int64 tensors, bit-identical to the Python-int version."""
    x = (x ^ _shr(x, 30)) * _signed(MIX_MUL1)
    x = (x ^ _shr(x, 27)) * _signed(MIX_MUL2)
    return x ^ _shr(x, 31)


def row_key_words(seeds: list[int], positions: list[int]) -> list[int]:
    """Stream keys of a batch of rows as int64 words, host ints (the native draw's form)."""
    return [_signed(row_key(s, p)) for s, p in zip(seeds, positions, strict=True)]


def row_keys(seeds: list[int], positions: list[int]) -> torch.Tensor:
    """row_key_words as a tensor.  # [num_rows, 1]"""
    return torch.tensor(row_key_words(seeds, positions), dtype=torch.int64).reshape(-1, 1)


def token_hash(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """64-bit hash words of (row key, token id); broadcasts keys [R, 1] against ids [R|1, N]."""
    return mix64_tensor(keys + (token_ids + 1) * _signed(GAMMA))


def uniform(words: torch.Tensor) -> torch.Tensor:
    """u = (2k + 1) / 2^53 from the top 52 bits k of each word; exact, in (0, 1)."""
    k = _shr(words, 12)
    return (k * 2 + 1).to(torch.float64) * 2.0 ** -53


def gumbel(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise -log(-log(u)) in float64 for each (row key, token id), with the
    libm-free log64, in torch operations (any device). The native op set's sampler runs the C++
    spelling, tensorfold._cpu.gumbel, instead (the same bits: tests/test_cpu_kernels.py)."""
    neg_log_u = log64(uniform(token_hash(keys, token_ids))).neg_()  # in [2^-53, 36.8]
    return log64(neg_log_u).neg_()
