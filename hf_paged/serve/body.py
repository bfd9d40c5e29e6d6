"""Request bodies: a size limit enforced before anything is parsed, and JSON parsing into a protocol model with
OpenAI errors (invalid JSON, lone surrogates, invalid fields) naming the field at fault."""

from __future__ import annotations

import json
import sys

from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import APIError
from .protocol import json_type

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
MAX_JSON_DEPTH = 32  # arrays and objects inside one another; OpenAI bodies need fewer than 10


class BodyLimitMiddleware:
    """ASGI middleware that refuses a request body over `max_bytes` with 413 at once: from its `Content-Length`
    when it declares one, otherwise as soon as the bytes received pass the limit (a chunked upload). A body within
    the limit is read here and replayed to the app, so nothing downstream ever holds more than `max_bytes`.

    Args:
        app: the ASGI app.
        max_bytes (`int`): the largest body accepted.
    """

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send, f"the request body has {declared} bytes")
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send, f"the request body has more than {self.max_bytes} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, send: Send, what: str) -> None:
        error = APIError(413, f"{what}, over this server's limit of {self.max_bytes} bytes", code="body_too_large")
        payload = json.dumps(error.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives `body` once, then whatever `receive` gives (a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def parse_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """`raw` JSON validated as `model`; raises `APIError` (400) naming the field at fault. CPU-bound: call it from a
    worker thread for large bodies.

    Example:

    ```python
    >>> from hf_paged.serve.protocol import CompletionRequest
    >>> parse_body(b'{"model": "m", "prompt": "hi"}', CompletionRequest).prompt
    'hi'
    >>> try:
    ...     parse_body(b'{"model": "m", "prompt": "\\\\ud800"}', CompletionRequest)
    ... except APIError as error:
    ...     print(error.status, error.param)
    400 prompt

    ```
    """
    try:
        data = json.loads(raw)
    except RecursionError:
        raise APIError(400, f"the request body nests more than {MAX_JSON_DEPTH} arrays or objects") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise APIError(400, f"the request body is not valid JSON: {error}") from None
    except ValueError:  # an integer literal longer than Python reads
        limit = sys.get_int_max_str_digits()
        raise APIError(400, f"the request body holds an integer of over {limit} digits") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    if json_depth(data) > MAX_JSON_DEPTH:
        raise APIError(400, f"the request body nests more than {MAX_JSON_DEPTH} arrays or objects")
    where = _surrogate_path(data)
    if where is not None:
        raise APIError(
            400, f"{where or 'a key'}: contains a lone UTF-16 surrogate, which is not valid Unicode", where or None
        )
    try:
        return model.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")
        if first["type"].endswith("_type"):  # a value of the wrong JSON type: say which it was
            message += f", got {json_type(first['input'])}"
        raise APIError(400, f"{param}: {message}" if param else message, param) from None


def json_depth(value) -> int:
    """How many arrays and objects of parsed JSON `value` sit inside one another (0 for a scalar), counted without
    recursion.

    Example:

    ```python
    >>> json_depth({"a": [1, {"b": []}]}), json_depth("text")
    (4, 0)

    ```
    """
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _surrogate_path(value, path: str = "") -> str | None:
    """The dotted path of the first string (or key) in `value` holding a lone surrogate, or `None`."""
    if isinstance(value, str):
        return path if _has_surrogate(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            key_text = key.encode("utf-8", "backslashreplace").decode("utf-8")  # a surrogate key, spelled out
            inner = f"{path}.{key_text}" if path else key_text
            if _has_surrogate(key):
                return inner
            found = _surrogate_path(item, inner)
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = _surrogate_path(item, f"{path}.{index}" if path else str(index))
            if found is not None:
                return found
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
