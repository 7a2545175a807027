"""The error every refusal goes out as: HttpError, with its status and the OpenAI error body
`{"error": {"message", "type", "param", "code"}}`.

The HTTP layer's own refusals (a body that is not JSON, 404, 405, 413, 503, a handler's 500) use
it, and a handler refuses a request by raising it (or a subclass of it); the Router
turns it into its status and body. Nothing here knows the API's fields.
"""


class HttpError(Exception):
    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error",
               param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
