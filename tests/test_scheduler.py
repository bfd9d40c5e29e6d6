"""Scheduler: exact admission, decode and preemption decisions over a real pool (no model). Every decision takes
its blocks through the planner's real allocation call as it is made; a forward is simulated by choosing token 7."""

from __future__ import annotations

import hf_paged
from hf_paged.engine.params import SamplingParams
from hf_paged.engine.request import Request, RequestStatus
from hf_paged.engine.scheduler import Scheduler
from hf_paged.groups import KVLayout
from hf_paged.planner import ForwardPlanner
from hf_paged.pool import BlockPool
from hf_paged.prefix import root_hash
from hf_paged.reference_models import tiny_model

ROOT = root_hash(b"test")


def scheduler_over(num_blocks: int, block_size: int, root: bytes | None = None, **options):
    """`(scheduler, allocator)` over a fresh pool of one full-attention layer group."""
    pool = BlockPool(num_blocks, block_size)
    planner = ForwardPlanner(pool, KVLayout.for_windows([None]), root)
    return Scheduler(planner, **options), pool.allocator


def request(name: str, prompt_length: int, max_new_tokens: int = 100) -> Request:
    return Request(name, list(range(10, 10 + prompt_length)), SamplingParams(max_new_tokens=max_new_tokens))


def run(scheduler: Scheduler, step) -> None:
    """What the engine does with a step, whose blocks the scheduler took: generate one more token when the rows
    reach the end of the request's tokens (not after a prompt chunk short of it), and index the full blocks."""
    for req in step.requests:
        assert req.row.num_tokens <= len(req.token_ids)
        if req.row.num_tokens == len(req.token_ids):
            req.append_token(7)
    planner = scheduler.planner
    if planner.prefix_caching:
        scheduler.pool.index_full_blocks([req.row for req in step.requests], planner.roots)


def names(requests) -> list[str]:
    return [r.request_id for r in requests]


def test_admission_is_first_come_first_served_within_the_free_blocks():
    scheduler, allocator = scheduler_over(8, 4, None)
    for name, length in (("a", 9), ("b", 8), ("c", 13), ("d", 1)):
        scheduler.add(request(name, length))
    step, failed = scheduler.schedule()
    # a needs 3 blocks, b 2 more (5); c would need 4 more (9 > 8): admission stops at c, d waits behind it
    assert (step.kind, names(step.requests), step.new_tokens, failed) == ("prefill", ["a", "b"], [9, 8], [])
    assert names(scheduler.waiting) == ["c", "d"]
    run(scheduler, step)
    assert [len(r.row.table.block_ids) for r in step.requests] == [3, 2] and allocator.num_free == 3
    step, _ = scheduler.schedule()
    # b's next token needs a block (its 2 blocks are full): c's 4 blocks do not fit in the 3 - 1 left
    assert (step.kind, names(step.requests), step.new_tokens) == ("decode", ["a", "b"], [1, 1])


def test_the_most_recently_admitted_request_is_preempted_and_recomputed_first():
    scheduler, allocator = scheduler_over(6, 2, None)
    a, b = request("a", 3), request("b", 3)
    scheduler.add(a)
    run(scheduler, scheduler.schedule()[0])  # a: blocks [0, 1]
    scheduler.add(b)
    run(scheduler, scheduler.schedule()[0])  # b: blocks [2, 3]
    for _ in range(3):  # a and b reach 6 tokens: blocks [0, 1, 4] and [2, 3, 5]
        step, _ = scheduler.schedule()
        assert names(step.requests) == ["a", "b"]
        run(scheduler, step)
    assert (a.row.table.block_ids, b.row.table.block_ids, allocator.num_free) == ([0, 1, 4], [2, 3, 5], 0)
    step, failed = scheduler.schedule()  # both need a 4th block, none is free: b goes
    assert (names(step.requests), failed, scheduler.num_preemptions) == (["a"], [], 1)
    assert b.row is None and b.status is RequestStatus.WAITING and b.num_preemptions == 1
    # b's blocks [2, 3, 5] went back; the decode step took the first of them for a's next token as it was decided
    assert names(scheduler.waiting) == ["b"] and sorted(allocator.free_block_ids) == [3, 5]
    assert a.row.table.block_ids == [0, 1, 4, 2]
    run(scheduler, step)
    scheduler.finish(a, "length")
    assert allocator.num_free == 6
    step, _ = scheduler.schedule()  # b comes back with its prompt and the 4 tokens it had generated
    assert (step.kind, names(step.requests), step.new_tokens) == ("prefill", ["b"], [7])
    assert b.token_ids == list(range(10, 13)) + [7, 7, 7, 7]


