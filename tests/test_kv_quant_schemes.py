"""benchmarks/kv_quant_schemes.py's teacher-forced check: every position's greedy next token, the prompt and the
reference before it fed in one forward through a scheme's round trip, compared with the reference's own token."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from hf_paged.reference_models import tiny_model

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
kv_quant_schemes = pytest.importorskip("kv_quant_schemes")

IDENTITY = (lambda x: x, lambda x: x)


@pytest.fixture(scope="module")
def workload():
    model = tiny_model("llama")
    prompts = torch.randint(3, 128, (3, 6), generator=torch.Generator().manual_seed(0))
    reference = kv_quant_schemes.greedy_continuations(model, prompts)
    return model, prompts, reference


def test_exact_round_trip_is_a_plain_forward_over_prompt_and_reference(workload):
    model, prompts, reference = workload
    agrees = kv_quant_schemes.next_token_agreement(model, prompts, reference, *IDENTITY)
    assert agrees.shape == reference.shape == (3, 64)
    with torch.no_grad():
        logits = model(torch.cat([prompts, reference[:, :-1]], dim=1), use_cache=False).logits
    assert torch.equal(agrees, logits[:, prompts.shape[1] - 1 :].argmax(-1) == reference)
    assert agrees.float().mean() > 0.9  # the same K/V in another summation order: ties flip, little else


def test_a_round_trip_that_loses_the_values_disagrees(workload):
    """Negative control: the check sees what the round trip does to the K/V."""
    model, prompts, reference = workload
    exact = kv_quant_schemes.next_token_agreement(model, prompts, reference, *IDENTITY)
    lossy = kv_quant_schemes.next_token_agreement(model, prompts, reference, lambda k: k, torch.zeros_like)
    assert lossy.sum() < exact.sum()


def test_agreement_reads_the_share_of_positions_and_of_whole_prompts():
    agrees = torch.tensor([[True, True, False, True], [True, True, True, True]])
    assert kv_quant_schemes.agreement(agrees) == "87.50% of 8 (1 differ; 1 of 2 prompts all agree)"
