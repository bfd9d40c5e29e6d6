"""`EngineStats`: what one `Engine` run did, in the units people compare engines by."""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """Counters of an `Engine` since `reset_stats()` (`engine.generate` resets them; `engine.last_stats` keeps its
    run's).

    Attributes:
        num_requests (`int`): requests finished (any reason).
        prompt_tokens (`int`): prompt tokens of those requests.
        generated_tokens (`int`): tokens generated.
        elapsed_s (`float`): seconds from the reset to the last step.
        requests_per_s, tokens_per_s (`float`): finished requests and generated tokens per second.
        mean_ttft_s, p90_ttft_s (`float | None`): time to first token, mean and 90th percentile.
        num_steps, prefill_steps, decode_steps, mixed_steps (`int`): forwards run, by kind (a mixed step holds
            prompt tokens and decoding requests' tokens together).
        preemptions (`int`): requests that lost their blocks and were recomputed.
        peak_blocks (`int`): most pool blocks in use at once.
        prefix_hit_rate (`float`): share of admitted prompt tokens taken from the prefix cache.
        positions_computed (`int`): positions the model's forwards computed (tokens and pads).
        pad_positions (`int`): of those, pad positions (no token): 0 for packed steps.
    """

    num_requests: int
    prompt_tokens: int
    generated_tokens: int
    elapsed_s: float
    requests_per_s: float
    tokens_per_s: float
    mean_ttft_s: float | None
    p90_ttft_s: float | None
    num_steps: int
    prefill_steps: int
    decode_steps: int
    preemptions: int
    peak_blocks: int
    prefix_hit_rate: float
    mixed_steps: int = 0
    positions_computed: int = 0
    pad_positions: int = 0

    @property
    def pad_share(self) -> float:
        """Share of computed positions that were pads."""
        return self.pad_positions / self.positions_computed if self.positions_computed else 0.0


def percentile(values: list[float], fraction: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(fraction * 100) - 1]
