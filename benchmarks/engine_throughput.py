"""Serving a mixed-length workload under one KV memory budget: hf_paged's `Engine` vs stock `generate` with static
batches vs transformers' own continuous batching (`generate_batch`'s manager), side by side in one run.

Workload: ShareGPT-like prompt and output lengths (log-normal with the vLLM paper's ShareGPT means, as in
kv_memory.py) scaled by `--scale` and clipped to [1, `--max-length`], random token ids, greedy decoding, every
request asking for its own output length (end-of-sequence ignored where the API allows it; tokens/s counts the tokens
each request actually received).

- Engine: a pool of budget / block_size blocks; admission, preemption and prefix reuse as shipped.
- Static batches: prompts taken in arrival order into the largest batch whose DynamicCache (padded prompt + longest
  output in the batch, for every row) fits the budget; each batch runs `generate` with its longest output length.
- generate_batch: transformers' continuous batching manager with the same number of tokens in its cache
  (`num_blocks * page_size` = budget), each request with its own `max_new_tokens`.

Peak KV is the most KV memory held at once: the Engine's peak blocks, the largest static batch's DynamicCache, and the
preallocated cache of `generate_batch`.

Engine-only columns: "pad share" is the share of the positions its forwards computed that were pads
(`EngineStats.pad_share`); "wall / ceiling" compares its wall time with the **ceiling**: the same run's bare model
forwards (no cache, `use_cache=False`) over exactly the input shapes the Engine's forwards had, in the same order,
with the logits of the same positions (`logits_to_keep`: a packed step's last token of each row), timed after the
Engine run, so the ratio is the Engine's own overhead (scheduling, block bookkeeping, paged reads
and writes, sampling) plus the attention over the cached context that any cache needs and the bare forwards do not
do. "wall / ceiling with context" adds that attention for the decode steps (most steps): each of their forwards
runs with a stock `DynamicCache` holding every row's context (contiguous, left-padded to the step's longest, as
`generate` holds a batch), filled before the timed forward; packed steps stay bare forwards.

"engine_gather" runs the Engine with `kernel="gather"` (K/V copied out of the blocks before attention) instead of
its default in-place kernel (its ceilings are not re-measured: they depend only on the forwards' shapes).

Usage: python benchmarks/engine_throughput.py [--model tiny|smollm2] [--requests 200] [--budget-tokens 8192]
       [--systems engine engine_gather static generate_batch]
"""

from __future__ import annotations

import argparse
import time

import torch
from common import environment, load_model, markdown_table
from kv_memory import sharegpt_like_requests
from transformers import ContinuousBatchingConfig, DynamicCache, GenerationConfig

import hf_paged
from hf_paged.pool import KVShape


