"""Compiled paged `generate` (`hf_paged.compiled_decode`): transformers' own auto-compile path (`compile_config`
with `_compile_all_devices` on CPU) runs a paged call's decode steps through one compiled graph, giving the eager
paged call's tokens (and `DynamicCache`'s), logits within float rounding, one graph however the calls' shapes vary,
and eager steps wherever compiling cannot serve."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from transformers import CompileConfig, DynamicCache, StoppingCriteria, StoppingCriteriaList

import hf_paged
from hf_paged.reference_models import tiny_model

from .conftest import drop_step_tensors, left_padded_batch

LOGIT_TOLERANCE = 1e-4  # fp32, tiny models: inductor's fused and reordered sums move logits by ~1e-7
POOL = {"block_size": 4, "num_blocks": 256, "attn_implementation": "hf_paged"}


def compile_config(backend="aot_eager") -> CompileConfig:
    """transformers' compile options, told to compile on CPU too (it compiles on CUDA only by default)."""
    config = CompileConfig(backend=backend, mode=None if backend != "inductor" else "reduce-overhead")
    config._compile_all_devices = True
    return config


def generate(model, input_ids, attention_mask=None, compiled=None, **options):
    """`(sequences, logits)` of one paged `generate` call, compiled with `compiled` (a backend) or eager."""
    if compiled is not None:
        options["compile_config"] = compile_config(compiled)
    out = model.generate(
        input_ids,
        attention_mask=attention_mask,
        pad_token_id=0,
        cache_implementation="paged",
        cache_config=options.pop("cache_config", POOL),
        output_logits=True,
        return_dict_in_generate=True,
        **{"max_new_tokens": 10, "do_sample": False, **options},
    )
    return out.sequences, torch.stack(out.logits)


def largest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize(
    "family, compiler",
    [
        ("llama", "inductor"),
        ("gemma2", "inductor"),  # full and sliding layer groups, soft-capped logits
        ("starcoder2", "aot_eager"),  # every layer sliding (window 6): blocks given back during the call
        ("qwen3", "aot_eager"),  # q/k norms
        ("opt", "aot_eager"),  # learned positions from the attention mask
    ],
)
def test_compiled_decode_gives_the_eager_paged_tokens(family, compiler):
    model = tiny_model(family)
    input_ids, attention_mask = left_padded_batch([9, 5, 12])
    tokens, logits = generate(model, input_ids, attention_mask, max_new_tokens=14)
    compiled_tokens, compiled_logits = generate(model, input_ids, attention_mask, compiler, max_new_tokens=14)
    assert torch.equal(compiled_tokens, tokens)
    assert largest_difference(compiled_logits, logits) < LOGIT_TOLERANCE
    stock = model.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=14, do_sample=False, pad_token_id=0,
        past_key_values=DynamicCache(config=model.config),
    )  # fmt: skip
    assert torch.equal(compiled_tokens, stock)
    decode = hf_paged.compiled_decode_of(model)
    assert decode.compiled_steps == 12 and decode.eager_steps == 1  # 13 decode steps: the first checks the model
    assert decode.graphs == 1 and decode.disabled is None


@pytest.mark.parametrize(
    "family, kv_dtype, compiler",
    [
        ("llama", "int8", "inductor"),
        ("llama", "int4", "aot_eager"),
        ("gemma2", "int4", "inductor"),
        ("llama", "int4-channel", "inductor"),
        ("gemma2", "int4-channel", "aot_eager"),
    ],
)
def test_compiled_decode_over_quantized_pages_gives_the_eager_paged_tokens(family, kv_dtype, compiler):
    # the compiled step quantizes and reads the pages through the same format code as eager steps; int4-channel
    # (blocks of 8 here): the decode step that fills a block quantizes its keys per channel
    model = tiny_model(family)
    input_ids, attention_mask = left_padded_batch([9, 5, 12])
    options = {"cache_config": {**POOL, "kv_dtype": kv_dtype, "block_size": 8}, "max_new_tokens": 14}
    tokens, logits = generate(model, input_ids, attention_mask, **options)
    compiled_tokens, compiled_logits = generate(model, input_ids, attention_mask, compiler, **options)
    assert torch.equal(compiled_tokens, tokens)
    assert largest_difference(compiled_logits, logits) < LOGIT_TOLERANCE
    decode = hf_paged.compiled_decode_of(model)
    assert decode.compiled_steps == 12 and decode.graphs == 1 and decode.disabled is None
    _, unquantized_logits = generate(model, input_ids, attention_mask, max_new_tokens=14)
    assert largest_difference(logits, unquantized_logits) > 10 * LOGIT_TOLERANCE  # the pages were quantized


