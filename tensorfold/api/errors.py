"""The OpenAI error shape, shared by the HTTP layer (404, 405, 413) and the API layer (400s).

Every refusal is an ApiError raised before any token is generated or any stream opens; the
server turns it into `{"error": {"message", "type", "param", "code"}}` with its HTTP status.
"""


class ApiError(Exception):
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
