"""Parsing of OpenAI chat/completions request bodies into a frozen GenerationRequest.

One pass over the decoded JSON body, before any token: each field the server honours is read by
tensorfold.api.fields into a GenerationRequest and its SamplingParams; each field it cannot
honour is refused with an ApiError (400, `param` naming the field), never silently dropped.
Every top-level field falls in exactly one set:

- parsed: the fields read below (model, messages/prompt, sampling, stream, priority, ...);
- NOT_YET: features later work implements; only their off state is accepted until then;
- NOT_HONOURED: OpenAI, vLLM and llama.cpp knobs this server does not implement; only their
  neutral value is accepted;
- CHAT_ONLY: chat fields refused in a completions body (there is no template to hear them);
- HARMLESS: bookkeeping that changes no token (user, metadata, ...): ignored; the prompt-cache
  hints too (prompt_cache_key, ...): the prefix cache is automatic and shared;
- anything else: ignored and listed in GenerationRequest.ignored_fields, so the server can log
  it as vLLM does (OpenAI itself refuses unknown fields; clients send many vendor extras).
JSON null is the off/default state of every field.

Decisions where spec/http-api.md is silent (vLLM's choice unless said otherwise):
- model: absent, null or "" means the served model; a name outside ServerDefaults.model_names
  (when that is nonempty) is 404 model_not_found with param "model".
- temperature >= 0 with no upper cap; 0 < top_p <= 1; 0 <= min_p <= 1; top_k any integer up to
  2**31-1, <= 0 stored as 0 (off); seed any int64, negatives included.
- Integer fields take integral floats (3.0 -> 3) and refuse 2.5, strings and booleans.
- max_tokens and max_completion_tokens are synonyms, both >= 1 and <= 2**31-1; when both are
  set they must agree (400 on max_completion_tokens), since one of them would be dropped.
  SamplingParams.max_tokens is the explicit limit or None; ServerDefaults.max_tokens is applied
  later, capped to the remaining window (spec: explicit limits are refused, defaults capped).
- stop: a nonempty string or up to MAX_STOP nonempty strings (OpenAI caps at 4, vLLM has no cap).
- priority: "foreground" | "background" | null; vLLM's integer priority is accepted only as its
  default 0 (foreground): its other values have no mapping onto two classes.
- stream_options needs stream: true (OpenAI and vLLM refuse it otherwise).
- A completions body with a nonempty `messages` list is a chat request; a list `prompt` holds
  token ids, or one prompt (string or ids) in a one-element list; batches are refused.
  logprobs in a completions body is refused unless null (even 0 asks for a logprobs object).
"""
import copy
from dataclasses import dataclass
import json
from typing import Any

from tensorfold.api import fields, structured
from tensorfold.api.tools import ToolRequest, parse_tools
from tensorfold.api.errors import ApiError
from tensorfold.api.messages import check_messages
from tensorfold.grammar.spec import GrammarSpec
from tensorfold.sampling.params import SamplingParams

MAX_STOP = 16
MAX_INT32 = 2**31 - 1
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
PRIORITIES = ("foreground", "background")

# ---- Features not implemented yet. field -> the values (besides null) this server honours now,
# i.e. the feature's off state. Later work flips an entry by deleting it and parsing the field.
NOT_YET = {
    "functions": ([],),
    "function_call": ("none", "auto"),
}

