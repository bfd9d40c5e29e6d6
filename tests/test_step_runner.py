"""The Engine's compiled steps (`Engine(compile=True)`, `engine.step_runner`): the same tokens as its eager steps,
log-probabilities within float rounding, one compiled graph for every step shape, and eager steps wherever compiling
cannot serve (a compile error, changed weights, quantized pages)."""

from __future__ import annotations

import random
import re
import warnings

import pytest
import torch

import hf_paged
import hf_paged.engine.step_runner as step_runner
from hf_paged.reference_models import tiny_model

from .conftest import drop_step_tensors

LOGPROB_TOLERANCE = 1e-4  # fp32, tiny models: inductor's fused and reordered sums move log-probs by ~1e-6


def prompts(count: int, seed: int = 0, longest: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(3, 120) for _ in range(rng.randint(1, longest))] for _ in range(count)]


def run(model, compile: bool, batch: list[list[int]], max_new_tokens=12, **options):
    """Tokens, log-probs and the engine of one `generate` over `batch` in a fresh pool (mixed steps: 32 tokens)."""
    hf_paged.release_pool(model)
    engine = hf_paged.Engine(
        model, block_size=4, num_blocks=512, max_batch_size=8, max_num_batched_tokens=32, compile=compile, **options
    )
    params = hf_paged.SamplingParams(max_new_tokens=max_new_tokens, logprobs=0)
    outputs = engine.generate(batch, params)
    engine.pool.check_invariants()
    return [o.token_ids for o in outputs], [[p.logprob for p in o.logprobs] for o in outputs], engine


@pytest.fixture
def backend(monkeypatch):
    """Compile with `aot_eager` (traced through the same custom ops, no C++ build): what most tests need, fast."""
    monkeypatch.setattr(step_runner, "COMPILE_BACKEND", "aot_eager")
    return "aot_eager"


@pytest.mark.parametrize(
    "family, compiler",
    [("llama", "inductor-cpp"), ("gemma2", "inductor-cpp"), ("llama", "inductor"), ("qwen3", "aot_eager"),
     ("starcoder2", "aot_eager")],
)  # fmt: skip
def test_compiled_steps_give_the_eager_engines_tokens(family, compiler, monkeypatch):
    # gemma2: full and sliding layer groups, soft-capped logits; starcoder2: every layer sliding (window 6);
    # inductor-cpp: the default, inductor's host code in C++ (the suite's other compiles keep Python's, conftest.py)
    monkeypatch.setattr(step_runner, "CPP_WRAPPER", compiler == "inductor-cpp")
    monkeypatch.setattr(step_runner, "COMPILE_BACKEND", compiler.removesuffix("-cpp"))
    model = tiny_model(family)
    batch = prompts(20)
    tokens, logprobs, eager = run(model, False, batch)
    compiled_tokens, compiled_logprobs, engine = run(model, True, batch)
    assert compiled_tokens == tokens
    difference = max(abs(a - b) for row, other in zip(logprobs, compiled_logprobs) for a, b in zip(row, other))
    assert difference < LOGPROB_TOLERANCE
    runner = engine.runner
    assert eager.runner.compiled_steps == 0
    assert runner.compiled_steps == runner.num_steps - 1  # all but the first, which allocates the pages
    assert runner.graphs == 1 and runner.disabled is None
    assert engine.stats().compiled_steps == runner.compiled_steps


def test_metrics_say_which_forward_ran(backend):
    from hf_paged.serve.metrics import MetricsSnapshot, render_metrics

    _, _, engine = run(tiny_model("llama"), True, prompts(4), max_new_tokens=4)
    runner = engine.runner
    totals = {"requests": 4, "prompt_tokens": 0, "generation_tokens": 16}
    text = render_metrics(MetricsSnapshot.take(engine, totals, 0.0)).splitlines()
    assert f'hf_paged_engine_steps_by_forward_total{{forward="compiled"}} {runner.compiled_steps}' in text
    assert 'hf_paged_engine_steps_by_forward_total{forward="eager"} 1' in text
    assert "hf_paged_compiled_graphs_total 1" in text


