"""How close paged outputs must be to stock `generate`: token ids always equal; scores and logits bitwise when the
attention gathers K/V (SDPA then attends over the same dense K/V as stock), within `SCORE_TOLERANCE` when a kernel
reads the blocks in place (it sums in another order than SDPA: float rounding, ~1e-7 relative)."""

from __future__ import annotations

import torch

from hf_paged import kernels

SCORE_TOLERANCE = 1e-5


def reads_in_place() -> bool:
    """Whether a paged call that leaves the kernel unset reads the blocks in place on this machine."""
    return kernels.resolve_kernel(None, "cpu").in_place


def assert_scores_match(reference: torch.Tensor, paged: torch.Tensor) -> None:
    """Scores (or logits) of a paged call equal stock's: bitwise under the gather kernel, else within tolerance."""
    assert reference.shape == paged.shape
    if reads_in_place():  # infinities (masked tokens) must match exactly
        torch.testing.assert_close(paged, reference, rtol=0, atol=SCORE_TOLERANCE)
    else:
        assert torch.equal(reference, paged)
