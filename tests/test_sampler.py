"""The Engine's sampler: greedy choices are `torch.argmax`'s (what stock `generate` picks), also on ties and NaN."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged.engine.params import SamplingParams
from hf_paged.engine.request import Request
from hf_paged.engine.sampler import next_tokens


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
