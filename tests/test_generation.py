"""Golden equivalence of `generate(cache_implementation="paged")` with `DynamicCache`, and the generate glue."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.utils import GenerationMixin
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import PreTrainedModel

import hf_paged
from hf_paged import PagedCache, get_pool
from hf_paged.reference_models import tiny_model

from .conftest import left_padded_batch
from .exactness import assert_scores_match

pytestmark = pytest.mark.kernel_matrix  # every test runs on the in-place kernel and on gather

LENGTHS = [5, 11, 8, 14]  # none a multiple of 3 or 16


def generate_pair(model, paged_options=None, **kwargs):
    """The same generate call on DynamicCache and on the paged cache (seeded alike)."""
    kwargs = {"max_new_tokens": 12, "pad_token_id": 0, "return_dict_in_generate": True, "output_logits": True, **kwargs}
    torch.manual_seed(1234)
    reference = model.generate(**kwargs)
    torch.manual_seed(1234)
    paged = model.generate(**kwargs, cache_implementation="paged", cache_config=paged_options or {})
    return reference, paged


def max_logit_gap(reference, paged) -> float:
    assert len(reference.logits) == len(paged.logits)
    return max((a - b).abs().max().item() for a, b in zip(reference.logits, paged.logits))


def release(output):
    output.past_key_values.release()


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def family_model(request):
    return tiny_model(request.param)


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sample"])
def test_left_padded_batch_is_token_identical_to_dynamic_cache(family_model, block_size, do_sample):
    input_ids, attention_mask = left_padded_batch(LENGTHS)
    reference, paged = generate_pair(
        family_model,
        {"block_size": block_size},
        input_ids=input_ids,
        attention_mask=attention_mask,
        do_sample=do_sample,
        top_k=20 if do_sample else None,
    )
    assert torch.equal(reference.sequences, paged.sequences)
    assert paged.sequences.shape == (4, 14 + 12)
    assert max_logit_gap(reference, paged) <= 1e-5  # prefill (step 0) and every decode step
    stats = get_pool(family_model).stats()
    assert stats.tokens_stored == sum(LENGTHS) + 4 * 11  # pads are never stored; the last token is never fed back
    release(paged)
    assert get_pool(family_model).stats().num_used == 0


def test_sliding_window_model_is_exact():
    model = tiny_model("mistral", sliding_window=6)
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=3)
    reference, paged = generate_pair(
        model, {"block_size": 4}, input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=20
    )
    assert torch.equal(reference.sequences, paged.sequences)
    assert max_logit_gap(reference, paged) <= 1e-5
    release(paged)


def test_unpadded_batch_and_single_prompt(llama):
    for input_ids in (torch.randint(3, 128, (3, 9)), torch.randint(3, 128, (1, 7))):
        reference, paged = generate_pair(llama, {"block_size": 4}, input_ids=input_ids)
        assert torch.equal(reference.sequences, paged.sequences)
        release(paged)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_stock_attention_reads_a_paged_cache(implementation):
    model = tiny_model("llama", attn_implementation=implementation)
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=5)
    reference, paged = generate_pair(
        model,
        {"block_size": 3, "attn_implementation": implementation},
        input_ids=input_ids,
        attention_mask=attention_mask,
    )
    assert torch.equal(reference.sequences, paged.sequences)
    assert max_logit_gap(reference, paged) <= 1e-5
    release(paged)


@pytest.mark.parametrize("kernel", ["gather", "cpu"])
def test_hf_paged_attention_reads_through_block_tables(llama, monkeypatch, kernel):
    reads = []
    original = PagedCache.read_layer
    monkeypatch.setattr(PagedCache, "read_layer", lambda self, i, **kw: reads.append(i) or original(self, i, **kw))
    input_ids, attention_mask = left_padded_batch([3, 6])
    out = llama.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=4,
        pad_token_id=0,
        cache_implementation="paged",
        cache_config={"kernel": kernel},
        return_dict_in_generate=True,
    )
    calls = out.past_key_values.attention_calls
    out.past_key_values.release()
    if kernel == "gather":
        assert reads == [0, 1] * 4  # every layer of every forward (prefill + 3 decode steps)
        assert calls == {"gather": 8}
    else:  # the left-padded prefill gathers (its pad queries see the pads' K/V, never stored); decode reads in place
        assert reads == [0, 1]
        assert calls == {"gather": 2, "cpu": 6}


# ---------------------------------------------------------------------- generation config route and explicit cache
def test_generation_config_cache_implementation_paged(llama):
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=7)
    reference = llama.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=8, pad_token_id=0)
    config = GenerationConfig(
        max_new_tokens=8, pad_token_id=0, cache_implementation="paged", cache_config={"block_size": 5}
    )
    peak_before = get_pool(llama).stats().peak_used
    paged = llama.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
    assert torch.equal(reference, paged)
    assert get_pool(llama).block_size == 5 and get_pool(llama).stats().num_used == 0
    assert get_pool(llama).stats().peak_used > peak_before or peak_before > 0


def test_model_generation_config_paged(llama):
    input_ids = torch.randint(3, 128, (2, 6))
    reference = llama.generate(input_ids=input_ids, max_new_tokens=5, pad_token_id=0)
    llama.generation_config.cache_implementation = "paged"
    try:
        paged = llama.generate(input_ids=input_ids, max_new_tokens=5, pad_token_id=0, return_dict_in_generate=True)
    finally:
        llama.generation_config.cache_implementation = None
    assert isinstance(paged.past_key_values, PagedCache)
    assert torch.equal(reference, paged.sequences)
    release(paged)


def test_explicit_paged_cache_and_continuation_across_calls(llama):
    input_ids, attention_mask = left_padded_batch([4, 9], seed=11)
    first = llama.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=5,
        pad_token_id=0,
        return_dict_in_generate=True,
    )
    cache = PagedCache(llama, block_size=2)
    paged_first = llama.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=5,
        pad_token_id=0,
        past_key_values=cache,
        return_dict_in_generate=True,
    )
    assert torch.equal(first.sequences, paged_first.sequences) and paged_first.past_key_values is cache

    follow_up = torch.cat([first.sequences, torch.randint(3, 128, (2, 3))], dim=1)
    follow_mask = torch.cat(
        [attention_mask, torch.ones(2, follow_up.shape[1] - attention_mask.shape[1], dtype=torch.long)], dim=1
    )
    second = llama.generate(
        input_ids=follow_up,
        attention_mask=follow_mask,
        max_new_tokens=4,
        pad_token_id=0,
        past_key_values=first.past_key_values,
    )
    paged_second = llama.generate(
        input_ids=follow_up, attention_mask=follow_mask, max_new_tokens=4, pad_token_id=0, past_key_values=cache
    )
    assert torch.equal(second, paged_second)
    assert cache.get_seq_length() == follow_up.shape[1] + 3
    cache.release()
    assert get_pool(llama).stats().num_used == 0


# ---------------------------------------------------------------------- stock generate features
def test_logits_processors_stopping_criteria_and_scores(llama):
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=13)

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 14 + 6, dtype=torch.bool)

    def run(**extra):
        torch.manual_seed(0)
        return llama.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=12,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3)]),
            stopping_criteria=StoppingCriteriaList([StopAfter()]),
            no_repeat_ngram_size=2,
            return_dict_in_generate=True,
            output_scores=True,
            **extra,
        )

    reference, paged = run(), run(cache_implementation="paged")
    assert torch.equal(reference.sequences, paged.sequences) and paged.sequences.shape == (4, 20)
    for a, b in zip(reference.scores, paged.scores, strict=True):
        assert_scores_match(a, b)
    release(paged)


def test_rows_ending_at_different_steps_on_eos(llama):
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=17)
    free_run = llama.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=10, pad_token_id=0)
    eos = int(free_run[0, 14 + 2])  # row 0 emits it at step 3; other rows at other steps or never
    reference = llama.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=10, pad_token_id=0, eos_token_id=eos
    )
    paged = llama.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=10,
        pad_token_id=0,
        eos_token_id=eos,
        cache_implementation="paged",
        cache_config={"block_size": 3},
    )
    assert torch.equal(reference, paged)
    finished_at = [(row[14:] == eos).nonzero()[0].item() if (row[14:] == eos).any() else None for row in paged]
    assert finished_at[0] == 2 and len(set(finished_at)) > 1
    assert get_pool(llama).stats().num_used == 0


def test_attention_implementation_is_restored_even_when_generate_fails(llama):
    assert llama.config._attn_implementation == "sdpa"
    input_ids = torch.randint(3, 128, (1, 5))
    llama.generate(input_ids=input_ids, max_new_tokens=2, pad_token_id=0, cache_implementation="paged")
    assert llama.config._attn_implementation == "sdpa"

    class Boom(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        llama.generate(
            input_ids=input_ids,
            max_new_tokens=4,
            pad_token_id=0,
            cache_implementation="paged",
            stopping_criteria=StoppingCriteriaList([Boom()]),
        )
    assert llama.config._attn_implementation == "sdpa"
    assert get_pool(llama).stats().num_used == 0


def test_the_attention_switch_replays_what_set_attn_implementation_wrote(monkeypatch):
    """Every paged call (and every Engine step) switches the model's attention and back; after the first,
    `set_attn_implementation` (a walk of every module) is not called again while nothing else changed the
    implementations, and what the user sets between calls is what the next call starts from and restores."""
    from hf_paged.forward import _implementations

    model = tiny_model("llama")
    calls = []
    original = model.set_attn_implementation
    monkeypatch.setattr(model, "set_attn_implementation", lambda value: calls.append(value) or original(value))
    input_ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    options = {"max_new_tokens": 3, "pad_token_id": 0, "do_sample": False}
    reference = model.generate(input_ids, **options)
    first = model.generate(input_ids, **options, cache_implementation="paged")
    assert len(calls) == 1 and model.config._attn_implementation == "sdpa"  # recorded, then undone by replay
    second = model.generate(input_ids, **options, cache_implementation="paged")
    assert len(calls) == 1 and model.config._attn_implementation == "sdpa"
    assert torch.equal(first, reference) and torch.equal(second, reference)
    original("eager")  # the user's own switch between calls: the recorded values no longer apply
    with hf_paged.Engine(model, exact=True) as engine:  # switches an eager model to "hf_paged" (in eager math)
        outputs = engine.generate(input_ids.tolist(), max_new_tokens=3)
    assert len(calls) == 2 and _implementations(model.config) == {"": "eager"}
    assert [o.token_ids for o in outputs] == reference[:, 5:].tolist()
    hf_paged.release_pool(model)


# ---------------------------------------------------------------------- negative control
def test_negative_control_without_mask_registration_padded_batch_goes_wrong(llama, monkeypatch):
    """Proves the equivalence test can fail: with no mask function registered for "hf_paged", transformers builds
    no mask, the model attends to the (stored-as-first-token) pad positions, and the outputs diverge."""
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=19)
    reference, paged = generate_pair(llama, input_ids=input_ids, attention_mask=attention_mask)
    assert torch.equal(reference.sequences, paged.sequences)
    release(paged)

    monkeypatch.delitem(AttentionMaskInterface._global_mapping, "hf_paged")
    reference, broken = generate_pair(llama, input_ids=input_ids, attention_mask=attention_mask)
    assert not torch.equal(reference.sequences, broken.sequences)
    assert max_logit_gap(reference, broken) > 1e-3
    release(broken)


# ---------------------------------------------------------------------- enable / disable
def test_disable_restores_stock_generate_and_enable_is_idempotent(llama):
    hf_paged.disable()
    try:
        assert not hf_paged.is_enabled()
        assert "hf_paged" not in AttentionMaskInterface._global_mapping
        assert GenerationMixin.generate is hf_paged.generation._original_generate
        assert PreTrainedModel.get_compiled_call is hf_paged.generation._original_get_compiled_call
    finally:
        hf_paged.enable()
        hf_paged.enable()
    assert hf_paged.is_enabled() and GenerationMixin.generate.__wrapped__ is hf_paged.generation._original_generate
    assert PreTrainedModel.get_compiled_call is hf_paged.generation._paged_compiled_call
    input_ids = torch.randint(3, 128, (1, 5))
    out = llama.generate(
        input_ids=input_ids, max_new_tokens=3, min_new_tokens=3, pad_token_id=0, cache_implementation="paged"
    )
    assert out.shape == (1, 8)
