"""Beam search and num_return_sequences on shared, copy-on-write pages: exact, shared, and never leaking."""

from __future__ import annotations

import pytest
import torch

from hf_paged import PagedCache, get_pool
from hf_paged.reference_models import tiny_model

from .conftest import left_padded_batch
from .exactness import assert_scores_match

pytestmark = pytest.mark.kernel_matrix  # every test runs on the in-place kernel and on gather

LENGTHS = [5, 11, 8]  # a left-padded batch of three prompts
BEAM_CASES = [
    (num_beams, num_return, early_stopping)
    for num_beams in (2, 4, 8)
    for num_return in sorted({1, 2, num_beams})
    for early_stopping in (True, False, "never")
]


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma2"])
def family_model(request):
    return tiny_model(request.param)


def beam_pair(model, block_size, **kwargs):
    kwargs = {"max_new_tokens": 14, "pad_token_id": 0, "return_dict_in_generate": True, "output_scores": True, **kwargs}
    reference = model.generate(**kwargs)
    paged = model.generate(**kwargs, cache_implementation="paged", cache_config={"block_size": block_size})
    return reference, paged


@pytest.mark.parametrize("case", range(len(BEAM_CASES)))
def test_beam_search_is_token_and_score_identical(family_model, case):
    num_beams, num_return, early_stopping = BEAM_CASES[case]
    block_size = (1, 4, 16)[case % 3]
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=case)
    reference, paged = beam_pair(
        family_model,
        block_size,
        input_ids=input_ids,
        attention_mask=attention_mask,
        num_beams=num_beams,
        num_return_sequences=num_return,
        early_stopping=early_stopping,
        length_penalty=(0.6, 1.0, 1.4)[case % 3],
        no_repeat_ngram_size=3 if case % 2 else 0,
    )
    assert torch.equal(reference.sequences, paged.sequences)
    assert_scores_match(reference.sequences_scores, paged.sequences_scores)
    assert paged.sequences.shape[0] == 3 * num_return
    paged.past_key_values.release()
    assert get_pool(family_model).stats().num_used == 0


def test_sampling_with_num_return_sequences_is_identical():
    model = tiny_model("llama")
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=21)
    options = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        do_sample=True,
        top_k=30,
        num_return_sequences=4,
        max_new_tokens=16,
        pad_token_id=0,
    )
    torch.manual_seed(3)
    reference = model.generate(**options)
    torch.manual_seed(3)
    paged = model.generate(**options, cache_implementation="paged", cache_config={"block_size": 4})
    assert torch.equal(reference, paged)
    stats = get_pool(model).last_cache_stats
    # prompts of 5 and 11 tokens end in a partial block, copied by 3 of its 4 rows; 8 tokens fill their blocks
    assert stats.cow_copies == 2 * 3
    assert get_pool(model).stats().num_used == 0


def test_expanded_rows_share_one_copy_of_each_prompt_after_prefill():
    model = tiny_model("llama")
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=2)
    after_prefill = []

    def snapshot(module, args, kwargs, output):
        cache = kwargs["past_key_values"]
        if not after_prefill:
            after_prefill.append((cache.stats(), [list(t.block_ids) for t in cache.row_tables]))

    handle = model.register_forward_hook(snapshot, with_kwargs=True)
    try:
        model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            num_beams=4,
            max_new_tokens=3,
            pad_token_id=0,
            cache_implementation="paged",
            cache_config={"block_size": 4},
        )
    finally:
        handle.remove()
    stats, tables = after_prefill[0]
    assert stats.num_rows == 12
    assert stats.num_blocks == 2 + 3 + 2  # ceil(5/4) + ceil(11/4) + ceil(8/4): one copy per prompt, not four
    assert stats.tokens_stored == sum(LENGTHS)
    for prompt in range(3):
        assert len({tuple(t) for t in tables[4 * prompt : 4 * prompt + 4]}) == 1


def test_reorder_is_a_table_permutation_and_invariants_hold_after_every_step(monkeypatch):
    model = tiny_model("qwen2")
    pool_checks = []
    original = PagedCache.reorder_cache

    def checked_reorder(self, beam_idx):
        used_before = self.pool.stats().num_used
        original(self, beam_idx)
        self.pool.check_invariants()
        pool_checks.append(self.pool.stats().num_used <= used_before)  # a reorder never takes blocks

    monkeypatch.setattr(PagedCache, "reorder_cache", checked_reorder)
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=4)
    model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        num_beams=4,
        max_new_tokens=12,
        pad_token_id=0,
        cache_implementation="paged",
        cache_config={"block_size": 4},
    )
    assert len(pool_checks) == 12 and all(pool_checks)  # generate reorders after every step, the last included
    assert get_pool(model).stats().num_used == 0


