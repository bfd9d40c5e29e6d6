"""`/metrics`: the Engine and its block pool in Prometheus text format, from a snapshot the engine thread publishes
after every step (so reading it never waits for a running forward)."""

from __future__ import annotations

from dataclasses import dataclass

from ..engine import Engine
from ..engine.distributed import RankState
from ..engine.stats import LatencyHistograms

_SAMPLES = (  # name, kind, help
    ("hf_paged_kv_blocks_used", "gauge", "KV blocks held by running requests"),
    ("hf_paged_kv_blocks_free", "gauge", "KV blocks free (cached-evictable included)"),
    ("hf_paged_kv_blocks_total", "gauge", "KV blocks in the pool"),
    ("hf_paged_kv_blocks_cached", "gauge", "KV blocks indexed by the prefix cache"),
    ("hf_paged_kv_usage_ratio", "gauge", "Share of KV blocks in use"),
    ("hf_paged_kv_waste_ratio", "gauge", "Share of allocated KV slots holding no token"),
    ("hf_paged_prefix_hit_ratio", "gauge", "Share of admitted prompt tokens served by the prefix cache"),
    ("hf_paged_preemptions_total", "counter", "Requests preempted and recomputed"),
    ("hf_paged_requests_running", "gauge", "Requests decoding"),
    ("hf_paged_requests_waiting", "gauge", "Requests queued"),
    ("hf_paged_requests_total", "counter", "Requests finished"),
    ("hf_paged_prompt_tokens_total", "counter", "Prompt tokens of finished requests"),
    ("hf_paged_generation_tokens_total", "counter", "Tokens generated"),
    ("hf_paged_requests_by_model_total", "counter", "Requests finished, per model (the base or a LoRA adapter)"),
    ("hf_paged_prompt_tokens_by_model_total", "counter", "Prompt tokens of finished requests, per model"),
    ("hf_paged_generation_tokens_by_model_total", "counter", "Tokens generated, per model"),
    ("hf_paged_lora_adapters_loaded", "gauge", "LoRA adapters requests can name"),
    ("hf_paged_lora_adapters_resident", "gauge", "LoRA adapters in memory (unloaded ones still serving included)"),
    ("hf_paged_lora_adapter_bytes", "gauge", "Bytes of the resident LoRA adapters' stacked factors"),
    ("hf_paged_engine_steps_total", "counter", "Engine steps (forwards) run"),
    ("hf_paged_engine_steps_by_kind_total", "counter", "Engine steps by kind: prefill, decode, or mixed (both)"),
    ("hf_paged_positions_computed_total", "counter", "Positions the model's forwards computed (tokens and pads)"),
    ("hf_paged_pad_positions_total", "counter", "Pad positions among them (0 for packed steps)"),
    ("hf_paged_attention_kernel_info", "gauge", "The paged-attention backend in use (label kernel), always 1"),
    ("hf_paged_kv_dtype_info", "gauge", "How the pool stores K/V (label kv_dtype: auto, int8, int4), always 1"),
    ("hf_paged_attention_calls_total", "counter", "Attention calls (per layer and step) by the backend that ran them"),
    ("hf_paged_engine_steps_by_forward_total", "counter", "Engine steps by forward: compiled or eager"),
    ("hf_paged_compiled_graphs_total", "counter", "Step graphs compiled (a new one after the first: a recompilation)"),
    ("hf_paged_compile_seconds_total", "counter", "Seconds spent compiling step graphs"),
    ("hf_paged_decode_graph_replays_total", "counter", "Decode steps replayed from a captured graph, by size"),
    ("hf_paged_kv_tier_enabled", "gauge", "1 while a tier behind the prefix cache works, 0 once it failed"),
    ("hf_paged_kv_tier_hits_total", "counter", "Blocks loaded into the pool from a tier"),
    ("hf_paged_kv_tier_tokens_loaded_total", "counter", "Prompt tokens loaded from a tier instead of computed"),
    ("hf_paged_kv_tier_bytes_read_total", "counter", "Bytes read from a tier on hits"),
    ("hf_paged_kv_tier_bytes_written_total", "counter", "Bytes written to a tier"),
    ("hf_paged_kv_tier_entries", "gauge", "Blocks a tier holds"),
    ("hf_paged_kv_tier_evictions_total", "counter", "Entries a tier dropped to stay within its budget"),
    ("hf_paged_kv_tier_rejects_total", "counter", "Entries that failed their checksum or key (misses, deleted)"),
    ("hf_paged_kv_tier_load_seconds_total", "counter", "Seconds spent reading and decoding a tier's hits"),
    ("hf_paged_tp_world_size", "gauge", "Tensor-parallel ranks serving the model (1: one process)"),
    ("hf_paged_rank_kv_blocks_used", "gauge", "KV blocks in use in each rank's pool"),
    ("hf_paged_rank_kv_usage_ratio", "gauge", "Share of each rank's KV blocks in use"),
    ("hf_paged_rank_kv_bytes_used", "gauge", "Bytes of KV blocks in use in each rank's pool"),
    ("hf_paged_rank_kv_bytes_total", "gauge", "Bytes of each rank's KV pool"),
)
_HISTOGRAMS = (  # name, LatencyHistograms field, help
    ("hf_paged_time_to_first_token_seconds", "time_to_first_token", "Seconds from arrival to first token"),
    ("hf_paged_inter_token_latency_seconds", "inter_token_latency", "Seconds between two tokens of a request"),
    ("hf_paged_e2e_request_latency_seconds", "e2e_request_latency",
     "Seconds from a request's arrival to its end (stop or length)"),
    ("hf_paged_request_queue_time_seconds", "request_queue_time", "Seconds from arrival to first admission"),
)  # fmt: skip


