"""Engine: continuous batching is token-identical to one `model.generate` per prompt, frees blocks at once, and
fails bad requests alone."""

from __future__ import annotations

import itertools
import random
import threading

import pytest
import torch
from transformers import GenerationConfig

import hf_paged
from hf_paged import Engine
from hf_paged.engine.prompts import sampling_params
from hf_paged.engine.scheduler import Step
from hf_paged.reference_models import tiny_model

pytestmark = pytest.mark.kernel_matrix  # every test runs on the in-place kernel and on gather


def mixed_prompts(count: int, vocab_size: int, seed: int = 0, longest: int = 40, most_new: int = 24):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(rng.randint(1, longest))] for _ in range(count)]
    return prompts, [rng.randint(1, most_new) for _ in prompts]


def alone(model, prompt: list[int], max_new_tokens: int, **options) -> list[int]:
    """The reference: the prompt generated alone with stock generate and DynamicCache."""
    output = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, **options)
    return output[0, len(prompt) :].tolist()


def drive(engine: Engine) -> dict[str, hf_paged.RequestOutput]:
    """Step until idle, checking the pool after every step; the final output of every request."""
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        engine.pool.check_invariants()
    return finals


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def workload(model):
    prompts, news = mixed_prompts(64, model.config.vocab_size)
    fixed = {"do_sample": False}
    expected = [alone(model, p, n, min_new_tokens=n, **fixed) for p, n in zip(prompts, news)]
    return prompts, news, expected


@pytest.mark.parametrize("num_blocks", [512, 40], ids=["roomy-pool", "pool-too-small"])
def test_greedy_matches_generate_alone(model, workload, num_blocks):
    prompts, news, expected = workload
    engine = Engine(model, block_size=4, num_blocks=num_blocks, exact=True)
    ids = [engine.add_request(p, max_new_tokens=n, min_new_tokens=n) for p, n in zip(prompts, news)]
    finals = drive(engine)
    assert [finals[i].token_ids for i in ids] == expected
    assert all(finals[i].finish_reason == "length" for i in ids)
    stats = engine.stats()
    assert stats.num_requests == 64 and stats.generated_tokens == sum(news)
    assert engine.pool.stats().num_used == 0
    if num_blocks == 40:  # 64 prompts need ~380 blocks at once: queueing and preemption are forced
        assert stats.preemptions > 0 and stats.peak_blocks <= 40
        assert any(finals[i].num_preemptions for i in ids)
    else:
        assert stats.preemptions == 0 and stats.prefill_steps == 1