def test_one_graph_serves_40_requests_of_varied_lengths(backend):
    model = tiny_model("llama")
    torch._dynamo.utils.counters.clear()
    rng = random.Random(1)
    hf_paged.release_pool(model)
    engine = hf_paged.Engine(
        model, block_size=4, num_blocks=1024, max_batch_size=6, max_num_batched_tokens=24, compile=True
    )
    for index in range(40):  # one at a time and in groups: steps of 1 token, of 1 row, mixed, long prompts chunked
        batch = prompts(1 + index % 4, seed=index, longest=60)
        engine.generate(batch, hf_paged.SamplingParams(max_new_tokens=rng.randint(1, 20)))
    assert engine.runner.compiled_steps > 200
    assert engine.runner.graphs == 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_a_compile_error_falls_back_to_eager_steps_with_one_warning(monkeypatch):
    def failing_backend(graph_module, example_inputs):
        raise RuntimeError("no C++ compiler in this simulation")

    monkeypatch.setattr(step_runner, "COMPILE_BACKEND", failing_backend)
    model = tiny_model("llama")
    batch = prompts(6)
    tokens, _, _ = run(model, False, batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled_tokens, _, engine = run(model, True, batch)
    messages = [str(w.message) for w in caught if "compiled steps are off" in str(w.message)]
    assert len(messages) == 1 and "no C++ compiler in this simulation" in messages[0]
    assert compiled_tokens == tokens
    assert engine.runner.disabled is not None and engine.runner.compiled_steps == 1  # the checked first step only


def test_a_graph_that_fails_with_cpp_host_code_compiles_with_pythons(monkeypatch, caplog):
    """A compile error with C++ host code (a graph inductor's C++ wrapper cannot write) retries once with Python
    host code, with one warning, and the steps stay compiled; an error with Python's too turns compiling off."""

    def backend(graph_module, example_inputs):
        if torch._inductor.config.cpp_wrapper:
            raise NotImplementedError("not in C++ host code in this simulation")
        return torch._dynamo.backends.registry.lookup_backend("aot_eager")(graph_module, example_inputs)

    monkeypatch.setattr(step_runner, "COMPILE_BACKEND", backend)
    monkeypatch.setattr(step_runner, "CPP_WRAPPER", True)
    model = tiny_model("llama")
    batch = prompts(6)
    tokens, _, _ = run(model, False, batch)
    with caplog.at_level("WARNING", logger="hf_paged.engine.step_runner"):
        compiled_tokens, _, engine = run(model, True, batch)
    warned = [r.getMessage() for r in caplog.records if "C++ host code failed" in r.getMessage()]
    assert len(warned) == 1 and "not in C++ host code in this simulation" in warned[0]
    runner = engine.runner
    assert compiled_tokens == tokens
    assert runner.disabled is None and runner.python_host_code is not None
    assert runner.compiled_steps == runner.num_steps - 1


def test_changed_weights_are_compiled_again():
    # inductor freezes the weights into the graph: without the weights check the second call would answer with the
    # first call's weights
    model = tiny_model("llama")
    batch = prompts(6)
    hf_paged.release_pool(model)
    engine = hf_paged.Engine(model, block_size=4, num_blocks=512, compile=True)
    before = [o.token_ids for o in engine.generate(batch, max_new_tokens=8)]
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # an in-place edit: a fine-tune step, a merged adapter
    after = [o.token_ids for o in engine.generate(batch, max_new_tokens=8)]
    expected, _, _ = run(model, False, batch, max_new_tokens=8)
    assert after == expected and after != before
    assert engine.runner.graphs == 2


@pytest.mark.parametrize("concat", [True, False])
def test_projections_of_one_input_run_as_one_matmul(concat, monkeypatch):
    # the default (True): q/k/v and gate/up concatenated by inductor's freezing, 4 matmuls a layer instead of 7, plus
    # the LM head; False is the negative control (tokens: test_compiled_steps_give_the_eager_engines_tokens)
    monkeypatch.setattr(step_runner, "CONCAT_LINEAR", concat)
    model = tiny_model("llama", num_hidden_layers=2)
    hf_paged.release_pool(model)
    engine = hf_paged.Engine(model, block_size=4, num_blocks=64, compile=True)
    engine.generate(prompts(4), max_new_tokens=4)  # compiles
    engine.add_request([5, 6, 7], hf_paged.SamplingParams(max_new_tokens=4))
    with torch.profiler.profile() as profile:
        engine.step()
    matmuls = [event.name for event in profile.events() if "linear" in event.name or "mm" in event.name]
    assert engine.runner.graphs == 1 and engine.runner.compiled_steps == engine.runner.num_steps - 1
    assert len(matmuls) == (4 if concat else 7) * 2 + 1, matmuls


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "int4-channel"])
def test_quantized_pages_run_compiled_with_the_eager_engines_tokens(family, kv_dtype):
    # the quantized ops write codes and scales as the eager storage does, and the kernels read them the same way;
    # int4-channel: the staged write quantizes a block's keys in the step that fills it (blocks of 4 tokens here)
    model = tiny_model(family)
    batch = prompts(12)
    tokens, logprobs, _ = run(model, False, batch, kv_dtype=kv_dtype)
    compiled_tokens, compiled_logprobs, engine = run(model, True, batch, kv_dtype=kv_dtype)
    assert compiled_tokens == tokens
    difference = max(abs(a - b) for row, other in zip(logprobs, compiled_logprobs) for a, b in zip(row, other))
    assert difference < LOGPROB_TOLERANCE
    runner = engine.runner
    assert runner.compiled_steps == runner.num_steps - 1 and runner.graphs == 1 and runner.disabled is None
    assert engine.pool.storage.format.name == kv_dtype


