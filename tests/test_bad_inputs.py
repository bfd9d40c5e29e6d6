"""Bad input gets a clear error naming the value and the limit, and corrupts nothing: the pool is exactly as before
(same free queue, same refcounts), its invariants hold, no block leaks, and the next call is exact.

Unit-level refusals live with their modules: allocator sizes and freed or foreign tables in `test_allocator.py`,
`parse_memory` and `PagedCacheConfig` in `test_pool.py`, storage shapes in `test_storage.py`, a forward of another
batch size and encoder-decoder models in `test_cache.py`, attention head counts in `test_attention.py`.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from hf_paged import PagedCache, PoolExhaustedError, get_pool
from hf_paged.reference_models import tiny_model

from .conftest import left_padded_batch

BLOCK_SIZE, NUM_BLOCKS = 4, 64


@pytest.fixture(scope="module")
def model():
    model = tiny_model("llama")
    get_pool(model, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    return model


def pool_state(model):
    pool = get_pool(model)
    allocator = pool.allocator
    refs = [allocator.ref_count(b) for b in range(allocator.num_blocks)]
    return pool, sorted(allocator.free_block_ids), refs, allocator.stats().num_tables


def generate(model, **kwargs):
    input_ids, attention_mask = left_padded_batch([3, 7], seed=99)
    options = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 4, "pad_token_id": 0}
    return model.generate(**{**options, **kwargs})


def assert_next_call_is_exact(model):
    used = get_pool(model).stats().num_used  # blocks of caches the test holds
    reference = generate(model)
    assert torch.equal(generate(model, cache_implementation="paged"), reference)
    assert get_pool(model).stats().num_used == used


@contextmanager
def refused(model, error, message):
    """The block raises `error` matching `message`; the pool is untouched, consistent, and keeps working."""
    before = pool_state(model)
    with pytest.raises(error, match=message) as info:
        yield info
    assert pool_state(model) == before
    get_pool(model).check_invariants()
    assert model.config._attn_implementation == "sdpa"
    assert_next_call_is_exact(model)


def prefill(model, cache, input_ids):
    with torch.no_grad():
        model(input_ids=input_ids, past_key_values=cache)


# ---------------------------------------------------------------------- cache_config
@pytest.mark.parametrize(
    "value, error, message",
    [
        (0, ValueError, "block_size must be a positive int \\(>= 1\\), got 0"),
        (-4, ValueError, "block_size must be a positive int \\(>= 1\\), got -4"),
        ("16", TypeError, "block_size must be a positive int or 'auto', got '16'"),
        (2.5, TypeError, "block_size must be a positive int, got 2.5"),
    ],
)
def test_invalid_block_size(model, value, error, message):
    with refused(model, error, message):
        generate(model, cache_implementation="paged", cache_config={"block_size": value})


@pytest.mark.parametrize(
    "value, error, message",
    [
        (0, ValueError, "num_blocks must be a positive int \\(>= 1\\), got 0"),
        (True, TypeError, "num_blocks must be a positive int, got True"),
        (10**12, ValueError, "num_blocks=1000000000000 asks for .* GiB of KV, more than the .* GiB of memory of cpu"),
    ],
)
def test_invalid_num_blocks(model, value, error, message):
    with refused(model, error, message):
        generate(model, cache_implementation="paged", cache_config={"num_blocks": value})


@pytest.mark.parametrize(
    "value, error, message",
    [
        ("lots", ValueError, "max_memory='lots' is not a memory size; use bytes or a number with one of the units"),
        ("-5MB", ValueError, "max_memory='-5MB' is not a memory size"),
        ("12 parsecs", ValueError, "max_memory='12 parsecs' is not a memory size"),
        (
            "10B",
            ValueError,
            "max_memory=10 \\(10 bytes\\) is smaller than one KV block \\(8192 bytes = 16 tokens x 512 bytes",
        ),
        ("64PiB", ValueError, "max_memory='64PiB' is not a memory size"),
        ("10TiB", ValueError, "asks for .* GiB of KV, more than the .* GiB of memory of cpu"),
        (1.5, TypeError, "max_memory must be an int \\(bytes\\) or a string like '512MiB', got float"),
    ],
)
def test_invalid_max_memory(model, value, error, message):
    with refused(model, error, message):
        generate(model, cache_implementation="paged", cache_config={"max_memory": value})


def test_num_blocks_and_max_memory_together(model):
    with refused(model, ValueError, "give either num_blocks \\(4\\) or max_memory \\('1GiB'\\), not both"):
        generate(model, cache_implementation="paged", cache_config={"num_blocks": 4, "max_memory": "1GiB"})


def test_unknown_cache_config_keys(model):
    message = "unknown cache_config key\\(s\\) \\['blocksize', 'size'\\]; hf_paged understands \\['attn_implementation'"
    with refused(model, ValueError, message):
        generate(model, cache_implementation="paged", cache_config={"blocksize": 16, "size": 2})


def test_cache_config_that_is_not_a_dict(model):
    with refused(model, TypeError, "cache_config must be a dict or a PagedCacheConfig, got str 'block_size=4'"):
        generate(model, cache_implementation="paged", cache_config="block_size=4")


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"memory_fraction": 1.5}, ValueError, "memory_fraction must be in \\(0, 1\\], got 1.5"),
        ({"memory_fraction": "0.5"}, TypeError, "memory_fraction must be a number in \\(0, 1\\], got '0.5'"),
        ({"prefix_caching": "yes"}, TypeError, "prefix_caching must be True or False, got 'yes'"),
        ({"attn_implementation": 3}, TypeError, "attn_implementation must be a string, got 3"),
    ],
)
def test_invalid_option_values(model, options, error, message):
    with refused(model, error, message):
        generate(model, cache_implementation="paged", cache_config=options)


def test_unknown_attention_implementation(model):
    with refused(model, ValueError, 'Specified `attn_implementation="flashy"` is not supported'):
        generate(model, cache_implementation="paged", cache_config={"attn_implementation": "flashy"})


# ---------------------------------------------------------------------- pool and model disagree
def test_dtype_mismatch_between_a_busy_pool_and_the_model():
    """An idle pool follows a dtype change (tests/test_pool.py); one with blocks in use refuses the new dtype."""
    model = tiny_model("llama")
    held = PagedCache(model, block_size=4)
    prefill(model, held, torch.randint(3, 128, (1, 5)))
    in_use = get_pool(model).stats().num_used
    model.to(torch.bfloat16)
    cache = PagedCache(model)
    message = (
        "holds 2 heads x 16 dims of torch.float32 on cpu, but the model produced 2 heads x 16 dims of torch.bfloat16"
    )
    with pytest.raises(ValueError, match=message):
        prefill(model, cache, torch.randint(3, 128, (1, 5)))
    assert cache.batch_size == 0 and get_pool(model).stats().num_used == in_use
    cache.release()
    held.release()
    get_pool(model).check_invariants()


def test_device_mismatch_between_pool_and_model():
    model = tiny_model("llama")
    cache = PagedCache(model, block_size=4)
    prefill(model, cache, torch.randint(3, 128, (1, 5)))
    cache.release()
    model.to("meta")  # a device the pool's storage is not on
    cache = PagedCache(model)
    with pytest.raises(ValueError, match="of torch.float32 on cpu, but the model produced .* of torch.float32 on meta"):
        prefill(model, cache, torch.randint(3, 128, (1, 5), device="meta"))
    assert cache.batch_size == 0 and get_pool(model).stats().num_used == 0
    cache.release()
    get_pool(model).check_invariants()


def test_cache_from_another_model(model):
    other = tiny_model("llama", seed=1)
    cache = PagedCache(model)
    with refused(model, ValueError, "built for a LlamaForCausalLM .* cannot be used with a LlamaForCausalLM"):
        generate(other, past_key_values=cache)
    assert cache.batch_size == 0
    cache.release()


# ---------------------------------------------------------------------- cache life cycle and row operations
def test_cache_used_after_release(model):
    cache = PagedCache(model)
    prefill(model, cache, torch.randint(3, 128, (2, 5)))
    cache.release()
    message = "this PagedCache was released; its blocks are back in the pool. Build a new one."
    with refused(model, RuntimeError, message):
        generate(model, past_key_values=cache)
    for use in (lambda: prefill(model, cache, torch.randint(3, 128, (2, 1))), cache.fork, lambda: cache.crop(-1)):
        with pytest.raises(RuntimeError, match=message):
            use()


def test_double_release_is_a_no_op(model):
    cache = PagedCache(model)
    prefill(model, cache, torch.randint(3, 128, (2, 9)))
    cache.release()
    stats = get_pool(model).last_cache_stats
    before = pool_state(model)
    cache.release()  # like closing a file twice: nothing happens
    assert cache.is_released and pool_state(model) == before and get_pool(model).last_cache_stats is stats
    assert stats.num_blocks == 6 and get_pool(model).stats().num_used == 0
    assert_next_call_is_exact(model)


def test_crop_beyond_the_cached_length(model):
    cache = PagedCache(model)
    prefill(model, cache, torch.randint(3, 128, (2, 6)))
    tables = [list(t.block_ids) for t in cache.row_tables]
    with refused(model, ValueError, "crop\\(-7\\) would remove more than the 6 cached positions"):
        cache.crop(-7)
    with refused(model, ValueError, "crop\\(2\\): pass a negative number of positions to remove \\(or 0\\)"):
        cache.crop(2)
    assert cache.get_seq_length() == 6 and [t.block_ids for t in cache.row_tables] == tables
    cache.release()


@pytest.mark.parametrize(
    "beam_idx, error, message",
    [
        ([0, 1, 3], IndexError, "reorder_cache: row indices \\[3\\] are out of range for a cache of 3 rows"),
        ([0, -1, 2], IndexError, "reorder_cache: row indices \\[-1\\] are out of range for a cache of 3 rows"),
        ([0.0, 1.0, 2.0], TypeError, "reorder_cache: row indices must be integers, got \\[0.0, 1.0, 2.0\\]"),
    ],
)
def test_reorder_cache_with_bad_indices(model, beam_idx, error, message):
    cache = PagedCache(model)
    prefill(model, cache, torch.randint(3, 128, (3, 6)))
    tables = [list(t.block_ids) for t in cache.row_tables]
    with refused(model, error, message):
        cache.reorder_cache(torch.tensor(beam_idx))
    assert [t.block_ids for t in cache.row_tables] == tables
    cache.release()


def test_fork_with_a_bad_count(model):
    cache = PagedCache(model)
    prefill(model, cache, torch.randint(3, 128, (1, 6)))
    with refused(model, ValueError, "fork\\(n\\): n must be a positive int, got 0"):
        cache.fork(0)
    cache.release()


# ---------------------------------------------------------------------- requests the pool cannot hold
def test_prompt_longer_than_the_whole_pool(model):
    message = (
        "this generate call may need 76 KV blocks of 4 tokens at once \\(1 row\\(s\\) of up to 301 tokens.*\\) but "
        "the model's whole pool has 64 blocks, sized by get_pool\\(model, num_blocks=64\\)"
    )
    with refused(model, PoolExhaustedError, message) as info:
        model.generate(input_ids=torch.randint(3, 128, (1, 300)), max_new_tokens=2, cache_implementation="paged")
    assert (info.value.num_needed, info.value.num_free, info.value.num_blocks) == (76, 64, 64)


def test_batch_larger_than_the_free_blocks(model):
    held = PagedCache(model)
    prefill(model, held, torch.randint(3, 128, (2, 116)))  # 58 of the 64 blocks
    input_ids, attention_mask = left_padded_batch([5, 11, 8, 14])
    message = (
        "a forward of 4 row\\(s\\) x 14 token\\(s\\) needs 11 more block\\(s\\) but only 6 are free. Give the pool "
        "more memory .*, shorten the request, or release caches you no longer need"
    )
    with refused(model, PoolExhaustedError, message):
        generate(model, input_ids=input_ids, attention_mask=attention_mask, cache_implementation="paged")
    held.release()


# ---------------------------------------------------------------------- prompts and generate arguments
def test_non_integer_token_ids(model):
    with refused(model, TypeError, "input_ids must hold integer token ids, got a tensor of torch.float32"):
        model.generate(input_ids=torch.tensor([[5.0, 6.0, 7.0]]), max_new_tokens=2, cache_implementation="paged")


@pytest.mark.parametrize("token", [128, -1])
def test_token_ids_outside_the_vocabulary(model, token):
    message = f"input_ids holds token id {token}, outside the model's vocabulary \\[0, 128\\)"
    with refused(model, ValueError, message):
        model.generate(input_ids=torch.tensor([[5, token, 7]]), max_new_tokens=2, cache_implementation="paged")


def test_empty_prompt(model):
    with refused(model, ValueError, "input_ids has shape \\(1, 0\\): every prompt needs at least one token"):
        model.generate(input_ids=torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2, cache_implementation="paged")


def test_prompt_row_with_no_real_token(model):
    input_ids, attention_mask = left_padded_batch([4, 2])
    attention_mask[1] = 0
    message = "row 1 has no real token: its attention_mask is all zeros \\(an empty prompt\\?\\)"
    with refused(model, ValueError, message):
        generate(model, input_ids=input_ids, attention_mask=attention_mask, cache_implementation="paged")


def test_max_new_tokens_zero_behaves_like_dynamic_cache(model):
    with pytest.raises(ValueError) as stock:
        generate(model, max_new_tokens=0)
    with refused(model, ValueError, "`max_new_tokens` must be greater than 0, but is 0") as paged:
        generate(model, max_new_tokens=0, cache_implementation="paged")
    assert str(paged.value) == str(stock.value)
    generate(model, cache_implementation="paged")  # the prompt's full blocks are now in the prefix cache
    cache = PagedCache(model)
    with refused(model, ValueError, "`max_new_tokens` must be greater than 0"):
        generate(model, max_new_tokens=0, past_key_values=cache)
    assert cache.batch_size == 0 and cache.get_seq_length() == 0  # a failed call leaves a fresh cache empty
    cache.release()


def test_past_key_values_together_with_cache_implementation(model):
    cache = PagedCache(model)
    message = "Passing both `cache_implementation='paged'` and `past_key_values` is unsupported"
    with refused(model, ValueError, message):
        generate(model, past_key_values=cache, cache_implementation="paged")
    cache.release()
