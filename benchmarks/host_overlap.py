"""Can the host plan the next Engine step while the CPU runs this one? Asynchronous batching on the CPU, measured
before it is built.

Asynchronous batching overlaps the host's Python work for step N+1 (scheduling, planning, sampling bookkeeping)
with the device's work for step N. On the CPU the "device" is the same process: the overlap would have to come from
a Python thread running beside the forward, which needs the forward to leave the GIL to it. This script builds the
Engine at its defaults (compiled steps) on SmolLM2-135M fp32, puts `--requests` greedy requests in it, compiles on
the first steps (untimed), then times `--steps` steps three ways, in turn:

- `alone`: each step on its own (the forward's share of it reported beside);
- `then host work`: each step followed by `--host-ms` ms of pure-Python work in the same thread (what the host does
  today, serially, on top of the step: the sequential cost to beat);
- `beside host work`: each step with the same Python work running in a second thread, started as the step starts
  (what asynchronous batching would do).

Asynchronous batching pays on this CPU only if `beside` is faster than `then`. Median step times, one process.

Usage: python benchmarks/host_overlap.py [--requests 60] [--steps 20] [--host-ms 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
from common import environment, load_model, markdown_table

import hf_paged


def python_work(seconds: float) -> None:
    """Pure-Python work (no torch call) for `seconds` of this thread's CPU time."""
    end = time.thread_time() + seconds
    total = 0
    while time.thread_time() < end:
        for i in range(200):
            total += i * i


def timed_steps(engine, steps: int, host_seconds: float, mode: str) -> tuple[list[float], list[float]]:
    """Wall seconds of `steps` Engine steps in `mode`, and of each step's forward."""
    runner = engine.runner
    forward, forwards = runner.forward, []

    def timed_forward(*args, **kwargs):
        began = time.perf_counter()
        result = forward(*args, **kwargs)
        forwards.append(time.perf_counter() - began)
        return result

    runner.forward = timed_forward
    times = []
    try:
        for _ in range(steps):
            began = time.perf_counter()
            if mode == "beside host work":
                helper = threading.Thread(target=python_work, args=(host_seconds,))
                helper.start()
                engine.step()
                helper.join()
            else:
                engine.step()
                if mode == "then host work":
                    python_work(host_seconds)
            times.append(time.perf_counter() - began)
    finally:
        runner.forward = forward
    return times, forwards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--host-ms", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, label = load_model("smollm2")
    engine = hf_paged.Engine(model, progress=False)
    generator = torch.Generator().manual_seed(0)
    new_tokens = 4 + 3 * args.steps + 8  # every request decodes through all timed steps
    for _ in range(args.requests):
        prompt = torch.randint(3, model.config.vocab_size, (args.prompt_tokens,), generator=generator).tolist()
        engine.add_request(prompt, max_new_tokens=new_tokens, eos_token_id=(), do_sample=False)  # no early end
    began = time.perf_counter()
    while engine.num_waiting or engine.step_counts.get("decode", 0) < 2:  # prefills, then compiled decodes
        engine.step()
    print(environment() + f"; {label}; {args.requests} requests decoding; warm-up {time.perf_counter() - began:.0f} s")
    print()
    rows, sequential = [], None
    for mode in ("alone", "then host work", "beside host work"):
        times, forwards = timed_steps(engine, args.steps, args.host_ms / 1e3, mode)
        step_ms, forward_ms = 1e3 * statistics.median(times), 1e3 * statistics.median(forwards)
        sequential = step_ms if mode == "then host work" else sequential
        versus = "" if sequential is None else f"{sequential / step_ms:.2f}x"
        rows.append([mode, f"{step_ms:.1f}", f"{forward_ms:.1f}", versus])
        print(markdown_table(["steps", "step ms", "forward ms", "speed vs then"], rows[-1:]).splitlines()[-1])
    print()
    print(markdown_table(["steps", "step ms", "forward ms", "speed vs then"], rows))
    engine.close()


if __name__ == "__main__":
    main()
