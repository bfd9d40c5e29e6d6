"""16 requests sharing a 512-token prefix: prefill tokens computed, time to first token and KV blocks held, with and
without the prefix cache, side by side.

Requests are served one after another with stock `generate` (max_new_tokens=1, so the call time is the time to
first token). Each request's cache is kept (`return_dict_in_generate=True`) until all 16 are done, so "KV blocks
held" is what 16 concurrent conversations would hold. With the prefix cache the first request computes the prefix
and the other 15 find it; "without" is `cache_config={"prefix_caching": False}`; DynamicCache is stock. TTFT is the
median over requests 2-16 (the first one computes the prefix either way).

Usage: python benchmarks/prefix_sharing.py [--models tiny smollm2] [--requests 16] [--prefix 512]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import environment, load_model, markdown_table

import hf_paged

HEADERS = [
    "model",
    "cache",
    "prefill tokens",
    "vs Dynamic",
    "TTFT ms (median)",
    "TTFT speed-up",
    "KV blocks held (16 kept)",
    "same first tokens",
]
VARIANTS = {
    "DynamicCache": {},
    "paged, no prefix cache": {"cache_implementation": "paged", "cache_config": {"prefix_caching": False}},
    "paged + prefix cache": {"cache_implementation": "paged"},
}


def serve(model, prompts: list[torch.Tensor], options: dict):
    computed, ttft, outputs = [], [], []
    counts = []
    hook = model.register_forward_pre_hook(lambda m, a, k: counts.append(k["input_ids"].shape[-1]), with_kwargs=True)
    try:
        for prompt in prompts:
            counts.clear()
            start = time.perf_counter()
            out = model.generate(
                input_ids=prompt,
                max_new_tokens=1,
                do_sample=False,
                pad_token_id=0,
                return_dict_in_generate=True,
                **options,
            )
            ttft.append(time.perf_counter() - start)
            computed.append(counts[0])
            outputs.append(out)
    finally:
        hook.remove()
    blocks = hf_paged.get_pool(model).stats().num_used if "cache_implementation" in options else None
    first_tokens = [out.sequences[0, -1].item() for out in outputs]
    for out in outputs:
        if isinstance(out.past_key_values, hf_paged.PagedCache):
            out.past_key_values.release()
    return sum(computed), statistics.median(ttft[1:]), blocks, first_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prefix", type=int, default=512)
    parser.add_argument("--suffix", type=int, default=24)
    args = parser.parse_args()
    print(environment() + "\n")
    rows = []
    for name in args.models:
        model, label = load_model(name)
        generator = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        prefix = torch.randint(3, vocab, (1, args.prefix), generator=generator)
        prompts = [
            torch.cat([prefix, torch.randint(3, vocab, (1, args.suffix), generator=generator)], dim=1)
            for _ in range(args.requests)
        ]
        results = {}
        for variant, options in VARIANTS.items():
            hf_paged.release_pool(model)  # a fresh pool: nothing cached from an earlier variant
            results[variant] = serve(model, prompts, options)
        baseline = results["DynamicCache"]
        for variant, (computed, ttft, blocks, tokens) in results.items():
            rows.append(
                [
                    label,
                    variant,
                    computed,
                    f"{computed / baseline[0]:.3f}",
                    f"{ttft * 1e3:.1f}",
                    f"{baseline[1] / ttft:.2f}x",
                    "" if blocks is None else blocks,
                    "yes" if tokens == baseline[3] else "NO",
                ]
            )
        print(
            markdown_table(
                HEADERS,
                rows[-3:],
            ),
            flush=True,
        )
    print()
    print(
        markdown_table(
            HEADERS,
            rows,
        )
    )


if __name__ == "__main__":
    main()