def workload(num_requests: int, scale: float, max_length: int, vocab_size: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    requests = []
    for prompt_length, output_length in sharegpt_like_requests(num_requests, seed):
        prompt_length = max(1, min(max_length, round(prompt_length * scale)))
        output_length = max(1, min(max_length, round(output_length * scale)))
        prompt = torch.randint(3, vocab_size, (prompt_length,), generator=generator).tolist()
        requests.append((prompt, output_length))
    return requests


def record_forwards(model, engine) -> tuple[list, object]:
    """`(forwards, hook)`: for every forward of `model` from now on (until `hook.remove()`), its `input_ids` shape,
    its `logits_to_keep` (the positions whose logits it computed) and, for a decode step of right-aligned rows (one
    token each), every row's context before it (`None` for other forwards)."""
    forwards = []

    def record(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        decode = ids.shape[1] == 1 and engine.cache.packed_rows() is None
        contexts = [row.num_tokens - 1 for row in engine.cache.rows] if decode else None
        forwards.append((tuple(ids.shape), kwargs.get("logits_to_keep"), contexts))

    return forwards, model.register_forward_pre_hook(record, with_kwargs=True)


def ceiling_seconds(model, forwards: list, vocab_size: int, with_context: bool = False) -> float:
    """The model's own cost of the Engine's forwards, in order: bare forwards (no cache) over the same input shapes,
    computing the logits of the same positions (`logits_to_keep`); `with_context`: a decode step's rows also attend
    to their contexts, held in a stock `DynamicCache` (contiguous, left-padded to the step's longest context, as
    `generate` holds a batch), filled before each timed forward."""
    generator = torch.Generator().manual_seed(1)
    config = model.config.get_text_config(decoder=True)
    kv_heads = getattr(config, "num_key_value_heads", config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    longest = max((max(c) for *_, c in forwards if c), default=0)
    widest = max((len(c) for *_, c in forwards if c), default=0)
    filler = torch.zeros(widest, kv_heads, longest, head_dim, dtype=model.dtype)
    total = 0.0
    with torch.inference_mode():
        for shape, logits_to_keep, contexts in forwards:
            inputs = {"input_ids": torch.randint(3, vocab_size, shape, generator=generator)}
            if logits_to_keep is not None:
                inputs["logits_to_keep"] = logits_to_keep
            if with_context and contexts:
                past = max(contexts)
                cache = DynamicCache(config=model.config)
                for layer in range(config.num_hidden_layers):
                    cache.update(filler[: len(contexts), :, :past], filler[: len(contexts), :, :past], layer)
                mask = torch.zeros(len(contexts), past + 1, dtype=torch.long)
                for row, context in enumerate(contexts):
                    mask[row, past - context :] = 1
                inputs |= {"past_key_values": cache, "attention_mask": mask, "use_cache": True}
                inputs["position_ids"] = torch.tensor(contexts)[:, None]
            else:
                inputs["use_cache"] = False
            start = time.perf_counter()
            model(**inputs)
            total += time.perf_counter() - start
    return total


def run_engine(model, requests, budget_tokens: int, block_size: int, kernel: str = "auto", ceilings: bool = True):
    engine = hf_paged.Engine(
        model, block_size=block_size, num_blocks=budget_tokens // block_size, progress=False, kernel=kernel, exact=True
    )  # eager steps (their forward hooks count the positions); compiled steps: compiled_steps.py, vs_vllm_cpu.py
    params = [hf_paged.SamplingParams(max_new_tokens=n, eos_token_id=()) for _, n in requests]
    forwards, hook = record_forwards(model, engine)
    start = time.perf_counter()
    outputs = engine.generate([p for p, _ in requests], params)
    elapsed = time.perf_counter() - start
    hook.remove()
    if not ceilings:  # the ceilings depend on the forwards' shapes only: the same for every kernel
        ceiling = ceiling_with_context = float("nan")
    else:
        ceiling = ceiling_seconds(model, forwards, model.config.vocab_size)
        ceiling_with_context = ceiling_seconds(model, forwards, model.config.vocab_size, with_context=True)
    stats = engine.last_stats
    pad_share = getattr(stats, "pad_share", None)  # (versions before packed steps did not count pads)
    waste = "-" if pad_share is None else f"{pad_share:.1%}"
    mixed = getattr(stats, "mixed_steps", 0)
    kinds = f"{stats.prefill_steps} prefill, {stats.decode_steps} decode, {mixed} mixed steps"
    extra = (
        f"{stats.preemptions} preemptions, {kinds}, peak {stats.peak_blocks} blocks, "
        f"{elapsed / max(stats.num_steps, 1) * 1e3:.2f} ms/step, kernel {engine.cache.kernel.backend}"
    )
    engine.close()
    generated = sum(len(o.token_ids) for o in outputs)
    versus = ("-", "-") if not ceilings else (f"{elapsed / ceiling:.2f}x", f"{elapsed / ceiling_with_context:.2f}x")
    return elapsed, generated, stats.peak_blocks * block_size, extra, waste, *versus


def static_batches(requests, budget_tokens: int) -> list[list[tuple[list[int], int]]]:
    batches, current = [], []
    for request in requests:
        trial = current + [request]
        cost = len(trial) * (max(len(p) for p, _ in trial) + max(n for _, n in trial))
        if current and cost > budget_tokens:
            batches.append(current)
            trial = [request]
        current = trial
    return batches + [current]


def run_static(model, requests, budget_tokens: int, pad_token_id: int = 0):
    peak, generated = 0, 0
    start = time.perf_counter()
    batches = static_batches(requests, budget_tokens)
    for batch in batches:
        width, new = max(len(p) for p, _ in batch), max(n for _, n in batch)
        input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p, _ in batch])
        attention_mask = (input_ids != pad_token_id).long()
        attention_mask[:, -1] = 1
        for row, (prompt, _) in enumerate(batch):
            attention_mask[row, width - len(prompt) :] = 1
        model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=pad_token_id,
        )
        generated += sum(n for _, n in batch)  # tokens each request asked for; the rest of the batch is waste
        peak = max(peak, len(batch) * (width + new))
    elapsed = time.perf_counter() - start
    sizes = [len(b) for b in batches]
    return elapsed, generated, peak, f"{len(batches)} batches of {min(sizes)}-{max(sizes)}", "-", "-", "-"


