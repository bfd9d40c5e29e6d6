"""PagedCache as a transformers Cache: row tables, padding, row operations, release and the finalizer."""

from __future__ import annotations

import gc
import re

import pytest
import torch
from transformers import DynamicCache

import hf_paged
from hf_paged import PagedCache, get_pool
from hf_paged.reference_models import tiny_model

from .conftest import left_padded_batch


@pytest.fixture
def model():
    return tiny_model("llama")


def prefill(model, cache, input_ids, attention_mask=None):
    with torch.no_grad():
        return model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)


def test_prefill_stores_only_real_tokens_and_reports_the_padded_length(model):
    cache = PagedCache(model, block_size=4, num_blocks=32)
    input_ids, attention_mask = left_padded_batch([3, 9, 5])
    prefill(model, cache, input_ids, attention_mask)
    assert cache.get_seq_length() == 9 and cache.get_mask_sizes(1, 0) == (10, 0)
    assert cache.leading_pads == [6, 0, 4]
    assert [t.num_tokens for t in cache.row_tables] == [3, 9, 5]
    assert [t.block_ids for t in cache.row_tables] == [[0], [1, 2, 3], [4, 5]]
    assert get_pool(model).stats().tokens_stored == 17
    cache.release()


def test_prefill_logits_match_dynamic_cache_and_decode_continues(model):
    input_ids, attention_mask = left_padded_batch([3, 9, 5], seed=2)
    dynamic, paged = DynamicCache(config=model.config), PagedCache(model, block_size=2)
    ref, out = prefill(model, dynamic, input_ids, attention_mask), prefill(model, paged, input_ids, attention_mask)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=1e-5)
    next_ids = ref.logits[:, -1].argmax(-1, keepdim=True)
    mask = torch.cat([attention_mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
    ref, out = prefill(model, dynamic, next_ids, mask), prefill(model, paged, next_ids, mask)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=1e-5)
    assert paged.get_seq_length() == dynamic.get_seq_length() == 10
    paged.release()


def test_inner_model_call_without_the_hook_stores_every_token(model):
    cache = PagedCache(model, block_size=4)
    with torch.no_grad():
        model.model(input_ids=torch.randint(3, 128, (2, 6)), past_key_values=cache, use_cache=True)
    assert [t.num_tokens for t in cache.row_tables] == [6, 6]
    cache.release()


def test_reorder_cache_permutes_block_tables_without_copying(model):
    cache = PagedCache(model, block_size=4, num_blocks=32)
    prefill(model, cache, torch.randint(3, 128, (3, 6)))
    pool = get_pool(model)
    before = [list(t.block_ids) for t in cache.row_tables]  # [[0,1],[2,3],[4,5]]
    cache.reorder_cache(torch.tensor([2, 2, 0]))
    assert [t.block_ids for t in cache.row_tables] == [before[2], before[2], before[0]]
    assert [pool.allocator.ref_count(b) for b in range(6)] == [1, 1, 0, 0, 2, 2]
    # the freed full block 2 stays cached (evictable, handed out last); the partial block 3 is plain free
    assert pool.allocator.free_block_ids[-2:] == [3, 2] and pool.allocator.evictable_block_ids == [2]
    assert pool.stats().cow_copies == 0
    with pytest.raises(IndexError, match="row indices \\[3\\] are out of range for a cache of 3 rows"):
        cache.reorder_cache(torch.tensor([0, 1, 3]))
    cache.release()


def test_writing_into_a_shared_partial_block_copies_it_in_every_layer(model):
    cache = PagedCache(model, block_size=4, num_blocks=32)
    prefill(model, cache, torch.randint(3, 128, (1, 6)))
    cache.batch_repeat_interleave(2)
    assert cache.row_tables[0].block_ids == cache.row_tables[1].block_ids == [0, 1]
    storage = get_pool(model).storage
    prefill(model, cache, torch.randint(3, 128, (2, 1)))
    assert [t.block_ids for t in cache.row_tables] == [[0, 2], [0, 1]]
    for layer in (0, 1):  # the first 2 slots of the copy equal the original, in all layers
        assert torch.equal(storage.keys[layer][2, :2], storage.keys[layer][1, :2])
        assert torch.equal(storage.values[layer][2, :2], storage.values[layer][1, :2])
        assert not torch.equal(storage.keys[layer][2, 2], storage.keys[layer][1, 2])
    assert get_pool(model).stats().cow_copies == 1
    cache.release()


def test_one_row_prefix_broadcasts_to_an_expanded_batch_by_sharing(model):
    prompt = torch.randint(3, 128, (1, 7))
    cache = PagedCache(model, block_size=4)
    prefill(model, cache, prompt)
    out = prefill(model, cache, torch.randint(3, 128, (3, 1)))
    assert cache.batch_size == 3 and out.logits.shape[0] == 3
    first_blocks = {t.block_ids[0] for t in cache.row_tables}
    assert len(first_blocks) == 1 and get_pool(model).allocator.ref_count(first_blocks.pop()) == 3
    cache.release()


def test_batch_size_mismatch_is_refused(model):
    cache = PagedCache(model)
    prefill(model, cache, torch.randint(3, 128, (2, 3)))
    with pytest.raises(ValueError, match="holds 2 rows but the forward has batch size 3"):
        prefill(model, cache, torch.randint(3, 128, (3, 1)))
    cache.release()


def test_crop_frees_blocks_and_keeps_padding_consistent(model):
    cache = PagedCache(model, block_size=2, num_blocks=32)
    input_ids, attention_mask = left_padded_batch([2, 6])
    prefill(model, cache, input_ids, attention_mask)
    used = get_pool(model).stats().num_used
    cache.crop(-3)
    assert cache.get_seq_length() == 3 and [t.num_tokens for t in cache.row_tables] == [0, 3]
    assert cache.leading_pads == [3, 0] and get_pool(model).stats().num_used == used - 2  # 4 blocks -> 0 + 2
    cache.crop(0)
    assert cache.get_seq_length() == 3
    with pytest.raises(ValueError, match="crop\\(-4\\) would remove more than the 3 cached positions"):
        cache.crop(-4)
    with pytest.raises(ValueError, match="pass a negative number"):
        cache.crop(2)
    cache.release()


def test_reset_empties_the_cache_for_reuse(model):
    cache = PagedCache(model, block_size=4)
    prefill(model, cache, torch.randint(3, 128, (2, 5)))
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.batch_size == 0 and get_pool(model).stats().num_used == 0
    prefill(model, cache, torch.randint(3, 128, (3, 2)))
    assert cache.batch_size == 3
    cache.release()


def test_release_returns_blocks_and_closes_the_cache(model):
    cache = PagedCache(model, block_size=4)
    prefill(model, cache, torch.randint(3, 128, (2, 5)))
    cache.release()
    assert get_pool(model).stats().num_used == 0 and cache.is_released
    with pytest.raises(RuntimeError, match="was released"):
        prefill(model, cache, torch.randint(3, 128, (2, 5)))
    cache.release()  # a no-op (more uses after release in test_bad_inputs.py)


def test_dropped_cache_returns_its_blocks(model):
    cache = PagedCache(model, block_size=4)
    prefill(model, cache, torch.randint(3, 128, (2, 9)))
    assert get_pool(model).stats().num_used == 6
    del cache
    gc.collect()
    assert get_pool(model).stats().num_used == 0


def test_cache_reports_transformers_cache_properties(model):
    cache = PagedCache(model)
    assert len(cache) == model.config.num_hidden_layers
    assert not cache.is_compileable and cache.is_croppable and cache.get_max_length() == -1
    assert cache.get_seq_length() == 0 and "PagedCache(rows=0" in repr(cache)
    cache.release()


def test_encoder_decoder_models_are_refused():
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, vocab_size=64, d_kv=16))
    with pytest.raises(NotImplementedError, match="T5ForConditionalGeneration is an encoder-decoder model"):
        PagedCache(t5)


