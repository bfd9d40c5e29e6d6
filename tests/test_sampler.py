"""The Engine's sampler: greedy choices are `torch.argmax`'s (what stock `generate` picks), also on ties and NaN."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged.engine.params import SamplingParams
from hf_paged.engine.request import Request
from hf_paged.engine.sampler import apply_processors, logits_processors, next_tokens


def _requests(count: int) -> list[Request]:
    return [Request(f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=4)) for i in range(count)]


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 8),
    vocab=st.integers(1, 300),
    levels=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
    specials=st.lists(st.sampled_from([float("-inf"), float("inf"), float("nan")]), max_size=6),
)
def test_greedy_tokens_are_argmax_on_ties_infinities_and_nan(rows, vocab, levels, seed, specials):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (rows, vocab), generator=generator).float()  # few levels: many ties
    positions = torch.randint(0, rows * vocab, (len(specials),), generator=generator).tolist()
    for position, value in zip(positions, specials):
        logits.view(-1)[position] = value
    assert next_tokens(_requests(rows), logits) == logits.argmax(dim=-1).tolist()


def test_greedy_tokens_on_bfloat16_logits_are_argmax_of_their_fp32_values():
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 1.0, 3.0, 3.0]], dtype=torch.bfloat16)
    assert next_tokens(_requests(2), logits) == [1, 0] == logits.float().argmax(dim=-1).tolist()


OPTION_SETS = [
    {"repetition_penalty": 1.3},
    {"min_new_tokens": 5, "eos_token_id": (2, 7)},
    {"frequency_penalty": 0.5, "presence_penalty": 0.3, "logit_bias": {4: 2.0}},
    {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.9},
]


@pytest.mark.parametrize("options", OPTION_SETS)
def test_processors_applied_one_by_one_equal_the_list_call(options):
    """`apply_processors` gives exactly what `LogitsProcessorList.__call__` gives for the Engine's processors."""
    generator = torch.Generator().manual_seed(3)
    processors = logits_processors(SamplingParams(max_new_tokens=8, **options), prompt_length=4)
    assert len(processors) >= 1
    ids = torch.randint(0, 50, (1, 7), generator=generator)
    scores = torch.randn(1, 50, generator=generator)
    assert torch.equal(apply_processors(processors, ids, scores.clone()), processors(ids, scores.clone()))


def test_min_new_tokens_holds_back_eos_until_reached_then_leaves_the_request():
    """End-of-sequence is refused for the first `min_new_tokens` tokens, then chosen; the processor is dropped once
    it would change nothing (the request's other processors stay)."""
    request = Request(
        "r", [5, 6], SamplingParams(max_new_tokens=8, min_new_tokens=3, eos_token_id=(2,), repetition_penalty=1.2)
    )
    logits = torch.zeros(1, 10)
    logits[0, 2], logits[0, 8] = 5.0, 1.0  # end-of-sequence first, then token 8
    chosen, kinds = [], []
    for _ in range(4):
        [token] = next_tokens([request], logits)
        chosen.append(token)
        kinds.append([type(processor).__name__ for processor in request.processors])
        request.output_token_ids.append(token)
    assert chosen == [8, 8, 8, 2]
    assert kinds[2] == ["RepetitionPenaltyLogitsProcessor", "MinNewTokensLengthLogitsProcessor"]
    assert kinds[3] == ["RepetitionPenaltyLogitsProcessor"]


def test_greedy_rows_with_processors_take_the_first_maximum():
    """A row whose processors leave ties picks what `argmax` picks, as rows without processors do."""
    request = Request("r", [1], SamplingParams(max_new_tokens=4, repetition_penalty=2.0))
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, -1.0]])  # token 1 is penalised: 2 and 3 tie
    [token] = next_tokens([request], logits)
    expected = logits.clone()
    expected[0, 1] /= 2.0
    assert token == int(expected.argmax(dim=-1)) == 2
