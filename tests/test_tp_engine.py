"""`DistributedEngine` on 2 gloo ranks of a tiny Llama with 4 KV heads loaded with `tp_plan="auto"` on CPU.

One 2-rank job (`distributed_helpers.run_ranks`) runs a mixed batch of requests (greedy and sampled, seeded and not,
a shared prefix, an abort, stop at `max_new_tokens=0`) through rank 0's `DistributedEngine` while rank 1 follows.
Every rank records, after each of its engine's steps, the tokens every request got and its allocator's stats; the
records are gathered and compared here, and rank 0's greedy outputs are compared with a single-process `Engine`.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import hf_paged
from hf_paged.engine.distributed import DistributedEngine
from hf_paged.reference_models import tiny_model
from tests.distributed_helpers import JOB_TIMEOUT_S, gloo_available, run_ranks

pytestmark = pytest.mark.skipif(not gloo_available(), reason="needs torch.distributed with the gloo backend")

WORLD_SIZE = 2
NUM_REQUESTS = 64
ENGINE_OPTIONS = {"block_size": 4, "num_blocks": 160, "max_batch_size": 24, "max_prefill_tokens": 256, "exact": True}


def requests() -> list[tuple[list[int], dict]]:
    """`(prompt ids, add_request options)` of the mixed batch: a third sampled (half of them without a seed, which
    rank 0 draws), prompts of 2 to 40 tokens, a quarter sharing a 12-token prefix, 0 to 12 new tokens."""
    rng = random.Random(17)
    shared = [rng.randrange(3, 128) for _ in range(12)]
    batch = []
    for index in range(NUM_REQUESTS):
        prompt = [rng.randrange(3, 128) for _ in range(rng.randrange(2, 41))]
        if index % 4 == 0:
            prompt = shared + prompt[:8]
        options = {"max_new_tokens": 0 if index % 32 == 5 else rng.randrange(1, 13)}
        if index % 3 == 1:
            options.update(do_sample=True, temperature=0.8, top_p=0.9)
            if index % 2:
                options["seed"] = index
        batch.append((prompt, options))
    return batch


def load(folder: str, tp: bool):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5.23 prefers DistributedConfig(tp_plan=)
        options = {"tp_plan": "auto"} if tp else {}
        return AutoModelForCausalLM.from_pretrained(folder, **options).eval()


# ---------------------------------------------------------------------------------------------- in every rank
def rank_work(rank: int, folder: str) -> list[dict]:
    engine = hf_paged.Engine(load(folder, tp=True), progress=False, **ENGINE_OPTIONS)
    steps: list[tuple] = []
    step = engine.step

    def recording_step():
        outputs = step()
        digest = [(o.request_id, tuple(o.new_token_ids), o.finish_reason) for o in outputs]
        steps.append((digest, dataclasses.replace(engine.pool.stats(), tp_rank=0)))
        return outputs

    engine.step = recording_step  # every rank's own record of every step
    distributed = DistributedEngine(engine, timeout_s=30)
    result: dict = {"rank": rank}
    if rank == 0:
        batch = requests()
        ids = [distributed.add_request(prompt, **options) for prompt, options in batch]
        aborted = distributed.add_request(batch[0][0], max_new_tokens=50)
        outputs = {}
        while len(outputs) < len(ids) + 1:
            for output in distributed.step():
                if output.finished:
                    outputs[output.request_id] = output
            if distributed.engine.num_steps == 3 and aborted not in outputs:
                outputs[aborted] = distributed.abort(aborted)
        result["outputs"] = [outputs[i] for i in ids]
        result["aborted"] = outputs[aborted]
        result["streamed"] = [o.new_token_ids for o in distributed.stream([[5, 6, 7]], max_new_tokens=3)]
        abandoned = distributed.stream([[8, 9, 10]], max_new_tokens=20)
        next(abandoned)
        abandoned.close()  # aborts the request; the followers replay the abort with the next step
        assert distributed.step()[0].finish_reason == "abort"
        result["interleaved"] = interleaved_streams(distributed)
        padded = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])  # without a mask: the pads (id 0) are not prompt tokens
        result["padded"] = [o.prompt_token_ids for o in distributed.generate(padded, max_new_tokens=1)]
        result["rank_states"] = distributed.rank_states  # as of that step
        distributed.close()
    else:
        distributed.follow()
    result["steps"] = steps
    result["final"] = engine.pool.stats()
    engine.pool.check_invariants()
    gathered: list = [None] * WORLD_SIZE
    dist.all_gather_object(gathered, result)
    return gathered


INTERLEAVED = ([[5, 6, 7], [11, 12, 13, 14]], 3), ([[20, 21], [30, 31, 32]], 6)  # (prompts, max_new_tokens)


def interleaved_streams(engine) -> tuple[dict, dict]:
    """`(pieces, finals)` by request id of two streams read in turn by one thread (`zip_longest`)."""
    streams = [engine.stream(prompts, max_new_tokens=new) for prompts, new in INTERLEAVED]
    pieces: dict[str, list[int]] = {}
    finals: dict[str, list[int]] = {}
    for pair in itertools.zip_longest(*streams):
        for output in filter(None, pair):
            pieces.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finished:
                finals[output.request_id] = output.token_ids
    return pieces, finals


# ---------------------------------------------------------------------------------------------- in the test process
@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_engine")
    folder = str(root / "llama")
    tiny_model("llama", num_key_value_heads=4).save_pretrained(folder)
    started = time.monotonic()
    ranks = run_ranks(rank_work, (folder,), root, WORLD_SIZE)
    return folder, ranks, time.monotonic() - started


def test_greedy_outputs_match_the_single_process_engine(job):
    folder, ranks, _ = job
    batch = requests()
    engine = hf_paged.Engine(load(folder, tp=False), progress=False, **ENGINE_OPTIONS)
    greedy = [i for i, (_, options) in enumerate(batch) if not options.get("do_sample")]
    assert len(greedy) > NUM_REQUESTS // 2
    ids = [engine.add_request(batch[i][0], **batch[i][1]) for i in greedy]
    expected = {}
    while engine.has_unfinished_requests():
        expected.update((o.request_id, o) for o in engine.step() if o.finished)
    for index, reference in zip(greedy, (expected[i] for i in ids)):
        output = ranks[0]["outputs"][index]
        assert output.token_ids == reference.token_ids, f"request {index}"
        assert output.finish_reason == reference.finish_reason
    lengths = {len(o.token_ids) for o in ranks[0]["outputs"]}
    assert 0 in lengths and len(lengths) > 5  # a mixed batch, max_new_tokens=0 included


def test_two_streams_read_in_turn_each_get_every_piece(job):
    """Rank 0 routes each step's outputs to the stream whose requests they are, whoever stepped (each stream used to
    drop the other's pieces, and could wait forever for a final output the other had dropped)."""
    folder, ranks, _ = job
    pieces, finals = ranks[0]["interleaved"]
    assert len(finals) == 4 and all(pieces[i] == finals[i] for i in finals)
    engine = hf_paged.Engine(load(folder, tp=False), progress=False, **ENGINE_OPTIONS)
    expected = [o.token_ids for prompts, new in INTERLEAVED for o in engine.generate(prompts, max_new_tokens=new)]
    assert sorted(finals.values()) == sorted(expected)


