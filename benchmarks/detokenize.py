"""The Engine's text side alone: what `TextTracker` (a request's streamed text, stop strings watched) costs per
request and per step as an output grows, with SmolLM2's tokenizer, for outputs of random token ids. The Engine
updates the tracker of every running request at every step, so a cost that grows with the output length is paid
by every step of a long generation.

Usage: python benchmarks/detokenize.py [--lengths 250 1000 2000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch
from common import environment, markdown_table

from hf_paged.engine.text import TextTracker
from hf_paged.reference_models import load_smollm2


def seconds(tokenizer, token_ids: list[int], stop: tuple[str, ...]) -> tuple[float, float]:
    """`(whole request, last step)`: the seconds a tracker takes over every step of the output, and its last step."""
    tracker = TextTracker(tokenizer, stop)
    start = time.perf_counter()
    for count in range(1, len(token_ids)):
        tracker.update(token_ids[:count])
    last = time.perf_counter()
    tracker.update(token_ids)
    end = time.perf_counter()
    tracker.finish(token_ids)
    return end - start, end - last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[250, 1000, 2000])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    _, tokenizer = load_smollm2()
    generator = torch.Generator().manual_seed(0)
    rows = []
    for length in args.lengths:
        token_ids = torch.randint(100, tokenizer.vocab_size, (length,), generator=generator).tolist()
        for stop in ((), ("zzzz",)):
            runs = [seconds(tokenizer, token_ids, stop) for _ in range(args.repeats)]
            whole, last = min(r[0] for r in runs), min(r[1] for r in runs)
            rows.append([length, "yes" if stop else "no", f"{whole * 1e3:.1f}", f"{last * 1e3:.3f}"])
    print(f"SmolLM2 tokenizer; {environment()}\n")
    print(markdown_table(["output tokens", "stop string", "ms per request", "ms at the last step"], rows))


if __name__ == "__main__":
    main()
