"""--api-key: every /v1 route wants `Authorization: Bearer KEY` (Anthropic clients may send
`x-api-key: KEY` instead), compared in constant time; anything else is a 401 in the route's
error shape. /health, /metrics and the tokenizer routes stay open.
"""
import hmac

from tensorfold.http.messages import HttpRequest, HttpResponse


def presented_key(request: HttpRequest) -> str | None:
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key") or None


def require_key(handler, key: str, unauthorized=None):
    """`handler` behind the key check; `unauthorized(message)` makes the 401 (OpenAI's shape by
    default)."""
    expected = key.encode()
    unauthorized = unauthorized or (lambda message: HttpResponse.error(401, message, code="invalid_api_key"))

    def guarded(request: HttpRequest):
        given = presented_key(request)
        if given is None:
            return unauthorized("Missing API key: send 'Authorization: Bearer <key>'")
        if not hmac.compare_digest(given.encode(), expected):
            return unauthorized("Incorrect API key provided")
        return handler(request)
    return guarded
