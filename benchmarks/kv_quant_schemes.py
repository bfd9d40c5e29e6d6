"""Quantization schemes for K/V pages measured before they are built: quality on SmolLM2 of each candidate next to
the formats shipped (`kv_dtype="int8"`, `"int4"`), all in one run, with the bytes each would cost per cached token.

Method: a `DynamicCache` that stores every K/V tensor as the candidate's pages would give it back (quantized and
dequantized, in fp32), so only the storage scheme differs from unquantized pages; the metrics are kv_quant.py's,
over the same text (Python's own documentation, `pydoc_data.topics`): perplexity over `--segments` segments of
`--context` tokens (1,024 by default; as many segments as make 20,480 tokens or more unless given: 20 of 1,024, 5 of
4,096) fed in chunks of 256 (each chunk reads its predecessors' K/V back from the "pages": at longer contexts, more
of the context attended is quantized), and the share of `--prompts` greedy 64-token continuations identical to
unquantized pages (`--ppl-only` skips those and the teacher-forced check). fp32 weights. A continuation parts at its
first differing token and then diverges by itself, so that share counts prompts with at least one near-tie flipped;
"next token agrees" counts the flips one step at a time instead: each prompt followed by its unquantized
continuation is fed in one forward (teacher forcing) and every one of the 64 positions' greedy next token is compared
with the unquantized continuation's. The "fp32 pages" row is the floor of that check: the same exact K/V, only
computed in one forward instead of token by token (another summation order in the matmuls). For schemes with groups,
that one forward quantizes a group as soon as the 96 tokens fill it, where decoding reads its tokens exactly until
then: their column is a little pessimistic.

Schemes (`H`: the Hadamard rotation of kv_format.py; "as shipped": one bfloat16 scale per token and head, vectors
rotated by `H`, symmetric codes):

- Keys "per channel, asymmetric, group G": within each group of G consecutive tokens of a head (a block of G
  tokens), every channel gets its own minimum and step (`(max - min) / (2**bits - 1)`), both bfloat16, and codes
  0..2**bits-1 (KIVI's grouping of keys). The scales need the whole group, so the tokens of a group not yet full
  stay unquantized (the open block kept in full precision until it fills). "rotated": the vectors are rotated by `H`
  first. "clip search": per channel and group, the range `[min + a (max - min), max - b (max - min)]` with the
  least squared error over the group's tokens, for `a`, `b` in `CLIP` (0 to 15%; same bytes). "open group int8":
  the open group's keys held as int8 as shipped (not exact), and a group quantized from those int8 values as it
  fills.
- Keys "centred on the previous block": nothing kept in full precision; each block is centred on the mean of
  the previous block as read back (derivable by every reader: no bytes), then quantized per token as shipped.
- "first N tokens unquantized": as shipped, except a sequence's first N tokens (keys and values) kept exact.
- Values: as shipped (per token). "values clip search": as shipped with the scale `absmax * s / 7`, per token the
  `s` in 1.0, 0.95, 0.9, 0.85, 0.8 with the least squared error (same bytes).

Bytes per cached token and head (head_dim 64) count codes, scales and zero points at bfloat16, vs bfloat16 pages
(256 bytes for K and V); the full-precision (or int8) open block is not counted (at most G - 1 tokens a sequence).

First table: sequences resident in `--budget` of KV for each scheme (kv_quant.py's method and ShareGPT-like mix),
in blocks of its group, with its open group's keys in fp32 (int8 where named) counted per running sequence (what
building it needs) and not counted.

Usage: python benchmarks/kv_quant_schemes.py [--context 1024] [--segments 20] [--prompts 50] [--ppl-only]
       [--schemes NAME ...] [--budget 1GiB] [--threads N]
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import time

import torch
from common import environment, markdown_table
from kv_memory import admitted, sharegpt_like_requests
from kv_quant import BLOCK_SIZE, CHUNK, SEGMENT, english_text_ids, greedy_continuations
from transformers import DynamicCache

from hf_paged.config import parse_memory
from hf_paged.kv_format import FORMATS, rotate
from hf_paged.reference_models import load_smollm2

HEAD_DIM = 64  # SmolLM2's


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def shipped(name: str):
    """Round trip of a shipped format (`[batch, heads, tokens, head_dim]` in, same out)."""
    return FORMATS[name].round_trip


def keys_per_channel(bits: int, group: int, rotated: bool, clip: tuple[float, ...] = (0.0,)):
    """Round trip of keys quantized per channel over each full group of `group` tokens, asymmetric (bfloat16 minimum
    and step per channel); the last, partial group stays unquantized. `clip`: the shares of a channel's range tried
    off each end (the range `[min + a * (max - min), max - b * (max - min)]` for every `a`, `b` in `clip`, values
    outside clamped to it), keeping per channel and group the one with the least squared error over its tokens (the
    first tried wins ties: `clip` starting with 0 never does worse than the whole range)."""
    levels = 2**bits - 1

    def round_trip(x: torch.Tensor) -> torch.Tensor:
        values = rotate(x) if rotated else x.float()
        batch, heads, tokens, dim = values.shape
        full = tokens // group * group
        out = values.clone()
        if full:
            groups = values[:, :, :full].reshape(batch, heads, full // group, group, dim)
            minimum, maximum = groups.amin(dim=3, keepdim=True), groups.amax(dim=3, keepdim=True)
            best, least = groups, torch.full_like(minimum, math.inf)
            for a in clip:
                for b in clip:
                    low = (minimum + a * (maximum - minimum)).to(torch.bfloat16).float()
                    high = maximum - b * (maximum - minimum)
                    step = ((high - low) / levels).to(torch.bfloat16).float()
                    divisor = torch.where(step > 0, step, torch.ones_like(step))
                    tried = torch.round((groups - low) / divisor).clamp(0, levels) * step + low
                    error = (tried - groups).square().sum(dim=3, keepdim=True)
                    best, least = torch.where(error < least, tried, best), torch.minimum(error, least)
            out[:, :, :full] = best.reshape(batch, heads, full, dim)
        return (rotate(out) if rotated else out).to(x.dtype)

    return round_trip


def values_clip_search(bits: int, shrink: tuple[float, ...] = (1.0, 0.95, 0.9, 0.85, 0.8)):
    """Round trip of the shipped per-token format (rotated, symmetric, one bfloat16 scale a token) with the scale
    `absmax * s / max_code` for the `s` in `shrink` that gives each token the least squared error (codes clamped;
    the first tried wins ties: `shrink` starting with 1.0 never does worse than as shipped). Same bytes as shipped."""
    levels = 2 ** (bits - 1) - 1

    def round_trip(x: torch.Tensor) -> torch.Tensor:
        values = rotate(x)
        absmax = values.abs().amax(dim=-1, keepdim=True)
        best, least = values, torch.full_like(absmax, math.inf)
        for s in shrink:
            scale = (absmax * s / levels).to(torch.bfloat16).float()
            divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
            tried = torch.round(values / divisor).clamp(-levels, levels) * scale
            error = (tried - values).square().sum(dim=-1, keepdim=True)
            best, least = torch.where(error < least, tried, best), torch.minimum(error, least)
        return rotate(best).to(x.dtype)

    return round_trip


def open_group_int8(round_trip):
    """Round trip of a per-channel scheme whose open group is kept in int8 as shipped instead of exact: the keys go
    through `shipped("int8")` first, and a group is quantized per channel from those int8 values when it fills."""
    int8 = shipped("int8")

    def stored_int8(x: torch.Tensor) -> torch.Tensor:
        return round_trip(int8(x))

    return stored_int8


def keys_centered(bits: int, block: int, scales_per_token: int):
    """Round trip of keys with nothing kept in full precision: each block of `block` tokens is centred on the mean of
    the previous block as the pages give it back (a value every reader can derive, so it costs no bytes; the first
    block is not centred), then quantized per token as shipped (rotated, symmetric), with `scales_per_token` scales
    a token over equal slices of the rotated vector."""
    levels = 2 ** (bits - 1) - 1

    def per_token(y: torch.Tensor) -> torch.Tensor:
        shape = y.shape
        y = y.reshape(*shape[:-1], scales_per_token, shape[-1] // scales_per_token)
        scale = (y.abs().amax(dim=-1, keepdim=True) / levels).to(torch.bfloat16).float()
        divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
        return (torch.round(y / divisor).clamp(-levels, levels) * scale).reshape(shape)

    def round_trip(x: torch.Tensor) -> torch.Tensor:
        values = x.float()
        out = torch.empty_like(values)
        previous = None
        for begin in range(0, values.shape[2], block):
            part = values[:, :, begin : begin + block]
            mean = torch.zeros_like(part[:, :, :1]) if previous is None else previous.mean(dim=2, keepdim=True)
            out[:, :, begin : begin + block] = rotate(per_token(rotate(part - mean))) + mean
            previous = out[:, :, begin : begin + block] if part.shape[2] == block else None
        return out.to(x.dtype)

    return round_trip


def first_tokens_exact(round_trip, tokens: int):
    """Round trip of `round_trip` with a sequence's first `tokens` tokens left unquantized (the attention sink and
    the start of the prompt, which most queries weigh heavily)."""

    def partly(x: torch.Tensor) -> torch.Tensor:
        out = round_trip(x)
        out[:, :, :tokens] = x[:, :, :tokens]
        return out

    return partly


def open_group(name: str) -> int:
    """Tokens a scheme's quantization group (its block) holds; per-channel schemes keep their open group unquantized,
    so a running sequence also holds up to that many tokens' keys in full precision."""
    match = re.search(r"\(group (\d+)\)", name)
    return int(match.group(1)) if match else BLOCK_SIZE


