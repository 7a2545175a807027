"""Wires the parts into a server: engine -> Service (OpenAI routes) -> Router -> HttpServer.

    settings = ServeSettings(...)   # parsed once by __main__ (or built by tests)
    server = build_server(settings)
    server.serve_forever()
"""
import logging
import os
from dataclasses import dataclass

from tensorfold.api.service import Service
from tensorfold.engine.engine import Engine, EngineConfig
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
    engine: EngineConfig = EngineConfig()
    limits: Limits = Limits()


def served_names(settings: ServeSettings) -> tuple[str, ...]:
    if settings.served_model_name:
        name = settings.served_model_name
    elif settings.model is None:
        name = DEFAULT_MODEL_NAME
    else:
        name = os.path.basename(os.path.normpath(settings.model))
        name = name[:-5] if name.endswith(".gguf") else name
    return (name, *[a for a in settings.aliases if a != name])


def build_router(service: Service) -> Router:
    router = Router()
    router.add("GET", "/v1/models", service.models)
    router.add("GET", "/health", service.health)
    router.add("POST", "/v1/chat/completions", service.chat_completions)
    router.add("POST", "/v1/completions", service.completions)
    return router


def build_server(settings: ServeSettings, engine: Engine | None = None) -> HttpServer:
    engine = engine or Engine(settings.model, settings.engine)
    service = Service(engine, served_names(settings), default_max_tokens=settings.max_tokens,
                      model_card=settings.model_card, reasoning_effort=settings.reasoning_effort,
                      thinking_budget=settings.thinking_budget)
    server = HttpServer(build_router(service), settings.host, settings.port, tick=service.tick,
                        limits=settings.limits)
    server.service = service
    service.wake = server.wake
    return server