def test_negative_control_a_decode_step_that_drops_the_left_padding_changes_the_tokens(monkeypatch):
    # proves the comparison above can fail: the compiled step without each row's own length attends to pad slots
    import hf_paged.step_attention as step_attention

    model = tiny_model("llama")
    input_ids, attention_mask = left_padded_batch([9, 5, 12])
    tokens, logits = generate(model, input_ids, attention_mask)
    padded = step_attention.StepTensors.of_batch.__func__

    def with_every_row_as_long_as_the_longest(cls, cache, query_start, device, width=None):
        tensors = padded(cls, cache, query_start, device, width)
        longest = tuple(torch.full_like(lengths, int(lengths.max())) for lengths in tensors.seq_lens)
        return tensors._replace(seq_lens=longest)

    monkeypatch.setattr(step_attention.StepTensors, "of_batch", classmethod(with_every_row_as_long_as_the_longest))
    _, compiled_logits = generate(model, input_ids, attention_mask, "aot_eager")
    assert not torch.allclose(compiled_logits, logits, atol=1e-2)  # (pad slots may hold anything: NaN included)


def test_sampling_and_returned_sequences_give_the_eager_draws():
    model = tiny_model("llama")
    input_ids, attention_mask = left_padded_batch([7, 11])
    runs = []
    for compiled in (None, "aot_eager"):
        torch.manual_seed(3)
        runs.append(generate(model, input_ids, attention_mask, compiled, do_sample=True, num_return_sequences=3)[0])
    assert torch.equal(runs[0], runs[1])
    assert hf_paged.compiled_decode_of(model).compiled_steps == 8


def test_beam_search_runs_eagerly_as_stock_does():
    # transformers 5.23 compiles only the greedy and sampling loops; beam search with a compile_config is eager
    model = tiny_model("llama")
    input_ids, attention_mask = left_padded_batch([7, 11])
    options = {"num_beams": 3, "num_return_sequences": 2}
    tokens, _ = generate(model, input_ids, attention_mask, **options)
    compiled_tokens, _ = generate(model, input_ids, attention_mask, "aot_eager", **options)
    assert torch.equal(compiled_tokens, tokens)
    assert hf_paged.compiled_decode_of(model) is None


def test_one_graph_serves_calls_of_every_shape():
    model = tiny_model("llama")
    torch._dynamo.utils.counters.clear()
    shapes = [([9], 10), ([5, 12], 3), ([3, 3, 20], 25), ([30], 6), ([4, 8, 2, 16], 12), ([1], 40), ([6, 7], 1)]
    decode_steps = 0
    for lengths, new_tokens in shapes:  # batch sizes 1-4, table widths from 1 to 11 blocks, left padding or none
        input_ids, attention_mask = left_padded_batch(lengths, seed=len(lengths) + new_tokens)
        tokens, _ = generate(model, input_ids, attention_mask, max_new_tokens=new_tokens)
        compiled_tokens, _ = generate(model, input_ids, attention_mask, "aot_eager", max_new_tokens=new_tokens)
        assert torch.equal(compiled_tokens, tokens)
        decode_steps += tokens.shape[1] - input_ids.shape[1] - 1  # the prefill computes the first new token
    decode = hf_paged.compiled_decode_of(model)
    assert decode.compiled_steps == decode_steps - 1 and decode.eager_steps == 1 and decode_steps > 50
    assert decode.graphs == 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_a_compile_error_falls_back_to_eager_steps_with_one_warning():
    def failing_backend(graph_module, example_inputs):
        raise RuntimeError("no C++ compiler in this simulation")

    model = tiny_model("llama")
    input_ids, attention_mask = left_padded_batch([9, 5])
    tokens, _ = generate(model, input_ids, attention_mask)
    config = compile_config()
    config.backend = failing_backend
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            compiled_tokens, _ = generate(model, input_ids, attention_mask, compile_config=config)
            assert torch.equal(compiled_tokens, tokens)
    messages = [str(w.message) for w in caught if "compiled decoding of paged generate is off" in str(w.message)]
    assert len(messages) == 1 and "no C++ compiler in this simulation" in messages[0]
    decode = hf_paged.compiled_decode_of(model)
    assert decode.compiled_steps == 0 and decode.disabled is not None


