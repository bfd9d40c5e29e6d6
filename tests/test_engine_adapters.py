"""Engine with LoRA adapters chosen per request: every request's tokens equal PEFT's `generate` with only its
adapter active, whatever else shares its steps; the prefix cache never lends K/V across adapters or across reloads
with new weights; limits and bad adapters are refused clearly."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from peft import IA3Config, LoraConfig, get_peft_model, get_peft_model_state_dict

from hf_paged import Engine
from hf_paged.engine import step_runner
from hf_paged.reference_models import random_lora, tiny_model
from tests.lora_helpers import ALL_LINEAR, PeftReference, three_adapters

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")
NAMES = [None, "qv", "all", "mlp"]


@pytest.fixture(scope="module")
def base():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def adapters(base):
    return three_adapters(base)


@pytest.fixture(scope="module")
def reference(base, adapters):
    return PeftReference(base, adapters)


def workload(count: int, vocab_size: int, seed: int = 0):
    """`(prompt, adapter, max_new_tokens)` of `count` requests, adapters (and the base) in turn."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, vocab_size) for _ in range(rng.randint(1, 30))], NAMES[i % 4], rng.randint(1, 14))
        for i in range(count)
    ]


def run_interleaved(engine: Engine, requests: list, arrive_every: int = 3, **options) -> tuple[list, list]:
    """Add the requests a few at a time while stepping (so prompts join decoding rows in mixed steps); returns every
    request's final output and, per step, its kind and the adapters of its rows."""
    steps = []
    run = engine._run

    def recording(step):
        steps.append((step.kind, {r.adapter_name for r in step.requests}))
        return run(step)

    engine._run = recording
    ids, finals, pending = [], {}, list(requests)
    while pending or engine.has_unfinished_requests():
        for prompt, adapter, count in pending[:arrive_every]:
            ids.append(
                engine.add_request(prompt, max_new_tokens=count, min_new_tokens=count, adapter=adapter, **options)
            )
        del pending[:arrive_every]
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        engine.pool.check_invariants()
    del engine._run
    return [finals[i] for i in ids], steps


@pytest.mark.parametrize("num_blocks", [256, 24], ids=["roomy-pool", "pool-too-small"])
def test_mixed_adapters_in_the_same_steps_match_peft_alone(base, adapters, reference, num_blocks):
    requests = workload(32, base.config.vocab_size)
    engine = Engine(
        base,
        block_size=4,
        num_blocks=num_blocks,
        max_batch_size=8,
        max_num_batched_tokens=16,
        adapters=adapters,
        exact=True,
    )
    outputs, steps = run_interleaved(engine, requests)
    for output, (prompt, adapter, count) in zip(outputs, requests):
        assert output.adapter == adapter
        assert output.token_ids == reference.generate(prompt, adapter, count), (adapter, prompt)
    kinds = {kind for kind, _ in steps}
    assert "mixed" in kinds  # prompt chunks packed with decoding rows
    assert any(len(names) == 4 for kind, names in steps if kind == "mixed")  # 3 adapters + base in one step
    assert engine.adapter_counts["all"]["requests"] == 8
    assert engine.pool.stats().num_used == 0
    assert (engine.stats().preemptions > 0) == (num_blocks == 24)  # recomputed on their own adapter's blocks


def run_phases(engine: Engine, reference: PeftReference, phases: list, seed: int = 0) -> list[int]:
    """For each `(adapters to load, adapters to unload, names)` phase: change the engine's adapters, run 12 requests
    over `names` to the end and check each against PEFT alone; returns the runner's graph count after each phase."""
    graphs = []
    for step, (load, unload, names) in enumerate(phases):
        for name, adapter in load.items():
            engine.load_adapter(name, adapter)
            if name not in reference.model.peft_config:
                reference.add(name, *adapter)
        for name in unload:
            engine.unload_adapter(name)
        rng = random.Random(seed + step)
        requests = [
            ([rng.randrange(3, 100) for _ in range(rng.randint(1, 30))], names[i % len(names)], rng.randint(1, 14))
            for i in range(12)
        ]
        outputs, _ = run_interleaved(engine, requests, arrive_every=4)
        for output, (prompt, adapter, count) in zip(outputs, requests):
            assert output.token_ids == reference.generate(prompt, adapter, count), (step, adapter)
        graphs.append(engine.runner.graphs)
    return graphs