def test_a_request_that_can_never_fit_fails_alone():
    scheduler, allocator = scheduler_over(4, 4, None)
    big, small = request("big", 16), request("small", 3)
    scheduler.add(big)
    scheduler.add(small)
    step, failed = scheduler.schedule()
    assert names(failed) == ["big"] and big.finish_reason == "error"
    assert big.error == (
        "the request needs 5 blocks of 4 tokens for its 16 tokens and the next one, but the whole pool has 4 blocks"
    )
    assert names(step.requests) == ["small"]


def test_the_engines_refusal_names_what_set_the_pools_size():
    model = tiny_model("llama")
    engine = hf_paged.Engine(model, block_size=4, num_blocks=4, exact=True)
    (output,) = engine.generate([list(range(3, 19))], max_new_tokens=2)
    assert output.finish_reason == "error"
    assert output.error.endswith("but the whole pool has 4 blocks, sized by Engine(num_blocks=4)")


def test_a_lone_request_outgrowing_the_pool_ends_with_its_blocks_returned():
    scheduler, allocator = scheduler_over(2, 2, None)
    scheduler.add(request("a", 3))
    run(scheduler, scheduler.schedule()[0])
    run(scheduler, scheduler.schedule()[0])  # 4 tokens: both blocks full
    step, failed = scheduler.schedule()
    assert step is None and names(failed) == ["a"] and "needs 1 more" in failed[0].error
    assert failed[0].finish_reason == "length"  # it generated tokens: it ends with them
    assert allocator.num_free == 2 and not scheduler.has_work


def test_batch_size_and_prefill_budget_limit_admission():
    scheduler, allocator = scheduler_over(64, 4, None, max_batch_size=3, max_prefill_tokens=20)
    for name, length in (("a", 25), ("b", 2), ("c", 2), ("d", 2), ("e", 2)):
        scheduler.add(request(name, length))
    step, _ = scheduler.schedule()
    assert names(step.requests) == ["a"] and step.new_tokens == [20]  # alone, in chunks of the budget
    run(scheduler, step)
    step, _ = scheduler.schedule()
    assert names(step.requests) == ["a"] and step.new_tokens == [5] and step.admitted == ()  # its last chunk
    run(scheduler, step)
    assert a_done(scheduler)
    step, _ = scheduler.schedule()
    assert names(step.requests) == ["b", "c"]  # the batch is full at 3 running
    run(scheduler, step)
    step, _ = scheduler.schedule()
    assert step.kind == "decode" and names(scheduler.waiting) == ["d", "e"]


def a_done(scheduler: Scheduler) -> bool:
    first = scheduler.running[0]
    return first.output_token_ids == [7] and first.row.num_tokens == 25


def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps():
    scheduler, allocator = scheduler_over(16, 4, None, max_prefill_tokens=4)
    short, long = request("short", 3), request("long", 10)
    scheduler.add(short)
    run(scheduler, scheduler.schedule()[0])
    scheduler.add(long)
    plan = []
    for _ in range(6):
        step, failed = scheduler.schedule()
        assert not failed
        plan.append((step.kind, names(step.requests), step.new_tokens))
        run(scheduler, step)
    assert plan == [
        ("prefill", ["long"], [4]),  # admitted alone: 10 tokens > the budget of 4
        ("decode", ["short"], [1]),  # the running request decodes between chunks
        ("prefill", ["long"], [4]),
        ("decode", ["short"], [1]),
        ("prefill", ["long"], [2]),  # the last chunk: "long" gets its first token
        ("decode", ["short", "long"], [1, 1]),
    ]
    assert long.output_token_ids == [7, 7] and long.row.table.block_ids == [1, 2, 4] and allocator.num_free == 11


