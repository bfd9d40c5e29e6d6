"""Sequences resident in one KV budget with `kv_dtype="int4-channel"` (keys per channel per block, the open block's
keys in full precision in companion blocks) next to bf16 pages and per-token int4 pages, for long sequences and the
ShareGPT-like mix.

Method: SmolLM2-135M's KV shape (30 layers x 3 KV heads x head_dim 64) with bf16 K/V; each format gets the blocks
`--budget` bytes buy (`KVShape`'s bytes per block: codes, scales, per-channel steps and minimums), in a real
`BlockAllocator` of its block size (int4-channel: its companions per open block as the pool sizes them). Requests are
admitted in arrival order at their final length (`append` of that many tokens: a sequence whose last block is not
full holds that open block's companions too, as every running sequence does while it writes) until one does not fit;
the mean over 100 starting points in the stream. Workloads: fixed lengths (2,048, 2,047, 4,096, 8,192), lengths
uniform in [2,048, 8,192] (1,000 requests, seed 0), and kv_memory.py's ShareGPT-like mix (4,000 requests, lengths
up to 2,047).

Usage: python benchmarks/kv_channel_resident.py [--budget 4GiB] [--block-sizes 32 64]
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch
from common import environment, markdown_table
from kv_memory import sharegpt_like_requests

from hf_paged import BlockAllocator, PoolExhaustedError
from hf_paged.config import parse_memory
from hf_paged.pool import KVShape

LAYERS, HEADS, HEAD_DIM = 30, 3, 64


def resident(lengths: list[int], shape: KVShape, block_size: int, budget: int) -> float:
    """Mean requests of `lengths` resident at once in `budget` bytes of `shape`'s pages of `block_size` tokens."""
    num_blocks = budget // (shape.bytes_per_block_token * block_size)
    samples = []
    for offset in range(0, len(lengths), max(1, len(lengths) // 100)):
        allocator, count = BlockAllocator(num_blocks, block_size, shape.companions), 0
        for length in lengths[offset:] + lengths[:offset]:
            try:
                allocator.append(allocator.new_table(), length)
            except PoolExhaustedError:
                break
            count += 1
        samples.append(count)
    return statistics.mean(samples)


def workloads() -> dict[str, list[int]]:
    rng = random.Random(0)
    mix = [prompt + output - 1 for prompt, output in sharegpt_like_requests(4000)]
    return {
        "2,048 tokens each": [2048] * 400,
        "2,047 tokens each (last block open)": [2047] * 400,
        "4,096 tokens each": [4096] * 400,
        "8,192 tokens each": [8192] * 400,
        "uniform 2,048-8,192": [rng.randint(2048, 8192) for _ in range(1000)],
        "ShareGPT-like mix": mix,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", default="4GiB")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[32, 64])
    args = parser.parse_args()
    budget = parse_memory(args.budget)
    print(environment(), "\n")
    formats = {"bf16 pages (block 16)": (KVShape(LAYERS, HEADS, HEAD_DIM, torch.bfloat16), 16)}
    formats["int4 pages (block 16)"] = (KVShape(LAYERS, HEADS, HEAD_DIM, torch.bfloat16, kv_dtype="int4"), 16)
    for block in args.block_sizes:
        shape = KVShape(LAYERS, HEADS, HEAD_DIM, torch.bfloat16, kv_dtype="int4-channel", block_size=block)
        formats[f"int4-channel (block {block}, {shape.companions} companions)"] = (shape, block)
    print("## Bytes per token (SmolLM2-135M, bf16 K/V)\n")
    rows = [[name, f"{shape.bytes_per_token:,}"] for name, (shape, _) in formats.items()]
    print(markdown_table(["pages", "bytes per token (full blocks)"], rows) + "\n")
    print(f"## Sequences resident in {args.budget} of KV\n")
    rows = []
    for workload, lengths in workloads().items():
        counts = {name: resident(lengths, shape, block, budget) for name, (shape, block) in formats.items()}
        base = counts["bf16 pages (block 16)"]
        rows += [[workload, name, f"{count:.1f}", f"{count / base:.2f}x"] for name, count in counts.items()]
    print(markdown_table(["workload", "pages", "sequences resident (mean)", "vs bf16 pages"], rows))


if __name__ == "__main__":
    main()
