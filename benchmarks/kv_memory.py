"""KV waste and sequences admitted in a fixed KV budget: paged blocks vs max-length reservation vs left-padded
batches, on a synthetic ShareGPT-like length mix.

Length mix: prompt and output lengths are log-normal (sigma 1.0) with the ShareGPT means reported in the vLLM paper
(161 prompt tokens, 338 output tokens), clipped to [1, 1024] each, 1,000 requests, seed 0. A request's KV holds
prompt + output - 1 tokens when it finishes (the last sampled token is never fed back).

Paged numbers come from the real `hf_paged.BlockAllocator` (the allocator `PagedCache` uses), so they are exact
block counts, not formulas. Usage: python benchmarks/kv_memory.py [--requests 1000] [--budget-tokens 65536]
"""

from __future__ import annotations

import argparse
import math
import random

from common import markdown_table

from hf_paged import BlockAllocator

MAX_LENGTH = 2048  # what a StaticCache-style reservation sizes every sequence for
PROMPT_MEAN, OUTPUT_MEAN, SIGMA = 161.31, 337.99, 1.0


def sharegpt_like_requests(num_requests: int, seed: int = 0) -> list[tuple[int, int]]:
    """`(prompt length, output length)` pairs, log-normal with the ShareGPT means, clipped to [1, 1024]."""
    rng = random.Random(seed)

    def draw(mean: float) -> int:
        mu = math.log(mean) - SIGMA**2 / 2
        return max(1, min(1024, round(rng.lognormvariate(mu, SIGMA))))

    return [(draw(PROMPT_MEAN), draw(OUTPUT_MEAN)) for _ in range(num_requests)]


def paged_slots(lengths: list[int], block_size: int) -> tuple[int, int]:
    """(slots allocated, tokens stored) after every sequence reached its length, from a real allocator."""
    allocator = BlockAllocator(sum(-(-n // block_size) for n in lengths), block_size)
    for length in lengths:
        allocator.append(allocator.new_table(), length)
    stats = allocator.stats()
    return stats.slots_allocated, stats.tokens_stored


def left_padded_slots(lengths: list[int], prompts: list[int], batch: int) -> int:
    """Rows of a left-padded batch all hold max prompt + max output of the batch (finished rows keep decoding pads)."""
    slots = 0
    for start in range(0, len(lengths), batch):
        group = range(start, min(start + batch, len(lengths)))
        longest_prompt = max(prompts[i] for i in group)
        longest_output = max(lengths[i] - prompts[i] for i in group)
        slots += len(group) * (longest_prompt + longest_output)
    return slots


def admitted(lengths: list[int], budget: int, cost) -> int:
    """How many requests, in arrival order, are resident at once at their final length within `budget` slots."""
    used = 0
    for count, length in enumerate(lengths):
        used += cost(length)
        if used > budget:
            return count
    return len(lengths)


def admitted_left_padded(lengths: list[int], prompts: list[int], budget: int) -> int:
    best = 0
    for size in range(1, len(lengths) + 1):
        width = max(prompts[:size]) + max(n - p for n, p in zip(lengths[:size], prompts[:size]))
        if size * width > budget:
            break
        best = size
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--budget-tokens", type=int, default=65536, help="KV budget in token slots")
    parser.add_argument("--padded-batch", type=int, default=8)
    args = parser.parse_args()

    requests = sharegpt_like_requests(args.requests)
    prompts = [prompt for prompt, _ in requests]
    lengths = [prompt + output - 1 for prompt, output in requests]
    tokens = sum(lengths)
    print(
        f"{args.requests} requests, mean length {tokens / len(lengths):.1f} tokens "
        f"(prompt mean {sum(prompts) / len(prompts):.1f}), max {max(lengths)}\n"
    )

    rows = []
    for block_size in (16, 32, 256):
        slots, stored = paged_slots(lengths, block_size)
        per_seq = (slots - stored) / len(lengths)
        floor = (block_size - 1) / 2
        rows.append(
            [
                f"paged B={block_size}",
                slots,
                f"{(slots - stored) / slots:.2%}",
                f"{per_seq:.1f}",
                f"{floor:.1f}",
                f"{per_seq / floor:.3f}",
            ]
        )
    static = MAX_LENGTH * len(lengths)
    rows.append(
        [
            f"max-length reservation ({MAX_LENGTH})",
            static,
            f"{(static - tokens) / static:.2%}",
            f"{(static - tokens) / len(lengths):.1f}",
            "",
            "",
        ]
    )
    padded = left_padded_slots(lengths, prompts, args.padded_batch)
    rows.append(
        [
            f"left-padded DynamicCache, batch {args.padded_batch}",
            padded,
            f"{(padded - tokens) / padded:.2%}",
            f"{(padded - tokens) / len(lengths):.1f}",
            "",
            "",
        ]
    )
    print(
        markdown_table(
            ["scheme", "slots allocated", "KV waste", "wasted tokens / seq", "floor (B-1)/2", "waste / floor"], rows
        )
    )

    budget = args.budget_tokens
    static_n = admitted(lengths, budget, lambda n: MAX_LENGTH)
    rows = []
    for block_size in (16, 32, 256):
        n = admitted(lengths, budget, lambda length, b=block_size: -(-length // b) * b)
        rows.append([f"paged B={block_size}", n, f"{n / static_n:.2f}x"])
    rows.append([f"max-length reservation ({MAX_LENGTH})", static_n, "1.00x"])
    padded_n = admitted_left_padded(lengths, prompts, budget)
    rows.append(["left-padded DynamicCache (one batch)", padded_n, f"{padded_n / static_n:.2f}x"])
    print(f"\nSequences resident at once in a budget of {budget} token slots:\n")
    print(markdown_table(["scheme", "sequences", "vs reservation"], rows))


if __name__ == "__main__":
    main()