def test_a_chunk_that_does_not_fit_preempts_its_request_until_it_does():
    scheduler, allocator = scheduler_over(6, 4, None, max_prefill_tokens=4)
    short, long = request("short", 4, max_new_tokens=6), request("long", 12)
    scheduler.add(short)
    run(scheduler, scheduler.schedule()[0])  # short: 1 block
    scheduler.add(long)
    run(scheduler, scheduler.schedule()[0])  # long fits (3 blocks + short's next): first chunk
    run(scheduler, scheduler.schedule()[0])  # short decodes into a second block
    hog = allocator.new_table()
    allocator.append(hog, 12)  # someone else takes the last 3 free blocks: long's next chunk cannot fit
    step, _ = scheduler.schedule()
    assert (step.kind, names(step.requests)) == ("decode", ["short"])
    assert names(scheduler.waiting) == ["long"] and long.status is RequestStatus.WAITING and long.row is None
    assert scheduler.num_preemptions == 1 and allocator.num_free == 1
    run(scheduler, step)
    allocator.free(hog)
    step, _ = scheduler.schedule()  # readmitted, prefilled again from its first chunk
    assert names(step.requests) == ["long"] and step.new_tokens == [4] and step.admitted == (long,)
    allocator.check_invariants()


def test_admission_reuses_cached_prefix_blocks():
    scheduler, allocator = scheduler_over(16, 4, ROOT)
    first = request("first", 10)
    scheduler.add(first)
    run(scheduler, scheduler.schedule()[0])
    cached = first.row.table.block_ids[:2]  # tokens 10..17, full
    scheduler.finish(first, "length")
    assert allocator.stats().num_cached == 2 and allocator.num_used == 0
    second = request("second", 9)  # same first 8 tokens
    scheduler.add(second)
    step, _ = scheduler.schedule()
    assert step.new_tokens == [1] and second.row.table.block_ids[:2] == cached and second.prefix_tokens_reused == 8
    assert len(second.row.table.block_ids) == 3  # the block of its 9th token, taken as it was admitted
    assert [allocator.ref_count(b) for b in cached] == [1, 1]


# ---------------------------------------------------------------------- mixed steps (packed forwards)
def long_prompt_while_one_decodes(num_blocks: int, **options):
    """`(scheduler, allocator, short, long)`: a packed scheduler where `short` (3 tokens) is prefilled and decodes
    when `long` (a 10-token prompt) arrives."""
    scheduler, allocator = scheduler_over(num_blocks, 4, None, **options)
    scheduler.packed = True
    short, long = request("short", 3), request("long", 10)
    scheduler.add(short)
    run(scheduler, scheduler.schedule()[0])
    scheduler.add(long)
    return scheduler, allocator, short, long


def test_mixed_steps_decode_every_running_request_while_a_long_prompt_is_prefilled():
    scheduler, allocator, short, long = long_prompt_while_one_decodes(16, max_prefill_tokens=4)
    plan = []
    for _ in range(4):
        step, failed = scheduler.schedule()
        assert not failed
        plan.append((step.kind, names(step.requests), step.new_tokens))
        if max(step.new_tokens) > 1:  # prompt tokens: packed; a decode-only step stays right-aligned (no pad either)
            assert step.batch.packed is not None and step.batch.packed.num_tokens == sum(step.new_tokens)
        else:
            assert step.batch.packed is None and step.batch.num_new == 1
        run(scheduler, step)
    assert plan == [
        ("mixed", ["short", "long"], [1, 4]),  # admitted while "short" decodes: no step without a token for it
        ("mixed", ["short", "long"], [1, 4]),
        ("mixed", ["short", "long"], [1, 2]),  # the last chunk: "long" gets its first token
        ("decode", ["short", "long"], [1, 1]),
    ]
    assert short.output_token_ids == [7] * 5 and long.output_token_ids == [7, 7]
    allocator.check_invariants()


