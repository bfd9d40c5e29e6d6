"""Serving 8 LoRA adapters from one base model: hf_paged's `Engine` with the adapters resident (requests of all
adapters in the same steps) vs the `Engine` serving one adapter merged into the weights (no adapter cost: the
ceiling) vs PEFT `generate` per adapter in static batches (`set_adapter`, then that adapter's requests batched as
`engine_throughput.py` batches them under the same KV budget), side by side in one run, plus memory.

Workload: `engine_throughput.py`'s ShareGPT-like lengths (scaled by `--scale`, clipped to [1, `--max-length`]),
random token ids, greedy, every request asking for its own output length; request `i` runs on adapter `i % 8`.
Adapters: random LoRA factors (`hf_paged.reference_models.random_lora`) of rank `--rank` on `--targets`.

`--systems adapters-compiled merged-compiled` add the same two Engines with compiled steps (`compile=True`, compiled
in a warm-up that is not timed); "vs merged" compares each Engine with the merged one of its own kind (eager or
compiled), and the compiled adapters' row counts the requests whose tokens equal the eager Engine's.

Memory: the base model's parameters plus the adapters' stacked factors (what the Engine holds), against one merged
copy of the model per adapter (what serving each fine-tune as its own model takes).

Usage: python benchmarks/lora_serving.py [--model smollm2|tiny] [--requests 64] [--adapters 8] [--rank 8]
       [--targets q_proj k_proj v_proj o_proj] [--budget-tokens 8192]
       [--systems adapters merged peft adapters-compiled merged-compiled]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from common import environment, load_model, markdown_table
from engine_throughput import static_batches, workload
from peft import get_peft_model, set_peft_model_state_dict

import hf_paged
from hf_paged.reference_models import random_lora


def run_engine(model, requests, names, adapters, budget_tokens: int, block_size: int, compiled: bool = False):
    """Every request on its adapter (`names[i]`, `None`: the model as it is), all in one Engine: eager steps
    (`exact=True`), or compiled ones (`compile=True`, compiled during a warm-up of two short requests per adapter
    name used, not timed). Returns the wall time, tokens generated, adapter bytes, notes and every request's
    tokens."""
    options = {"compile": True} if compiled else {"exact": True}
    engine = hf_paged.Engine(
        model, block_size=block_size, num_blocks=budget_tokens // block_size, progress=False, adapters=adapters,
        **options,
    )  # fmt: skip
    warmup = ""
    if compiled:
        start = time.perf_counter()
        for name in dict.fromkeys(names):
            engine.generate([[5, 6, 7], [8, 9]], max_new_tokens=3, adapter=name)
        warmup = f"; warm-up (compiling) {time.perf_counter() - start:.0f} s, {engine.runner.graphs} graph(s)"
    steps_before, compiled_before = engine.stats().num_steps, engine.runner.compiled_steps
    start = time.perf_counter()
    ids = [
        engine.add_request(prompt, max_new_tokens=count, min_new_tokens=count, do_sample=False, adapter=name)
        for (prompt, count), name in zip(requests, names)
    ]
    tokens = {}
    while engine.has_unfinished_requests():
        tokens.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    elapsed = time.perf_counter() - start
    generated = sum(len(t) for t in tokens.values())
    num_steps = engine.stats().num_steps - steps_before
    per_step = elapsed / max(num_steps, 1) * 1e3
    compiled_steps = engine.runner.compiled_steps - compiled_before
    notes = f"{num_steps} steps ({compiled_steps} compiled), {per_step:.1f} ms/step{warmup}"
    resident = engine.adapters.num_bytes
    engine.close()
    engine.adapters.close()
    return elapsed, generated, resident, notes, [tokens[i] for i in ids]


def run_peft_static(model, requests, names, adapters, budget_tokens: int, pad_token_id: int = 0):
    """PEFT's model with every adapter loaded; per adapter, its requests in static batches."""
    peft_model = None
    for name, (config, state) in adapters.items():
        if peft_model is None:
            peft_model = get_peft_model(copy.deepcopy(model), config, adapter_name=name)
        else:
            peft_model.add_adapter(name, config)
        set_peft_model_state_dict(peft_model, state, adapter_name=name)
    peft_model.eval()
    generated, num_batches = 0, 0
    start = time.perf_counter()
    for name in adapters:
        peft_model.set_adapter(name)
        mine = [request for request, owner in zip(requests, names) if owner == name]
        for batch in static_batches(mine, budget_tokens):
            width, new = max(len(p) for p, _ in batch), max(n for _, n in batch)
            input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p, _ in batch])
            attention_mask = torch.zeros_like(input_ids)
            for row, (prompt, _) in enumerate(batch):
                attention_mask[row, width - len(prompt) :] = 1
            with torch.inference_mode():
                peft_model.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=pad_token_id,
                )
            generated += sum(n for _, n in batch)  # the tokens requests asked for; the rest of the batch is waste
            num_batches += 1
    elapsed = time.perf_counter() - start
    return elapsed, generated, None, f"{num_batches} batches over {len(adapters)} adapters", None


