"""Global pool: sizing from cache_config, reuse, rebuild, and configuration errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hf_paged
from hf_paged import PagedCache, PagedCacheConfig, get_pool, release_pool
from hf_paged.config import DEFAULT_CPU_KV_BYTES, DEFAULT_MAX_BLOCKS, parse_memory
from hf_paged.pool import KVShape
from hf_paged.reference_models import tiny_model


@pytest.fixture
def model():
    return tiny_model("llama")


def test_kv_bytes_per_token_of_smollm2_shape():
    # 30 layers x 3 KV heads x 64 dims, fp32: the DESIGN.md figure
    assert KVShape(30, 3, 64, torch.float32).bytes_per_token == 46_080


def test_pool_is_global_per_model_and_sized_by_num_blocks(model):
    pool = get_pool(model, num_blocks=40, block_size=8)
    assert (pool.num_blocks, pool.block_size) == (40, 8)
    assert get_pool(model) is pool and PagedCache(model).pool is pool
    assert get_pool(tiny_model("llama")) is not pool


def test_pool_sized_by_max_memory(model):
    per_token = KVShape.from_model(model).bytes_per_token  # 2 * 2 layers * 2 heads * 16 dims * 4 bytes
    assert per_token == 512
    pool = get_pool(model, block_size=16, max_memory="1MiB")
    assert pool.num_blocks == 2**20 // (512 * 16)


def test_default_cpu_budget(model):
    pool = get_pool(model)
    assert pool.num_blocks == min(DEFAULT_CPU_KV_BYTES // (512 * 16), DEFAULT_MAX_BLOCKS) and pool.block_size == 16
    smollm2_shaped = KVShape(30, 3, 64, torch.float32)
    assert DEFAULT_CPU_KV_BYTES // (smollm2_shaped.bytes_per_token * 16) == 1456  # 23k tokens of SmolLM2 KV


def test_default_cuda_budget_is_a_fraction_of_free_device_memory(monkeypatch):
    """On CUDA the default pool takes `memory_fraction` (0.9) of the memory free when it is made, not of the total:
    the weights already loaded are not counted twice. The device's answer is simulated here (no GPU)."""
    from hf_paged.pool import _default_budget

    asked = []

    def mem_get_info(device):
        asked.append(device)
        return 6 * 2**30, 80 * 2**30  # (free, total) bytes, as torch.cuda.mem_get_info answers

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    cuda = torch.device("cuda", 1)
    assert _default_budget(cuda, PagedCacheConfig()) == (int(6 * 2**30 * 0.9), "90% of free CUDA memory")
    assert _default_budget(cuda, PagedCacheConfig(memory_fraction=0.5)) == (3 * 2**30, "50% of free CUDA memory")
    assert asked == [cuda, cuda]
    cpu_budget = _default_budget(torch.device("cpu"), PagedCacheConfig())
    assert cpu_budget == (DEFAULT_CPU_KV_BYTES, "1 GiB of KV on a CPU")


def test_idle_pool_is_rebuilt_for_new_options_but_busy_pool_is_not(model):
    first = get_pool(model, block_size=4, num_blocks=16)
    second = get_pool(model, block_size=8)
    assert second is not first and second.block_size == 8
    cache = PagedCache(model)
    with torch.no_grad():
        model(input_ids=torch.randint(3, 128, (1, 5)), past_key_values=cache)
    with pytest.raises(
        ValueError, match="has block_size=8, num_blocks=.* and 1 blocks in use; it cannot be rebuilt as block_size=2"
    ):
        get_pool(model, block_size=2)
    assert get_pool(model) is second
    cache.release()
    release_pool(model)
    assert get_pool(model) is not second


