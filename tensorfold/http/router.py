"""Routes: (method, path pattern) -> handler, and every refusal the HTTP layer itself makes.

A pattern is literal segments and `{name}` segments ("/v1/responses/{id}"); a `{name}` segment
matches one non-empty path segment, percent-decoded into request.path_params. Routes are tried
in the order they were added. dispatch() never raises: an unknown path is a 404, a known path
with another method a 405 with an Allow header, a handler's HttpError its own status and body,
and any other exception a logged 500 server_error. HEAD is served by the GET handler (the
server sends no body).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Union
from urllib.parse import unquote

from tensorfold.http.errors import HttpError
from tensorfold.http.messages import DeferredResponse, EventStream, HttpRequest, HttpResponse

log = logging.getLogger("tensorfold.http")

Reply = Union[HttpResponse, EventStream, DeferredResponse]
Handler = Callable[[HttpRequest], Reply]


@dataclass(frozen=True)
class _Route:
    method: str
    segments: tuple[str, ...]   # literal text, or "{name}"
    handler: Handler

    def match(self, parts: list[str]) -> dict[str, str] | None:
        if len(parts) != len(self.segments):
            return None
        params = {}
        for seg, part in zip(self.segments, parts):
            if seg.startswith("{") and seg.endswith("}"):
                if not part:
                    return None
                params[seg[1:-1]] = part
            elif seg != part:
                return None
        return params


class Router:
    def __init__(self):
        self._routes: list[_Route] = []

    def add(self, method: str, pattern: str, handler: Handler) -> None:
        if not pattern.startswith("/"):
            raise ValueError(f"route pattern must start with '/': {pattern!r}")
        self._routes.append(_Route(method.upper(), tuple(pattern.split("/")[1:]), handler))

    def dispatch(self, request: HttpRequest) -> Reply:
        parts = [unquote(p) for p in request.path.split("/")[1:]] if request.path.startswith("/") else []
        method = "GET" if request.method == "HEAD" else request.method
        allowed = set()
        for route in self._routes:
            params = route.match(parts)
            if params is None:
                continue
            if route.method == method:
                request.path_params = params
                return self._call(route.handler, request)
            allowed.add(route.method)
        if not allowed:
            return HttpResponse.error(404, f"Invalid URL ({request.method} {request.path})",
                                      code="not_found")
        if "GET" in allowed:
            allowed.add("HEAD")
        allow = ", ".join(sorted(allowed))
        return HttpResponse.error(405, f"Method {request.method} not allowed for {request.path}"
                                  f" (allowed: {allow})", code="method_not_allowed",
                                  headers=[("allow", allow)])

    @staticmethod
    def _call(handler: Handler, request: HttpRequest) -> Reply:
        try:
            result = handler(request)
        except HttpError as err:
            return HttpResponse.from_error(err)
        except Exception:
            log.exception("handler for %s %s failed", request.method, request.path)
            return server_error()
        if not isinstance(result, (HttpResponse, EventStream, DeferredResponse)):
            log.error("handler for %s %s returned %r, not a reply type",
                      request.method, request.path, type(result).__name__)
            return server_error()
        return result


def server_error() -> HttpResponse:
    return HttpResponse.error(500, "The server had an error while processing your request.",
                              type="server_error")
