"""The OpenAI routes on top of the engine: request in, reply (streamed or whole) out.

All of it runs on the server's one thread. A handler validates the body, renders and tokenizes
the prompt, checks it against the window and hands the request to the engine; everything that
can be refused is refused here, before any token and before a stream opens. tick() runs one
engine round and routes each request's new text to its stream or its pending response.
"""
import logging
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from tensorfold.api import replies
from tensorfold.api import anthropic, fields, metrics, responses
from tensorfold.api.errors import ApiError
from tensorfold.api.priority import request_priority
from tensorfold.api.request import (GenerationRequest, ServerDefaults, check_prompt_ids,
                                    parse_chat_request, parse_completion_request)
from tensorfold.chat.cards import ModelCard, select_card
from tensorfold.chat.messages import render_chat
from tensorfold.chat.reply_parser import ReplyParser
from tensorfold.chat.template import ChatTemplate, TemplateError
from tensorfold.engine.engine import Engine, RequestOutput
from tensorfold.engine.request import Request
from tensorfold.grammar.compiler import GrammarCompileError, GrammarCompiler
from tensorfold.grammar.constraint import GrammarConstraint
from tensorfold.grammar.spec import GrammarSpec
from tensorfold.grammar.tool_call import tool_call_spec
from tensorfold.sampling.constraint import combine
from tensorfold.sampling.thinking_budget import ThinkingBudget
from tensorfold.http.messages import DeferredResponse, EventStream, HttpRequest, HttpResponse
from tensorfold.sampling.params import SamplingParams

log = logging.getLogger("tensorfold.api")

QUICK_COMPILE_S = 0.02  # a grammar compiled within this is started at once; a slower one waits off-thread


@dataclass
class Prepared:
    """A validated request, rendered: what starting it needs."""
    greq: GenerationRequest
    fmt: replies.ReplyFormat
    prompt_ids: list[int]
    params: SamplingParams
    parser: ReplyParser
    thinking: bool = False     # the prompt opened a think block


@dataclass
class Reply:
    """One live request: where its text goes, and how its text is split."""
    fmt: replies.ReplyFormat
    sink: EventStream | DeferredResponse
    parser: ReplyParser


@dataclass
class PendingGrammar:
    """A request waiting for its grammar to compile on the worker thread; its sink is a held
    stream or a deferred response, so a compile error can still be a 400."""
    prepared: Prepared
    spec: GrammarSpec
    future: Future
    sink: EventStream | DeferredResponse


@dataclass
class Counters:
    requests_total: int = 0
    prompt_tokens_total: int = 0
    completion_tokens_total: int = 0   # finished replies; running ones are added on read
    cached_tokens_total: int = 0
    prefill_seconds_total: float = 0.0
    decode_seconds_total: float = 0.0
    rounds_total: int = 0
    drafted_total: int = 0
    accepted_total: int = 0

    def add_finished(self, req: Request) -> None:
        s = req.stats
        self.prompt_tokens_total += req.num_prompt_tokens
        self.completion_tokens_total += len(req.output_ids)
        self.cached_tokens_total += s.cached_tokens
        self.prefill_seconds_total += s.prefill_s
        self.decode_seconds_total += s.decode_s
        self.drafted_total += s.drafted
        self.accepted_total += s.accepted


