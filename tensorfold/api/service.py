"""The Service: the server's routes (OpenAI's, the Responses API, Anthropic's Messages, the
tokenizer's, /health and /metrics) over the engine, and the loop's tick.

All of it runs on the server's one thread. A generation handler validates the body, prepares
the prompt (api/prompt.py), takes its grammar through the pipeline (api/grammar_pipeline.py)
and starts it (api/delivery.py); everything that can be refused is refused before any token
and before a stream opens. tick() starts the requests whose grammar compiled, then runs one
engine round and delivers its text. The engine is read through its EngineInfo and the model
through the ServedModel the wiring built (tensorfold/server.py).
"""
import logging
import time

from tensorfold.api import anthropic, fields, metrics, reasoning_token, responses, responses_format
from tensorfold.api.counters import Counters, health_body, metrics_text
from tensorfold.api.delivery import Delivery
from tensorfold.api.errors import ApiError
from tensorfold.api.grammar_pipeline import GrammarPipeline
from tensorfold.api.prompt import Prompts
from tensorfold.api.image_fetch import ImageFetches
from tensorfold.api.images import ImageLimits
from tensorfold.api.request import (GenerationRequest, ServerDefaults, check_prompt_ids,
                                    parse_chat_request, parse_completion_request)
from tensorfold.api.response_store import ResponseStore, StoredResponse
from tensorfold.chat.served import ServedModel
from tensorfold.engine.engine import Engine
from tensorfold.http.errors import HttpError
from tensorfold.http.messages import HttpRequest, HttpResponse

log = logging.getLogger("tensorfold.api")


