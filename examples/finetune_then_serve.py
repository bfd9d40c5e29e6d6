"""Fine-tune a model with LoRA, merge the adapter, save it, reload it and serve it with paged batch generation.

The task is small and checkable: turn a sentence about a person into one line of JSON with the keys `person`, `age`
and `city` (SmolLM2-135M-Instruct already writes JSON, but says `name`, spreads it over several lines and keeps
talking; a few dozen examples teach it the schema and to stop). The stages:

1. build the training and held-out examples (synthetic, from a seed);
2. wrap the model with a PEFT LoRA adapter and answer the held-out prompts with paged generation (the baseline);
3. fine-tune for `--steps` steps (training runs right after a paged `generate`: the attention implementation that
   paged generation switches to is restored when `generate` returns);
4. merge the adapter into the weights and save the model with its tokenizer (safetensors);
5. serve: reload the folder with `AutoModelForCausalLM.from_pretrained` and answer the held-out prompts with
   `generate(..., cache_implementation="paged")`, printing the answers and the block pool's statistics.

Run:

    python examples/finetune_then_serve.py                # SmolLM2-135M-Instruct: a few minutes on a CPU
    python examples/finetune_then_serve.py --tiny         # a tiny random Llama with a character tokenizer: seconds
"""

from __future__ import annotations

import argparse
import random
import string
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer, decoders, models
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

import hf_paged
from hf_paged.reference_models import load_smollm2, tiny_model

INSTRUCTION = "Extract the person as JSON: "
NAMES = [
    "Alice", "Bruno", "Chen", "Dmitri", "Elena", "Farah", "Goran", "Hana", "Ivan", "Julia", "Kofi", "Lena",
    "Mateo", "Nadia", "Oscar", "Priya", "Rosa", "Sven", "Tara", "Umar", "Anna", "David", "Maria", "Tom",
]  # fmt: skip
CITIES = [
    "Paris", "Lisbon", "Osaka", "Nairobi", "Toronto", "Oslo", "Lima", "Cairo", "Seoul", "Dublin", "Quito", "Hanoi",
    "Vienna", "Accra", "Denver", "Perth", "Riga", "Tunis", "Porto", "Bergen", "Berlin", "Madrid", "Rome", "Boston",
]  # fmt: skip
SENTENCES = [
    "{person} is {age} years old and lives in {city}.",
    "Meet {person}, {age}, from {city}.",
    "{person} ({age}) moved to {city} last year.",
    "Born {age} years ago, {person} now calls {city} home.",
    "In {city}, {person} just turned {age}.",
]
NUM_TRAIN = 48
NUM_HELD_OUT = 4  # the last names and cities never appear in training
ATTENTION_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class Example:
    """One instruction and the answer the fine-tuned model should give."""

    instruction: str
    answer: str


@dataclass
class ServeResult:
    """What the serve stage produced: one answer per prompt and the block pool's accounting."""

    answers: list[str]
    pool_stats: hf_paged.AllocatorStats
    cache_stats: hf_paged.CacheStats | None
    seconds: float
    engine_answers: list[str] | None = None
    engine_stats: hf_paged.EngineStats | None = None


@dataclass
class Report:
    """Everything `main` measured, for tests and notebooks."""

    output_dir: Path
    step_losses: list[float]
    loss_before: float
    loss_after: float
    held_out: list[Example]
    baseline_answers: list[str]
    attention_before_generate: str
    attention_after_generate: str
    served: ServeResult
    seconds: dict[str, float] = field(default_factory=dict)


# ---------------------------------------------------------------------- data
def make_example(person: str, age: int, city: str, sentence: str) -> Example:
    answer = f'{{"person": "{person}", "age": {age}, "city": "{city}"}}'
    return Example(INSTRUCTION + sentence.format(person=person, age=age, city=city), answer)


def build_examples(seed: int, num_train: int = NUM_TRAIN) -> tuple[list[Example], list[Example]]:
    """`(train, held_out)`: `num_train` examples drawn from the first names and cities, and one held-out example for
    each of the last `NUM_HELD_OUT` names (with unseen cities)."""
    rng = random.Random(seed)
    names, cities = NAMES[:-NUM_HELD_OUT], CITIES[:-NUM_HELD_OUT]
    train = [
        make_example(rng.choice(names), rng.randint(18, 90), rng.choice(cities), rng.choice(SENTENCES))
        for _ in range(num_train)
    ]
    held_out = [
        make_example(person, rng.randint(18, 90), city, SENTENCES[i % len(SENTENCES)])
        for i, (person, city) in enumerate(zip(NAMES[-NUM_HELD_OUT:], CITIES[-NUM_HELD_OUT:]))
    ]
    return train, held_out


def exact_matches(answers: list[str], examples: list[Example]) -> int:
    return sum(answer.strip() == example.answer for answer, example in zip(answers, examples))