def run_compiled_against_peft(model, adapters, reference: PeftReference, requests: list) -> tuple[Engine, list]:
    """Run `requests` interleaved through a compiled Engine serving `adapters`, check every request's tokens against
    PEFT alone; returns the engine and its steps (`run_interleaved`)."""
    engine = Engine(
        model, block_size=4, num_blocks=256, max_batch_size=8, max_num_batched_tokens=16, adapters=adapters,
        compile=True,
    )  # fmt: skip
    outputs, steps = run_interleaved(engine, requests)
    for output, (prompt, adapter, count) in zip(outputs, requests):
        assert output.token_ids == reference.generate(prompt, adapter, count), (adapter, prompt)
    return engine, steps


@pytest.mark.parametrize("compiler", ["inductor", "aot_eager"])
def test_compiled_steps_with_mixed_adapters_match_peft_alone(base, adapters, reference, compiler, monkeypatch):
    # inductor freezes the weights into the graph: the adapters' factors and masks must stay graph inputs
    monkeypatch.setattr(step_runner, "COMPILE_BACKEND", compiler)
    engine, steps = run_compiled_against_peft(base, adapters, reference, workload(32, base.config.vocab_size, seed=4))
    assert any(len(names) == 4 for kind, names in steps if kind == "mixed")  # 3 adapters + base in one step
    runner = engine.runner
    assert runner.compiled_steps == runner.num_steps - 1 and runner.disabled is None  # all but the first
    assert runner.graphs <= 2  # steps with adapters; base-only steps, if any ran


def test_the_adapters_forward_compiles_with_python_host_code(base, adapters, reference, monkeypatch):
    """By default C++ host code is for the base forward only: the adapters' forward compiles with Python's (its C++
    host code took ~3x as long to compile, for steps ~2% faster), and its steps still match PEFT."""
    host_code = []

    def recording_backend(graph_module, example_inputs):
        host_code.append("C++" if torch._inductor.config.cpp_wrapper else "Python")
        return torch._dynamo.backends.registry.lookup_backend("aot_eager")(graph_module, example_inputs)

    monkeypatch.setattr(step_runner, "COMPILE_BACKEND", recording_backend)
    monkeypatch.setattr(step_runner, "CPP_WRAPPER", True)
    monkeypatch.setattr(step_runner, "ADAPTERS_CPP_WRAPPER", False)  # HF_PAGED_CPP_WRAPPER unset
    engine, _ = run_compiled_against_peft(base, adapters, reference, workload(16, base.config.vocab_size, seed=5))
    assert host_code == ["Python"]  # every step held an adapter request (the first ran eagerly)
    base_only = engine.generate([[5, 6, 7, 8]], max_new_tokens=3)[0].token_ids
    assert base_only == reference.generate([5, 6, 7, 8], None, 3)
    assert host_code == ["Python", "C++"]
    assert engine.runner.python_host_code is None  # nothing failed: a choice, not a fallback


@pytest.mark.parametrize("family", ["gemma2", "qwen3"])  # sliding and full layer groups; q/k norms
def test_compiled_steps_with_adapters_match_peft_alone_on_other_families(family, monkeypatch):
    monkeypatch.setattr(step_runner, "COMPILE_BACKEND", "aot_eager")
    model = tiny_model(family)
    adapters = three_adapters(model)
    reference = PeftReference(model, adapters)
    engine, _ = run_compiled_against_peft(model, adapters, reference, workload(16, model.config.vocab_size, seed=7))
    assert engine.runner.compiled_steps == engine.runner.num_steps - 1 and engine.runner.disabled is None


def test_compiled_steps_compile_again_only_for_modules_no_adapter_hooked_before(base, adapters, reference, monkeypatch):
    # loading and unloading change the stacks' width (slots x rank): a size the graph takes as an input
    monkeypatch.setattr(step_runner, "COMPILE_BACKEND", "aot_eager")
    engine = Engine(base, block_size=4, num_blocks=256, max_batch_size=8, adapters={"qv": adapters["qv"]}, compile=True)
    wide = random_lora(base, seed=9, rank=16, target_modules=("q_proj", "gate_proj"))
    graphs = run_phases(
        engine,
        PeftReference(base, {"qv": adapters["qv"]}),
        [
            ({}, (), [None]),  # the base model's graph
            ({}, (), [None, "qv"]),  # the adapters' graph, for q_proj and v_proj
            ({"all": adapters["all"]}, (), [None, "qv", "all"]),  # every linear layer hooked: built again
            ({"mlp": adapters["mlp"]}, (), NAMES),  # a third slot, modules hooked already
            ({}, ("qv",), [None, "all", "mlp"]),  # a slot freed
            ({"wide": wide}, (), [None, "all", "wide"]),  # rank 16: every slot twice as wide
        ],
    )
    assert graphs == [1, 2, 3, 3, 3, 3]