def resident(
    bytes_per_token_head: float, block: int, open_bytes_per_head: float, budget: int, layers: int, kv_heads: int
) -> float:
    """Mean sequences resident in `budget` bytes of KV, kv_quant.py's method (the ShareGPT-like mix of kv_memory.py,
    admitted in arrival order at their final length, from every 10th request on): each sequence costs its blocks of
    `block` tokens plus `open_bytes_per_head` per layer and KV head (a full-precision open group)."""
    lengths = [prompt + output - 1 for prompt, output in sharegpt_like_requests(1000)]

    def cost(length: int) -> float:
        return (-(-length // block) * block * bytes_per_token_head + open_bytes_per_head) * layers * kv_heads

    samples = [admitted(lengths[offset:] + lengths[:offset], budget, cost) for offset in range(0, len(lengths), 10)]
    return statistics.mean(samples)


def resident_rows(names: list[str], budget: int, layers: int, kv_heads: int) -> list[list[str]]:
    """Sequences resident per scheme: blocks of its group, without and with its open group's keys in fp32 or int8
    (what building it would need), next to bf16 and fp32 pages of 16 tokens."""
    bf16 = resident(4 * HEAD_DIM, BLOCK_SIZE, 0, budget, layers, kv_heads)
    fp32 = resident(8 * HEAD_DIM, BLOCK_SIZE, 0, budget, layers, kv_heads)
    rows = [["fp32 pages", str(BLOCK_SIZE), "-", f"{fp32:.1f}", f"{fp32 / bf16:.2f}x", "1.00x"]]
    for name in names:
        _, _, key_bytes, value_bytes = SCHEMES[name]
        group = open_group(name)
        per_channel = "per channel" in name
        open_token = bytes_shipped(8) if "open group int8" in name else 4 * HEAD_DIM
        for open_bytes in [0, group * open_token] if per_channel else [0]:
            count = resident(key_bytes + value_bytes, group, open_bytes, budget, layers, kv_heads)
            counted = f"{open_bytes:,g} B" if open_bytes else "not counted" if per_channel else "-"
            rows.append([name, str(group), counted, f"{count:.1f}", f"{count / bf16:.2f}x", f"{count / fp32:.2f}x"])
    return rows


def bytes_shipped(bits: int) -> float:
    return HEAD_DIM * bits / 8 + 2


def bytes_per_channel(bits: int, group: int) -> float:
    return HEAD_DIM * bits / 8 + 2 * 2 * HEAD_DIM / group


CLIP = (0.0, 0.05, 0.1, 0.15)  # shares of a channel's range tried off each end by the clip-search schemes

SCHEMES = {  # name: (keys, values, bytes of K, bytes of V per token and head)
    "bf16 pages": (bf16, bf16, 2 * HEAD_DIM, 2 * HEAD_DIM),
    "int8 as shipped": (shipped("int8"), shipped("int8"), bytes_shipped(8), bytes_shipped(8)),
    "int8, keys per channel (group 16)": (keys_per_channel(8, 16, False), shipped("int8"), bytes_per_channel(8, 16),
                                          bytes_shipped(8)),
    "int8, keys per channel (group 64)": (keys_per_channel(8, 64, False), shipped("int8"), bytes_per_channel(8, 64),
                                          bytes_shipped(8)),
    "int4 as shipped": (shipped("int4"), shipped("int4"), bytes_shipped(4), bytes_shipped(4)),
    "int4, keys per channel (group 16)": (keys_per_channel(4, 16, False), shipped("int4"), bytes_per_channel(4, 16),
                                          bytes_shipped(4)),
    "int4, keys per channel rotated (group 16)": (keys_per_channel(4, 16, True), shipped("int4"),
                                                  bytes_per_channel(4, 16), bytes_shipped(4)),
    "int4, keys per channel rotated (group 32)": (keys_per_channel(4, 32, True), shipped("int4"),
                                                  bytes_per_channel(4, 32), bytes_shipped(4)),
    "int4, keys per channel rotated (group 64)": (keys_per_channel(4, 64, True), shipped("int4"),
                                                  bytes_per_channel(4, 64), bytes_shipped(4)),
    "int4, keys per channel rotated, clip search (group 32)": (keys_per_channel(4, 32, True, CLIP), shipped("int4"),
                                                               bytes_per_channel(4, 32), bytes_shipped(4)),
    "int4, keys per channel rotated, clip search (group 64)": (keys_per_channel(4, 64, True, CLIP), shipped("int4"),
                                                               bytes_per_channel(4, 64), bytes_shipped(4)),
    "int4, keys per channel rotated, clip search (group 64), values clip search": (
        keys_per_channel(4, 64, True, CLIP), values_clip_search(4), bytes_per_channel(4, 64), bytes_shipped(4)),
    "int4, keys per channel rotated (group 64), open group int8": (open_group_int8(keys_per_channel(4, 64, True)),
                                                                   shipped("int4"), bytes_per_channel(4, 64),
                                                                   bytes_shipped(4)),
    "int4, keys unquantized": (lambda x: x, shipped("int4"), 4 * HEAD_DIM, bytes_shipped(4)),
    "int4, keys centred on the previous block (16)": (keys_centered(4, 16, 1), shipped("int4"), bytes_shipped(4),
                                                      bytes_shipped(4)),
    "int4, keys centred (16), 2 scales a token": (keys_centered(4, 16, 2), shipped("int4"), bytes_shipped(4) + 2,
                                                  bytes_shipped(4)),
    "int8, first 4 tokens unquantized": (first_tokens_exact(shipped("int8"), 4), first_tokens_exact(shipped("int8"), 4),
                                         bytes_shipped(8), bytes_shipped(8)),
    "int8, first block (16) unquantized": (first_tokens_exact(shipped("int8"), 16),
                                           first_tokens_exact(shipped("int8"), 16), bytes_shipped(8), bytes_shipped(8)),
}  # fmt: skip


class RoundTripCache(DynamicCache):
    """A `DynamicCache` whose layers hand back every K/V (the new tokens' and the context's) as `keys` / `values`
    round-trip them; the exact K/V are kept, so a scheme with groups re-derives each group's scales as it fills."""

    def __init__(self, config, keys, values):
        super().__init__(config=config)
        self.round_trip_keys, self.round_trip_values = keys, values
        self.exact: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        new = key_states.shape[2]
        if layer_idx in self.exact:
            old_keys, old_values = self.exact[layer_idx]
            key_states = torch.cat([old_keys, key_states], dim=2)
            value_states = torch.cat([old_values, value_states], dim=2)
        self.exact[layer_idx] = (key_states, value_states)
        keys, values = self.round_trip_keys(key_states), self.round_trip_values(value_states)
        super().update(keys[:, :, -new:], values[:, :, -new:], layer_idx, *args, **kwargs)  # its length bookkeeping
        self.layers[layer_idx].keys, self.layers[layer_idx].values = keys, values
        return keys, values


def context_workload(
    tokenizer, context: int, num_segments: int, num_prompts: int
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """kv_quant.py's `text_workload` with perplexity segments of `context + 1` token ids (the same at `SEGMENT`):
    `num_segments` of them from the English text, then `num_prompts` prompts of 32 tokens from the text after them."""
    ids = english_text_ids(tokenizer)
    segments = [ids[i * context : (i + 1) * context + 1] for i in range(num_segments)]
    start = num_segments * context + 1
    prompts = torch.stack([ids[start + i * 96 : start + i * 96 + 32] for i in range(num_prompts)])
    assert prompts.shape == (num_prompts, 32) and all(s.numel() == context + 1 for s in segments), "text too short"
    return segments, prompts


@torch.no_grad()
def chunked_nll(model, segments: list[torch.Tensor], new_cache) -> tuple[float, int]:
    """kv_quant.py's `chunked_nll` over segments of any length: the mean next-token NLL over `segments`, each fed
    in chunks of `CHUNK` tokens to a cache of its own from `new_cache()`, and how many tokens it covers."""
    total, count = 0.0, 0
    for segment in segments:
        cache = new_cache()
        for start in range(0, segment.numel() - 1, CHUNK):
            logits = model(segment[None, start : start + CHUNK], past_key_values=cache, use_cache=True).logits[0]
            targets = segment[start + 1 : start + CHUNK + 1]
            total += torch.nn.functional.cross_entropy(logits[: targets.numel()], targets, reduction="sum").item()
            count += targets.numel()
    return total / count, count


def mean_nll(model, segments: list[torch.Tensor], keys, values) -> float:
    return chunked_nll(model, segments, lambda: RoundTripCache(model.config, keys, values))[0]


def continuations(model, prompts: torch.Tensor, keys, values) -> torch.Tensor:
    return greedy_continuations(model, prompts, past_key_values=RoundTripCache(model.config, keys, values))


@torch.no_grad()
def next_token_agreement(model, prompts: torch.Tensor, reference: torch.Tensor, keys, values) -> torch.Tensor:
    """`[prompts, new tokens]`: whether the greedy next token at each position of `reference` (the unquantized
    continuations of `prompts`) is `reference`'s own, with the prompt and the reference before it fed in one forward
    through the scheme's round trip (teacher forcing: every position sees the same tokens whatever it predicts)."""
    ids = torch.cat([prompts, reference[:, :-1]], dim=1)
    cache = RoundTripCache(model.config, keys, values)
    logits = model(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, use_cache=True).logits
    return logits[:, prompts.shape[1] - 1 :].argmax(dim=-1) == reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=SEGMENT, help="tokens of a perplexity segment")
    parser.add_argument("--segments", type=int, help="perplexity segments (default: 20,480 tokens' worth, at least)")
    parser.add_argument("--prompts", type=int, default=50, help="prompts for greedy continuations")
    parser.add_argument("--ppl-only", action="store_true", help="perplexity only: no continuations, no teacher forcing")
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES), metavar="NAME")
    parser.add_argument("--budget", default="1GiB", help="KV budget of the sequences-resident table")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    num_segments = args.segments or -(-20 * SEGMENT // args.context)
    print(environment(), "\n")
    model, tokenizer = load_smollm2()
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    print(f"## Sequences resident in {args.budget} of KV (ShareGPT-like mix; {layers} layers x {kv_heads} KV heads)\n")
    headers = [
        "scheme",
        "block",
        "open group's keys in fp32 (int8 where named), per layer and head",
        "sequences resident (mean)",
        "vs bf16",
        "vs fp32",
    ]
    print(markdown_table(headers, resident_rows(args.schemes, parse_memory(args.budget), layers, kv_heads)) + "\n")
    segments, prompts = context_workload(tokenizer, args.context, num_segments, args.prompts)

    exact = (lambda x: x, lambda x: x)
    begin = time.perf_counter()
    base_nll, tokens = chunked_nll(model, segments, lambda: RoundTripCache(model.config, *exact))
    if not args.ppl_only:
        base = continuations(model, prompts, *exact)
        floor = next_token_agreement(model, prompts, base, *exact)
    print(f"  fp32 pages: {time.perf_counter() - begin:.0f} s", flush=True)
    rows = [["fp32 pages", f"{4 * HEAD_DIM} + {4 * HEAD_DIM}", "2.000", "+0.00%"]]
    rows[0] += [] if args.ppl_only else ["100%", agreement(floor)]
    for name in args.schemes:
        begin = time.perf_counter()
        keys, values, key_bytes, value_bytes = SCHEMES[name]
        nll = mean_nll(model, segments, keys, values)
        rows.append(
            [
                name,
                f"{key_bytes:g} + {value_bytes:g}",
                f"{(key_bytes + value_bytes) / (4 * HEAD_DIM):.3f}",
                f"{math.exp(nll - base_nll) - 1:+.2%}",
            ]
        )
        if not args.ppl_only:
            same = (continuations(model, prompts, keys, values) == base).all(dim=1)
            rows[-1] += [
                f"{same.float().mean().item():.0%} ({int(same.sum())} of {args.prompts})",
                agreement(next_token_agreement(model, prompts, base, keys, values)),
            ]
        print(f"  {name}: {time.perf_counter() - begin:.0f} s", flush=True)
    print(
        f"\nperplexity of unquantized pages {math.exp(base_nll):.4f} over {tokens:,} tokens "
        f"({num_segments} segments of {args.context:,}, fed in chunks of {CHUNK})\n"
    )
    headers = ["scheme", "bytes K + V per token and head", "vs bf16", "perplexity vs fp32 pages"]
    headers += [] if args.ppl_only else ["identical", "next token agrees (teacher-forced)"]
    print(markdown_table(headers, rows))


def agreement(agrees: torch.Tensor) -> str:
    """Share of positions agreeing, and of prompts with every position agreeing."""
    whole = agrees.all(dim=1)
    return (
        f"{agrees.float().mean().item():.2%} of {agrees.numel():,} ({agrees.numel() - int(agrees.sum())} differ; "
        f"{int(whole.sum())} of {agrees.shape[0]} prompts all agree)"
    )


if __name__ == "__main__":
    main()
