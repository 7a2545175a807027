"""Load a Hugging Face checkpoint directory into a Checkpoint.

Reads config.json, model.safetensors or sharded *.safetensors (with model.safetensors.index.json),
tokenizer.json, tokenizer_config.json, chat_template.jinja (or the template inside
tokenizer_config.json) and generation_config.json. Every failure names the file and the problem.
"""
import json
import os

from tensorfold.models.checkpoint import Checkpoint, CheckpointError


def load_hf_dir(path: str) -> Checkpoint:
    config = _read_json(path, "config.json", required=True)
    tensors = _load_safetensors(path)
    tokenizer = _load_tokenizer(path)
    tokenizer_config = _read_json(path, "tokenizer_config.json", required=False)
    generation_config = _read_json(path, "generation_config.json", required=False)
    return Checkpoint(
        path=path,
        config=config,
        tensors=tensors,
        tokenizer=tokenizer,
        tokenizer_config={k: _token_text(v) if k in ("bos_token", "eos_token") else v
                          for k, v in tokenizer_config.items()},
        chat_template=_chat_template(path, tokenizer_config),
        generation_config=generation_config,
    )


def _read_json(path: str, name: str, required: bool) -> dict:
    file = os.path.join(path, name)
    if not os.path.exists(file):
        if required:
            raise CheckpointError(f"{file}: missing")
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file}: cannot be read as JSON ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    return data


def _load_safetensors(path: str) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index_file = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(index_file):
        weight_map = _read_json(path, "model.safetensors.index.json", required=True).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_file}: no weight_map")
        files = sorted(set(weight_map.values()))
    elif os.path.exists(single):
        files, weight_map = ["model.safetensors"], None
    else:
        found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not found:
            raise CheckpointError(f"{path}: no model.safetensors, sharded *.safetensors or index found")
        raise CheckpointError(f"{path}: found {', '.join(found)} but no model.safetensors.index.json")
    tensors = {}
    for name in files:
        file = os.path.join(path, name)
        if not os.path.exists(file):
            raise CheckpointError(f"{file}: missing (listed in model.safetensors.index.json)")
        try:
            tensors.update(load_file(file))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{file}: cannot be read ({e}); the file may be truncated") from e
    if weight_map is not None:
        missing = sorted(k for k in weight_map if k not in tensors)
        if missing:
            raise CheckpointError(f"{index_file}: tensors listed but absent from their shards: {missing[:5]}")
    return tensors


def _load_tokenizer(path: str):
    from tokenizers import Tokenizer

    file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(file):
        raise CheckpointError(f"{file}: missing (only fast tokenizers are supported)")
    try:
        return Tokenizer.from_file(file)
    except Exception as e:  # tokenizers raises a bare Exception on parse errors
        raise CheckpointError(f"{file}: cannot be parsed ({e})") from e


def _chat_template(path: str, tokenizer_config: dict) -> str | None:
    file = os.path.join(path, "chat_template.jinja")
    if os.path.exists(file):
        with open(file, encoding="utf-8") as f:
            return f.read()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_text(token) -> str | None:
    if isinstance(token, dict):  # AddedToken serialised as {"content": ...}
        return token.get("content")
    return token
