"""Structured outputs on SmolLM2-135M (fp32): how often replies are valid with and without a JSON schema, and what
the token masks cost the Engine.

Quality: `--quality-prompts` chat prompts asking for a person (name, age, city) as a JSON object, greedy, at most 80
new tokens, in one `generate` of the Engine, once free and once with OpenAI's `response_format` json_schema; a reply
counts as valid when `json.loads` reads its whole text and it validates against the schema (jsonschema).

Overhead: `--requests` prompts of the engine benchmark's workload, each generating exactly `--new-tokens` tokens
(`min_new_tokens` = `max_new_tokens`), run free and with every request constrained by a schema that cannot end
within that many tokens (an array of at least 1,000 such persons), so both runs do the same steps over the same
batches; the runs take turns `--repeats` times. Reported: tokens/s of each, their ratio, and the time the sampler
spends masking (xgrammar's bitmask fill, the bias added to the logits, and advancing the matchers) per step.

Usage: python benchmarks/structured_outputs.py [--requests 64] [--new-tokens 64] [--repeats 3] [--exact]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jsonschema
from common import environment, markdown_table
from engine_throughput import workload

import hf_paged
import hf_paged.engine.engine as engine_module
import hf_paged.engine.sampler as sampler
from hf_paged.reference_models import load_smollm2

NAME = {"type": "string", "maxLength": 40}
PERSON = {
    "type": "object",
    "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "city": NAME},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PEOPLE = {"type": "array", "items": PERSON, "minItems": 1000}
JOBS = ["teacher", "pilot", "baker", "nurse", "farmer", "painter", "chef", "doctor", "singer", "writer", "plumber",
        "dancer", "lawyer", "sailor", "poet", "driver", "tailor", "miner", "judge", "actor", "potter", "clerk",
        "banker", "guard", "monk", "coach", "vet", "pianist", "barber", "welder"]  # fmt: skip


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}


def is_valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), PERSON)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def quality(engine, tokenizer, count: int) -> list[list]:
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Invent a {job} and give their name, age and city as a JSON object."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for job in (JOBS * (count // len(JOBS) + 1))[:count]
    ]
    rows = []
    for label, schema in (("free", None), ("json_schema", PERSON)):
        options = {} if schema is None else {"response_format": response_format(schema)}
        outputs = engine.generate(prompts, max_new_tokens=80, **options)
        valid = sum(is_valid(output.text) for output in outputs)
        stopped = sum(output.finish_reason == "stop" for output in outputs)
        example = outputs[0].text.replace("\n", "\\n")[:70]
        rows.append([label, f"{valid}/{count}", f"{stopped}/{count}", f"`{example}`"])
    return rows


class MaskTimer:
    """Seconds spent in `mask_logits` (bitmask fill and apply) and in advancing the matchers (`accept_all`)."""

    def __init__(self):
        self.seconds = 0.0
        self._mask = sampler.mask_logits
        self._accept = engine_module.accept_all
        timer = self

        def timed_mask(*args):
            start = time.perf_counter()
            try:
                return timer._mask(*args)
            finally:
                timer.seconds += time.perf_counter() - start

        def timed_accept(constraints, tokens):
            start = time.perf_counter()
            try:
                return timer._accept(constraints, tokens)
            finally:
                timer.seconds += time.perf_counter() - start

        sampler.mask_logits = timed_mask
        engine_module.accept_all = timed_accept


def overhead(engine, vocab_size: int, count: int, new_tokens: int, repeats: int) -> tuple[list, dict]:
    prompts = [prompt for prompt, _ in workload(count, 0.25, new_tokens, vocab_size)]
    params = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens}
    timer = MaskTimer()
    runs = {"free": [], "json_schema": []}
    mask_seconds, steps = [], []
    engine.generate(prompts[:8], max_new_tokens=4)  # warm-up (compiles, when the engine's steps compile)
    engine.generate(prompts[:8], max_new_tokens=4, response_format=response_format(PEOPLE))
    for _ in range(repeats):
        for label in runs:
            options = {} if label == "free" else {"response_format": response_format(PEOPLE)}
            timer.seconds = 0.0
            start = time.perf_counter()
            outputs = engine.generate(prompts, **params, **options)
            wall = time.perf_counter() - start
            tokens = sum(len(output.token_ids) for output in outputs)
            assert tokens == count * new_tokens, (label, tokens)
            runs[label].append(tokens / wall)
            if label == "json_schema":
                mask_seconds.append(timer.seconds)
                steps.append(engine.last_stats.num_steps)
    free, constrained = statistics.median(runs["free"]), statistics.median(runs["json_schema"])
    rows = [
        ["free", f"{free:.0f}", "1.00x", "-"],
        ["json_schema (every request)", f"{constrained:.0f}", f"{constrained / free:.2f}x",
         f"{1000 * statistics.median(m / s for m, s in zip(mask_seconds, steps)):.2f}"],
    ]  # fmt: skip
    return rows, {"runs": runs, "tokens": count * new_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quality-prompts", type=int, default=20)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--exact", action="store_true", help="eager steps (the Engine's default compiles them)")
    args = parser.parse_args()
    model, tokenizer = load_smollm2()
    engine = hf_paged.Engine(model, tokenizer, progress=False, exact=args.exact)
    print(f"SmolLM2-135M (fp32); {environment()}; Engine {'exact (eager)' if args.exact else 'defaults'}; xgrammar")
    print()
    print(markdown_table(["output", "valid (parse + schema)", "ended by itself", "first reply"],
                         quality(engine, tokenizer, args.quality_prompts)))  # fmt: skip
    print()
    rows, raw = overhead(engine, model.config.vocab_size, args.requests, args.new_tokens, args.repeats)
    print(f"{args.requests} requests x {args.new_tokens} tokens, median of {args.repeats} runs each (taking turns)")
    print(markdown_table(["requests", "tokens/s", "vs free", "masking ms / step"], rows))
    print("tokens/s of every run:", {k: [round(v) for v in runs] for k, runs in raw["runs"].items()})


if __name__ == "__main__":
    main()
