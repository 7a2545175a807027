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
from tensorfold.api.errors import ApiError
from tensorfold.api.priority import request_priority
from tensorfold.api.request import (GenerationRequest, ServerDefaults, check_prompt_ids,
                                    parse_chat_request, parse_completion_request)
from tensorfold.chat.messages import render_chat
from tensorfold.chat.template import ChatTemplate, TemplateError
from tensorfold.engine.engine import Engine, RequestOutput
from tensorfold.engine.request import Request
from tensorfold.grammar.compiler import GrammarCompileError, GrammarCompiler
from tensorfold.grammar.constraint import GrammarConstraint
from tensorfold.http.messages import DeferredResponse, EventStream, HttpRequest, HttpResponse
from tensorfold.sampling.params import SamplingParams

log = logging.getLogger("tensorfold.api")

QUICK_COMPILE_S = 0.02  # a grammar compiled within this is started at once; a slower one waits off-thread


@dataclass
class Reply:
    """One live request: where its text goes, and what has gone."""
    fmt: replies.ReplyFormat
    sink: EventStream | DeferredResponse
    pieces: list[str] = field(default_factory=list)


@dataclass
class PendingGrammar:
    """A request waiting for its grammar to compile on the worker thread; its sink is a held
    stream or a deferred response, so a compile error can still be a 400."""
    greq: GenerationRequest
    fmt: replies.ReplyFormat
    prompt_ids: list[int]
    params: SamplingParams
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
    def __init__(self, engine: Engine, model_names: tuple[str, ...], *, default_max_tokens: int | None = None):
        self.engine = engine
        self.model_names = model_names
        ckpt = engine.checkpoint
        self.template = ChatTemplate(ckpt.chat_template, bos_token=ckpt.tokenizer_config.get("bos_token") or "",
                                     eos_token=ckpt.tokenizer_config.get("eos_token") or "") \
            if ckpt.chat_template else None
        gen = ckpt.generation_config
        self.defaults = ServerDefaults(
            temperature=float(gen.get("temperature", 1.0)) if gen.get("do_sample", True) else 0.0,
            top_p=float(gen.get("top_p", 1.0)), top_k=int(gen.get("top_k", 0) or 0),
            min_p=float(gen.get("min_p", 0.0) or 0.0),
            max_tokens=default_max_tokens, model_names=model_names)
        self.replies: dict[str, Reply] = {}
        self.counters = Counters()
        self.started = time.time()
        tok = engine.tokenizer
        self.grammars = GrammarCompiler(tok, engine.model.args.vocab_size)
        self.pending: list[PendingGrammar] = []
        self.wake = lambda: None  # set by the server: makes its poll return (any thread)
        think_end = tok.token_to_id("</think>")
        self.think_end = think_end if think_end is not None and tok.token_to_id("<think>") is not None else None
        if GrammarCompiler.available():
            self.grammars.warm()  # xgrammar and the tokenizer table, loaded off the serving thread

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
        running = [r for r in self.engine.scheduler.running]
        decoding = sum(1 for r in running if r.output_ids)
        body = {
            "status": "ok",
            "exact": self.engine.exact,
            "backend": self.engine.config.backend,
            "ops": self.engine.model.ops.NAME,
            "busy": self.engine.has_work(),
            "requests_running": len(self.replies),
            "requests_total": c.requests_total,
            "completion_tokens_total": c.completion_tokens_total + sum(len(r.output_ids) for r in running),
            "prompt_tokens_total": c.prompt_tokens_total,
            "cached_tokens_total": c.cached_tokens_total,
            "prefill_seconds_total": round(c.prefill_seconds_total, 6),
            "decode_seconds_total": round(c.decode_seconds_total, 6),
            "rounds_total": c.rounds_total,
            "drafted_total": c.drafted_total,
            "accepted_total": c.accepted_total,
            "context_length": self.engine.context_length,
            "streams": {"decoding": decoding, "prefilling": len(running) - decoding,
                        "maximum": self.engine.config.max_num_seqs},
        }
        return HttpResponse.json_response(body)

    # -- one request ------------------------------------------------------------------------

    def _generate(self, greq: GenerationRequest):
        if greq.ignored_fields:
            log.info("ignoring unknown request fields: %s", ", ".join(greq.ignored_fields))
        prompt_ids = self._prompt_ids(greq)
        params = self._fit_window(greq, len(prompt_ids))
        fmt = replies.ReplyFormat(greq.kind, greq.model or self.model_names[0])
        if greq.grammar is None:
            return self._start(greq, fmt, prompt_ids, params)
        if not GrammarCompiler.available():
            raise ApiError("structured output needs xgrammar on the server: pip install xgrammar",
                           param=greq.grammar.field)
        future = self.grammars.compile_async(greq.grammar)
        try:
            compiled, seconds = future.result(timeout=QUICK_COMPILE_S)
        except FutureTimeout:
            sink = EventStream(held=True) if greq.stream else DeferredResponse()
            pending = PendingGrammar(greq, fmt, prompt_ids, params, future, sink)
            self.pending.append(pending)
            future.add_done_callback(lambda _: self.wake())
            return sink
        except GrammarCompileError as e:
            raise _compile_error(greq, e) from None
        return self._start(greq, fmt, prompt_ids, params, self._constraint(greq, compiled, prompt_ids), seconds)

    def _start(self, greq: GenerationRequest, fmt: replies.ReplyFormat, prompt_ids: list[int],
               params: SamplingParams, constraint=None, compile_s: float | None = None, sink=None):
        """Hand the request to the engine; returns its sink (new, or the held one to open)."""
        try:
            req_id = self.engine.add_request(prompt_ids, params, req_id=fmt.id,
                                             priority=request_priority(greq.priority, greq.messages),
                                             constraint=constraint)
        except MemoryError as e:  # can never fit the KV pool, whatever else finishes
            raise ApiError(str(e), param="max_tokens", code="context_length_exceeded") from None
        self.engine.requests[req_id].stats.grammar_compile_s = compile_s
        self.counters.requests_total += 1
        if greq.stream:
            sink = sink or EventStream()
            first = fmt.first_chunk()
            if first is not None:
                sink.send(first)
            sink.open()
        else:
            sink = sink or DeferredResponse()
        sink.on_disconnect = lambda: self._cancel(req_id)
        self.replies[req_id] = Reply(fmt, sink)
        return sink

    def _constraint(self, greq: GenerationRequest, compiled, prompt_ids: list[int]) -> GrammarConstraint:
        """The request's grammar; with thinking on (a chat reply that opens with a think block:
        the vocabulary has the markers and the prompt did not close one), from after </think>."""
        start_after = None
        if self.think_end is not None and greq.kind == "chat" and self.think_end not in prompt_ids[-8:]:
            start_after = self.think_end
        return GrammarConstraint(compiled, self.engine.tokenizer.eos_token_ids, start_after)

    def _start_compiled(self) -> None:
        """Start the requests whose grammar finished compiling (or answer them with a 400)."""
        done = [p for p in self.pending if p.future.done()]
        self.pending = [p for p in self.pending if not p.future.done()]
        for p in done:
            if p.sink.disconnected:
                continue
            try:
                compiled, seconds = p.future.result()
                self._start(p.greq, p.fmt, p.prompt_ids, p.params,
                            self._constraint(p.greq, compiled, p.prompt_ids), seconds, p.sink)
                continue
            except GrammarCompileError as e:
                response = HttpResponse.from_api_error(_compile_error(p.greq, e))
            except ApiError as e:
                response = HttpResponse.from_api_error(e)
            except Exception as e:  # a fault of the compiler itself: this request only
                log.exception("grammar compile failed")
                response = HttpResponse.error(500, f"grammar compile failed: {type(e).__name__}: {e}",
                                              type="server_error")
            if isinstance(p.sink, EventStream):
                p.sink.refuse(response)
            else:
                p.sink.resolve(response)

    def _prompt_ids(self, greq: GenerationRequest) -> list[int]:
        tok = self.engine.tokenizer
        if greq.kind == "chat":
            if self.template is None:
                raise ApiError("this model has no chat template; use /v1/completions", param="messages")
            try:
                text = render_chat(self.template, list(greq.messages),
                                   template_kwargs=_template_kwargs(greq))
            except TemplateError as e:
                raise ApiError(f"the chat template rejected the request: {e.message}", param="messages") from None
            # The template writes its own special tokens (bos included), as transformers does.
            return tok.encode(text, add_special_tokens=False)
        if greq.prompt_ids is not None:
            check_prompt_ids(greq.prompt_ids, tok.vocab_size)
            return list(greq.prompt_ids)
        return tok.encode(greq.prompt, add_special_tokens=True)

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
            self.replies.pop(out.req_id, None)
            self.counters.add_finished(out.request)
            _send_error(reply.sink, f"generation failed: {out.request.error or 'a replayed token differed'}")
            return
        if isinstance(reply.sink, EventStream):
            if out.new_text:
                reply.sink.send(reply.fmt.chunk(out.new_text, None))
            if out.finished:
                reply.sink.send(reply.fmt.chunk("", out.finish_reason))
                reply.sink.send(reply.fmt.usage_chunk(out.request))
                reply.sink.send("[DONE]")
                reply.sink.close()
        else:
            reply.pieces.append(out.new_text)
            if out.finished:
                body = reply.fmt.final("".join(reply.pieces), out.finish_reason, out.request)
                reply.sink.resolve(HttpResponse.json_response(body))
        if out.finished:
            self.replies.pop(out.req_id, None)
            self.counters.add_finished(out.request)

    def _fail_running(self, error: Exception) -> None:
        message = f"generation failed: {type(error).__name__}: {error}"
        for req in list(self.engine.scheduler.running):
            reply = self.replies.pop(req.req_id, None)
            self.counters.add_finished(req)  # keeps completion_tokens_total from going back
            self.engine.abort(req.req_id)
            if reply is not None:
                _send_error(reply.sink, message)


def _send_error(sink: EventStream | DeferredResponse, message: str) -> None:
    """A failed generation: an error event that ends the stream, or HTTP 500."""
    if isinstance(sink, EventStream):
        sink.send({"error": {"message": message, "type": "server_error", "param": None, "code": None}})
        sink.send("[DONE]")
        sink.close()
    else:
        sink.resolve(HttpResponse.error(500, message, type="server_error"))


def _compile_error(greq: GenerationRequest, e: GrammarCompileError) -> ApiError:
    return ApiError(f"'{greq.grammar.field}' could not be compiled into a grammar: {e}", param=greq.grammar.field)


def _template_kwargs(greq: GenerationRequest) -> dict | None:
    kwargs = dict(greq.chat_template_kwargs or {})
    effort = greq.reasoning_effort
    if effort is not None:
        kwargs.setdefault("enable_thinking", effort != "none")
        if effort != "none":
            kwargs["reasoning_effort"] = effort
    return kwargs or None
