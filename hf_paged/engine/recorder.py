"""`StatsRecorder`: an Engine's counters, time-to-first-token sample and latency histograms, and the `EngineStats`
they make."""

from __future__ import annotations

import time

from .stats import EngineStats, LatencyHistograms, Reservoir, percentile

COUNTERS = (
    "num_requests",
    "prompt_tokens",
    "generated_tokens",
    "steps",
    "prefill_steps",
    "decode_steps",
    "mixed_steps",
    "admitted_tokens",
    "prefix_tokens_reused",
    "positions_computed",
    "pad_positions",
    "compiled_steps",
    "graph_steps",
)


class StatsRecorder:
    """What an `Engine` counts as it steps. The counters and the time-to-first-token sample start again at `reset`;
    the latency histograms (what `/metrics` shows) and the per-adapter counts run from the engine's creation.

    Attributes:
        counters (`dict[str, int]`): the `COUNTERS` since the last `reset`.
        latency (`LatencyHistograms`): queue time, time to first token, inter-token and end-to-end latency.
        adapter_counts (`dict[str | None, dict[str, int]]`): finished requests, prompt and generated tokens per
            adapter name (`None`: the base model).
        last_step_time (`float`): `time.perf_counter()` at the end of the last step (or the reset).

    Example:

    ```python
    >>> from hf_paged.engine.recorder import StatsRecorder
    >>> recorder = StatsRecorder()
    >>> recorder.counters["steps"], recorder.prefix_hit_rate
    (0, 0.0)

    ```
    """

    def __init__(self):
        self.latency = LatencyHistograms()
        self.adapter_counts: dict[str | None, dict[str, int]] = {}
        self.reset(num_preemptions=0)

    def reset(self, num_preemptions: int) -> None:
        """Start the counters again; `num_preemptions`: the scheduler's count now."""
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._ttfts = Reservoir()  # bounded: a long-running engine keeps a sample, not every request's
        self._ttft_sum = 0.0
        self._preemptions_at_reset = num_preemptions
        self.start_time = self.last_step_time = time.perf_counter()

    # ------------------------------------------------------------------ recording
    def admitted(self, step, now: float) -> None:
        """`step`'s admitted requests: their queue time (first admission only), tokens, and prefix tokens reused."""
        for request in step.admitted:
            if request.admission_time is None:  # its first admission (a preempted request was admitted before)
                request.admission_time = now
                self.latency.request_queue_time.observe(now - request.arrival_time)
        self.counters["admitted_tokens"] += sum(r.num_tokens for r in step.admitted)
        self.counters["prefix_tokens_reused"] += sum(  # a step's blocks are taken: its chunk is in the rows
            r.row.num_tokens - count for r, count in zip(step.requests, step.new_tokens) if r in step.admitted
        )

    def forward(self, step, positions: int, compiled: bool, replayed: bool = False) -> None:
        """A forward of `step` that computed `positions` positions, compiled or eagerly, replayed from a decode
        graph or not."""
        self.counters["compiled_steps"] += int(compiled)
        self.counters["graph_steps"] += int(replayed)
        self.counters["positions_computed"] += positions
        self.counters["pad_positions"] += positions - sum(step.new_tokens)

    def stepped(self, step) -> None:
        self.counters["steps"] += 1
        self.counters[f"{step.kind}_steps"] += 1

    def token(self, request, previous: float | None) -> None:
        """`request` got a token; `previous`: when it got its last one (`None`: this is its first)."""
        if previous is None:
            self.latency.time_to_first_token.observe(request.first_token_time - request.arrival_time)
        else:
            self.latency.inter_token_latency.observe(request.last_token_time - previous)

    def finished(self, request) -> None:
        counts = self.adapter_counts.setdefault(
            request.adapter_name, {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0}
        )
        counts["requests"] += 1
        counts["prompt_tokens"] += len(request.prompt_token_ids)
        counts["generated_tokens"] += len(request.output_token_ids)
        self.counters["num_requests"] += 1
        self.counters["prompt_tokens"] += len(request.prompt_token_ids)
        self.counters["generated_tokens"] += len(request.output_token_ids)
        if request.first_token_time is not None:
            ttft = request.first_token_time - request.arrival_time
            self._ttfts.add(ttft)
            self._ttft_sum += ttft
        if request.finish_reason in ("stop", "length") and request.finish_time is not None:
            self.latency.e2e_request_latency.observe(request.finish_time - request.arrival_time)

    # ------------------------------------------------------------------ reading
    @property
    def step_counts(self) -> dict[str, int]:
        c = self.counters
        return {
            "prefill": c["prefill_steps"],
            "decode": c["decode_steps"],
            "mixed": c["mixed_steps"],
            "positions": c["positions_computed"],
            "pads": c["pad_positions"],
        }

    @property
    def prefix_hit_rate(self) -> float:
        reused, admitted = self.counters["prefix_tokens_reused"], self.counters["admitted_tokens"]
        return reused / admitted if admitted else 0.0

    def snapshot(self, num_preemptions: int, peak_blocks: int, kernel: str, attention_calls: dict) -> EngineStats:
        """The `EngineStats` since the last `reset` (the arguments: the scheduler's preemptions, the pool's peak, the
        attention backend and its calls, as they are now)."""
        c = self.counters
        elapsed = max(self.last_step_time - self.start_time, 1e-9)
        return EngineStats(
            num_requests=c["num_requests"],
            prompt_tokens=c["prompt_tokens"],
            generated_tokens=c["generated_tokens"],
            elapsed_s=elapsed,
            requests_per_s=c["num_requests"] / elapsed,
            tokens_per_s=c["generated_tokens"] / elapsed,
            mean_ttft_s=self._ttft_sum / self._ttfts.count if self._ttfts.count else None,
            p90_ttft_s=percentile(self._ttfts.values, 0.9),
            num_steps=c["steps"],
            prefill_steps=c["prefill_steps"],
            decode_steps=c["decode_steps"],
            mixed_steps=c["mixed_steps"],
            positions_computed=c["positions_computed"],
            pad_positions=c["pad_positions"],
            preemptions=num_preemptions - self._preemptions_at_reset,
            peak_blocks=peak_blocks,
            prefix_hit_rate=self.prefix_hit_rate,
            attention_kernel=kernel,
            attention_calls=attention_calls,
            compiled_steps=c["compiled_steps"],
            graph_steps=c["graph_steps"],
        )
