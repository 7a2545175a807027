"""The Metal shaders of metal/ as data: each kernel's body file, its inputs, scalars, outputs and
template parameters, the helper headers it needs, and the constants header every shader reads.

One table serves both builds: on macOS tensorfold/mlx/metal.py hands a kernel's body, header and
names to mx.fast.metal_kernel; on Linux tensorfold/mlx/metal_cpu.py wraps the same body in a C++
function over the grid and compiles it with g++ against metal/metal_compat.h. The constants are
written from the Python modules that define them (tensorfold/exact, kernels/paged_attention.py,
kernels/quant_gemm.py, sampling/), so a shader cannot drift from its reference's numbers.

An argument is "type name": the element type of an array (float, int, long, ulong, int8_t, or a
template type such as KV), or of a 0-d scalar. Arrays are passed row-contiguous.
"""
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from tensorfold.exact import float32 as ref32, float64 as ref64, grid
from tensorfold.kernels import paged_attention as pa, quant_gemm as qg
from tensorfold.sampling import keyed, sampler

SHADER_DIR = Path(__file__).resolve().parents[2] / "metal"
SAMPLER_CHUNK = 4096   # tokens per thread of the sampler's chunk kernels
HEADERS = ("exact32.metal.h", "float64_soft.metal.h")


@dataclass(frozen=True)
class Kernel:
    source: str                    # the body, a file in metal/
    inputs: tuple[str, ...]        # arrays, "type name"
    scalars: tuple[str, ...]       # 0-d inputs, "type name"
    outputs: tuple[str, ...]       # arrays, "type name"
    templates: tuple[str, ...] = ()  # template parameters: a type (KV) or a constant (SUB, HAS_MIN, ACT, ...)

    @property
    def name(self) -> str:
        return self.source.removesuffix(".metal")

    @property
    def input_names(self) -> list[str]:
        return _names(self.inputs) + _names(self.scalars)

    @property
    def output_names(self) -> list[str]:
        return _names(self.outputs)

    def body(self) -> str:
        return (SHADER_DIR / self.source).read_text()


def _names(args: tuple[str, ...]) -> list[str]:
    return [a.split()[1] for a in args]


def types(args: tuple[str, ...]) -> list[str]:
    """The element types of "type name" arguments."""
    return [a.split()[0] for a in args]


_ATTENTION_DIMS = ("int num_rows", "int num_heads", "int num_kv_heads", "int head_dim", "int block_size",
                   "int table_width", "int num_keys", "int window")
_SAMPLER_DIMS = ("int num_rows", "int vocab", "int mask_words", "int num_chunks")

KERNELS = {k.name: k for k in (
    Kernel("quantize_activations.metal", ("float x",), ("int num_rows", "int num_groups"),
           ("int8_t xq", "int m", "int k", "int sm", "int se", "int xsum"), ("ACT",)),
    Kernel("quant_gemm.metal",
           ("int8_t xq", "int m", "int k", "int sm", "int se", "int xsum", "int8_t codes", "int scale",
            "int scale_exp", "int w_min", "int w_min_exp", "int top"),
           ("int num_rows", "int num_cols", "int num_blocks", "int grid_bias"), ("float y",), ("SUB", "HAS_MIN", "ACT")),
    Kernel("attention_scores.metal",
           ("float q", "int positions", "int row_seq", "int block_tables", "KV k_cache", "KV v_cache"),
           _ATTENTION_DIMS + ("float scale",), ("float scores", "int v_exp"), ("KV",)),
    Kernel("attention_softmax.metal", ("float scores", "int v_exp", "int positions"),
           ("int num_rows", "int num_heads", "int num_keys", "int window"),
           ("long weights", "int top", "long den")),
    Kernel("attention_output.metal",
           ("long weights", "int top", "long den", "int v_exp", "int positions", "int row_seq", "int block_tables",
            "KV v_cache"), _ATTENTION_DIMS, ("float out",), ("KV",)),
    Kernel("sampler_chunk_max.metal", ("float logits", "int bitmask"), _SAMPLER_DIMS,
           ("float chunk_max",), ("HAS_MASK",)),
    Kernel("sampler_tokens.metal",
           ("float logits", "int bitmask", "float chunk_max", "ulong temperature", "ulong row_key", "int mode"),
           _SAMPLER_DIMS, ("long keys", "ulong scores"), ("HAS_MASK",)),
    Kernel("sampler_chunk_fold.metal",
           ("float logits", "int bitmask", "long keys", "ulong scores", "long min_q", "int mode"), _SAMPLER_DIMS,
           ("ulong best_score", "long best_id", "long q_sum", "long count"), ("HAS_MASK",)),
    Kernel("sampler_draw.metal",
           ("int mode", "ulong best_score", "long best_id", "long q_sum", "long count", "long head_keys",
            "ulong head_scores", "long top_k", "long top_p40", "long min_q"),
           ("int num_rows", "int num_chunks", "int head_size"), ("long token", "int decided")),
    Kernel("token_bitmask.metal", ("float logits", "int bitmask"), ("int num_rows", "int vocab", "int mask_words"),
           ("float masked",)),
    Kernel("verify_accept.metal", ("long draws", "long drafts", "int path_starts"), ("int num_paths",),
           ("int accepted",)),
)}