@pytest.mark.parametrize(("max_prefill_tokens", "max_num_batched_tokens"), [(7, 512), (16, 512), (4096, 30)])
def test_chunked_prefill_matches_generate_alone(model, workload, max_prefill_tokens, max_num_batched_tokens):
    # prompts of up to 40 tokens in chunks of 7 or 16, among requests that keep decoding; sampled requests too.
    # (4096, 30): chunks are what 30 tokens a step leave next to the decoding requests, a different size each step
    prompts, news, expected = workload
    options = {"block_size": 4, "num_blocks": 512, "prefix_caching": False}  # every prompt token is computed
    budgets = {"max_prefill_tokens": max_prefill_tokens, "max_num_batched_tokens": max_num_batched_tokens}
    engine = Engine(model, max_batch_size=25, **budgets, **options, exact=True)
    ids = [engine.add_request(prompts[0], max_new_tokens=news[0], min_new_tokens=news[0])]
    engine.step()  # the others arrive while the first decodes
    ids += [engine.add_request(p, max_new_tokens=n, min_new_tokens=n) for p, n in zip(prompts[1:24], news[1:])]
    sampled = engine.add_request(prompts[0], max_new_tokens=10, do_sample=True, top_k=20, seed=5)
    finals, step_sizes = {}, []
    while engine.has_unfinished_requests():
        before = engine.stats().positions_computed
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
        step_sizes.append(engine.stats().positions_computed - before)
        engine.pool.check_invariants()
    assert [finals[i].token_ids for i in ids] == expected[:24]
    [solo] = Engine(model, **options, exact=True).generate(
        [prompts[0]], max_new_tokens=10, do_sample=True, top_k=20, seed=5
    )
    assert finals[sampled].token_ids == solo.token_ids
    stats = engine.stats()
    chunk = min(max_prefill_tokens, max_num_batched_tokens)
    chunks = sum(-(-len(p) // chunk) for p in prompts[1:24] if len(p) > chunk)
    # every chunk is a step carrying prompt tokens: prompt tokens alone, or with decoding requests' (mixed)
    assert stats.prefill_steps + stats.mixed_steps >= chunks and stats.generated_tokens == sum(news[:24]) + 10
    assert max(step_sizes[1:]) <= max_num_batched_tokens  # every step after the first had a request decoding
    assert engine.pool.stats().num_used == 0


def step_kind(engine: Engine, before) -> str:
    """The kind of the step just run, from the change in `engine.stats()` since `before`."""
    after = engine.stats()
    for kind in ("prefill", "decode", "mixed"):
        if getattr(after, f"{kind}_steps") > getattr(before, f"{kind}_steps"):
            return kind
    return "none"


@pytest.mark.parametrize(
    ("attention", "expected"),
    [("hf_paged", ["mixed"] * 5), ("sdpa", ["prefill", "decode"] * 5)],
    ids=["packed-mixed", "padded-alternating"],
)
def test_chunks_of_a_long_prompt_run_with_decode_steps(model, attention, expected):
    options = {"attn_implementation": attention, "prefix_caching": False}  # every chunk computed, in both runs
    engine = Engine(model, block_size=4, num_blocks=256, max_prefill_tokens=8, **options, exact=True)
    short = engine.add_request([5, 6, 7], max_new_tokens=30)
    engine.step()  # short is prefilled and decodes from now on
    engine.add_request(list(range(3, 43)), max_new_tokens=4)  # 40 tokens: 5 chunks of 8
    kinds = []
    while engine.has_unfinished_requests():
        before = engine.stats()
        outputs = engine.step()
        kinds.append(step_kind(engine, before))
        assert all(o.request_id == short or o.token_ids for o in outputs)  # a chunk short of the end reports nothing
    # packed: every chunk shares its step with the short request's decode (it never waits); padded: they alternate
    assert kinds[: len(expected)] == expected
    assert engine.pool.stats().num_used == 0


class UnmaskedEngine(Engine):
    """Negative control: lets every row attend to its left pads (padded steps)."""

    def _forward_inputs(self, step):
        inputs = super()._forward_inputs(step)
        inputs["attention_mask"] = torch.ones_like(inputs["attention_mask"])
        return inputs


class UnplacedEngine(Engine):
    """Negative control: packed steps without each token's own position (the model numbers the packed sequence)."""

    def _packed_inputs(self, step):
        inputs = super()._packed_inputs(step)
        del inputs["position_ids"]
        return inputs


def test_negative_control_unplaced_packed_tokens_change_outputs(model, workload):
    prompts, news, expected = workload
    engine = UnplacedEngine(model, block_size=4, num_blocks=512, prefix_caching=False, exact=True)  # its K/V are wrong
    outputs = engine.generate(prompts[:16], max_new_tokens=8, min_new_tokens=8)
    assert engine.last_stats.pad_positions == 0  # the steps were packed
    assert [o.token_ids for o in outputs] != [e[:8] for e in expected[:16]]


def test_negative_control_unmasked_pads_change_outputs(model, workload):
    prompts, news, expected = workload
    engine = UnmaskedEngine(
        model, block_size=4, num_blocks=512, attn_implementation="sdpa", prefix_caching=False, exact=True
    )
    outputs = engine.generate(prompts[:16], max_new_tokens=8, min_new_tokens=8)
    assert [o.token_ids for o in outputs] != [e[:8] for e in expected[:16]]


def test_generate_returns_outputs_in_input_order(model, workload):
    prompts, news, expected = workload
    engine = Engine(model, block_size=8, num_blocks=256, exact=True)
    eos = model.generation_config.eos_token_id
    configs = [GenerationConfig(max_new_tokens=n, min_new_tokens=n, eos_token_id=eos) for n in news[:10]]
    outputs = engine.generate(prompts[:10], configs)
    assert [o.token_ids for o in outputs] == expected[:10]
    assert engine.last_stats.num_requests == 10
    assert engine.pool.stats().num_used == 0


def test_sampling_with_a_seed_ignores_the_rest_of_the_batch(model, workload):
    prompts, _, _ = workload
    options = {
        "do_sample": True,
        "top_k": 20,
        "top_p": 0.9,
        "temperature": 0.8,
        "max_new_tokens": 12,
        "eos_token_id": 2,
    }
    engine = Engine(model, block_size=4, num_blocks=256, exact=True)
    [solo] = engine.generate([prompts[0]], seed=1234, **options)
    crowd = engine.generate(
        prompts[:12], [hf_paged.SamplingParams(seed=1234 if i == 0 else i, **options) for i in range(12)]
    )
    assert crowd[0].token_ids == solo.token_ids
    again = engine.generate(prompts[5:0:-1] + [prompts[0]], seed=1234, **options)
    assert again[-1].token_ids == solo.token_ids
    assert len({tuple(o.token_ids) for o in crowd}) > 1


def test_abort_mid_stream_frees_blocks_at_once(model, workload):
    prompts, _, _ = workload
    engine = Engine(model, block_size=4, num_blocks=256, exact=True)
    stream = engine.stream(prompts[:4], max_new_tokens=30, min_new_tokens=30)
    first = next(stream)
    held = engine.pool.stats().num_used
    output = engine.abort(first.request_id)
    assert output.finish_reason == "abort" and output.finished
    assert engine.pool.stats().num_used < held
    assert engine.abort(first.request_id) is None  # already gone
    finals = {o.request_id: o for o in stream if o.finished}
    assert len(finals) == 4 and finals[first.request_id].finish_reason == "abort"
    assert sorted(o.finish_reason for o in finals.values()) == ["abort", "length", "length", "length"]
    assert engine.pool.stats().num_used == 0


def test_closing_a_stream_early_aborts_its_requests(model, workload):
    prompts, _, _ = workload
    engine = Engine(model, block_size=4, num_blocks=256, exact=True)
    stream = engine.stream(prompts[:3], max_new_tokens=20, min_new_tokens=20)
    next(stream)
    stream.close()
    assert engine.pool.stats().num_used == 0 and not engine.has_unfinished_requests()


def test_stream_deltas_add_up_to_generate(model, workload):
    prompts, news, expected = workload
    engine = Engine(model, block_size=4, num_blocks=256, exact=True)
    pieces: dict[str, list[int]] = {}
    finals = {}
    for output in engine.stream(prompts[:6], max_new_tokens=10, min_new_tokens=10):
        pieces.setdefault(output.request_id, []).extend(output.new_token_ids)
        assert output.token_ids[-len(output.new_token_ids) :] == output.new_token_ids
        if output.finished:
            finals[output.request_id] = output
    assert len(finals) == 6
    assert all(pieces[i] == finals[i].token_ids for i in finals)
    assert sorted(len(p) for p in pieces.values()) == [10] * 6


def test_prompt_larger_than_the_pool_fails_alone(model, workload):
    prompts, news, expected = workload
    engine = Engine(model, block_size=4, num_blocks=16, exact=True)
    huge = list(range(3, 3 + 70))  # 70 tokens + 1 need 18 blocks of 4
    outputs = engine.generate([prompts[0], huge, prompts[1]], max_new_tokens=5, min_new_tokens=5)
    assert outputs[1].finish_reason == "error" and outputs[1].token_ids == []
    assert "18 blocks" in outputs[1].error and "16 blocks" in outputs[1].error
    assert outputs[0].token_ids == expected[0][:5] and outputs[2].token_ids == expected[1][:5]
    assert engine.pool.stats().num_used == 0


def test_a_request_blocked_by_blocks_held_outside_the_engine_fails_instead_of_waiting_forever(model):
    engine = Engine(model, block_size=4, num_blocks=16, exact=True)
    outside = hf_paged.PagedCache(model, block_size=4, num_blocks=16)
    model.generate(torch.tensor([list(range(3, 43))]), past_key_values=outside, max_new_tokens=8)  # 12 blocks held
    short, blocked = engine.generate([[5, 6, 7], list(range(50, 70))], max_new_tokens=2)
    assert short.finish_reason == "length" and len(short.token_ids) == 2  # 1 block: fits in the 4 free
    assert blocked.finish_reason == "error" and "needs 5 free blocks but only 4 of the pool's 16" in blocked.error
    outside.release()
    (again,) = engine.generate([list(range(50, 70))], max_new_tokens=2)
    assert again.finish_reason == "length" and engine.pool.stats().num_used == 0


def test_the_held_elsewhere_error_counts_blocks_as_they_were_when_admission_failed(model):
    engine = Engine(model, block_size=4, num_blocks=16, exact=True)
    prefix = list(range(50, 62))
    engine.generate([[*prefix, 1]], max_new_tokens=1)  # 3 full blocks cached, free to evict
    outside = hf_paged.PagedCache(model, block_size=4, num_blocks=16)
    model.generate(torch.tensor([list(range(3, 43))]), past_key_values=outside, max_new_tokens=8)  # 12 blocks held
    (blocked,) = engine.generate([[*prefix, 70, 71, 72, 73, 74]], max_new_tokens=2)  # 3 cached + 2 new blocks
    outside.release()
    assert blocked.finish_reason == "error"
    assert "needs 2 free blocks besides the 3 of its cached prefix but only 1 of the pool's 16" in blocked.error


def test_a_sequence_outgrowing_the_whole_pool_ends_with_reason_length_and_its_tokens(model):
    engine = Engine(model, block_size=4, num_blocks=4, exact=True)
    [output] = engine.generate([[5, 6, 7]], max_new_tokens=40, min_new_tokens=40)
    assert output.finish_reason == "length" and "4 blocks in all" in output.error
    assert len(output.token_ids) == 4 * 4 - 3 + 1  # the pool holds 16 positions; the last token is never stored
    assert engine.pool.stats().num_used == 0


def test_eos_ends_a_request_with_reason_stop(model, workload):
    prompts, news, expected = workload
    index = next(i for i, e in enumerate(expected) if len(e) >= 4 and e[3] not in e[:3])
    eos = expected[index][3]
    engine = Engine(model, block_size=4, num_blocks=128, exact=True)
    [output] = engine.generate([prompts[index]], max_new_tokens=20, eos_token_id=eos)
    assert output.token_ids == expected[index][:4] and output.finish_reason == "stop"


def test_max_new_tokens_zero_returns_at_once(model):
    engine = Engine(model, block_size=4, num_blocks=32, exact=True)
    [output] = engine.generate([[5, 6, 7]], max_new_tokens=0)
    assert output.token_ids == [] and output.finish_reason == "length"


def test_shared_prefixes_are_reused_and_stay_exact(model):
    rng = random.Random(3)
    system = [rng.randrange(3, 128) for _ in range(32)]
    prompts = [system + [rng.randrange(3, 128) for _ in range(rng.randint(1, 9))] for _ in range(12)]
    expected = [alone(model, p, 6, min_new_tokens=6, do_sample=False) for p in prompts]
    engine = Engine(model, block_size=8, num_blocks=256, exact=True)
    engine.generate(prompts[:1], max_new_tokens=6, min_new_tokens=6)  # puts the system prompt's blocks in the cache
    outputs = engine.generate(prompts, max_new_tokens=6, min_new_tokens=6)
    assert [o.token_ids for o in outputs] == expected
    assert engine.last_stats.prefix_hit_rate > 0.5
    assert all(o.prefix_tokens_reused >= 32 for o in outputs)


def test_a_failing_forward_fails_its_batch_and_the_engine_recovers(model, workload):
    prompts, news, expected = workload
    engine = Engine(model, block_size=4, num_blocks=128, exact=True)
    calls = {"n": 0}

    def fail_third_forward(module, args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")

    handle = model.model.layers[1].register_forward_pre_hook(fail_third_forward)
    try:
        ids = [engine.add_request(p, max_new_tokens=6, min_new_tokens=6) for p in prompts[:3]]
        with pytest.raises(RuntimeError, match="injected failure"):
            drive(engine)
    finally:
        handle.remove()
    engine.pool.check_invariants()
    assert engine.pool.stats().num_used == 0
    failed = drive(engine)  # the failed requests are reported, with the error
    assert {o.finish_reason for o in failed.values()} == {"error"} and set(failed) == set(ids)
    assert "injected failure" in failed[ids[0]].error
    outputs = engine.generate(prompts[:3], max_new_tokens=6, min_new_tokens=6)
    assert [o.token_ids for o in outputs] == [e[:6] for e in expected[:3]]


class FailsOnToken:
    """A tokenizer whose `decode` raises on one token id (as sentencepiece does for an id past its vocabulary)."""

    eos_token_id = None

    def __init__(self, bad_token: int):
        self.bad_token = bad_token

    def decode(self, ids, skip_special_tokens=True):
        if self.bad_token in ids:
            raise IndexError("piece id is out of range")
        return " ".join(map(str, ids))


def test_a_token_the_tokenizer_cannot_decode_fails_its_request_alone(model, workload):
    prompts, news, expected = workload
    bad = 77
    engine = Engine(model, FailsOnToken(bad), block_size=4, num_blocks=128, exact=True)
    failing = engine.add_request(prompts[0], max_new_tokens=6, logit_bias={bad: 100.0})
    others = [engine.add_request(p, max_new_tokens=6, min_new_tokens=6) for p in prompts[1:4]]
    finals = drive(engine)  # every step returns: the failure stays with its request
    assert finals[failing].finish_reason == "error" and finals[failing].token_ids == [bad]
    assert "decoding token 77 failed: IndexError: piece id is out of range" in finals[failing].error
    assert [finals[i].token_ids for i in others] == [e[:6] for e in expected[1:4]]
    assert [finals[i].finish_reason for i in others] == ["length"] * 3
    assert engine.pool.stats().num_used == 0


def test_requests_added_from_another_thread_join_the_batch(model, workload):
    prompts, news, expected = workload
    engine = Engine(model, block_size=4, num_blocks=256, exact=True)
    first = engine.add_request(prompts[0], max_new_tokens=news[0], min_new_tokens=news[0])
    engine.step()
    ids = []
    worker = threading.Thread(
        target=lambda: ids.extend(
            engine.add_request(p, max_new_tokens=n, min_new_tokens=n) for p, n in zip(prompts[1:8], news[1:8])
        )
    )
    worker.start()
    worker.join()
    finals = drive(engine)
    assert [finals[i].token_ids for i in [first, *ids]] == expected[:8]


@pytest.mark.parametrize(
    ("prompt", "options", "message"),
    [
        ([], {}, "the prompt is empty"),
        ([1, 2.5], {}, r"token ids must be ints in \[0, 128\), got \[2.5\]"),
        ([1, 500], {}, r"token ids must be ints in \[0, 128\), got \[500\]"),
        ("hello", {}, "string prompts need a tokenizer"),
        ([1, 2], {"stop": ["x"]}, "stop strings"),
        ([1, 2], {"max_new_tokens": -1}, "max_new_tokens must be an int >= 0, got -1"),
        ([1, 2], {"top_p": 1.5, "do_sample": True}, r"top_p must be in \(0, 1\] when sampling, got 1.5"),
        ([1, 2], {"temperature": 0.0, "do_sample": True}, "temperature must be > 0 when sampling, got 0.0"),
        (list(range(1, 100)) * 6, {}, "594 tokens; the model.s context window is 512 tokens"),
    ],
)
def test_bad_requests_are_refused_clearly(model, prompt, options, message):
    engine = Engine(model, block_size=4, num_blocks=32, exact=True)
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, **options)
    assert not engine.has_unfinished_requests() and engine.pool.stats().num_used == 0


def test_unknown_option_and_bad_engine_settings(model):
    engine = Engine(model, block_size=4, num_blocks=32, exact=True)
    with pytest.raises(TypeError, match=r"unknown generation options \['beams'\]"):
        engine.add_request([1, 2], beams=4)
    with pytest.raises(ValueError, match="max_batch_size must be a positive int, got 0"):
        Engine(model, max_batch_size=0, block_size=4, num_blocks=32, exact=True)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be at least max_batch_size \(16\)"):
        Engine(model, max_batch_size=16, max_num_batched_tokens=8, block_size=4, num_blocks=32, exact=True)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1, 2], request_id="a")
        engine.add_request([1, 2], request_id="a")
    engine.close()
    assert engine.pool.stats().num_used == 0