class Service:
    def __init__(self, engine: Engine, served: ServedModel, model_names: tuple[str, ...], *,
                 default_max_tokens: int | None = None, response_store: str | None = None,
                 builtin_tools: str = "refuse", reasoning_key_file: str | None = None,
                 image_limits: ImageLimits = ImageLimits()):
        self.engine = engine
        self.info = engine.info
        self.served = served
        self.model_names = model_names
        s = served.sampling
        self.defaults = ServerDefaults(s.temperature, s.top_p, s.top_k, s.min_p, max_tokens=default_max_tokens,
                                       model_names=model_names, vision=engine.info.vision is not None)
        self.counters = Counters()
        self.latencies = metrics.Latencies()
        self.response_store = ResponseStore(path=response_store)
        self.builtin_tools = builtin_tools
        self.reasoning = reasoning_token.ReasoningSealer(
            reasoning_token.key_from_file(reasoning_key_file) if reasoning_key_file else
            self.response_store.key(reasoning_token.new_key) or reasoning_token.new_key())
        self.started = time.time()
        self.wake = lambda: None  # set by the server: makes its poll return (any thread)
        self.prompts = Prompts(served, self.info, model_names, default_max_tokens, image_limits)
        self.grammar = GrammarPipeline(served, self.info.vocab_size, lambda: self.wake())
        self.delivery = Delivery(engine, served, self.counters, self.latencies)
        self.fetches = ImageFetches(lambda: self.wake())

    # the live requests and the served model's parts, as the tests and tools read them

    @property
    def replies(self) -> dict:
        return self.delivery.replies

    @property
    def card(self):
        return self.served.card

    @property
    def template(self):
        return self.served.template

    @property
    def think_ids(self):
        return self.served.think_ids

    # -- routes -----------------------------------------------------------------------------

    def chat_completions(self, http: HttpRequest):
        return self._generate(parse_chat_request(http.json(), self.defaults))

    def completions(self, http: HttpRequest):
        body = http.json()
        return self._generate(parse_completion_request(body, self.defaults))

    def models(self, http: HttpRequest) -> HttpResponse:
        data = [{"id": name, "object": "model", "created": int(self.started), "owned_by": "tensorfold",
                 "max_model_len": self.info.context_length} for name in self.model_names]
        return HttpResponse.json_response({"object": "list", "data": data})

    def health(self, http: HttpRequest) -> HttpResponse:
        """200 with the server's state; 503 (with the same body) while the backend cannot serve."""
        body = health_body(self.counters, self.info, self.engine.load(), card_name=self.served.card_name,
                           busy=self.engine.has_work(), requests_running=len(self.replies))
        live = self.engine.backend.status()  # a rank group's ranks and failure, where there is one
        if "ranks" in live:
            body["ranks"] = live["ranks"]
        if live.get("unavailable"):
            body.update(status="unavailable", reason=live["unavailable"])
            return HttpResponse.json_response(body, 503)
        return HttpResponse.json_response(body)

    def create_response(self, http: HttpRequest):
        """POST /v1/responses: the Responses API through the chat path (api/responses.py)."""
        rreq = responses.to_chat_body(http.json(), self.response_store, self.reasoning, self.builtin_tools)
        if rreq.ignored_fields:
            log.info("ignoring unknown Responses fields: %s", ", ".join(rreq.ignored_fields))
        if rreq.options.ignored_tools:
            log.info("dropping built-in tools (--builtin-tools ignore): %s", ", ".join(rreq.options.ignored_tools))

        def stored(response: dict) -> None:  # before the last event or the body goes out
            if rreq.echo["store"]:
                items = [{"id": f"item_{response['id'][5:]}_{i}", **item} for i, item in enumerate(rreq.input_items)]
                self.response_store.put(StoredResponse(
                    response, items, rreq.conversation + [responses_format.assistant_message(response)]))

        try:
            greq = parse_chat_request(rreq.chat, self.defaults)
            return self._generate(greq, lambda model: responses_format.ResponsesFormat(
                model, rreq.echo, stored, rreq.options))
        except ApiError as e:
            raise responses_format.responses_error(e) from None

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

    def _stored(self, http: HttpRequest) -> StoredResponse:
        response_id = http.path_params["id"]
        entry = self.response_store.get(response_id)
        if entry is None:
            raise ApiError(f"No response found with id '{response_id}'", status=404, param="response_id",
                           code="not_found")
        return entry

    def messages(self, http: HttpRequest):
        """POST /v1/messages: Anthropic's Messages API through the chat path (api/anthropic.py)."""
        try:
            greq = parse_chat_request(anthropic.to_chat_body(http.json(), context_length=self.info.context_length),
                                      self.defaults)
            return self._generate(greq, anthropic.MessagesFormat)
        except HttpError as e:  # an ApiError, or a body that is not JSON
            return anthropic.api_error(e)

    def count_tokens(self, http: HttpRequest) -> HttpResponse:
        """POST /v1/messages/count_tokens: the prompt tokens the same Messages body would have."""
        try:
            greq = parse_chat_request(anthropic.to_chat_body(http.json(), count_only=True,
                                                            context_length=self.info.context_length), self.defaults)
            ids, _ = self.prompts.ids(greq, greq.tools.shown() if greq.tools else None)
        except HttpError as e:  # an ApiError, or a body that is not JSON
            return anthropic.api_error(e)
        return HttpResponse.json_response({"input_tokens": len(ids)})

    def metrics(self, http: HttpRequest) -> HttpResponse:
        text = metrics_text(self.counters, self.engine.load(), self.latencies)
        return HttpResponse(200, text.encode(), content_type="text/plain; version=0.0.4; charset=utf-8")

    def tokenize(self, http: HttpRequest) -> HttpResponse:
        """{"prompt" | "content": text} or {"messages": [...]} (through the chat template, with
        add_generation_prompt, default true) -> {"tokens", "count", "max_model_len"}."""
        body = http.json()
        if not isinstance(body, dict):
            raise ApiError("the request body must be a JSON object")
        tok = self.served.tokenizer
        if body.get("messages") is not None:
            greq = parse_chat_request({"messages": body["messages"], "tools": body.get("tools"),
                                       "chat_template_kwargs": body.get("chat_template_kwargs")}, self.defaults)
            if self.served.template is None:
                raise ApiError("this model has no chat template", param="messages")
            shown = greq.tools.shown() if greq.tools else None
            generation = fields.boolean(body.get("add_generation_prompt"), "add_generation_prompt")
            text = self.prompts.render(greq, shown, add_generation_prompt=generation is not False)
            ids = tok.encode(text, add_special_tokens=False)
        else:
            key = "prompt" if "prompt" in body else "content"
            text = fields.string(body.get(key), key, required=True)
            special = fields.boolean(body.get("add_special_tokens"), "add_special_tokens")
            ids = tok.encode(text, add_special_tokens=special is not False)
        return HttpResponse.json_response({"tokens": ids, "count": len(ids),
                                           "max_model_len": self.info.context_length})

    def detokenize(self, http: HttpRequest) -> HttpResponse:
        """{"tokens": [ids]} -> {"prompt": text, "content": text} (vLLM's and llama-server's names)."""
        body = http.json()
        if not isinstance(body, dict):
            raise ApiError("the request body must be a JSON object")
        ids = fields.array(body.get("tokens"), "tokens", required=True)
        ids = tuple(fields.integer(t, f"tokens[{i}]", lo=0, required=True) for i, t in enumerate(ids))
        check_prompt_ids(ids, self.served.tokenizer.vocab_size)
        text = self.served.tokenizer.decode(ids)
        return HttpResponse.json_response({"prompt": text, "content": text})

    # -- one request, and the loop's tick ---------------------------------------------------

    def _generate(self, greq: GenerationRequest, fmt_class=None):
        if greq.ignored_fields:
            log.info("ignoring unknown request fields: %s", ", ".join(greq.ignored_fields))
        urls = self.prompts.image_urls(greq)
        if urls:  # fetched off the serving thread (api/image_fetch.py); the request waits, held
            limits = self.prompts.image_limits
            return self.fetches.submit(greq, fmt_class, urls, limits.max_bytes, limits.url_timeout_s)
        return self._start(greq, fmt_class)

    def _start(self, greq: GenerationRequest, fmt_class=None, fetched: dict | None = None, sink=None):
        """Prepare and start a request (its image URLs fetched, its sink held, where it waited)."""
        prepared = self.prompts.prepare(greq, fmt_class, fetched)
        spec = self.grammar.spec(greq)
        if spec is None:
            return self.delivery.start(prepared, self.grammar.budget(prepared), sink=sink)
        return self.grammar.submit(prepared, spec, self.delivery.start, sink)

    def tick(self) -> bool:
        """One engine round; True while work remains."""
        if self.fetches.pending:
            self.fetches.start_fetched(
                self._start, lambda greq, fmt_class, e: self.prompts.format(greq, fmt_class).api_error(e),
                lambda greq, fmt_class, message: self.prompts.format(greq, fmt_class).error_response(500, message))
        if self.grammar.pending:
            self.grammar.start_compiled(self.delivery.start)
        return self.delivery.round()