class Service:
    def __init__(self, engine: Engine, model_names: tuple[str, ...], *, default_max_tokens: int | None = None,
                 model_card: str | None = None, reasoning_effort: str | None = None, thinking_budget: int = 0,
                 response_store: str | None = None):
        self.engine = engine
        self.model_names = model_names
        ckpt = engine.checkpoint
        self.card: ModelCard | None = select_card(ckpt.architecture, ckpt.chat_template, model_card)
        source = self.card.template if self.card is not None and self.card.template else ckpt.chat_template
        self.template = ChatTemplate(source, bos_token=ckpt.tokenizer_config.get("bos_token") or "",
                                     eos_token=ckpt.tokenizer_config.get("eos_token") or "") if source else None
        self.reasoning_effort = reasoning_effort or (self.card.default_effort if self.card else None)
        self.thinking_budget = thinking_budget  # requests without one: 0 is none
        log.info("model card: %s", self.card.name if self.card else "none (no think markers, no tools)")
        gen = ckpt.generation_config
        self.defaults = ServerDefaults(
            temperature=float(gen.get("temperature", 1.0)) if gen.get("do_sample", True) else 0.0,
            top_p=float(gen.get("top_p", 1.0)), top_k=int(gen.get("top_k", 0) or 0),
            min_p=float(gen.get("min_p", 0.0) or 0.0),
            max_tokens=default_max_tokens, model_names=model_names)
        self.replies: dict[str, Reply] = {}
        self.counters = Counters()
        self.latencies = metrics.Latencies()
        self.response_store = responses.ResponseStore(path=response_store)
        self.started = time.time()
        tok = engine.tokenizer
        self.grammars = GrammarCompiler(tok, engine.model.args.vocab_size)
        self.pending: list[PendingGrammar] = []
        self.wake = lambda: None  # set by the server: makes its poll return (any thread)
        think = self.card.think if self.card is not None else None
        ids = (tok.token_to_id(think.open), tok.token_to_id(think.close)) if think else (None, None)
        self.think_ids = ids if None not in ids else None  # the markers as single tokens, if they are
        # what a thinking budget writes at its cut: a newline, the close marker, a blank line
        self.think_close_sequence = tok.encode("\n" + think.close + "\n\n", add_special_tokens=False) \
            if self.think_ids else None

    # -- routes -----------------------------------------------------------------------------

    def chat_completions(self, http: HttpRequest):
        return self._generate(parse_chat_request(http.json(), self.defaults))

    def completions(self, http: HttpRequest):
        body = http.json()
        return self._generate(parse_completion_request(body, self.defaults))

    def models(self, http: HttpRequest) -> HttpResponse:
        data = [{"id": name, "object": "model", "created": int(self.started), "owned_by": "tensorfold",
                 "max_model_len": self.engine.context_length} for name in self.model_names]
        return HttpResponse.json_response({"object": "list", "data": data})

    def health(self, http: HttpRequest) -> HttpResponse:
        c = self.counters
        load = self.engine.load()
        body = {
            "status": "ok",
            "exact": self.engine.exact,
            "backend": self.engine.config.backend,
            "ops": self.engine.model.ops.NAME,
            "weights": self.engine.model.weight_formats(),
            "kv_dtype": str(self.engine.cache.dtype).removeprefix("torch."),
            "model_card": self.card.name if self.card else None,
            "busy": self.engine.has_work(),
            "requests_running": len(self.replies),
            "requests_total": c.requests_total,
            "completion_tokens_total": c.completion_tokens_total + load.running_reply_tokens,
            "prompt_tokens_total": c.prompt_tokens_total,
            "cached_tokens_total": c.cached_tokens_total,
            "prefill_seconds_total": round(c.prefill_seconds_total, 6),
            "decode_seconds_total": round(c.decode_seconds_total, 6),
            "rounds_total": c.rounds_total,
            "drafted_total": c.drafted_total,
            "accepted_total": c.accepted_total,
            "context_length": self.engine.context_length,
            "streams": {"decoding": load.decoding, "prefilling": load.prefilling, "maximum": load.max_running},
        }
        return HttpResponse.json_response(body)

    def create_response(self, http: HttpRequest):
        """POST /v1/responses: the Responses API through the chat path (api/responses.py)."""
        rreq = responses.to_chat_body(http.json(), self.response_store)

        def stored(response: dict) -> None:  # before the last event or the body goes out
            if rreq.echo["store"]:
                items = [{"id": f"item_{response['id'][5:]}_{i}", **item} for i, item in enumerate(rreq.input_items)]
                self.response_store.put(responses.StoredResponse(
                    response, items, rreq.conversation + [responses.assistant_message(response)]))

        try:
            greq = parse_chat_request(rreq.chat, self.defaults)
            return self._generate(greq, lambda model: responses.ResponsesFormat(model, rreq.echo, stored))
        except ApiError as e:
            raise responses.responses_error(e) from None

    def get_response(self, http: HttpRequest) -> HttpResponse:
        return HttpResponse.json_response(self._stored(http).response)

    def delete_response(self, http: HttpRequest) -> HttpResponse:
        entry = self._stored(http)
        self.response_store.delete(entry.response["id"])
        return HttpResponse.json_response({"id": entry.response["id"], "object": "response", "deleted": True})

    def response_input_items(self, http: HttpRequest) -> HttpResponse:
        items = self._stored(http).input_items
        return HttpResponse.json_response({"object": "list", "data": items, "has_more": False,
                                           "first_id": items[0]["id"] if items else None,
                                           "last_id": items[-1]["id"] if items else None})

    def _stored(self, http: HttpRequest) -> responses.StoredResponse:
        response_id = http.path_params["id"]
        entry = self.response_store.get(response_id)
        if entry is None:
            raise ApiError(f"No response found with id '{response_id}'", status=404, param="response_id",
                           code="not_found")
        return entry

    def messages(self, http: HttpRequest):
        """POST /v1/messages: Anthropic's Messages API through the chat path (api/anthropic.py)."""
        try:
            greq = parse_chat_request(anthropic.to_chat_body(http.json()), self.defaults)
            return self._generate(greq, anthropic.MessagesFormat)
        except ApiError as e:
            return anthropic.api_error(e)

    def count_tokens(self, http: HttpRequest) -> HttpResponse:
        """POST /v1/messages/count_tokens: the prompt tokens the same Messages body would have."""
        try:
            greq = parse_chat_request(anthropic.to_chat_body(http.json(), count_only=True), self.defaults)
            ids, _ = self._prompt_ids(greq, greq.tools.shown() if greq.tools else None)
        except ApiError as e:
            return anthropic.api_error(e)
        return HttpResponse.json_response({"input_tokens": len(ids)})

    def metrics(self, http: HttpRequest) -> HttpResponse:
        c = self.counters
        load = self.engine.load()
        counters = [
            ("tensorfold_requests_total", "Generation requests accepted.", c.requests_total),
            ("tensorfold_prompt_tokens_total", "Prompt tokens of finished requests.", c.prompt_tokens_total),
            ("tensorfold_generation_tokens_total", "Reply tokens, running requests' included.",
             c.completion_tokens_total + load.running_reply_tokens),
            ("tensorfold_prefix_cache_hit_tokens_total", "Prompt tokens found in the prefix cache.",
             c.cached_tokens_total),
            ("tensorfold_prefill_seconds_total", "Engine time spent in prefill rounds.", c.prefill_seconds_total),
            ("tensorfold_decode_seconds_total", "Engine time spent in decode rounds.", c.decode_seconds_total),
            ("tensorfold_rounds_total", "Engine rounds run.", c.rounds_total),
            ("tensorfold_draft_tokens_total", "Drafted tokens verified.", c.drafted_total),
            ("tensorfold_draft_accepted_tokens_total", "Drafted tokens accepted.", c.accepted_total),
        ]
        gauges = [
            ("tensorfold_requests_running", "Requests in the engine's running set.", load.decoding + load.prefilling),
            ("tensorfold_requests_waiting", "Requests waiting for a lane or memory.", load.waiting),
            ("tensorfold_kv_cache_usage_ratio", "Share of the KV cache's blocks held by requests.", load.kv_used_ratio),
            ("tensorfold_draft_acceptance_ratio", "Accepted over drafted tokens so far.",
             c.accepted_total / c.drafted_total if c.drafted_total else 0.0),
        ]
        text = metrics.exposition(counters, gauges, self.latencies.histograms())
        return HttpResponse(200, text.encode(), content_type="text/plain; version=0.0.4; charset=utf-8")

    def tokenize(self, http: HttpRequest) -> HttpResponse:
        """{"prompt" | "content": text} or {"messages": [...]} (through the chat template, with
        add_generation_prompt, default true) -> {"tokens", "count", "max_model_len"}."""
        body = http.json()
        if not isinstance(body, dict):
            raise ApiError("the request body must be a JSON object")
        tok = self.engine.tokenizer
        if body.get("messages") is not None:
            greq = parse_chat_request({"messages": body["messages"], "tools": body.get("tools"),
                                       "chat_template_kwargs": body.get("chat_template_kwargs")}, self.defaults)
            if self.template is None:
                raise ApiError("this model has no chat template", param="messages")
            shown = greq.tools.shown() if greq.tools else None
            generation = fields.boolean(body.get("add_generation_prompt"), "add_generation_prompt")
            try:
                text = render_chat(self.template, list(greq.messages), tools=shown,
                                   template_kwargs=self._template_kwargs(greq),
                                   add_generation_prompt=generation is not False)
            except TemplateError as e:
                raise ApiError(f"the chat template rejected the request: {e.message}", param="messages") from None
            ids = tok.encode(text, add_special_tokens=False)
        else:
            key = "prompt" if "prompt" in body else "content"
            text = fields.string(body.get(key), key, required=True)
            special = fields.boolean(body.get("add_special_tokens"), "add_special_tokens")
            ids = tok.encode(text, add_special_tokens=special is not False)
        return HttpResponse.json_response({"tokens": ids, "count": len(ids),
                                           "max_model_len": self.engine.context_length})

    def detokenize(self, http: HttpRequest) -> HttpResponse:
        """{"tokens": [ids]} -> {"prompt": text, "content": text} (vLLM's and llama-server's names)."""
        body = http.json()
        if not isinstance(body, dict):
            raise ApiError("the request body must be a JSON object")
        ids = fields.array(body.get("tokens"), "tokens", required=True)
        ids = tuple(fields.integer(t, f"tokens[{i}]", lo=0, required=True) for i, t in enumerate(ids))
        check_prompt_ids(ids, self.engine.tokenizer.vocab_size)
        text = self.engine.tokenizer.decode(ids)
        return HttpResponse.json_response({"prompt": text, "content": text})

    # -- one request ------------------------------------------------------------------------

    def _generate(self, greq: GenerationRequest, fmt_class=None):
        if greq.ignored_fields:
            log.info("ignoring unknown request fields: %s", ", ".join(greq.ignored_fields))
        prepared = self._prepare(greq, fmt_class)
        spec = greq.grammar
        if greq.tools is not None and greq.tools.forced:
            spec = tool_call_spec(self.card, greq.tools.shown())
        if spec is None:
            return self._start(prepared, self._budget(prepared))
        if not GrammarCompiler.available():
            raise ApiError("structured output needs xgrammar on the server: pip install xgrammar", param=spec.field)
        compiled = self.grammars.cached(spec)
        if compiled is not None:  # no hop to the worker thread for a grammar already compiled
            return self._start(prepared, self._constraint(prepared, compiled), 0.0)
        future = self.grammars.compile_async(spec)
        try:
            compiled, seconds = future.result(timeout=QUICK_COMPILE_S)
        except FutureTimeout:
            sink = EventStream(held=True) if greq.stream else DeferredResponse()
            self.pending.append(PendingGrammar(prepared, spec, future, sink))
            future.add_done_callback(lambda _: self.wake())
            return sink
        except GrammarCompileError as e:
            raise _compile_error(spec, e) from None
        return self._start(prepared, self._constraint(prepared, compiled), seconds)

    def _prepare(self, greq: GenerationRequest, fmt_class=None) -> Prepared:
        """Render and tokenize, check the window, make the reply's format and parser."""
        shown = greq.tools.shown() if greq.tools is not None else None
        if shown and (self.card is None or self.card.tool_format is None):
            raise ApiError(f"this model's card ({self.card.name if self.card else 'none'}) declares no tool-call "
                           "format, so it cannot be offered tools; start the server with --model-card NAME for "
                           "a card that does", param="tools")
        prompt_ids, thinking = self._prompt_ids(greq, shown)
        params = self._fit_window(greq, len(prompt_ids))
        fmt = (fmt_class or replies.FORMATS[greq.kind])(greq.model or self.model_names[0])
        card = self.card if greq.kind == "chat" else None
        parser = ReplyParser(card, shown, parallel_tool_calls=greq.tools.parallel if greq.tools else True,
                             thinking=thinking, call_id_prefix=f"call_{fmt.id[-12:]}")
        return Prepared(greq, fmt, prompt_ids, params, parser, thinking)

    def _start(self, p: Prepared, constraint=None, compile_s: float | None = None, sink=None):
        """Hand the request to the engine; returns its sink (new, or the held one to open)."""
        greq, fmt = p.greq, p.fmt
        try:
            req_id = self.engine.add_request(p.prompt_ids, p.params, req_id=fmt.id,
                                             priority=request_priority(greq.priority, greq.messages),
                                             constraint=constraint)
        except MemoryError as e:  # can never fit the KV pool, whatever else finishes
            raise ApiError(str(e), param="max_tokens", code="context_length_exceeded") from None
        self.engine.requests[req_id].stats.grammar_compile_s = compile_s
        self.counters.requests_total += 1
        if greq.stream:
            sink = sink or EventStream()
            for event, data in fmt.opening(self.engine.requests[req_id]):
                sink.send(data, event=event)
            sink.open()
        else:
            sink = sink or DeferredResponse()
        sink.on_disconnect = lambda: self._cancel(req_id)
        self.replies[req_id] = Reply(fmt, sink, p.parser)
        return sink

    def _constraint(self, p: Prepared, compiled):
        """The request's grammar (with the card's think markers, from after a think block), and
        its thinking budget."""
        think = self.think_ids if p.greq.kind == "chat" else None
        budget = self._budget(p)
        skip = tuple(budget.sequence[budget.sequence.index(budget.close_id) + 1:]) if budget else ()
        grammar = GrammarConstraint(compiled, self.engine.tokenizer.eos_token_ids, think, p.thinking, skip)
        return combine([budget, grammar])

    def _budget(self, p: Prepared) -> ThinkingBudget | None:
        """The thinking budget (the request's, else --thinking-budget), for a card with think
        markers that are single tokens: the budget-th reply token while thinking becomes
        "\n" + close marker + "\n\n"."""
        budget = p.greq.thinking_budget or self.thinking_budget
        if not budget or self.think_ids is None or p.greq.kind != "chat":
            return None
        return ThinkingBudget(budget, *self.think_ids, self.think_close_sequence, p.thinking)

    def _start_compiled(self) -> None:
        """Start the requests whose grammar finished compiling (or answer them with a 400)."""
        done = [p for p in self.pending if p.future.done()]
        self.pending = [p for p in self.pending if not p.future.done()]
        for p in done:
            if p.sink.disconnected:
                continue
            try:
                compiled, seconds = p.future.result()
                self._start(p.prepared, self._constraint(p.prepared, compiled), seconds, p.sink)
                continue
            except GrammarCompileError as e:
                response = p.prepared.fmt.api_error(_compile_error(p.spec, e))
            except ApiError as e:
                response = p.prepared.fmt.api_error(e)
            except Exception as e:  # a fault of the compiler itself: this request only
                log.exception("grammar compile failed")
                response = p.prepared.fmt.error_response(500, f"grammar compile failed: {type(e).__name__}: {e}")
            if isinstance(p.sink, EventStream):
                p.sink.refuse(response)
            else:
                p.sink.resolve(response)

    def _prompt_ids(self, greq: GenerationRequest, tools: list[dict] | None) -> tuple[list[int], bool]:
        """The prompt's token ids, and whether it opened a think block the reply starts inside."""
        tok = self.engine.tokenizer
        if greq.kind == "chat":
            if self.template is None:
                raise ApiError("this model has no chat template; use /v1/completions", param="messages")
            try:
                text = render_chat(self.template, list(greq.messages), tools=tools,
                                   template_kwargs=self._template_kwargs(greq))
            except TemplateError as e:
                raise ApiError(f"the chat template rejected the request: {e.message}", param="messages") from None
            # The template writes its own special tokens (bos included), as transformers does.
            return tok.encode(text, add_special_tokens=False), self._opens_think(text)
        if greq.prompt_ids is not None:
            check_prompt_ids(greq.prompt_ids, tok.vocab_size)
            return list(greq.prompt_ids), False
        return tok.encode(greq.prompt, add_special_tokens=True), False

    def _opens_think(self, prompt: str) -> bool:
        think = self.card.think if self.card is not None else None
        if think is None:
            return False
        at = prompt.rfind(think.open)
        return at >= 0 and not prompt[at + len(think.open):].strip()

    def _template_kwargs(self, greq: GenerationRequest) -> dict | None:
        """chat_template_kwargs, with the effort: the request's (else --reasoning-effort). "none"
        turns thinking off; another effort turns it on and reaches the template under the card's
        name for it; an explicit enable_thinking wins."""
        kwargs = dict(greq.chat_template_kwargs or {})
        effort = greq.reasoning_effort or self.reasoning_effort
        if effort is not None:
            kwargs.setdefault("enable_thinking", effort != "none")
            if effort != "none":
                kwargs["reasoning_effort"] = self.card.effort_name(effort) if self.card else effort
        return kwargs or None

    def _fit_window(self, greq: GenerationRequest, num_prompt: int) -> SamplingParams:
        window = self.engine.context_length
        room = window - num_prompt
        prompt_param = "messages" if greq.kind == "chat" else "prompt"
        if room < 1:
            raise ApiError(f"the prompt is {num_prompt} tokens, which leaves no room for a reply in "
                           f"this model's {window}-token context window; shorten the prompt",
                           param=prompt_param, code="context_length_exceeded")
        params = greq.sampling
        if params.max_tokens is not None:
            if num_prompt + params.max_tokens > window:
                raise ApiError(
                    f"this model's context window is {window} tokens, but the request asks for "
                    f"{num_prompt + params.max_tokens} ({num_prompt} in the prompt + {params.max_tokens} "
                    f"for the reply); lower {greq.max_tokens_field} to at most {room} or shorten the prompt",
                    param=greq.max_tokens_field, code="context_length_exceeded")
            return params
        default = self.defaults.max_tokens or self.engine.config.default_max_tokens
        return SamplingParams(**{**params.__dict__, "max_tokens": min(default, room)})

    def _cancel(self, req_id: str) -> None:
        self.latencies.forget(req_id)
        reply = self.replies.pop(req_id, None)
        req = self.engine.requests.get(req_id)
        if req is not None:
            self.counters.add_finished(req)
        self.engine.abort(req_id)
        if reply is not None:
            log.info("%s: client went away; request cancelled", req_id)

    # -- engine rounds ----------------------------------------------------------------------

    def tick(self) -> bool:
        """One engine round; True while work remains."""
        if self.pending:
            self._start_compiled()
        if not self.engine.has_work():
            return False
        try:
            outputs = self.engine.step()
        except Exception as e:  # a generation error: fail the running requests, keep serving
            log.exception("engine round failed")
            self._fail_running(e)
            return self.engine.has_work()
        self.counters.rounds_total += 1
        for out in outputs:
            self._deliver(out)
        return self.engine.has_work()

    def _deliver(self, out: RequestOutput) -> None:
        reply = self.replies.get(out.req_id)
        if reply is None:
            return
        if out.finish_reason == "error":  # this request only: its grammar or a replay failed
            self.latencies.forget(out.req_id)
            self.replies.pop(out.req_id, None)
            self.counters.add_finished(out.request)
            _send_error(reply, f"generation failed: {out.request.error or 'a replayed token differed'}")
            return
        delta = reply.parser.push(out.new_text)
        self.latencies.delivered(out.req_id, len(out.new_token_ids), out.request.stats.first_token_s)
        if out.finished:
            delta.add(reply.parser.finish())
            out.request.stats.reasoning_tokens = self._reasoning_tokens(reply, out.request)
            self.latencies.finished(out.request)
            reply.sink.access_note = _access_note(out.request)
        finish = out.finish_reason
        if out.finished and reply.parser.has_calls:
            finish = "tool_calls"
        if isinstance(reply.sink, EventStream):
            events = reply.fmt.deltas(delta) + (reply.fmt.closing(finish, out.request) if out.finished else [])
            for event, data in events:
                reply.sink.send(data, event=event)
            if out.finished:
                reply.sink.close()
        elif out.finished:
            body = reply.fmt.final(reply.parser.whole, finish, out.request)
            reply.sink.resolve(HttpResponse.json_response(body))
        if out.finished:
            self.replies.pop(out.req_id, None)
            self.counters.add_finished(out.request)

    def _reasoning_tokens(self, reply: Reply, req: Request) -> int:
        """The reply tokens through the think block's close (all of them if it never closed);
        0 for a reply without a think block."""
        if not reply.parser.after_think:
            return 0
        close = self.card.think.close
        if self.think_ids is not None:
            ids = req.output_ids
            return ids.index(self.think_ids[1]) + 1 if self.think_ids[1] in ids else len(ids)
        decode = self.engine.tokenizer.decode
        lo, hi = 1, len(req.output_ids)
        if close not in decode(req.output_ids):
            return hi
        while lo < hi:  # the shortest prefix whose text holds the close marker
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if close in decode(req.output_ids[:mid]) else (mid + 1, hi)
        return lo

    def _fail_running(self, error: Exception) -> None:
        message = f"generation failed: {type(error).__name__}: {error}"
        for req_id in self.engine.running_ids():
            self.latencies.forget(req_id)
            reply = self.replies.pop(req_id, None)
            self.counters.add_finished(self.engine.requests[req_id])  # keeps completion_tokens_total from going back
            self.engine.abort(req_id)
            if reply is not None:
                _send_error(reply, message)


def _send_error(reply: Reply, message: str) -> None:
    """A failed generation: an error event that ends the stream, or HTTP 500."""
    if isinstance(reply.sink, EventStream):
        for event, data in reply.fmt.error_events(message):
            reply.sink.send(data, event=event)
        reply.sink.close()
    else:
        reply.sink.resolve(reply.fmt.error_response(500, message))


def _access_note(req: Request) -> str:
    return f"{req.num_prompt_tokens}+{len(req.output_ids)} tokens {req.finish_reason or ''}".rstrip()


def _compile_error(spec: GrammarSpec, e: GrammarCompileError) -> ApiError:
    return ApiError(f"'{spec.field}' could not be compiled into a grammar: {e}", param=spec.field)
