"""`kv_dtype="int4-channel"` measured through the pages themselves, beside unquantized pages and per-token `"int4"`
pages, in one run: perplexity at long contexts, greedy continuations, teacher-forced next-token flips, decode speed.

- Perplexity: the English text of Python's documentation (kv_quant.py's), tokenized by SmolLM2's tokenizer, in
  segments of `--contexts` tokens (as many as make at least `--tokens` tokens), each fed in chunks of 256 tokens to
  a `PagedCache` in the format: every chunk attends to the K/V the earlier chunks left in the pages (int4-channel:
  full blocks' keys per channel, the open block's exactly). fp32 weights; fp32 pages (`"auto"`) are the reference.
- Continuations: kv_quant.py's 50 prompts of 32 tokens, 64 greedy tokens each in one batch: the share identical to
  fp32 pages. bf16 pages are a `DynamicCache` storing K/V rounded to bfloat16 (an fp32 model's pages are fp32).
- Teacher-forced: each prompt followed by its fp32-pages continuation, fed in one forward through the format's pages;
  every position's greedy next token compared with the continuation's (3,200 positions).
- Speed: the median decode step of greedy `generate`, batch 8 (`--speed-contexts`), each format in turn,
  `--repeats` rounds; and one layer's attention alone in the CPU kernel (8 x 4,096, SmolLM2's shapes).

Usage: python benchmarks/kv_channel.py [--contexts 1024 4096] [--tokens 20480] [--prompts 50]
       [--speed-contexts 1024 4096] [--repeats 3]  (an empty --contexts or --prompts 0 skips that part)
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from common import environment, markdown_table
from decode_speed import step_seconds
from kv_quant import english_text_ids, greedy_continuations, text_workload
from kv_quant_schemes import RoundTripCache, agreement, bf16

import hf_paged
from hf_paged.reference_models import load_smollm2

CHUNK = 256
FORMATS = {"auto": 16, "int4": 16, "int4-channel": 64}  # kv_dtype: block size (int4-channel: its default)


def paged(model, kv_dtype: str) -> hf_paged.PagedCache:
    return hf_paged.PagedCache(model, kv_dtype=kv_dtype, block_size=FORMATS[kv_dtype])


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, context: int, tokens: int, kv_dtype: str) -> tuple[float, int]:
    """Mean NLL over segments of `context` tokens (at least `tokens` in all) fed in chunks, and the count."""
    segments = -(-tokens // context)
    total, count = 0.0, 0
    for index in range(segments):
        segment = ids[index * context : (index + 1) * context + 1]
        cache = paged(model, kv_dtype)
        for start in range(0, context, CHUNK):
            logits = model(segment[None, start : start + CHUNK], past_key_values=cache, use_cache=True).logits[0]
            targets = segment[start + 1 : start + CHUNK + 1]
            total += torch.nn.functional.cross_entropy(logits[: targets.numel()], targets, reduction="sum").item()
            count += targets.numel()
        cache.release()
    return total / count, count


@torch.no_grad()
def teacher_forced(model, prompts: torch.Tensor, reference: torch.Tensor, cache) -> torch.Tensor:
    ids = torch.cat([prompts, reference[:, :-1]], dim=1)
    logits = model(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, use_cache=True).logits
    if hasattr(cache, "release"):
        cache.release()
    return logits[:, prompts.shape[1] - 1 :].argmax(dim=-1) == reference


def decode_step(model, batch: int, context: int, kv_dtype: str, steps: int = 16) -> float:
    prompt = torch.randint(100, 40000, (batch, context), generator=torch.Generator().manual_seed(context))
    config = {"kv_dtype": kv_dtype, "block_size": FORMATS[kv_dtype], "max_memory": "2GiB"}
    options = {"cache_implementation": "paged", "cache_config": config}
    return statistics.median(step_seconds(model, prompt, steps + 1, options))


def kernel_seconds(kv_dtype: str, batch: int = 8, context: int = 4096, repeats: int = 20) -> float:
    """One layer's decode attention in the CPU kernel over pages written through the pool's own storage."""
    from hf_paged.pool import BlockPool, KVShape

    block = FORMATS[kv_dtype]
    shape = KVShape(1, 3, 64, torch.float32, kv_dtype=kv_dtype, block_size=block)
    pool = BlockPool(batch * (context // block + 4) * (1 + shape.companions), block, shape)
    rows = pool.new_rows(batch, 1, track_tokens=False)
    pool.take_blocks([(row.table, context) for row in rows])
    generator = torch.Generator().manual_seed(0)
    for row in rows:
        slots = torch.tensor([row.table.block_ids[p // block] * block + p % block for p in range(context)])
        pool.storage.write(0, slots, torch.randn(context, 3, 64, generator=generator), torch.randn(context, 3, 64))
    width = max(len(row.table.block_ids) for row in rows)
    tables = torch.tensor([row.table.block_ids + [row.table.block_ids[0]] * (width - len(row.table.block_ids))
                           for row in rows], dtype=torch.int32)  # fmt: skip
    keys, values = pool.storage.layer_tensors(0)
    args = (torch.randn(batch, 9, 64), keys, values, tables, torch.full((batch,), context, dtype=torch.int32),
            torch.arange(batch + 1, dtype=torch.int32))  # fmt: skip
    hf_paged.kernels.paged_attention(*args, scale=0.125, kernel="cpu")
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        hf_paged.kernels.paged_attention(*args, scale=0.125, kernel="cpu")
        times.append(time.perf_counter() - begin)
    pool.free_rows(rows)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="*", default=[1024, 4096])
    parser.add_argument("--tokens", type=int, default=20480, help="perplexity tokens per context, at least")
    parser.add_argument("--prompts", type=int, default=50, help="prompts for continuations (0: none)")
    parser.add_argument("--speed-contexts", type=int, nargs="*", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(environment(), "\n")
    model, tokenizer = load_smollm2()
    ids = english_text_ids(tokenizer)

    rows = []
    for context in args.contexts:
        nll = {}
        for kv_dtype in FORMATS:
            begin = time.perf_counter()
            nll[kv_dtype], count = perplexity(model, ids, context, args.tokens, kv_dtype)
            print(f"  perplexity, context {context}, {kv_dtype}: {time.perf_counter() - begin:.0f} s", flush=True)
        for kv_dtype in FORMATS:
            rows.append(
                [
                    str(context),
                    f"{count:,}",
                    kv_dtype,
                    f"{math.exp(nll[kv_dtype]):.4f}",
                    f"{math.exp(nll[kv_dtype] - nll['auto']) - 1:+.2%}",
                ]  # fmt: skip
            )
    if rows:
        print("\n## Perplexity through the pages (fp32 weights; chunks of 256)\n")
        print(markdown_table(["context", "tokens", "pages", "perplexity", "vs fp32 pages"], rows) + "\n")

    if args.prompts:
        continuation_rows(model, tokenizer, args.prompts)
    speed_rows(model, args.speed_contexts, args.repeats)


def continuation_rows(model, tokenizer, num_prompts: int) -> None:
    _, prompts = text_workload(tokenizer, 20, num_prompts)
    base = greedy_continuations(model, prompts, past_key_values=paged(model, "auto"))
    rows = []
    identity = lambda x: x  # noqa: E731
    caches = {"bf16 pages": lambda: RoundTripCache(model.config, bf16, bf16)}
    caches |= {f"{name} pages": (lambda name=name: paged(model, name)) for name in FORMATS if name != "auto"}
    caches["fp32 pages, one forward (floor)"] = lambda: RoundTripCache(model.config, identity, identity)
    for label, new_cache in caches.items():
        same = (greedy_continuations(model, prompts, past_key_values=new_cache()) == base).all(dim=1)
        flips = agreement(teacher_forced(model, prompts, base, new_cache()))
        rows.append([label, f"{same.float().mean().item():.0%} ({int(same.sum())} of {num_prompts})", flips])
    print("## Greedy continuations vs fp32 pages, and next-token agreement under teacher forcing\n")
    print(markdown_table(["pages", "64-token continuations identical", "next token agrees"], rows) + "\n")


def speed_rows(model, contexts: list[int], repeats: int) -> None:
    rows = []
    for context in contexts:
        seconds = {kv_dtype: [] for kv_dtype in FORMATS}
        for _ in range(repeats):
            for kv_dtype in FORMATS:
                seconds[kv_dtype].append(decode_step(model, 8, context, kv_dtype))
        median = {kv_dtype: statistics.median(values) for kv_dtype, values in seconds.items()}
        rows.append([f"SmolLM2 decode, batch 8 x {context}"] + [f"{median[k] * 1e3:.1f} ms" for k in FORMATS]
                    + [f"{median['auto'] / median[k]:.2f}x" for k in ("int4", "int4-channel")])  # fmt: skip
    layer = {kv_dtype: kernel_seconds(kv_dtype) for kv_dtype in FORMATS}
    rows.append(["one layer's attention (CPU kernel), 8 x 4096"] + [f"{layer[k] * 1e3:.2f} ms" for k in FORMATS]
                + [f"{layer['auto'] / layer[k]:.2f}x" for k in ("int4", "int4-channel")])  # fmt: skip
    print("## Decode speed (median step; speed vs fp32 pages, higher is faster)\n")
    headers = ["workload", "fp32 pages", "int4 pages", "int4-channel pages", "int4 speed", "int4-channel speed"]
    print(markdown_table(headers, rows))


if __name__ == "__main__":
    main()
