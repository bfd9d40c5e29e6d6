"""Chunked prefill in the Engine: how long running requests wait for their next token when a long prompt arrives,
and what chunking costs the long request's time to first token.

`--running` requests (prompts of 32 random tokens, `--new` new tokens each, greedy) are decoding when one request
with a prompt of `--long` random tokens arrives. The Engine runs with `max_prefill_tokens` = each value of
`--budgets` (a value >= `--long` prefills the long prompt in one step) and `max_num_batched_tokens` = each value of
`--step-budgets` (tokens in one step while requests decode; "default" leaves the Engine's default; versions of
hf_paged without it run the first value only). Per run: the longest gap between two tokens of any running request
after the long request arrived, the median gap, the long request's time to first token, and the total wall time;
outputs are checked to be the same for every budget.

Usage: python benchmarks/chunked_prefill.py [--model smollm2|tiny] [--long 2048] [--budgets 4096 512 256]
       [--step-budgets default 256]
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

import torch
from common import environment, load_model, markdown_table

import hf_paged


def run(model, budget: int, step_budget: int | None, running: int, long: int, new: int):
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    shorts = [torch.randint(3, vocab, (32,), generator=generator).tolist() for _ in range(running)]
    long_prompt = torch.randint(3, vocab, (long,), generator=generator).tolist()
    step = {} if step_budget is None else {"max_num_batched_tokens": step_budget}
    engine = hf_paged.Engine(model, block_size=16, max_prefill_tokens=budget, prefix_caching=False, exact=True, **step)
    options = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False}
    ids = [engine.add_request(p, **options) for p in shorts]
    started: set[str] = set()
    while len(started) < running:  # every short request has its first token
        started.update(o.request_id for o in engine.step() if o.token_ids)
    long_id = engine.add_request(long_prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    arrived = last_token = time.perf_counter()
    gaps, ttft, outputs = [], None, {}
    while engine.has_unfinished_requests():
        results = engine.step()
        now = time.perf_counter()
        if any(o.request_id in ids and o.new_token_ids for o in results):
            gaps.append(now - last_token)
            last_token = now
        for o in results:
            if o.request_id == long_id and ttft is None and o.token_ids:
                ttft = now - arrived
            if o.finished:
                outputs[o.request_id] = o.token_ids
        if all(i in outputs for i in ids):
            last_token = now  # nothing left to wait for
    total = time.perf_counter() - arrived
    return [outputs[i] for i in [*ids, long_id]], max(gaps), statistics.median(gaps), ttft, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=["tiny", "smollm2"])
    parser.add_argument("--running", type=int, default=8)
    parser.add_argument("--long", type=int, default=2048)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--budgets", nargs="+", type=int, default=[4096, 512, 256])
    parser.add_argument("--step-budgets", nargs="+", default=["default", "256"])
    args = parser.parse_args()
    model, label = load_model(args.model)
    print(f"{label}; {environment()}\n")
    supported = "max_num_batched_tokens" in inspect.signature(hf_paged.Engine).parameters
    default = inspect.signature(hf_paged.Engine).parameters.get("max_num_batched_tokens")
    step_budgets = [None if b == "default" else int(b) for b in args.step_budgets][: None if supported else 1]
    rows, reference = [], None
    for budget in args.budgets:
        for step_budget in step_budgets:
            outputs, worst, median, ttft, total = run(model, budget, step_budget, args.running, args.long, args.new)
            reference = reference or outputs
            shown = "-" if not supported else default.default if step_budget is None else step_budget
            rows.append(
                [
                    budget,
                    shown,
                    f"{worst * 1000:.0f}",
                    f"{median * 1000:.0f}",
                    f"{ttft:.2f}",
                    f"{total:.1f}",
                    "yes" if outputs == reference else "NO",
                ]
            )
            print(rows[-1], flush=True)
    print(
        f"\n{args.running} requests decoding (32-token prompts, {args.new} new tokens) when a {args.long}-token prompt "
        "arrives; block size 16\n"
    )
    headers = [
        "max_prefill_tokens",
        "max_num_batched_tokens",
        "longest wait for a token, ms",
        "median, ms",
        "long request TTFT, s",
        "wall s",
        "same tokens",
    ]
    print(markdown_table(headers, rows))


if __name__ == "__main__":
    main()
