"""Tensor-parallel paged generation on CPU: two ranks (gloo) of models loaded with `tp_plan="auto"`.

One 2-rank job per module (`distributed_helpers.run_ranks`: spawned processes, a free port, a deadline, every rank
killed on failure) runs every scenario on both ranks. After every forward each rank records its rows' block tables,
the refcounts of their blocks, the free queue and the allocator's stats; rank 0 gathers every rank's records with
`all_gather_object`. The tests compare them across ranks, compare the tokens with single-process `DynamicCache`
generation, and check the per-rank pool sizing.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import hf_paged
from hf_paged.pool import BlockPool, KVShape
from hf_paged.reference_models import tiny_model
from tests.conftest import left_padded_batch
from tests.distributed_helpers import JOB_TIMEOUT_S, fail_on_rank_1, gloo_available, run_ranks
from tests.quant_helpers import generate_round_trip, generate_staged_round_trip

pytestmark = pytest.mark.skipif(not gloo_available(), reason="needs torch.distributed with the gloo backend")

WORLD_SIZE = 2
MAX_MEMORY = 128 * 1024  # bytes of KV per process: 32 blocks of 4 tokens for the 4-KV-head Llama in one process
CACHE_CONFIG = {"block_size": 4, "max_memory": MAX_MEMORY}

# family -> tiny_model options; Llama: 4 attention heads, 4 KV heads (2 per rank); Qwen2: 4 heads, 2 KV heads (1)
FAMILIES = {"llama": {"num_key_value_heads": 4}, "qwen2": {}}
QUANTIZED = ("int8", "int4", "int4-channel")  # quantized pages, run on the Llama's greedy scenario
# a model whose 3 KV heads 2 ranks cannot split
UNEVEN = ("llama", {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3})


def scenarios() -> dict[str, list[tuple[int, dict]]]:
    """name -> the `generate` calls it makes, in order, each `(seed, kwargs)`; the same on every rank and in the
    single-process reference."""
    input_ids, attention_mask = left_padded_batch([5, 11], seed=3)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 8}
    prompt = left_padded_batch([13], seed=4)[0]
    shared = torch.cat([prompt[:, :9], left_padded_batch([4], seed=5)[0]], dim=1)  # 9 tokens of `prompt`, then new
    return {
        "greedy": [(0, {**batch, "do_sample": False})],
        "sampling": [(7, {**batch, "do_sample": True, "num_return_sequences": 2})],
        "beams": [(0, {**batch, "max_new_tokens": 6, "num_beams": 4, "num_return_sequences": 2})],
        "prefix_reuse": [
            (0, {"input_ids": prompt, "max_new_tokens": 4, "do_sample": False}),
            (0, {"input_ids": shared, "max_new_tokens": 4, "do_sample": False}),
        ],
    }


def reference_outputs(model) -> dict[str, list[torch.Tensor]]:
    """Every scenario's output token ids in one process with `DynamicCache`."""
    outputs = {}
    for name, calls in scenarios().items():
        outputs[name] = []
        for seed, kwargs in calls:
            torch.manual_seed(seed)
            outputs[name].append(model.generate(**kwargs, pad_token_id=0))
    return outputs


# ---------------------------------------------------------------------------------------------- in every rank
def snapshot(pool, cache) -> dict:
    """What must be identical on every rank after a forward: tables, refcounts, free queue, allocator stats."""
    allocator = pool.allocator
    tables = [tuple(table.block_ids) for table in cache.row_tables]
    live = sorted({block_id for table in tables for block_id in table if block_id is not None})
    return {
        "tables": tables,
        "ref_counts": {block_id: allocator.ref_count(block_id) for block_id in live},
        "free_queue": allocator.free_block_ids,
        "allocator": allocator.stats(),
    }


