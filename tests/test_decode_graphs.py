"""Decode graphs (`hf_paged.engine.decode_graphs`): decode steps replayed over static buffers padded to captured
batch sizes. Without a GPU the buffer logic is proven by eager replay (`capture="eager"`: the same buffers, the same
function, nothing recorded): the tokens of the exact Engine, pad rows that store only in the graphs' scratch block,
the scratch block returned on close. The CUDA capture itself runs under `pytest -m gpu`."""

from __future__ import annotations

import random

import pytest
import torch

import hf_paged
import hf_paged.engine.step_runner as step_runner
from hf_paged.engine.decode_graphs import DecodeGraphs
from hf_paged.reference_models import tiny_model

SIZES = (1, 2, 4)  # graphs of 1, 2 and 4 rows: steps of 3 rows pad by one, steps of 5+ rows run without a graph


def prompts(count: int, seed: int = 0, longest: int = 20) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(3, 120) for _ in range(rng.randint(1, longest))] for _ in range(count)]


def engine_for(model, **options):
    hf_paged.release_pool(model)
    return hf_paged.Engine(model, block_size=4, num_blocks=256, max_batch_size=6, max_num_batched_tokens=24, **options)


def tokens_of(engine, batch, max_new_tokens=None):
    """Greedy tokens of `batch`; by default request `i` asks for `3 + 5 * i % 14` tokens (steps of every size)."""
    lengths = [max_new_tokens or 3 + 5 * index % 14 for index in range(len(batch))]
    outputs = engine.generate(batch, [hf_paged.SamplingParams(max_new_tokens=length) for length in lengths])
    engine.pool.check_invariants()
    return [o.token_ids for o in outputs]


@pytest.fixture
def backend(monkeypatch):
    monkeypatch.setattr(step_runner, "COMPILE_BACKEND", "aot_eager")


@pytest.mark.parametrize("family", ["llama", "gemma2", "starcoder2"])
def test_eager_replayed_graphs_give_the_exact_engines_tokens(family):
    # gemma2: full and sliding layer groups (two tables per row); starcoder2: every layer sliding (window 6)
    model = tiny_model(family)
    batch = prompts(9)
    expected = tokens_of(engine_for(model, exact=True), batch)
    engine = engine_for(model, compile=False)
    engine.runner.capture_decode_graphs(SIZES, capture="eager")
    assert tokens_of(engine, batch) == expected
    graphs = engine.runner.decode_graphs
    assert graphs.sizes == SIZES and set(graphs.replays_by_size) <= set(SIZES)
    assert sum(graphs.replays_by_size.values()) > 10 and len(graphs.replays_by_size) >= 2
    assert engine.runner.eager_steps > 0  # steps of 5-6 rows and prompt steps: no graph


@pytest.mark.parametrize("compile", [False, True])
def test_eager_replayed_graphs_over_quantized_pages_give_the_engines_tokens(compile, backend):
    # pad rows store quantized codes and scales in the scratch block; compiled: the quantized ops inside the graph
    model = tiny_model("llama")
    batch = prompts(9, seed=6)
    expected = tokens_of(engine_for(model, compile=compile, kv_dtype="int8"), batch)
    engine = engine_for(model, compile=compile, kv_dtype="int8")
    engine.runner.capture_decode_graphs(SIZES, capture="eager")
    assert tokens_of(engine, batch) == expected
    assert sum(engine.runner.decode_graphs.replays_by_size.values()) > 10