def test_two_compiled_engines_on_one_model_apply_only_their_own_adapters(base, adapters, reference, monkeypatch):
    # both sets hook the same modules; a compiled step hands its adapters to every hook it traces
    monkeypatch.setattr(step_runner, "COMPILE_BACKEND", "aot_eager")
    first = Engine(base, block_size=4, num_blocks=64, adapters={"qv": adapters["qv"]}, compile=True)
    second = Engine(
        base, block_size=4, num_blocks=64, adapters={"qv": adapters["qv"], "all": adapters["all"]}, compile=True
    )
    for engine in (first, second, first):
        requests = [(p, a, n) for p, a, n in workload(12, base.config.vocab_size, seed=5) if a in (None, "qv")]
        outputs, _ = run_interleaved(engine, requests)
        for output, (prompt, adapter, count) in zip(outputs, requests):
            assert output.token_ids == reference.generate(prompt, adapter, count), adapter
        assert engine.runner.compiled_steps > 0


def test_adapters_collected_while_another_engine_compiles_leave_its_steps_intact(
    base, adapters, reference, monkeypatch
):
    # an engine dropped in a reference cycle is freed by the cyclic collector, whose finalizer removes its adapters'
    # hooks; collected between Dynamo's trace of another engine's step and the guards it builds over those hooks, it
    # failed that step (IndexError): compiled calls run with the cyclic collector off
    thresholds = gc.get_threshold()

    def backend_that_allocates(graph_module, example_inputs):
        gc.set_threshold(1)  # the collector would run at this allocation: after the trace, before its guards
        [[] for _ in range(100)]
        gc.set_threshold(*thresholds)
        return graph_module.forward

    monkeypatch.setattr(step_runner, "COMPILE_BACKEND", backend_that_allocates)
    engine = Engine(base, block_size=4, num_blocks=64, adapters={"qv": adapters["qv"]}, compile=True)
    requests = [(p, a, n) for p, a, n in workload(8, base.config.vocab_size, seed=6) if a in (None, "qv")]
    gc.collect()
    gc.set_threshold(10**9)  # nothing collected before the compiled call
    try:
        dropped = Engine(base, block_size=4, num_blocks=16, adapters={"all": adapters["all"]}, compile=False)
        dropped.cycle = dropped
        del dropped
        outputs, _ = run_interleaved(engine, requests)
    finally:
        gc.set_threshold(*thresholds)
    for output, (prompt, adapter, count) in zip(outputs, requests):
        assert output.token_ids == reference.generate(prompt, adapter, count), adapter
    assert engine.runner.compiled_steps > 0 and engine.runner.disabled is None


def test_negative_control_a_graph_traced_before_a_module_was_hooked_leaves_its_adapter_out(base, adapters, monkeypatch):
    # Dynamo does not guard on a module's hooks: reusing the adapters' graph after "all" hooks new modules is wrong
    monkeypatch.setattr(step_runner, "COMPILE_BACKEND", "aot_eager")
    first = step_runner.StepRunner._adapted_forward

    def the_first_graph_forever(self, lora):
        if self._adapted is None:
            return first(self, lora)
        return self._adapted[1]

    monkeypatch.setattr(step_runner.StepRunner, "_adapted_forward", the_first_graph_forever)
    engine = Engine(base, block_size=4, num_blocks=256, max_batch_size=8, adapters={"qv": adapters["qv"]}, compile=True)
    with pytest.raises(AssertionError, match=r"\(1, 'all'\)"):
        run_phases(
            engine,
            PeftReference(base, {"qv": adapters["qv"]}),
            [({}, (), ["qv"]), ({"all": adapters["all"]}, (), ["all"])],
        )


