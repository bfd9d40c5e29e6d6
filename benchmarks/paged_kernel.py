"""One layer's paged attention: the in-place CPU kernel vs gather + SDPA (what the `"hf_paged"` attention did before
it had a kernel, and still does with `kernel="gather"`), side by side in one run.

Shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64) in fp32, blocks of 16 tokens handed out in
random order. "decode": every row computes one query over its whole context; "prefill chunk": every row computes its
last `--chunk` tokens. The gather side is what the attention ran: K and V copied through the block tables into a
dense `[batch, kv_heads, context, head_dim]` copy (one `index_select` each), then SDPA over the copy (with the
causal mask a chunk needs). Times are medians of `--repeats` calls; with `--cold` the CPU's caches are filled with
other data before every call (as a model's weights fill them between two layers), so K/V come from memory.

Usage: python benchmarks/paged_kernel.py [--batches 1 8] [--contexts 256 1024 2048 4096] [--chunk 8 16 64] [--cold]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from common import environment, markdown_table

from hf_paged.kernels import cpu
from hf_paged.kernels.reference import repeat_kv
from hf_paged.storage import head_rows

HEADERS = ["shape", "batch", "context", "queries/row", "gather + SDPA ms", "in-place kernel ms", "speed-up"]


def median_ms(fn, repeats: int, cold: bool = False) -> float:
    """Median of `repeats` timed calls of `fn` (after one untimed); `cold`: the caches are filled with other data
    before every call (outside the timing), as a model's weights fill them between two layers' attention."""
    fn()
    times = []
    for _ in range(repeats):
        if cold:
            evict_caches()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


_SCRATCH = None


def evict_caches(megabytes: int = 128) -> None:
    """Write `megabytes` of other data, more than the CPU's caches hold, so the next call reads from memory."""
    global _SCRATCH
    if _SCRATCH is None:
        _SCRATCH = torch.zeros(megabytes * 2**20 // 4)
    _SCRATCH.add_(1.0)


def layer(batch: int, context: int, queries: int, heads=9, kv_heads=3, head_dim=64, block_size=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    blocks_per_row = -(-context // block_size)
    num_blocks = batch * blocks_per_row + 64
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator)
    tables = torch.randperm(num_blocks, generator=generator)[: batch * blocks_per_row].view(batch, -1)
    query = torch.randn(batch * queries, heads, head_dim, generator=generator)
    return query, key_cache, value_cache, tables.to(torch.int32)


def gather_sdpa(query, key_cache, value_cache, tables, context: int, queries: int):
    batch, heads, head_dim = tables.shape[0], query.shape[1], query.shape[2]
    kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    positions = torch.arange(context)
    slots = tables.long()[:, positions // block_size] * block_size + positions % block_size
    index = head_rows(slots, kv_heads)
    mask = None
    if queries > 1:
        mask = torch.ones(queries, context, dtype=torch.bool).tril(context - queries)

    def run():
        keys = key_cache.view(-1, head_dim).index_select(0, index).view(batch, kv_heads, context, head_dim)
        values = value_cache.view(-1, head_dim).index_select(0, index).view(batch, kv_heads, context, head_dim)
        per_row = query.view(batch, queries, heads, head_dim).transpose(1, 2)
        n_rep = heads // kv_heads
        return F.scaled_dot_product_attention(
            per_row, repeat_kv(keys, n_rep), repeat_kv(values, n_rep), attn_mask=mask, scale=head_dim**-0.5
        )

    return run


def in_place(query, key_cache, value_cache, tables, context: int, queries: int):
    batch = tables.shape[0]
    lengths = torch.full((batch,), context, dtype=torch.int32)
    starts = torch.arange(0, (batch + 1) * queries, queries, dtype=torch.int32)
    scale = query.shape[-1] ** -0.5
    return lambda: cpu.attention(query, key_cache, value_cache, tables, lengths, starts, scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--contexts", nargs="+", type=int, default=[256, 1024, 2048, 4096])
    parser.add_argument("--chunk", nargs="+", type=int, default=[4, 8, 16, 64])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--cold", action="store_true", help="fill the caches with other data before every timed call (as in a model)"
    )
    args = parser.parse_args()
    print(environment() + "\n")
    cpu.library()  # built (or loaded from the cache) before timing
    rows = []
    for queries in [1, *args.chunk]:
        for batch in args.batches:
            for context in args.contexts:
                if queries > context:
                    continue  # a chunk is part of its row's context
                tensors = layer(batch, context, queries)
                gather_ms = median_ms(gather_sdpa(*tensors, context, queries), args.repeats, args.cold)
                kernel_ms = median_ms(in_place(*tensors, context, queries), args.repeats, args.cold)
                shape = "decode" if queries == 1 else "prefill chunk"
                rows.append(
                    [
                        shape,
                        batch,
                        context,
                        queries,
                        f"{gather_ms:.3f}",
                        f"{kernel_ms:.3f}",
                        f"{gather_ms / kernel_ms:.2f}x",
                    ]
                )
                print(markdown_table(HEADERS, rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(markdown_table(HEADERS, rows))


if __name__ == "__main__":
    main()