def test_progress_bar_only_when_asked(model, capsys):
    engine = Engine(model, block_size=4, num_blocks=64, exact=True)
    engine.generate([[1, 2, 3]] * 3, max_new_tokens=2, progress=True)
    assert "3/3" in capsys.readouterr().err
    engine.generate([[1, 2, 3]] * 3, max_new_tokens=2)  # stderr is not a terminal under pytest
    assert "3/3" not in capsys.readouterr().err


def test_step_kinds(model):
    engine = Engine(model, block_size=4, num_blocks=64, exact=True)
    engine.add_request([1, 2, 3], max_new_tokens=3)
    step, failed = engine.scheduler.schedule()
    assert isinstance(step, Step) and step.kind == "prefill" and step.new_tokens == [3] and not failed
    engine.close()
    assert engine.pool.stats().num_used == 0


# ---------------------------------------------------------------------- SmolLM2-135M end to end
QUESTIONS = [
    "What is a page table?",
    "Name three colours.",
    "Write a haiku about memory.",
    "Why is the sky blue? Answer in one sentence.",
    "List two prime numbers.",
    "What does a cache do?",
    "Say hello in French.",
    "Explain copy-on-write briefly.",
]


@pytest.fixture(scope="module")
def chat_workload(smollm2):
    model, tokenizer = smollm2
    rng = random.Random(7)
    prompts, news = [], []
    for index in range(64):
        question = QUESTIONS[index % len(QUESTIONS)] + " " * rng.randint(0, 3) + "Detail." * rng.randint(0, 3)
        messages = [{"role": "user", "content": question}]
        prompts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
        if isinstance(prompts[-1], dict) or hasattr(prompts[-1], "keys"):
            prompts[-1] = prompts[-1]["input_ids"]
        news.append(rng.randint(2, 8))
    expected = [alone(model, p, n, do_sample=False) for p, n in zip(prompts, news)]
    return prompts, news, expected