@dataclass(frozen=True)
class MetricsSnapshot:
    """The values `/metrics` shows, taken at one moment (between two engine steps).

    Attributes:
        values (`dict[str, float]`): metric name to value.
        taken_at (`float`): `time.monotonic()` when it was taken.
        latency (`LatencyHistograms`, *optional*): a copy of the engine's latency histograms.
    """

    values: dict[str, float]
    taken_at: float
    latency: LatencyHistograms | None = None

    @classmethod
    def take(
        cls, engine: Engine, totals: dict[str, int], taken_at: float, model_totals: dict | None = None
    ) -> MetricsSnapshot:
        """Read `engine` and its pool; call it from the thread that steps the engine, between steps.
        `model_totals` are the counters per model (`{name: {"requests", "prompt_tokens", "generation_tokens"}}`)."""
        pool = engine.pool.stats()
        values = {
            "hf_paged_kv_blocks_used": pool.num_used,
            "hf_paged_kv_blocks_free": pool.num_free,
            "hf_paged_kv_blocks_total": pool.num_blocks,
            "hf_paged_kv_blocks_cached": pool.num_cached,
            "hf_paged_kv_usage_ratio": pool.num_used / pool.num_blocks if pool.num_blocks else 0.0,
            "hf_paged_kv_waste_ratio": pool.waste_fraction,
            "hf_paged_prefix_hit_ratio": engine.prefix_hit_rate,
            "hf_paged_preemptions_total": engine.scheduler.num_preemptions,
            "hf_paged_requests_running": engine.num_running,
            "hf_paged_requests_waiting": engine.num_waiting,
            "hf_paged_requests_total": totals["requests"],
            "hf_paged_prompt_tokens_total": totals["prompt_tokens"],
            "hf_paged_generation_tokens_total": totals["generation_tokens"],
            "hf_paged_engine_steps_total": engine.num_steps,
        }
        for model, counts in (model_totals or {}).items():
            label = '{model="' + model.replace("\\", "\\\\").replace('"', '\\"') + '"}'
            values["hf_paged_requests_by_model_total" + label] = counts["requests"]
            values["hf_paged_prompt_tokens_by_model_total" + label] = counts["prompt_tokens"]
            values["hf_paged_generation_tokens_by_model_total" + label] = counts["generation_tokens"]
        adapters = getattr(engine, "adapters", None)
        if adapters is not None:
            values["hf_paged_lora_adapters_loaded"] = len(adapters)
            values["hf_paged_lora_adapters_resident"] = adapters.num_resident
            values["hf_paged_lora_adapter_bytes"] = adapters.num_bytes
        counts = engine.step_counts
        for kind in ("prefill", "decode", "mixed"):
            values[f'hf_paged_engine_steps_by_kind_total{{kind="{kind}"}}'] = counts[kind]
        values["hf_paged_positions_computed_total"] = counts["positions"]
        values["hf_paged_pad_positions_total"] = counts["pads"]
        cache = getattr(engine, "cache", None)
        if cache is not None:
            values[f'hf_paged_attention_kernel_info{{kernel="{cache.kernel.backend}"}}'] = 1
            values[f'hf_paged_kv_dtype_info{{kv_dtype="{engine.pool.kv_dtype}"}}'] = 1
            for backend, calls in cache.attention_calls.items():
                values[f'hf_paged_attention_calls_total{{kernel="{backend}"}}'] = calls
        runner = getattr(engine, "runner", None)  # a DistributedEngine's ranks have none
        if runner is not None:
            values['hf_paged_engine_steps_by_forward_total{forward="compiled"}'] = runner.compiled_steps
            values['hf_paged_engine_steps_by_forward_total{forward="eager"}'] = runner.eager_steps
            values["hf_paged_compiled_graphs_total"] = runner.graphs
            values["hf_paged_compile_seconds_total"] = runner.compile_s
            graphs = runner.decode_graphs
            for size in () if graphs is None else graphs.sizes:
                values[f'hf_paged_decode_graph_replays_total{{size="{size}"}}'] = graphs.replays_by_size[size]
        offload = getattr(getattr(engine, "pool", None), "offload", None)
        for tier in [] if offload is None else offload.stats().tiers:
            label = f'{{tier="{tier.name}"}}'
            values["hf_paged_kv_tier_enabled" + label] = int(tier.enabled)
            values["hf_paged_kv_tier_hits_total" + label] = tier.hits
            values["hf_paged_kv_tier_tokens_loaded_total" + label] = tier.tokens_loaded
            values["hf_paged_kv_tier_bytes_read_total" + label] = tier.bytes_read
            values["hf_paged_kv_tier_bytes_written_total" + label] = tier.bytes_written
            values["hf_paged_kv_tier_entries" + label] = tier.entries
            values["hf_paged_kv_tier_evictions_total" + label] = tier.evictions
            values["hf_paged_kv_tier_rejects_total" + label] = tier.rejects
            values["hf_paged_kv_tier_load_seconds_total" + label] = tier.load_seconds
        states = getattr(engine, "rank_states", None) or [RankState.of(0, engine)]  # a DistributedEngine's ranks
        values["hf_paged_tp_world_size"] = len(states)
        for state in states:
            label = f'{{rank="{state.rank}"}}'
            used, total = state.pool.num_used, state.pool.num_blocks
            values["hf_paged_rank_kv_blocks_used" + label] = used
            values["hf_paged_rank_kv_usage_ratio" + label] = used / total if total else 0.0
            values["hf_paged_rank_kv_bytes_used" + label] = state.kv_bytes_used
            values["hf_paged_rank_kv_bytes_total" + label] = state.kv_bytes_total
        latency = getattr(engine, "latency", None)
        return cls(
            {name: float(value) for name, value in values.items()},
            taken_at,
            None if latency is None else latency.copy(),
        )


