"""Thread safety: threads generating on one model and one pool get what they would get one after another.

What is and is not thread-safe is listed in docs/reliability.md.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from contextlib import contextmanager, nullcontext

import pytest
import torch

import hf_paged
from hf_paged import BlockAllocator, PagedCache, get_pool
from hf_paged.forward import attention_implementation
from hf_paged.prefix import chain, root_hash
from hf_paged.reference_models import tiny_model

from .conftest import left_padded_batch

NUM_THREADS = 4
SYSTEM = torch.randint(3, 128, (1, 13), generator=torch.Generator().manual_seed(7))  # a prompt every thread shares


def with_system_prompt(lengths, seed):
    input_ids, attention_mask = left_padded_batch(lengths, seed=seed)
    rows = len(lengths)
    return torch.cat([SYSTEM.expand(rows, -1), input_ids], 1), torch.cat(
        [torch.ones(rows, 13).long(), attention_mask], 1
    )


@contextmanager
def frequent_thread_switches():
    """Make the interpreter switch threads every microsecond, so that Python-level races show up."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def run_in_threads(work, num_threads=NUM_THREADS):
    """`work(i)` in `num_threads` threads started together; their results, or the first error re-raised."""
    barrier = threading.Barrier(num_threads)
    results, errors = [None] * num_threads, []

    def target(i):
        try:
            barrier.wait()
            results[i] = work(i)
        except BaseException as error:  # re-raised in the main thread
            errors.append(error)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


@pytest.fixture(scope="module")
def model():
    model = tiny_model("llama")
    get_pool(model, block_size=2, num_blocks=2048)
    return model


def workload(model, i, prompt_cache):
    """Four different kinds of request, all starting with the shared system prompt."""
    options = {"max_new_tokens": 8, "pad_token_id": 0, "do_sample": False}
    if i == 0:  # a left-padded greedy batch
        ids, mask = with_system_prompt([3, 7, 5], seed=i)
        return model.generate(input_ids=ids, attention_mask=mask, cache_implementation="paged", **options)
    if i == 1:  # beams sharing pages, copy-on-write on every step
        ids, mask = with_system_prompt([4, 6], seed=i)
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            num_beams=3,
            num_return_sequences=2,
            cache_implementation="paged",
            **options,
        )
    if i == 2:  # a fork of a prompt cache built before the threads started (blocks shared across threads)
        fork = prompt_cache.fork()
        try:
            follow = torch.cat([SYSTEM, torch.randint(3, 128, (1, 4), generator=torch.Generator().manual_seed(i))], 1)
            return model.generate(input_ids=follow, past_key_values=fork, **options)
        finally:
            fork.release()
    prompt = torch.cat([SYSTEM, torch.randint(3, 20, (1, 20), generator=torch.Generator().manual_seed(i))], 1)
    return model.generate(input_ids=prompt, prompt_lookup_num_tokens=3, cache_implementation="paged", **options)


def test_four_threads_match_sequential_runs(model):
    prompt_cache = PagedCache(model)
    with torch.no_grad():
        model(input_ids=SYSTEM, past_key_values=prompt_cache)
    expected = [workload(model, i, prompt_cache) for i in range(NUM_THREADS)]
    forwards = []  # which thread ran each forward
    handle = model.register_forward_pre_hook(lambda *args: forwards.append(threading.get_ident()))
    try:
        with frequent_thread_switches():
            for _ in range(3):
                results = run_in_threads(lambda i: workload(model, i, prompt_cache))
                assert all(torch.equal(a, b) for a, b in zip(expected, results))
    finally:
        handle.remove()
    switches = sum(a != b for a, b in zip(forwards, forwards[1:]))
    print(f"{len(forwards)} forwards, {switches} thread switches between consecutive forwards")
    assert switches > 3 * NUM_THREADS  # the forwards of the threads really interleaved
    prompt_cache.release()
    pool = get_pool(model)
    pool.check_invariants()
    assert pool.stats().num_used == 0 and model.config._attn_implementation == "sdpa"


@pytest.fixture
def yielding_allocator(monkeypatch):
    """The real allocator, made to give up the GIL inside its critical sections (between checking the free blocks
    and taking them, while releasing): without its lock, other threads would then interleave there."""
    for name in ("num_blocks_needed_for", "_take_free_block", "_release_blocks", "_acquire_cached"):
        original = getattr(BlockAllocator, name)

        def yielding(self, *args, _original=original, **kwargs):
            time.sleep(0)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(BlockAllocator, name, yielding)
    return BlockAllocator(num_blocks=64, block_size=2)


def hammer(allocator, seed, steps=1500):
    """Random table operations and prefix-cache traffic on `allocator`; the unexpected errors met."""
    rng, root = random.Random(seed), root_hash(b"threads")
    tables, errors = [], []
    for _ in range(steps):
        action = rng.random()
        try:
            if action < 0.15 or not tables:
                tables.append(allocator.new_table())
            elif action < 0.5:
                allocator.append(rng.choice(tables), rng.randint(1, 5))
            elif action < 0.6:
                tables.append(allocator.fork(rng.choice(tables)))
            elif action < 0.7:
                table = rng.choice(tables)
                allocator.truncate(table, rng.randint(0, table.num_tokens))
            elif action < 0.85:
                allocator.free(tables.pop(rng.randrange(len(tables))))
            else:  # index a table's first block under some content, then take the longest cached prefix
                tokens = [rng.randint(0, 1) for _ in range(4)]
                with allocator.lock:
                    table = rng.choice(tables)
                    if table.num_tokens >= 2:
                        allocator.cache_block(table.block_ids[0], chain(root, tokens, 2)[0][0], tuple(tokens[:2]))
                    reused = allocator.new_table()
                    allocator.share_cached(reused, allocator.lookup_prefix(chain(root, tokens, 2)))
                tables.append(reused)
        except hf_paged.PoolExhaustedError:
            pass
        except Exception as error:  # collected: the test reports them
            errors.append(error)
    for table in tables:
        allocator.free(table)
    return errors


def test_threads_hammering_one_allocator_keep_it_consistent(yielding_allocator):
    allocator = yielding_allocator
    errors = run_in_threads(lambda i: hammer(allocator, i))
    assert errors == [[]] * NUM_THREADS
    allocator.check_invariants()
    assert allocator.num_free == 64 and allocator.stats().num_tables == 0


def test_negative_control_without_the_lock_the_hammer_breaks_the_allocator(yielding_allocator):
    """Proves the test above can fail: the same hammer on an allocator whose lock does nothing corrupts it."""
    allocator = yielding_allocator
    allocator.lock = nullcontext()
    errors = run_in_threads(lambda i: hammer(allocator, i))
    try:
        allocator.check_invariants()
        consistent = allocator.num_free == 64
    except AssertionError:
        consistent = False
    assert any(errors) or not consistent


def test_two_attention_implementations_at_once_are_refused(model):
    """A model runs one attention implementation at a time: a paged call needing another is refused, not mixed."""
    with attention_implementation(model, "eager"):  # e.g. another thread generating with eager attention
        with pytest.raises(RuntimeError, match="running paged generation with attention 'eager' in another thread"):
            model.generate(input_ids=SYSTEM, max_new_tokens=2, pad_token_id=0, cache_implementation="paged")
    assert model.config._attn_implementation == "sdpa" and get_pool(model).stats().num_used == 0
