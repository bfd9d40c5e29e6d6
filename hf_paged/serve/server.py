"""The OpenAI-compatible HTTP API (FastAPI) over an `EngineLoop`."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import RequestOutput
from .loop import EngineLoop
from .metrics import render_metrics
from .protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, error_body

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 512


class APIError(Exception):
    """An error answered with the OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def create_app(loop: EngineLoop, model_name: str, api_key: str | None = None) -> FastAPI:
    """A FastAPI app serving `loop.engine` as `model_name`: `/v1/completions`, `/v1/chat/completions` (both with
    server-sent-event streaming), `/v1/models`, `/health` and `/metrics`. With `api_key`, `/v1/*` needs
    `Authorization: Bearer <api_key>`."""
    app = FastAPI(title="hf_paged", docs_url=None, redoc_url=None)
    engine = loop.engine

    @app.exception_handler(APIError)
    async def api_error(_, error: APIError):
        return JSONResponse(error_body(error.message, _kind(error.status), error.param, error.code), error.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message = "the request body is not valid JSON"
        return JSONResponse(error_body(message, param=where), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, error: StarletteHTTPException):
        return JSONResponse(error_body(str(error.detail), _kind(error.status_code)), error.status_code)

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                body = error_body("invalid or missing API key", code="invalid_api_key")
                return JSONResponse(body, 401)
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(engine, loop.totals), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "hf_paged"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompt_ids = _tokenize(engine, body.prompt)
        return await _serve(loop, model_name, body, prompt_ids, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        if engine.tokenizer is None or getattr(engine.tokenizer, "chat_template", None) is None:
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return await _serve(loop, model_name, body, _tokenize(engine, text), request, chat=True)

    return app


def _kind(status: int) -> str:
    return {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error")


def _tokenize(engine, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, list):
        return prompt
    if engine.tokenizer is None:
        raise APIError(400, "this server has no tokenizer: send the prompt as a list of token ids", "prompt")
    return engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]


def _options(engine, body: SamplingFields, prompt_ids: list[int], chat: bool) -> dict:
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is None:
        max_tokens = CHAT_DEFAULT_MAX_TOKENS if chat else COMPLETION_DEFAULT_MAX_TOKENS
        if engine.max_context is not None:
            max_tokens = max(0, min(max_tokens, engine.max_context - len(prompt_ids)))
    if not prompt_ids:
        raise APIError(400, "the prompt is empty", "prompt")
    if engine.max_context is not None and len(prompt_ids) + max_tokens > engine.max_context:
        raise APIError(
            400,
            f"the prompt has {len(prompt_ids)} tokens and asks for {max_tokens} more, over the model's context "
            f"window of {engine.max_context} tokens",
            "max_tokens",
            "context_length_exceeded",
        )
    error = engine.scheduler.never_fits(len(prompt_ids))
    if error is not None:
        raise APIError(400, error, "prompt")
    options = {"max_new_tokens": max_tokens, "stop": body.stop_strings(), "top_k": 0}
    if body.temperature == 0:
        options["do_sample"] = False
    else:
        options.update(do_sample=True, temperature=body.temperature, top_p=body.top_p)
    return options


async def _serve(loop: EngineLoop, model_name: str, body: SamplingFields, prompt_ids, request: Request, chat: bool):
    if body.model != model_name:
        raise APIError(
            404, f"model {body.model!r} does not exist; this server serves {model_name!r}", "model", "model_not_found"
        )
    options = _options(loop.engine, body, prompt_ids, chat)
    event_loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
    request_ids = []
    try:
        for index in range(body.n):
            seed = None if body.seed is None else body.seed + index
            choice_queue = _IndexedQueue(queue, index)
            request_ids.append(
                await asyncio.to_thread(loop.submit, event_loop, choice_queue, prompt_ids, seed=seed, **options)
            )
    except ValueError as error:
        await _abort_all(loop, request_ids)
        raise APIError(400, str(error)) from error
    reply_id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    if body.stream:
        stream = _stream(loop, queue, request_ids, reply_id, model_name, body.n, chat)
        return StreamingResponse(stream, media_type="text/event-stream")
    return await _complete(loop, queue, request_ids, reply_id, model_name, len(prompt_ids), body.n, chat, request)


class _IndexedQueue:
    """Puts `(choice index, output)` into a shared queue (what `EngineLoop` calls `put_nowait` on)."""

    def __init__(self, queue: asyncio.Queue, index: int):
        self.queue, self.index = queue, index

    def put_nowait(self, output: RequestOutput) -> None:
        self.queue.put_nowait((self.index, output))


async def _abort_all(loop: EngineLoop, request_ids: list[str]) -> None:
    for request_id in request_ids:
        await asyncio.to_thread(loop.abort, request_id)


def _finish_reason(output: RequestOutput) -> str | None:
    if output.finish_reason == "error":
        raise APIError(500, output.error or "generation failed", code="generation_failed")
    return output.finish_reason


async def _complete(loop, queue, request_ids, reply_id, model_name, prompt_tokens, n, chat, request: Request):
    finals: dict[int, RequestOutput] = {}
    try:
        while len(finals) < n:
            try:
                index, output = await asyncio.wait_for(queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise asyncio.CancelledError from None
                continue
            if output.finished:
                finals[index] = output
    finally:
        if len(finals) < n:
            await _abort_all(loop, request_ids)
    choices = []
    for index in range(n):
        output = finals[index]
        reason = _finish_reason(output)
        if chat:
            choices.append(
                {"index": index, "message": {"role": "assistant", "content": output.text}, "finish_reason": reason}
            )
        else:
            choices.append({"index": index, "text": output.text, "logprobs": None, "finish_reason": reason})
    completion_tokens = sum(len(o.token_ids) for o in finals.values())
    return {
        "id": reply_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


async def _stream(loop, queue, request_ids, reply_id, model_name, n, chat) -> AsyncIterator[str]:
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"
    finished = 0

    def chunk(index: int, text: str | None, reason: str | None, first: bool = False) -> str:
        if chat:
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "finish_reason": reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}
        body = {"id": reply_id, "object": kind, "created": created, "model": model_name, "choices": [choice]}
        return f"data: {json.dumps(body)}\n\n"

    try:
        if chat:
            for index in range(n):
                yield chunk(index, "", None, first=True)
        while finished < n:
            index, output = await queue.get()
            if output.finish_reason == "error":
                body = error_body(output.error or "generation failed", "server_error", code="generation_failed")
                yield f"data: {json.dumps(body)}\n\n"
                return
            if output.new_text or output.finished:
                yield chunk(index, output.new_text, output.finish_reason if output.finished else None)
            finished += output.finished
        yield "data: [DONE]\n\n"
    finally:
        if finished < n:  # the client went away (or the stream failed): free the blocks now
            await _abort_all(loop, request_ids)
