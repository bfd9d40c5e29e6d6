"""Exactness on SmolLM2-135M-Instruct: bf16 (paged and stock) against an fp32 reference, and whether an answer
depends on what ran before it (a prefix cached by a batched call), for fp32, int8 and int4 pages.

Prompts: chat questions (from the tests and the README) after one shared system prompt, so a batched call caches
the same full blocks a later single prompt reuses. Greedy, `--max-new-tokens` tokens; every answer is compared
position by position over `--max-new-tokens` slots (an answer that ends earlier holds nothing in the slots after).

Part 1, bf16 against fp32. The reference is stock `generate` (`DynamicCache`) on the fp32 model, each prompt alone.
The same prompts then run alone on stock and on paged `generate` (prefix caching off) with fp32 weights and with
the model cast to bfloat16. Free-running: answers and tokens that differ from the reference, and where they part.
Teacher-forced: each run fed the reference answer one token a step (a logits processor forces it, so the steps are
the ones `generate` runs), its raw logits compared with the reference's at every step: the share of steps whose
greedy token is the reference's, and the mean |logit - fp32 logit| over the vocabulary.

Part 2, answers after a cached prefix, for fp32 weights with `kv_dtype` "auto" (fp32 pages), "int8" and "int4",
and for bf16 weights with bf16 pages:
1. fresh: each prompt alone, the prefix cache cleared before each, and once more right after it (served its own
   cached prefix: the control, where the reused blocks hold what this prompt alone computes);
2. one batched call of all prompts (left-padded): their full blocks enter the prefix cache;
3. after: each prompt alone again, prefix caching on (its shared system-prompt blocks, and its own, now come from
   the batched call): answers and tokens that differ from fresh;
4. each prompt alone with `prefix_caching=False`, the batched call's blocks still cached: must equal fresh, logits
   bitwise.
Also: each prompt's K/V as the batched call stored them against the fresh call's (the share of token-head-layer
vectors, K and V, or their codes and scales, that differ; for unquantized pages the largest |difference|), the
batched call's answers against fresh, and the same for stock `DynamicCache` (its K/V after one prefill forward,
batched and alone): what float rounding alone does to stock. Last, the Engine with `prefix_caching=False` serving
all prompts together (one running batch, packed steps), against `generate` alone.

Usage: python benchmarks/exactness.py [--prompts 16] [--max-new-tokens 24]

On a machine whose cores are shared, `GOMP_SPINCOUNT=0` shortens the quantized runs a lot (the CPU kernel's OpenMP
threads otherwise spin and delay torch's own threads); it changes no number.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time

import torch
from common import environment, markdown_table
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

import hf_paged
from hf_paged.reference_models import load_smollm2

SYSTEM = (
    "You are a helpful assistant. Answer the user's question in one or two short sentences, plainly and "
    "accurately. If you are not sure, say so."
)
QUESTIONS = [  # tests/test_smollm2.py, tests/test_prefix.py and the README, then a few more of the kind
    "What is the capital of France?",
    "Write a haiku about memory pages.",
    "Explain beam search in one sentence.",
    "List three prime numbers.",
    "Name a prime number larger than 10.",
    "Why is the sky blue?",
    "Why is grass green?",
    "What is the capital of Italy?",
    "What colour is the sky?",
    "Name a fruit that is yellow.",
    "How many legs does a spider have?",
    "What does a CPU cache do?",
    "Translate 'good morning' into French.",
    "Give one tip for writing clear code.",
    "What is 12 times 7?",
    "Why do we sleep?",
]
FORMATS = ("auto", "int8", "int4")
NO_TOKEN = -1
REFERENCE = "stock `DynamicCache`, fp32 (the reference)"
BEGIN = time.perf_counter()


class ForceTokens(LogitsProcessor):
    """Greedy decoding forced onto `tokens`: step `t` can only pick `tokens[t]` (teacher forcing inside
    `generate`, so the forwards are the ones a free-running call makes)."""

    def __init__(self, tokens: list[int], prompt_length: int):
        self.tokens, self.prompt_length = tokens, prompt_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        forced = torch.full_like(scores, -float("inf"))
        forced[:, self.tokens[input_ids.shape[1] - self.prompt_length]] = 0.0
        return forced


def chat_prompts(tokenizer, count: int) -> list[torch.Tensor]:
    """`count` prompts (`[1, length]` ids): the shared system prompt, then one question each."""
    if count > len(QUESTIONS):
        raise SystemExit(f"--prompts: at most {len(QUESTIONS)}")
    return [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
        for question in QUESTIONS[:count]
    ]


def left_padded(prompts: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as one left-padded batch: `(input_ids, attention_mask)`."""
    width = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.shape[1] :], mask[row, width - prompt.shape[1] :] = prompt[0], 1
    return ids, mask