@pytest.mark.slow
@pytest.mark.parametrize(("block_size", "num_blocks"), [(16, 256), (4, 40)], ids=["roomy-pool", "pool-too-small"])
def test_smollm2_engine_matches_generate_alone(smollm2, chat_workload, block_size, num_blocks):
    model, tokenizer = smollm2
    prompts, news, expected = chat_workload
    engine = Engine(model, tokenizer, block_size=block_size, num_blocks=num_blocks, exact=True)
    ids = [engine.add_request(p, max_new_tokens=n) for p, n in zip(prompts, news)]
    finals = drive(engine)
    assert [finals[i].token_ids for i in ids] == expected
    assert finals[ids[0]].text == tokenizer.decode(expected[0], skip_special_tokens=True)
    stats = engine.stats()
    assert engine.pool.stats().num_used == 0
    if num_blocks == 40:  # recomputed requests find their full blocks (and the shared system prompt) cached
        assert stats.preemptions > 0 and stats.peak_blocks <= 40 and stats.prefix_hit_rate > 0


@pytest.mark.slow
def test_smollm2_chunked_prefill_matches_generate_alone(smollm2, chat_workload):
    # chat prompts of about 40 tokens in chunks of 16, without the prefix cache: every chunk is computed
    model, tokenizer = smollm2
    prompts, news, expected = chat_workload
    engine = Engine(
        model, tokenizer, block_size=16, num_blocks=256, max_prefill_tokens=16, prefix_caching=False, exact=True
    )
    ids = [engine.add_request(p, max_new_tokens=n) for p, n in zip(prompts[:16], news)]
    finals = drive(engine)
    assert [finals[i].token_ids for i in ids] == expected[:16]
    stats = engine.stats()  # every chunk is a step with prompt tokens (alone, or mixed with decoding requests')
    assert stats.prefill_steps + stats.mixed_steps >= sum(-(-len(p) // 16) for p in prompts[:16])
    assert engine.pool.stats().num_used == 0


def test_smollm2_stop_strings_and_streamed_text(smollm2):
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer, block_size=16, num_blocks=128, exact=True)
    messages = [{"role": "user", "content": "Count from one to ten in words, separated by commas."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    [full] = engine.generate([prompt], max_new_tokens=24)
    assert len(full.text) > 8, full.text
    stop = full.text[5:7]
    cut = full.text.index(stop)
    streamed = "".join(o.new_text for o in engine.stream([prompt], max_new_tokens=24, stop=[stop]))
    [stopped] = engine.generate([prompt], max_new_tokens=24, stop_strings=[stop])
    assert stopped.text == full.text[:cut] == streamed
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) < len(full.token_ids)
    assert engine.pool.stats().num_used == 0


def test_smollm2_stop_strings_follow_generate_across_the_prompt_and_refuse_special_tokens(smollm2):
    """`generate`'s stop strings watch the whole sequence: one that begins in the prompt and ends in the first token
    stops there (the Engine searched the output only and ran on). A stop string holding a special token's text
    never matched the text, which skips special tokens: refused, naming the id to end on."""
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer, block_size=16, num_blocks=64, exact=True)
    prompt = tokenizer("The capital of France is", return_tensors="pt").input_ids
    options = {"max_new_tokens": 10, "do_sample": False}
    stock = model.generate(prompt, stop_strings=[" is Paris"], tokenizer=tokenizer, **options)[0, prompt.shape[1] :]
    assert tokenizer.decode(stock) == " Paris"
    [stopped] = engine.generate(prompt, stop=[" is Paris"], **options)
    assert stopped.token_ids == stock.tolist() and stopped.finish_reason == "stop" and stopped.text == ""
    [inside] = engine.generate(prompt, stop=["France"], **options)  # only in the prompt: no stop
    assert inside.finish_reason == "length" and len(inside.token_ids) == 10
    with pytest.raises(ValueError, match=r"stop string '<\|im_end\|>' holds the special token .* eos_token_id=2"):
        engine.add_request(prompt[0], stop=["<|im_end|>"])
    messages = [{"role": "user", "content": "Hi"}]
    for call in (lambda: engine.add_request(messages), lambda: engine.generate([messages])):
        with pytest.raises(ValueError, match="apply the chat template first"):
            call()
    assert not engine.has_unfinished_requests() and engine.pool.stats().num_used == 0


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_with_and_without_the_prefix_cache(model, prefix_caching):
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 9, 10, 11, 12, 14, 15, 16]]
    expected = [alone(model, p, 5, min_new_tokens=5, do_sample=False) for p in prompts]
    engine = Engine(model, block_size=2, num_blocks=12, prefix_caching=prefix_caching, exact=True)
    outputs = engine.generate(prompts * 3, max_new_tokens=5, min_new_tokens=5)
    assert [o.token_ids for o in outputs] == expected * 3
    assert engine.last_stats.preemptions > 0 and engine.pool.stats().num_used == 0
    assert (engine.last_stats.prefix_hit_rate > 0) == prefix_caching