def rank_work(rank: int, folders: dict[str, str], uneven_folder: str) -> list[dict]:
    """Load every model with `tp_plan="auto"`, run every scenario paged, recording a snapshot after each forward;
    every rank's results, gathered."""
    from transformers import AutoModelForCausalLM

    def load(folder):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers 5.23 prefers DistributedConfig(tp_plan=)
            return AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto").eval()

    results = {}
    for family, folder in folders.items():
        model = load(folder)
        pool = hf_paged.get_pool(model, **CACHE_CONFIG)
        steps: list[dict] = []

        def record(module, args, kwargs, output, pool=pool, steps=steps):
            cache = kwargs.get("past_key_values")
            if isinstance(cache, hf_paged.PagedCache):
                steps.append(snapshot(pool, cache))

        model.register_forward_hook(record, with_kwargs=True)
        per_call = []
        outputs = {}
        for name, calls in scenarios().items():
            outputs[name] = []
            for seed, kwargs in calls:
                steps.clear()
                torch.manual_seed(seed)
                out = model.generate(**kwargs, cache_implementation="paged", cache_config=CACHE_CONFIG, pad_token_id=0)
                outputs[name].append(out)
                per_call.append((name, list(steps), pool.stats(), pool.last_cache_stats))
        pool.check_invariants()
        results[family] = {
            "tp": (pool.tp_rank, pool.tp_world_size, pool.kv_heads_local, pool.num_blocks),
            "kv_shape": pool.kv_shape,
            "outputs": outputs,
            "calls": per_call,
            "final": pool.stats(),
        }
    model, greedy = load(folders["llama"]), scenarios()["greedy"][0][1]
    results["quantized"] = {  # each KV head's vector is quantized on its own: the split changes nothing
        kv_dtype: model.generate(
            **greedy, cache_implementation="paged", cache_config={**CACHE_CONFIG, "kv_dtype": kv_dtype}, pad_token_id=0
        )
        for kv_dtype in QUANTIZED
    }
    try:
        hf_paged.get_pool(load(uneven_folder))
        results["uneven_error"] = None
    except ValueError as error:
        results["uneven_error"] = str(error)
    gathered: list = [None] * WORLD_SIZE
    dist.all_gather_object(gathered, results)
    return gathered


# ---------------------------------------------------------------------------------------------- in the test process
@pytest.fixture(scope="module")
def tp_job(tmp_path_factory):
    """`(folders, per-rank results, single-process DynamicCache outputs, seconds the job took)`."""
    root = tmp_path_factory.mktemp("tp")
    folders = {}
    for family, options in FAMILIES.items():
        folders[family] = str(root / family)
        tiny_model(family, **options).save_pretrained(folders[family])
    uneven_folder = str(root / "uneven")
    tiny_model(UNEVEN[0], **UNEVEN[1]).save_pretrained(uneven_folder)
    started = time.monotonic()
    ranks = run_ranks(rank_work, (folders, uneven_folder), root, WORLD_SIZE)
    seconds = time.monotonic() - started
    references = {family: reference_outputs(load_single(folder)) for family, folder in folders.items()}
    return folders, ranks, references, seconds


