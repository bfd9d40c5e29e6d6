"""The server holds its memory flat: thousands of requests of a mixed load (completions and chat, streamed or not,
log-probabilities, stop strings, bad requests) through the real app, in process, leave no per-request Python
memory behind once the bounded structures are full (the prefix-cache index, at most one entry a block,
`TokenTexts`' cache, at most `TOKEN_CACHE_SIZE` tokens, and the Engine's sample of time-to-first-token values, at most
`RESERVOIR_SIZE`: the last two made small here so the warm-up fills them)."""

from __future__ import annotations

import asyncio
import functools
import gc
import random
import threading
import tracemalloc

import httpx
import pytest
from transformers import AutoTokenizer

from hf_paged import Engine
from hf_paged.engine import recorder as recorder_module
from hf_paged.engine.stats import Reservoir
from hf_paged.reference_models import smollm2_path, tiny_model
from hf_paged.serve import replies
from hf_paged.serve.loop import EngineLoop
from hf_paged.serve.prompts import PromptEncoder
from hf_paged.serve.server import create_app

MODEL = "tiny"
WARM_UP_REQUESTS = 600
MEASURED_REQUESTS = 800
MEMORY_BOUND_BYTES = 32 * 1024  # 41 bytes a request; one leftover list of token ids a request would be ~150


def request_body(rng: random.Random) -> tuple[str, dict]:
    """One request of the mix: (path, JSON body)."""
    kind, tokens = rng.random(), rng.randint(1, 6)
    if kind < 0.05:  # refused with 400
        return "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 9}
    if kind < 0.35:
        messages = [{"role": "user", "content": f"Tell me about {rng.random()}"}]
        temperature = rng.choice([0, 0.8])
        body = {"model": MODEL, "messages": messages, "max_tokens": tokens, "temperature": temperature,
                "logprobs": True, "top_logprobs": 2}  # fmt: skip
        return "/v1/chat/completions", body
    if kind < 0.75:
        return "/v1/completions", {"model": MODEL, "prompt": f"Once upon a time {rng.randrange(10**6)}",
                                   "max_tokens": tokens, "stop": ["\n\n"], "logprobs": 1}  # fmt: skip
    return "/v1/completions", {"model": MODEL, "prompt": f"Story {rng.randrange(10**6)}:", "max_tokens": tokens + 4,
                               "stream": True}  # fmt: skip


async def serve(client: httpx.AsyncClient, rng: random.Random, count: int, concurrency: int = 8) -> int:
    """Send `count` requests, `concurrency` at a time; the number answered 200."""
    answered = [0]

    async def one(body):
        response = await client.post(body[0], json=body[1])
        answered[0] += response.status_code == 200

    for start in range(0, count, concurrency):
        await asyncio.gather(*(one(request_body(rng)) for _ in range(min(concurrency, count - start))))
    return answered[0]


def tiny_app():
    """An `EngineLoop` over a tiny random Llama with SmolLM2's tokenizer, and its app."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=1024)
    loop = EngineLoop(
        Engine(model, tokenizer, block_size=4, num_blocks=96, max_batch_size=8, exact=True), model_name=MODEL
    )
    return loop, create_app(loop, MODEL)


def test_prompts_are_tokenized_on_one_thread(monkeypatch):
    """Spread over many threads, the fast tokenizer's native memory grew with every prompt holding a new word
    (docs/benchmarks.md): every prompt, chat or completion, is tokenized on the server's one tokenizer thread."""
    threads = set()
    encode = PromptEncoder.encode

    def recording_encode(self, *args, **kwargs):
        threads.add(threading.current_thread().name)
        return encode(self, *args, **kwargs)

    monkeypatch.setattr(PromptEncoder, "encode", recording_encode)
    loop, app = tiny_app()

    async def requests():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            await serve(client, random.Random(3), 48, concurrency=16)

    try:
        asyncio.run(requests())
    finally:
        loop.stop()
    assert len(threads) == 1 and next(iter(threads)).startswith("hf_paged-tokenizer"), threads


@pytest.mark.slow
def test_server_memory_is_flat_over_thousands_of_requests(monkeypatch):
    monkeypatch.setattr(replies, "TOKEN_CACHE_SIZE", 64)
    monkeypatch.setattr(recorder_module, "Reservoir", functools.partial(Reservoir, size=64))
    loop, app = tiny_app()
    rng = random.Random(26)

    async def soak():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            await serve(client, rng, WARM_UP_REQUESTS)
            gc.collect()
            before = tracemalloc.take_snapshot()
            answered = await serve(client, rng, MEASURED_REQUESTS)
            gc.collect()
            return before, tracemalloc.take_snapshot(), answered

    tracemalloc.start()  # before the warm-up: what it allocated and later requests free counts as freed
    try:
        before, after, answered = asyncio.run(soak())
    finally:
        tracemalloc.stop()
        loop.stop()
    growth = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    top = sorted(after.compare_to(before, "traceback"), key=lambda stat: -stat.size_diff)[:3]
    print(f"\nmemory: {growth} bytes over {MEASURED_REQUESTS} requests ({growth / MEASURED_REQUESTS:.1f} B each)")
    assert growth < MEMORY_BOUND_BYTES, "\n".join(f"{stat}\n" + "\n".join(stat.traceback.format()) for stat in top)
    assert answered > MEASURED_REQUESTS * 0.9  # the mix's 400s are 5%
    assert loop.engine.pool.stats().num_used == 0 and loop.idle
