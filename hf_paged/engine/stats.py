"""`EngineStats`: what one `Engine` run did, in the units people compare engines by."""

from __future__ import annotations

import bisect
import random
import statistics
from dataclasses import dataclass, field


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
        mean_ttft_s, p90_ttft_s (`float | None`): time to first token, mean (of every request) and 90th percentile
            (exact up to 1,024 requests, then estimated from a uniform sample of 1,024: `Reservoir`).
        num_steps, prefill_steps, decode_steps, mixed_steps (`int`): forwards run, by kind (a mixed step holds
            prompt tokens and decoding requests' tokens together).
        preemptions (`int`): requests that lost their blocks and were recomputed.
        peak_blocks (`int`): most pool blocks in use at once.
        prefix_hit_rate (`float`): share of admitted prompt tokens taken from the prefix cache.
        positions_computed (`int`): positions the model's forwards computed (tokens and pads).
        pad_positions (`int`): of those, pad positions (no token): 0 for packed steps.
        attention_kernel (`str`): the paged-attention backend the engine's attention calls (`"cpu"`: blocks read in
            place; `"gather"`: K/V copied out of them first; see `hf_paged.kernels`).
        attention_calls (`dict[str, int]`): attention calls (per layer and step) by the backend that ran them, since
            the engine was created; eager steps only (a compiled step's attention runs inside its graph).
        compiled_steps (`int`): steps whose forward ran compiled (`Engine(compile=True)`; the others ran eagerly).
        graph_steps (`int`): decode steps replayed from a captured graph (`Engine(cuda_graphs=...)`), compiled or
            not.
        kv_tiers (`tuple[TierStats, ...]`): every tier behind the prefix cache (`kv_offload`; see
            `hf_paged.offload.TierStats`): hits, tokens loaded, bytes read and written, entries, evictions, rejects,
            load time; empty without tiers. Counted since the tiers were attached, not since the reset.
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
    attention_kernel: str = "gather"
    attention_calls: dict = field(default_factory=dict, repr=False)
    compiled_steps: int = 0
    graph_steps: int = 0
    kv_tiers: tuple = field(default=(), repr=False)

    @property
    def pad_share(self) -> float:
        """Share of computed positions that were pads."""
        return self.pad_positions / self.positions_computed if self.positions_computed else 0.0


# Bucket upper bounds in seconds (Prometheus `le`, each bucket counting what is at most its bound; `+Inf` is added):
# fine steps where a CPU or a GPU answers, coarse ones up to minutes. docs/serving.md lists them.
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                               1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
RESERVOIR_SIZE = 1024  # time-to-first-token samples `EngineStats.p90_ttft_s` is computed from


class Histogram:
    """Observations counted in fixed buckets, with their sum and count: memory that does not grow with the number
    of observations (a Prometheus histogram).

    Args:
        bounds (`tuple[float, ...]`): the buckets' upper bounds, increasing; a last bucket takes everything above.

    Example:

    ```python
    >>> histogram = Histogram((0.1, 1.0))
    >>> for seconds in (0.05, 0.1, 0.5, 3.0):
    ...     histogram.observe(seconds)
    >>> histogram.cumulative(), histogram.count, histogram.sum
    ([2, 3, 4], 4, 3.65)

    ```
    """

    def __init__(self, bounds: tuple[float, ...]):
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"histogram bounds must increase, got {bounds}")
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # the first bucket whose bound is >= value
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[int]:
        """Observations at most each bound, then the total (`+Inf`)."""
        total, out = 0, []
        for count in self.counts:
            total += count
            out.append(total)
        return out

    def copy(self) -> Histogram:
        other = Histogram.__new__(Histogram)
        other.bounds, other.counts, other.sum, other.count = self.bounds, list(self.counts), self.sum, self.count
        return other


@dataclass
class LatencyHistograms:
    """The latencies operators watch, per request and token, since the engine was created (never reset, as
    Prometheus counters are not): time to first token (from `add_request`), inter-token latency (between two
    tokens of a request), end-to-end latency (from `add_request` to the step that finishes it with `"stop"` or
    `"length"`) and queue time (from `add_request` to the step that first admits it)."""

    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(TIME_TO_FIRST_TOKEN_BUCKETS))
    inter_token_latency: Histogram = field(default_factory=lambda: Histogram(INTER_TOKEN_LATENCY_BUCKETS))
    e2e_request_latency: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    request_queue_time: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))

    def copy(self) -> LatencyHistograms:
        return LatencyHistograms(*(getattr(self, name).copy() for name in self.__dataclass_fields__))


class Reservoir:
    """A uniform sample of at most `size` of the values added (reservoir sampling, seeded): every value while
    there are at most `size`, so percentiles are exact until then and estimated from the sample afterwards, in
    memory that does not grow.

    Example:

    ```python
    >>> reservoir = Reservoir(size=3)
    >>> for value in range(10):
    ...     reservoir.add(float(value))
    >>> reservoir.count, len(reservoir.values)
    (10, 3)

    ```
    """

    def __init__(self, size: int = RESERVOIR_SIZE, seed: int = 0):
        self.size = size
        self.values: list[float] = []
        self.count = 0
        self._random = random.Random(seed)

    def add(self, value: float) -> None:
        self.count += 1
        if len(self.values) < self.size:
            self.values.append(value)
            return
        slot = self._random.randrange(self.count)
        if slot < self.size:
            self.values[slot] = value


def percentile(values: list[float], fraction: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(fraction * 100) - 1]
