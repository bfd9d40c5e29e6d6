"""Whole-model prompt chunks over a cached context: how many new tokens a row may have and still read its K/V in
place under `kernel="auto"` on the CPU (`kernels.AUTO_CPU_MAX_QUERIES`), measured side by side in one run.

For each (batch, cached context, new tokens) a random prompt of `context` tokens is generated once, so prefix caching
holds its full blocks; then every round appends `new` fresh random tokens to it (other tokens for every setting and
round, so no setting reuses the blocks another computed) and times one greedy `generate` of one token: the forward
that matters is the prefill of the new tokens over the cached context, rows of `new` queries (a context of 0: a whole
new prompt, e.g. `1x0+2048`). Each value of `--limits` is set as `AUTO_CPU_MAX_QUERIES` in turn ("none": no limit);
with a limit below `new` those rows gather K/V and run SDPA, at or above it they read in place. The table shows the
median of `--rounds` calls and each setting's speed-up over the first. The tokens are checked to agree on one shared
input per shape (in fp32 they must; in bfloat16 they may not).

Usage: python benchmarks/in_place_queries.py [--model smollm2|tiny] [--limits 8 64 256] [--rounds 5]
       [--shapes 1x2048+24 8x1024+64 ...] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import environment, load_model, markdown_table

import hf_paged
import hf_paged.kernels as kernels

DEFAULT_SHAPES = "1x2048+24 1x2048+64 1x2048+128 1x2048+256 8x1024+24 8x1024+64 8x1024+128 8x2048+100".split()


def parse_shape(text: str) -> tuple[int, int, int]:
    """`"BxC+N"` → `(batch, cached context, new tokens)`."""
    try:
        batch, rest = text.split("x")
        context, new = rest.split("+")
        return int(batch), int(context), int(new)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is BATCHxCONTEXT+NEW (e.g. 8x1024+64), got {text!r}") from None


def parse_limit(text: str) -> int | None:
    if text == "none":
        return None
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"a limit is a positive number of queries or 'none', got {text!r}")
    return value


def generate_one(model, input_ids: torch.Tensor) -> torch.Tensor:
    return model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=1,
        min_new_tokens=1,
        do_sample=False,
        pad_token_id=0,
        cache_implementation="paged",
        cache_config={"max_memory": "2GiB"},
    )


def measure(model, batch: int, context: int, new: int, limits: list, rounds: int, vocab: int) -> tuple[list, bool]:
    """Median seconds per limit, and whether every limit gave the same tokens on one shared input."""
    cached = torch.randint(100, vocab, (batch, context), generator=torch.Generator().manual_seed(context + new))
    if context:
        generate_one(model, cached)  # its full blocks stay cached for the timed calls
    times: list[list[float]] = [[] for _ in limits]
    for round_ in range(rounds):
        for i, limit in enumerate(limits):
            kernels.AUTO_CPU_MAX_QUERIES = limit
            seed = torch.Generator().manual_seed(1 + 97 * round_ + i)
            fresh = torch.randint(100, vocab, (batch, new), generator=seed)
            start = time.perf_counter()
            generate_one(model, torch.cat([cached, fresh], dim=1))
            times[i].append(time.perf_counter() - start)
    shared = torch.cat([cached, torch.randint(100, vocab, (batch, new), generator=torch.Generator().manual_seed(0))], 1)
    outputs = []
    for limit in limits:
        # only the context cached, so every limit computes the shared new tokens itself (not the first one's blocks)
        hf_paged.get_pool(model).clear_prefix_cache()
        if context:
            generate_one(model, cached)
        kernels.AUTO_CPU_MAX_QUERIES = limit
        outputs.append(generate_one(model, shared))
    same = all(torch.equal(outputs[0], other) for other in outputs[1:])
    return [statistics.median(t) for t in times], same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=["tiny", "smollm2"])
    parser.add_argument("--limits", nargs="+", type=parse_limit, default=[8, 64, 256])
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=[parse_shape(s) for s in DEFAULT_SHAPES])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's (and pool's)")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    model, label = load_model(args.model)
    if args.dtype != "float32":
        model, label = model.to(getattr(torch, args.dtype)), f"{label.replace(' (fp32)', '')} in {args.dtype}"
    vocab = min(model.config.vocab_size, 40_000)
    names = ["none" if limit is None else str(limit) for limit in args.limits]
    headers = ["batch", "cached context", "new tokens"] + [f"limit {n} ms" for n in names]
    headers += [f"limit {n} vs {names[0]}" for n in names[1:]] + ["same tokens"]
    rows = []
    original = kernels.AUTO_CPU_MAX_QUERIES
    try:
        for batch, context, new in args.shapes:
            medians, same = measure(model, batch, context, new, args.limits, args.rounds, vocab)
            row = [batch, context, new] + [f"{1000 * m:.0f}" for m in medians]
            row += [f"{medians[0] / m:.2f}x" for m in medians[1:]] + ["yes" if same else "NO"]
            rows.append(row)
            print(" | ".join(map(str, row)), flush=True)
    finally:
        kernels.AUTO_CPU_MAX_QUERIES = original
    print(f"\n{label}; {environment()}\n")
    print(markdown_table(headers, rows))


if __name__ == "__main__":
    main()