def test_a_padded_tensor_of_prompts_loses_its_pads_as_in_the_engine(job):
    _, ranks, _ = job
    assert ranks[0]["padded"] == [[5, 6], [7, 8, 9, 10]]


def test_every_step_gives_the_same_tokens_and_allocator_stats_on_every_rank(job):
    _, ranks, _ = job
    steps0 = ranks[0]["steps"]
    assert len(steps0) > 10
    for rank in range(1, WORLD_SIZE):
        assert len(ranks[rank]["steps"]) == len(steps0)
        for index, (step, step0) in enumerate(zip(ranks[rank]["steps"], steps0)):
            assert step == step0, f"step {index}: rank {rank} differs from rank 0"
    sampled = [o for o, (_, options) in zip(ranks[0]["outputs"], requests()) if options.get("do_sample")]
    assert len(sampled) > 10 and all(o.token_ids or o.finish_reason == "length" for o in sampled)


def test_the_abort_reaches_every_rank_and_every_pool_is_empty_after(job):
    _, ranks, _ = job
    assert ranks[0]["aborted"].finish_reason == "abort"
    for rank, result in enumerate(ranks):
        final = result["final"]
        assert final.num_used == 0 and final.num_tables == 0, f"rank {rank}: {final}"
        assert (final.tp_rank, final.tp_world_size, final.kv_heads_local) == (rank, WORLD_SIZE, 2)
    states = ranks[0]["rank_states"]
    assert [s.rank for s in states] == list(range(WORLD_SIZE))
    assert all(s.kv_bytes_total > 0 and s.kv_bytes_used == 0 for s in states)


def test_the_prefix_cache_is_shared_the_same_way_on_every_rank(job):
    _, ranks, _ = job
    reused = [o.prefix_tokens_reused for o in ranks[0]["outputs"]]
    assert sum(reused) > 0
    assert ranks[0]["steps"][-1][1].prefix_tokens_reused == ranks[1]["steps"][-1][1].prefix_tokens_reused


def test_the_job_is_quick(job):
    assert job[2] < JOB_TIMEOUT_S / 3, f"the {WORLD_SIZE}-rank engine job took {job[2]:.0f} s"


def test_a_distributed_engine_needs_a_process_group(llama):
    with pytest.raises(RuntimeError, match="torch.distributed initialized"):
        DistributedEngine(hf_paged.Engine(llama, block_size=4, num_blocks=8, exact=True))


def test_a_model_that_is_not_split_over_the_group_is_refused(tmp_path):
    from tests.distributed_helpers import run_ranks as run

    with pytest.raises(RuntimeError, match=r"tp_world_size=1 rank\(s\) but the process group has 2"):
        run(unsplit_work, (), tmp_path, WORLD_SIZE, timeout_s=60)


def unsplit_work(rank: int) -> None:
    DistributedEngine(hf_paged.Engine(tiny_model("llama"), block_size=4, num_blocks=8, exact=True))


def test_stream_yields_each_token_and_closing_it_early_frees_every_rank(job):
    _, ranks, _ = job
    assert ranks[0]["streamed"] == [[token] for token in sum(ranks[0]["streamed"], [])]
    assert len(ranks[0]["streamed"]) == 3
    assert all(result["final"].num_used == 0 for result in ranks)
