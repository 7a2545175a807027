"""Give a tiny checkpoint a trained multi-token-prediction layer, so MTP drafting has something to
accept in tests and benchmarks (random MTP weights would accept nothing).

    python tools/train_mtp.py IN_DIR OUT_DIR [--seconds 5] [--seed 0]

IN_DIR is a transformers-saved tiny checkpoint (tools/tiny_checkpoint.py) of a family with an MTP
layer: qwen3_5, qwen3_5_moe and qwen3_next (Qwen3.5/3.6's and Flash Next's mtp.*), glm_moe_dsa (GLM-5's next-n layer, model.layers.{L}.*) or
nemotron_h (Nemotron 3's mtp.layers.*). The script greedy-decodes the model's own continuations of
random prompts with transformers, takes its final hidden states (after the final norm, what the
server feeds the MTP layer), and trains the MTP layer in torch on the CPU for a few seconds: row j
sees (h[j], t[j+1]) at position j and learns t[j+2], on the rows whose target the model generated
(a random prompt's tokens are not predictable). The softmax runs over the tokens the data holds
plus random others (a sampled softmax: the full 49k-column head would leave time for a handful of
steps). The layer is the one models/mtp.py serves, in its training form (MTPLayer): fc over
[norm(embed(t)), norm(h)], the family's decoder layers (transformers' own: Qwen3_5DecoderLayer,
Qwen3_5MoeDecoderLayer or Qwen3NextDecoderLayer, GlmMoeDsaDecoderLayer with an indexer of its own, NemotronHBlocks in the
config's MTP pattern), a final norm, the model's embedding and head (frozen, shared). OUT_DIR gets the checkpoint with the
MTP tensors added under the family's names (models/mtp.MTPNames; GLM's also with the copies of the
embedding and head a real checkpoint stores), the config's count set to 1
(mtp_num_hidden_layers, num_nextn_predict_layers) and mtp_prompts.json: the prompts it continued.
Deterministic for a seed (one thread, a fixed number of steps).

What it learns: on a tiny random model, the next-but-one token is not a function a layer learns
in seconds from a few thousand rows (held-out acceptance stays near 0); it memorises the
continuations it was trained on. So acceptance is measurable on those prompts (greedy, their
continuations are the training rows), which is what the tests and tools/bench_spec.py use;
a real checkpoint's MTP layer was trained with the model.
"""
import argparse
import copy
import json
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Form:
    """A family's training form: its layers and norms (transformers' modules), how a layer runs,
    and where the config declares the layer. Subclasses per family."""
    declare_key = ""
    norm_value = 1.0  # a fresh norm weight (Qwen3.5 stores offsets from 1: 0)

    def __init__(self, config):
        self.config = config
        self.text = getattr(config, "text_config", config)
        self.text._attn_implementation = "eager"

    def norm(self):
        raise NotImplementedError

    def layers(self) -> list:
        raise NotImplementedError

    def context(self, base, hidden, num_rows: int) -> dict:
        """What every layer's forward takes beside x: the causal mask and the rope of positions 0.."""
        mask = torch.full((num_rows, num_rows), float("-inf")).triu(1).view(1, 1, num_rows, num_rows)
        positions = torch.arange(num_rows).view(1, num_rows).expand(hidden.shape[0], num_rows)
        return {"attention_mask": mask, "position_embeddings": base.rotary_emb(hidden, positions),
                "position_ids": positions}

    def run(self, layer, x, context):
        return layer(x, **context)

    def init(self, mtp) -> None:
        """Fresh values for what transformers' modules leave empty or constant."""

    def declare(self, config: dict) -> None:
        (config.get("text_config") or config)[self.declare_key] = 1


