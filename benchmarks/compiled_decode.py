"""Decode tokens/s of compiled paged `generate` vs transformers' compiled `StaticCache`, with the eager paged cache and
`DynamicCache` beside them, measured side by side in one run; compiled paged tokens checked against eager paged ones.

Compiled means transformers' own auto-compile path: `compile_config` with `_compile_all_devices = True` (on CPU
transformers compiles only when told), the decode steps run through `model.get_compiled_call`, the prefill eagerly.
Each (batch, context) runs in a process of its own (a static graph for that shape: stock's best case), where every
cache first runs one untimed call of the shape (a compiled cache builds its graph there), then `--repeats` timed
calls; decode steps are timed inside the call (a stopping criterion notes the time after every step) and the table
shows the median step and the graphs each compiled cache built. `--in-process` runs every shape in one process
instead, as a program calling `generate` on varied shapes does: the paged cache keeps its one graph, while
transformers' compiled `StaticCache` recompiles with dynamic sizes (measured far slower at batch 8 on this CPU).

`--kv-dtype int8` (or `int4`, `int4-channel`) runs both paged caches over quantized pages: "tokens equal" then compares
compiled quantized tokens with eager quantized ones, which may differ where a compiled K/V rounds to another code.

Usage: python benchmarks/compiled_decode.py [--models smollm2] [--contexts 128 1024 2048 4096] [--batches 1 8]
       [--kv-dtype auto]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import torch
from common import environment, load_model, markdown_table
from decode_speed import StepClock, greedy_decode
from transformers import CompileConfig

import hf_paged
from hf_paged.compiling import unique_graphs
from hf_paged.kernels import native_ops

HEADERS = [
    "model",
    "batch",
    "context",
    "DynamicCache tok/s",
    "paged eager tok/s",
    "StaticCache compiled tok/s",
    "paged compiled tok/s",
    "paged compiled / StaticCache compiled",
    "paged compiled / paged eager",
    "tokens equal",
    "graphs (paged, StaticCache)",
]


def compile_config() -> CompileConfig:
    config = CompileConfig()
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told
    return config


def caches(pool_memory: str, kv_dtype: str = "auto") -> dict[str, dict]:
    cache_config = {"max_memory": pool_memory} | ({} if kv_dtype == "auto" else {"kv_dtype": kv_dtype})
    paged = {"cache_implementation": "paged", "cache_config": cache_config}
    return {
        "DynamicCache": {},
        "paged eager": paged,
        "StaticCache compiled": {"cache_implementation": "static", "compile_config": compile_config()},
        "paged compiled": {**paged, "compile_config": compile_config()},
    }


def decode(model, input_ids, new_tokens: int, options: dict) -> tuple[list[float], torch.Tensor]:
    """Seconds of every decode step of one greedy call of exactly `new_tokens` tokens, and its tokens."""
    clock = StepClock()
    output = greedy_decode(model, input_ids, new_tokens, options, clock)
    return [b - a for a, b in zip(clock.times, clock.times[1:])], output


def measure(
    model, batch: int, context: int, new_tokens: int, repeats: int, pool_memory: str, kv_dtype: str = "auto"
) -> dict:
    """Tokens/s of every cache at one shape, whether compiled paged tokens equal eager paged ones, and the graphs
    each compiled cache built meanwhile."""
    generator = torch.Generator().manual_seed(batch * 10_000 + context)
    input_ids = torch.randint(3, model.config.vocab_size, (batch, context), generator=generator)
    options = caches(pool_memory, kv_dtype)
    graphs = unique_graphs()
    decode_before = hf_paged.compiled_decode_of(model)
    paged_before = 0 if decode_before is None else decode_before.graphs
    tokens = {name: decode(model, input_ids, new_tokens, option)[1] for name, option in options.items()}  # untimed
    steps = {name: [] for name in options}
    for _ in range(repeats):
        for name, option in options.items():
            steps[name].extend(decode(model, input_ids, new_tokens, option)[0])
    paged_graphs = hf_paged.compiled_decode_of(model).graphs - paged_before
    return {
        "speed": {name: batch / statistics.median(times) for name, times in steps.items()},
        "equal": torch.equal(tokens["paged compiled"], tokens["paged eager"]),
        "graphs": [paged_graphs, unique_graphs() - graphs - paged_graphs],
    }


def measure_in_a_process(name: str, batch: int, context: int, args, ops: str = "native") -> dict:
    command = [sys.executable, __file__, "--models", name, "--shape", str(batch), str(context)]
    command += ["--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats), "--pool-memory", args.pool_memory]
    command += ["--kv-dtype", args.kv_dtype]
    env = {**os.environ, native_ops.DISABLE_VARIABLE: "0" if ops == "python" else "1"}
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def row(label: str, batch: int, context: int, result: dict) -> list:
    speed = result["speed"]
    return [
        label,
        batch,
        context,
        *(f"{speed[header.removesuffix(' tok/s')]:.1f}" for header in HEADERS[3:7]),
        f"{speed['paged compiled'] / speed['StaticCache compiled']:.2f}x",
        f"{speed['paged compiled'] / speed['paged eager']:.2f}x",
        "yes" if result["equal"] else "NO",
        "{}, {}".format(*result["graphs"]),
    ]


def pages_label(label: str, kv_dtype: str) -> str:
    return label if kv_dtype == "auto" else f"{label}, {kv_dtype} pages"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2"], choices=["tiny", "smollm2"])
    parser.add_argument("--contexts", nargs="+", type=int, default=[128, 1024, 2048, 4096])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--pool-memory", default="4GiB")
    parser.add_argument(
        "--kv-dtype", default="auto", choices=["auto", "int8", "int4", "int4-channel"], help="the paged caches' pages"
    )
    parser.add_argument("--in-process", action="store_true", help="every shape in this process, one after another")
    parser.add_argument(
        "--ops",
        nargs="+",
        default=["native"],
        choices=["native", "python"],
        help="the CPU implementation of the paged ops: native (C++, the default) or python (HF_PAGED_NATIVE_OPS=0); "
        "each shape runs once with each, in a process of its own",
    )
    parser.add_argument("--shape", nargs=2, type=int, help=argparse.SUPPRESS)  # one shape, its result as JSON
    args = parser.parse_args()
    if args.in_process and args.ops != ["native"]:
        parser.error("--ops python runs each shape in a process of its own: leave out --in-process")
    if args.shape is not None:
        model, label = load_model(args.models[0])
        result = measure(model, *args.shape, args.new_tokens, args.repeats, args.pool_memory, args.kv_dtype)
        print(json.dumps({**result, "label": pages_label(label, args.kv_dtype)}))
        return
    print(environment() + ("; every shape in one process" if args.in_process else "; each shape in its own process"))
    print()
    rows = []
    for name in args.models:
        model, label = load_model(name) if args.in_process else (None, name)
        label = pages_label(label, args.kv_dtype)
        for batch in args.batches:
            for context in args.contexts:
                for ops in args.ops:
                    if args.in_process:
                        result = measure(
                            model, batch, context, args.new_tokens, args.repeats, args.pool_memory, args.kv_dtype
                        )
                    else:
                        result = measure_in_a_process(name, batch, context, args, ops)
                        label = result["label"] + (", Python ops" if ops == "python" else "")
                    rows.append(row(label, batch, context, result))
                    print(markdown_table(HEADERS, rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(markdown_table(HEADERS, rows))


if __name__ == "__main__":
    main()
