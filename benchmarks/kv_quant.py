"""Quantized pages (`cache_config={"kv_dtype": ...}`): bytes per token, sequences resident in one KV budget, quality
on SmolLM2 (perplexity with the context's K/V read back from the pages, greedy continuations) and decode speed, every
format side by side in one run.

- Bytes: `KVShape.bytes_per_token` of SmolLM2-135M (30 layers x 3 KV heads x head_dim 64), scales included.
- Sequences resident: the ShareGPT-like length mix of kv_memory.py (1,000 requests), admitted in arrival order at
  their final length into a real `BlockAllocator` of the blocks `--budget` bytes buys in each format (block 16)
  until one does not fit; the mean over 100 starting points in the stream.
- Perplexity: the English text of Python's own documentation (`pydoc_data.topics`, shipped with CPython), tokenized
  by SmolLM2's tokenizer; `--segments` segments of 1,024 tokens, each fed in chunks of 256 tokens to a `PagedCache`
  in the format, so every chunk attends to the K/V its predecessors left in the pages (and to its own, written
  first and read back). fp32 weights.
- Continuations: `--prompts` prompts of 32 tokens from the same text (after the perplexity segments), 64 greedy
  tokens each in one batch; the share identical to unquantized pages, and the mean tokens before the first
  difference.
- Speed: SmolLM2 greedy `generate` at batch 8 (`--contexts`), the median decode step (decode_speed.py's clock),
  each format in turn, `--repeats` times (prefix caching reuses the prompt's blocks after the first round: decode
  steps are not affected); and one layer's attention alone (CPU kernel, batch 8 x 4,096, SmolLM2 shapes).

Usage: python benchmarks/kv_quant.py [--segments 20] [--prompts 50] [--contexts 1024 4096] [--budget 1GiB]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time

import torch
from common import environment, markdown_table
from decode_speed import step_seconds
from kv_memory import sharegpt_like_requests

import hf_paged
from hf_paged import BlockAllocator
from hf_paged.config import parse_memory
from hf_paged.kernels import paged_attention
from hf_paged.kv_format import QuantizedPages, kv_format
from hf_paged.pool import KVShape
from hf_paged.reference_models import load_smollm2

FORMATS = ("auto", "int8", "int4")
BLOCK_SIZE = 16
SEGMENT, CHUNK = 1024, 256


def english_text_ids(tokenizer) -> torch.Tensor:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    text = "\n\n".join(topics[name] for name in sorted(topics))
    return tokenizer(text, return_tensors="pt").input_ids[0]


def bytes_table(shape_of) -> tuple[str, dict]:
    bf16 = shape_of("auto", torch.bfloat16).bytes_per_token
    fp32 = shape_of("auto", torch.float32).bytes_per_token
    rows, per_token = [], {}
    for label, kv_dtype, dtype in (
        ("bf16 pages", "auto", torch.bfloat16),
        ("fp32 pages", "auto", torch.float32),
        ("int8 pages", "int8", torch.float32),
        ("int4 pages", "int4", torch.float32),
    ):
        cost = shape_of(kv_dtype, dtype).bytes_per_token
        per_token[label] = cost
        rows.append([label, f"{cost:,}", f"{cost / bf16:.3f}", f"{cost / fp32:.3f}"])
    return markdown_table(["pages", "bytes per token", "vs bf16", "vs fp32"], rows), per_token


def resident_table(per_token: dict, budget: int) -> str:
    requests = sharegpt_like_requests(1000)
    lengths = [prompt + output - 1 for prompt, output in requests]
    counts = {}
    for label, cost in per_token.items():
        num_blocks = budget // (cost * BLOCK_SIZE)
        samples = []
        for offset in range(0, len(lengths), 10):  # the mix from every 10th request on (wrapping): less noise
            allocator, admitted = BlockAllocator(num_blocks, BLOCK_SIZE), 0
            for length in lengths[offset:] + lengths[:offset]:
                if allocator.num_free < -(-length // BLOCK_SIZE):
                    break
                allocator.append(allocator.new_table(), length)
                admitted += 1
            samples.append(admitted)
        counts[label] = statistics.mean(samples)
    rows = [
        [
            label,
            f"{budget // (per_token[label] * BLOCK_SIZE):,}",
            f"{count:.1f}",
            f"{count / counts['bf16 pages']:.2f}x",
            f"{count / counts['fp32 pages']:.2f}x",
        ]
        for label, count in counts.items()
    ]
    return markdown_table(["pages", "blocks", "sequences resident (mean)", "vs bf16", "vs fp32"], rows)


def text_workload(tokenizer, num_segments: int, num_prompts: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`num_segments` perplexity segments of `SEGMENT + 1` token ids from the English text, then `num_prompts`
    prompts of 32 tokens from the text after them (`[num_prompts, 32]`)."""
    ids = english_text_ids(tokenizer)
    segments = [ids[i * SEGMENT : (i + 1) * SEGMENT + 1] for i in range(num_segments)]
    start = num_segments * SEGMENT + 1
    prompts = torch.stack([ids[start + i * 96 : start + i * 96 + 32] for i in range(num_prompts)])
    assert prompts.shape == (num_prompts, 32) and all(s.numel() == SEGMENT + 1 for s in segments)
    return segments, prompts


