"""Decode tokens/s of `cache_implementation="paged"` (its default kernel, and `kernel="gather"`) vs `DynamicCache`,
measured side by side in one run.

For each (model, batch, context) the same random prompt is generated with each cache in turn, `--repeats` times,
after one short warm-up call per cache and model. Decode steps are timed inside the call (a stopping criterion notes
the time after every step), so the prefill is left out; the table shows the median step. EOS is disabled
(`min_new_tokens`) so every run decodes N tokens. The pool gets `--pool-memory` of KV (the default 1 GiB holds less
than 8 x 4096 tokens of SmolLM2). With prefix caching on (the default), repeated paged calls reuse the prompt's
blocks and prefill only its last token; decode steps are not affected.

Usage: python benchmarks/decode_speed.py [--models tiny smollm2] [--contexts 128 512 1024 2048 4096] [--batches 1 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import environment, load_model, markdown_table
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_paged  # noqa: F401  (registers cache_implementation="paged")

HEADERS = [
    "model",
    "batch",
    "context",
    "DynamicCache tok/s",
    "paged tok/s",
    "paged gather tok/s",
    "paged / Dynamic",
    "gather / Dynamic",
]


class StepClock(StoppingCriteria):
    """Notes the time after every generated token (never stops generation)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def greedy_decode(model, input_ids, new_tokens: int, options: dict, clock: StepClock) -> torch.Tensor:
    """One greedy `generate` call of exactly `new_tokens` tokens with `options`, `clock` called after every step;
    returns its tokens."""
    return model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        min_new_tokens=new_tokens,
        max_new_tokens=new_tokens,
        pad_token_id=0,
        stopping_criteria=StoppingCriteriaList([clock]),
        **options,
    )


def step_seconds(model, input_ids, new_tokens: int, options: dict) -> list[float]:
    """Seconds of every decode step of one `generate` call (the first token, which the prefill computes, excluded)."""
    clock = StepClock()
    greedy_decode(model, input_ids, new_tokens, options, clock)
    return [b - a for a, b in zip(clock.times, clock.times[1:])]


def caches(pool_memory: str) -> dict[str, dict]:
    paged = {"cache_implementation": "paged"}
    return {
        "DynamicCache": {},
        "paged": {**paged, "cache_config": {"max_memory": pool_memory}},
        "gather": {**paged, "cache_config": {"max_memory": pool_memory, "kernel": "gather"}},
    }


def measure(model, batch: int, context: int, new_tokens: int, repeats: int, pool_memory: str) -> dict[str, float]:
    generator = torch.Generator().manual_seed(batch * 10_000 + context)
    input_ids = torch.randint(3, model.config.vocab_size, (batch, context), generator=generator)
    options = caches(pool_memory)
    steps = {name: [] for name in options}
    for _ in range(repeats):
        for name, option in options.items():
            steps[name].extend(step_seconds(model, input_ids, new_tokens, option))
    return {name: batch / statistics.median(times) for name, times in steps.items()}


def warm_up(model, pool_memory: str) -> None:
    """One short call per cache (kernel built or loaded, first-call costs paid) before anything is timed."""
    input_ids = torch.randint(3, model.config.vocab_size, (2, 32))
    for option in caches(pool_memory).values():
        step_seconds(model, input_ids, 4, option)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2"], choices=["tiny", "smollm2"])
    parser.add_argument("--contexts", nargs="+", type=int, default=[128, 512, 1024, 2048, 4096])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--pool-memory", default="4GiB")
    args = parser.parse_args()
    print(environment() + "\n")

    rows = []
    for name in args.models:
        model, label = load_model(name)
        warm_up(model, args.pool_memory)
        for batch in args.batches:
            for context in args.contexts:
                speed = measure(model, batch, context, args.new_tokens, args.repeats, args.pool_memory)
                rows.append(
                    [
                        label,
                        batch,
                        context,
                        f"{speed['DynamicCache']:.1f}",
                        f"{speed['paged']:.1f}",
                        f"{speed['gather']:.1f}",
                        f"{speed['paged'] / speed['DynamicCache']:.2f}x",
                        f"{speed['gather'] / speed['DynamicCache']:.2f}x",
                    ]
                )
                print(markdown_table(HEADERS, rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(markdown_table(HEADERS, rows))


if __name__ == "__main__":
    main()