def test_a_model_that_does_not_pass_its_kwargs_to_attention_decodes_eagerly():
    model = tiny_model("llama")
    drop_step_tensors(model)
    input_ids, attention_mask = left_padded_batch([9, 5])
    tokens, _ = generate(model, input_ids, attention_mask)
    with pytest.warns(RuntimeWarning, match=r"ran for layers \[0\] instead of each of its 2 layers"):
        compiled_tokens, _ = generate(model, input_ids, attention_mask, "aot_eager")
    assert torch.equal(compiled_tokens, tokens)
    assert hf_paged.compiled_decode_of(model).compiled_steps == 0


@pytest.mark.parametrize(
    "options",
    [
        {},  # CPU: transformers compiles only when compile_config says _compile_all_devices
        {"compile_config": CompileConfig()},
        {"compile_config": "all devices", "disable_compile": True},
        {"compile_config": "all devices", "output_hidden_states": True},
    ],
    ids=["no compile_config", "cuda only", "disable_compile", "hidden states"],
)
def test_paged_generate_stays_eager_where_stock_would_not_compile_or_the_cache_cannot(options):
    model = tiny_model("llama")
    if options.get("compile_config") == "all devices":
        options["compile_config"] = compile_config()
    out = model.generate(
        torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=6, do_sample=False, pad_token_id=0,
        cache_implementation="paged", cache_config=options.pop("cache_config", POOL), return_dict_in_generate=True,
        **options,
    )  # fmt: skip
    decode = hf_paged.compiled_decode_of(model)
    assert decode is None or decode.compiled_steps == 0
    assert not out.past_key_values.is_compileable


def test_the_returned_cache_is_not_compileable_after_the_call_and_continues_compiled():
    model = tiny_model("llama")
    first = torch.tensor([[5, 6, 7, 8, 9, 10]])
    runs = []
    for compiled in (None, "aot_eager"):
        cache = hf_paged.PagedCache(model, **POOL)
        options = {} if compiled is None else {"compile_config": compile_config(compiled)}
        turn = model.generate(
            first, past_key_values=cache, max_new_tokens=5, do_sample=False, pad_token_id=0, **options
        )
        assert not cache.is_compileable and cache.decode_table_width is None
        follow_up = torch.cat([turn, torch.tensor([[11, 12, 13]])], dim=1)  # a conversation's next turn
        runs.append(
            model.generate(
                follow_up, past_key_values=cache, max_new_tokens=8, do_sample=False, pad_token_id=0, **options
            )
        )
        cache.release()
    assert torch.equal(runs[0], runs[1])
    assert hf_paged.compiled_decode_of(model).compiled_steps == 3 + 7  # each call's first decode step checks


def test_a_prompt_reused_from_the_prefix_cache_decodes_compiled_to_the_same_tokens():
    model = tiny_model("llama")
    input_ids = torch.arange(3, 23)[None]
    tokens, _ = generate(model, input_ids)
    out = model.generate(
        input_ids, max_new_tokens=10, do_sample=False, pad_token_id=0, cache_implementation="paged",
        cache_config=POOL, compile_config=compile_config(), return_dict_in_generate=True,
    )  # fmt: skip
    assert torch.equal(out.sequences, tokens)
    assert out.past_key_values.stats().prefix_tokens_reused == 16  # every full block of the 20-token prompt
    decode_steps = out.sequences.shape[1] - input_ids.shape[1] - 1  # the prefill computes the first new token
    assert hf_paged.compiled_decode_of(model).compiled_steps == decode_steps - 1 and decode_steps > 3