@pytest.mark.parametrize(
    "text, expected",
    [("512MiB", 512 * 2**20), ("2GB", 2 * 10**9), ("1.5 GiB", int(1.5 * 2**30)), ("4096", 4096), (77, 77)],
)
def test_parse_memory(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize(
    "value, error, message",
    [
        ("12 parsecs", ValueError, "max_memory='12 parsecs' is not a memory size"),
        ("-5MB", ValueError, "is not a memory size"),
        (0, ValueError, "max_memory must be > 0 bytes, got 0"),
        (1.5, TypeError, "max_memory must be an int \\(bytes\\) or a string"),
    ],
)
def test_parse_memory_refuses_nonsense(value, error, message):
    with pytest.raises(error, match=message):
        parse_memory(value)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"memory_fraction": 1.5}, "memory_fraction must be in \\(0, 1\\], got 1.5"),
        ({"attn_implementation": 3}, "attn_implementation must be a string, got 3"),
        ({"block_size": "16"}, "block_size must be a positive int or 'auto', got '16'"),
        ({"num_block": 4}, "unknown cache_config key\\(s\\) \\['num_block'\\]; hf_paged understands"),
    ],
)
def test_config_errors_name_the_value(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        PagedCacheConfig.from_dict(options)


def test_an_idle_pool_follows_the_models_dtype_and_a_busy_one_refuses_clearly():
    """`model.to(torch.bfloat16)` after paged calls: an idle pool drops its float32 tensors (and its prefix cache) so
    generate and an Engine built before keep working; with blocks in use the write names both dtypes."""
    model = tiny_model("llama")
    prompt = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(3))
    options = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    engine = hf_paged.Engine(model, block_size=4, num_blocks=64, exact=True)
    for dtype in (torch.float32, torch.bfloat16, torch.float32):
        model.to(dtype)
        expected = model.generate(prompt, **options)
        assert torch.equal(model.generate(prompt, **options, cache_implementation="paged"), expected)
        (output,) = engine.generate([prompt[0].tolist()], max_new_tokens=6, min_new_tokens=6)
        assert output.token_ids == expected[0, 20:].tolist()
        assert engine.pool.kv_shape.dtype == dtype and engine.pool.storage.keys[0].dtype == dtype
    held = PagedCache(model)
    model.generate(prompt, past_key_values=held, **options)
    model.to(torch.bfloat16)
    with pytest.raises(ValueError, match="holds .* of torch.float32 .* produced .* of torch.bfloat16"):
        model.generate(prompt, **options, cache_implementation="paged")
    held.release()
    engine.close()


# ---------------------------------------------------------------------- a request the whole pool cannot hold
def count_forwards(model) -> list:
    calls: list = []
    model.register_forward_pre_hook(lambda *args: calls.append(1))
    return calls


def test_a_request_the_engines_small_pool_cannot_hold_is_refused_before_any_forward(model):
    """`Engine(model, num_blocks=8)` sized the model's pool; a later plain paged `generate` of 1 x 8 + 200 tokens
    needs 13 blocks of 16: refused before the first forward (it used to fail after 128 decoded tokens), naming the
    size's origin and the way back to the default; after `release_pool` the same call runs and equals stock."""
    hf_paged.Engine(model, num_blocks=8, exact=True)
    forwards = count_forwards(model)
    prompt = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    options = {"max_new_tokens": 200, "min_new_tokens": 200, "do_sample": False, "pad_token_id": 0}
    with pytest.raises(hf_paged.PoolExhaustedError) as refused:
        model.generate(prompt, **options, cache_implementation="paged")
    assert isinstance(refused.value, hf_paged.RequestTooLargeError)
    message = str(refused.value)
    assert "may need 13 KV blocks of 16 tokens" in message and "whole pool has 8 blocks" in message
    assert "sized by Engine(num_blocks=8)" in message and "hf_paged.release_pool(model)" in message
    assert (refused.value.num_needed, refused.value.num_blocks) == (13, 8)
    assert forwards == []
    pool = get_pool(model)
    pool.check_invariants()
    assert pool.stats().num_used == 0
    release_pool(model)
    expected = model.generate(prompt, **options)
    forwards.clear()
    assert torch.equal(model.generate(prompt, **options, cache_implementation="paged"), expected)
    assert len(forwards) == 200