class QwenForm(Form):
    declare_key, norm_value = "mtp_num_hidden_layers", 0.0

    def norm(self):
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm
        return Qwen3_5RMSNorm(self.text.hidden_size, eps=self.text.rms_norm_eps)

    def layers(self):
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer
        return [Qwen3_5DecoderLayer(self.text, self.text.layer_types.index("full_attention"))]

    def context(self, base, hidden, num_rows):
        mask = torch.full((num_rows, num_rows), float("-inf")).triu(1).view(1, 1, num_rows, num_rows)
        positions = torch.arange(num_rows).view(1, 1, num_rows).expand(3, hidden.shape[0], num_rows)
        return {"position_embeddings": base.rotary_emb(hidden, positions), "attention_mask": mask}

    def init(self, mtp):
        with torch.no_grad():
            for name, param in mtp.named_parameters():
                if name.endswith("norm.weight"):
                    param.zero_()  # stored as offsets from 1


class QwenMoeForm(QwenForm):
    """Qwen3.5/3.6-MoE's MTP layer: gated attention and the model's MoE (routed experts, the gated
    shared expert), its stacked experts drawn fresh (a module built outside a model leaves them empty)."""

    def layers(self):
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer
        return [Qwen3_5MoeDecoderLayer(self.text, self.text.layer_types.index("full_attention"))]

    def init(self, mtp):
        _init_fresh(mtp)
        super().init(mtp)


class QwenNextForm(QwenMoeForm):
    """Qwen3-Next's (Flash Next's) MTP layer: a full-attention decoder layer with the model's MoE,
    as Qwen3.6's, in Qwen3-Next's modules; its rope is one row of positions (no M-RoPE)."""

    def norm(self):
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm
        return Qwen3NextRMSNorm(self.text.hidden_size, eps=self.text.rms_norm_eps)

    def layers(self):
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer
        return [Qwen3NextDecoderLayer(self.text, self.text.layer_types.index("full_attention"))]

    context = Form.context


class GlmForm(Form):
    """GLM-5's next-n layer: a decoder layer at index num_hidden_layers with an indexer of its own
    and the MoE."""
    declare_key = "num_nextn_predict_layers"

    def norm(self):
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaRMSNorm
        return GlmMoeDsaRMSNorm(self.text.hidden_size, eps=self.text.rms_norm_eps)

    def layers(self):
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaDecoderLayer
        extended = copy.deepcopy(self.text)
        extended.indexer_types = list(extended.indexer_types) + ["full"]
        extended.mlp_layer_types = list(extended.mlp_layer_types) + ["sparse"]
        return [GlmMoeDsaDecoderLayer(extended, self.text.num_hidden_layers)]

    def run(self, layer, x, context):
        return layer(x, **context)[0]

    def init(self, mtp):
        _init_fresh(mtp)


class NemotronForm(Form):
    """Nemotron 3's MTP layers: NemotronHBlocks in the config's MTP pattern (transformers' default:
    attention, then MoE), after the decoder's."""
    declare_key = "num_nextn_predict_layers"

    def norm(self):
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNorm
        return NemotronHRMSNorm(self.text.hidden_size, eps=self.text.layer_norm_epsilon)

    def layers(self):
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHBlock
        extended = copy.deepcopy(self.text)
        first = len(extended.layers_block_type)
        extended.layers_block_type = list(extended.layers_block_type) + list(self.text.mtp_layers_block_type)
        return [NemotronHBlock(extended, first + i) for i in range(len(self.text.mtp_layers_block_type))]

    def context(self, base, hidden, num_rows):
        return {"attention_mask": torch.full((num_rows, num_rows), float("-inf")).triu(1).view(1, 1, num_rows, num_rows)}

    def init(self, mtp):
        _init_fresh(mtp)

    def declare(self, config):
        letters = {"full_attention": "*", "attention": "*", "moe": "E", "mlp": "-"}
        config.update(num_nextn_predict_layers=1,  # the Hub's spelling of the pattern
                      mtp_hybrid_override_pattern="".join(letters[k] for k in self.text.mtp_layers_block_type))
        config.pop("mtp_layers_block_type", None)


FORMS = {"qwen3_5": QwenForm, "qwen3_5_text": QwenForm, "qwen3_5_moe": QwenMoeForm, "qwen3_5_moe_text": QwenMoeForm,
         "qwen3_next": QwenNextForm, "glm_moe_dsa": GlmForm, "nemotron_h": NemotronForm}