@torch.no_grad()
def chunked_nll(model, segments: list[torch.Tensor], new_cache) -> tuple[float, int]:
    """Mean next-token NLL over `segments`, each fed in chunks of `CHUNK` tokens to a cache of its own from
    `new_cache()` (released after, where it has `release`), and how many tokens it covers."""
    total, count = 0.0, 0
    for segment in segments:
        cache = new_cache()
        for start in range(0, SEGMENT, CHUNK):
            logits = model(segment[None, start : start + CHUNK], past_key_values=cache, use_cache=True).logits[0]
            targets = segment[start + 1 : start + CHUNK + 1]
            total += torch.nn.functional.cross_entropy(logits[: targets.numel()], targets, reduction="sum").item()
            count += targets.numel()
        if hasattr(cache, "release"):
            cache.release()
    return total / count, count


def mean_nll(model, segments: list[torch.Tensor], kv_dtype: str) -> tuple[float, int]:
    return chunked_nll(model, segments, lambda: hf_paged.PagedCache(model, kv_dtype=kv_dtype, block_size=BLOCK_SIZE))


def greedy_continuations(model, prompts: torch.Tensor, **cache_options) -> torch.Tensor:
    """64 greedy tokens after each of `prompts`, generated in one batch with `cache_options` passed to `generate`."""
    out = model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        do_sample=False,
        max_new_tokens=64,
        min_new_tokens=64,
        pad_token_id=0,
        **cache_options,
    )
    return out[:, prompts.shape[1] :]