def test_a_model_that_does_not_pass_its_kwargs_to_attention_runs_eagerly(backend):
    model = tiny_model("llama")
    drop_step_tensors(model)
    batch = prompts(6)
    tokens, _, _ = run(model, False, batch)
    with pytest.warns(RuntimeWarning, match="compiled steps are off") as caught:
        compiled_tokens, _, engine = run(model, True, batch)
    assert len([w for w in caught if "compiled steps are off" in str(w.message)]) == 1
    assert compiled_tokens == tokens and engine.runner.compiled_steps == 0


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_the_compile_option_is_checked_before_anything_is_built(value):
    model, pools = tiny_model("llama"), len(hf_paged.live_pools())
    with pytest.raises(ValueError, match=f"compile must be True, False or 'auto', got {value!r}"):
        hf_paged.Engine(model, compile=value)
    assert len(hf_paged.live_pools()) == pools  # no pool was built


def test_the_default_engine_compiles_its_steps_where_a_compiler_works(backend):
    model = tiny_model("llama")
    batch = prompts(6)
    hf_paged.release_pool(model)
    with hf_paged.Engine(model, block_size=4, num_blocks=512, exact=True) as exact:
        expected = [o.token_ids for o in exact.generate(batch, max_new_tokens=10)]
        assert exact.runner.compile is False and exact.runner.compiled_steps == 0
    hf_paged.release_pool(model)
    with hf_paged.Engine(model, block_size=4, num_blocks=512) as engine:  # compile="auto", exact=False
        assert engine.runner.compile is True and engine.exact is False
        assert [o.token_ids for o in engine.generate(batch, max_new_tokens=10)] == expected
        assert engine.runner.compiled_steps == engine.runner.num_steps - 1 and engine.runner.graphs == 1
    hf_paged.release_pool(model)
    with hf_paged.Engine(model, block_size=4, num_blocks=512, kv_dtype="int8") as quantized:  # measured: same quality
        assert quantized.runner.compile is True
    hf_paged.release_pool(model)
    with hf_paged.Engine(model, block_size=4, num_blocks=512, kv_dtype="int4-channel") as channel:  # measured faster
        assert channel.runner.compile is True


@pytest.mark.parametrize(
    "options, reason",
    [
        ({"exact": True}, "exact=True"),
        ({"cpu_linear": "onednn"}, "cpu_linear='onednn'"),
        ({}, "inductor finds no C++ compiler"),
    ],
    ids=["exact", "packed-linears", "no-compiler"],
)
def test_auto_runs_eager_steps_where_compiled_ones_cannot_and_says_why(options, reason, monkeypatch, caplog):
    from hf_paged.cpu_linear import onednn_available

    if "cpu_linear" in options and not onednn_available():
        pytest.skip("this torch has no oneDNN CPU matmul")
    if not options:  # a machine without a C++ compiler: inductor's own search finds none
        monkeypatch.setattr(torch._inductor.config.cpp, "cxx", ("hf-paged-no-such-compiler++",))
    model = tiny_model("llama")
    hf_paged.release_pool(model)
    with caplog.at_level("INFO", logger="hf_paged.engine.step_runner"):
        engine = hf_paged.Engine(model, block_size=4, num_blocks=128, **options)
    with engine:
        engine.generate(prompts(3), max_new_tokens=4)
        assert engine.runner.compile is False and engine.runner.compiled_steps == 0
    assert f"the Engine runs eager steps (compile='auto'): {reason}" in caplog.text


@pytest.mark.parametrize(
    "options, message",
    [
        ({"exact": True, "compile": True}, "exact=True runs the eager steps, bit-exact with generate; compile=True"),
        (
            {"exact": True, "cpu_linear": "onednn"},
            "exact=True keeps the model's own linear layers; cpu_linear='onednn'",
        ),
        ({"exact": "yes"}, "exact must be True or False, got 'yes'"),
    ],
)
def test_exact_conflicts_are_refused_before_anything_is_built(options, message):
    model, pools = tiny_model("llama"), len(hf_paged.live_pools())
    with pytest.raises(ValueError, match=re.escape(message)):
        hf_paged.Engine(model, **options)
    assert len(hf_paged.live_pools()) == pools  # no pool was built