def _f32_bits(v: float) -> str:
    return f"0x{struct.unpack('<I', struct.pack('<f', v))[0]:08X}u"


def _f64_bits(v: float) -> str:
    return f"0x{struct.unpack('<Q', struct.pack('<d', v))[0]:016X}ul"


def constants_header() -> str:
    """#defines of every number the shaders take from a reference, written from its module."""
    f32 = {"EXP_MIN": ref32.EXP_MIN, "LOG2E": ref32.LOG2E, "LN2_HI": ref32.LN2_HI, "LN2_LO": ref32.LN2_LO}
    f32.update({f"EXP_P{i}": c for i, c in enumerate(ref32.EXP_POLY)})
    f64 = {"LN2_HI64": ref64.LN2_HI64, "LN2_LO64": ref64.LN2_LO64, "INV_LN2": ref64.INV_LN2,
           "EXP64_MIN": ref64.EXP64_MIN, "TWO_M64": ref64.TWO_M64, "TINY64": ref64.TINY64, "TWO54": ref64.TWO54,
           "ROUND_MAGIC": grid.ROUND_MAGIC, "TWO32": float(sampler.Q_ONE), "TWO_M53": 2.0 ** -53}
    f64.update({f"EXP64_P{i + 1}": c for i, c in enumerate(ref64.EXP64_P)})
    f64.update({f"LG{i + 1}": c for i, c in enumerate(ref64.LOG64_LG)})
    ints = {"QBLOCK": qg.BLOCK, "X_MAX": qg.X_MAX, "QK_BITS": pa.QK_BITS, "V_BITS": pa.V_BITS,
            "W_BITS": pa.W_BITS, "L_BITS": pa.L_BITS, "NO_KEY_EXPONENT": pa.NO_KEY_EXPONENT,
            "SAMPLER_CHUNK": SAMPLER_CHUNK, "ID_BITS": sampler.ID_BITS, "P_BITS": sampler.P_BITS}
    longs = {"ID_MASK": sampler.ID_MASK, "OFF": sampler.OFF, "NO_TOKEN": sampler.NO_TOKEN,
             "SCALE_BIAS": ref64.SCALE_BIAS, "SQRT_HALF_SHIFT": ref64.SQRT_HALF_SHIFT}
    words = {"MIX_MUL1": keyed.MIX_MUL1, "MIX_MUL2": keyed.MIX_MUL2, "GAMMA": keyed.GAMMA}
    lines = ["// Written by tensorfold/mlx/metal_kernels.py from the references' modules."]
    lines += [f"#define TF_{k}_BITS {_f32_bits(v)}" for k, v in f32.items()]
    lines += [f"#define TF_{k}_BITS {_f64_bits(v)}" for k, v in f64.items()]
    lines += [f"#define TF_{k} ({v})" for k, v in ints.items()]
    lines += [f"#define TF_{k} ({v}l)" if v >= 0 else f"#define TF_{k} ({v + 1}l - 1l)" for k, v in longs.items()]
    lines += [f"#define TF_{k} 0x{v:016X}ul" for k, v in words.items()]
    lines.append(f"#define TF_F16_MAX {float(qg.F16_MAX)!r}f")
    return "\n".join(lines) + "\n"


def header_source() -> str:
    """Everything a kernel body needs above it: the constants, then the helper headers."""
    return constants_header() + "".join((SHADER_DIR / h).read_text() for h in HEADERS)


def grid_bias(kind: str, kdim: int) -> int:
    """quant_gemm's g = top[n] + kmax[row] + grid_bias for K = kdim: T - 62 + ceil(log2(#terms)),
    a dot term per activation group (kdim / act of them) and as many minimum terms."""
    spec = qg.KINDS[kind]
    return spec.term_bits - 62 + math.ceil(math.log2(kdim // spec.act * (2 if spec.has_min else 1)))