# ---------------------------------------------------------------------- models
def char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level chat tokenizer built offline: ids 0-2 are `<pad>`, `<|im_start|>` and `<|im_end|>` (the
    tiny models' pad, bos and eos ids), then printable ASCII and newline, one id per character."""
    specials = ["<pad>", "<|im_start|>", "<|im_end|>"]
    characters = sorted(set(string.printable) - set("\t\r\x0b\x0c"))
    vocab = {token: i for i, token in enumerate(specials + characters)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: every character is a token
    core.add_special_tokens(specials)
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def load_base_model(tiny: bool, seed: int):
    """`(model, tokenizer)`: SmolLM2-135M-Instruct, or a tiny random Llama sized to the character tokenizer."""
    if not tiny:
        return load_smollm2()
    tokenizer = char_tokenizer()
    model = tiny_model("llama", seed=seed, vocab_size=len(tokenizer), max_position_embeddings=512)
    return model, tokenizer


def add_lora(model, rank: int = 8):
    """Wrap `model` with a LoRA adapter on the attention projections (the base weights are frozen)."""
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=ATTENTION_PROJECTIONS, task_type="CAUSAL_LM"
    )
    return get_peft_model(model, config)


# ---------------------------------------------------------------------- training
def chat_prompt(tokenizer, instruction: str) -> str:
    messages = [{"role": "user", "content": instruction}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_batch(tokenizer, examples: list[Example]) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids`, `attention_mask` and `labels`; only the answer and its end-of-turn token are
    learned (prompt and padding labels are -100). The prompt is tokenized exactly as the serve stage tokenizes it."""
    rows = []
    for example in examples:
        prompt = tokenizer(chat_prompt(tokenizer, example.instruction), add_special_tokens=False)["input_ids"]
        answer = tokenizer(example.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((prompt + answer, [-100] * len(prompt) + answer))
    width = max(len(ids) for ids, _ in rows)
    batch = {
        "input_ids": torch.full((len(rows), width), tokenizer.pad_token_id),
        "attention_mask": torch.zeros((len(rows), width), dtype=torch.long),
        "labels": torch.full((len(rows), width), -100),
    }
    for i, (ids, labels) in enumerate(rows):
        batch["input_ids"][i, : len(ids)] = torch.tensor(ids)
        batch["attention_mask"][i, : len(ids)] = 1
        batch["labels"][i, : len(ids)] = torch.tensor(labels)
    return batch


def batches(examples: list[Example], batch_size: int, seed: int):
    """Shuffled mini-batches, epoch after epoch, forever (an epoch's last incomplete batch is dropped)."""
    if not 1 <= batch_size <= len(examples):
        raise ValueError(f"batch_size must be between 1 and the {len(examples)} examples, got {batch_size}")
    rng = random.Random(seed)
    while True:
        order = list(examples)
        rng.shuffle(order)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield order[start : start + batch_size]


@torch.no_grad()
def mean_loss(model, tokenizer, examples: list[Example], batch_size: int = 16) -> float:
    """Teacher-forced loss per answer token over `examples`, in eval mode."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(examples), batch_size):
        batch = encode_batch(tokenizer, examples[start : start + batch_size])
        num_tokens = int((batch["labels"][:, 1:] != -100).sum())
        total += model(**batch).loss.item() * num_tokens
        count += num_tokens
    return total / count


def train(
    model,
    tokenizer,
    examples: list[Example],
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    progress_bar: bool = True,
) -> list[float]:
    """`steps` AdamW steps on the trainable (LoRA) parameters; returns the loss of every step.

    `progress_bar=False` hides the progress bar (in a notebook, whose stored outputs would keep every frame of it).
    """
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    steps_and_batches = zip(range(steps), batches(examples, batch_size, seed))
    progress = tqdm(steps_and_batches, total=steps, desc="fine-tuning", disable=not progress_bar)
    for _, chunk in progress:
        loss = model(**encode_batch(tokenizer, chunk)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        progress.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses


# ---------------------------------------------------------------------- generation and serving
def paged_answers(model, tokenizer, instructions: list[str], max_new_tokens: int, **generate_kwargs) -> list[str]:
    """Greedy answers to `instructions` as one left-padded batch, on a paged KV cache by default."""
    prompts = [chat_prompt(tokenizer, instruction) for instruction in instructions]
    inputs = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    generate_kwargs.setdefault("cache_implementation", "paged")
    model.eval()
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **generate_kwargs)
    return tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def merge_and_save(peft_model, tokenizer, output_dir: Path):
    """Fold the adapter into the base weights and save model and tokenizer (transformers 5 writes safetensors)."""
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return merged


def serve(model_dir: Path, instructions: list[str], max_new_tokens: int, block_size: int = 16) -> ServeResult:
    """Reload the saved model and answer `instructions` twice: as one paged `generate` batch, and as requests of the
    continuous-batching `hf_paged.Engine` (what `hf-paged serve` runs behind its HTTP API)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    start = time.perf_counter()
    answers = paged_answers(model, tokenizer, instructions, max_new_tokens, cache_config={"block_size": block_size})
    seconds = time.perf_counter() - start
    pool = hf_paged.get_pool(model)
    served = ServeResult(answers, pool.stats(), pool.last_cache_stats, seconds)
    with hf_paged.Engine(model, tokenizer, block_size=block_size) as engine:
        prompts = [chat_prompt(tokenizer, instruction) for instruction in instructions]
        outputs = engine.generate(prompts, max_new_tokens=max_new_tokens, do_sample=False)
        served.engine_answers = [output.text for output in outputs]
        served.engine_stats = engine.last_stats
    return served


# ---------------------------------------------------------------------- command line
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2-135M-Instruct")
    parser.add_argument("--steps", type=int, default=16, help="training steps (default: 16)")
    parser.add_argument("--batch-size", type=int, default=8, help="examples per training step (default: 8)")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: 1e-3, or 1e-2 with --tiny)")
    parser.add_argument("--output-dir", type=Path, default=None, help="where to save the merged model")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per answer (default: 32)")
    parser.add_argument("--seed", type=int, default=0, help="seed for data, initial weights and shuffling")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "max_new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.batch_size > NUM_TRAIN:
        parser.error(f"--batch-size must be at most {NUM_TRAIN} (the training examples), got {args.batch_size}")
    if args.lr is None:
        args.lr = 1e-2 if args.tiny else 1e-3
    if args.lr <= 0:
        parser.error(f"--lr must be positive, got {args.lr}")
    if args.output_dir is None:
        args.output_dir = Path("finetuned-tiny-llama" if args.tiny else "finetuned-smollm2")
    return args


def print_answers(title: str, answers: list[str], examples: list[Example]) -> None:
    print(f"\n{title} ({exact_matches(answers, examples)}/{len(examples)} exact):")
    for answer, example in zip(answers, examples):
        mark = "ok " if answer.strip() == example.answer else "   "
        print(f"  {mark}{example.instruction[len(INSTRUCTION) :]!r}\n      -> {answer.strip()!r}")


def describe_pool(served: ServeResult) -> str:
    pool, cache = served.pool_stats, served.cache_stats
    lines = [
        f"pool: {pool.num_blocks:,} blocks of {pool.block_size} tokens; peak {pool.peak_used} in use, "
        f"{pool.num_used} in use now, {pool.num_cached} full prompt blocks kept in the prefix cache",
    ]
    if cache is not None:
        lines.append(
            f"batch: {cache.num_rows} rows ended with {cache.tokens_stored} tokens in {cache.num_blocks} blocks "
            f"({cache.num_blocks * cache.block_size - cache.tokens_stored} slots unused, pads not stored), "
            f"generated in {served.seconds:.1f} s"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Report:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    seconds = {}
    clock = time.perf_counter()
    model, tokenizer = load_base_model(args.tiny, args.seed)
    train_set, held_out = build_examples(args.seed)
    instructions = [example.instruction for example in held_out]
    peft_model = add_lora(model)
    seconds["load"] = time.perf_counter() - clock

    clock = time.perf_counter()
    attention_before = model.config._attn_implementation
    baseline = paged_answers(peft_model, tokenizer, instructions, args.max_new_tokens)
    attention_after = model.config._attn_implementation
    print_answers("Before fine-tuning (paged generation)", baseline, held_out)
    print(f"attention implementation: {attention_before!r} before paged generate, {attention_after!r} after")
    seconds["baseline"] = time.perf_counter() - clock

    clock = time.perf_counter()
    loss_before = mean_loss(peft_model, tokenizer, train_set)
    step_losses = train(peft_model, tokenizer, train_set, args.steps, args.lr, args.batch_size, args.seed)
    loss_after = mean_loss(peft_model, tokenizer, train_set)
    # The weights changed: blocks cached before training are never reused (their namespace holds the weights'
    # version); dropping them now just returns their memory sooner.
    hf_paged.get_pool(model).clear_prefix_cache()
    print(f"\ntraining loss per answer token: {loss_before:.3f} -> {loss_after:.3f} ({args.steps} steps)")
    seconds["train"] = time.perf_counter() - clock

    clock = time.perf_counter()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    merge_and_save(peft_model, tokenizer, args.output_dir)
    saved = sorted(path.name for path in args.output_dir.iterdir())
    print(f"saved merged model to {args.output_dir}: {', '.join(saved)}")
    seconds["merge_and_save"] = time.perf_counter() - clock

    clock = time.perf_counter()
    served = serve(args.output_dir, instructions, args.max_new_tokens)
    print_answers("After fine-tuning, reloaded and served (paged generation)", served.answers, held_out)
    print(describe_pool(served))
    engine = served.engine_stats
    print(
        f"Engine: the same {engine.num_requests} prompts as continuous-batching requests, "
        f"{'the same' if served.engine_answers == served.answers else 'DIFFERENT'} answers, "
        f"{engine.tokens_per_s:.0f} tokens/s; serve it over HTTP with: hf-paged serve {args.output_dir}"
    )
    seconds["serve"] = time.perf_counter() - clock

    print("\nseconds: " + ", ".join(f"{stage} {value:.1f}" for stage, value in seconds.items()))
    return Report(
        output_dir=args.output_dir,
        step_losses=step_losses,
        loss_before=loss_before,
        loss_after=loss_after,
        held_out=held_out,
        baseline_answers=baseline,
        attention_before_generate=attention_before,
        attention_after_generate=attention_after,
        served=served,
        seconds=seconds,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
