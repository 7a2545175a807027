"""Give a tiny qwen3_5 checkpoint a trained multi-token-prediction layer (mtp.*), so MTP drafting
has something to accept in tests and benchmarks (random MTP weights would accept nothing).

    python tools/train_mtp.py IN_DIR OUT_DIR [--seconds 5] [--seed 0]

IN_DIR is a transformers-saved tiny qwen3_5 checkpoint (tools/tiny_checkpoint.py). The script
greedy-decodes the model's own continuations of random prompts with transformers, takes its final
hidden states (after the final norm, what the server feeds the MTP layer), and trains the MTP
layer in torch on the CPU for a few seconds: row j sees (h[j], t[j+1]) at position j and learns
t[j+2], on the rows whose target the model generated (a random prompt's tokens are not
predictable). The softmax runs over the tokens the data holds plus random others (a sampled
softmax: the full 49k-column head would leave time for a handful of steps). The layer is the one models/mtp.py serves: fc over [norm(embed(t)), norm(h)], one gated
full-attention decoder layer (transformers' own Qwen3_5DecoderLayer), a final norm, the model's
embedding and head (frozen, shared). OUT_DIR gets the checkpoint with the mtp.* tensors added
and text_config.mtp_num_hidden_layers = 1, and mtp_prompts.json: the prompts it continued.
Deterministic for a seed (one thread, a fixed number of steps).

What it learns: on a tiny random model, the next-but-one token is not a function a layer learns
in seconds from a few thousand rows (held-out acceptance stays near 0); it memorises the
continuations it was trained on. So acceptance is measurable on those prompts (greedy, their
continuations are the training rows), which is what the tests and tools/bench_spec.py use;
a real checkpoint's MTP layer was trained with the model.
"""
import argparse
import json
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tensorfold.models.mtp import PREFIX  # noqa: E402


class MTPLayer(torch.nn.Module):
    """The training form of models/mtp.py's layer (RMSNorm weights as offsets from 1, as stored)."""

    def __init__(self, text_config, layer_idx: int):
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

        super().__init__()
        hidden = text_config.hidden_size
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(hidden, eps=text_config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(hidden, eps=text_config.rms_norm_eps)
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = torch.nn.ModuleList([Qwen3_5DecoderLayer(text_config, layer_idx)])
        self.norm = Qwen3_5RMSNorm(hidden, eps=text_config.rms_norm_eps)

    def forward(self, embedded, hidden, position_embeddings, mask):
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], dim=-1))
        x = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=mask)
        return self.norm(x)


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
    from transformers import AutoConfig, AutoModelForImageTextToText, Qwen3_5ForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        gen = torch.Generator().manual_seed(seed)
        config = AutoConfig.from_pretrained(in_dir)
        text_config = getattr(config, "text_config", config)
        text_config._attn_implementation = "eager"
        cls = AutoModelForImageTextToText if hasattr(config, "text_config") else Qwen3_5ForCausalLM
        model = cls.from_pretrained(in_dir, dtype=torch.float32).eval()
        vocab = text_config.vocab_size
        tokens = continuations(model, min(vocab, 49152), num_seqs, prompt_len, new_tokens, gen)  # [B, T]
        base = text_model(model)
        with torch.no_grad():
            hidden = base(input_ids=tokens).last_hidden_state  # [B, T, H], after the final norm
            embedded = base.embed_tokens(tokens)                # [B, T, H]
        head = model.get_output_embeddings()
        # Row j: (h[j], t[j+1]) at position j -> t[j+2].
        T = tokens.shape[1] - 2
        h_in, e_in, target = hidden[:, :T], embedded[:, 1:T + 1], tokens[:, 2:]
        positions = torch.arange(T).view(1, 1, T).expand(3, tokens.shape[0], T)
        with torch.no_grad():
            rope = base.rotary_emb(h_in, positions)
        mask = torch.full((T, T), float("-inf")).triu(1).view(1, 1, T, T)
        generated = torch.arange(T) + 2 >= prompt_len  # rows whose target t[j+2] the model chose
        columns = torch.unique(torch.cat([target[:, generated].reshape(-1),
                                          torch.randint(0, vocab, (negatives,), generator=gen)]))
        local = torch.searchsorted(columns, target[:, generated])  # targets as column indices
        head_rows = head.weight[columns].detach()  # [columns, H]
        layer_idx = text_config.layer_types.index("full_attention")
        mtp = MTPLayer(text_config, layer_idx)
        with torch.no_grad():
            for name, param in mtp.named_parameters():
                if name.endswith("norm.weight"):
                    param.zero_()  # stored as offsets from 1
        optimizer = torch.optim.Adam(mtp.parameters(), lr=3e-3)
        started, done, loss = time.perf_counter(), 0, None
        while done < steps and time.perf_counter() - started < seconds:
            logits = mtp(e_in, h_in, rope, mask)[:, generated] @ head_rows.T  # [B, rows, columns]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), local.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            done += 1
        with torch.no_grad():
            chosen = head(mtp(e_in, h_in, rope, mask)[:, generated]).argmax(-1)
            accuracy = (chosen == target[:, generated]).float().mean().item()
        log(f"train_mtp: {done} steps in {time.perf_counter() - started:.1f}s, loss {loss.item():.3f}, "
            f"top-1 {accuracy:.2f} on {local.numel()} rows")
        save(in_dir, out_dir, mtp)
        with open(os.path.join(out_dir, "mtp_prompts.json"), "w", encoding="utf-8") as f:
            json.dump(tokens[:, :prompt_len].tolist(), f)
        return {"steps": done, "loss": loss.item(), "accuracy": accuracy}
    finally:
        torch.set_num_threads(threads)


def save(in_dir: str, out_dir: str, mtp: MTPLayer) -> None:
    """OUT_DIR: IN_DIR's files, the mtp.* tensors added to model.safetensors, the config's
    mtp_num_hidden_layers set to 1."""
    from safetensors.torch import load_file, save_file

    if os.path.abspath(in_dir) != os.path.abspath(out_dir):
        shutil.copytree(in_dir, out_dir, dirs_exist_ok=True)
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    tensors.update({PREFIX + name: p.detach().contiguous() for name, p in mtp.state_dict().items()})
    save_file(tensors, path, metadata={"format": "pt"})
    config_path = os.path.join(out_dir, "config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    (config.get("text_config") or config)["mtp_num_hidden_layers"] = 1
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