# ---------------------------------------------------------------------- packed steps: no pad position
def test_packed_steps_compute_no_pad_position(model, workload):
    prompts, news, expected = workload
    computed, eos = [], model.generation_config.eos_token_id
    hook = model.get_input_embeddings().register_forward_pre_hook(lambda m, args: computed.append(args[0].numel()))
    try:
        engine = Engine(model, block_size=4, num_blocks=512, max_prefill_tokens=32, exact=True)
        configs = [GenerationConfig(max_new_tokens=n, min_new_tokens=n, eos_token_id=eos) for n in news[:12]]
        outputs = engine.generate(prompts[:12], configs)
    finally:
        hook.remove()
    assert [o.token_ids for o in outputs] == expected[:12]
    stats = engine.last_stats
    real = sum(len(p) for p in prompts[:12]) + sum(n - 1 for n in news[:12])  # prompts, then fed-back tokens
    assert sum(computed) == stats.positions_computed == real and stats.pad_positions == 0
    assert stats.mixed_steps > 0


def test_negative_control_padded_steps_count_their_pads(model, workload):
    prompts, _, _ = workload
    engine = Engine(model, block_size=4, num_blocks=512, max_prefill_tokens=256, attn_implementation="sdpa", exact=True)
    engine.generate(prompts[:12], max_new_tokens=8, min_new_tokens=8)
    stats = engine.last_stats  # stock attention reads dense K/V: right-aligned rows, pads through the model
    assert stats.pad_positions > 0 and stats.mixed_steps == 0 and stats.pad_share > 0