def render_metrics(snapshot: MetricsSnapshot) -> str:
    """Prometheus exposition text of `snapshot`: KV blocks used/free, usage and waste, prefix hit rate, preemptions,
    requests running/waiting, the server's request, token and step counters (steps by kind, positions computed and
    pad positions among them), the attention kernel in use and its calls, the pool's K/V format, each
    tensor-parallel rank's KV blocks and bytes (labelled `rank="0"`, ...; one rank without tensor parallelism), the
    tiers behind the prefix cache when `kv_offload` is on (`hf_paged_kv_tier_*`, labelled `tier="disk"`, ...), and
    the latency histograms (time to first token, inter-token latency, end-to-end latency, queue time:
    `_bucket{le="..."}`, `_sum`, `_count`).

    Example:

    ```python
    >>> text = render_metrics(MetricsSnapshot({"hf_paged_kv_blocks_used": 3.0}, 0.0))
    >>> "hf_paged_kv_blocks_used 3" in text.splitlines()
    True

    ```
    """
    lines = []
    for name, kind, help_text in _SAMPLES:
        samples = [key for key in snapshot.values if key == name or key.startswith(name + "{")]  # labelled per rank
        if samples:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            lines += [f"{key} {snapshot.values[key]:g}" for key in samples]
    if snapshot.latency is not None:
        for name, field, help_text in _HISTOGRAMS:
            histogram = getattr(snapshot.latency, field)
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
            bounds = [f"{bound:g}" for bound in histogram.bounds] + ["+Inf"]
            lines += [f'{name}_bucket{{le="{le}"}} {count}' for le, count in zip(bounds, histogram.cumulative())]
            lines += [f"{name}_sum {histogram.sum:.6f}", f"{name}_count {histogram.count}"]
    return "\n".join(lines) + "\n"
