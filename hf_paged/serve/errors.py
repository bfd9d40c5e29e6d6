"""`APIError` and the OpenAI error body every failure of the server is answered with."""

from __future__ import annotations

_KINDS = {
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error answered with the OpenAI error body and HTTP `status`.

    Args:
        status (`int`): the HTTP status.
        message (`str`): what went wrong, naming the value and the limit.
        param (`str`, *optional*): the request field at fault (`"messages.0.content"`, `"seed"`, ...).
        code (`str`, *optional*): OpenAI's machine-readable code (`"context_length_exceeded"`, ...).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.message, error_kind(self.status), self.param, self.code)


def error_kind(status: int) -> str:
    """OpenAI's error `type` for an HTTP status."""
    return _KINDS.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None):
    """The OpenAI error body: `{"error": {"message", "type", "param", "code"}}`.

    Example:

    ```python
    >>> error_body("seed must be at most 9223372036854775807", param="seed")["error"]["param"]
    'seed'

    ```
    """
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
