"""ApiError: the API layer's refusal, in the HTTP layer's error shape (http/errors.py).

Every refusal is an ApiError raised before any token is generated or any stream opens; its
`param` names the request field at fault (the Responses and Messages routes rename or reshape
it for their protocols). The Router sends it as `{"error": {"message", "type", "param", "code"}}`
with its HTTP status, as it sends any HttpError.
"""
from tensorfold.http.errors import HttpError


class ApiError(HttpError):
    """A request the API refuses (400 unless `status` says otherwise)."""
