"""Llama-family decoder (SmolLM2, Llama 2/3): GQA, RMSNorm, SwiGLU, rope, optional tied head.

Weights arrive as a dict of Hugging Face parameter names; Q/K/V and gate/up are fused into one
GEMM each. A GEMM weight is a dense tensor or a quantized one (kernels/quant_gemm.QuantWeight:
GGUF blocks kept as stored); the op set packs either. Every op comes from `ops` (the backend's
batch-invariant set), so the same file runs the cpu reference and the cuda kernels; weights and
rope tables live on `device`.
"""
import torch

from tensorfold.kernels import quant_gemm, reference
from tensorfold.models.checkpoint import CheckpointError
from tensorfold.models.config import ModelArgs, rope_inv_freq
from tensorfold.models.forward_batch import ForwardBatch, KVCache, LayerKV


class Layer:
    def __init__(self, tensors: dict, prefix: str, args: ModelArgs, dtype: torch.dtype, window: int | None,
                 device: torch.device, pack):
        def get(name):
            return _take(tensors, prefix + name, dtype, device)

        def maybe(name):
            return get(name) if prefix + name in tensors else None

        def gemm(*names):  # one GEMM weight in the op set's layout (pack), fused along N
            parts = [_take_matrix(tensors, prefix + n, dtype, device) for n in names]
            if len({_format(p) for p in parts}) > 1:  # a Q4_K_M file's Q6_K v beside Q4_K q, k
                return tuple(pack(p) for p in parts)  # (N-concatenated outputs: Model.linear)
            return pack(parts[0] if len(parts) == 1 else _stack(parts))

        attn, mlp = "self_attn.", "mlp."
        self.input_norm = get("input_layernorm.weight")
        self.post_attn_norm = get("post_attention_layernorm.weight")
        self.qkv = gemm(attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight")
        biases = [maybe(attn + f"{p}_proj.bias") for p in "qkv"]
        self.qkv_bias = torch.cat(biases) if biases[0] is not None else None
        self.o = gemm(attn + "o_proj.weight")
        self.o_bias = maybe(attn + "o_proj.bias")
        self.gate_up = gemm(mlp + "gate_proj.weight", mlp + "up_proj.weight")
        self.down = gemm(mlp + "down_proj.weight")
        # The op set's one-call layer takes single weights and no biases.
        self.fusable = self.qkv_bias is None and self.o_bias is None and not any(
            isinstance(w, tuple) for w in (self.qkv, self.o, self.gate_up, self.down))
        self.q_norm = maybe(attn + "q_norm.weight")  # qwen3
        self.k_norm = maybe(attn + "k_norm.weight")
        self.window = window


class Model:
    """forward(batch, cache) -> logits [num_logits, vocab] (fp32) for batch.logits_rows."""

    def __init__(self, args: ModelArgs, tensors: dict, dtype: torch.dtype, ops, device: torch.device | str = "cpu"):
        self.args = args
        self.dtype = dtype
        self.ops = ops
        self.device = device = torch.device(device)
        embed = _take_matrix(tensors, "model.embed_tokens.weight", dtype, device)
        if tuple(embed.shape) != (args.vocab_size, args.hidden_size):
            raise CheckpointError(f"model.embed_tokens.weight has shape {tuple(embed.shape)}, "
                                  f"config says ({args.vocab_size}, {args.hidden_size})")
        quantized = isinstance(embed, quant_gemm.QuantWeight)
        # A quantized table is kept once, in the op set's layout, and looked up from there
        # (ops.embedding); a tied head then is the same object.
        self.embed = ops.pack_weight(embed) if quantized else embed
        self.layers = [Layer(tensors, f"model.layers.{i}.", args, dtype, args.layer_windows[i], device,
                             ops.pack_weight) for i in range(args.num_layers)]
        self.norm = _take(tensors, "model.norm.weight", dtype, device)
        if "lm_head.weight" in tensors:
            self.lm_head = ops.pack_weight(_take_matrix(tensors, "lm_head.weight", dtype, device))
        elif args.tie_word_embeddings:  # dense: a packed copy where the op set packs (the lookup reads embed)
            self.lm_head = self.embed if quantized else ops.pack_weight(embed)
        else:
            raise CheckpointError("lm_head.weight is missing and the config does not tie embeddings")
        inv_freq, rope_scale = rope_inv_freq(args.rope, args.head_dim)
        cos, sin = reference.rope_table(inv_freq, rope_scale, args.max_position)  # built on the CPU
        self.cos, self.sin = cos.to(device), sin.to(device)  # [max_position, head_dim]
        self.scale = args.head_dim ** -0.5

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        a = self.args
        h = self._embed(batch.input_ids)  # [num_rows, hidden]
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]  # [num_rows, head_dim]
        residual = h
        x = self.ops.rms_norm(h, self.layers[0].input_norm, a.rms_norm_eps)
        fused = getattr(self.ops, "decoder_layer", None)  # an op set that runs a whole layer
        for i, layer in enumerate(self.layers):
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else None
            kv = cache.layer(i)
            if fused is not None and layer.fusable:
                x, residual = fused(self, layer, x, residual, next_norm, batch, cos, sin, kv)
                continue
            attn = self._attention(layer, x, batch, cos, sin, kv)
            x, residual = self.ops.add_rms_norm(attn, residual, layer.post_attn_norm, a.rms_norm_eps)
            gate_up = self.linear(x, layer.gate_up)  # [num_rows, 2 * intermediate]
            gate, up = gate_up.split(a.intermediate_size, dim=-1)
            mlp = self.linear(self.ops.silu_and_mul(gate, up), layer.down)
            if next_norm is not None:  # the add and the next layer's norm, in one op
                x, residual = self.ops.add_rms_norm(mlp, residual, next_norm, a.rms_norm_eps)
            else:
                residual = residual + mlp
        last = self.ops.rms_norm(residual[batch.logits_rows], self.norm, a.rms_norm_eps)
        return self.ops.linear(last, self.lm_head).float()  # [num_logits, vocab]

    def weight_formats(self) -> dict[str, int]:
        """How many GEMM matrices use each weight format (float32, bfloat16, q4_1, ...)."""
        gemms = [w for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [self.lm_head]
        gemms = [part for w in gemms for part in (w if isinstance(w, tuple) else (w,))]
        formats: dict[str, int] = {}
        for w in gemms:
            formats[_format(w)] = formats.get(_format(w), 0) + 1
        return formats

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.ops.embedding(self.embed, ids).to(self.dtype)

    def _attention(self, layer: Layer, x, batch: ForwardBatch, cos, sin, kv: LayerKV):
        a = self.args
        num_rows = x.shape[0]
        qkv = self.linear(x, layer.qkv, layer.qkv_bias)
        q_size, kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        q = qkv[:, :q_size].reshape(num_rows, a.num_heads, a.head_dim)
        k = qkv[:, q_size:q_size + kv_size].reshape(num_rows, a.num_kv_heads, a.head_dim)
        v = qkv[:, q_size + kv_size:].reshape(num_rows, a.num_kv_heads, a.head_dim)
        if layer.q_norm is not None:  # qwen3: per-head norm, then rope, in one op
            q = self.ops.rms_norm_rope(q, layer.q_norm, a.rms_norm_eps, cos, sin)
            k = self.ops.rms_norm_rope(k, layer.k_norm, a.rms_norm_eps, cos, sin)
        else:
            q = self.ops.apply_rope(q, cos, sin)
            k = self.ops.apply_rope(k, cos, sin)
        self.ops.write_kv(kv.k, kv.v, k, v, batch.slot_mapping, v_exp=kv.v_exp)
        # Every row of every sequence in one call: each row's result is the one it gets alone.
        out = self.ops.attention(q, kv.k, kv.v, batch, self.scale, layer.window, v_exp=kv.v_exp)
        return self.linear(out.reshape(num_rows, -1), layer.o, layer.o_bias)

    def linear(self, x, weight, bias=None):
        if isinstance(weight, tuple):  # parts of different formats: their outputs side by side
            out = torch.cat([self.ops.linear(x, part) for part in weight], dim=1)
            return out if bias is None else out + bias
        return self.ops.linear(x, weight, bias)


def _take_matrix(tensors: dict, name: str, dtype: torch.dtype, device: torch.device):
    """A GEMM weight: quantized blocks stay blocks (on `device`), dense ones become `dtype`."""
    if isinstance(tensors.get(name), quant_gemm.QuantWeight):
        return tensors[name].to(device)
    return _take(tensors, name, dtype, device)


def _stack(parts: list):
    """Weights of one format fused along N."""
    if isinstance(parts[0], quant_gemm.QuantWeight):
        return quant_gemm.cat(parts)
    return torch.cat(parts)


def _format(weight) -> str:
    fmt = getattr(weight, "format", None) or getattr(weight, "kind", None)
    return fmt or str(weight.dtype).removeprefix("torch.")


def _take(tensors: dict, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if name not in tensors:
        raise CheckpointError(f"missing tensor '{name}'")
    return tensors[name].to(device=device, dtype=dtype).contiguous()
