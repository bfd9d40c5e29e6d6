"""Global pool: sizing from cache_config, reuse, rebuild, and configuration errors."""

from __future__ import annotations

import pytest
import torch

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
    assert cpu_budget == (DEFAULT_CPU_KV_BYTES, "the default CPU KV budget")


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
    engine = hf_paged.Engine(model, block_size=4, num_blocks=64)
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
