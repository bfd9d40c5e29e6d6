"""Do compiled Engine steps over quantized pages lose quality against the eager ones? Greedy continuations of
English text on SmolLM2-135M (fp32) by Engines on each page format, eager (`exact=True`) and compiled
(`compile=True`), every one compared with the eager Engine on unquantized pages (bit-exact with `generate`).

Workload: kv_quant.py's continuation prompts (`--prompts` prompts of 32 tokens from the English text of Python's
documentation, after the perplexity segments), `--new-tokens` greedy tokens each, end-of-sequence ignored, all in one
`generate` of an Engine of its own (blocks of 16, `--budget-tokens` of KV); the compiled Engines compile on four
short requests first. Reported per Engine: the share of continuations identical to the unquantized eager Engine's,
the mean tokens before the first difference, and the mean log-probability of the tokens it chose.

Usage: python benchmarks/compiled_quant_quality.py [--prompts 50] [--new-tokens 64] [--formats int8 int4]
"""

from __future__ import annotations

import argparse
import statistics

from common import environment, markdown_table
from kv_quant import text_workload

import hf_paged
from hf_paged.reference_models import load_smollm2


def continuations(model, prompts: list[list[int]], new_tokens: int, budget: int, **options) -> list:
    """`(tokens, log-probabilities)` of every prompt's greedy continuation by a fresh Engine with `options`."""
    hf_paged.release_pool(model)
    engine = hf_paged.Engine(model, block_size=16, num_blocks=budget // 16, progress=False, **options)
    if engine.runner.compile:
        engine.generate([[1, 2, 3], [4, 5]] * 2, max_new_tokens=4)  # compiles
    params = hf_paged.SamplingParams(max_new_tokens=new_tokens, eos_token_id=(), logprobs=0)
    outputs = engine.generate(prompts, params)
    engine.close()
    return [(list(o.token_ids), [p.logprob for p in o.logprobs]) for o in outputs]


def agreement(result: list, reference: list) -> tuple[int, float]:
    """Continuations identical to the reference's, and the mean tokens before the first difference."""
    prefixes = []
    for (tokens, _), (expected, _) in zip(result, reference):
        same = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), len(tokens))
        prefixes.append(same)
    identical = sum(tokens == expected for (tokens, _), (expected, _) in zip(result, reference))
    return identical, statistics.mean(prefixes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--formats", nargs="+", default=["int8", "int4"], choices=["int8", "int4"])
    parser.add_argument("--budget-tokens", type=int, default=8192)
    args = parser.parse_args()
    model, tokenizer = load_smollm2()
    _, prompt_ids = text_workload(tokenizer, 20, args.prompts)
    prompts = prompt_ids.tolist()
    run = lambda **options: continuations(model, prompts, args.new_tokens, args.budget_tokens, **options)  # noqa: E731
    reference = run(exact=True)
    variants = {("auto", "compiled"): run(compile=True)}
    for kv_dtype in args.formats:
        variants[kv_dtype, "eager"] = run(exact=True, kv_dtype=kv_dtype)
        variants[kv_dtype, "compiled"] = run(compile=True, kv_dtype=kv_dtype)
    rows = []
    for (kv_dtype, steps), result in variants.items():
        identical, prefix = agreement(result, reference)
        mean_logprob = statistics.mean(p for _, logprobs in result for p in logprobs)
        rows.append([kv_dtype, steps, f"{identical}/{len(prompts)}", f"{prefix:.1f}", f"{mean_logprob:.3f}"])
    reference_logprob = statistics.mean(p for _, logprobs in reference for p in logprobs)
    rows.insert(0, ["auto", "eager (exact=True)", "reference", f"{args.new_tokens}", f"{reference_logprob:.3f}"])
    print(f"SmolLM2-135M (fp32); {environment()}")
    print(f"{len(prompts)} prompts of 32 tokens of English text, {args.new_tokens} greedy tokens each\n")
    headers = ["kv_dtype", "steps", "continuations identical to unquantized eager",
               "mean tokens before the first difference", "mean log-prob of the chosen tokens"]  # fmt: skip
    print(markdown_table(headers, rows))


if __name__ == "__main__":
    main()
