"""The OpenAI-compatible HTTP API (FastAPI) over an `EngineLoop`."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import secrets
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..adapters import LoraAdapter
from ..errors import UnknownAdapterError
from ..structured import ResponseFormat, ResponseFormatError, compiler_for
from .body import DEFAULT_MAX_BODY_BYTES, BodyLimitMiddleware, parse_body
from .calls import Call, watch_disconnect
from .errors import APIError, error_body, error_kind
from .loop import EngineLoop, ShuttingDown
from .metrics import render_metrics
from .prompts import PromptEncoder
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoraRequest,
    SamplingFields,
    UnloadLoraRequest,
    message_text,
    unsupported_fields,
)
from .replies import Reply, TokenTexts, sse
from .streaming import EventStream
from .tools import ToolCalling, call_syntax, earlier_calls

logger = logging.getLogger(__name__)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 512
SHUTDOWN_MESSAGE = "the server is shutting down; the request was aborted at the end of the shutdown grace period"


def create_app(
    loop: EngineLoop,
    model_name: str,
    api_key: str | None = None,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    lora_paths: dict[str, str] | None = None,
) -> FastAPI:
    """A FastAPI app serving `loop.engine` as `model_name`: `/v1/completions`, `/v1/chat/completions` (both with
    server-sent-event streaming), `/v1/models`, `/health` and `/metrics`. With `api_key`, `/v1/*` needs
    `Authorization: Bearer <api_key>` (the scheme in any case). Request bodies over `max_body_bytes` get 413 before
    they are read. The engine's LoRA adapters are served as models of their own (a request's `model` picks one;
    `/v1/models` lists them with `parent` = `model_name`), loaded from `lora_paths` (`{name: path}`, for
    `/v1/models`' `root`) and at runtime through `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`."""
    app = FastAPI(title="hf_paged", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    engine = loop.engine
    encoder = PromptEncoder(engine.tokenizer, engine.max_context, engine.vocab_size)
    paths = dict(lora_paths or {})
    adapters = getattr(engine, "adapters", None)  # a DistributedEngine serves no adapter

    def adapter_of(body: SamplingFields) -> str | None:
        """The adapter `body.model` names (`None`: the base model), or a 404 naming the models served."""
        if body.model == model_name:
            return None
        if adapters is not None and body.model in adapters:
            return body.model
        served = [model_name, *([] if adapters is None else adapters.names)]
        raise APIError(
            404, f"model {body.model!r} does not exist; this server serves {served}", "model", "model_not_found"
        )

    token_text = TokenTexts(engine.tokenizer)
    syntax = "json" if engine.tokenizer is None else call_syntax(engine.tokenizer)  # how tools reach the model
    # One thread tokenizes every prompt. Called from one thread, the fast (Rust) tokenizer's native memory levels off
    # once its cache of words seen is full (~2 MiB); spread over the default executor's threads, it kept growing by
    # ~400 bytes for every prompt holding a word not seen before (docs/benchmarks.md, "Memory over many requests").
    tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_paged-tokenizer")

    async def on_tokenizer_thread(function, *args):
        return await asyncio.get_running_loop().run_in_executor(tokenizer_thread, functools.partial(function, *args))

    @app.exception_handler(APIError)
    async def api_error(_, error: APIError):
        return JSONResponse(error.body(), error.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, error: RequestValidationError):
        return JSONResponse(error_body(str(error)), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, error: StarletteHTTPException):
        return JSONResponse(error_body(str(error.detail), error_kind(error.status_code)), error.status_code)

    @app.exception_handler(Exception)
    async def unexpected_error(_, error: Exception):
        logger.error("hf_paged: unexpected error", exc_info=error)
        body = error_body(f"internal error: {type(error).__name__}", "server_error", code="internal_error")
        return JSONResponse(body, 500)

    async def require_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key", code="invalid_api_key")

    @app.get("/health")
    async def health():
        if not loop.accepting:
            return JSONResponse({"status": "shutting_down"}, 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(loop.snapshot), media_type="text/plain; version=0.0.4")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])

    @v1.get("/models")
    async def models():
        base = {"id": model_name, "object": "model", "created": 0, "owned_by": "hf_paged", "root": model_name}
        data = [{**base, "parent": None}]
        for name in [] if adapters is None else adapters.names:
            data.append({**base, "id": name, "root": paths.get(name, name), "parent": model_name})
        return {"object": "list", "data": data}

    @v1.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await _parse(request, LoadLoraRequest)
        if adapters is None:
            raise APIError(400, "this server cannot load LoRA adapters (tensor parallel)", code="unsupported")
        if body.lora_name == model_name:
            raise APIError(400, f"lora_name {body.lora_name!r} is the base model's name", "lora_name")
        if body.lora_name in adapters:
            raise APIError(400, f"an adapter named {body.lora_name!r} is loaded already; unload it first", "lora_name")
        try:  # read and checked off the engine thread: the running requests do not wait for the disk
            adapter = await asyncio.to_thread(LoraAdapter.load, body.lora_name, body.lora_path, engine.model)
            await loop.call(lambda e: e.load_adapter(body.lora_name, adapter))
        except (ValueError, NotImplementedError, OSError) as error:
            raise APIError(400, str(error), "lora_path") from None
        paths[body.lora_name] = body.lora_path
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @v1.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await _parse(request, UnloadLoraRequest)
        try:
            await loop.call(lambda e: e.unload_adapter(body.lora_name))
        except UnknownAdapterError as error:
            raise APIError(404, str(error), "lora_name", "model_not_found") from None
        paths.pop(body.lora_name, None)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @v1.post("/completions")
    async def completions(request: Request):
        body = await _parse(request, CompletionRequest)
        adapter = adapter_of(body)
        _check(body)
        if isinstance(body.prompt, str):  # token ids are checked against the context below, before submitting
            encoder.check_evident_length(len(body.prompt), "prompt")
        prompt_ids = await on_tokenizer_thread(encoder.encode, body.prompt)
        echo = ""
        if body.echo:
            text = isinstance(body.prompt, str)
            echo = body.prompt if text else await on_tokenizer_thread(_decode, engine, prompt_ids)
        reply = Reply(body.model, False, token_text, body.logprobs, echo, body.include_usage)
        return await _serve(loop, body, prompt_ids, reply, request, body.logprobs, adapter)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        body = await _parse(request, ChatCompletionRequest)
        adapter = adapter_of(body)
        _check(body)
        tools = ToolCalling.from_body(body.tools, body.tool_choice, body.parallel_tool_calls, syntax)
        if tools is not None and (body.response_format is not None or body.structured_outputs is not None):
            raise APIError(400, "tools: not supported together with response_format or structured_outputs", "tools")
        messages = [_template_message(m, syntax) for m in body.messages]
        if tools is not None:
            messages = tools.messages(messages)
        encoder.check_evident_length(sum(len(m["content"]) for m in messages), "messages")
        template_tools = None if tools is None else tools.template_tools()
        prompt_ids = await on_tokenizer_thread(_chat_ids, encoder, messages, template_tools)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        reply = Reply(body.model, True, token_text, logprobs, include_usage=body.include_usage, tools=tools)
        return await _serve(loop, body, prompt_ids, reply, request, logprobs, adapter)

    app.include_router(v1)
    return app