def _init_fresh(mtp, std: float = 0.1) -> None:
    """Every norm weight 1, biases 0, every other parameter N(0, std) (transformers' modules built
    outside a model leave some empty: the stacked experts, the routers at zero)."""
    with torch.no_grad():
        for name, param in mtp.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, std)


class MTPLayer(torch.nn.Module):
    """The training form of models/mtp.py's layer: enorm, hnorm, fc, the family's layers, norm."""

    def __init__(self, form: Form):
        super().__init__()
        hidden = form.text.hidden_size
        self.form = form
        self.enorm, self.hnorm = form.norm(), form.norm()
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = torch.nn.ModuleList(form.layers())
        self.norm = form.norm()
        form.init(self)

    def forward(self, embedded, hidden, context):
        x = self.fc(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        for layer in self.layers:
            x = self.form.run(layer, x, context)
        return self.norm(x)

    def checkpoint_tensors(self, names, model) -> dict:
        """The trained tensors under the family's checkpoint names (models/mtp.MTPNames), the
        stacked experts one matrix per expert as the real checkpoints store them."""
        from tensorfold.models.loader import split_stacked_experts

        out = {_checkpoint_name(name, names): value.detach().contiguous() for name, value in self.state_dict().items()}
        split_stacked_experts(out)
        copies = {"embed_tokens.weight": model.get_input_embeddings().weight,
                  "shared_head.head.weight": model.get_output_embeddings().weight}
        out.update({names.prefix + n: copies[n].detach().contiguous() for n in names.ignored})
        return {n: v.contiguous() for n, v in out.items()}


def load_form(path: str):
    """(the transformers model of the checkpoint at path, its Form, its family's MTPNames)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from tensorfold.models.config import ModelArgs
    from tensorfold.models.registry import model_family

    config = AutoConfig.from_pretrained(path)
    form = FORMS[config.model_type](config)
    cls = AutoModelForImageTextToText if hasattr(config, "text_config") else AutoModelForCausalLM
    model = cls.from_pretrained(path, dtype=torch.float32).eval()
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    form.declare(raw)  # the names of the layer as saved (Nemotron-H's follow its declared pattern)
    args = ModelArgs.from_hf(raw, os.path.join(path, "config.json"))
    names = model_family(raw["architectures"][0], path).mtp_layer(args).names
    return model, form, names


def text_model(model):
    return model.model.language_model if hasattr(model.model, "language_model") else model.model


def continuations(model, vocab: int, num: int, prompt_len: int, new_tokens: int, gen) -> torch.Tensor:
    """[num, prompt_len + new_tokens]: random prompts and the model's greedy continuations."""
    prompts = torch.randint(100, vocab, (num, prompt_len), generator=gen)
    with torch.no_grad():
        return model.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)


