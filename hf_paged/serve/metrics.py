"""`/metrics`: the Engine and its block pool in Prometheus text format."""

from __future__ import annotations

from ..engine import Engine


def render_metrics(engine: Engine, totals: dict[str, int]) -> str:
    """Prometheus exposition text: KV blocks used/free, usage and waste, prefix hit rate, preemptions, requests
    running/waiting, and the server's request and token counters."""
    pool = engine.pool.stats()
    stats = engine.stats()
    usage = pool.num_used / pool.num_blocks if pool.num_blocks else 0.0
    samples = [
        ("hf_paged_kv_blocks_used", "gauge", "KV blocks held by running requests", pool.num_used),
        ("hf_paged_kv_blocks_free", "gauge", "KV blocks free (cached-evictable included)", pool.num_free),
        ("hf_paged_kv_blocks_total", "gauge", "KV blocks in the pool", pool.num_blocks),
        ("hf_paged_kv_blocks_cached", "gauge", "KV blocks indexed by the prefix cache", pool.num_cached),
        ("hf_paged_kv_usage_ratio", "gauge", "Share of KV blocks in use", usage),
        ("hf_paged_kv_waste_ratio", "gauge", "Share of allocated KV slots holding no token", pool.waste_fraction),
        (
            "hf_paged_prefix_hit_ratio",
            "gauge",
            "Share of admitted prompt tokens served by the prefix cache",
            stats.prefix_hit_rate,
        ),
        (
            "hf_paged_preemptions_total",
            "counter",
            "Requests preempted and recomputed",
            engine.scheduler.num_preemptions,
        ),
        ("hf_paged_requests_running", "gauge", "Requests decoding", engine.num_running),
        ("hf_paged_requests_waiting", "gauge", "Requests queued", engine.num_waiting),
        ("hf_paged_requests_total", "counter", "Requests finished", totals["requests"]),
        ("hf_paged_prompt_tokens_total", "counter", "Prompt tokens of finished requests", totals["prompt_tokens"]),
        ("hf_paged_generation_tokens_total", "counter", "Tokens generated", totals["generation_tokens"]),
    ]
    lines = []
    for name, kind, help_text, value in samples:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {float(value):g}"]
    return "\n".join(lines) + "\n"