def run(model, ids, mask=None, *, max_new_tokens, paged=None, force=None, keep_cache=False):
    """Greedy `generate` on `ids`: stock (`paged=None`) or paged with `paged` as its `cache_config`. Returns
    `(answers, logits, cache)`: per row the new token ids (ended at the end-of-sequence token), the raw logits of
    row 0 (`[steps, vocab]`, fp32), and the kept `PagedCache` (`keep_cache`) or `None`."""
    options = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=model.generation_config.eos_token_id)
    options.update(return_dict_in_generate=True, output_logits=True)
    if paged is not None:
        options.update(cache_implementation="paged", cache_config=paged)
    if force is not None:
        options.update(
            max_new_tokens=len(force), logits_processor=LogitsProcessorList([ForceTokens(force, ids.shape[1])])
        )
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids) if mask is None else mask, **options)
    answers = [ended(row.tolist(), model.generation_config.eos_token_id) for row in out.sequences[:, ids.shape[1] :]]
    logits = torch.stack([step[0].float() for step in out.logits])
    cache = out.past_key_values if keep_cache else None
    if paged is not None and not keep_cache:
        out.past_key_values.release()
    return answers, logits, cache


def ended(tokens: list[int], eos) -> list[int]:
    """`tokens` up to and including the first end-of-sequence token."""
    stops = set(eos) if isinstance(eos, (list, tuple)) else {eos}
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[: i + 1]
    return tokens


def slots(answer: list[int], width: int) -> torch.Tensor:
    """`answer` in `width` slots, `NO_TOKEN` after its end."""
    return torch.tensor(answer[:width] + [NO_TOKEN] * (width - len(answer[:width])))


def compare(answers: list[list[int]], reference: list[list[int]], width: int) -> dict:
    """Answers and tokens (slot by slot) differing from `reference`, and the first differing slot of each answer
    that differs."""
    firsts, tokens = [], 0
    for answer, ref in zip(answers, reference):
        differs = slots(answer, width) != slots(ref, width)
        tokens += int(differs.sum())
        if differs.any():
            firsts.append(int(differs.int().argmax()))
    return {"answers": len(firsts), "tokens": tokens, "firsts": firsts}


def describe(result: dict, count: int, width: int) -> list[str]:
    """A `compare` result as table cells: answers, tokens and first differing slots."""
    firsts = ", ".join(str(f) for f in sorted(result["firsts"])) or "-"
    return [f"{result['answers']} of {count}", f"{result['tokens']} of {count * width}", firsts]


# ---------------------------------------------------------------------- part 1: bf16 against fp32
def teacher_forced(model, prompt, reference, free, free_logits, max_new_tokens, paged):
    """Raw logits of `model` fed `reference` a step at a time (the free-running logits when its answer is the
    reference already)."""
    if free == reference:
        return free_logits
    return run(model, prompt, max_new_tokens=max_new_tokens, paged=paged, force=reference)[1]