def train(in_dir: str, out_dir: str, steps: int = 150, seconds: float = 30.0, seed: int = 0, num_seqs: int = 16,
          prompt_len: int = 8, new_tokens: int = 40, negatives: int = 1024, log=print) -> dict:
    """Train `steps` Adam steps (fewer if `seconds` run out) and save; returns {"steps", "loss",
    "accuracy"} (accuracy: full-vocabulary greedy top-1 on the generated rows)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        gen = torch.Generator().manual_seed(seed)
        model, form, names = load_form(in_dir)
        vocab = form.text.vocab_size
        tokens = continuations(model, min(vocab, 49152), num_seqs, prompt_len, new_tokens, gen)  # [B, T]
        base = text_model(model)
        with torch.no_grad():
            hidden = base(input_ids=tokens).last_hidden_state  # [B, T, H], after the final norm
            embedded = model.get_input_embeddings()(tokens)     # [B, T, H]
        head = model.get_output_embeddings()
        # Row j: (h[j], t[j+1]) at position j -> t[j+2].
        T = tokens.shape[1] - 2
        h_in, e_in, target = hidden[:, :T], embedded[:, 1:T + 1], tokens[:, 2:]
        with torch.no_grad():
            context = form.context(base, h_in, T)
        generated = torch.arange(T) + 2 >= prompt_len  # rows whose target t[j+2] the model chose
        columns = torch.unique(torch.cat([target[:, generated].reshape(-1),
                                          torch.randint(0, vocab, (negatives,), generator=gen)]))
        local = torch.searchsorted(columns, target[:, generated])  # targets as column indices
        head_rows = head.weight[columns].detach()  # [columns, H]
        mtp = MTPLayer(form)
        optimizer = torch.optim.Adam(mtp.parameters(), lr=3e-3)
        started, done, loss = time.perf_counter(), 0, None
        while done < steps and time.perf_counter() - started < seconds:
            logits = mtp(e_in, h_in, context)[:, generated] @ head_rows.T  # [B, rows, columns]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), local.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            done += 1
        with torch.no_grad():
            chosen = head(mtp(e_in, h_in, context)[:, generated]).argmax(-1)
            accuracy = (chosen == target[:, generated]).float().mean().item()
        log(f"train_mtp: {done} steps in {time.perf_counter() - started:.1f}s, loss {loss.item():.3f}, "
            f"top-1 {accuracy:.2f} on {local.numel()} rows")
        save(in_dir, out_dir, mtp.checkpoint_tensors(names, model), form)
        with open(os.path.join(out_dir, "mtp_prompts.json"), "w", encoding="utf-8") as f:
            json.dump(tokens[:, :prompt_len].tolist(), f)
        return {"steps": done, "loss": loss.item(), "accuracy": accuracy}
    finally:
        torch.set_num_threads(threads)


def trained_layer(path: str):
    """(the transformers model, the MTPLayer holding the checkpoint's trained MTP tensors): the
    training form of what the server loads, for tests."""
    from safetensors.torch import load_file

    from tensorfold.models.loader import STACKED_EXPERTS

    model, form, names = load_form(path)
    mtp = MTPLayer(form)
    stored = load_file(os.path.join(path, "model.safetensors"))
    state = {}
    for name, value in mtp.state_dict().items():
        full = _checkpoint_name(name, names)
        if full in stored:
            state[name] = stored[full]
        else:  # stacked experts, stored one matrix per expert
            prefix, stacked = full.rsplit("experts.", 1)
            projs = STACKED_EXPERTS["experts." + stacked]
            state[name] = torch.stack([torch.cat([stored[f"{prefix}experts.{e}.{p}.weight"] for p in projs])
                                       for e in range(value.shape[0])])
    mtp.load_state_dict(state)
    return model, mtp


def _checkpoint_name(name: str, names) -> str:
    """An MTPLayer parameter's name in the checkpoint (models/mtp.MTPNames)."""
    where = {"enorm.": names.norm_embedding, "hnorm.": names.norm_hidden, "fc.": names.fc, "norm.": names.norm}
    top = name.split(".", 1)[0] + "."
    if top in where:
        return names.prefix + where[top]
    i, rest = name[len("layers."):].split(".", 1)  # layers.i.<its own names>
    return names.prefix + names.layers[int(i)] + rest


def save(in_dir: str, out_dir: str, tensors: dict, form: Form) -> None:
    """OUT_DIR: IN_DIR's files, the MTP tensors added to model.safetensors, the config's count set to 1."""
    from safetensors.torch import load_file, save_file

    if os.path.abspath(in_dir) != os.path.abspath(out_dir):
        shutil.copytree(in_dir, out_dir, dirs_exist_ok=True)
    path = os.path.join(out_dir, "model.safetensors")
    stored = load_file(path)
    stored.update(tensors)
    save_file(stored, path, metadata={"format": "pt"})
    config_path = os.path.join(out_dir, "config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    form.declare(config)
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("in_dir")
    p.add_argument("out_dir")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seconds", type=float, default=30.0, help="stop early past this")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    train(args.in_dir, args.out_dir, args.steps, args.seconds, args.seed)


if __name__ == "__main__":
    main()
