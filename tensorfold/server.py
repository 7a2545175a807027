"""Wires the parts into a server: engine -> ServedModel -> Service (the routes) -> Router -> HttpServer.

    settings = ServeSettings(...)   # parsed once by __main__ (or built by tests)
    server = build_server(settings)
    server.serve_forever()

The one place that reads the engine's checkpoint and tokenizer: it builds the ServedModel the
Service serves (card, template, defaults); above it the Service sees only engine.info.
"""
import logging
import os
from dataclasses import dataclass

from tensorfold.api.images import ImageLimits
from tensorfold.api import anthropic
from tensorfold.api.auth import require_key
from tensorfold.api.service import Service
from tensorfold.chat.served import ServedModel, served_model
from tensorfold.engine.engine import Engine, EngineConfig
from tensorfold.http.messages import HttpRequest, HttpResponse
from tensorfold.http.router import Router
from tensorfold.http.server import HttpServer, Limits

log = logging.getLogger("tensorfold")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ServeSettings:
    model: str | None = None            # HF dir or .gguf; None = the default model
    host: str = "127.0.0.1"
    port: int = 8080
    served_model_name: str | None = None
    aliases: tuple[str, ...] = ()
    max_tokens: int | None = None       # default reply limit (capped to the remaining window)
    model_card: str | None = None       # model_cards/NAME.json; None: chosen from the checkpoint
    reasoning_effort: str | None = None  # the effort of requests that set none
    thinking_budget: int = 0            # thinking tokens of requests that set no budget; 0: none
    api_key: str | None = None          # every /v1 route wants "Authorization: Bearer KEY"
    response_store: str | None = None   # an SQLite file for stored responses; None: in memory
    builtin_tools: str = "refuse"       # Responses built-in tools (web_search, ...): "refuse" (400) or "ignore"
    reasoning_key_file: str | None = None  # the encrypted-reasoning key; None: kept in the store, else per process
    engine: EngineConfig = EngineConfig()
    limits: Limits = Limits()
    image_limits: ImageLimits = ImageLimits()  # --vision: bytes, pixels and images per request


def served_names(settings: ServeSettings) -> tuple[str, ...]:
    if settings.served_model_name:
        name = settings.served_model_name
    elif settings.model is None:
        name = DEFAULT_MODEL_NAME
    else:
        name = os.path.basename(os.path.normpath(settings.model))
        name = name[:-5] if name.endswith(".gguf") else name
    return (name, *[a for a in settings.aliases if a != name])


def build_router(service: Service, api_key: str | None = None) -> Router:
    """The routes. With an API key, the /v1 ones want it; /, /health, /metrics and the tokenizer
    routes stay open (as vLLM keeps its non-/v1 routes). A query string (Claude Code's
    /v1/messages?beta=true) plays no part in matching."""
    guard = (lambda h: require_key(h, api_key)) if api_key else (lambda h: h)
    router = Router()
    router.add("GET", "/", root)  # clients (Claude Code) probe HEAD / before their first request
    router.add("GET", "/v1/models", guard(service.models))
    router.add("GET", "/health", service.health)
    router.add("GET", "/metrics", service.metrics)
    router.add("POST", "/tokenize", service.tokenize)
    router.add("POST", "/detokenize", service.detokenize)
    router.add("POST", "/v1/chat/completions", guard(service.chat_completions))
    router.add("POST", "/v1/completions", guard(service.completions))
    router.add("POST", "/v1/responses", guard(service.create_response))
    router.add("GET", "/v1/responses/{id}", guard(service.get_response))
    router.add("DELETE", "/v1/responses/{id}", guard(service.delete_response))
    router.add("GET", "/v1/responses/{id}/input_items", guard(service.response_input_items))
    anthropic_guard = (lambda h: require_key(h, api_key, lambda m: anthropic.error_response(401, m))) \
        if api_key else (lambda h: h)
    router.add("POST", "/v1/messages", anthropic_guard(service.messages))
    router.add("POST", "/v1/messages/count_tokens", anthropic_guard(service.count_tokens))
    return router


def root(http: HttpRequest) -> HttpResponse:
    """GET / (and HEAD /): 200 with an empty body, open like /health."""
    return HttpResponse(200, b"", content_type="text/plain; charset=utf-8")


def served_model_of(engine: Engine, settings: ServeSettings = ServeSettings()) -> ServedModel:
    """The model as served: the engine's checkpoint metadata and tokenizer, with the settings'
    card, effort and thinking budget."""
    ckpt = engine.checkpoint
    return served_model(ckpt.architecture, ckpt.chat_template, ckpt.tokenizer_config, ckpt.generation_config,
                        engine.tokenizer, model_card=settings.model_card, reasoning_effort=settings.reasoning_effort,
                        thinking_budget=settings.thinking_budget)


def build_server(settings: ServeSettings, engine: Engine | None = None) -> HttpServer:
    engine = engine or Engine(settings.model, settings.engine)
    service = Service(engine, served_model_of(engine, settings), served_names(settings),
                      default_max_tokens=settings.max_tokens, response_store=settings.response_store,
                      builtin_tools=settings.builtin_tools, reasoning_key_file=settings.reasoning_key_file,
                      image_limits=settings.image_limits)
    if settings.api_key is None and settings.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without --api-key: anyone who reaches this port can use the model",
                    settings.host)
    server = HttpServer(build_router(service, settings.api_key), settings.host, settings.port, tick=service.tick,
                        limits=settings.limits)
    server.service = service
    service.wake = server.wake
    return server