def test_an_eager_model_runs_packed_steps_in_eager_math(workload):
    model = tiny_model("llama", attn_implementation="eager")
    prompts, news, _ = workload
    expected = [alone(model, p, n, min_new_tokens=n, do_sample=False) for p, n in zip(prompts[:12], news)]

    def served(engine: Engine) -> list[list[int]]:
        ids = [engine.add_request(p, max_new_tokens=n, min_new_tokens=n) for p, n in zip(prompts[:12], news)]
        finals = drive(engine)
        return [finals[i].token_ids for i in ids]

    with Engine(model, block_size=4, num_blocks=256, exact=True) as engine:
        assert served(engine) == expected
        stats = engine.stats()
        assert stats.pad_positions == 0 and stats.prefill_steps + stats.mixed_steps >= 1  # packed: no pad position
        assert engine.cache.eager_math  # the "hf_paged" attention computed in eager attention's ops
    assert model.config._attn_implementation == "eager"  # the model is handed back as it was
    # asked for by name, the stock attention is kept: padded steps reading dense K/V
    with Engine(model, block_size=4, num_blocks=256, attn_implementation="eager", exact=True) as padded:
        assert served(padded) == expected
        assert padded.stats().pad_positions > 0 and not padded.cache.eager_math


# ---------------------------------------------------------------------- callers, ids, prompts and configs
def test_a_failing_generate_leaves_nothing_of_its_call_behind(model, workload):
    """A bad last prompt used to leave the earlier ones queued, and an interrupted call its requests waiting or
    running: the next `generate` of one prompt ran them all, and nobody ever got their outputs."""
    prompts, news, expected = workload
    engine = Engine(model, block_size=4, num_blocks=128, exact=True)
    with pytest.raises(ValueError, match="token ids must be ints"):
        engine.generate([prompts[0], prompts[1], [1, 500]], max_new_tokens=4)
    assert not engine.has_unfinished_requests() and engine.pool.stats().num_used == 0
    calls = {"n": 0}

    def interrupt_third_forward(module, args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt

    handle = model.model.layers[1].register_forward_pre_hook(interrupt_third_forward)
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.generate(prompts[:4], max_new_tokens=8)
    finally:
        handle.remove()
    engine.pool.check_invariants()
    assert not engine.has_unfinished_requests() and engine.pool.stats().num_used == 0
    [only] = engine.generate([prompts[5]], max_new_tokens=news[5], min_new_tokens=news[5])
    assert only.token_ids == expected[5] and engine.last_stats.num_requests == 1


def test_automatic_ids_skip_the_ids_callers_chose(model, workload):
    prompts, news, expected = workload
    engine = Engine(model, block_size=4, num_blocks=128, exact=True)
    chosen = engine.add_request(prompts[0], request_id="req-1", max_new_tokens=news[0], min_new_tokens=news[0])
    automatic = [engine.add_request(p, max_new_tokens=n, min_new_tokens=n) for p, n in zip(prompts[1:3], news[1:3])]
    assert len({chosen, *automatic}) == 3
    finals = drive(engine)
    assert [finals[i].token_ids for i in [chosen, *automatic]] == expected[:3]


def test_generate_leaves_other_callers_final_outputs_to_step(model, workload):
    """A request another caller queued finishes while `generate` steps for its own: its final output used to be
    dropped with it (the request forgotten, `abort` returning None); the next `step()` reports it."""
    prompts, news, expected = workload
    engine = Engine(model, block_size=4, num_blocks=128, exact=True)
    other = engine.add_request(prompts[0], max_new_tokens=2, min_new_tokens=2)
    [mine] = engine.generate([prompts[1]], max_new_tokens=news[1], min_new_tokens=news[1])
    assert mine.token_ids == expected[1]
    [reported] = engine.step()
    assert reported.request_id == other and reported.finished and reported.token_ids == expected[0][:2]
    assert engine.step() == [] and engine.pool.stats().num_used == 0


def test_sampling_without_top_k_uses_generates_default(model):
    """Stock `generate` samples with top_k=50 when neither the model's config nor the call sets it; the Engine
    sampled from the whole vocabulary."""
    prompt = [5, 6, 7, 8]
    engine = Engine(model, block_size=4, num_blocks=64, exact=True)
    for seed in range(4):
        torch.manual_seed(seed)
        stock = model.generate(torch.tensor([prompt]), do_sample=True, max_new_tokens=8, min_new_tokens=8)
        [output] = engine.generate([prompt], do_sample=True, max_new_tokens=8, min_new_tokens=8, seed=seed)
        assert output.token_ids == stock[0, len(prompt) :].tolist()
    defaults = model.generation_config
    assert sampling_params(None, {"do_sample": True}, defaults).top_k == 50
    assert sampling_params(hf_paged.SamplingParams(do_sample=True), {}, defaults).top_k == 0  # SamplingParams' own


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (GenerationConfig(max_length=8), "max_length=8"),
        (GenerationConfig(num_beams=3), "num_beams=3"),
        (GenerationConfig(bad_words_ids=[[5]]), "bad_words_ids"),
        (GenerationConfig(suppress_tokens=[5]), "suppress_tokens"),
        (GenerationConfig(min_length=6), "min_length=6"),
    ],
)
def test_generation_config_options_the_engine_does_not_implement_are_refused(model, config, message):
    engine = Engine(model, block_size=4, num_blocks=32, exact=True)
    with pytest.raises(ValueError, match=f"{message}.*which the Engine does not implement"):
        engine.add_request([1, 2, 3], config)
    assert not engine.has_unfinished_requests()
    engine.add_request([1, 2, 3], GenerationConfig(max_length=8, max_new_tokens=3))  # max_new_tokens wins
    with pytest.raises(TypeError, match="generation_config must be a GenerationConfig or SamplingParams, got dict"):
        engine.add_request([1, 2, 3], {"max_new_tokens": 3})
    engine.close()


