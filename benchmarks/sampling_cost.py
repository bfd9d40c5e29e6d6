"""What choosing the next tokens costs the Engine a step, by sampling options: `before`, rows in turn with their
processors applied through `LogitsProcessorList.__call__` (which inspects every processor's signature every call)
and the minimum length kept after it is reached, as the Engine did; `after`, the sampler as it is
(`sampler.apply_processors` calling each processor, the minimum length dropped once reached); side by side in one
run. (Both pick greedy rows with `max(dim).indices`, which
`before` took with `argmax`: that part of the change is not in the ratio.)

`--requests` requests share one step's logits (`[requests, vocab]`, random, SmolLM2's vocabulary of 49,152 by
default); each option set is timed `--repeats` times per way (median), the ways alternating. The chosen tokens of
both ways are compared (seeded requests: the same draws).

Usage: python benchmarks/sampling_cost.py [--requests 60] [--vocab 49152] [--repeats 20] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import environment, markdown_table

from hf_paged.engine import sampler
from hf_paged.engine.params import SamplingParams
from hf_paged.engine.request import Request

OPTIONS = {
    "greedy": {},
    "greedy, min_new_tokens reached": {"min_new_tokens": 4, "eos_token_id": (2,)},
    "greedy, repetition_penalty 1.1": {"repetition_penalty": 1.1},
    "sampling: temperature 0.7, top_k 50, top_p 0.9": {
        "do_sample": True,
        "temperature": 0.7,
        "top_k": 50,
        "top_p": 0.9,
    },  # fmt: skip
}


def listed(processors, input_ids, scores):
    """The processors applied as before: through `LogitsProcessorList.__call__`."""
    return processors(input_ids, scores)


def requests_for(options: dict, count: int) -> list[Request]:
    requests = []
    for i in range(count):
        request = Request(f"r{i}", list(range(3, 35)), SamplingParams(max_new_tokens=64, seed=i, **options))
        request.output_token_ids = list(range(40, 48))  # 8 generated: past any minimum length here
        request.generator = torch.Generator().manual_seed(i)
        requests.append(request)
    return requests


def timed(options: dict, logits: torch.Tensor, way: str) -> tuple[float, list[int]]:
    requests = requests_for(options, logits.shape[0])
    apply, still_acting = sampler.apply_processors, sampler._still_acting
    if way == "before":
        sampler.apply_processors, sampler._still_acting = listed, lambda request: request.processors
    try:
        sampler.next_tokens(requests, logits)  # a first step: processors built
        for i, request in enumerate(requests):
            request.generator.manual_seed(i)
        began = time.perf_counter()
        tokens = sampler.next_tokens(requests, logits)
        return time.perf_counter() - began, tokens
    finally:
        sampler.apply_processors, sampler._still_acting = apply, still_acting


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logits = torch.randn(args.requests, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
    print(environment() + f"; {args.requests} requests, vocabulary {args.vocab}")
    print()
    headers = ["options", "before ms a step", "after ms a step", "after vs before", "tokens equal"]
    rows = []
    for label, options in OPTIONS.items():
        times = {"before": [], "after": []}
        tokens = {}
        for _ in range(args.repeats):
            for way in times:
                seconds, tokens[way] = timed(options, logits, way)
                times[way].append(seconds)
        before_ms, after_ms = (1e3 * statistics.median(times[way]) for way in ("before", "after"))
        equal = "yes" if tokens["before"] == tokens["after"] else "NO"
        rows.append([label, f"{before_ms:.1f}", f"{after_ms:.1f}", f"{before_ms / after_ms:.2f}x", equal])
        print(markdown_table(headers, rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(markdown_table(headers, rows))


if __name__ == "__main__":
    main()
