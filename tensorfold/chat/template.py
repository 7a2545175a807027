"""Chat templates: render a checkpoint's Hugging Face jinja template into a prompt string.

A ChatTemplate compiles its source once and renders it the way transformers'
`apply_chat_template(..., tokenize=False)` does, so a prompt here equals the prompt the model was
trained and evaluated with:

- jinja2's ImmutableSandboxedEnvironment (templates are untrusted code from the Hub) with
  trim_blocks, lstrip_blocks, the loopcontrols extension and jinja's lenient Undefined;
- the globals `raise_exception(msg)`, `strftime_now(fmt)`, a `dict` that cannot be inspected and a
  `namespace` that refuses underscore names; the `tojson` filter with json.dumps semantics
  (ensure_ascii=False; indent, separators and sort_keys arguments), not jinja's HTML-escaping one;
- the `{% generation %}...{% endgeneration %}` block (training-mask marker) renders its body;
- messages are copied before rendering; keys whose value is None are dropped (templates test
  `is defined`, and `content: None` would otherwise print "None"); a message's reasoning is
  visible as `reasoning_content` whichever of reasoning_content, thinking or reasoning carried it,
  and as `thinking` too (gpt-oss templates read that name).

Invariants: every failure, at compile or render time, is a TemplateError whose message is safe to
show to a client. A `raise_exception(msg)` from the template is a TemplateError whose message is
exactly `msg`. The caller's messages, tools and kwargs are never mutated. Rendering reads the
clock only through `strftime_now`, and the clock is an argument.
"""
import datetime
import json
from typing import Any, Callable

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Variables the server sets on every render; chat_template_kwargs may not replace them (nor the
# environment's globals, such as raise_exception or range).
RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})

# Names a message's reasoning may arrive under; the first is the one templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TemplateError(Exception):
    """The template cannot render this request (or cannot be compiled); the message is for the client."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def _raise_exception(message: Any):
    raise TemplateError(str(message))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _SafeDict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without handing them the dict type."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _SafeNamespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing underscore-prefixed names (a road to CPython internals)."""

    def __init__(*args, **kwargs):  # same signature trick as jinja's, so namespace(self=1) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _SafeNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _SafeNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise TemplateError(f"chat template error: namespace attribute {name!r} starts with an underscore")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}body{% endgeneration %}` renders body; we never need the assistant mask."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


def _plain(value):
    # A fresh copy of JSON-like data, so nothing the template touches belongs to the caller.
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    return value


def _template_message(message: dict) -> dict:
    message = {key: _plain(value) for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


class ChatTemplate:
    """One compiled chat template with its special tokens.

    source: the jinja text (tokenizer_config.json's chat_template, or a GGUF's
    tokenizer.chat_template). clock: what `strftime_now` reads (pin it for reproducible prompts).
    """

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "",
                 clock: Callable[[], datetime.datetime] = datetime.datetime.now):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                           extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: clock().strftime(fmt)
        env.globals["dict"] = _SafeDict()
        env.globals["namespace"] = _SafeNamespace
        self._reserved = RESERVED_VARIABLES | frozenset(env.globals)
        try:
            ast = env.parse(source)
            self._template = env.from_string(ast)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"chat template syntax error at line {exc.lineno}: {exc.message}") from None
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template cannot be compiled: {exc}") from None
        # What the template reads and names: lets callers ask whether it knows enable_thinking or
        # reasoning_effort, and whether it names an effort such as "high" itself.
        self.variables = frozenset(jinja2.meta.find_undeclared_variables(ast))
        self.string_constants = frozenset(
            node.value for node in ast.find_all(jinja2.nodes.Const) if isinstance(node.value, str))

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True, tools: list | None = None,
               template_kwargs: dict | None = None) -> str:
        """The prompt text for `messages`.

        template_kwargs become extra template variables (enable_thinking, reasoning_effort, ...).
        A key naming a variable the server sets (RESERVED_VARIABLES, or a global such as
        raise_exception) is refused with a TemplateError naming it, rather than silently winning
        or silently losing.
        """
        kwargs = dict(template_kwargs or {})
        for key in kwargs:
            if key in self._reserved:
                raise TemplateError(f"chat_template_kwargs cannot set {key!r}: the server sets it")
        context = {"documents": None, **_plain(kwargs)}
        context.update(messages=[_template_message(m) for m in messages], tools=_plain(tools),
                       add_generation_prompt=add_generation_prompt, bos_token=self.bos_token,
                       eos_token=self.eos_token)
        try:
            return self._template.render(context)
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template error: {exc.message or type(exc).__name__}") from None
        except Exception as exc:  # a template is a program: TypeError, ZeroDivisionError, RecursionError...
            raise TemplateError(f"chat template error: {type(exc).__name__}: {exc}") from None