def _differs(now: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """Per block, whether any bit changed (blocks never written hold what `torch.empty` gave: NaNs among them)."""
    return (now.view(torch.int32) != before.view(torch.int32)).flatten(1).any(1)


def test_pad_rows_store_in_the_scratch_block_and_close_returns_it():
    model = tiny_model("llama")
    engine = engine_for(model, compile=False)
    engine.runner.capture_decode_graphs(SIZES, capture="eager")
    tokens_of(engine, prompts(3))  # decode steps of 3 rows: one pad row each, graphs captured
    graphs = engine.runner.decode_graphs
    storage, scratch = engine.pool.storage, graphs.scratch_block
    for layer in range(model.config.num_hidden_layers):
        for tensor in storage.layer_tensors(layer):
            tensor[scratch].fill_(7.0)  # the pad rows store the same K/V every step: overwrite them to see them stored
    before = [tuple(t.clone() for t in storage.layer_tensors(layer)) for layer in range(model.config.num_hidden_layers)]
    engine.pool.check_invariants()
    assert engine.pool.stats().num_used == 1 and engine.pool.allocator.ref_count(scratch) == 1
    batch = prompts(3, seed=5)
    tokens_of(engine, batch, max_new_tokens=6)  # new rows in freed blocks, pad rows beside them
    stored = sum(-(-(len(prompt) + 5) // 4) for prompt in batch)  # the blocks the rows' tokens fill
    for layer, (keys, values) in enumerate(before):
        now_keys, now_values = storage.layer_tensors(layer)
        changed = _differs(now_keys, keys) | _differs(now_values, values)
        assert changed[scratch] and int(changed.sum()) <= stored + 1  # the rows' blocks and the pad rows' one
    engine.close()
    assert engine.pool.stats().num_used == 0 and engine.runner.decode_graphs is None


def test_pad_rows_writing_into_a_live_block_would_be_caught(monkeypatch):
    # negative control: pad rows that stored in the first row's first slot (its first prompt token) change its tokens
    from hf_paged.engine import decode_graphs

    fill = decode_graphs._Buffers.fill

    def faulty_fill(self, input_ids, position_ids, tensors):
        fill(self, input_ids, position_ids, tensors)
        rows, block_size = input_ids.shape[1], tensors.kv[0][0].shape[1]
        for slots, table in zip(self.slots, tensors.block_tables):
            slots[rows:] = int(table[0, 0]) * block_size

    model = tiny_model("llama")
    batch = prompts(3, seed=2)
    expected = tokens_of(engine_for(model, exact=True), batch)
    engine = engine_for(model, compile=False)
    engine.runner.capture_decode_graphs((4,), capture="eager")
    monkeypatch.setattr(decode_graphs._Buffers, "fill", faulty_fill)
    assert tokens_of(engine, batch) != expected
    assert engine.runner.decode_graphs.replays_by_size[4] > 0


def test_compiled_forward_replayed_from_graphs_gives_the_compiled_engines_tokens_without_recompiling(backend):
    torch._dynamo.utils.counters.clear()
    model = tiny_model("llama")
    batch = prompts(12, seed=3)
    expected = tokens_of(engine_for(model, compile=True), batch)
    engine = engine_for(model, compile=True)
    engine.runner.capture_decode_graphs(SIZES, capture="eager")
    assert tokens_of(engine, batch) == expected
    runner = engine.runner
    assert sum(runner.decode_graphs.replays_by_size.values()) > 10
    assert runner.graphs == 1 and runner.disabled is None  # the buffers of every size: the one graph
    assert runner.compiled_steps == runner.num_steps - 1


def test_graphs_are_captured_again_after_the_weights_change():
    model = tiny_model("llama")
    batch = prompts(3, seed=4)
    engine = engine_for(model, compile=False, prefix_caching=True)
    engine.runner.capture_decode_graphs(SIZES, capture="eager")
    tokens_of(engine, batch)
    first = engine.runner.decode_graphs
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)
    after = tokens_of(engine, batch)
    assert engine.runner.decode_graphs is not first and engine.pool.stats().num_used == 1
    assert after == tokens_of(engine_for(model, exact=True), batch)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"cuda_graphs": "yes"}, "cuda_graphs must be True, False or 'auto', got 'yes'"),
        ({"cuda_graphs": True}, "cuda_graphs=True needs a model on a CUDA device; this one is on cpu"),
        ({"cuda_graphs": True, "exact": True}, "exact=True runs the eager steps"),
    ],
)
def test_the_cuda_graphs_option_is_checked_before_anything_is_built(options, message):
    model = tiny_model("llama")
    hf_paged.release_pool(model)
    earlier = {id(pool) for pool in hf_paged.live_pools()}  # other tests' pools (run in any order) may still live
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        hf_paged.Engine(model, block_size=4, num_blocks=64, **options)
    assert not [pool for pool in hf_paged.live_pools() if id(pool) not in earlier]


def test_auto_captures_no_graphs_on_the_cpu():
    engine = engine_for(tiny_model("llama"), compile=False)
    tokens_of(engine, prompts(2))
    assert engine.runner.decode_graphs is None and engine.pool.stats().num_used == 0


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"sizes": ()}, "decode graph sizes must be positive ints, got ()"),
        ({"sizes": (0, 4)}, "decode graph sizes must be positive ints, got (0, 4)"),
        ({"capture": "cpu"}, "capture must be one of ('cuda', 'eager'), got 'cpu'"),
        ({"width": 0}, "the decode graphs' table width must be a positive int, got 0"),
    ],
)
def test_decode_graph_arguments_are_checked_before_a_block_is_taken(arguments, message):
    engine = engine_for(tiny_model("llama"), compile=False)
    tokens_of(engine, prompts(1), max_new_tokens=1)
    options = {"sizes": SIZES, "capture": "eager", "width": 8, **arguments}
    with pytest.raises(ValueError) as raised:
        DecodeGraphs(lambda *args: None, engine.cache, **options)
    assert str(raised.value) == message
    assert engine.pool.stats().num_used == 0


def test_cuda_capture_of_a_cpu_model_is_refused():
    engine = engine_for(tiny_model("llama"), compile=False)
    with pytest.raises(ValueError, match="CUDA graphs need a model on a CUDA device; this one is on cpu"):
        engine.runner.capture_decode_graphs(SIZES)


@pytest.mark.gpu
def test_cuda_graphs_give_the_eager_step_tokens_on_a_gpu():
    model = tiny_model("llama").to("cuda")
    batch = prompts(9)
    expected = tokens_of(engine_for(model, exact=True), batch)
    engine = engine_for(model, compile=False, cuda_graphs=True)
    assert tokens_of(engine, batch) == expected
    graphs = engine.runner.decode_graphs
    assert graphs.capture == "cuda" and sum(graphs.replays_by_size.values()) > 10


def test_stats_and_metrics_count_the_replays():
    from hf_paged.serve.metrics import MetricsSnapshot, render_metrics

    engine = engine_for(tiny_model("llama"), compile=False)
    engine.runner.capture_decode_graphs(SIZES, capture="eager")
    tokens_of(engine, prompts(3))
    graphs, runner = engine.runner.decode_graphs, engine.runner
    assert engine.stats().graph_steps == runner.graph_steps == sum(graphs.replays_by_size.values()) > 0
    assert runner.num_steps == engine.stats().num_steps  # replayed eager steps are counted once, as eager
    text = render_metrics(MetricsSnapshot.take(engine, {"requests": 3, "prompt_tokens": 0, "generation_tokens": 0}, 0))
    for size in SIZES:
        assert f'hf_paged_decode_graph_replays_total{{size="{size}"}} {graphs.replays_by_size[size]}' in text
