"""Fine-tune two LoRA adapters on one base model, then serve both and the base from one `hf-paged serve` process.

The two adapters learn different answers to the same prompts (a sentence about a person): `json` answers one line
of JSON with the keys `person`, `age` and `city`; `greet` answers `Hello <person> from <city>!`. The stages:

1. build the training and held-out sentences (synthetic, from a seed; the held-out names and cities never appear in
   training);
2. for each adapter: wrap the base model with PEFT LoRA, train `--steps` steps on its answers, write the stock
   reference answers (PEFT `generate` with that adapter alone, `DynamicCache`), save the adapter
   (`save_pretrained`: `adapter_config.json` + `adapter_model.safetensors`) and take the LoRA layers out again, so
   the next adapter starts from the same base;
3. serve: `hf-paged serve BASE --lora json=DIR --lora greet=DIR` in one process, and ask the held-out prompts of
   the base model and of each adapter with the `openai` client (`model="json"` picks the adapter); the requests of
   the three models run in the same engine steps.

Run:

    python examples/serve_many_adapters.py            # SmolLM2-135M-Instruct, 12 steps per adapter: a few minutes
    python examples/serve_many_adapters.py --tiny     # a tiny random Llama with a character tokenizer: seconds
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from finetune_then_serve import (  # noqa: E402 - the sibling example, importable from this folder
    CITIES,
    NAMES,
    NUM_HELD_OUT,
    SENTENCES,
    Example,
    chat_prompt,
    load_base_model,
    train,
)

from hf_paged.reference_models import smollm2_path  # noqa: E402

TASKS = {
    "json": lambda person, age, city: f'{{"person": "{person}", "age": {age}, "city": "{city}"}}',
    "greet": lambda person, age, city: f"Hello {person} from {city}!",
}
BASE_NAME = "base"


@dataclass
class Report:
    """What `main` produced, for tests: per served model (`base`, `json`, `greet`), the server's answers to the
    held-out prompts, and per adapter the stock reference answers and the training losses."""

    held_out: list[str]
    served: dict[str, list[str]]
    reference: dict[str, list[str]]
    losses: dict[str, list[float]]
    models: list[dict]
    seconds: dict[str, float] = field(default_factory=dict)


def build_sentences(seed: int, count: int) -> tuple[list[tuple], list[tuple]]:
    """`(train, held_out)` as `(sentence, person, age, city)`."""
    rng = random.Random(seed)
    names, cities = NAMES[:-NUM_HELD_OUT], CITIES[:-NUM_HELD_OUT]

    def person(name, city, template):
        age = rng.randint(18, 90)
        return template.format(person=name, age=age, city=city), name, age, city

    train_set = [person(rng.choice(names), rng.choice(cities), rng.choice(SENTENCES)) for _ in range(count)]
    held_out = [
        person(name, city, SENTENCES[i % len(SENTENCES)])
        for i, (name, city) in enumerate(zip(NAMES[-NUM_HELD_OUT:], CITIES[-NUM_HELD_OUT:]))
    ]
    return train_set, held_out


def stock_answers(model, tokenizer, sentences: list[str], max_new_tokens: int) -> list[str]:
    """Greedy answers of `model` as it is (PEFT with one adapter active), each prompt alone, on `DynamicCache`."""
    answers = []
    for sentence in sentences:
        ids = tokenizer(chat_prompt(tokenizer, sentence), add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(input_ids=ids, max_new_tokens=max_new_tokens, do_sample=False)
        answers.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return answers


def train_adapter(base, tokenizer, name: str, train_set, held_out, args) -> tuple[Path, list[float], list[str]]:
    """Train adapter `name` on `base`, save it; returns its folder, the step losses and its reference answers.
    `base` is left without LoRA layers."""
    config = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM"
    )
    model = get_peft_model(base, config)
    examples = [Example(sentence, TASKS[name](*person)) for sentence, *person in train_set]
    torch.manual_seed(args.seed)
    losses = train(model, tokenizer, examples, args.steps, args.lr, args.batch_size, args.seed)
    reference = stock_answers(model, tokenizer, [s for s, *_ in held_out], args.max_new_tokens)
    folder = args.output_dir / name
    model.save_pretrained(folder)
    model.unload()  # the LoRA layers out, the base weights as they were
    return folder, losses, reference


def save_base(base, tokenizer, tiny: bool, output_dir: Path) -> Path:
    """A folder `hf-paged serve` loads the base model from (SmolLM2's converted copy, or the tiny model saved)."""
    if not tiny:
        return smollm2_path()
    folder = output_dir / "base"
    base.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(base_dir: Path, adapters: dict[str, Path], timeout_s: float = 300) -> tuple[subprocess.Popen, str]:
    """`hf-paged serve` (as `python -m hf_paged.serve`) on a free loopback port; returns it and its URL."""
    import httpx

    port = free_port()
    command = [sys.executable, "-m", "hf_paged.serve", "serve", str(base_dir), "--served-model-name", BASE_NAME]
    command += ["--port", str(port), "--num-blocks", "256", "--log-level", "warning"]
    command += ["--exact"]  # a few prompts: eager steps, bit-exact with generate (compiling would take a minute)
    for name, folder in adapters.items():
        command += ["--lora", f"{name}={folder}"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited: {server.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return server, url
        except httpx.HTTPError:
            time.sleep(0.3)
    server.kill()
    raise RuntimeError(f"the server did not come up within {timeout_s} s")


def ask_all(url: str, models: list[str], sentences: list[str], max_tokens: int) -> dict[str, list[str]]:
    """Every sentence to every model at once (one thread per request, so they share engine steps)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    answers = {model: [None] * len(sentences) for model in models}

    def ask(model: str, index: int) -> None:
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": sentences[index]}],
            max_tokens=max_tokens,
            temperature=0,
        )
        answers[model][index] = reply.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(m, i)) for m in models for i in range(len(sentences))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2-135M-Instruct")
    parser.add_argument("--steps", type=int, default=12, help="training steps per adapter (default: 12)")
    parser.add_argument("--batch-size", type=int, default=8, help="examples per training step (default: 8)")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: 2e-3, or 1e-2 with --tiny)")
    parser.add_argument("--output-dir", type=Path, default=Path("many-adapters"), help="where adapters are saved")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="tokens per answer (default: 24)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "max_new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.lr is None:
        args.lr = 1e-2 if args.tiny else 2e-3
    return args


def main(argv: list[str] | None = None) -> Report:
    args = parse_args(argv)
    seconds = {}
    clock = time.perf_counter()
    base, tokenizer = load_base_model(args.tiny, args.seed)
    train_set, held_out = build_sentences(args.seed, count=48)
    sentences = [sentence for sentence, *_ in held_out]
    folders, losses, reference = {}, {}, {}
    for name in TASKS:
        folders[name], losses[name], reference[name] = train_adapter(base, tokenizer, name, train_set, held_out, args)
        print(f"adapter {name!r}: loss {losses[name][0]:.3f} -> {losses[name][-1]:.3f}, saved to {folders[name]}")
    base_dir = save_base(base, tokenizer, args.tiny, args.output_dir)
    seconds["train"] = time.perf_counter() - clock

    clock = time.perf_counter()
    server, url = start_server(base_dir, folders)
    try:
        import httpx

        models = httpx.get(f"{url}/v1/models").json()["data"]
        print("served models: " + ", ".join(f"{m['id']} (parent {m['parent']})" for m in models))
        served = ask_all(url, [BASE_NAME, *TASKS], sentences, args.max_new_tokens)
    finally:
        server.terminate()
        server.wait(timeout=60)
    seconds["serve"] = time.perf_counter() - clock

    for index, sentence in enumerate(sentences):
        print(f"\n{sentence}")
        for model, answers in served.items():
            same = ""
            if model != BASE_NAME:
                equal = answers[index] == reference[model][index]
                same = "  (= PEFT generate)" if equal else "  (differs from PEFT generate)"
            print(f"  {model:>5}: {answers[index]!r}{same}")
    print("\nseconds: " + ", ".join(f"{stage} {value:.1f}" for stage, value in seconds.items()))
    return Report(sentences, served, reference, losses, models, seconds)


if __name__ == "__main__":
    main(sys.argv[1:])