async def _parse(request: Request, model):
    raw = await request.body()  # at most the body limit (BodyLimitMiddleware)
    return await asyncio.to_thread(parse_body, raw, model)


def _check(body: SamplingFields) -> None:
    refused = unsupported_fields(body)
    if refused is not None:
        param, message = refused
        raise APIError(400, message, param, "unsupported_parameter")


def _template_message(message, syntax: str) -> dict:
    """A chat message as the template reads it: its text, and an assistant's earlier tool calls — for a Hermes
    template as `tool_calls` with their arguments parsed (it writes the tags), else in the JSON the model calls with
    (after any text); a tool message keeps its `tool_call_id`."""
    text = message_text(message)
    entry = {"role": message.role, "content": text}
    if message.tool_calls:
        calls = earlier_calls(message.tool_calls)
        if syntax == "hermes":
            entry["tool_calls"] = [{"type": "function", "function": call} for call in calls]
        else:
            as_json = json.dumps(calls, ensure_ascii=False)
            entry["content"] = f"{text}\n{as_json}" if text else as_json
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    return entry


def _chat_ids(encoder: PromptEncoder, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    try:
        text = encoder.chat_text(messages, tools)
    except APIError:
        raise
    except Exception as error:  # noqa: BLE001 - a template that refuses these messages (roles out of order, ...)
        raise APIError(400, f"messages: the chat template failed: {error}", "messages") from None
    return encoder.encode(text, special_tokens=False)  # the template holds the special tokens


def _decode(engine, prompt_ids: list[int]) -> str:
    if engine.tokenizer is None:
        raise APIError(400, "echo needs a tokenizer to turn the prompt's token ids into text", "echo")
    return engine.tokenizer.decode(prompt_ids, skip_special_tokens=False)


def _options(engine, body: SamplingFields, prompt_ids: list[int], chat: bool, logprobs: int | None) -> dict:
    """`Engine.add_request` options of every choice (their seeds apart), or a 400 naming the field."""
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if chat and max_tokens == 0:  # OpenAI refuses it for chat (completions take 0: the echoed prompt alone)
        name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        raise APIError(400, f"{name}: must be at least 1 for chat completions, got 0", name)
    if not prompt_ids:
        raise APIError(400, "the prompt is empty", "prompt")
    if engine.max_context is not None and len(prompt_ids) >= engine.max_context:
        where = "messages" if chat else "prompt"
        raise APIError(
            400,
            f"{where}: the prompt has {len(prompt_ids)} tokens, which leaves no room for an answer in the model's "
            f"context window of {engine.max_context} tokens",
            where,
            "context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = CHAT_DEFAULT_MAX_TOKENS if chat else COMPLETION_DEFAULT_MAX_TOKENS
        if engine.max_context is not None:
            max_tokens = max(0, min(max_tokens, engine.max_context - len(prompt_ids)))
    if engine.max_context is not None and len(prompt_ids) + max_tokens > engine.max_context:
        raise APIError(
            400,
            f"the prompt has {len(prompt_ids)} tokens and asks for {max_tokens} more, over the model's context "
            f"window of {engine.max_context} tokens",
            "max_tokens",
            "context_length_exceeded",
        )
    if body.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({body.min_tokens}) is over max_tokens ({max_tokens})", "min_tokens")
    bias = body.bias()
    too_big = [token for token in bias if token >= engine.vocab_size]
    if too_big:
        raise APIError(
            400, f"logit_bias: token ids must be below the vocabulary size {engine.vocab_size}, got {too_big[:5]}",
            "logit_bias",
        )  # fmt: skip
    error = engine.scheduler.never_fits(len(prompt_ids))
    if error is not None:
        raise APIError(400, error, "prompt")
    options = {
        "max_new_tokens": max_tokens,
        "min_new_tokens": body.min_tokens,
        "stop": body.stop_strings(),
        "top_k": 0,
        "frequency_penalty": body.frequency_penalty,
        "presence_penalty": body.presence_penalty,
        "logit_bias": bias,
        "logprobs": logprobs,
    }
    if body.temperature == 0:
        options["do_sample"] = False
    else:
        options.update(do_sample=True, temperature=body.temperature, top_p=body.top_p)
    return options


def _response_format(engine, body: SamplingFields, tools: ToolCalling | None = None) -> ResponseFormat | None:
    """The body's `response_format` or `structured_outputs` (or what its tools ask), compiled for the engine's
    tokenizer (cached), or a 400 naming the field."""
    if body.response_format is not None and body.structured_outputs is not None:
        raise APIError(400, "set response_format or structured_outputs, not both", "structured_outputs")
    param = "response_format" if body.structured_outputs is None else "structured_outputs"
    param = "tools" if tools is not None else param
    try:
        if tools is not None:
            response_format = tools.response_format()
        elif body.structured_outputs is not None:
            response_format = ResponseFormat.from_structured_outputs(body.structured_outputs)
        else:
            response_format = ResponseFormat.parse(body.response_format)
        if response_format is not None:
            if engine.tokenizer is None:
                raise ResponseFormatError("structured outputs need the model's tokenizer, which this server lacks")
            compiler_for(engine.tokenizer, engine.vocab_size).compile(response_format)
    except ResponseFormatError as error:
        message = str(error) if str(error).startswith(param) else f"{param}: {error}"
        raise APIError(400, message, param) from None
    return response_format


async def _serve(
    loop: EngineLoop, body: SamplingFields, prompt_ids, reply: Reply, request: Request, logprobs, adapter: str | None
):
    options = _options(loop.engine, body, prompt_ids, reply.chat, logprobs)
    response_format = None
    if body.response_format is not None or body.structured_outputs is not None or reply.tools is not None:
        response_format = await asyncio.to_thread(_response_format, loop.engine, body, reply.tools)  # compiles
    if response_format is not None:
        options["response_format"] = response_format
    if adapter is not None:
        options["adapter"] = adapter
    choices = []
    for index in range(body.n):  # seeds seed, seed + 1, ... (an int64 seed maps onto the generator's [0, 2**64))
        seed = None if body.seed is None else (body.seed + index) % 2**64
        choices.append({**options, "seed": seed})
    call = Call(loop, body.n)
    try:
        await call.start(prompt_ids, choices)
    except ShuttingDown as error:
        raise APIError(503, str(error), code="server_shutdown") from None
    except UnknownAdapterError as error:  # unloaded since the request was checked
        raise APIError(404, str(error), "model", "model_not_found") from None
    except (ValueError, TypeError) as error:
        raise APIError(400, str(error)) from None
    if body.stream:
        return EventStream(_events(call, reply, len(prompt_ids)), call)
    return await _complete(call, reply, request, len(prompt_ids))


async def _complete(call: Call, reply: Reply, request: Request, prompt_tokens: int):
    watcher = asyncio.create_task(watch_disconnect(request.receive, call))
    finals = [None] * call.n
    try:
        async for index, output in call.outputs():
            if output.finished:
                finals[index] = output
    finally:
        watcher.cancel()
        call.close()
    if call.disconnected:
        return Response(status_code=499)  # nobody is there to read it
    for output in finals:
        if output.finish_reason == "error":
            raise APIError(500, output.error or "generation failed", code="generation_failed")
        if output.finish_reason == "abort":
            raise APIError(503, SHUTDOWN_MESSAGE, code="server_shutdown")
    return JSONResponse(reply.complete(finals, prompt_tokens))


async def _events(call: Call, reply: Reply, prompt_tokens: int) -> AsyncIterator[str]:
    for event in reply.opening_chunks(call.n):
        yield event
    completion_tokens = 0
    async for index, output in call.outputs():
        if output.finish_reason == "error":
            yield sse(error_body(output.error or "generation failed", "server_error", code="generation_failed"))
            return
        if output.finish_reason == "abort":
            yield sse(error_body(SHUTDOWN_MESSAGE, "server_error", code="server_shutdown"))
            return
        event = reply.chunk(index, output)
        if event is not None:
            yield event
        if output.finished:
            completion_tokens += len(output.token_ids)
    if call.disconnected:
        return
    if reply.include_usage:
        yield reply.usage_chunk(prompt_tokens, completion_tokens)
    yield "data: [DONE]\n\n"