def test_seeded_sampling_matches_peft_alone(base, adapters, reference):
    requests = workload(16, base.config.vocab_size, seed=1)
    engine = Engine(base, block_size=4, num_blocks=256, max_num_batched_tokens=64, adapters=adapters, exact=True)
    ids = [
        engine.add_request(p, max_new_tokens=n, min_new_tokens=n, do_sample=True, top_k=20, seed=100 + i, adapter=a)
        for i, (p, a, n) in enumerate(requests)
    ]
    finals = {o.request_id: o for o in engine.generate([[5]], max_new_tokens=1)}  # drives the queued ones too
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    for i, (request_id, (prompt, adapter, count)) in enumerate(zip(ids, requests)):
        expected = reference.generate(prompt, adapter, count, seed=100 + i, do_sample=True, top_k=20)
        assert finals[request_id].token_ids == expected, adapter


def test_right_aligned_steps_under_a_stock_attention_match_too(base, adapters, reference):
    requests = workload(12, base.config.vocab_size, seed=2)
    engine = Engine(base, block_size=4, num_blocks=256, attn_implementation="sdpa", adapters=adapters, exact=True)
    outputs, steps = run_interleaved(engine, requests, arrive_every=4)
    assert {kind for kind, _ in steps} <= {"prefill", "decode"}
    for output, (prompt, adapter, count) in zip(outputs, requests):
        assert output.token_ids == reference.generate(prompt, adapter, count)


def test_negative_control_adapters_change_the_output(base, adapters, reference):
    """Each adapter changes most requests' tokens; served as the base model they would not match PEFT."""
    requests = [(p, a, n) for p, a, n in workload(24, base.config.vocab_size, seed=3) if a is not None]
    engine = Engine(base, block_size=4, num_blocks=256, adapters=adapters, exact=True)
    as_base = [engine.generate([p], max_new_tokens=n, min_new_tokens=n)[0].token_ids for p, _, n in requests]
    expected = [reference.generate(p, a, n) for p, a, n in requests]
    differ = sum(got != want for got, want in zip(as_base, expected))
    assert differ >= len(requests) * 2 // 3, differ
    for name in ("qv", "all", "mlp"):
        assert any(got != want for got, want, (_, a, _) in zip(as_base, expected, requests) if a == name)


def test_prefix_cache_is_shared_within_an_adapter_and_never_across(base, adapters, reference):
    engine = Engine(base, block_size=4, num_blocks=256, adapters=adapters, exact=True)
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks cached after the first run
    first = {}
    for name in NAMES:
        [output] = engine.generate([prompt], max_new_tokens=4, min_new_tokens=4, adapter=name)
        assert output.prefix_tokens_reused == 0, name  # no other adapter's blocks
        assert output.token_ids == reference.generate(prompt, name, 4)
        first[name] = output.token_ids
    for name in NAMES:
        [output] = engine.generate([prompt], max_new_tokens=4, min_new_tokens=4, adapter=name)
        assert output.prefix_tokens_reused == 12, name  # every full block of its own
        assert output.token_ids == first[name]


def reload_with_new_weights(base, engine: Engine):
    """Serve a prompt on adapter "qv", reload "qv" with other weights, serve the prompt again: the second output."""
    prompt = list(range(30, 47))
    engine.generate([prompt], max_new_tokens=6, min_new_tokens=6, adapter="qv")
    engine.unload_adapter("qv")
    engine.load_adapter("qv", random_lora(base, seed=7, rank=4))
    [output] = engine.generate([prompt], max_new_tokens=6, min_new_tokens=6, adapter="qv")
    return prompt, output


def test_reloading_an_adapter_with_new_weights_never_serves_the_old_kv(base, adapters):
    engine = Engine(base, block_size=4, num_blocks=256, adapters={"qv": adapters["qv"]}, exact=True)
    prompt, output = reload_with_new_weights(base, engine)
    new = PeftReference(base, {"qv": random_lora(base, seed=7, rank=4)})
    assert output.prefix_tokens_reused == 0
    assert output.token_ids == new.generate(prompt, "qv", 6)


def test_negative_control_keying_blocks_by_adapter_name_alone_serves_stale_kv(base, adapters, monkeypatch):
    """The stale-block bug (a prefix cache keyed by the adapter's name only): the reload reuses the old weights'
    K/V and the output differs from the new adapter's."""
    from hf_paged.engine.request import Request

    monkeypatch.setattr(Request, "prefix_namespace", property(lambda r: r.adapter and r.adapter.name.encode()))
    engine = Engine(base, block_size=4, num_blocks=256, adapters={"qv": adapters["qv"]}, exact=True)
    prompt, output = reload_with_new_weights(base, engine)
    new = PeftReference(base, {"qv": random_lora(base, seed=7, rank=4)})
    assert output.prefix_tokens_reused == 16
    assert output.token_ids != new.generate(prompt, "qv", 6)


