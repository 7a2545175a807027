"""tools/tiny_checkpoint.py's Qwen hybrids (qwen3_5, qwen3_5_moe, qwen3_next): each checkpoint holds
exactly the tensors, names and shapes of the real Hub checkpoints' layout, its config.json the Hub's
fields, it loads back into transformers (the ForCausalLM that AutoModelForCausalLM picks and, for the
multimodal ones, the ForConditionalGeneration) unchanged, and well_separated_seed's seed decodes the
same tokens after the round trip."""
import json
import os

import pytest

torch = pytest.importorskip("torch")
from safetensors import safe_open  # noqa: E402

from tools.tiny_checkpoint import (HYBRID_ARCHS, SEED_PROMPT, build_tiny_model, family_tokenizer,  # noqa: E402
                                   hybrid_margins, make_tiny_checkpoint, well_separated_seed)

H, I, E, EI, VOCAB = 64, 128, 8, 32, 49152 + 4  # hidden, intermediate, experts, expert width; SmolLM2 + 4
HEADS, KV, HD = 4, 2, 32
KH, VH, KD, VD, CONV = 4, 8, 16, 16, 4  # linear attention: key/value heads and head dims, conv kernel
LINEAR, FULL = (0, 1, 2), (3,)


def expected_tensors(arch: str) -> dict:
    """name -> shape of every tensor the tiny `arch` checkpoint must hold (the Hub's layout)."""
    text = "model." if arch == "qwen3_next" else "model.language_model."
    out = {f"{text}embed_tokens.weight": (VOCAB, H), f"{text}norm.weight": (H,)}
    key_dim, value_dim = KH * KD, VH * VD
    for n in range(4):
        p = f"{text}layers.{n}."
        out[p + "input_layernorm.weight"] = (H,)
        out[p + "post_attention_layernorm.weight"] = (H,)
        if n in LINEAR:
            la = p + "linear_attn."
            out.update({la + "A_log": (VH,), la + "dt_bias": (VH,),
                        la + "conv1d.weight": (2 * key_dim + value_dim, 1, CONV),
                        la + "norm.weight": (VD,), la + "out_proj.weight": (H, value_dim)})
            if arch == "qwen3_next":
                out[la + "in_proj_qkvz.weight"] = (2 * key_dim + 2 * value_dim, H)
                out[la + "in_proj_ba.weight"] = (2 * VH, H)
            else:
                out.update({la + "in_proj_qkv.weight": (2 * key_dim + value_dim, H),
                            la + "in_proj_z.weight": (value_dim, H),
                            la + "in_proj_b.weight": (VH, H), la + "in_proj_a.weight": (VH, H)})
        else:
            sa = p + "self_attn."
            out.update({sa + "q_proj.weight": (HEADS * HD * 2, H), sa + "k_proj.weight": (KV * HD, H),
                        sa + "v_proj.weight": (KV * HD, H), sa + "o_proj.weight": (H, HEADS * HD),
                        sa + "q_norm.weight": (HD,), sa + "k_norm.weight": (HD,)})
        mlp = p + "mlp."
        if arch == "qwen3_5":
            out.update({mlp + "gate_proj.weight": (I, H), mlp + "up_proj.weight": (I, H),
                        mlp + "down_proj.weight": (H, I)})
            continue
        out.update({mlp + "gate.weight": (E, H), mlp + "shared_expert_gate.weight": (1, H),
                    mlp + "shared_expert.gate_proj.weight": (EI, H), mlp + "shared_expert.up_proj.weight": (EI, H),
                    mlp + "shared_expert.down_proj.weight": (H, EI)})
        if arch == "qwen3_5_moe":  # fused, as Qwen3.5/3.6-35B-A3B's shards hold them
            out.update({mlp + "experts.gate_up_proj": (E, 2 * EI, H), mlp + "experts.down_proj": (E, H, EI)})
        else:  # per expert, as Qwen3-Next-80B-A3B's
            for e in range(E):
                out.update({f"{mlp}experts.{e}.gate_proj.weight": (EI, H), f"{mlp}experts.{e}.up_proj.weight": (EI, H),
                            f"{mlp}experts.{e}.down_proj.weight": (H, EI)})
    if arch != "qwen3_next":  # the vision tower: one block of width 32, patches 16x16 over 2 frames, 2x2 merge
        v, vh = "model.visual.", 32
        out.update({v + "patch_embed.proj.weight": (vh, 3, 2, 16, 16), v + "patch_embed.proj.bias": (vh,),
                    v + "pos_embed.weight": (64, vh),
                    v + "blocks.0.norm1.weight": (vh,), v + "blocks.0.norm1.bias": (vh,),
                    v + "blocks.0.norm2.weight": (vh,), v + "blocks.0.norm2.bias": (vh,),
                    v + "blocks.0.attn.qkv.weight": (3 * vh, vh), v + "blocks.0.attn.qkv.bias": (3 * vh,),
                    v + "blocks.0.attn.proj.weight": (vh, vh), v + "blocks.0.attn.proj.bias": (vh,),
                    v + "blocks.0.mlp.linear_fc1.weight": (64, vh), v + "blocks.0.mlp.linear_fc1.bias": (64,),
                    v + "blocks.0.mlp.linear_fc2.weight": (vh, 64), v + "blocks.0.mlp.linear_fc2.bias": (vh,),
                    v + "merger.norm.weight": (vh,), v + "merger.norm.bias": (vh,),
                    v + "merger.linear_fc1.weight": (4 * vh, 4 * vh), v + "merger.linear_fc1.bias": (4 * vh,),
                    v + "merger.linear_fc2.weight": (H, 4 * vh), v + "merger.linear_fc2.bias": (H,)})
    return out


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The models are tiny: a second thread only waits (on a loaded runner, many times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hybrids(one_thread, tmp_path_factory, smollm2_tokenizer):
    """arch -> (folder, seed, margins): each hybrid made with its family tokenizer and a well separated seed."""
    made = {}
    for arch in HYBRID_ARCHS:
        seed = well_separated_seed(arch, tokenizer=smollm2_tokenizer, family=True)
        tokenizer = family_tokenizer(arch, smollm2_tokenizer, family=True)
        prompt = tokenizer(SEED_PROMPT, add_special_tokens=False)["input_ids"]
        margins = hybrid_margins(build_tiny_model(arch, seed, tokenizer), prompt)
        folder = make_tiny_checkpoint(str(tmp_path_factory.mktemp(arch)), arch, seed=seed,
                                      tokenizer=smollm2_tokenizer, family=True)
        made[arch] = folder, seed, prompt, margins
    return made


def tensors(folder: str) -> dict:
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_tensor_layout(hybrids, arch):
    """Exactly the Hub's tensor names and shapes; tied embeddings, so no lm_head.weight."""
    found = {k: tuple(v.shape) for k, v in tensors(hybrids[arch][0]).items()}
    expected = expected_tensors(arch)
    assert sorted(set(found) - set(expected)) == [] and sorted(set(expected) - set(found)) == []
    assert found == expected


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_config_fields(hybrids, arch):
    with open(os.path.join(hybrids[arch][0], "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    text = config if arch == "qwen3_next" else config["text_config"]
    assert text["linear_num_key_heads"] == KH and text["linear_num_value_heads"] == VH
    assert (text["linear_key_head_dim"], text["linear_value_head_dim"]) == (KD, VD)
    assert text["linear_conv_kernel_dim"] == CONV
    assert text["full_attention_interval"] == 4 and text["rms_norm_eps"] == 1e-6 and text["head_dim"] == HD
    if arch == "qwen3_next":  # the Hub's flat form: no layer_types, no rope_parameters
        assert config["architectures"] == ["Qwen3NextForCausalLM"] and "layer_types" not in config
        assert "rope_parameters" not in config
        assert (config["rope_theta"], config["partial_rotary_factor"]) == (1e7, 0.25)
        assert config["norm_topk_prob"] is True
        assert config["decoder_sparse_step"] == 1 and config["mlp_only_layers"] == []
    else:
        cls = "Qwen3_5ForConditionalGeneration" if arch == "qwen3_5" else "Qwen3_5MoeForConditionalGeneration"
        assert config["architectures"] == [cls] and config["model_type"] == arch
        assert text["model_type"] == f"{arch}_text" and config["vision_config"]["model_type"] == f"{arch}_vision"
        assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
        rope = text["rope_parameters"]
        assert rope == {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                        "mrope_section": [2, 1, 1], "mrope_interleaved": True}
        assert sum(rope["mrope_section"]) == int(HD * rope["partial_rotary_factor"]) // 2
        assert text["attn_output_gate"] is True and config["tie_word_embeddings"] is True
        assert "norm_topk_prob" not in text  # Qwen3.5-MoE always renormalises its top-k
    if arch != "qwen3_5":
        assert (text["num_experts"], text["num_experts_per_tok"]) == (E, 2)
        assert (text["moe_intermediate_size"], text["shared_expert_intermediate_size"]) == (EI, EI)


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_weights_are_drawn(hybrids, arch):
    """Norms, dt_bias and A_log random (transformers leaves norms at 0 or 1 and dt_bias at 1)."""
    found = tensors(hybrids[arch][0])
    for name, t in found.items():
        if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight",
                          "language_model.norm.weight")):
            assert 0.05 < t.std() < 0.5 and t.abs().mean() < 0.5, name  # zero-centred: x_hat * (1 + w)
        elif name.endswith(("linear_attn.norm.weight", "dt_bias")):
            assert 0.05 < t.std() < 0.5 and abs(t.mean() - 1) < 0.5, name  # plain weight / bias around 1
        elif name.endswith("A_log"):
            assert t.std() > 0.1 and (t.exp() >= 0.01).all() and (t.exp() <= 16).all(), name


def load_checks(arch, folder, prompt, tokens):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    loaders = [AutoModelForCausalLM] + ([AutoModelForImageTextToText] if arch != "qwen3_next" else [])
    for loader in loaders:
        model = loader.from_pretrained(folder).eval()
        expected = {"qwen3_5": "Qwen3_5", "qwen3_5_moe": "Qwen3_5Moe", "qwen3_next": "Qwen3Next"}[arch]
        assert type(model).__name__.startswith(expected)
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=len(tokens),
                                 min_new_tokens=len(tokens))
        assert out[0, len(prompt):].tolist() == tokens, type(model).__name__


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_loads_back_and_generates(hybrids, arch):
    """The saved checkpoint, read back by transformers, decodes the in-memory model's greedy tokens."""
    folder, seed, prompt, margins = hybrids[arch]
    load_checks(arch, folder, prompt, margins["tokens"])


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_seed_is_well_separated(hybrids, arch):
    folder, seed, prompt, margins = hybrids[arch]
    assert margins["token_gap"] > 1e-3 and margins["distinct"] >= 4
    assert (margins["route_gap"] is None) == (arch == "qwen3_5")
    if arch != "qwen3_5":
        assert margins["route_gap"] > 1e-3


