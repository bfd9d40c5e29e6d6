"""Sliding-window models: peak KV bytes and decode time of a long generation, DynamicCache vs paged with and without
giving back the blocks its window skipped.

Models (random weights, fp32, built from configs): a Mistral-style model whose every layer slides, a Gemma2-style
hybrid (sliding and full layers alternate) and a Gemma3-style hybrid (five sliding layers to one full); 6 layers,
width 256, 4 KV heads of 64, window `--window`. A batch of `--batch` prompts of `--prompt` random tokens generates
`--new` tokens greedily (min_new_tokens), three ways, alternating, `--repeats` times (time: median):

- DynamicCache: transformers' own cache (its sliding layers keep the last window - 1 tokens); peak KV bytes are the
  sizes of its K/V tensors, read after every update.
- paged, release off: `cache.skip_window = None`, every layer keeps every block (what a single block
  table per row must do on a hybrid model).
- paged: the default; sliding layer groups give back the blocks behind their window.
Paged peak KV bytes = the most distinct blocks the cache held x bytes per block (`KVShape.bytes_per_block_token` x
block size). Output tokens are compared with DynamicCache.

Usage: python benchmarks/sliding_memory.py [--window 256] [--prompt 128] [--new 1024] [--batch 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import environment, markdown_table
from transformers import DynamicCache

import hf_paged
from hf_paged.reference_models import tiny_model

SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
)
MODELS = {
    "mistral": ("Mistral-style, all 6 layers slide", "mistral", {}),
    "gemma2": ("Gemma2-style, 3 sliding + 3 full", "gemma2", {"query_pre_attn_scalar": 64}),
    "gemma3": (
        "Gemma3-style, 5 sliding + 1 full",
        "gemma3",
        {"query_pre_attn_scalar": 64, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
    ),
}
BLOCK_SIZE = 16


class DynamicMeter:
    """Peak K/V bytes of every DynamicCache updated while active."""

    def __init__(self):
        self.peak = 0

    def __enter__(self):
        meter, update = self, DynamicCache.update
        self._original = update

        def metered(cache, *args, **kwargs):
            out = update(cache, *args, **kwargs)
            held = sum(
                t.numel() * t.element_size()
                for layer in cache.layers
                for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                if isinstance(t, torch.Tensor)
            )
            meter.peak = max(meter.peak, held)
            return out

        DynamicCache.update = metered
        return self

    def __exit__(self, *exc):
        DynamicCache.update = self._original


def run(model, input_ids, new: int, mode: str):
    """`(sequences, peak KV bytes, seconds)` of one greedy generation."""
    kwargs = dict(input_ids=input_ids, min_new_tokens=new, max_new_tokens=new, do_sample=False, pad_token_id=0)
    if mode == "dynamic":
        with DynamicMeter() as meter:
            start = time.perf_counter()
            out = model.generate(**kwargs)
            seconds = time.perf_counter() - start
        return out, meter.peak, seconds
    cache = hf_paged.PagedCache(model, block_size=BLOCK_SIZE)
    if mode == "paged, release off":
        cache.skip_window = None
    start = time.perf_counter()
    out = model.generate(**kwargs, past_key_values=cache)
    seconds = time.perf_counter() - start
    per_block = cache.pool.kv_shape.bytes_per_block_token * BLOCK_SIZE
    peak = cache.stats().peak_blocks * per_block
    cache.release()
    return out, peak, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(environment() + "\n")
    modes = ["dynamic", "paged, release off", "paged"]
    rows = []
    for name in args.models:
        label, family, extra = MODELS[name]
        model = tiny_model(family, **{**SHAPE, **extra, "sliding_window": args.window})
        input_ids = torch.randint(3, 128, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
        results = {mode: [] for mode in modes}
        for _ in range(args.repeats):
            for mode in modes:
                results[mode].append(run(model, input_ids, args.new, mode))
        reference = results["dynamic"][0][0]
        mib = 2**20
        dynamic_peak, dynamic_s = results["dynamic"][0][1], statistics.median(r[2] for r in results["dynamic"])
        groups = hf_paged.get_pool(model).layout.num_groups
        for mode in modes:
            peak, seconds = results[mode][0][1], statistics.median(r[2] for r in results[mode])
            same = all(torch.equal(r[0], reference) for r in results[mode])
            rows.append(
                [
                    label,
                    groups,
                    mode,
                    f"{peak / mib:.1f}",
                    f"{peak / dynamic_peak:.2f}",
                    f"{seconds:.1f}",
                    f"{dynamic_s / seconds:.2f}x",
                    "yes" if same else "NO",
                ]
            )
            print(rows[-1], flush=True)
    print()
    print(
        f"batch {args.batch}, prompt {args.prompt}, {args.new} new tokens, window {args.window}, block size "
        f"{BLOCK_SIZE}, fp32\n"
    )
    headers = ["model", "layer groups", "cache", "peak KV MiB", "vs Dynamic", "s", "speed vs Dynamic", "same tokens"]
    print(markdown_table(headers, rows))


if __name__ == "__main__":
    main()