def load_single(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_quantized_pages_match_one_process_over_the_same_quantized_values(tp_job, kv_dtype):
    folders, ranks, _, _ = tp_job
    greedy = dict(scenarios()["greedy"][0][1])
    model = load_single(folders["llama"])
    input_ids = greedy.pop("input_ids")
    if kv_dtype == "int4-channel":  # keys per channel of each KV head over a block: the split changes nothing either
        expected = generate_staged_round_trip(model, input_ids, CACHE_CONFIG["block_size"], **greedy, pad_token_id=0)
    else:
        expected = generate_round_trip(model, kv_dtype, input_ids, **greedy, pad_token_id=0)
    for results in ranks:
        assert torch.equal(results["quantized"][kv_dtype], expected)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scenario", list(scenarios()))
def test_tokens_match_single_process_dynamic_cache(tp_job, family, scenario):
    _, ranks, references, _ = tp_job
    for rank, results in enumerate(ranks):
        for call, (paged, reference) in enumerate(
            zip(results[family]["outputs"][scenario], references[family][scenario])
        ):
            assert torch.equal(paged, reference), f"{family} {scenario} call {call}, rank {rank}:\n{paged}\n{reference}"


@pytest.mark.parametrize("family", FAMILIES)
def test_tables_refcounts_and_stats_identical_on_every_rank_after_every_step(tp_job, family):
    _, ranks, _, _ = tp_job
    calls = [results[family]["calls"] for results in ranks]
    assert all(len(steps) > 0 for _, steps, _, _ in calls[0])
    for rank in range(1, WORLD_SIZE):
        assert len(calls[rank]) == len(calls[0])
        for (name, steps, stats, cache_stats), (_, steps0, stats0, cache_stats0) in zip(calls[rank], calls[0]):
            assert len(steps) == len(steps0), f"{family} {name}: rank {rank} ran {len(steps)} forwards"
            for index, (step, step0) in enumerate(zip(steps, steps0)):
                assert step == step0, f"{family} {name}, forward {index}: rank {rank} differs from rank 0"
            assert dataclasses.replace(stats, tp_rank=0) == stats0
            assert cache_stats == cache_stats0


@pytest.mark.parametrize("family", FAMILIES)
def test_scenarios_sample_share_beam_blocks_and_reuse_prefixes(tp_job, family):
    _, ranks, _, _ = tp_job
    for results in ranks:
        by_name = {}
        for name, steps, _, cache_stats in results[family]["calls"]:
            by_name.setdefault(name, []).append((steps, cache_stats))
        sampled = results[family]["outputs"]["sampling"][0]
        assert not torch.equal(sampled[0], sampled[1])  # two samples of one prompt: really sampled
        assert by_name["prefix_reuse"][1][1].prefix_tokens_reused == 8  # the 2 full blocks of the shared 9 tokens
        beam_steps = by_name["beams"][0][0]
        assert any(count > 1 for step in beam_steps for count in step["ref_counts"].values())
        assert results[family]["final"].num_used == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_gets_twice_the_blocks_of_one_process(tp_job, family):
    folders, ranks, _, _ = tp_job
    model = load_single(folders[family])
    single = hf_paged.get_pool(model, **CACHE_CONFIG)
    kv_heads = model.config.num_key_value_heads
    assert (single.tp_rank, single.tp_world_size, single.kv_heads_local) == (0, 1, kv_heads)
    for rank, results in enumerate(ranks):
        tp_rank, tp_world_size, kv_heads_local, num_blocks = results[family]["tp"]
        assert (tp_rank, tp_world_size, kv_heads_local) == (rank, WORLD_SIZE, kv_heads // WORLD_SIZE)
        assert num_blocks == WORLD_SIZE * single.num_blocks
        assert results[family]["kv_shape"].bytes_per_token * WORLD_SIZE == single.kv_shape.bytes_per_token
        final = results[family]["final"]
        assert (final.tp_rank, final.tp_world_size, final.kv_heads_local) == (rank, WORLD_SIZE, kv_heads_local)


def test_a_degree_that_does_not_divide_the_kv_heads_is_refused(tp_job):
    _, ranks, _, _ = tp_job
    for results in ranks:
        assert results["uneven_error"] is not None
        assert "tp_size=2" in results["uneven_error"] and "3 KV heads" in results["uneven_error"]


def test_the_job_is_quick(tp_job):
    assert tp_job[3] < JOB_TIMEOUT_S / 4, f"the {WORLD_SIZE}-rank job took {tp_job[3]:.0f} s"


def test_a_single_process_pool_reports_rank_0_of_1(llama):
    pool = BlockPool(8, 4, KVShape.from_model(llama))
    stats = pool.stats()
    assert isinstance(stats, hf_paged.AllocatorStats)
    assert (stats.tp_rank, stats.tp_world_size, stats.kv_heads_local) == (0, 1, 2)
    assert (pool.tp_rank, pool.tp_world_size, pool.kv_heads_local) == (0, 1, 2)


def test_a_failing_rank_stops_the_job_with_its_traceback_and_no_rank_left(tmp_path):
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="(?s)exit codes.*rank 1 fails on purpose"):
        run_ranks(fail_on_rank_1, (), tmp_path, WORLD_SIZE, timeout_s=60)
    assert time.monotonic() - started < 30  # rank 0 was killed, not left to its collective's 60 s timeout
    assert multiprocessing.active_children() == []
