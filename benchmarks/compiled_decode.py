"""Decode tokens/s of compiled paged `generate` vs transformers' compiled `StaticCache`, with the eager paged cache and
`DynamicCache` beside them, measured side by side in one run; compiled paged tokens checked against eager paged ones.

Compiled means transformers' own auto-compile path: `compile_config` with `_compile_all_devices = True` (on CPU
transformers compiles only when told), the decode steps run through `model.get_compiled_call`, the prefill eagerly.
For each (batch, context) Dynamo's graphs are dropped (`torch._dynamo.reset()`) and every cache first runs one untimed
call of the same shape (a compiled cache builds its graph there: a static graph for that shape, stock's best case),
then `--repeats` timed calls; decode steps are timed inside the call (a stopping criterion
notes the time after every step) and the table shows the median step. The number of graphs each compiled cache built
in the whole run is printed at the end (the paged cache's come from `hf_paged.compiled_decode_of`). `--keep-graphs`
keeps Dynamo's graphs from shape to shape instead, as one process calling `generate` on varied shapes does: the paged
cache keeps its one graph, while transformers' compiled `StaticCache` call recompiles with dynamic sizes.

Usage: python benchmarks/compiled_decode.py [--models smollm2] [--contexts 128 1024 2048 4096] [--batches 1 8]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import environment, load_model, markdown_table
from decode_speed import StepClock, greedy_decode
from transformers import CompileConfig

import hf_paged
from hf_paged.compiling import unique_graphs

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
]


def compile_config() -> CompileConfig:
    config = CompileConfig()
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told
    return config


def caches(pool_memory: str) -> dict[str, dict]:
    paged = {"cache_implementation": "paged", "cache_config": {"max_memory": pool_memory}}
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


def measure(model, batch: int, context: int, new_tokens: int, repeats: int, pool_memory: str, fresh: bool):
    if fresh:
        torch._dynamo.reset()
        model.__dict__.pop("_compiled_call", None)  # transformers' compiled forward of the model
    generator = torch.Generator().manual_seed(batch * 10_000 + context)
    input_ids = torch.randint(3, model.config.vocab_size, (batch, context), generator=generator)
    options = caches(pool_memory)
    tokens = {name: decode(model, input_ids, new_tokens, option)[1] for name, option in options.items()}  # untimed
    steps = {name: [] for name in options}
    for _ in range(repeats):
        for name, option in options.items():
            steps[name].extend(decode(model, input_ids, new_tokens, option)[0])
    speed = {name: batch / statistics.median(times) for name, times in steps.items()}
    return speed, torch.equal(tokens["paged compiled"], tokens["paged eager"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2"], choices=["tiny", "smollm2"])
    parser.add_argument("--contexts", nargs="+", type=int, default=[128, 1024, 2048, 4096])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--pool-memory", default="4GiB")
    parser.add_argument("--keep-graphs", action="store_true", help="keep Dynamo's graphs from shape to shape")
    args = parser.parse_args()
    print(environment() + "\n")

    rows = []
    for name in args.models:
        model, label = load_model(name)
        graphs_before = unique_graphs()
        for batch in args.batches:
            for context in args.contexts:
                speed, equal = measure(
                    model, batch, context, args.new_tokens, args.repeats, args.pool_memory, not args.keep_graphs
                )
                rows.append(
                    [
                        label,
                        batch,
                        context,
                        *(f"{speed[header.removesuffix(' tok/s')]:.1f}" for header in HEADERS[3:7]),
                        f"{speed['paged compiled'] / speed['StaticCache compiled']:.2f}x",
                        f"{speed['paged compiled'] / speed['paged eager']:.2f}x",
                        "yes" if equal else "NO",
                    ]
                )
                print(markdown_table(HEADERS, rows[-1:]).splitlines()[-1], flush=True)
        decode_graphs = hf_paged.compiled_decode_of(model)
        paged_graphs = 0 if decode_graphs is None else decode_graphs.graphs
        total = unique_graphs() - graphs_before
        print(f"{label}: graphs compiled: paged {paged_graphs}, StaticCache {total - paged_graphs}", flush=True)
    print()
    print(markdown_table(HEADERS, rows))


if __name__ == "__main__":
    main()