def test_prompt_forms(model, workload):
    np = pytest.importorskip("numpy")
    prompts, news, expected = workload
    engine = Engine(model, block_size=4, num_blocks=128, exact=True)
    options = {"max_new_tokens": news[0], "min_new_tokens": news[0]}
    as_numpy = [np.int64(t) for t in prompts[0]]
    assert [o.token_ids for o in engine.generate([as_numpy], **options)] == [expected[0]]
    assert [o.token_ids for o in engine.generate(np.array(prompts[0]), **options)] == [expected[0]]
    with pytest.raises(ValueError, match=r"must be 1-D or \[1, length\], got shape \(2, 3\)"):
        engine.add_request(torch.tensor([[5, 6, 7], [8, 9, 10]]))  # was one prompt of 6 tokens
    for bad in (None, 5.0, []):
        with pytest.raises(ValueError, match="prompts must be a string, token ids, a tensor"):
            engine.generate(bad)
    assert not engine.has_unfinished_requests() and engine.pool.stats().num_used == 0


def test_weights_edited_while_a_request_runs_leave_no_stale_block_in_the_prefix_cache():
    """A block half-filled before a weight update and filled after it holds K/V of both weights: a later request
    with the same tokens must not reuse it (its output must equal stock generate under the new weights)."""
    model = tiny_model("llama")
    engine = Engine(model, block_size=4, num_blocks=64, exact=True)
    first = engine.add_request([11, 12], max_new_tokens=8, min_new_tokens=8)
    engine.step()  # the prompt's 2 tokens are stored with the old weights; block 0 is not full yet
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(3.0)
            layer.self_attn.v_proj.weight.mul_(-2.0)
    finals = drive(engine)  # block 0 fills with K/V of the new weights
    prompt = [11, 12, *finals[first].token_ids[:6], 40, 41]
    outputs = engine.generate([prompt], max_new_tokens=8, min_new_tokens=8)
    assert outputs[0].prefix_tokens_reused == 0
    assert outputs[0].token_ids == alone(model, prompt, 8, min_new_tokens=8, do_sample=False)
    engine.close()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_step_under_checkpointing_in_training_mode_is_refused_and_the_requests_wait(model, workload):
    prompts, news, expected = workload
    engine = Engine(model, block_size=4, num_blocks=128, exact=True)
    ids = [engine.add_request(p, max_new_tokens=5, min_new_tokens=5) for p in prompts[:2]]
    model.activation_checkpointing_enable()
    model.train()
    try:
        with pytest.raises(ValueError, match="drop the KV cache"):
            engine.step()
        assert engine.pool.stats().num_used == 0 and engine.has_unfinished_requests()
    finally:
        model.eval()
        model.activation_checkpointing_disable()
    finals = drive(engine)
    assert [finals[i].token_ids for i in ids] == [e[:5] for e in expected[:2]]


def test_an_engine_follows_a_resized_vocabulary():
    model = tiny_model("llama")
    engine = Engine(model, block_size=4, num_blocks=64, exact=True)
    engine.generate([[5, 6, 7]], max_new_tokens=2)
    model.resize_token_embeddings(160)
    prompt = [5, 140, 150, 7]
    (output,) = engine.generate([prompt], max_new_tokens=4, min_new_tokens=4, logit_bias={155: 0.5})
    assert output.token_ids == alone(model, prompt, 4, min_new_tokens=4, do_sample=False, sequence_bias={(155,): 0.5})
    with pytest.raises(ValueError, match=r"token ids must be ints in \[0, 160\), got \[160\]"):
        engine.add_request([5, 160])


def test_streams_consumed_in_turn_by_one_thread_each_get_every_piece(model, workload):
    """Two streams read alternately (`zip_longest`), and a `generate` run while a stream is paused: each call takes
    all of its own pieces, whoever stepped (this hung: a stream waited for a final output the other one held)."""
    prompts, news, expected = workload
    engine = Engine(model, block_size=4, num_blocks=128, exact=True)
    first = engine.stream(prompts[0:2], max_new_tokens=3, min_new_tokens=3)
    second = engine.stream(prompts[2:4], max_new_tokens=6, min_new_tokens=6)
    pieces: dict[str, list[int]] = {}
    finals = {}
    for pair in itertools.zip_longest(first, second):
        for output in filter(None, pair):
            pieces.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finished:
                finals[output.request_id] = output.token_ids
    assert len(finals) == 4 and all(pieces[i] == finals[i] for i in finals)
    assert sorted(finals.values()) == sorted([e[:3] for e in expected[0:2]] + [e[:6] for e in expected[2:4]])
    paused = engine.stream(prompts[4:5], max_new_tokens=6, min_new_tokens=6)
    streamed = list(next(paused).new_token_ids)
    (between,) = engine.generate(prompts[5:6], max_new_tokens=4, min_new_tokens=4)
    streamed += [token for output in paused for token in output.new_token_ids]
    assert streamed == expected[4][:6] and between.token_ids == expected[5][:4]
    assert not engine.has_unfinished_requests() and not engine._router._collectors


