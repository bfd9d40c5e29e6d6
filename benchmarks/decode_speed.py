"""Decode tokens/s of `cache_implementation="paged"` vs `DynamicCache`, measured side by side in one run.

For each (model, batch, context) the same prompt is generated with each cache, alternating, `--repeats` times.
Decode time = time(generate N + 1 new tokens) - time(generate 1 new token), so the prefill is left out; the table
shows the median. EOS is disabled (`min_new_tokens`) so every run decodes N tokens. "overhead µs/step" is what one
decode step of the whole batch costs more with the paged cache: batch / paged tok/s - batch / Dynamic tok/s.

Usage: python benchmarks/decode_speed.py [--models tiny smollm2] [--contexts 128 512 1024] [--batches 1 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import environment, load_model, markdown_table

import hf_paged  # noqa: F401  (registers cache_implementation="paged")

CACHES = {"DynamicCache": {}, "paged": {"cache_implementation": "paged"}}
HEADERS = ["model", "batch", "context", "DynamicCache tok/s", "paged tok/s", "paged / Dynamic", "overhead µs/step"]


def timed_generate(model, input_ids, new_tokens: int, options: dict) -> float:
    start = time.perf_counter()
    model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        min_new_tokens=new_tokens,
        max_new_tokens=new_tokens,
        pad_token_id=0,
        **options,
    )
    return time.perf_counter() - start


def decode_seconds(model, input_ids, new_tokens: int, options: dict) -> float:
    return timed_generate(model, input_ids, new_tokens + 1, options) - timed_generate(model, input_ids, 1, options)


def measure(model, batch: int, context: int, new_tokens: int, repeats: int) -> dict[str, float]:
    generator = torch.Generator().manual_seed(batch * 10_000 + context)
    input_ids = torch.randint(3, model.config.vocab_size, (batch, context), generator=generator)
    for options in CACHES.values():  # warm-up
        decode_seconds(model, input_ids, 2, options)
    samples = {name: [] for name in CACHES}
    for _ in range(repeats):
        for name, options in CACHES.items():
            samples[name].append(decode_seconds(model, input_ids, new_tokens, options))
    return {name: batch * new_tokens / statistics.median(times) for name, times in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    parser.add_argument("--contexts", nargs="+", type=int, default=[128, 512, 1024])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(environment() + "\n")

    rows = []
    for name in args.models:
        model, label = load_model(name)
        for batch in args.batches:
            for context in args.contexts:
                speed = measure(model, batch, context, args.new_tokens, args.repeats)
                ratio = speed["paged"] / speed["DynamicCache"]
                overhead_us = (batch / speed["paged"] - batch / speed["DynamicCache"]) * 1e6
                rows.append(
                    [
                        label,
                        batch,
                        context,
                        f"{speed['DynamicCache']:.0f}",
                        f"{speed['paged']:.0f}",
                        f"{ratio:.2f}x",
                        f"{overhead_us:.0f}",
                    ]
                )
                print(markdown_table(HEADERS, rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(markdown_table(HEADERS, rows))


if __name__ == "__main__":
    main()
