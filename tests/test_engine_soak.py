"""Engine soak: thousands of requests arriving over time, random aborts, a pool at about half of the demand. The pool
stays consistent after every step, no block leaks, and every completed greedy output equals its request run alone."""

from __future__ import annotations

import os
import random

import pytest
import torch

from hf_paged import Engine
from hf_paged.reference_models import tiny_model

NUM_REQUESTS = 20_000 if os.environ.get("HF_PAGED_LONG_TESTS") else 2_000
DISTINCT_PROMPTS = 240  # prompts repeat (as real traffic does), so references are computed once per prompt
MOST_NEW = 8
BLOCK_SIZE = 4
IN_FLIGHT = 64  # requests offered at once at the peak
# Every request needs at most ceil((12 + 8) / 4) = 5 blocks: 64 in flight would need 320; the pool holds half.
NUM_BLOCKS = IN_FLIGHT * 5 // 2


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["hf_paged", "sdpa"], ids=["packed-mixed-steps", "padded-steps"])
def test_engine_soak_with_aborts_and_a_half_sized_pool(attention):
    model = tiny_model("llama")
    rng = random.Random(2026)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randint(1, 12))] for _ in range(DISTINCT_PROMPTS)]
    options = {"do_sample": False, "max_new_tokens": MOST_NEW, "min_new_tokens": MOST_NEW}
    reference = [model.generate(torch.tensor([p]), **options)[0, len(p) :].tolist() for p in prompts]

    engine = Engine(
        model,
        block_size=BLOCK_SIZE,
        num_blocks=NUM_BLOCKS,
        max_batch_size=IN_FLIGHT,
        attn_implementation=attention,
        exact=True,
    )
    allocator = engine.pool.allocator
    asked: dict[str, tuple[int, int]] = {}
    completed, aborted, steps = 0, 0, 0
    while completed + aborted < NUM_REQUESTS:
        while len(asked) < NUM_REQUESTS and engine.num_running + engine.num_waiting < IN_FLIGHT:
            index, new = rng.randrange(DISTINCT_PROMPTS), rng.randint(1, MOST_NEW)
            request_id = engine.add_request(prompts[index], max_new_tokens=new, min_new_tokens=new)
            asked[request_id] = (index, new)
        for output in engine.step():
            if not output.finished:
                continue
            if output.finish_reason == "abort":
                aborted += 1
                continue
            index, new = asked[output.request_id]
            assert output.finish_reason == "length" and output.token_ids == reference[index][:new], output
            completed += 1
        steps += 1
        if rng.random() < 0.35:  # abort a random request, queued or running
            live = [r for r in list(engine._requests) if not engine._requests[r].finished]
            if live:
                held = allocator.num_used
                engine.abort(rng.choice(live))
                assert allocator.num_used <= held
        allocator.check_invariants()
        assert allocator.num_used <= NUM_BLOCKS
    stats = engine.stats()
    assert completed + aborted == NUM_REQUESTS and aborted > 50
    assert allocator.num_used == 0 and not engine.has_unfinished_requests()
    assert stats.prefix_hit_rate > 0.1
    if attention == "sdpa":
        assert stats.preemptions > 0
    # packed mixed steps take every decoding request's token before admitting against the next step's: this
    # workload finishes in 2.2x fewer steps and did not need to preempt (preemption under packed steps is covered
    # by test_engine.py's pools too small for their requests)
    print(
        f"\nsoak: {NUM_REQUESTS} requests ({completed} completed, {aborted} aborted) in {steps} steps, "
        f"{stats.preemptions} preemptions, peak {stats.peak_blocks}/{NUM_BLOCKS} blocks, "
        f"prefix hit rate {stats.prefix_hit_rate:.2f}"
    )


# Memory: after a warm-up (the prefix cache and the TTFT sample full, torch's caches built), thousands more requests
# leave no per-request trace. Each finished request used to leave its time to first token in a list (~32 bytes);
# the bound allows ~10 bytes a request, for the noise of torch's and transformers' own small caches.
WARM_UP_REQUESTS = 1_500
MEASURED_REQUESTS = 3_000
MEMORY_BOUND_BYTES = 32 * 1024


def serve_requests(engine: Engine, rng: random.Random, count: int) -> int:
    """Offer `count` requests (greedy and sampled, 10% aborted at once or later), 32 in flight; returns how many
    finished with stop or length."""
    finished, done = 0, 0
    while done < count:
        while engine.num_running + engine.num_waiting < 32:
            prompt = [rng.randrange(3, 128) for _ in range(rng.randint(1, 12))]
            new = rng.randint(1, 6)
            request_id = engine.add_request(prompt, max_new_tokens=new, do_sample=rng.random() < 0.3, seed=None)
            if rng.random() < 0.05:
                engine.abort(request_id)
        for output in engine.step():
            if output.finished:
                done += 1
                finished += output.finish_reason in ("stop", "length")
        if rng.random() < 0.05 and engine._requests:
            engine.abort(rng.choice(list(engine._requests)))
    return finished


@pytest.mark.slow
def test_engine_memory_is_flat_over_thousands_of_requests():
    import gc
    import tracemalloc

    engine = Engine(tiny_model("llama"), block_size=4, num_blocks=160, max_batch_size=32, exact=True)
    rng = random.Random(7)
    tracemalloc.start()  # before the warm-up: what it allocated and later requests free is then counted as freed
    try:
        serve_requests(engine, rng, WARM_UP_REQUESTS)
        gc.collect()
        before = tracemalloc.take_snapshot()
        finished = serve_requests(engine, rng, MEASURED_REQUESTS)
        while engine.has_unfinished_requests():  # the requests still in flight end too
            engine.step()
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    growth = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    top = sorted(after.compare_to(before, "lineno"), key=lambda stat: -stat.size_diff)[:3]
    print(f"\nmemory: {growth} bytes over {MEASURED_REQUESTS} requests ({growth / MEASURED_REQUESTS:.1f} B each)")
    assert growth < MEMORY_BOUND_BYTES, "\n".join(str(stat) for stat in top)
    assert engine.pool.stats().num_used == 0 and not engine.has_unfinished_requests()
    latency = engine.latency  # bounded too: fixed buckets
    assert latency.e2e_request_latency.count >= finished > MEASURED_REQUESTS // 2
    assert latency.time_to_first_token.count >= latency.e2e_request_latency.count
    assert len(engine.recorder._ttfts.values) == 1024 and engine.stats().p90_ttft_s is not None