def test_a_continuation_the_caches_pool_cannot_hold_is_refused_before_any_forward_and_the_cache_goes_on(model):
    """Continuing the caller's `PagedCache` (6 blocks of 4) from 12 tokens by 30 needs 11 blocks: refused before
    the first forward (it used to run out mid-decode, leaving 24 tokens of a call whose output was lost in the
    cache), the cache as it was; it then continues by 4 tokens with stock's tokens."""
    cache = PagedCache(model, block_size=4, num_blocks=6)
    options = {"do_sample": False, "pad_token_id": 0}
    first = model.generate(torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=7, **options, past_key_values=cache)
    assert (first.shape[1], cache.get_seq_length()) == (12, 11)
    used = get_pool(model).stats().num_used
    forwards = count_forwards(model)
    with pytest.raises(hf_paged.RequestTooLargeError) as refused:
        model.generate(first, max_new_tokens=30, min_new_tokens=30, **options, past_key_values=cache)
    message = str(refused.value)
    assert "may need 11 KV blocks of 4 tokens" in message and "whole pool has 6 blocks" in message
    assert "sized by PagedCache(num_blocks=6)" in message and "hf_paged.PagedCache(model, num_blocks=11)" in message
    assert forwards == []
    get_pool(model).check_invariants()
    assert (cache.get_seq_length(), get_pool(model).stats().num_used) == (11, used)
    more = model.generate(first, max_new_tokens=4, min_new_tokens=4, **options, past_key_values=cache)
    assert torch.equal(more, model.generate(first, max_new_tokens=4, min_new_tokens=4, **options))
    cache.release()


def test_a_batch_an_earlier_calls_max_memory_cannot_hold_is_refused_at_once(model):
    """An earlier call's `max_memory` (4 blocks of 8 KiB here) sized the pool; 4 rows x 40 tokens need 12 blocks:
    refused before the prefill, naming that call; the exact size the message asks for runs."""
    small = {"max_new_tokens": 2, "do_sample": False, "pad_token_id": 0}
    model.generate(
        torch.tensor([[5, 6, 7]]), **small, cache_implementation="paged", cache_config={"max_memory": "32KiB"}
    )
    assert get_pool(model).num_blocks == 4
    forwards = count_forwards(model)
    prompts = torch.randint(3, 128, (4, 40), generator=torch.Generator().manual_seed(1))
    with pytest.raises(
        hf_paged.RequestTooLargeError, match=r"sized by generate\(cache_config=\{'max_memory': 32768\}\)"
    ):
        model.generate(prompts, **small, cache_implementation="paged")
    assert forwards == []
    out = model.generate(prompts, **small, cache_implementation="paged", cache_config={"num_blocks": 12})
    assert torch.equal(out, model.generate(prompts, **small))


def test_a_sizeless_call_on_an_idle_pool_sized_below_the_default_is_told_once(model, caplog):
    get_pool(model, num_blocks=64)  # get_pool itself sizes the pool on purpose: no word from it
    with caplog.at_level("WARNING", logger="hf_paged.pool"):
        get_pool(model)
        assert caplog.records == []
        model.generate(
            torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False, pad_token_id=0, cache_implementation="paged"
        )
        model.generate(
            torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False, pad_token_id=0, cache_implementation="paged"
        )
    (record,) = caplog.records
    text = record.getMessage()
    assert "generate names no pool size and runs on the model's idle KV pool of 64 blocks" in text
    assert "sized by get_pool(model, num_blocks=64)" in text and "hf_paged.release_pool(model)" in text
    assert get_pool(model).num_blocks == 64  # the size is kept: the call is told, not changed


def test_no_word_for_a_busy_pool_or_a_default_one(model, caplog):
    held = PagedCache(model, num_blocks=64)
    model.generate(torch.tensor([[5, 6, 7]]), past_key_values=held, max_new_tokens=2, do_sample=False, pad_token_id=0)
    with caplog.at_level("WARNING", logger="hf_paged.pool"):
        model.generate(
            torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=False, pad_token_id=0, cache_implementation="paged"
        )  # busy: other caches hold blocks
        held.release()
        release_pool(model)
        for _ in range(2):  # a pool of the default size
            model.generate(
                torch.tensor([[5, 6, 7]]),
                max_new_tokens=2,
                do_sample=False,
                pad_token_id=0,
                cache_implementation="paged",
            )
    assert caplog.records == []
    assert get_pool(model).sized_by.startswith("the default sizing (1 GiB of KV on a CPU")


