"""How a packed step's attention is laid out, measured: the queries of a packed forward (`[1, T]`, no pad
position) attend per row to that row's keys, read through the block tables. Three groupings of rows into attention
calls are timed on the same shapes, one layer, SmolLM2-135M's heads (9 query heads, 3 KV heads, head dim 64):

- "one": every row in one call, each row's queries padded to the widest row (`[rows, heads, W, head_dim]`);
- "rows": one call per row (no padding, a Python loop over the rows);
- "log2" (what the Engine uses): rows whose new-token counts are within a factor of 2 share a call.

Shapes: a decode step (64 rows x 1 token, contexts 20-300), a prefill of 16 short prompts (8-64 tokens), and a mixed
step (63 decoding rows plus one 256-token prompt chunk).

Usage: python benchmarks/packed_attention.py [--repeats 30]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from common import environment, markdown_table

from hf_paged.attention import _packed_attention
from hf_paged.batch import GROUPINGS, PackedRows

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


class Layer(torch.nn.Module):
    num_key_value_groups = HEADS // KV_HEADS
    is_causal = True


def shapes(seed: int = 0) -> dict[str, tuple[list[int], list[int]]]:
    """`{name: (pasts, counts)}`: tokens each row held before the step and its new tokens."""
    rng = random.Random(seed)
    decode = ([rng.randint(20, 300) for _ in range(64)], [1] * 64)
    prefill = ([0] * 16, [rng.randint(8, 64) for _ in range(16)])
    mixed = ([rng.randint(20, 300) for _ in range(63)] + [0], [1] * 63 + [256])
    return {"decode (64 x 1)": decode, "prefill (16 x 8-64)": prefill, "mixed (63 x 1 + 256)": mixed}


def time_grouping(pasts, counts, grouping: str, repeats: int) -> float:
    packed = PackedRows.of(pasts, counts, "cpu", grouping)
    length = max(p + c for p, c in zip(pasts, counts))
    query = torch.randn(1, HEADS, sum(counts), HEAD_DIM)
    key = torch.randn(len(counts), KV_HEADS, length, HEAD_DIM)
    value = torch.randn_like(key)
    layer = Layer().eval()
    for _ in range(3):
        _packed_attention(layer, query, key, value, packed, None, HEAD_DIM**-0.5, 0.0, None, None)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        _packed_attention(layer, query, key, value, packed, None, HEAD_DIM**-0.5, 0.0, None, None)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    print(environment() + "\n")
    rows = []
    for name, (pasts, counts) in shapes().items():
        times = {grouping: time_grouping(pasts, counts, grouping, args.repeats) for grouping in GROUPINGS}
        best = min(times.values())
        rows.append([name] + [f"{times[g] * 1e3:.2f} ms{' (best)' if times[g] == best else ''}" for g in GROUPINGS])
    print(markdown_table(["step"] + [f'"{g}"' for g in GROUPINGS], rows))


if __name__ == "__main__":
    main()
