"""Stock `nn.Linear` vs weights packed for oneDNN (`hf_paged.cpu_linear`, `Engine(cpu_linear="onednn")`) on
SmolLM2-135M (fp32), side by side in one run.

- Forward: one forward of the model without a cache over `--tokens` tokens (a decode step of that many rows, or a
  packed Engine step), logits for every position; stock and packed take turns, `--repeats` times each; medians.
  The largest logit difference between the two is shown (float rounding: a different summation order).
- Decode: the median decode step of greedy `generate` (decode_speed.py's clock) with the paged cache and with
  `DynamicCache`, stock and packed, at each `--decode` shape (batch x context), 16 new tokens.

Usage: python benchmarks/cpu_linear.py [--tokens 1 8 64 256] [--decode 1x128 8x1024] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import environment, markdown_table
from decode_speed import step_seconds

from hf_paged.cpu_linear import pack_linears, unpack_linears
from hf_paged.reference_models import load_smollm2

SETTINGS = ("stock", "onednn")


def use(model, setting: str) -> None:
    """Give `model` the stock or the packed layers; packed layers keep their packed weights between turns (unpacking
    would drop them, and the next turn would time packing them again)."""
    if not hasattr(model, "_packed_forwards"):
        pack_linears(model)
        model._packed_forwards = {m: m.__dict__["forward"] for m in model.modules() if "forward" in m.__dict__}
    for module, forward in model._packed_forwards.items():
        if setting == "onednn":
            module.forward = forward
        else:
            module.__dict__.pop("forward", None)


@torch.no_grad()
def forward_rows(model, token_counts: list[int], repeats: int) -> list[list[str]]:
    rows = []
    for count in token_counts:
        ids = torch.randint(3, model.config.vocab_size, (1, count), generator=torch.Generator().manual_seed(count))
        seconds, logits = {s: [] for s in SETTINGS}, {}
        for _ in range(repeats + 1):  # the first round warms up
            for setting in SETTINGS:
                use(model, setting)
                begin = time.perf_counter()
                logits[setting] = model(ids, use_cache=False).logits
                seconds[setting].append(time.perf_counter() - begin)
        median = {s: statistics.median(v[1:]) for s, v in seconds.items()}
        difference = (logits["onednn"] - logits["stock"]).abs().max().item()
        rows.append(
            [
                count,
                f"{median['stock'] * 1e3:.1f}",
                f"{median['onednn'] * 1e3:.1f}",
                f"{median['stock'] / median['onednn']:.2f}x",
                f"{difference:.1e}",
            ]
        )
    return rows


def decode_rows(model, shapes: list[tuple[int, int]]) -> list[list[str]]:
    rows = []
    caches = {"paged": {"cache_implementation": "paged", "cache_config": {"max_memory": "2GiB"}}, "DynamicCache": {}}
    for batch, context in shapes:
        ids = torch.randint(3, model.config.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0))
        step = {}
        for setting in SETTINGS:
            use(model, setting)
            for cache, options in caches.items():
                step_seconds(model, ids[:, :16], 4, options)  # warm-up
                step[setting, cache] = statistics.median(step_seconds(model, ids, 16, options))
        rows.append(
            [f"{batch} x {context}"]
            + [f"{step[s, c] * 1e3:.1f}" for c in caches for s in SETTINGS]
            + [f"{step['stock', c] / step['onednn', c]:.2f}x" for c in caches]
            + [f"{step[s, 'DynamicCache'] / step[s, 'paged']:.2f}x" for s in SETTINGS]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256], help="tokens per forward")
    parser.add_argument("--decode", nargs="*", default=["1x128", "8x1024"], help="decode shapes, batch x context")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.decode]
    print(environment(), "\n")
    model = load_smollm2()[0]
    try:
        rows = forward_rows(model, args.tokens, args.repeats)
        print("## One forward, no cache (SmolLM2-135M fp32; median ms)\n")
        headers = ["tokens", "stock ms", "onednn ms", "speed-up", "max logit difference"]
        print(markdown_table(headers, rows) + "\n")
        if shapes:
            print("## Decode step of greedy generate (median ms of 16 steps)\n")
            headers = [
                "batch x context",
                "paged, stock",
                "paged, onednn",
                "DynamicCache, stock",
                "DynamicCache, onednn",
                "paged speed-up",
                "DynamicCache speed-up",
                "paged / Dynamic (stock)",
                "paged / Dynamic (onednn)",
            ]
            print(markdown_table(headers, decode_rows(model, shapes)))
    finally:
        unpack_linears(model)


if __name__ == "__main__":
    main()
