"""Delivery: the live requests, from the engine to their clients.

start() hands a prepared request to the engine and opens its sink (a stream, or a response
resolved later); round() runs one engine round and sends each request's new text, split by its
reply parser, to its sink in its format. A request leaves `replies` exactly once: finished,
failed (an error event that ends its stream, or a 500), or cancelled because its client went
away; each way its tokens are added to the counters, so the totals never go back.
"""
import logging
from dataclasses import dataclass

from tensorfold.api import metrics, replies
from tensorfold.api.counters import Counters
from tensorfold.api.errors import ApiError
from tensorfold.api.priority import request_priority
from tensorfold.api.prompt import Prepared
from tensorfold.chat.reply_parser import ReplyParser
from tensorfold.chat.served import ServedModel
from tensorfold.engine.engine import Engine, RequestOutput
from tensorfold.engine.request import Request
from tensorfold.http.messages import DeferredResponse, EventStream, HttpResponse

log = logging.getLogger("tensorfold.api")


@dataclass
class Reply:
    """One live request: where its text goes, how its text is split, and its engine request."""
    fmt: replies.ReplyFormat
    sink: EventStream | DeferredResponse
    parser: ReplyParser
    request: Request


class Delivery:
    def __init__(self, engine: Engine, served: ServedModel, counters: Counters, latencies: metrics.Latencies):
        self.engine = engine
        self.served = served
        self.counters = counters
        self.latencies = latencies
        self.replies: dict[str, Reply] = {}

    def start(self, p: Prepared, constraint=None, compile_s: float | None = None, sink=None):
        """Hand the request to the engine; returns its sink (new, or the held one to open)."""
        greq, fmt = p.greq, p.fmt
        down = self.engine.unavailable()
        if down:  # a failed rank group: nothing can run until it is restarted
            raise ApiError(f"the model cannot serve now: {down}", status=503, type="server_error",
                           code="unavailable")
        try:
            req_id = self.engine.add_request(p.prompt_ids, p.params, req_id=fmt.id,
                                             priority=request_priority(greq.priority, greq.messages),
                                             constraint=constraint, grammar_compile_s=compile_s, images=p.images)
        except MemoryError as e:  # can never fit the KV pool, whatever else finishes
            raise ApiError(str(e), param="max_tokens", code="context_length_exceeded") from None
        request = self.engine.requests[req_id]  # the engine hands back its id; the formats read the request
        self.counters.requests_total += 1
        if greq.stream:
            sink = sink or EventStream()
            for event, data in fmt.opening(request):
                sink.send(data, event=event)
            sink.open()
        else:
            sink = sink or DeferredResponse()
        sink.on_disconnect = lambda: self.cancel(req_id)
        self.replies[req_id] = Reply(fmt, sink, p.parser, request)
        return sink

    def cancel(self, req_id: str) -> None:
        self.latencies.forget(req_id)
        reply = self.replies.pop(req_id, None)
        if reply is not None:
            self.counters.add_finished(reply.request)
        self.engine.abort(req_id)
        if reply is not None:
            log.info("%s: client went away; request cancelled", req_id)

    def round(self) -> bool:
        """One engine round, its new text delivered; True while work remains."""
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
            out.request.stats.reasoning_tokens = \
                self.served.reasoning_tokens(out.request.output_ids) if reply.parser.after_think else 0
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

    def _fail_running(self, error: Exception) -> None:
        message = f"generation failed: {type(error).__name__}: {error}"
        for req_id in self.engine.running_ids():
            self.latencies.forget(req_id)
            reply = self.replies.pop(req_id, None)
            self.engine.abort(req_id)
            if reply is not None:
                self.counters.add_finished(reply.request)  # keeps completion_tokens_total from going back
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