# ---- Fields this server does not implement. field -> its neutral values (besides null).
NOT_HONOURED = {
    # OpenAI
    "best_of": (1,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": ({},),
    "top_logprobs": (0,),
    "echo": (False,),
    "suffix": ("",),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "web_search_options": (),
    "verbosity": ("medium",),
    "moderation": (),               # asks for moderation this server does not run
    # vLLM extensions
    "repetition_penalty": (1,),
    "length_penalty": (1,),
    "use_beam_search": (False,),
    "min_tokens": (0,),
    "stop_token_ids": ([],),
    "bad_words": ([],),
    "allowed_token_ids": (),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "prompt_logprobs": (),
    "truncate_prompt_tokens": (),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "chat_template": (),            # a caller-supplied template: we render the checkpoint's
    "documents": (),
    "mm_processor_kwargs": (),
    "cache_salt": (),               # asks for prefix-cache isolation we do not provide
    "logits_processors": (),
    "vllm_xargs": (),
    "return_tokens_as_token_ids": (False,),
    "guided_whitespace_pattern": (),  # JSON grammars allow up to 32 blanks in a row instead
    # llama.cpp extensions
    "n_predict": (),
    "typical_p": (1,),
    "repeat_penalty": (1,),
    "mirostat": (0,),
    "tfs_z": (1,),
    "dry_multiplier": (0,),
    "xtc_probability": (0,),
    "n_probs": (0,),
    "grammar": (),
    "json_schema": (),
}

# Chat fields a completions body may not carry: nothing there would hear them.
CHAT_ONLY = ("chat_template_kwargs", "reasoning_effort", "thinking_budget", "tools", "tool_choice",
             "parallel_tool_calls", "functions", "function_call")

# Fields that change no token and no reply field: ignored without comment.
HARMLESS = frozenset({
    "user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
    "prompt_cache_retention", "prompt_cache_options", "request_id", "cache_prompt",
})

PARSED = frozenset({
    "model", "messages", "prompt", "temperature", "top_p", "top_k", "min_p", "seed",
    "max_tokens", "max_completion_tokens", "stop", "ignore_eos", "draft", "stream",
    "stream_options", "priority", "n", "logprobs", "chat_template_kwargs", "reasoning_effort",
    "parallel_tool_calls", "tools", "tool_choice", "thinking_budget", *structured.FIELDS,
})
KNOWN = PARSED | HARMLESS | NOT_YET.keys() | NOT_HONOURED.keys() | frozenset(CHAT_ONLY)


@dataclass(frozen=True)
class ServerDefaults:
    """Sampling defaults (the checkpoint's generation_config) and server flags a request hears."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int | None = None      # applied later, capped to the remaining window
    model_names: tuple[str, ...] = ()  # served name first, then aliases; () accepts any model
    vision: bool = False

    def __post_init__(self):
        if not (self.temperature >= 0 and 0 < self.top_p <= 1 and 0 <= self.min_p <= 1):
            raise ValueError(f"invalid sampling defaults: {self}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens default must be >= 1, got {self.max_tokens}")


@dataclass(frozen=True)
class GenerationRequest:
    """One validated request, everything the template, engine and reply writer need from it."""
    kind: str                                  # "chat" | "completion"
    model: str                                 # the name the reply reports
    messages: tuple[dict, ...] | None          # chat: validated deep copies of the caller's
    prompt: str | None                         # completion: text ...
    prompt_ids: tuple[int, ...] | None         # ... or token ids (see check_prompt_ids)
    sampling: SamplingParams
    stream: bool
    include_usage: bool                        # stream_options.include_usage; usage is always sent
    chat_template_kwargs: dict | None
    reasoning_effort: str | None               # the top-level field, else chat_template_kwargs'
    priority: str | None                       # "foreground" | "background" | None (unset)
    grammar: GrammarSpec | None = None         # structured output (api/structured.py)
    tools: ToolRequest | None = None           # chat: offered tools and the choice (api/tools.py)
    thinking_budget: int | None = None         # reply tokens of thinking before a forced close; None: server's
    ignored_fields: tuple[str, ...] = ()       # unknown top-level fields, sorted, for a log line
    max_tokens_field: str = "max_tokens"       # the spelling the client used, for error messages


def parse_chat_request(body: Any, defaults: ServerDefaults) -> GenerationRequest:
    body = _object_body(body)
    model = _model(body, defaults)
    if body.get("prompt") is not None:
        raise ApiError("'prompt' is a /v1/completions field; a chat request sends messages",
                       param="prompt")
    messages = check_messages(body.get("messages"), vision=defaults.vision)
    tools = parse_tools(body, messages)
    if fields.boolean(body.get("logprobs"), "logprobs"):
        raise ApiError("logprobs is not supported", param="logprobs")
    chat_template_kwargs, reasoning_effort = _template_inputs(body)
    budget = fields.integer(body.get("thinking_budget"), "thinking_budget", lo=0, hi=MAX_INT32)
    return _request(body, defaults, kind="chat", model=model, messages=messages,
                    chat_template_kwargs=chat_template_kwargs,
                    reasoning_effort=reasoning_effort, tools=tools, thinking_budget=budget or None)


def parse_completion_request(body: Any, defaults: ServerDefaults) -> GenerationRequest:
    """A /v1/completions body; one with a nonempty `messages` list is parsed as chat."""
    body = _object_body(body)
    messages = fields.array(body.get("messages"), "messages")
    if messages:
        return parse_chat_request(body, defaults)
    model = _model(body, defaults)
    for key in CHAT_ONLY:
        if body.get(key) is not None:
            raise ApiError(f"'{key}' applies to /v1/chat/completions only", param=key)
    prompt, prompt_ids = _prompt(body.get("prompt"))
    if body.get("logprobs") is not None:
        raise ApiError("logprobs is not supported", param="logprobs")
    return _request(body, defaults, kind="completion", model=model, prompt=prompt,
                    prompt_ids=prompt_ids)


def check_prompt_ids(ids, vocab_size: int) -> None:
    """Raise a 400 naming the first prompt token id outside [0, vocab_size)."""
    for i, token_id in enumerate(ids):
        if not 0 <= token_id < vocab_size:
            raise ApiError(f"prompt token id {token_id} at index {i} is outside the "
                           f"vocabulary [0, {vocab_size})", param=f"prompt[{i}]")


def _object_body(body: Any) -> dict:
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got {fields.json_type(body)}")
    return body


def _model(body: dict, defaults: ServerDefaults) -> str:
    name = fields.string(body.get("model"), "model")
    if not name:
        return defaults.model_names[0] if defaults.model_names else ""
    if defaults.model_names and name not in defaults.model_names:
        raise ApiError(f"The model `{name}` does not exist; this server serves "
                       f"{', '.join(defaults.model_names)}",
                       status=404, param="model", code="model_not_found")
    return name


def _request(body: dict, defaults: ServerDefaults, *, kind: str, model: str,
             messages=None, prompt=None, prompt_ids=None, chat_template_kwargs=None,
             reasoning_effort=None, tools: ToolRequest | None = None,
             thinking_budget: int | None = None) -> GenerationRequest:
    """The fields both kinds share, then the refusals, then the request."""
    sampling = _sampling(body, defaults)
    stream, include_usage = _stream(body)
    priority = _priority(body.get("priority"))
    grammar = structured.parse_grammar(body)
    if grammar is not None and tools is not None and tools.forced:
        raise ApiError(f"'{grammar.field}' cannot be combined with tool_choice "
                       f"{json.dumps(body.get('tool_choice'))}: a forced tool call has its own grammar",
                       param="tool_choice")
    _refuse_unhonoured(body)
    return GenerationRequest(
        kind=kind, model=model, messages=messages, prompt=prompt, prompt_ids=prompt_ids,
        sampling=sampling, stream=stream, include_usage=include_usage,
        chat_template_kwargs=chat_template_kwargs, reasoning_effort=reasoning_effort,
        priority=priority, grammar=grammar, tools=tools, thinking_budget=thinking_budget, ignored_fields=tuple(sorted(k for k in body if k not in KNOWN)),
        max_tokens_field="max_completion_tokens" if body.get("max_completion_tokens") is not None
        else "max_tokens")


def _prompt(value: Any) -> tuple[str | None, tuple[int, ...] | None]:
    """(text, None) or (None, token ids). A list is token ids, or one prompt in a list."""
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        if len(value) > 1:
            raise ApiError("a batch of prompts is not supported; send one prompt per request",
                           param="prompt")
        return _one_prompt(value[0], "prompt[0]")
    return _one_prompt(value, "prompt")


def _one_prompt(value: Any, at: str) -> tuple[str | None, tuple[int, ...] | None]:
    if isinstance(value, str):
        return fields.string(value, at, nonempty=True), None
    if value is None:
        raise ApiError(f"'{at}' is required", param=at)
    if not isinstance(value, list):
        raise ApiError(f"'{at}' must be a string or an array of token ids, "
                       f"got {fields.json_type(value)}", param=at)
    fields.array(value, at, nonempty=True)
    return None, tuple(fields.integer(t, f"{at}[{i}]", lo=0, required=True)
                       for i, t in enumerate(value))


def _sampling(body: dict, defaults: ServerDefaults) -> SamplingParams:
    temperature = fields.number(body.get("temperature"), "temperature", lo=0)
    top_p = fields.number(body.get("top_p"), "top_p", lo=0, lo_open=True, hi=1)
    top_k = fields.integer(body.get("top_k"), "top_k", hi=MAX_INT32)
    min_p = fields.number(body.get("min_p"), "min_p", lo=0, hi=1)
    seed = fields.integer(body.get("seed"), "seed", lo=-2**63, hi=2**63 - 1)
    return SamplingParams(
        temperature=defaults.temperature if temperature is None else temperature,
        top_p=defaults.top_p if top_p is None else top_p,
        top_k=max(0, defaults.top_k if top_k is None else top_k),
        min_p=defaults.min_p if min_p is None else min_p,
        seed=seed,
        max_tokens=_max_tokens(body),
        stop=_stop(body.get("stop")),
        ignore_eos=bool(fields.boolean(body.get("ignore_eos"), "ignore_eos")),
        draft=fields.boolean(body.get("draft"), "draft") is not False,
    )


def _max_tokens(body: dict) -> int | None:
    max_tokens = fields.integer(body.get("max_tokens"), "max_tokens", lo=1, hi=MAX_INT32)
    max_completion = fields.integer(body.get("max_completion_tokens"), "max_completion_tokens",
                                    lo=1, hi=MAX_INT32)
    if None not in (max_tokens, max_completion) and max_tokens != max_completion:
        raise ApiError(f"max_tokens ({max_tokens}) and max_completion_tokens ({max_completion}) "
                       "disagree; send one of them", param="max_completion_tokens")
    return max_completion if max_completion is not None else max_tokens


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (fields.string(value, "stop", nonempty=True),)
    if not isinstance(value, list):
        raise ApiError(f"'stop' must be a string or an array of strings, "
                       f"got {fields.json_type(value)}", param="stop")
    fields.array(value, "stop", max_len=MAX_STOP)
    return tuple(fields.string(s, f"stop[{i}]", nonempty=True, required=True)
                 for i, s in enumerate(value))


def _stream(body: dict) -> tuple[bool, bool]:
    stream = bool(fields.boolean(body.get("stream"), "stream"))
    options = fields.obj(body.get("stream_options"), "stream_options")
    if options is None:
        return stream, False
    include_usage = fields.boolean(options.get("include_usage"), "stream_options.include_usage")
    fields.boolean(options.get("include_obfuscation"), "stream_options.include_obfuscation")
    if fields.boolean(options.get("continuous_usage_stats"),
                      "stream_options.continuous_usage_stats"):
        raise ApiError("continuous_usage_stats is not supported; the last event carries usage",
                       param="stream_options.continuous_usage_stats")
    if not stream:
        raise ApiError("stream_options is only allowed when stream is true",
                       param="stream_options")
    return stream, bool(include_usage)


def _priority(value: Any) -> str | None:
    if value is None:
        return None  # unset: the server may still treat a session-title request as background
    if fields.same_value(value, 0):
        return "foreground"
    if isinstance(value, int) and not isinstance(value, bool):
        raise ApiError("integer priorities are not supported (only 0); send \"foreground\" or "
                       "\"background\"", param="priority")
    return fields.string(value, "priority", choices=PRIORITIES)


def _template_inputs(body: dict) -> tuple[dict | None, str | None]:
    """chat_template_kwargs, and the reasoning effort: the top-level field wins over the one
    vLLM's clients send inside chat_template_kwargs."""
    kwargs = fields.obj(body.get("chat_template_kwargs"), "chat_template_kwargs")
    effort = fields.string(body.get("reasoning_effort"), "reasoning_effort",
                           choices=REASONING_EFFORTS)
    if kwargs is None:
        return None, effort
    fields.boolean(kwargs.get("enable_thinking"), "chat_template_kwargs.enable_thinking")
    inner = fields.string(kwargs.get("reasoning_effort"), "chat_template_kwargs.reasoning_effort",
                          choices=REASONING_EFFORTS)
    return copy.deepcopy(kwargs), effort if effort is not None else inner


def _refuse_unhonoured(body: dict) -> None:
    n = fields.integer(body.get("n"), "n", lo=1)
    if n is not None and n > 1:
        raise ApiError("n > 1 is not supported", param="n")
    for table, reason in ((NOT_YET, "is not available yet on this server"),
                          (NOT_HONOURED, "is not supported by this server")):
        for key, neutral in table.items():
            value = body.get(key)
            if value is None or any(fields.same_value(value, v) for v in neutral):
                continue
            accepted = " or ".join(json.dumps(v) for v in (None, *neutral))
            raise ApiError(f"'{key}' {reason} (accepted: {accepted})", param=key)