def test_one_row_prompt_cache_broadcasts_to_beams():
    model = tiny_model("llama")
    prompt = torch.randint(3, 128, (1, 9))
    reference = model.generate(input_ids=prompt, num_beams=4, num_return_sequences=2, max_new_tokens=8, pad_token_id=0)
    cache = PagedCache(model, block_size=4)
    with torch.no_grad():
        model(input_ids=prompt[:, :-1], past_key_values=cache)
    prefix_blocks = list(cache.row_tables[0].block_ids)
    paged = model.generate(
        input_ids=prompt, num_beams=4, num_return_sequences=2, max_new_tokens=8, pad_token_id=0, past_key_values=cache
    )
    assert torch.equal(reference, paged)
    assert cache.batch_size == 4  # the beams; every beam still shares the prompt's full blocks
    assert [get_pool(model).allocator.ref_count(b) for b in prefix_blocks] == [4, 4]
    cache.release()
    assert get_pool(model).stats().num_used == 0


def test_batch_select_and_repeat_interleave_keep_sharing_consistent():
    model = tiny_model("llama")
    cache = PagedCache(model, block_size=4)
    with torch.no_grad():
        model(input_ids=torch.randint(3, 128, (2, 6)), past_key_values=cache)
    cache.batch_repeat_interleave(3)
    pool = get_pool(model)
    assert [pool.allocator.ref_count(b) for b in range(4)] == [3, 3, 3, 3]
    cache.batch_select_indices(torch.tensor([0, 4]))
    assert [pool.allocator.ref_count(b) for b in range(4)] == [1, 1, 1, 1]
    pool.check_invariants()
    cache.release()


def test_negative_control_without_copy_on_write_beams_corrupt_each_other():
    """Proves the beam test can fail: with copy-on-write switched off, beams that share a partial block overwrite
    each other's K/V and the results leave DynamicCache's."""
    model = tiny_model("llama")
    input_ids, attention_mask = left_padded_batch(LENGTHS, seed=0)
    kwargs = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        num_beams=4,
        max_new_tokens=14,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
    )
    reference = model.generate(**kwargs)
    allocator = get_pool(model, block_size=16).allocator
    allocator._needs_copy_on_write = lambda block_id: False  # rows write into the blocks they share
    try:
        broken = model.generate(**kwargs, cache_implementation="paged")
    finally:
        del allocator._needs_copy_on_write
    assert (reference.sequences_scores - broken.sequences_scores).abs().max() > 1e-3
    broken.past_key_values.release()
    assert get_pool(model).stats().num_used == 0


def test_beam_search_on_smollm2(smollm2):
    model, tokenizer = smollm2
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in ("Give me a name for a cat.", "What is two plus two?")
    ]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    kwargs = dict(
        **batch, num_beams=4, max_new_tokens=48, return_dict_in_generate=True, output_scores=True, early_stopping=True
    )
    reference = model.generate(**kwargs)
    paged = model.generate(**kwargs, cache_implementation="paged")
    assert torch.equal(reference.sequences, paged.sequences)
    assert_scores_match(reference.sequences_scores, paged.sequences_scores)
    stats = paged.past_key_values.stats()
    assert stats.cow_copies > 0 and stats.peak_blocks < 8 * -(-paged.sequences.shape[1] // 16)
    paged.past_key_values.release()
    assert get_pool(model).stats().num_used == 0


def test_matrix_covers_every_requested_value():
    assert {c[0] for c in BEAM_CASES} == {2, 4, 8}
    assert {c[2] for c in BEAM_CASES} == {True, False, "never"}
    assert {(n, r) for n, r, _ in BEAM_CASES} == {(n, r) for n in (2, 4, 8) for r in (1, 2, n)}
    block_sizes = {(1, 4, 16)[case % 3] for case in range(len(BEAM_CASES))}
    assert block_sizes == {1, 4, 16}


def test_crop_on_shared_blocks_then_decode_copies_instead_of_overwriting():
    model = tiny_model("llama")
    cache = PagedCache(model, block_size=4)
    with torch.no_grad():
        model(input_ids=torch.randint(3, 128, (1, 10)), past_key_values=cache)
        cache.batch_repeat_interleave(3)  # three rows share blocks [0, 1, 2] (10 tokens: the last one 2/4 full)
        cache.crop(-3)  # 7 tokens: block 2 is dropped by all rows, block 1 becomes the shared partial block
        pool = get_pool(model)
        assert [pool.allocator.ref_count(b) for b in range(3)] == [3, 3, 0]
        model(input_ids=torch.randint(3, 128, (3, 1)), past_key_values=cache)
    assert cache.stats().cow_copies == 2 and [t.num_tokens for t in cache.row_tables] == [8, 8, 8]
    assert len({t.block_ids[1] for t in cache.row_tables}) == 3
    pool.check_invariants()
    cache.release()