def test_exhaustion_messages_name_the_size_origin_and_count_in_good_grammar(model):
    pool = get_pool(model, block_size=4, num_blocks=3)
    table = pool.allocator.new_table()
    pool.allocator.append(table, 8)
    with pytest.raises(hf_paged.PoolExhaustedError) as exhausted:
        pool.allocator.append(pool.allocator.new_table(), 8)
    assert "needs 2 more block(s) but only 1 is free" in str(exhausted.value)
    assert "The pool's size was set by get_pool(model, num_blocks=3)" in str(exhausted.value)
    pool.allocator.free(table)


CASES = st.fixed_dictionaries(
    {
        "family": st.sampled_from(["llama", "mistral", "gemma2"]),
        "lengths": st.lists(st.integers(1, 20), min_size=1, max_size=3),
        "mode": st.sampled_from(["greedy", "beams", "sample"]),
        "expand": st.integers(2, 3),
        "block_size": st.sampled_from([2, 4, 8]),
        "max_new_tokens": st.integers(1, 12),
        "seed": st.integers(0, 3),
    }
)
MODELS = {
    "llama": tiny_model("llama"),
    "mistral": tiny_model("mistral", sliding_window=6),
    "gemma2": tiny_model("gemma2"),
}


def run_in_pool(case: dict, num_blocks: int):
    """`generate` of `case` on a fresh pool of `num_blocks` blocks; returns the pool."""
    from tests.conftest import left_padded_batch

    model = MODELS[case["family"]]
    release_pool(model)
    input_ids, attention_mask = left_padded_batch(case["lengths"], seed=case["seed"])
    options = {"max_new_tokens": case["max_new_tokens"], "min_new_tokens": case["max_new_tokens"], "pad_token_id": 0}
    if case["mode"] == "beams":
        options |= {"num_beams": case["expand"], "num_return_sequences": case["expand"] - 1, "do_sample": False}
    elif case["mode"] == "sample":
        options |= {"num_return_sequences": case["expand"], "do_sample": True}
        torch.manual_seed(case["seed"])
    else:
        options |= {"do_sample": False}
    config = {"num_blocks": num_blocks, "block_size": case["block_size"]}
    model.generate(
        input_ids, attention_mask=attention_mask, **options, cache_implementation="paged", cache_config=config
    )
    return get_pool(model)


def blocks_needed(case: dict) -> int:
    try:
        run_in_pool(case, num_blocks=1)
    except hf_paged.RequestTooLargeError as refused:
        return refused.num_needed
    return 1


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=CASES)
def test_a_request_refused_up_front_would_not_fit_and_one_accepted_never_runs_out(case):
    """The refusal's count is the request's worst case: in a pool of exactly that many blocks the call runs to its
    end (beams, sampled sequences, padding, sliding groups, prefix caching on) and its peak stays within it."""
    needed = blocks_needed(case)
    pool = run_in_pool(case, num_blocks=needed)
    assert pool.stats().peak_used <= needed
    if needed > 1:
        with pytest.raises(hf_paged.RequestTooLargeError):
            run_in_pool(case, num_blocks=needed - 1)


def test_the_worst_case_check_fails_when_the_count_ignores_what_beams_write_negative_control(monkeypatch):
    """Counting only the prompt's blocks accepts a beam search the pool cannot hold: it runs out mid-decode."""
    from hf_paged.planner import ForwardPlanner

    def prompt_only(self, prompts, prefill_chunk=None):
        return sum(-(-prompt // self.pool.block_size) for prompt, _, _ in prompts)

    case = {
        "family": "llama",
        "lengths": [6],
        "mode": "beams",
        "expand": 3,
        "block_size": 4,
        "max_new_tokens": 12,
        "seed": 0,
    }
    monkeypatch.setattr(ForwardPlanner, "peak_blocks", prompt_only)
    needed = blocks_needed(case)
    with pytest.raises(hf_paged.PoolExhaustedError) as exhausted:
        run_in_pool(case, num_blocks=needed)
    assert not isinstance(exhausted.value, hf_paged.RequestTooLargeError)  # mid-decode, not up front