def merged(model, adapter):
    config, state = adapter
    peft_model = get_peft_model(copy.deepcopy(model), config)
    set_peft_model_state_dict(peft_model, state)
    return peft_model.merge_and_unload().eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", choices=["tiny", "smollm2"])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--targets", nargs="+", default=["q_proj", "k_proj", "v_proj", "o_proj"])
    parser.add_argument("--budget-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--scale", type=float, default=0.125)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument(
        "--systems",
        nargs="+",
        default=["adapters", "merged", "peft"],
        choices=["adapters", "merged", "peft", "adapters-compiled", "merged-compiled"],
    )
    args = parser.parse_args()

    torch.manual_seed(0)
    model, label = load_model(args.model)
    requests = workload(args.requests, args.scale, args.max_length, model.config.vocab_size)
    adapters = {
        f"adapter{i}": random_lora(model, seed=i, rank=args.rank, target_modules=args.targets)
        for i in range(args.adapters)
    }
    names = [f"adapter{i % args.adapters}" for i in range(len(requests))]
    base_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    merged_model = merged(model, adapters["adapter0"]) if {"merged", "merged-compiled"} & set(args.systems) else None
    systems = {
        "adapters": (
            f"Engine, {args.adapters} adapters resident",
            lambda: run_engine(model, requests, names, adapters, args.budget_tokens, args.block_size),
        ),
        "merged": (
            "Engine, one adapter merged",
            lambda: run_engine(merged_model, requests, [None] * len(requests), {}, args.budget_tokens, args.block_size),
        ),
        "adapters-compiled": (
            f"Engine compiled, {args.adapters} adapters resident",
            lambda: run_engine(model, requests, names, adapters, args.budget_tokens, args.block_size, True),
        ),
        "merged-compiled": (
            "Engine compiled, one adapter merged",
            lambda: run_engine(
                merged_model, requests, [None] * len(requests), {}, args.budget_tokens, args.block_size, True
            ),
        ),
        "peft": (
            "PEFT generate per adapter, static batches",
            lambda: run_peft_static(model, requests, names, adapters, args.budget_tokens),
        ),
    }
    runs = {title: run() for key, (title, run) in systems.items() if key in args.systems}
    merged_runs = {False: runs.get("Engine, one adapter merged"), True: runs.get("Engine compiled, one adapter merged")}
    peft_rate = runs.get("PEFT generate per adapter, static batches")
    eager_tokens = runs.get(f"Engine, {args.adapters} adapters resident", (None,) * 5)[4]
    rows = []
    for title, (elapsed, generated, adapter_bytes, notes, tokens) in runs.items():
        merged_rate = merged_runs["compiled" in title] or merged_runs[False]
        if "compiled" in title and tokens is not None and eager_tokens is not None and "adapters" in title:
            same = sum(a == b for a, b in zip(tokens, eager_tokens))
            notes += f"; {same}/{len(tokens)} requests' tokens equal the eager Engine's"
        rate = generated / elapsed
        memory = "-"
        if adapter_bytes is not None:
            memory = f"{(base_bytes + adapter_bytes) / 2**20:.1f} ({adapter_bytes / 2**20:.2f} adapters)"
        rows.append(
            [
                title,
                f"{rate:,.1f}",
                "-" if merged_rate is None else f"{rate / (merged_rate[1] / merged_rate[0]):.2f}x",
                "-" if peft_rate is None else f"{rate / (peft_rate[1] / peft_rate[0]):.2f}x",
                f"{elapsed:.1f}",
                memory,
                notes,
            ]
        )
    prompts = [len(p) for p, _ in requests]
    outputs = [n for _, n in requests]
    print(f"{label}; {environment()}")
    print(
        f"{len(requests)} requests over {args.adapters} adapters (rank {args.rank} on {', '.join(args.targets)}), "
        f"prompt {min(prompts)}-{max(prompts)} (mean {sum(prompts) / len(prompts):.0f}), output "
        f"{min(outputs)}-{max(outputs)} (mean {sum(outputs) / len(outputs):.0f}) tokens; KV budget "
        f"{args.budget_tokens} tokens; {args.adapters} merged copies would take "
        f"{args.adapters * base_bytes / 2**20:.1f} MiB of weights\n"
    )
    headers = ["system", "tokens/s", "vs merged", "vs PEFT static", "wall s", "weights MiB", "notes"]
    print(markdown_table(headers, rows))


if __name__ == "__main__":
    main()