def test_vision_tower_runs(hybrids):
    """The tiny tower is one transformers accepts: a 32x32 image (2 frames) becomes one merged token."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(hybrids["qwen3_5"][0]).eval()
    with torch.inference_mode():
        features = model.model.get_image_features(pixel_values=torch.randn(4, 3 * 2 * 16 * 16),
                                                  image_grid_thw=torch.tensor([[1, 2, 2]]))
    pooled = features.pooler_output if hasattr(features, "pooler_output") else features
    assert [tuple(f.shape) for f in pooled] == [(1, H)]


def test_untied_and_overrides(tmp_path, smollm2_tokenizer):
    """Overrides reach the text model: untied embeddings write lm_head.weight, more layers keep the
    interval of full attention."""
    folder = make_tiny_checkpoint(str(tmp_path / "next"), "qwen3_next", tokenizer=smollm2_tokenizer,
                                  tie_word_embeddings=False, num_hidden_layers=8)
    found = tensors(folder)
    assert found["lm_head.weight"].shape == (49152, H)
    assert "model.layers.7.self_attn.q_proj.weight" in found and "model.layers.6.linear_attn.A_log" in found
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(folder)
    assert config.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert config.tie_word_embeddings is False


def reference_logits(folder: str, ids: list) -> "torch.Tensor":
    """The hybrids' forward written out from the checkpoint's tensors and config.json alone (no cache,
    one sequence, float32), as a statement of the math the tensor names stand for."""
    import torch.nn.functional as F
    from safetensors.torch import load_file

    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    t = cfg.get("text_config", cfg)
    w = load_file(os.path.join(folder, "model.safetensors"))
    pre = "model.language_model." if "text_config" in cfg else "model."
    eps, nh, nkv, hd = t["rms_norm_eps"], t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    kh, vh = t["linear_num_key_heads"], t["linear_num_value_heads"]
    kd, vd, r = t["linear_key_head_dim"], t["linear_value_head_dim"], t["linear_num_value_heads"] // kh
    rope = t.get("rope_parameters") or {key: t[key] for key in ("rope_theta", "partial_rotary_factor")}
    rd = int(hd * rope["partial_rotary_factor"])  # rotated dims; text-only mrope is plain rope over them
    n = len(ids)
    angle = torch.arange(n).float()[:, None] / rope["rope_theta"] ** (torch.arange(0, rd, 2).float() / rd)
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    types = t.get("layer_types") or ["full_attention" if (i + 1) % t["full_attention_interval"] == 0
                                     else "linear_attention" for i in range(t["num_hidden_layers"])]

    def norm(x, weight, centred=True):  # RMSNorm in float32: x_hat * (1 + w), or x_hat * w for the gated one
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return x * (1 + weight) if centred else x * weight

    def rotate(x):  # neox halves over the first rd dims of each head, the rest passed through
        x1, x2, rest = x[..., :rd // 2], x[..., rd // 2:rd], x[..., rd:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], -1)

    def l2(x):
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    def ffn(h, gate, up, down):
        return (F.silu(h @ gate.T) * (h @ up.T)) @ down.T

    x = w[pre + "embed_tokens.weight"][ids]
    for layer, kind in enumerate(types):
        p = f"{pre}layers.{layer}."
        h = norm(x, w[p + "input_layernorm.weight"])
        if kind == "full_attention":
            a = p + "self_attn."
            qg = (h @ w[a + "q_proj.weight"].T).view(n, nh, 2 * hd)  # per head: [query hd | gate hd]
            q, gate = norm(qg[..., :hd], w[a + "q_norm.weight"]), qg[..., hd:].reshape(n, nh * hd)
            k = norm((h @ w[a + "k_proj.weight"].T).view(n, nkv, hd), w[a + "k_norm.weight"])
            v = (h @ w[a + "v_proj.weight"].T).view(n, nkv, hd)
            q, k = rotate(q), rotate(k).repeat_interleave(nh // nkv, 1)
            s = torch.einsum("qhd,khd->hqk", q, k) * hd ** -0.5
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
            o = torch.einsum("hqk,khd->qhd", s, v.repeat_interleave(nh // nkv, 1)).reshape(n, nh * hd)
            mixed = (o * torch.sigmoid(gate)) @ w[a + "o_proj.weight"].T
        else:
            a = p + "linear_attn."
            if a + "in_proj_qkvz.weight" in w:  # Qwen3-Next: per key head [q kd | k kd | v r*vd | z r*vd], [b r | a r]
                q, k, v, z = (h @ w[a + "in_proj_qkvz.weight"].T).view(n, kh, -1).split([kd, kd, r * vd, r * vd], -1)
                b, al = (h @ w[a + "in_proj_ba.weight"].T).view(n, kh, 2 * r).split([r, r], -1)
                qkv = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], -1)
                z, b, al = z.reshape(n, vh, vd), b.reshape(n, vh), al.reshape(n, vh)
            else:  # Qwen3.5: [all q | all k | all v] heads, z per value head, b and a per value head
                qkv = h @ w[a + "in_proj_qkv.weight"].T
                z = (h @ w[a + "in_proj_z.weight"].T).view(n, vh, vd)
                b, al = h @ w[a + "in_proj_b.weight"].T, h @ w[a + "in_proj_a.weight"].T
            taps = w[a + "conv1d.weight"][:, 0]  # [channels, K], causal: tap K-1 is the current token
            padded = F.pad(qkv.T, (taps.shape[1] - 1, 0))
            qkv = F.silu(torch.stack([(padded[:, i:i + taps.shape[1]] * taps).sum(-1) for i in range(n)]))
            q, k, v = qkv.split([kh * kd, kh * kd, vh * vd], -1)
            q = l2(q.view(n, kh, kd)).repeat_interleave(r, 1) * kd ** -0.5  # value head j reads key head j // r
            k, v = l2(k.view(n, kh, kd)).repeat_interleave(r, 1), v.view(n, vh, vd)
            beta = torch.sigmoid(b)
            decay = (-w[a + "A_log"].exp() * F.softplus(al + w[a + "dt_bias"])).exp()
            state, outs = torch.zeros(vh, kd, vd), []
            for i in range(n):  # gated delta rule
                state = state * decay[i][:, None, None]
                delta = (v[i] - torch.einsum("hkv,hk->hv", state, k[i])) * beta[i][:, None]
                state = state + k[i][:, :, None] * delta[:, None, :]
                outs.append(torch.einsum("hkv,hk->hv", state, q[i]))
            o = norm(torch.stack(outs), w[a + "norm.weight"], centred=False) * F.silu(z)
            mixed = o.reshape(n, vh * vd) @ w[a + "out_proj.weight"].T
        x = x + mixed
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        m = p + "mlp."
        if m + "gate.weight" not in w:
            y = ffn(h, w[m + "gate_proj.weight"], w[m + "up_proj.weight"], w[m + "down_proj.weight"])
        else:  # softmax over all experts, top-k, renormalised; plus the sigmoid-gated shared expert
            top, chosen = (h @ w[m + "gate.weight"].T).softmax(-1).topk(t["num_experts_per_tok"], -1)
            if t.get("norm_topk_prob", True):
                top = top / top.sum(-1, keepdim=True)
            y = torch.sigmoid(h @ w[m + "shared_expert_gate.weight"].T) * ffn(
                h, w[m + "shared_expert.gate_proj.weight"], w[m + "shared_expert.up_proj.weight"],
                w[m + "shared_expert.down_proj.weight"])
            for i in range(n):
                for weight, e in zip(top[i], chosen[i].tolist()):
                    if m + "experts.gate_up_proj" in w:  # fused: rows [gate I | up I]
                        gate, up = w[m + "experts.gate_up_proj"][e].chunk(2, 0)
                        down = w[m + "experts.down_proj"][e]
                    else:
                        gate, up, down = (w[f"{m}experts.{e}.{part}_proj.weight"] for part in ("gate", "up", "down"))
                    y[i] = y[i] + weight * ffn(h[i], gate, up, down)
        x = x + y
    return norm(x, w[pre + "norm.weight"]) @ w.get("lm_head.weight", w[pre + "embed_tokens.weight"]).T


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_reference_math(hybrids, arch):
    """The math written out in reference_logits is transformers' (float32 rounding apart)."""
    from transformers import AutoModelForCausalLM

    folder, _, prompt, _ = hybrids[arch]
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.inference_mode():
        expected = model(torch.tensor([prompt])).logits[0]
    got = reference_logits(folder, prompt)
    assert torch.allclose(got, expected, atol=1e-3, rtol=0), (got - expected).abs().max()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
