"""Batch-invariant torch ops: the reference every kernel is checked against, and the cpu backend.

Invariant: row i of every op's output is bitwise the same whatever other rows share the call,
how many there are, and where row i sits (shared/research/exactness-on-cpu.md has the
measurements behind each choice):
- GEMMs pad the row count to a multiple of 8 and make one call (stock mm/linear change a row's
  bits with M; padded calls did not, for M <= 1024, 1-4 threads, fp32 and bf16).
- Norms reduce each row alone in fp32; SiLU is x / (1 + exp(-x)) (stock silu's vector body and
  scalar tail round differently); rope reads a precomputed table.
The engine re-checks these at startup on the loaded model's shapes (engine/probes.py).
"""
import torch
import torch.nn.functional as F

ROW_PAD = 8


def pad_rows(x: torch.Tensor, multiple: int = ROW_PAD) -> torch.Tensor:
    num_rows = x.shape[0]
    padded = -(-num_rows // multiple) * multiple
    if padded == num_rows:
        return x
    return torch.cat([x, x.new_zeros((padded - num_rows, *x.shape[1:]))])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias) -> [M, N], row-invariant by padding M to 8."""
    num_rows = x.shape[0]
    out = F.linear(pad_rows(x), weight)  # [M_pad, N]
    out = out[:num_rows]
    if bias is not None:
        out = out + bias
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, each row reduced alone in fp32."""
    x32 = x.float()
    var = (x32 * x32).mean(dim=-1, keepdim=True)
    out = x32 / torch.sqrt(var + eps)
    return (out * weight.float()).to(x.dtype)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g = gate.float()
    return (g / (1.0 + torch.exp(-g)) * up.float()).to(gate.dtype)


def rope_table(inv_freq: list[float], scale: float, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_position, head_dim] (fp32), half-split (rotate_half) layout."""
    inv = torch.tensor(inv_freq, dtype=torch.float64).float()  # [head_dim // 2]
    pos = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(pos, inv)  # [max_position, head_dim // 2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [max_position, head_dim]
    return emb.cos() * scale, emb.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, num_heads, head_dim]; cos/sin [num_tokens, head_dim] already gathered by position."""
    x32 = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    out = x32 * cos[:, None, :] + rotated * sin[:, None, :]
    return out.to(x.dtype)
