"""Exception safety: an error raised inside the model mid-generate, a KeyboardInterrupt, or the pool running out
mid-decode returns every block, leaves the pool consistent, and the next call is exact.

An error between steps (in a stopping criterion) is in `test_generation.py`; a forward that stops midway through
the layers on a cache used directly, in `test_cache.py`.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from hf_paged import PagedCache, PoolExhaustedError, get_pool
from hf_paged.reference_models import tiny_model

from .conftest import left_padded_batch

MODES = {
    "greedy": {},
    "beams": {"num_beams": 3, "num_return_sequences": 2},
    "sampling": {"do_sample": True, "top_k": 20, "num_return_sequences": 2},
}
WHERE = ["before layer 0", "after layer 0", "after the last layer"]


class Boom(RuntimeError):
    pass


@pytest.fixture(scope="module")
def model():
    model = tiny_model("llama")
    get_pool(model, block_size=2, num_blocks=256)
    return model


def generate(model, mode="greedy", seed=0, **kwargs):
    input_ids, attention_mask = left_padded_batch([3, 6, 5], seed=seed)
    options = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 6, "pad_token_id": 0}
    torch.manual_seed(seed)
    return model.generate(**{**options, **MODES[mode], **kwargs})


def assert_pool_whole(model, used=0):
    pool = get_pool(model)
    pool.check_invariants()
    assert pool.stats().num_used == used
    assert model.config._attn_implementation == "sdpa"


def assert_next_call_is_exact(model, mode):
    assert torch.equal(generate(model, mode, cache_implementation="paged"), generate(model, mode))
    assert_pool_whole(model)


@contextmanager
def raising(model, where: str, at_call: int, error: BaseException):
    """Raise `error` on the `at_call`-th forward of a decoder layer, before layer 0 runs or after a layer wrote its
    K/V."""
    layers = model.model.layers
    calls = []

    def hook(*args):
        calls.append(1)
        if len(calls) == at_call:
            raise error

    if where == "before layer 0":
        handle = layers[0].register_forward_pre_hook(hook)
    else:
        handle = layers[0 if where == "after layer 0" else -1].register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
    assert len(calls) == at_call


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("at_call", [1, 4], ids=["prefill", "decode step 3"])
@pytest.mark.parametrize("where", WHERE)
def test_exception_inside_the_model_returns_every_block(model, mode, at_call, where):
    with pytest.raises(Boom):
        with raising(model, where, at_call, Boom("layer failed")):
            generate(model, mode, cache_implementation="paged")
    assert_pool_whole(model)
    assert_next_call_is_exact(model, mode)


@pytest.mark.parametrize("at_call", [1, 5], ids=["prefill", "decode step 4"])
@pytest.mark.parametrize("where", WHERE)
def test_keyboard_interrupt_mid_forward_returns_every_block(model, where, at_call):
    """torch runs no forward hook when a `KeyboardInterrupt` leaves the forward; the cache still drops the
    unfinished forward (an interrupted prefill's blocks, holding the first layer's K/V only, were indexed in the
    prefix cache and served to the next call)."""
    get_pool(model).clear_prefix_cache()  # the prompts' blocks are computed by the interrupted call
    with pytest.raises(KeyboardInterrupt):
        with raising(model, where, at_call, KeyboardInterrupt()):
            generate(model, "beams", cache_implementation="paged")
    assert_pool_whole(model)
    assert_next_call_is_exact(model, "beams")


def test_keyboard_interrupt_between_forwards_returns_every_block(model):
    calls = []

    def interrupt_on_third_forward(module, args, kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt

    handle = model.register_forward_pre_hook(interrupt_on_third_forward, with_kwargs=True)
    try:
        with pytest.raises(KeyboardInterrupt):
            generate(model, cache_implementation="paged")
    finally:
        handle.remove()
    assert_pool_whole(model)
    assert_next_call_is_exact(model, "greedy")


@pytest.mark.parametrize("where", WHERE)
def test_exception_on_a_callers_empty_cache_leaves_it_empty(model, where):
    cache = PagedCache(model)
    with pytest.raises(Boom):
        with raising(model, where, 3, Boom("layer failed")):
            generate(model, past_key_values=cache)
    assert cache.batch_size == 0 and cache.get_seq_length() == 0
    assert_pool_whole(model)
    assert torch.equal(generate(model, past_key_values=cache), generate(model))  # the same cache, afterwards
    cache.release()
    assert_pool_whole(model)


def test_keyboard_interrupt_in_the_prefill_of_a_callers_cache_leaves_it_empty(model):
    seed = 50  # prompts no other test computed
    get_pool(model).clear_prefix_cache()
    cache = PagedCache(model)
    with pytest.raises(KeyboardInterrupt):
        with raising(model, "after layer 0", 1, KeyboardInterrupt()):
            generate(model, seed=seed, past_key_values=cache)
    assert cache.batch_size == 0 and cache.get_seq_length() == 0
    assert_pool_whole(model)
    assert torch.equal(generate(model, seed=seed, past_key_values=cache), generate(model, seed=seed))
    cache.release()
    assert_pool_whole(model)


@pytest.mark.parametrize("where", WHERE)
def test_exception_on_a_callers_started_cache_keeps_it_usable(model, where):
    input_ids, attention_mask = left_padded_batch([3, 6, 5])
    cache = PagedCache(model)
    with torch.no_grad():
        model(input_ids=input_ids[:, :4], attention_mask=attention_mask[:, :4], past_key_values=cache)
    with pytest.raises(Boom):
        with raising(model, where, 3, Boom("layer failed")):
            generate(model, past_key_values=cache)
    get_pool(model).check_invariants()
    assert cache.batch_size == 3  # it keeps what it held; the next call crops it to what the prompt shares
    assert torch.equal(generate(model, past_key_values=cache), generate(model))
    cache.release()
    assert_pool_whole(model)


@pytest.mark.parametrize("where", WHERE)
def test_exception_on_a_fork_keeps_the_fork_usable(model, where):
    """A fork whose first own forward fails midway notices it on its next call, like the cache it came from."""
    seed = 40 + WHERE.index(where)  # prompts no other test computed: stale slots cannot hold the right K/V
    input_ids, attention_mask = left_padded_batch([3, 6, 5], seed=seed)
    prompt_cache = PagedCache(model)
    with torch.no_grad():
        model(input_ids=input_ids[:, :4], attention_mask=attention_mask[:, :4], past_key_values=prompt_cache)
    fork = prompt_cache.fork()
    with pytest.raises(Boom):
        with raising(model, where, 1, Boom("layer failed")):
            generate(model, seed=seed, past_key_values=fork)
    assert torch.equal(generate(model, seed=seed, past_key_values=fork), generate(model, seed=seed))
    for cache in (fork, prompt_cache):
        cache.release()
    assert_pool_whole(model)


@pytest.mark.parametrize("mode", MODES)
def test_pool_running_out_mid_decode_returns_every_block(mode):
    model = tiny_model("llama")
    # the whole pool holds every mode's worst case (else it is refused before any forward); the free blocks do not
    held = PagedCache(model, block_size=2, num_blocks=200)
    with torch.no_grad():
        model(input_ids=torch.randint(3, 128, (1, 360)), past_key_values=held)  # 180 blocks: 20 left
    forwards = []
    handle = model.register_forward_pre_hook(lambda *args: forwards.append(1))
    try:
        with pytest.raises(PoolExhaustedError, match="needs .* more block\\(s\\) but only .* are free") as info:
            generate(model, mode, max_new_tokens=24, cache_implementation="paged")
    finally:
        handle.remove()
    assert info.value.num_needed > info.value.num_free and len(forwards) > 2  # it ran out while decoding
    assert_pool_whole(model, used=180)
    held.release()
    assert_pool_whole(model)
    reference = generate(model, mode, max_new_tokens=24)
    assert torch.equal(generate(model, mode, max_new_tokens=24, cache_implementation="paged"), reference)
    assert_pool_whole(model)


def test_pool_running_out_on_a_callers_cache_then_continuing(model):
    """The caller's cache keeps what it computed; once blocks are free again the same cache finishes exactly."""
    pool = get_pool(model)
    hog = pool.allocator.new_table()
    pool.allocator.append(hog, 2 * (pool.num_blocks - 12))  # 12 blocks left
    cache = PagedCache(model)
    try:
        with pytest.raises(PoolExhaustedError):
            generate(model, past_key_values=cache, max_new_tokens=20)
        pool.check_invariants()
    finally:
        pool.allocator.free(hog)
    assert torch.equal(generate(model, past_key_values=cache, max_new_tokens=20), generate(model, max_new_tokens=20))
    cache.release()
    assert_pool_whole(model)