def setup_row(label, model, paged, prompts, reference, reference_logits, max_new_tokens) -> tuple[list, list]:
    """Part 1's row for one setup (`paged=None`: stock `generate`), and its free-running answers."""
    answers, agree, steps, deviation = [], 0, 0, []
    for prompt, ref, ref_logits in zip(prompts, reference, reference_logits):
        free, free_logits, _ = run(model, prompt, max_new_tokens=max_new_tokens, paged=paged)
        answers.append(free[0])
        logits = teacher_forced(model, prompt, ref, free[0], free_logits, max_new_tokens, paged)
        agree += int((logits.argmax(-1) == torch.tensor(ref)).sum())
        steps += len(ref)
        deviation.append((logits - ref_logits).abs().mean(-1))
    result = compare(answers, reference, max_new_tokens)
    row = [label] + describe(result, len(prompts), max_new_tokens)
    print(f"  {label}: done, {time.perf_counter() - BEGIN:.0f} s", file=sys.stderr, flush=True)
    return row + [f"{agree} of {steps}", f"{torch.cat(deviation).mean().item():.2e}"], answers


def bf16_rows(model, bf16_model, prompts, max_new_tokens) -> tuple[list[list], dict]:
    """Part 1's table rows and the free-running answers of each setup (the first: the fp32 reference itself)."""
    reference, reference_logits = [], []
    for prompt in prompts:
        answers, logits, _ = run(model, prompt, max_new_tokens=max_new_tokens)
        reference.append(answers[0])
        reference_logits.append(logits)
    steps = sum(len(ref) for ref in reference)
    label = REFERENCE
    rows = [[label] + describe(compare(reference, reference, max_new_tokens), len(prompts), max_new_tokens)]
    rows[0] += [f"{steps} of {steps}", "0"]
    answers_of = {label: reference}
    setups = {
        "paged, fp32 pages": (model, {"prefix_caching": False}),
        "stock `DynamicCache`, bf16": (bf16_model, None),
        "paged, bf16 pages": (bf16_model, {"prefix_caching": False}),
    }
    for label, (setup_model, paged) in setups.items():
        row, answers_of[label] = setup_row(
            label, setup_model, paged, prompts, reference, reference_logits, max_new_tokens
        )
        rows.append(row)
    return rows, answers_of