def break_layer(model, error: BaseException):
    """Make the attention of decoder layer 1 raise `error` (undone by `del attention.forward`)."""
    broken = model.model.layers[1].self_attn

    def boom(*args, **kwargs):
        raise error

    broken.forward = boom
    return broken


def broken_second_forward(model, error: BaseException):
    """`(prompt, reference, cache)`: two 9-token prompts, their stock generation, and a cache holding their first 5
    tokens whose next forward (the other 4) raised `error` in layer 1, after layer 0 wrote."""
    prompt = torch.randint(3, 128, (2, 9))
    reference = model.generate(input_ids=prompt, max_new_tokens=6, pad_token_id=0)
    cache = PagedCache(model, block_size=4)
    with torch.no_grad():
        model(input_ids=prompt[:, :5], past_key_values=cache)
    broken = break_layer(model, error)
    try:
        with pytest.raises(type(error), match=re.escape(str(error)) if str(error) else None):
            with torch.no_grad():
                model(input_ids=prompt[:, 5:], past_key_values=cache)  # layer 0 wrote 4 tokens, layer 1 none
    finally:
        del broken.forward
    return prompt, reference, cache


def test_a_forward_that_fails_midway_is_taken_back_at_once(model):
    prompt, reference, cache = broken_second_forward(model, RuntimeError("layer 1 failed"))
    assert cache.get_seq_length() == 5  # the forward hook saw the exception: its tokens are gone already
    paged = model.generate(input_ids=prompt, max_new_tokens=6, pad_token_id=0, past_key_values=cache)
    assert torch.equal(reference, paged)
    cache.release()
    get_pool(model).check_invariants()