def test_unload_and_reload_while_requests_run_on_the_name(base, adapters):
    """Requests added on an adapter finish on its weights even when it is unloaded (and its name reloaded with other
    weights) while they run; its slot is freed when the last of them ends; new requests cannot name it meanwhile."""
    old, new = adapters["qv"], random_lora(base, seed=9, rank=4)
    engine = Engine(base, block_size=4, num_blocks=256, max_adapters=2, adapters={"qv": old}, exact=True)
    prompt = [7, 8, 9, 10, 11]
    running = engine.add_request(prompt, max_new_tokens=10, min_new_tokens=10, adapter="qv")
    waiting = engine.add_request(prompt[::-1], max_new_tokens=3, min_new_tokens=3, adapter="qv")
    finals = {o.request_id: o for o in engine.step()}
    engine.unload_adapter("qv")
    with pytest.raises(ValueError, match=r"unknown adapter 'qv'; loaded adapters: none"):
        engine.add_request(prompt, adapter="qv")
    assert engine.adapters.num_resident == 1  # still serving its two requests
    engine.load_adapter("qv", new)
    with pytest.raises(ValueError, match=r"2 adapters are resident \(1 of them unloaded but still serving"):
        engine.load_adapter("other", adapters["mlp"])
    fresh = engine.add_request(prompt, max_new_tokens=10, min_new_tokens=10, adapter="qv")
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.adapters.num_resident == 1  # the old weights left with their last request
    before, after = PeftReference(base, {"qv": old}), PeftReference(base, {"qv": new})
    assert finals[running].token_ids == before.generate(prompt, "qv", 10)
    assert finals[waiting].token_ids == before.generate(prompt[::-1], "qv", 3)
    assert finals[fresh].token_ids == after.generate(prompt, "qv", 10)
    assert finals[fresh].token_ids != finals[running].token_ids
    engine.load_adapter("other", adapters["mlp"])  # the freed slot takes a new adapter
    with pytest.raises(ValueError, match="an adapter named 'qv' is loaded already; unload it first"):
        engine.load_adapter("qv", old)


def test_adapters_load_from_peft_directories(base, adapters, reference, tmp_path):
    config, state = adapters["all"]
    model = get_peft_model(tiny_model("llama"), config)
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(model, state)
    model.save_pretrained(tmp_path / "all")
    engine = Engine(base, block_size=4, num_blocks=64, adapters={"all": tmp_path / "all"}, exact=True)
    [output] = engine.generate([[4, 5, 6]], max_new_tokens=5, min_new_tokens=5, adapter="all")
    assert output.token_ids == reference.generate([4, 5, 6], "all", 5)
    assert engine.adapters.get("all").digest == engine.adapters.load("copy", adapters["all"]).digest