def run_generate_batch(model, requests, budget_tokens: int, page_size: int, use_cuda_graph: bool | None = None):
    """transformers' continuous batching over `requests` (`use_cuda_graph`: its own CUDA graphs; `None`: its
    default, on where the attention needs no mask)."""
    config = GenerationConfig(max_new_tokens=max(n for _, n in requests), do_sample=False, pad_token_id=0)
    batching = ContinuousBatchingConfig(
        page_size=page_size, num_blocks=budget_tokens // page_size, use_cuda_graph=use_cuda_graph
    )
    results = {}
    start = time.perf_counter()
    with model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=batching, block=True, timeout=5
    ) as manager:
        ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in requests]
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped early")
    elapsed = time.perf_counter() - start
    generated = sum(len(r.generated_tokens) for r in results.values())
    return elapsed, generated, budget_tokens, "preallocated cache", "-", "-", "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=["tiny", "smollm2"])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--budget-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument(
        "--systems",
        nargs="+",
        default=["engine", "static", "generate_batch"],
        choices=["engine", "engine_gather", "static", "generate_batch"],
    )
    args = parser.parse_args()

    torch.manual_seed(0)
    model, label = load_model(args.model)
    requests = workload(args.requests, args.scale, args.max_length, model.config.vocab_size)
    bytes_per_token = KVShape.from_model(model).bytes_per_token
    systems = {
        "engine": ("hf_paged Engine", lambda: run_engine(model, requests, args.budget_tokens, args.block_size)),
        "engine_gather": (
            "hf_paged Engine, kernel='gather'",
            lambda: run_engine(model, requests, args.budget_tokens, args.block_size, kernel="gather", ceilings=False),
        ),
        "static": ("stock generate, static batches", lambda: run_static(model, requests, args.budget_tokens)),
        "generate_batch": (
            "transformers generate_batch",
            lambda: run_generate_batch(model, requests, args.budget_tokens, args.block_size),
        ),
    }
    runs = {label: run() for key, (label, run) in systems.items() if key in args.systems}
    baseline = runs.get("stock generate, static batches")
    batching = runs.get("transformers generate_batch")
    rows = []
    for name, (elapsed, generated, peak_tokens, notes, pad_share, *versus_ceilings) in runs.items():
        tokens_per_s = generated / elapsed
        rows.append(
            [
                name,
                f"{tokens_per_s:,.0f}",
                "-" if baseline is None else f"{tokens_per_s / (baseline[1] / baseline[0]):.2f}x",
                "-" if batching is None else f"{tokens_per_s / (batching[1] / batching[0]):.2f}x",
                f"{elapsed:.1f}",
                f"{peak_tokens * bytes_per_token / 2**20:.1f}",
                pad_share,
                *versus_ceilings,
                notes,
            ]
        )
    prompts = [len(p) for p, _ in requests]
    outputs = [n for _, n in requests]
    print(f"{label}; {environment()}")
    print(
        f"{len(requests)} requests, prompt {min(prompts)}-{max(prompts)} (mean {sum(prompts) / len(prompts):.0f}), "
        f"output {min(outputs)}-{max(outputs)} (mean {sum(outputs) / len(outputs):.0f}) tokens; KV budget "
        f"{args.budget_tokens} tokens = {args.budget_tokens * bytes_per_token / 2**20:.1f} MiB\n"
    )
    headers = [
        "system",
        "tokens/s",
        "vs static",
        "vs generate_batch",
        "wall s",
        "peak KV MiB",
        "pad share",
        "wall / ceiling",
        "wall / ceiling with context",
        "notes",
    ]
    print(markdown_table(headers, rows))


if __name__ == "__main__":
    main()