def test_mixed_step_admission_counts_real_prompt_tokens_against_the_budget():
    scheduler, _ = scheduler_over(64, 4, None, max_prefill_tokens=10)
    scheduler.packed = True
    for name, length in (("a", 4), ("b", 5), ("c", 2)):
        scheduler.add(request(name, length))
    step, _ = scheduler.schedule()
    # a + b = 9 prompt tokens fit the budget of 10; c (2 more) does not. Padded, a and b would be 2 x 5 = 10
    assert (step.kind, names(step.requests), step.new_tokens) == ("prefill", ["a", "b"], [4, 5])
    run(scheduler, step)
    step, _ = scheduler.schedule()
    assert (step.kind, names(step.requests), step.new_tokens) == ("mixed", ["a", "b", "c"], [1, 1, 2])


def test_a_step_with_decoding_requests_holds_at_most_max_num_batched_tokens():
    scheduler, allocator = scheduler_over(64, 4, None, max_prefill_tokens=12, max_num_batched_tokens=5)
    scheduler.packed = True
    short_a, short_b, long = request("a", 2), request("b", 3), request("long", 20)
    scheduler.add(long)
    step, _ = scheduler.schedule()
    # nothing decodes: the first chunk takes the whole prefill budget (12), not the step budget (5)
    assert (step.kind, names(step.requests), step.new_tokens) == ("prefill", ["long"], [12])
    run(scheduler, step)
    scheduler.add(short_a)
    scheduler.add(short_b)
    plan = []
    for _ in range(5):
        step, failed = scheduler.schedule()
        assert not failed and (sum(step.new_tokens) <= 5 or step.kind == "prefill")
        plan.append((step.kind, names(step.requests), step.new_tokens))
        run(scheduler, step)
        allocator.check_invariants()
    assert plan == [
        ("prefill", ["long"], [8]),  # still nothing decoding: the rest of the prompt in one chunk
        ("mixed", ["long", "a"], [1, 2]),  # 1 decode token leaves 4 prompt tokens: b's 3 do not fit after a's 2
        ("mixed", ["long", "a", "b"], [1, 1, 3]),  # 2 decoding: 3 prompt tokens, b's whole prompt
        ("decode", ["long", "a", "b"], [1, 1, 1]),
        ("decode", ["long", "a", "b"], [1, 1, 1]),
    ]


def test_the_step_budget_leaves_prompt_tokens_only_what_decoding_requests_do_not_take():
    scheduler, _ = scheduler_over(64, 4, None, max_prefill_tokens=100, max_num_batched_tokens=10)
    assert [scheduler.prompt_budget(n) for n in (0, 1, 9, 10, 11)] == [100, 9, 1, 0, 0]
    scheduler.max_num_batched_tokens = 1000
    assert scheduler.prompt_budget(3) == 100  # never more than max_prefill_tokens


def test_a_long_prompt_arriving_while_requests_decode_is_chunked_by_the_step_budget():
    scheduler, allocator, _, long = long_prompt_while_one_decodes(64, max_prefill_tokens=100, max_num_batched_tokens=4)
    plan = []
    while not long.output_token_ids:
        step, _ = scheduler.schedule()
        plan.append(step.new_tokens)
        run(scheduler, step)
    # the prefill budget (100) would take the whole prompt in one step: the step budget gives it 4 - 1 a step
    assert plan == [[1, 3], [1, 3], [1, 3], [1, 1]]
    allocator.check_invariants()


def test_decoding_requests_that_fill_the_step_budget_leave_no_room_for_prompts():
    scheduler, allocator = scheduler_over(64, 4, None, max_num_batched_tokens=2)
    scheduler.packed = True
    for name in ("a", "b"):
        scheduler.add(request(name, 3))
    run(scheduler, scheduler.schedule()[0])  # a and b prefilled together (nothing decoded yet)
    waiting = request("c", 3)
    scheduler.add(waiting)
    step, failed = scheduler.schedule()
    assert (step.kind, names(step.requests), step.new_tokens, failed) == ("decode", ["a", "b"], [1, 1], [])
    assert waiting.row is None and list(scheduler.waiting) == [waiting]  # not admitted with a 0-token chunk
    allocator.check_invariants()