def test_bad_adapters_are_refused_naming_the_value_and_the_limit(base, adapters, tmp_path):
    engine = Engine(
        base, block_size=4, num_blocks=64, max_adapters=2, max_rank=4, adapters={"qv": adapters["qv"]}, exact=True
    )
    with pytest.raises(ValueError, match=r"unknown adapter 'nope'; loaded adapters: \['qv'\]"):
        engine.add_request([1, 2, 3], adapter="nope")
    too_big = r"adapter 'all' has rank 8 \(model.layers.0.mlp.down_proj\), above max_rank=4"
    with pytest.raises(ValueError, match=too_big):
        engine.load_adapter("all", adapters["all"])
    engine.load_adapter("mlp", adapters["mlp"])
    with pytest.raises(ValueError, match="cannot load adapter 'third': 2 adapters are resident, max_adapters=2"):
        engine.load_adapter("third", random_lora(base, seed=4, rank=2))
    other_base = tiny_model("llama", intermediate_size=96)
    with pytest.raises(ValueError, match=r"not trained for this base model: model.layers.0.mlp.down_proj is a Linear"):
        engine.load_adapter("x", random_lora(other_base, rank=2, target_modules=("down_proj",)))
    deeper = tiny_model("llama", num_hidden_layers=3)
    with pytest.raises(ValueError, match="not trained for this base model: it has no module model.layers.2"):
        engine.load_adapter("x", random_lora(deeper, rank=2))
    ia3 = get_peft_model(tiny_model("llama"), IA3Config(target_modules=["k_proj", "v_proj"], feedforward_modules=[]))
    ia3.save_pretrained(tmp_path / "ia3")
    with pytest.raises(NotImplementedError, match="adapter 'x' is a PEFT IA3 adapter; only LoRA adapters"):
        engine.load_adapter("x", tmp_path / "ia3")
    with pytest.raises(NotImplementedError, match=r"adapter 'x' uses DoRA \(use_dora=True\)"):
        engine.load_adapter("x", random_lora(base, rank=2, use_dora=True))
    embedding = LoraConfig(r=2, target_modules=["embed_tokens"])
    state = get_peft_model_state_dict(get_peft_model(tiny_model("llama"), embedding))
    with pytest.raises(NotImplementedError, match="lora_embedding_A"):
        engine.load_adapter("x", (embedding, state))
    with pytest.raises(ValueError, match="no PEFT adapter directory"):
        engine.load_adapter("x", tmp_path)
    assert engine.adapters.names == ["qv", "mlp"]
    with pytest.raises(ValueError, match="max_rank must be a positive int, got 0"):
        Engine(base, block_size=4, num_blocks=64, max_rank=0, exact=True)
    wrapped = get_peft_model(tiny_model("llama"), LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="need the plain base model; this model holds PEFT adapter layers"):
        Engine(wrapped, block_size=4, num_blocks=64, adapters={"qv": adapters["qv"]}, exact=True)


def test_the_base_model_outside_the_engine_is_unchanged(adapters):
    base = tiny_model("llama")
    ids = torch.tensor([[3, 4, 5, 6]])
    before = base(ids).logits.detach()
    engine = Engine(base, block_size=4, num_blocks=64, adapters=adapters, exact=True)
    engine.generate([[3, 4, 5]], max_new_tokens=3, adapter="all")
    assert torch.equal(base(ids).logits.detach(), before)  # the hooks add nothing outside the engine's steps

    def hooked():
        return [m for m in base.modules() if isinstance(m, torch.nn.Linear) and m._forward_hooks]

    assert len(hooked()) == 2 * 7  # every linear of the 2 layers ("all" targets them all)
    del engine
    import gc

    gc.collect()
    assert not hooked()  # a dropped engine leaves no hook behind


@pytest.mark.parametrize("compiled", [False, True], ids=["exact", "compiled"])
def test_smollm2_three_adapters_and_the_base_match_peft_alone(smollm2, compiled, monkeypatch):
    model, tokenizer = smollm2
    monkeypatch.setattr(step_runner, "COMPILE_BACKEND", "aot_eager")  # traced by Dynamo; inductor: the tiny tests
    adapters = {
        "qv": random_lora(model, seed=1, rank=8, lora_alpha=32),
        "all": random_lora(model, seed=2, rank=4, lora_alpha=16, target_modules=ALL_LINEAR),
        "mlp": random_lora(model, seed=3, rank=16, lora_alpha=16, target_modules=("down_proj",)),
    }
    questions = ["What is the capital of France?", "Name a prime number.", "Say hi.", "Why is the sky blue?"]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in questions
    ]
    requests = [
        (tokenizer(prompts[i % 4], add_special_tokens=False)["input_ids"], NAMES[(i + i // 4) % 4], 6) for i in range(8)
    ]
    engine = Engine(
        model, tokenizer, block_size=16, num_blocks=256, max_num_batched_tokens=64, adapters=adapters,
        **({"compile": True} if compiled else {"exact": True}),
    )  # fmt: skip
    outputs, steps = run_interleaved(engine, requests, arrive_every=2)
    assert engine.runner.compiled_steps == (engine.runner.num_steps - 1 if compiled else 0)
    assert any(len(names) >= 3 for kind, names in steps if kind == "mixed")
    reference = PeftReference(model, adapters)
    for output, (prompt, adapter, count) in zip(outputs, requests):
        assert output.token_ids == reference.generate(prompt, adapter, count), adapter
    # requests 0 and 7 ran prompts 0 and 3 on the base; requests 4 and 3 the same prompts on adapters
    assert outputs[4].token_ids != outputs[0].token_ids and outputs[3].token_ids != outputs[7].token_ids
