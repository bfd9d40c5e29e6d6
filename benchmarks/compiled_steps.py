"""The Engine's compiled steps (`Engine(compile=True)`) against its eager steps on SmolLM2-135M fp32, one process,
the variants one after another.

Workload: engine_throughput.py's with `--model smollm2` (`--requests` ShareGPT-like requests of random token ids,
greedy, end-of-sequence ignored, `--budget-tokens` of KV in blocks of 16). Each variant builds an Engine, warms it
up with 4 short requests (compiling, for the compiled variants: the time is reported as start-up), then times one
`generate` over the whole workload. Variants (`--variants`):

- `eager`: `Engine(compile=False)` (what `exact=True` runs: bit-exact with `generate`);
- `compiled`: `Engine(compile=True)` (inductor, weights frozen into the graph; what the default `compile="auto"` runs on
  a CPU with a C++ compiler);
- `compiled-unfrozen`: the same with inductor's freezing off (weights stay graph inputs; `step_runner.FREEZE`);
- `compiled-python`: compiled with inductor's host code in Python instead of C++ (`step_runner.CPP_WRAPPER`);
- `compiled-python-ops`: compiled, the paged ops' CPU implementation in Python (`native_ops.python_implementation`)
  instead of C++;
- `compiled-separate`: compiled without concatenating the projections of one input (q/k/v, gate/up) into one matmul
  (`step_runner.CONCAT_LINEAR`);
- `compiled-BxT`: compiled with `max_batch_size=B, max_num_batched_tokens=T`.

Reported per variant: tokens/s, start-up, compile seconds and graphs, how much the process's RSS grew from before
the engine was built to after the run (its pool, its compiled graph), and whether its tokens equal the first
variant's.

    python benchmarks/compiled_steps.py --requests 200 --variants eager compiled compiled-unfrozen
    python benchmarks/compiled_steps.py --variants eager compiled --logprobs   # how far compiled is from eager
    python benchmarks/compiled_steps.py --variants eager compiled --logprobs --kv-dtype int8   # quantized pages
    python benchmarks/compiled_steps.py --variants compiled-separate compiled --threads 2   # concat linear
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import re
import time

VARIANT = re.compile(
    r"^(eager|compiled|compiled-unfrozen|compiled-python|compiled-python-ops|compiled-separate|compiled-(\d+)x(\d+))$"
)


def run_variant(
    model, name: str, requests, warmup, budget_tokens: int, logprobs: bool = False, kv_dtype: str = "auto"
) -> dict:
    from hf_paged.kernels import native_ops

    python_ops = name == "compiled-python-ops"
    with native_ops.python_implementation() if python_ops else contextlib.nullcontext():
        return _run_variant(model, name, requests, warmup, budget_tokens, logprobs, kv_dtype)


def _run_variant(model, name: str, requests, warmup, budget_tokens: int, logprobs: bool, kv_dtype: str) -> dict:
    import psutil

    import hf_paged
    from hf_paged.engine import step_runner

    match = VARIANT.match(name)
    limits = {}
    if match.group(2):
        limits = {"max_batch_size": int(match.group(2)), "max_num_batched_tokens": int(match.group(3))}
    step_runner.FREEZE = name != "compiled-unfrozen"
    step_runner.CPP_WRAPPER = name != "compiled-python"
    step_runner.CONCAT_LINEAR = name != "compiled-separate"
    hf_paged.release_pool(model)
    gc.collect()
    rss_before = psutil.Process().memory_info().rss
    begin = time.perf_counter()
    block_size = 64 if kv_dtype == "int4-channel" else 16  # the pool's defaults
    engine = hf_paged.Engine(
        model, block_size=block_size, num_blocks=budget_tokens // block_size, progress=False,
        compile=name != "eager", kv_dtype=kv_dtype, **limits,
    )  # fmt: skip
    extra = {"logprobs": 0} if logprobs else {}
    engine.generate(
        [p for p, _ in warmup], [hf_paged.SamplingParams(max_new_tokens=n, eos_token_id=()) for _, n in warmup]
    )
    start_up = time.perf_counter() - begin
    params = [hf_paged.SamplingParams(max_new_tokens=n, eos_token_id=(), **extra) for _, n in requests]
    begin = time.perf_counter()
    outputs = engine.generate([p for p, _ in requests], params)
    elapsed = time.perf_counter() - begin
    gc.collect()
    tokens = [list(o.token_ids) for o in outputs]
    runner = engine.runner
    result = {
        "tokens": tokens,
        "logprobs": [[p.logprob for p in o.logprobs] for o in outputs] if logprobs else None,
        "rate": sum(map(len, tokens)) / elapsed,
        "elapsed": elapsed,
        "start_up": start_up,
        "compile": f"{runner.graphs} graph(s), {runner.compile_s:.0f} s" if runner.compile else "-",
        "steps": f"{engine.last_stats.compiled_steps} of {engine.last_stats.num_steps}",
        "rss": (psutil.Process().memory_info().rss - rss_before) / 2**20,
    }
    engine.close()
    step_runner.FREEZE = step_runner.CPP_WRAPPER = step_runner.CONCAT_LINEAR = True
    return result


def largest_logprob_difference(result: dict, reference: dict) -> float:
    """The largest |log-probability difference| between `result`'s tokens and `reference`'s, over each request's
    tokens up to its first different token (after it the two condition on different text)."""
    largest = 0.0
    for tokens, logprobs, ref_tokens, ref_logprobs in zip(
        result["tokens"], result["logprobs"], reference["tokens"], reference["logprobs"]
    ):
        for token, logprob, ref_token, ref_logprob in zip(tokens, logprobs, ref_tokens, ref_logprobs):
            largest = max(largest, abs(logprob - ref_logprob))
            if token != ref_token:
                break
    return largest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--budget-tokens", type=int, default=8192)
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--variants", nargs="+", default=["eager", "compiled", "compiled-unfrozen"])
    parser.add_argument(
        "--logprobs",
        action="store_true",
        help="every request also reports its tokens' log-probabilities: the table adds the largest |difference| from "
        "the first variant's, over the tokens before each request's first different token",
    )
    parser.add_argument(
        "--kv-dtype",
        default="auto",
        choices=["auto", "int8", "int4", "int4-channel"],
        help="how the pool stores K/V (blocks of 64 for int4-channel, else 16)",
    )
    args = parser.parse_args()
    for name in args.variants:
        if not VARIANT.match(name):
            names = "eager, compiled, compiled-unfrozen, compiled-python, compiled-separate or compiled-BxT"
            parser.error(f"--variants: {name!r} is not {names}")

    import torch
    from common import environment, markdown_table
    from engine_throughput import workload

    from hf_paged.reference_models import load_smollm2

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = load_smollm2()[0]
    vocab_size = model.config.vocab_size
    requests = workload(args.requests, args.scale, args.max_length, vocab_size)
    warmup = [(prompt, min(n, 8)) for prompt, n in workload(4, args.scale, 32, vocab_size, seed=1)]
    results = {
        name: run_variant(model, name, requests, warmup, args.budget_tokens, args.logprobs, args.kv_dtype)
        for name in args.variants
    }
    first = results[args.variants[0]]
    rows = [
        [
            name,
            f"{r['rate']:,.0f}",
            f"{r['rate'] / first['rate']:.2f}x",
            f"{r['elapsed']:.1f}",
            f"{r['start_up']:.0f}",
            r["compile"],
            r["steps"],
            f"{r['rss']:,.0f}",
            f"{sum(a == b for a, b in zip(r['tokens'], first['tokens']))}/{len(requests)}",
        ]
        + ([f"{largest_logprob_difference(r, first):.1e}"] if args.logprobs else [])
        for name, r in results.items()
    ]
    print(f"SmolLM2-135M (fp32); {environment()}")
    print(f"{len(requests)} requests; KV budget {args.budget_tokens} tokens; kv_dtype {args.kv_dtype}\n")
    headers = ["variant", "tokens/s", f"vs {args.variants[0]}", "wall s", "start-up s", "compiled", "compiled steps",
               "RSS growth MiB", f"requests equal to {args.variants[0]}'s"]  # fmt: skip
    if args.logprobs:
        headers.append(f"max abs logprob difference from {args.variants[0]}'s")
    print(markdown_table(headers, rows))


if __name__ == "__main__":
    main()
