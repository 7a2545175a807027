"""_cpu.DecoderLayer (csrc/cpu/layer.cpp): a layer built once from its packed weights, norms and
shapes, then run per batch. Its forward equals, bitwise (outputs and the cache it writes), the
same kernels called op by op (the composition models/blocks.py runs); bad weights fail when
the layer is built.

The layers come from the tiny checkpoints' tensors, packed here with _cpu.pack_weight /
pack_quant, so the test needs nothing from the op set's Python side.
"""
import gc
import types

import pytest
import torch

from tensorfold.backends import native_problem
from tensorfold.kernels import reference
from tensorfold.models.config import ModelArgs, rope_inv_freq
from tensorfold.models.hf_dir import load_hf_dir

pytestmark = pytest.mark.skipif(native_problem() is not None, reason=str(native_problem()))

BLOCK = 16
NUM_BLOCKS = 40


def _cpu():
    from tensorfold import _cpu as ext
    return ext


def dense_gemms(tensors, prefix, dtype):
    """The layer's four GEMM weights, fused along N as the model fuses them, dense [N, K]."""
    def w(name):
        return tensors[prefix + name].to(dtype).contiguous()
    return dict(qkv=torch.cat([w(f"self_attn.{p}_proj.weight") for p in "qkv"]), o=w("self_attn.o_proj.weight"),
                gate_up=torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]),
                down=w("mlp.down_proj.weight"))


def quant_gemms(gen, shapes):
    """Random q8_0 weights of the layer's GEMM shapes (kernels/quant_gemm.QuantWeight)."""
    from test_quant_gemm import random_weight
    return {name: random_weight(gen, "q8_0", n, k) for name, (n, k) in shapes.items()}


def build(ckpt_dir, dtype, index, quant_gen=None, window=0):
    """Layer `index` of a tiny checkpoint: its shapes, packed weights, norms, and the next norm."""
    ckpt = load_hf_dir(ckpt_dir)
    a = ModelArgs.from_hf(ckpt.config)
    t, prefix = ckpt.tensors, f"model.layers.{index}."

    def norm(name):
        return t[name].to(dtype).contiguous() if name in t else None

    q_size, kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    shapes = dict(qkv=(q_size + 2 * kv_size, a.hidden_size), o=(a.hidden_size, q_size),
                  gate_up=(2 * a.intermediate_size, a.hidden_size), down=(a.hidden_size, a.intermediate_size))
    ext = _cpu()
    if quant_gen is None:
        packed = {name: ext.pack_weight(w) for name, w in dense_gemms(t, prefix, dtype).items()}
    else:
        packed = {name: ext.pack_quant(w.kind, w.codes, w.scale, w.scale_exp, w.min, w.min_exp)
                  for name, w in quant_gemms(quant_gen, shapes).items()}
    next_name = f"model.layers.{index + 1}.input_layernorm.weight"
    inv_freq, rope_scale = rope_inv_freq(a.rope, a.head_dim)
    cos, sin = reference.rope_table(inv_freq, rope_scale, 1024)  # [max_position, head_dim]
    return types.SimpleNamespace(
        args=a, dtype=dtype, shapes=shapes, packed=packed, post_norm=norm(prefix + "post_attention_layernorm.weight"),
        q_norm=norm(prefix + "self_attn.q_norm.weight"), k_norm=norm(prefix + "self_attn.k_norm.weight"),
        next_norm=norm(next_name), scale=a.head_dim ** -0.5, window=window, cos=cos, sin=sin,
        quant=quant_gen is not None)


def make_layer(p):
    a = p.args
    return _cpu().DecoderLayer(p.packed["qkv"], p.packed["o"], p.packed["gate_up"], p.packed["down"], p.post_norm,
                               p.q_norm, p.k_norm, num_heads=a.num_heads, num_kv_heads=a.num_kv_heads,
                               head_dim=a.head_dim, hidden=a.hidden_size, intermediate=a.intermediate_size,
                               eps=a.rms_norm_eps, scale=p.scale, window=p.window)