def continuations(model, prompts: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    cache_config = {"kv_dtype": kv_dtype, "block_size": BLOCK_SIZE}
    return greedy_continuations(model, prompts, cache_implementation="paged", cache_config=cache_config)


def decode_step_seconds(model, batch: int, context: int, kv_dtype: str, pool_memory: str, steps: int = 16) -> float:
    """The median decode step of a greedy `generate` call (decode_speed.py's clock) with pages in `kv_dtype`."""
    generator = torch.Generator().manual_seed(context)
    prompt = torch.randint(100, 40000, (batch, context), generator=generator)
    config = {"kv_dtype": kv_dtype, "block_size": BLOCK_SIZE, "max_memory": pool_memory}
    options = {"cache_implementation": "paged", "cache_config": config}
    return statistics.median(step_seconds(model, prompt, steps + 1, options))


def kernel_seconds(kv_dtype: str, batch: int = 8, context: int = 4096, repeats: int = 20) -> float:
    generator = torch.Generator().manual_seed(0)
    num_blocks = batch * context // BLOCK_SIZE
    keys = torch.randn(num_blocks, BLOCK_SIZE, 3, 64, generator=generator)
    values = torch.randn(num_blocks, BLOCK_SIZE, 3, 64, generator=generator)
    if kv_dtype != "auto":
        fmt = kv_format(kv_dtype)
        keys = QuantizedPages(fmt, *fmt.quantize(keys), torch.float32)
        values = QuantizedPages(fmt, *fmt.quantize(values), torch.float32)
    tables = torch.randperm(num_blocks, generator=generator).to(torch.int32).view(batch, -1)
    args = (
        torch.randn(batch, 9, 64, generator=generator),
        keys,
        values,
        tables,
        torch.full((batch,), context, dtype=torch.int32),
        torch.arange(batch + 1, dtype=torch.int32),
    )
    paged_attention(*args, scale=0.125, kernel="cpu")
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        paged_attention(*args, scale=0.125, kernel="cpu")
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--segments", type=int, default=20, help="perplexity segments of 1,024 tokens")
    parser.add_argument("--prompts", type=int, default=50, help="prompts for greedy continuations")
    parser.add_argument("--contexts", type=int, nargs="*", default=[1024, 4096], help="decode-speed contexts")
    parser.add_argument("--repeats", type=int, default=3, help="decode-speed rounds (each format once a round)")
    parser.add_argument("--budget", default="1GiB", help="KV budget of the sequences-resident table")
    parser.add_argument("--pool-memory", default="2GiB", help="the pool of the decode-speed runs (fits 8 x 4096 fp32)")
    args = parser.parse_args()
    print(environment(), "\n")
    model, tokenizer = load_smollm2()

    def shape_of(kv_dtype, dtype):  # the model's shape, its K/V in `dtype` (bf16 for the comparison)
        return dataclasses.replace(KVShape.from_model(model, kv_dtype=kv_dtype), dtype=dtype)

    table, per_token = bytes_table(shape_of)
    print("## Bytes per cached token (SmolLM2-135M, scales included)\n\n" + table + "\n")
    budget = parse_memory(args.budget)
    print(f"## Sequences resident in {args.budget} of KV (ShareGPT-like mix, block {BLOCK_SIZE})\n")
    print(resident_table(per_token, budget) + "\n")

    segments, prompts = text_workload(tokenizer, args.segments, args.prompts)

    rows, nll = [], {}
    outputs = {}
    for kv_dtype in FORMATS:
        begin = time.perf_counter()
        nll[kv_dtype], count = mean_nll(model, segments, kv_dtype)
        outputs[kv_dtype] = continuations(model, prompts, kv_dtype)
        print(f"  {kv_dtype}: {time.perf_counter() - begin:.0f} s", flush=True)
    for kv_dtype in FORMATS:
        same = (outputs[kv_dtype] == outputs["auto"]).all(dim=1)
        differs = (outputs[kv_dtype] != outputs["auto"]).int()
        first = torch.where(differs.any(1), differs.argmax(1), torch.full_like(differs[:, 0], 64))
        rows.append(
            [
                kv_dtype,
                f"{math.exp(nll[kv_dtype]):.4f}",
                f"{math.exp(nll[kv_dtype] - nll['auto']) - 1:+.2%}",
                f"{same.float().mean().item():.0%} ({int(same.sum())} of {args.prompts})",
                f"{first.float().mean().item():.1f}",
            ]
        )
    print(f"\n## Quality on SmolLM2 (fp32 weights): perplexity over {count:,} tokens, greedy continuations\n")
    headers = ["pages", "perplexity", "vs fp32 pages", "64-token continuations identical", "mean tokens identical"]
    print(markdown_table(headers, rows) + "\n")

    speed_rows = []
    for context in args.contexts:
        seconds = {kv_dtype: [] for kv_dtype in FORMATS}
        for _ in range(args.repeats):
            for kv_dtype in FORMATS:
                seconds[kv_dtype].append(decode_step_seconds(model, 8, context, kv_dtype, args.pool_memory))
        median = {kv_dtype: statistics.median(values) for kv_dtype, values in seconds.items()}
        speed_rows.append(
            [f"SmolLM2 decode, batch 8 x {context}"]
            + [f"{median[kv_dtype] * 1e3:.1f} ms" for kv_dtype in FORMATS]
            + [f"{median['auto'] / median[kv_dtype]:.2f}x" for kv_dtype in FORMATS[1:]]
        )
    layer = {kv_dtype: kernel_seconds(kv_dtype) for kv_dtype in FORMATS}
    speed_rows.append(
        ["one layer's attention (CPU kernel), 8 x 4096"]
        + [f"{layer[kv_dtype] * 1e3:.2f} ms" for kv_dtype in FORMATS]
        + [f"{layer['auto'] / layer[kv_dtype]:.2f}x" for kv_dtype in FORMATS[1:]]
    )
    print("## Decode speed (median step; speed vs fp32 pages, higher is faster)\n")
    headers = ["workload", "fp32 pages", "int8 pages", "int4 pages", "int8 speed", "int4 speed"]
    print(markdown_table(headers, speed_rows))


if __name__ == "__main__":
    main()