def test_a_forward_interrupted_midway_is_forgotten_by_the_next_one(model):
    # torch runs no forward hook for an interrupt
    prompt, reference, cache = broken_second_forward(model, KeyboardInterrupt())
    assert cache.get_seq_length() == 9  # the interrupted forward's tokens are still counted ...
    paged = model.generate(input_ids=prompt, max_new_tokens=6, pad_token_id=0, past_key_values=cache)
    assert torch.equal(reference, paged)  # ... until the next forward drops them and recomputes
    cache.release()


def test_is_initialized_follows_a_dynamic_cache():
    """Models (Molmo2, HRM) tell their first forward by `past_key_values.is_initialized`."""
    model = tiny_model("llama")
    prompt = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    dynamic, paged = DynamicCache(config=model.config), PagedCache(model, block_size=4)
    seen = []
    for step in ("new", "forward", "decode", "reset"):
        with torch.no_grad():
            if step == "forward":
                for cache in (dynamic, paged):
                    model(input_ids=prompt, past_key_values=cache)
            elif step == "decode":
                for cache in (dynamic, paged):
                    model(input_ids=prompt[:, :1], past_key_values=cache)
            elif step == "reset":
                dynamic.reset()
                paged.reset()
        seen.append((dynamic.is_initialized, paged.is_initialized))
    assert seen == [(False, False), (True, True), (True, True), (False, False)]
    paged.release()


def test_is_initialized_is_false_in_the_first_forward_of_a_padded_batch():
    """A left-padded batch's rows are aligned before its first forward; they hold no token yet, so the model sees
    an uninitialized cache there, as with a `DynamicCache` (PaliGemma builds its first mask by it)."""
    model = tiny_model("llama")
    input_ids, attention_mask = left_padded_batch([3, 7])
    seen = []
    hook = model.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["past_key_values"].is_initialized), with_kwargs=True
    )
    options = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=3, do_sample=False)
    model.generate(**options)
    stock, seen[:] = list(seen), []
    model.generate(**options, cache_implementation="paged", cache_config={"block_size": 4})
    hook.remove()
    assert seen == stock == [False, True, True]


def test_cache_config_may_be_a_paged_cache_config():
    model = tiny_model("llama")
    prompt = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(2))
    options = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    out = model.generate(
        prompt,
        cache_implementation="paged",
        cache_config=hf_paged.PagedCacheConfig(block_size=8),
        return_dict_in_generate=True,
        **options,
    )
    assert get_pool(model).block_size == 8
    assert torch.equal(out.sequences, model.generate(prompt, **options))
    out.past_key_values.release()