def steps(gen, p, kv_dtype, record: bool):
    """Two forwards over one cache: a prefill of two sequences (20 and 300 rows: the second's
    later call takes the decode rows' path), then 3 verify rows of the first and 1 decode row of
    the second. Each step: the batch's tensors, with random x and residual."""
    a = p.args
    tables = torch.stack([torch.arange(0, 20).flip(0), torch.arange(20, 40)[torch.randperm(20, generator=gen)]])
    cache = dict(k=torch.zeros(NUM_BLOCKS, BLOCK, a.num_kv_heads, a.head_dim, dtype=kv_dtype))
    cache["v"] = torch.zeros_like(cache["k"])
    cache["v_exp"] = torch.zeros(NUM_BLOCKS, BLOCK, a.num_kv_heads, dtype=torch.int16) if record else None
    batches = []
    for spans in ([(0, 20), (0, 300)], [(20, 23), (300, 301)]):
        pos = torch.cat([torch.arange(lo, hi) for lo, hi in spans])
        seq = torch.cat([torch.full((hi - lo,), s) for s, (lo, hi) in enumerate(spans)])
        slots = tables[seq, pos // BLOCK] * BLOCK + pos % BLOCK
        starts = torch.tensor([0] + [hi - lo for lo, hi in spans]).cumsum(0)
        rows = len(pos)
        batches.append(dict(
            x=torch.randn(rows, a.hidden_size, generator=gen).to(p.dtype),
            residual=torch.randn(rows, a.hidden_size, generator=gen).to(p.dtype),
            cos=p.cos[pos], sin=p.sin[pos], slots=slots, positions=pos, tables=tables, row_starts=starts))
    return cache, batches


def clone_cache(cache):
    return {k: (v.clone() if v is not None else None) for k, v in cache.items()}


def op_by_op(p, b, cache, next_norm):
    """The layer as models/llama.py composes it, one kernel call at a time."""
    ext, a = _cpu(), p.args
    rows = b["x"].shape[0]

    def gemm(x, name):
        n, k = p.shapes[name]
        if p.quant:
            return ext.quant_linear(x, p.packed[name], n, k)
        return ext.linear_packed(x, p.packed[name], n, k)

    q_size, kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    qkv = gemm(b["x"], "qkv")
    q = qkv[:, :q_size].reshape(rows, a.num_heads, a.head_dim)
    k = qkv[:, q_size:q_size + kv_size].reshape(rows, a.num_kv_heads, a.head_dim)
    v = qkv[:, q_size + kv_size:].reshape(rows, a.num_kv_heads, a.head_dim)
    if p.q_norm is not None:
        q = ext.rms_norm_rope(q, p.q_norm, a.rms_norm_eps, b["cos"], b["sin"])
        k = ext.rms_norm_rope(k, p.k_norm, a.rms_norm_eps, b["cos"], b["sin"])
    else:
        q = ext.apply_rope(q, b["cos"], b["sin"])
        k = ext.apply_rope(k, b["cos"], b["sin"])
    ext.write_kv(cache["k"], cache["v"], k, v, b["slots"], v_exp=cache["v_exp"])
    attn = ext.paged_attention(q, cache["k"], cache["v"], b["positions"], b["tables"], b["row_starts"], p.scale,
                               p.window, v_exp=cache["v_exp"])
    x2, h = ext.add_rms_norm(gemm(attn.reshape(rows, -1), "o"), b["residual"], p.post_norm, a.rms_norm_eps)
    gate, up = gemm(x2, "gate_up").split(a.intermediate_size, dim=-1)
    mlp = gemm(ext.silu_and_mul(gate, up), "down")
    if next_norm is not None:
        return ext.add_rms_norm(mlp, h, next_norm, a.rms_norm_eps)
    return None, h + mlp


def forward(layer, b, cache, next_norm):
    return layer.forward(b["x"], b["residual"], next_norm, b["cos"], b["sin"], cache["k"], cache["v"],
                         cache["v_exp"], b["slots"], b["positions"], b["tables"], b["row_starts"])


def assert_same(got, want, what):
    for g, w, name in zip(got, want, ("x_next", "residual")):
        assert (g is None) == (w is None), f"{what}: {name} None on one side only"
        if g is not None:
            assert g.dtype == w.dtype and torch.equal(g, w), f"{what}: {name} differs"


def check_against_the_ops(p, kv_dtype, record, gen, last):
    next_norm = None if last else p.next_norm
    layer = make_layer(p)
    cache, batches = steps(gen, p, kv_dtype, record)
    caches = {path: clone_cache(cache) for path in ("layer", "ops")}
    for i, b in enumerate(batches):
        got = forward(layer, b, caches["layer"], next_norm)
        assert (got[0] is None) == last
        assert_same(got, op_by_op(p, b, caches["ops"], next_norm), f"step {i}: DecoderLayer vs op by op")
        for name in ("k", "v", "v_exp"):
            if record or name != "v_exp":
                assert torch.equal(caches["layer"][name], caches["ops"][name]), f"step {i}: cache {name} differs"
    assert caches["layer"]["k"].abs().sum() > 0  # the layer wrote the cache


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3"])
@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                            (torch.float32, torch.bfloat16)], ids=["f32", "bf16", "f32-bf16cache"])
@pytest.mark.parametrize("last", [False, True], ids=["next-norm", "last-layer"])
def test_forward_equals_the_op_by_op_layer(request, draw, arch, dtype, kv_dtype, last):
    p = build(request.getfixturevalue(arch), dtype, 0)
    check_against_the_ops(p, kv_dtype, record=not last, gen=draw.gen, last=last)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_quantized_weights_and_a_window(tiny_llama, draw, dtype):
    """q8_0 packed weights (pack_quant) for all four GEMMs, and a sliding window of 8 keys."""
    p = build(tiny_llama, dtype, 0, quant_gen=draw.gen, window=8)
    check_against_the_ops(p, torch.bfloat16, record=True, gen=draw.gen, last=False)