def test_greedy_requests_ignore_the_sampling_warpers_as_generate_does(model, workload):
    """`generate(do_sample=False, temperature=0.0)` runs (transformers warns the flag is ignored); so does the
    Engine, also when the 0 comes from the model's generation config (every request was refused)."""
    prompts, news, expected = workload
    engine = Engine(model, block_size=4, num_blocks=128, exact=True)
    (output,) = engine.generate(prompts[:1], max_new_tokens=4, min_new_tokens=4, temperature=0.0, top_p=0.0)
    assert output.token_ids == expected[0][:4]
    config = GenerationConfig(do_sample=False, temperature=0.0, max_new_tokens=4, min_new_tokens=4)
    (output,) = engine.generate(prompts[:1], config)
    assert output.token_ids == expected[0][:4]


def test_a_tokenizers_output_is_taken_as_its_prompts(smollm2):
    """`apply_chat_template` returns a `BatchEncoding` in transformers 5; a padded batch encoding's pads are not
    prompt tokens (both were refused); raw chat messages are refused with the way to apply the template."""
    model, tokenizer = smollm2
    engine = Engine(model, tokenizer, block_size=16, num_blocks=64, exact=True)
    messages = [{"role": "user", "content": "Name a colour."}]
    encoding = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = list(encoding["input_ids"])
    (from_ids,) = engine.generate([ids], max_new_tokens=4)
    (from_encoding,) = engine.generate(encoding, max_new_tokens=4)
    assert from_encoding.prompt_token_ids == ids and from_encoding.token_ids == from_ids.token_ids
    texts = ["Hello there", "A much longer prompt than the first one"]
    batch = tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    unpadded = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert [o.prompt_token_ids for o in engine.generate(batch, max_new_tokens=2)] == unpadded
    with pytest.raises(ValueError, match=r"apply the chat template first, e.g. tokenizer.apply_chat_template"):
        engine.generate(messages, max_new_tokens=2)
    engine.close()


def test_a_padded_tensor_of_prompts_loses_its_pads_as_generate_masks_them(model, workload):
    """Without an attention mask, `generate` masks a 2-D tensor's pad tokens (unless the pad is also an
    end-of-sequence token); so does `Engine.generate` (it took every column as a prompt token)."""
    prompts, _, _ = workload
    short, long = prompts[0][:3], prompts[1][:7]
    padded = torch.tensor([[0] * 4 + short, long])
    assert model.generation_config.pad_token_id == 0 and 0 not in short + long
    stock = model.generate(padded, max_new_tokens=5, min_new_tokens=5, do_sample=False)[:, padded.shape[1] :]
    engine = Engine(model, block_size=4, num_blocks=64, exact=True)
    outputs = engine.generate(padded, max_new_tokens=5, min_new_tokens=5)
    assert [o.prompt_token_ids for o in outputs] == [short, long]
    assert [o.token_ids for o in outputs] == stock.tolist()
    assert [o.token_ids for o in outputs] == [
        alone(model, p, 5, min_new_tokens=5, do_sample=False) for p in (short, long)
    ]
    # the pad is an end-of-sequence token: generate cannot tell pads apart and keeps them; so does the Engine
    options = {"max_new_tokens": 3, "min_new_tokens": 3, "eos_token_id": [0, 2]}
    (kept,) = engine.generate(padded[:1], **options)
    assert kept.prompt_token_ids == padded[0].tolist()
    assert kept.token_ids == model.generate(padded[:1], do_sample=False, **options)[0, padded.shape[1] :].tolist()
    engine.close()


def test_an_engine_takes_cache_config_as_generate_does(model):
    engine = Engine(model, cache_config=hf_paged.PagedCacheConfig(block_size=8, num_blocks=40), exact=True)
    assert (engine.pool.block_size, engine.pool.num_blocks) == (8, 40)
    engine = Engine(model, cache_config={"block_size": 4}, num_blocks=32, exact=True)
    assert (engine.pool.block_size, engine.pool.num_blocks) == (4, 32)


def test_abort_of_an_id_the_engine_does_not_know_raises_key_error(model):
    engine = Engine(model, block_size=4, num_blocks=64, exact=True)
    with pytest.raises(KeyError, match="no request 'never-added' in this engine"):
        engine.abort("never-added")
    request_id = engine.add_request([5, 6, 7], max_new_tokens=2, do_sample=False)
    finals = drive(engine)  # finished and reported: forgotten
    assert finals[request_id].finish_reason == "length"
    with pytest.raises(KeyError, match=repr(request_id)):
        engine.abort(request_id)
    assert engine.pool.stats().num_used == 0


def test_last_stats_follow_steps_the_caller_drives(model):
    engine = Engine(model, block_size=4, num_blocks=64, exact=True)
    assert engine.last_stats is None
    for prompt in ([5, 6, 7], [8, 9]):
        engine.add_request(prompt, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    drive(engine)
    stats = engine.last_stats
    assert stats is not None and stats.num_requests == 2 and stats.generated_tokens == 6
    assert stats.num_steps == engine.num_steps > 0
    engine.generate([[5, 6, 7]], max_new_tokens=2, min_new_tokens=2, do_sample=False)  # generate resets
    assert (engine.last_stats.num_requests, engine.last_stats.generated_tokens) == (1, 2)


def test_openai_option_names_are_refused_naming_the_engines_own(model):
    engine = Engine(model, block_size=4, num_blocks=64, exact=True)
    with pytest.raises(TypeError, match="max_tokens: the OpenAI API's name; use max_new_tokens"):
        engine.generate([[5, 6, 7]], max_tokens=3)
    with pytest.raises(TypeError, match="max_new_tokenz: did you mean max_new_tokens\\?"):
        engine.add_request([5, 6, 7], max_new_tokenz=3)
    assert not engine.has_unfinished_requests() and engine.pool.stats().num_used == 0