def test_smollm2_default_engine_gives_the_exact_engines_tokens(smollm2, monkeypatch):
    monkeypatch.setattr(step_runner, "CPP_WRAPPER", True)  # the default (conftest.py chooses Python's for the suite)
    model, tokenizer = smollm2
    questions = ["What is the capital of France?", "Name three primary colors.", "Count from one to five."]
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False) for q in questions]
    runs = {}
    for exact in (True, False):
        hf_paged.release_pool(model)
        with hf_paged.Engine(model, tokenizer, num_blocks=256, exact=exact) as engine:
            outputs = engine.generate(chats, max_new_tokens=24)
            runs[exact] = [o.token_ids for o in outputs], engine.runner.compiled_steps, engine.runner.graphs
    assert runs[False][0] == runs[True][0]
    assert runs[True][1] == 0 and runs[False][1] > 20 and runs[False][2] == 1


@pytest.mark.parametrize(
    "value, expected", [(None, True), ("1", True), ("true", True), ("0", False), ("off", False), ("no", False)]
)
def test_the_cpp_wrapper_setting_reads_the_environment(value, expected):
    assert step_runner.cpp_wrapper_from_env(value) is expected


@pytest.mark.parametrize("value, expected", [(None, False), ("", False), ("1", True), ("on", True), ("0", False)])
def test_the_adapters_forward_gets_cpp_host_code_only_when_asked(value, expected):
    assert step_runner.adapters_cpp_wrapper_from_env(value) is expected


def test_a_malformed_cpp_wrapper_setting_is_refused_naming_it():
    with pytest.raises(ValueError, match="HF_PAGED_CPP_WRAPPER='maybe': expected 1 .* or 0"):
        step_runner.cpp_wrapper_from_env("maybe")


def test_compile_with_packed_linear_layers_is_refused_naming_both():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="compile=True with cpu_linear='onednn'"):
        hf_paged.Engine(model, compile=True, cpu_linear="onednn")


def test_serve_compiles_at_start_up_and_leaves_the_pool_empty(backend):
    from hf_paged.serve.cli import _compile_now

    model = tiny_model("llama")
    hf_paged.release_pool(model)
    engine = hf_paged.Engine(model, block_size=4, num_blocks=64, compile=True)
    _compile_now(engine)  # what `hf-paged serve --compile` runs before it takes requests
    assert engine.runner.graphs == 1 and engine.runner.compiled_steps >= 1
    assert not engine.has_unfinished_requests()
    assert engine.pool.stats().num_used == 0  # the warm-up requests gave their blocks back


def test_serve_with_lora_adapters_compiles_their_steps_at_start_up_too(backend):
    from hf_paged.reference_models import random_lora
    from hf_paged.serve.cli import _compile_now

    model = tiny_model("llama")
    adapters = {"a": random_lora(model, seed=1), "b": random_lora(model, seed=2)}
    engine = hf_paged.Engine(model, block_size=4, num_blocks=64, compile=True, adapters=adapters)
    _compile_now(engine)
    assert engine.runner.graphs == 2  # the base model's steps, and steps with adapters
    graphs = engine.runner.graphs
    engine.generate([[5, 6, 7]], max_new_tokens=4, adapter="b")
    assert engine.runner.graphs == graphs and engine.pool.stats().num_used == 0


def test_compiled_steps_under_preemption_prefix_reuse_and_sampling_give_the_eager_tokens(backend):
    # a pool too small for the batch (requests preempted and recomputed), prompts sharing a prefix (blocks reused),
    # seeded sampling: the compiled engine makes the eager engine's scheduling decisions and draws
    model = tiny_model("llama")
    shared = list(range(3, 23))
    batch = [shared + prompt for prompt in prompts(12, seed=4, longest=12)]
    params = [hf_paged.SamplingParams(max_new_tokens=16, do_sample=True, temperature=0.8, seed=i) for i in range(12)]
    results = {}
    for compile in (False, True):
        hf_paged.release_pool(model)
        engine = hf_paged.Engine(model, block_size=4, num_blocks=40, max_batch_size=8, compile=compile)
        outputs = engine.generate(batch, params)
        stats = engine.last_stats
        results[compile] = [o.token_ids for o in outputs], stats.preemptions, stats.prefix_hit_rate
        engine.pool.check_invariants()
    assert results[True] == results[False]
    _, preemptions, hit_rate = results[True]
    assert preemptions > 0 and hit_rate > 0 and stats.compiled_steps > 0.8 * stats.num_steps