def test_the_window_reaches_the_attention(tiny_llama, draw):
    """Negative control: the layer built with another window gives other outputs."""
    outs = []
    for window in (0, 8):
        p = build(tiny_llama, torch.float32, 0, window=window)
        cache, batches = steps(torch.Generator().manual_seed(draw.seed), p, torch.float32, record=True)
        layer = make_layer(p)
        for b in batches:
            out = forward(layer, b, cache, p.next_norm)
        outs.append(out[0])
    assert not torch.equal(outs[0], outs[1])


def test_the_layer_keeps_its_weights_alive(tiny_qwen3, draw):
    """Built from tensors nobody else holds: the layer's own references keep them."""
    p = build(tiny_qwen3, torch.float32, 0)
    a = p.args
    clones = {name: w.clone() for name, w in p.packed.items()}
    layer = _cpu().DecoderLayer(clones.pop("qkv"), clones.pop("o"), clones.pop("gate_up"), clones.pop("down"),
                                p.post_norm.clone(), p.q_norm.clone(), p.k_norm.clone(), a.num_heads,
                                a.num_kv_heads, a.head_dim, a.hidden_size, a.intermediate_size, a.rms_norm_eps,
                                p.scale, 0)
    gc.collect()
    junk = [torch.full_like(w, 7) for w in p.packed.values()]  # reuses freed memory, were any freed
    assert (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.hidden, layer.intermediate, layer.window) == (
        a.num_heads, a.num_kv_heads, a.head_dim, a.hidden_size, a.intermediate_size, 0)
    cache, batches = steps(draw.gen, p, torch.float32, record=True)
    want_cache = clone_cache(cache)
    got = forward(layer, batches[0], cache, p.next_norm)
    assert_same(got, op_by_op(p, batches[0], want_cache, p.next_norm), "a layer of its own tensors")
    del junk


def test_bad_weights_fail_when_the_layer_is_built(tiny_llama, tiny_qwen3):
    ext = _cpu()
    p = build(tiny_llama, torch.float32, 0)
    a = p.args
    shape = dict(num_heads=a.num_heads, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, hidden=a.hidden_size,
                 intermediate=a.intermediate_size, eps=a.rms_norm_eps, scale=p.scale, window=0)
    w = dict(p.packed, post_norm=p.post_norm, q_norm=None, k_norm=None)

    def built(**changes):
        args = {**w, **shape, **changes}
        return ext.DecoderLayer(args.pop("qkv"), args.pop("o"), args.pop("gate_up"), args.pop("down"),
                                args.pop("post_norm"), args.pop("q_norm"), args.pop("k_norm"), **args)

    built()  # the right parts build
    n, k = p.shapes["qkv"]
    with pytest.raises(RuntimeError, match=rf"DecoderLayer: qkv is not a packed weight of \[{n}, {k}\]"):
        built(qkv=p.packed["o"])  # a weight of another shape
    with pytest.raises(RuntimeError, match=r"DecoderLayer: down is not a packed weight .* layer's dtype"):
        built(down=ext.pack_weight(torch.zeros(a.hidden_size, a.intermediate_size, dtype=torch.bfloat16)))
    with pytest.raises(RuntimeError, match=r"DecoderLayer: gate_up is not a packed weight"):
        built(intermediate=a.intermediate_size * 2)  # the shapes disagree with the weights
    from test_quant_gemm import random_weight
    q = random_weight(torch.Generator().manual_seed(0), "q8_0", a.hidden_size, a.hidden_size * 2)
    with pytest.raises(RuntimeError, match=r"DecoderLayer: o_proj is not a packed quantized weight of \["):
        built(o=ext.pack_quant(q.kind, q.codes, q.scale, q.scale_exp, q.min, q.min_exp))
    with pytest.raises(RuntimeError, match="post_norm must be a contiguous CPU tensor of 64 elements"):
        built(post_norm=torch.ones(a.hidden_size + 1))
    with pytest.raises(RuntimeError, match="q_norm and k_norm come together"):
        built(q_norm=torch.ones(a.head_dim))
    with pytest.raises(RuntimeError, match="head_dim must be even"):
        built(head_dim=a.head_dim + 1)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        built(post_norm=p.post_norm.half())

    # and a forward's batch is checked against the layer
    layer = built()
    cache, batches = steps(torch.Generator().manual_seed(0), p, torch.float32, record=True)
    b = batches[0]
    with pytest.raises(RuntimeError, match=r"DecoderLayer.forward: x must be contiguous \[tokens, 64\]"):
        forward(layer, dict(b, x=b["x"][:, :32].contiguous()), cache, None)
    with pytest.raises(RuntimeError, match="in the layer's dtype"):
        forward(layer, dict(b, x=b["x"].bfloat16()), cache, None)
    wrong = dict(cache, k=cache["k"][:, :, :1].contiguous(), v=cache["v"][:, :, :1].contiguous())
    with pytest.raises(RuntimeError, match="DecoderLayer.forward: contiguous CPU caches"):
        forward(layer, b, wrong, None)
    with pytest.raises(RuntimeError, match="next_norm must be"):
        forward(layer, b, cache, torch.ones(a.hidden_size, dtype=torch.bfloat16))
