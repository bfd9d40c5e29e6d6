"""The Triton kernel on a CUDA device reading unquantized, int8, int4 and int4-channel pages: one layer's decode
attention (one query a row over its whole context), side by side in one run.

Shapes are a Llama-style layer (32 query heads, 8 KV heads, head_dim 128), blocks of 16 tokens handed out in random
order (`"int4-channel"`: the same K/V written through its storage in blocks of 64, every row's last block open,
its keys in companion blocks); queries and unquantized pages in `--dtype` (bf16). Times are medians of `--repeats`
calls timed with CUDA events (after `--warmup` untimed calls). "GB/s" is the bytes of K/V the call must read (codes
and scales) over its time: a decode call that reads each byte once is bound by that figure. `--tile-n 16 64 128`
times each format with the kernel taking that many keys a step (default: its `TILE_N_BY_PRODUCTS`), to choose those
constants.

Usage: python benchmarks/gpu_page_formats.py [--batches 8 32] [--contexts 2048 8192] [--dtype bfloat16]
       [--tile-n 16 128] [--repeats 50]

Without a CUDA device it prints one line saying so and exits with status 0 (`--device cpu` runs tiny shapes under
Triton's interpreter, for the tests).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
from common import environment

from hf_paged import kernels
from hf_paged.allocator import BlockAllocator
from hf_paged.channel_keys import StagedLayout
from hf_paged.kernels import triton as triton_backend
from hf_paged.kv_format import FORMATS, QuantizedPages, kv_format
from hf_paged.staged_storage import StagedKVStorage

HEADERS = [
    "batch",
    "context",
    "pages",
    "keys a step",
    "K/V bytes a token",
    "ms a call",
    "GB/s",
    "speed vs the shape's first row",
]
QUANTIZED = ["int8", "int4", "int4-channel"]
CHANNEL_BLOCK = 64  # the block size of "int4-channel" pages (the pool's default for them)


def layer_call(batch, context, device, dtype, heads, kv_heads, head_dim, seed=0):
    """Query, K/V blocks in `dtype`, tables, lengths and query starts of a decode call."""
    generator = torch.Generator().manual_seed(seed)
    block_size = 16
    blocks_per_row = -(-context // block_size)
    num_blocks = batch * blocks_per_row + 8
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=generator).to(device, dtype)
    value_cache = torch.randn(shape, generator=generator).to(device, dtype)
    order = torch.randperm(num_blocks, generator=generator)[: batch * blocks_per_row]
    tables = order.view(batch, blocks_per_row).to(device, torch.int32)
    query = torch.randn(batch, heads, head_dim, generator=generator).to(device, dtype)
    lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
    return query, key_cache, value_cache, tables, lengths, starts


def pages(cache: torch.Tensor, name: str):
    """`cache` stored as `name` pages, and the bytes one token of it takes (codes and scales), as the pool counts
    them (`KVFormat.bytes_per_head`)."""
    fmt = kv_format(name if name in QUANTIZED else "auto")
    _, _, kv_heads, head_dim = cache.shape
    token_bytes = kv_heads * fmt.bytes_per_head(head_dim, cache.dtype)
    if not fmt.quantized:
        return cache, token_bytes
    return QuantizedPages(fmt, *fmt.quantize(cache), cache.dtype), token_bytes


def channel_pages(key_cache, value_cache, tables, lengths):
    """Every row's K/V (read through `tables` from the dense blocks) written into `"int4-channel"` pages, as a pool
    writes them: (key pages, value pages, their block tables, the bytes of K and V a token takes (block rows over
    block size))."""
    _, _, kv_heads, head_dim = key_cache.shape
    layout = StagedLayout(CHANNEL_BLOCK, kv_heads, head_dim)
    companions = layout.companions(key_cache.dtype)
    lengths = lengths.tolist()
    num_blocks = sum(-(-length // CHANNEL_BLOCK) + companions for length in lengths) + 1
    allocator = BlockAllocator(num_blocks, CHANNEL_BLOCK, companions)
    storage = StagedKVStorage(num_blocks, CHANNEL_BLOCK, kv_format=FORMATS["int4-channel"], companions=companions)
    rows = []
    for row, length in enumerate(lengths):
        positions = torch.arange(length, device=key_cache.device)
        dense_block = key_cache.shape[1]
        dense_slots = tables[row].long()[positions // dense_block] * dense_block + positions % dense_block
        table = allocator.new_table()
        copies = allocator.append(table, length)
        storage.apply_staging(allocator.staging)
        storage.copy_blocks(copies)
        block_ids = torch.tensor(table.block_ids, device=key_cache.device)
        slots = block_ids[positions // CHANNEL_BLOCK] * CHANNEL_BLOCK + positions % CHANNEL_BLOCK
        flat = (-1, kv_heads, head_dim)
        storage.write(0, slots, key_cache.view(flat)[dense_slots], value_cache.view(flat)[dense_slots])
        rows.append(table.block_ids)
    channel_tables = torch.tensor(rows, dtype=torch.int32, device=key_cache.device)
    key_pages, value_pages = storage.layer_tensors(0)
    return key_pages, value_pages, channel_tables, layout.row_bytes // CHANNEL_BLOCK // 2


def median_ms(fn, repeats: int, warmup: int, device: str) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def measure(args) -> list[list[str]]:
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            query, key_cache, value_cache, tables, lengths, starts = layer_call(
                batch, context, args.device, getattr(torch, args.dtype), args.heads, args.kv_heads, args.head_dim
            )
            scale = args.head_dim**-0.5
            base_ms = None
            for name in [args.dtype, *QUANTIZED]:
                if name == "int4-channel":
                    key_pages, value_pages, name_tables, token_bytes = channel_pages(
                        key_cache, value_cache, tables, lengths
                    )
                else:
                    key_pages, token_bytes = pages(key_cache, name)
                    value_pages, _ = pages(value_cache, name)
                    name_tables = tables
                for tile_n in args.tile_n or [None]:
                    triton_backend.TILE_N = tile_n
                    call = functools.partial(
                        kernels.paged_attention, query, key_pages, value_pages, name_tables, lengths, starts,
                        scale=scale, kernel="triton",
                    )  # fmt: skip
                    ms = median_ms(call, args.repeats, args.warmup, args.device)
                    base_ms = ms if base_ms is None else base_ms
                    read = 2 * token_bytes * batch * context
                    rows.append(
                        [
                            str(batch), str(context), name, str(tile_n or "default"), str(2 * token_bytes), f"{ms:.3f}",
                            f"{read / ms / 1e6:.0f}", f"{base_ms / ms:.2f}x",
                        ]
                    )  # fmt: skip
                    print("| " + " | ".join(rows[-1]) + " |", flush=True)
                del key_pages, value_pages
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", nargs="+", type=int, default=[8, 32])
    parser.add_argument("--contexts", nargs="+", type=int, default=[2048, 8192])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--tile-n", nargs="+", type=int, help="keys a kernel step; 0: the kernel's own (the default)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: benchmarks/gpu_page_formats.py measures the Triton kernel on a GPU (see docs/gpu.md)")
        return
    print("# gpu_page_formats\n")
    gpu = f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""
    print(environment() + gpu + "\n")
    print("| " + " | ".join(HEADERS) + " |\n|" + "---|" * len(HEADERS), flush=True)
    measure(args)


if __name__ == "__main__":
    main()
