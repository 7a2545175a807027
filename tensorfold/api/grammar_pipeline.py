"""The grammar pipeline: from a request's structured-output field (or a forced tool call) to the
constraint the engine samples under, compiled without stalling the serving thread.

A grammar already compiled, or one that compiles within QUICK_COMPILE_S, starts its request at
once. A slower one compiles on the compiler's worker thread while its request waits here
(PendingGrammar) behind a held stream or a deferred response, so a compile error is still a 400
and no token has been generated; the serving loop starts the finished ones (start_compiled).
The constraint is the grammar (from after the card's think block) combined with the thinking
budget, which a request without a grammar may have alone.
"""
import logging
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Callable

from tensorfold.api.errors import ApiError
from tensorfold.api.prompt import Prepared
from tensorfold.api.request import GenerationRequest
from tensorfold.chat.served import ServedModel
from tensorfold.grammar.compiler import GrammarCompileError, GrammarCompiler
from tensorfold.grammar.constraint import GrammarConstraint
from tensorfold.grammar.spec import GrammarSpec
from tensorfold.grammar.tool_call import tool_call_spec
from tensorfold.http.messages import DeferredResponse, EventStream
from tensorfold.sampling.constraint import combine
from tensorfold.sampling.thinking_budget import ThinkingBudget

log = logging.getLogger("tensorfold.api")

QUICK_COMPILE_S = 0.02  # a grammar compiled within this is started at once; a slower one waits off-thread

Sink = EventStream | DeferredResponse
# hands a prepared request to the engine: (prepared, constraint, compile seconds, held sink) -> its sink
Start = Callable[..., Sink]


@dataclass
class PendingGrammar:
    """A request waiting for its grammar to compile on the worker thread; its sink is a held
    stream or a deferred response, so a compile error can still be a 400."""
    prepared: Prepared
    spec: GrammarSpec
    future: Future
    sink: Sink


class GrammarPipeline:
    def __init__(self, served: ServedModel, vocab_size: int, wake: Callable[[], None]):
        self.served = served
        self.compiler = GrammarCompiler(served.tokenizer, vocab_size)
        self.pending: list[PendingGrammar] = []
        self.wake = wake  # makes the server's poll return (called from the worker thread)

    def spec(self, greq: GenerationRequest) -> GrammarSpec | None:
        """The grammar a request asks for: a forced tool call's, else its structured output's."""
        if greq.tools is not None and greq.tools.forced:
            return tool_call_spec(self.served.card, greq.tools.shown())
        return greq.grammar

    def submit(self, prepared: Prepared, spec: GrammarSpec, start: Start, sink: Sink | None = None) -> Sink:
        """Start the request under its grammar now, or hold it until the grammar compiles; `sink`:
        the request's held one, where it already waited (for its image URLs)."""
        if not GrammarCompiler.available():
            raise ApiError("structured output needs xgrammar on the server: pip install xgrammar", param=spec.field)
        compiled = self.compiler.cached(spec)
        if compiled is not None:  # no hop to the worker thread for a grammar already compiled
            return start(prepared, self.constraint(prepared, compiled), 0.0, sink)
        future = self.compiler.compile_async(spec)
        try:
            compiled, seconds = future.result(timeout=QUICK_COMPILE_S)
        except FutureTimeout:
            sink = sink or (EventStream(held=True) if prepared.greq.stream else DeferredResponse())
            self.pending.append(PendingGrammar(prepared, spec, future, sink))
            future.add_done_callback(lambda _: self.wake())
            return sink
        except GrammarCompileError as e:
            raise _compile_error(spec, e) from None
        return start(prepared, self.constraint(prepared, compiled), seconds, sink)

    def start_compiled(self, start: Start) -> None:
        """Start the requests whose grammar finished compiling (or answer them with a 400)."""
        done = [p for p in self.pending if p.future.done()]
        self.pending = [p for p in self.pending if not p.future.done()]
        for p in done:
            if p.sink.disconnected:
                continue
            try:
                compiled, seconds = p.future.result()
                start(p.prepared, self.constraint(p.prepared, compiled), seconds, p.sink)
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

    def constraint(self, p: Prepared, compiled):
        """The request's grammar (with the card's think markers, from after a think block), and
        its thinking budget."""
        think = self.served.think_ids if p.greq.kind == "chat" else None
        budget = self.budget(p)
        skip = tuple(budget.sequence[budget.sequence.index(budget.close_id) + 1:]) if budget else ()
        grammar = GrammarConstraint(compiled, self.served.tokenizer.eos_token_ids, think, p.thinking, skip)
        return combine([budget, grammar])

    def budget(self, p: Prepared) -> ThinkingBudget | None:
        """The thinking budget (the request's, else the server's), for a card with think
        markers that are single tokens: the budget-th reply token while thinking becomes
        "\n" + close marker + "\n\n"."""
        budget = p.greq.thinking_budget or self.served.thinking_budget
        if not budget or self.served.think_ids is None or p.greq.kind != "chat":
            return None
        return ThinkingBudget(budget, *self.served.think_ids, list(self.served.think_close_sequence), p.thinking)


def _compile_error(spec: GrammarSpec, e: GrammarCompileError) -> ApiError:
    return ApiError(f"'{spec.field}' could not be compiled into a grammar: {e}", param=spec.field)