def test_chunked_prefill_and_compiled_decode_give_the_eager_tokens():
    model = tiny_model("llama")
    input_ids, attention_mask = left_padded_batch([9, 14])
    tokens, _ = generate(model, input_ids, attention_mask, prefill_chunk_size=6)
    compiled_tokens, _ = generate(model, input_ids, attention_mask, "aot_eager", prefill_chunk_size=6)
    assert torch.equal(compiled_tokens, tokens)
    assert hf_paged.compiled_decode_of(model).compiled_steps == 8


def test_weights_edited_between_calls_are_used_without_compiling_again():
    # weights are graph inputs (no inductor freezing): a fine-tune step between calls needs no new graph
    model = tiny_model("llama")
    input_ids, attention_mask = left_padded_batch([9, 5])
    before, _ = generate(model, input_ids, attention_mask, "inductor")
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)
    after, _ = generate(model, input_ids, attention_mask, "inductor")
    expected, _ = generate(model, input_ids, attention_mask)
    assert torch.equal(after, expected) and not torch.equal(after, before)
    assert hf_paged.compiled_decode_of(model).graphs == 1


class FailAfter(StoppingCriteria):
    def __init__(self, steps: int):
        self.steps = steps

    def __call__(self, input_ids, scores, **kwargs):
        self.steps -= 1
        if self.steps == 0:
            raise KeyError("a stopping criterion failed")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_a_call_that_fails_mid_decode_returns_its_blocks():
    model = tiny_model("llama")
    input_ids, attention_mask = left_padded_batch([9, 5])
    with pytest.raises(KeyError, match="a stopping criterion failed"):
        generate(model, input_ids, attention_mask, "aot_eager", stopping_criteria=StoppingCriteriaList([FailAfter(5)]))
    gc.collect()
    pool = hf_paged.get_pool(model)
    pool.check_invariants()
    assert pool.stats().num_used == 0
    assert hf_paged.compiled_decode_of(model).compiled_steps == 3


@pytest.mark.parametrize("kv_dtype, compiler", [("auto", "inductor"), ("int8", "aot_eager")])
def test_smollm2_compiled_generate_gives_the_eager_tokens_of_the_readme_prompts(smollm2, kv_dtype, compiler):
    model, tokenizer = smollm2
    questions = ["What is the capital of France?", "Name a prime number larger than 10."]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    inputs = tokenizer(prompts, return_tensors="pt", padding=True)
    options = {"cache_config": {"block_size": 16, "kv_dtype": kv_dtype}, "max_new_tokens": 24}
    tokens, logits = generate(model, inputs["input_ids"], inputs["attention_mask"], **options)
    compiled_tokens, compiled_logits = generate(
        model, inputs["input_ids"], inputs["attention_mask"], compiler, **options
    )
    assert torch.equal(compiled_tokens, tokens)
    assert largest_difference(compiled_logits, logits) < 1e-3
    decode = hf_paged.compiled_decode_of(model)
    decode_steps = tokens.shape[1] - inputs["input_ids"].shape[1] - 1  # the prefill computes the first new token
    assert decode.compiled_steps == decode_steps - 1 and decode_steps > 10 and decode.graphs == 1
    model._hf_paged_decode = None  # the session's SmolLM2 is shared: later tests start without compiled graphs


def test_a_stock_compiled_call_after_a_paged_one_compiles_without_graph_breaks():
    # the forward hooks a paged call installs on the model stay out of the graphs of later stock compiled calls
    # (before: their per-thread binding broke the graph at every forward, a StaticCache decode step 1.3x slower)
    model = tiny_model("llama")
    input_ids, attention_mask = left_padded_batch([9, 5])
    generate(model, input_ids, attention_mask)  # installs the hooks
    torch._dynamo.utils.counters.clear()
    stock = model.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
        cache_implementation="static", compile_config=compile_config(),
    )  # fmt: skip
    assert stock.shape == (2, 15)
    counters = torch._dynamo.utils.counters
    assert not counters["unimplemented"] and not counters["graph_break"]  # nothing Dynamo had to skip or break at
    assert counters["frames"]["total"] == counters["frames"]["ok"] and counters["stats"]["unique_graphs"] == 1
