"""How to add each token's own LoRA update in a step that mixes adapters: the choice behind `AdapterSet`.

One linear layer of SmolLM2's shape (576 -> 576), `--adapters` adapters of rank `--rank`, tokens assigned to adapters
round-robin (`present` of them in the step), timed per call (median of `--repeats`):

- **base**: the linear layer alone (no adapter);
- **stacked** (used): every resident adapter's factors stacked once at load time, `((x @ A.T) * mask) @ B.T`:
  two matmuls whatever the mix, the mask keeping each token's own columns;
- **gather** (PEFT's `_mixed_batch_forward` design): per adapter present, `index_select` its tokens, two matmuls,
  `index_add_` the result back.

Usage: OMP_NUM_THREADS=1 python benchmarks/lora_update.py [--adapters 8] [--rank 8] [--repeats 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import environment, markdown_table


def timed(function, repeats: int) -> float:
    for _ in range(10):
        function()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--features", type=int, default=576)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.manual_seed(0)
    n, r, d = args.adapters, args.rank, args.features
    weight = torch.randn(d, d) / d**0.5
    a, b = torch.randn(n, r, d) / d**0.5, torch.randn(n, d, r) / r**0.5
    a_stack = a.reshape(n * r, d)
    b_stack = b.permute(1, 0, 2).reshape(d, n * r)
    rows = []
    for tokens, present, what in [(64, n, "decode, 64 rows"), (64, 2, "decode, 64 rows"), (320, n, "mixed step"),
                                  (512, n, "prefill"), (8, n, "decode, 8 rows")]:  # fmt: skip
        x = torch.randn(tokens, d)
        slots = torch.arange(tokens) % present
        select = torch.zeros(n, n * r)
        for slot in range(n):
            select[slot, slot * r : (slot + 1) * r] = 1
        mask = select[slots]
        groups = [(slot, (slots == slot).nonzero().flatten()) for slot in range(present)]

        def base(x=x):
            return x @ weight.T

        def stacked(x=x, mask=mask):
            return (x @ weight.T).addmm((x @ a_stack.T).mul_(mask), b_stack.T)

        def gather(x=x, groups=groups):
            y = x @ weight.T
            for slot, index in groups:
                part = x.index_select(0, index)
                y.index_add_(0, index, (part @ a[slot].T) @ b[slot].T)
            return y

        assert torch.allclose(stacked(), gather(), atol=1e-4)
        times = [timed(f, args.repeats) for f in (base, stacked, gather)]
        rows.append(
            [what, tokens, present, *(f"{t:,.0f}" for t in times), f"{times[1] / times[0]:.2f}x",
             f"{times[2] / times[0]:.2f}x"]
        )  # fmt: skip
    print(f"one {d} -> {d} linear, {n} adapters of rank {r} resident; {environment()}\n")
    headers = ["step", "tokens", "adapters in step", "base us", "stacked us", "gather us", "stacked/base",
               "gather/base"]  # fmt: skip
    print(markdown_table(headers, rows))


if __name__ == "__main__":
    main()
