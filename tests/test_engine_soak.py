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
        model, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_batch_size=IN_FLIGHT, attn_implementation=attention
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