# ---------------------------------------------------------------------- part 2: answers after a cached prefix
def stored_kv(cache, row: int, length: int) -> torch.Tensor:
    """Row `row`'s first `length` tokens as the pool stores them, every layer: `[layers, length, heads, n]`, each
    token, head and layer one vector (its K and V, or their codes and scales), fp32."""
    storage, block_size = cache.pool.storage, cache.pool.block_size
    position = torch.arange(length)
    blocks = torch.tensor(cache.row_tables[row].block_ids)[position // block_size]
    offsets = position % block_size
    layers = []
    for layer in range(len(cache.layers)):
        lane = storage.lane_of(layer)
        parts = [storage.keys[lane][blocks, offsets].float(), storage.values[lane][blocks, offsets].float()]
        if storage.format.quantized:
            parts += [
                scales[lane][blocks, offsets].float()[..., None]
                for scales in (storage.key_scales, storage.value_scales)
            ]
        layers.append(torch.cat(parts, -1))
    return torch.stack(layers)


def kv_difference(batched: list[torch.Tensor], alone: list[torch.Tensor], quantized: bool) -> str:
    """Token-head-layer vectors of the prompts' stored K/V that differ, batched call against alone; for unquantized
    pages also the largest |difference|."""
    differing = total = 0
    largest = 0.0
    for b, a in zip(batched, alone):
        vectors = (b != a).any(-1)
        differing, total = differing + int(vectors.sum()), total + vectors.numel()
        largest = max(largest, (b - a).abs().max().item())
    return f"{differing / total:.1%}" + ("" if quantized else f" (max abs {largest:.1e})")


@dataclasses.dataclass
class Alone:
    """Each prompt answered alone: answers, row-0 logits, stored prompt K/V, prefix tokens reused (all calls), and
    the answers of a second call right after each (its own prefix cached)."""

    answers: list = dataclasses.field(default_factory=list)
    logits: list = dataclasses.field(default_factory=list)
    kvs: list = dataclasses.field(default_factory=list)
    reused: int = 0
    repeats: list = dataclasses.field(default_factory=list)


def alone(model, prompts, max_new_tokens, config, clear: bool, kv: bool = False, repeat: bool = False) -> Alone:
    """Each prompt answered alone (`cache_config=config`), the prefix cache cleared before each when `clear`; with
    `repeat`, answered once more right after (served the blocks its first call cached)."""
    out = Alone()
    for prompt in prompts:
        if clear:
            hf_paged.get_pool(model).clear_prefix_cache()
        result, step_logits, cache = run(model, prompt, max_new_tokens=max_new_tokens, paged=config, keep_cache=kv)
        if kv:
            out.kvs.append(stored_kv(cache, 0, prompt.shape[1]))
            cache.release()
        out.reused += hf_paged.get_pool(model).last_cache_stats.prefix_tokens_reused
        out.answers.append(result[0])
        out.logits.append(step_logits)
        if repeat:
            out.repeats.append(run(model, prompt, max_new_tokens=max_new_tokens, paged=config)[0][0])
    return out


def history_row(model, prompts, kv_dtype, max_new_tokens, pad_id, label) -> tuple[list, list[list[int]]]:
    """Part 2 for one page format: the table row (labelled `label`), and the fresh answers."""
    config, count, width = {"kv_dtype": kv_dtype}, len(prompts), max_new_tokens
    hf_paged.release_pool(model)
    fresh = alone(model, prompts, width, config, clear=True, kv=True, repeat=True)
    hf_paged.get_pool(model).clear_prefix_cache()
    ids, mask = left_padded(prompts, pad_id)
    batched, _, cache = run(model, ids, mask, max_new_tokens=width, paged=config, keep_cache=True)
    batched_kv = [stored_kv(cache, row, p.shape[1]) for row, p in enumerate(prompts)]
    cache.release()
    after = alone(model, prompts, width, config, clear=False)
    unshared = alone(model, prompts, width, {**config, "prefix_caching": False}, clear=False)
    logits_equal = all(torch.equal(a, b) for a, b in zip(fresh.logits, unshared.logits))
    changed = compare(after.answers, fresh.answers, width)
    off = compare(unshared.answers, fresh.answers, width)
    return [
        label,
        kv_difference(batched_kv, fresh.kvs, kv_dtype != "auto"),
        f"{compare(batched, fresh.answers, width)['answers']} of {count}",
        f"{compare(fresh.repeats, fresh.answers, width)['answers']} of {count}",
        f"{after.reused / count:.0f}",
        f"**{changed['answers']} of {count}**",
        f"{changed['tokens']} of {count * width}",
        f"{off['answers']} of {count} (logits {'bitwise equal' if logits_equal else 'differ'})",
    ], fresh.answers


def stock_prompt_kv(model, ids, mask) -> list[torch.Tensor]:
    """Each row's prompt K/V after one stock prefill forward (`DynamicCache`, positions from the mask), laid out as
    `stored_kv`: `[layers, length, heads, 2 * head_dim]`."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        model(input_ids=ids, attention_mask=mask, position_ids=position_ids, past_key_values=cache, use_cache=True)
    rows = []
    for row, length in enumerate(mask.sum(-1).tolist()):
        layers = [
            torch.cat([layer.keys[row, :, -length:], layer.values[row, :, -length:]], -1) for layer in cache.layers
        ]
        rows.append(torch.stack(layers).transpose(1, 2))
    return rows


def stock_row(model, prompts, reference, max_new_tokens, pad_id, label) -> list:
    """Stock `DynamicCache` in fp32: the batched call's prompt K/V and answers against each prompt's alone
    (`reference`)."""
    ids, mask = left_padded(prompts, pad_id)
    alone_kv = [stock_prompt_kv(model, p, torch.ones_like(p))[0] for p in prompts]
    difference = kv_difference(stock_prompt_kv(model, ids, mask), alone_kv, quantized=False)
    batched = run(model, ids, mask, max_new_tokens=max_new_tokens)[0]
    result = compare(batched, reference, max_new_tokens)
    return [label, difference, f"{result['answers']} of {len(prompts)}"] + ["-"] * 5


def engine_row(model, prompts, kv_dtype, max_new_tokens, fresh, label) -> list:
    """The Engine with `prefix_caching=False` serving all prompts together (one running batch, packed steps),
    against `generate` alone (`fresh`)."""
    hf_paged.release_pool(model)
    engine = hf_paged.Engine(model, kv_dtype=kv_dtype, prefix_caching=False, exact=True)
    outputs = engine.generate(
        [prompt[0].tolist() for prompt in prompts], max_new_tokens=max_new_tokens, do_sample=False
    )
    result = compare([output.token_ids for output in outputs], fresh, max_new_tokens)
    return [
        label,
        f"{result['answers']} of {len(prompts)}",
        f"{result['tokens']} of {len(prompts) * max_new_tokens}",
    ]


def history_tables(model, bf16_model, prompts, answers_of, max_new_tokens, pad_id) -> tuple[list, list]:
    """Part 2's rows: stock and every page format with fp32 weights, stock and bf16 pages with bf16 weights; and
    the Engine's rows."""
    history, engine = [], []
    setups = (
        (model, "fp32", answers_of[REFERENCE], FORMATS),
        (bf16_model, "bf16", answers_of["stock `DynamicCache`, bf16"], ("auto",)),
    )
    for setup_model, dtype, reference, formats in setups:
        label = f"stock `DynamicCache`, {dtype} weights (no pages)"
        history.append(stock_row(setup_model, prompts, reference, max_new_tokens, pad_id, label))
        for kv_dtype in formats:
            label = f"{dtype if kv_dtype == 'auto' else kv_dtype} pages, {dtype} weights"
            row, fresh = history_row(setup_model, prompts, kv_dtype, max_new_tokens, pad_id, label)
            history.append(row)
            engine.append(engine_row(setup_model, prompts, kv_dtype, max_new_tokens, fresh, label))
            print(f"  {label}: done, {time.perf_counter() - BEGIN:.0f} s", file=sys.stderr, flush=True)
    return history, engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=len(QUESTIONS), help=f"chat prompts (at most {len(QUESTIONS)})")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="greedy tokens per answer")
    args = parser.parse_args()
    model, tokenizer = load_smollm2()
    prompts = chat_prompts(tokenizer, args.prompts)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    count, width = len(prompts), args.max_new_tokens

    bf16_model = copy.deepcopy(model).to(torch.bfloat16)
    rows, answers_of = bf16_rows(model, bf16_model, prompts, width)
    pair = compare(answers_of["paged, bf16 pages"], answers_of["stock `DynamicCache`, bf16"], width)
    history, engine = history_tables(model, bf16_model, prompts, answers_of, width, pad_id)

    command = " ".join(["python", "benchmarks/exactness.py"] + sys.argv[1:])
    lengths = f"{min(p.shape[1] for p in prompts)}-{max(p.shape[1] for p in prompts)}"
    print(f"`{command}` ({environment()}; {time.perf_counter() - BEGIN:.0f} s): SmolLM2-135M-Instruct, {count} chat")
    print(f"prompts of {lengths} tokens sharing a system prompt, {width} greedy tokens each.\n")
    print("### bf16 and fp32 against the fp32 reference (stock `DynamicCache`, fp32 weights)\n")
    headers = [
        "run",
        "answers differing",
        "tokens differing",
        "first differing token",
        "teacher-forced: greedy token = fp32's",
        "mean abs(logit - fp32 logit)",
    ]
    print(markdown_table(headers, rows) + "\n")
    print(
        f"paged bf16 against stock bf16: {pair['answers']} of {count} answers, {pair['tokens']} of {count * width}"
        " tokens differ.\n"
    )
    print("### Answers after a batched call cached their prefix (greedy)\n")
    headers = [
        "pages",
        "prompt K/V as stored, batched vs alone: vectors differing",
        "batched answers differing from alone",
        "answers alone right after the same prompt alone differing from fresh",
        "prefix tokens reused per answer after the batched call",
        "answers alone after the batched call differing from fresh",
        "tokens differing",
        "`prefix_caching=False` after the batched call differing from fresh",
    ]
    print(markdown_table(headers, history) + "\n")
    print("### The Engine (`prefix_caching=False`) serving all prompts together, against `generate` alone\n")
    headers = ["pages", "answers differing", "tokens differing"]
    print(markdown_table(headers, engine))


if __name__ == "__main__":
    main()
