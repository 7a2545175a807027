"""The cpu backend's op set: the batch-invariant torch references under the names a model calls.

A model takes an `ops` module; cuda_ops.py offers the same names backed by Triton kernels.
`sample` is the engine's draw (the keyed sampler); its tokens come back as Python ints.
"""
from tensorfold.kernels.paged_attention import paged_attention_ref as paged_attention  # noqa: F401
from tensorfold.kernels.paged_attention import paged_decode_attention_ref as paged_decode_attention  # noqa: F401
from tensorfold.kernels.paged_attention import write_kv_ref as write_kv  # noqa: F401
from tensorfold.kernels.reference import (add_rms_norm, apply_rope, linear, pad_rows, rms_norm,  # noqa: F401
                                          rms_norm_rope, rope_table, silu_and_mul)
from tensorfold.sampling.sampler import sample  # noqa: F401
