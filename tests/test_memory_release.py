"""`hf_paged.release_pool(model)` gives the pool's memory back: with no live cache the pool and its K/V tensors are
garbage at once; a live cache keeps them until it is released or dropped; the next `generate` builds a fresh pool of
the default size. And benchmarks/memory_after_generate.py runs on a tiny model."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

import hf_paged
from hf_paged.config import DEFAULT_CPU_KV_BYTES, DEFAULT_MAX_BLOCKS
from hf_paged.pool import KVShape
from hf_paged.reference_models import tiny_model
from tests.benchmark_helpers import run_script

from .conftest import left_padded_batch

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "memory_after_generate.py"


@pytest.fixture
def model():
    return tiny_model("llama")


@pytest.fixture
def batch():
    input_ids, attention_mask = left_padded_batch([5, 9])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "pad_token_id": 0}


def paged_generate(model, batch, **options):
    options.setdefault("cache_config", {"block_size": 4})
    return model.generate(**batch, max_new_tokens=6, do_sample=False, cache_implementation="paged", **options)


def storage_refs(pool) -> list[weakref.ref]:
    """Weak references to every K/V tensor of the pool."""
    return [weakref.ref(t) for lanes in (pool.storage.keys, pool.storage.values) for t in lanes.values()]


def test_without_a_live_cache_the_pool_and_its_tensors_are_garbage(model, batch):
    paged_generate(model, batch)
    pool = hf_paged.get_pool(model)
    pool_ref, tensors = weakref.ref(pool), storage_refs(pool)
    assert tensors and pool.stats().num_used == 0
    del pool
    hf_paged.release_pool(model)
    gc.collect()
    assert pool_ref() is None
    assert all(tensor() is None for tensor in tensors)
    assert all(live is not pool_ref() for live in hf_paged.live_pools())


@pytest.mark.parametrize("end", ["release", "drop"])
def test_a_live_cache_keeps_the_pool_until_it_is_released_or_dropped(model, batch, end):
    out = paged_generate(model, batch, return_dict_in_generate=True)
    cache = out.past_key_values
    pool = hf_paged.get_pool(model)
    pool_ref, tensors, used = weakref.ref(pool), storage_refs(pool), pool.stats().num_used
    del pool
    hf_paged.release_pool(model)
    gc.collect()
    assert used > 0 and pool_ref() is not None and pool_ref().stats().num_used == used
    assert hf_paged.get_pool(model) is not pool_ref()  # the model already has a new pool
    if end == "release":
        cache.release()
        assert pool_ref().stats().num_used == 0
    del out, cache
    gc.collect()
    assert pool_ref() is None
    assert all(tensor() is None for tensor in tensors)


def test_generate_after_release_pool_builds_a_fresh_default_pool(model, batch):
    first = paged_generate(model, batch, cache_config={"block_size": 16, "num_blocks": 8})
    small = weakref.ref(hf_paged.get_pool(model))
    assert small().num_blocks == 8
    hf_paged.release_pool(model)
    again = paged_generate(model, batch, cache_config={"block_size": 16})
    gc.collect()
    pool = hf_paged.get_pool(model)
    default_blocks = min(DEFAULT_CPU_KV_BYTES // (KVShape.from_model(model).bytes_per_token * 16), DEFAULT_MAX_BLOCKS)
    assert small() is None and pool.num_blocks == default_blocks
    assert pool.stats().peak_used == 2  # served only this call: a block per row (at most 9 + 6 tokens)
    assert torch.equal(first, again)


def table_cell(stdout: str, header: str, mode: str) -> str:
    """The cell of column `header` in the row of `mode` of the first markdown table of `stdout`."""
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in stdout.splitlines() if line.startswith("| ")]
    column = rows[0].index(header)
    return next(row[column] for row in rows[1:] if row[1] == mode)


def test_benchmark_script_on_a_tiny_model():
    result = run_script(SCRIPT, "--model", "tiny", "--modes", "paged", "--calls", "2", "--threads", "1")
    assert result.returncode == 0, result.stderr
    assert "pool objects garbage after release_pool + gc: yes" in result.stdout
    mode = "paged, default CPU sizing"
    kept = float(table_cell(result.stdout, "after generate 2", mode))
    released = float(table_cell(result.stdout, "after release + gc", mode))
    assert released <= kept
    assert table_cell(result.stdout, "pool tensors resident, MiB of reserved", mode).endswith(" of 512")
