"""Where an Engine step's time goes on SmolLM2-135M fp32: the compiled forward's call against the host work around it
(the prefix key's weight check, sampling, scheduling, the step's inputs and the attention switch).

Workload: engine_throughput.py's (`--requests` ShareGPT-like requests of random token ids, greedy, end-of-sequence
ignored, 8,192 tokens of KV in blocks of 16), run three times through `add_request` + `step()`: the first compiles,
the second warms oneDNN's kernels, the third is timed. Each part is timed by wrapping the function that does it and
summed over the timed run's steps (per step in the table); the wrappers cost about a microsecond a call.
`--python-host-code` compiles with inductor's host code in Python (`step_runner.CPP_WRAPPER = False`) instead of
C++, the default.

Usage: python benchmarks/engine_step_parts.py [--threads 2] [--requests 60] [--python-host-code]
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import torch
from common import environment, markdown_table, timing
from engine_throughput import workload

import hf_paged
from hf_paged import planner, prefix
from hf_paged.engine import engine as engine_module
from hf_paged.engine import scheduler, step_runner
from hf_paged.reference_models import load_smollm2

# (owner, attribute, label): the parts, outermost first
PARTS = [
    (engine_module.Engine, "step", "Engine.step (all of it)"),
    (step_runner.StepRunner, "_compiled_forward", "compiled forward with its inputs and attention switch"),
    (step_runner.StepRunner, "_run_compiled", "the compiled call (Dynamo's guards, the graph)"),
    (planner.ForwardPlanner, "refresh_root", "prefix key: the weights check (refresh_root)"),
    (prefix, "_sample_of", "  of which the parameter walk (_sample_of)"),
    (engine_module, "next_tokens", "sampling (next_tokens)"),
    (scheduler.Scheduler, "schedule", "scheduling"),
    (step_runner.StepRunner, "_packed_inputs", "input ids and positions"),
]


def timed(owner, name: str, label: str, totals: Counter) -> None:
    def add(seconds: float) -> None:
        totals[label] += seconds

    setattr(owner, name, timing(getattr(owner, name), add))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--python-host-code", action="store_true", help="inductor's host code in Python, not C++")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    step_runner.CPP_WRAPPER = not args.python_host_code
    totals: Counter = Counter()
    for owner, name, label in PARTS:
        timed(owner, name, label, totals)
    model = load_smollm2()[0]
    requests = workload(args.requests, 0.25, 256, model.config.vocab_size)
    engine = hf_paged.Engine(model, block_size=16, num_blocks=8192 // 16, progress=False)

    def run() -> int:
        for prompt, count in requests:
            engine.add_request(prompt, hf_paged.SamplingParams(max_new_tokens=count, eos_token_id=()))
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        return steps

    begin = time.perf_counter()
    run()
    first = time.perf_counter() - begin
    run()
    totals.clear()
    begin = time.perf_counter()
    steps = run()
    elapsed = time.perf_counter() - begin
    print(f"SmolLM2-135M (fp32); {environment()}; ran with {torch.get_num_threads()} torch threads")
    print(
        f"{args.requests} requests, {steps} steps; host code of the compiled step in "
        f"{'Python' if args.python_host_code else 'C++'}; first run (compiling) {first:.0f} s, timed run "
        f"{elapsed:.1f} s = {elapsed / steps * 1000:.1f} ms a step"
    )
    print()
    rows = [[label, f"{totals[label] / steps * 1000:.2f}"] for _, _, label in PARTS]
    print(markdown_table(["part", "ms a step"], rows))
    engine.close()


if __name__ == "__main__":
    main()
