"""Prefix sharing: content-addressed blocks, LRU eviction, skipped prefill, fork, multi-turn reuse, isolation."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from transformers import DynamicCache

import hf_paged
import hf_paged.prefix
import hf_paged.rows
from hf_paged import BlockAllocator, InvariantError, PagedCache, PoolExhaustedError, get_pool
from hf_paged.prefix import block_hash, chain, root_hash
from hf_paged.reference_models import tiny_model

from .exactness import assert_scores_match

pytestmark = pytest.mark.kernel_matrix  # every test runs on the in-place kernel and on gather

ROOT = root_hash(b"test")


def cached_table(allocator: BlockAllocator, tokens: list[int]):
    """A table holding `tokens`, its full blocks put in the prefix index (as a cache does after a forward)."""
    table = allocator.new_table()
    allocator.append(table, len(tokens))
    for (h, block_tokens), block_id in zip(chain(ROOT, tokens, allocator.block_size), table.block_ids):
        assert allocator.cache_block(block_id, h, block_tokens) == block_id
    return table


class CountTokens:
    """Counts the tokens every forward of a model receives (a forward pre-hook)."""

    def __init__(self, model):
        self.calls: list[int] = []
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        self.calls.append(int(kwargs["input_ids"].shape[-1]))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


# ---------------------------------------------------------------------- allocator: the prefix index
def test_freed_cached_blocks_stay_cached_and_are_found_again():
    allocator = BlockAllocator(num_blocks=6, block_size=2)
    table = cached_table(allocator, [5, 6, 7, 8, 9])  # blocks 0, 1 full and cached; block 2 partial
    allocator.free(table)
    assert allocator.free_block_ids == [3, 4, 5, 2, 1, 0]  # plain free first, then cached tail before head
    assert allocator.evictable_block_ids == [1, 0] and allocator.num_free == 6
    found = allocator.lookup_prefix(chain(ROOT, [5, 6, 7, 8, 9, 10], 2))
    assert found == [0, 1]
    again = allocator.new_table()
    allocator.share_cached(again, found)
    assert again.num_tokens == 4 and [allocator.ref_count(b) for b in (0, 1)] == [1, 1]
    assert allocator.evictable_block_ids == []
    stats = allocator.stats()
    assert (stats.prefix_queries, stats.prefix_tokens_reused, stats.num_cached, stats.num_evictable) == (1, 4, 2, 0)
    allocator.check_invariants()


def test_lookup_blocks_finds_each_link_on_its_own_without_counting_a_query():
    allocator = BlockAllocator(num_blocks=6, block_size=2)
    table = cached_table(allocator, [5, 6, 7, 8, 9, 10])  # blocks 0, 1, 2 cached
    allocator.free(table)
    hog = allocator.new_table()
    allocator.append(hog, 3 * 2 + 2)  # 3 plain free blocks, then the LRU evictable one: block 2 (the tail)
    links = chain(ROOT, [5, 6, 7, 8, 9, 10], 2)
    assert allocator.lookup_blocks(links) == [0, 1, None]
    assert allocator.lookup_blocks([links[1], (links[0][0], (5, 0))]) == [1, None]  # verified token by token
    assert allocator.stats().prefix_queries == 0
    allocator.record_prefix_reuse(4)
    assert (allocator.stats().prefix_queries, allocator.stats().prefix_tokens_reused) == (1, 4)
    allocator.free(hog)
    allocator.check_invariants()


def test_share_cached_may_start_a_table_without_its_leading_blocks():
    allocator = BlockAllocator(num_blocks=6, block_size=2)
    allocator.free(cached_table(allocator, [5, 6, 7, 8, 9, 10]))
    table = allocator.new_table()
    allocator.share_cached(table, [None, None, 2])  # a sliding window that reads only tokens 4-5
    assert table.block_ids == [None, None, 2] and table.num_tokens == 6 and table.num_skipped == 2
    assert [allocator.ref_count(b) for b in range(3)] == [0, 0, 1] and allocator.evictable_block_ids == [1, 0]
    allocator.check_invariants()
    with pytest.raises(ValueError, match="leading run"):
        allocator.share_cached(table, [None])
    other = allocator.new_table()
    with pytest.raises(ValueError, match="leading run"):
        allocator.share_cached(other, [1, None])
    assert table.block_ids == [None, None, 2] and other.block_ids == [] and allocator.ref_count(1) == 0  # unchanged
    allocator.free(table)
    allocator.free(other)
    allocator.check_invariants()


def two_group_allocator(tokens: list[int]) -> BlockAllocator:
    """An allocator of blocks of 2 whose prefix index holds `tokens` in two layer groups: group 0 in blocks 0, 1,
    ..., group 1 in the next ones, all evictable, group 1's tail the least recently used."""
    allocator = BlockAllocator(num_blocks=12, block_size=2)
    row = hf_paged.rows.Row.empty(allocator, num_groups=2)
    allocator.append_all(row.appends(len(tokens)))
    row.record(tokens)
    row.cache_full_blocks(allocator, hf_paged.prefix.group_roots(ROOT, 2))
    allocator.free(row.tables[1])
    allocator.free(row.tables[0])
    return allocator


def test_a_row_of_a_sliding_group_takes_only_the_window_of_a_cached_prefix():
    tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    roots = hf_paged.prefix.group_roots(ROOT, 2)
    allocator = two_group_allocator(tokens[:8])
    assert allocator.evictable_block_ids == [7, 6, 5, 4, 3, 2, 1, 0]
    # group 0 full attention, group 1 a window of 3: the next token (position 8) reads positions 6-8 only
    row = hf_paged.rows.Row.from_prefix_cache(allocator, roots, [None, 3], tokens)
    assert [t.block_ids for t in row.tables] == [[0, 1, 2, 3], [None, None, None, 7]]
    assert row.num_tokens == 8 and row.tokens == tokens[:8] and [len(h) for h in row.hashes] == [4, 4]
    assert (allocator.stats().prefix_queries, allocator.stats().prefix_tokens_reused) == (1, 8)
    row.free(allocator)
    allocator.check_invariants()


def test_a_sliding_group_missing_its_last_cached_block_shortens_the_hit():
    tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    roots = hf_paged.prefix.group_roots(ROOT, 2)
    allocator = two_group_allocator(tokens[:8])
    hog = allocator.new_table()
    allocator.append(hog, 2 * (allocator.num_free - len(allocator.evictable_block_ids) + 1))  # evicts block 7
    assert allocator.evictable_block_ids == [6, 5, 4, 3, 2, 1, 0]
    # 8 tokens would need group 1's block 3 (gone); 6 tokens need only its block 2 (positions 4-5)
    row = hf_paged.rows.Row.from_prefix_cache(allocator, roots, [None, 3], tokens)
    assert [t.block_ids for t in row.tables] == [[0, 1, 2], [None, None, 6]] and row.num_tokens == 6
    assert allocator.stats().prefix_tokens_reused == 6
    row.free(allocator)
    # were group 1 full attention, it would need every block from its head: blocks 4-6 are there, 6 tokens again
    row = hf_paged.rows.Row.from_prefix_cache(allocator, roots, [None, None], tokens)
    assert [t.block_ids for t in row.tables] == [[0, 1, 2], [4, 5, 6]]
    row.free(allocator)
    allocator.free(hog)
    allocator.check_invariants()


def test_eviction_takes_plain_free_blocks_first_then_lru_tail_before_head():
    allocator = BlockAllocator(num_blocks=5, block_size=2)
    older = cached_table(allocator, [1, 2, 3, 4])  # blocks 0, 1
    newer = cached_table(allocator, [7, 8, 9, 10])  # blocks 2, 3
    allocator.free(older)
    allocator.free(newer)
    assert allocator.evictable_block_ids == [1, 0, 3, 2]  # LRU first; each chain's tail before its head
    table = allocator.new_table()
    allocator.append(table, 2)  # the plain free block 4
    assert table.block_ids == [4] and allocator.stats().evictions == 0
    allocator.append(table, 4)  # evicts block 1 (older chain's tail), then block 0 (its head)
    assert table.block_ids == [4, 1, 0] and allocator.stats().evictions == 2
    assert allocator.lookup_prefix(chain(ROOT, [1, 2, 3, 4], 2)) == []
    assert allocator.lookup_prefix(chain(ROOT, [7, 8, 9, 10], 2)) == [2, 3]
    allocator.check_invariants()


def test_cached_blocks_in_use_are_never_evicted():
    allocator = BlockAllocator(num_blocks=4, block_size=2)
    held = cached_table(allocator, [1, 2, 3, 4])  # blocks 0, 1: cached and in use
    allocator.free(cached_table(allocator, [5, 6]))  # block 2: cached, evictable
    table = allocator.new_table()
    allocator.append(table, 4)  # block 3 (plain free), then block 2 (evicted)
    assert table.block_ids == [3, 2] and allocator.stats().evictions == 1
    with pytest.raises(PoolExhaustedError, match="needs 1 more block\\(s\\) but only 0 are free"):
        allocator.append(table, 1)
    assert held.block_ids == [0, 1] and allocator.lookup_prefix(chain(ROOT, [1, 2, 3, 4], 2)) == [0, 1]
    allocator.check_invariants()


def test_a_hash_collision_is_caught_by_token_verification():
    allocator = BlockAllocator(num_blocks=4, block_size=2)
    first = allocator.new_table()
    allocator.append(first, 2)
    allocator.append(second := allocator.new_table(), 2)
    same_hash = b"\x00" * 16
    assert allocator.cache_block(first.block_ids[0], same_hash, (1, 2)) == 0
    assert allocator.cache_block(second.block_ids[0], same_hash, (3, 4)) == 1  # not shared, not cached
    assert allocator.lookup_prefix([(same_hash, (3, 4))]) == []
    assert allocator.lookup_prefix([(same_hash, (1, 2))]) == [0]
    allocator.check_invariants()


def test_writing_into_a_truncated_cached_block_uncaches_it():
    allocator = BlockAllocator(num_blocks=4, block_size=2)
    table = cached_table(allocator, [1, 2, 3, 4])
    allocator.truncate(table, 3)
    allocator.append(table, 1)  # block 1 was cached as (3, 4); its slot 1 is rewritten
    assert allocator.lookup_prefix(chain(ROOT, [1, 2, 3, 4], 2)) == [0]
    assert allocator.block_hash(1) is None
    allocator.check_invariants()


def test_clear_prefix_cache_forgets_everything():
    allocator = BlockAllocator(num_blocks=4, block_size=2)
    allocator.free(cached_table(allocator, [1, 2, 3, 4]))
    allocator.clear_prefix_cache()
    assert allocator.lookup_prefix(chain(ROOT, [1, 2, 3, 4], 2)) == []
    assert allocator.stats().num_cached == 0 and allocator.num_free == 4
    allocator.check_invariants()


def test_invariant_4_catches_a_free_block_that_kept_its_hash():
    allocator = BlockAllocator(num_blocks=4, block_size=2)
    allocator.free(cached_table(allocator, [1, 2]))
    allocator._evictable.pop(0)
    allocator._free.append(0)
    with pytest.raises(InvariantError, match="invariant 4: free blocks \\[0\\] still carry a prefix hash"):
        allocator.check_invariants()


def test_chain_hash_depends_on_every_earlier_block():
    a = chain(ROOT, [1, 2, 3, 4, 5, 6], 2)
    b = chain(ROOT, [9, 2, 3, 4, 5, 6], 2)
    assert [h for h, _ in a] != [h for h, _ in b] and a[1][1] == b[1][1]
    assert all(x[0] != y[0] for x, y in zip(a, b))  # same later tokens, different prefix: different hashes
    assert block_hash(ROOT, [1, 2]) == a[0][0]


# ---------------------------------------------------------------------- generate: skipped prefill and reuse
@pytest.fixture
def model():
    return tiny_model("llama")


def test_second_call_with_a_cached_prompt_prefix_computes_only_the_rest(model):
    system = torch.randint(3, 128, (1, 37))
    first = torch.cat([system, torch.randint(3, 128, (1, 5))], dim=1)
    second = torch.cat([system, torch.randint(3, 128, (1, 6))], dim=1)
    options = dict(max_new_tokens=6, pad_token_id=0, do_sample=False)
    reference = model.generate(input_ids=second, **options)
    model.generate(input_ids=first, **options, cache_implementation="paged", cache_config={"block_size": 8})
    with CountTokens(model) as counter:
        paged = model.generate(input_ids=second, **options, cache_implementation="paged")
    assert torch.equal(reference, paged)
    assert counter.calls[0] == 43 - 32  # 4 full blocks of the 37-token system prompt came from the cache
    assert get_pool(model).last_cache_stats.prefix_tokens_reused == 32
    assert get_pool(model).stats().num_used == 0 and get_pool(model).stats().prefix_tokens_reused >= 32


def test_whole_prompt_cached_still_computes_its_last_token(model):
    prompt = torch.randint(3, 128, (1, 16))
    options = dict(max_new_tokens=4, pad_token_id=0, cache_implementation="paged", cache_config={"block_size": 4})
    first = model.generate(input_ids=prompt, **options)
    with CountTokens(model) as counter:
        again = model.generate(input_ids=prompt, **options)
    assert torch.equal(first, again) and counter.calls[0] == 4  # 3 cached blocks; the last block is recomputed


def test_batch_with_equal_padding_skips_the_shared_prefix(model):
    system = torch.randint(3, 128, (1, 20))
    batch = torch.cat([system.repeat(3, 1), torch.randint(3, 128, (3, 4))], dim=1)
    options = dict(max_new_tokens=5, pad_token_id=0, do_sample=False)
    reference = model.generate(input_ids=batch, **options)
    model.generate(input_ids=system, **options, cache_implementation="paged", cache_config={"block_size": 4})
    with CountTokens(model) as counter:
        paged = model.generate(input_ids=batch, **options, cache_implementation="paged", return_dict_in_generate=True)
    assert torch.equal(reference, paged.sequences) and counter.calls[0] == 24 - 20  # 5 cached blocks
    tables = paged.past_key_values.row_tables
    assert tables[0].block_ids[:5] == tables[1].block_ids[:5] == tables[2].block_ids[:5]
    paged.past_key_values.release()


def test_rows_with_different_padding_still_share_storage(model):
    system = torch.randint(3, 128, (1, 12)).tolist()[0]
    prompts = [system + [5, 6], system + [7, 8, 9, 10, 11]]
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention_mask = (input_ids != 0).long()
    options = dict(max_new_tokens=3, pad_token_id=0, do_sample=False, attention_mask=attention_mask)
    reference = model.generate(input_ids=input_ids, **options)
    paged = model.generate(
        input_ids=input_ids,
        **options,
        cache_implementation="paged",
        return_dict_in_generate=True,
        cache_config={"block_size": 4},
    )
    assert torch.equal(reference, paged.sequences)
    first, second = paged.past_key_values.row_tables
    assert first.block_ids[:3] == second.block_ids[:3]  # the 12-token system prompt: one copy of its 3 blocks
    paged.past_key_values.release()


def test_prompts_differing_inside_the_first_block_share_nothing(model):
    prompt = torch.randint(3, 128, (1, 24))
    other = prompt.clone()
    other[0, 2] = (other[0, 2] + 1) % 125 + 3
    options = dict(max_new_tokens=3, pad_token_id=0, cache_implementation="paged", cache_config={"block_size": 8})
    model.generate(input_ids=prompt, **options)
    with CountTokens(model) as counter:
        model.generate(input_ids=other, **options)
    assert counter.calls[0] == 24
    assert get_pool(model).last_cache_stats.prefix_tokens_reused == 0


def test_forced_hash_collision_never_hands_over_another_prompts_kv(model, monkeypatch):
    monkeypatch.setattr(hf_paged.rows, "block_hash", lambda parent, tokens: b"\x01" * 16)
    monkeypatch.setattr(hf_paged.prefix, "block_hash", lambda parent, tokens: b"\x01" * 16)
    first, second = torch.randint(3, 128, (1, 17)), torch.randint(3, 128, (1, 17))
    options = dict(max_new_tokens=5, pad_token_id=0, do_sample=False)
    reference = model.generate(input_ids=second, **options)
    model.generate(input_ids=first, **options, cache_implementation="paged", cache_config={"block_size": 8})
    with CountTokens(model) as counter:
        paged = model.generate(input_ids=second, **options, cache_implementation="paged")
    assert torch.equal(reference, paged) and counter.calls[0] == 17


def test_prefix_caching_can_be_switched_off(model):
    prompt = torch.randint(3, 128, (1, 20))
    options = dict(
        max_new_tokens=3,
        pad_token_id=0,
        cache_implementation="paged",
        cache_config={"block_size": 4, "prefix_caching": False},
    )
    model.generate(input_ids=prompt, **options)
    with CountTokens(model) as counter:
        model.generate(input_ids=prompt, **options)
    assert counter.calls[0] == 20 and get_pool(model).stats().num_cached == 0


def test_eviction_under_pressure_keeps_outputs_exact():
    model = tiny_model("llama")
    prompts = [torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(i)) for i in range(6)]
    options = dict(max_new_tokens=4, pad_token_id=0, do_sample=False)
    references = [model.generate(input_ids=p, **options) for p in prompts]
    for _ in range(2):
        for prompt, reference in zip(prompts, references):
            paged = model.generate(
                input_ids=prompt,
                **options,
                cache_implementation="paged",
                cache_config={"block_size": 4, "num_blocks": 20},
            )
            assert torch.equal(reference, paged)
    stats = get_pool(model).stats()
    assert stats.evictions > 0 and stats.num_used == 0


# ---------------------------------------------------------------------- fork and multi-turn
def test_fork_shares_the_prompt_and_matches_independent_runs(model):
    prompt = torch.randint(3, 128, (1, 10))
    cache = PagedCache(model, block_size=4)
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache)
    forks = cache.fork(4)
    pool = get_pool(model)
    assert pool.stats().num_used == 3  # one copy of the 10-token prompt for five caches
    assert all(pool.allocator.ref_count(b) == 5 for b in cache.row_tables[0].block_ids)
    continuations = [torch.cat([prompt, torch.randint(3, 128, (1, 2))], dim=1) for _ in forks]
    for fork, follow in zip(forks, continuations):
        reference = model.generate(input_ids=follow, max_new_tokens=5, pad_token_id=0)
        paged = model.generate(input_ids=follow, max_new_tokens=5, pad_token_id=0, past_key_values=fork)
        assert torch.equal(reference, paged)
        assert fork.stats().cow_copies == 1  # it wrote into the shared partial block 2 (10 tokens: 2/4 full)
    for fork in forks:
        fork.release()
    single = cache.fork()
    assert isinstance(single, PagedCache) and single.get_seq_length() == 10
    single.release()
    cache.release()
    with pytest.raises(ValueError, match="n must be a positive int, got 0"):
        PagedCache(model).fork(0)


def test_deepcopy_of_a_prompt_cache_is_a_fork(model):
    """transformers' prompt-reuse recipe, `generate(..., past_key_values=copy.deepcopy(prompt_cache))`, as with a
    DynamicCache (it was `TypeError: cannot pickle '_thread.RLock' object`)."""
    prompt = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(4))
    follow = torch.cat([prompt, torch.randint(3, 128, (1, 3), generator=torch.Generator().manual_seed(5))], dim=1)
    options = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    dynamic, paged = DynamicCache(), PagedCache(model, block_size=4)
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=dynamic)
        model(input_ids=prompt, past_key_values=paged)
    used = get_pool(model).stats().num_used
    copies = [copy.deepcopy(paged) for _ in range(2)]
    assert get_pool(model).stats().num_used == used  # shared, not copied
    reference = model.generate(input_ids=follow, past_key_values=copy.deepcopy(dynamic), **options)
    for twin in copies:
        assert torch.equal(model.generate(input_ids=follow, past_key_values=twin, **options), reference)
        twin.release()
    assert paged.get_seq_length() == 10
    image_like = PagedCache(model, block_size=4)
    image_like.stop_prefix_caching()  # K/V depending on more than token ids: the copy must not index them either
    assert not copy.deepcopy(image_like).prefix_caching
    paged.release()


def test_reused_cache_is_cropped_to_what_the_new_prompt_shares(model):
    prompt = torch.randint(3, 128, (1, 9))
    out = model.generate(
        input_ids=prompt, max_new_tokens=4, pad_token_id=0, cache_implementation="paged", return_dict_in_generate=True
    )
    cache = out.past_key_values
    edited = out.sequences.clone()
    edited[0, 5] = (edited[0, 5] + 1) % 125 + 3  # the user edits an earlier token of the conversation
    follow = torch.cat([edited, torch.randint(3, 128, (1, 3))], dim=1)
    reference = model.generate(input_ids=follow, max_new_tokens=4, pad_token_id=0)
    paged = model.generate(input_ids=follow, max_new_tokens=4, pad_token_id=0, past_key_values=cache)
    assert torch.equal(reference, paged)
    cache.release()


def test_multi_turn_chat_on_smollm2_reuses_the_conversation(smollm2):
    model, tokenizer = smollm2
    system = "You are a concise assistant. " * 12  # a system prompt of more than 100 tokens
    turns = ["Name a colour.", "Name a fruit of that colour.", "How many letters does it have?"]

    def run(cache_kwargs):
        messages = [{"role": "system", "content": system}]
        replies, computed = [], []
        cache = None
        for question in turns:
            messages.append({"role": "user", "content": question})
            ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
            )["input_ids"]
            extra = {"past_key_values": cache} if cache is not None else dict(cache_kwargs)
            with CountTokens(model) as counter:
                out = model.generate(
                    input_ids=ids, max_new_tokens=16, do_sample=False, return_dict_in_generate=True, **extra
                )
            computed.append(counter.calls[0])
            reply = tokenizer.decode(out.sequences[0, ids.shape[1] :], skip_special_tokens=True)
            replies.append(reply)
            messages.append({"role": "assistant", "content": reply})
            if cache_kwargs:
                cache = out.past_key_values
        if cache is not None:
            cache.release()
        return replies, computed, ids.shape[1]

    scratch, scratch_computed, final_length = run({})
    paged, paged_computed, _ = run({"cache_implementation": "paged"})
    assert paged == scratch
    assert paged_computed[0] == scratch_computed[0]
    assert all(p < s // 2 for p, s in zip(paged_computed[1:], scratch_computed[1:]))  # only the new turn
    assert get_pool(model).stats().num_used == 0


def test_shared_system_prompt_on_smollm2(smollm2):
    model, tokenizer = smollm2
    system = "You are a helpful assistant who answers in one short sentence. " * 20

    def prompt(question):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]

    first, second = prompt("What is the capital of Italy?"), prompt("What colour is the sky?")
    assert first.shape[1] > 200
    options = dict(max_new_tokens=20, do_sample=False)
    reference = model.generate(input_ids=second, **options)
    model.generate(input_ids=first, **options, cache_implementation="paged")
    shared = next(i for i in range(first.shape[1]) if first[0, i] != second[0, i])
    with CountTokens(model) as counter:
        paged = model.generate(input_ids=second, **options, cache_implementation="paged")
    assert torch.equal(reference, paged)
    assert counter.calls[0] == second.shape[1] - shared // 16 * 16
    assert get_pool(model).stats().num_used == 0


def test_cached_prompt_meeting_beams_and_sampling_stays_exact(model):
    prompt = torch.randint(3, 128, (2, 21))
    options = dict(max_new_tokens=8, pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    beams = dict(num_beams=4, num_return_sequences=2)
    reference = model.generate(input_ids=prompt, **options, **beams)
    model.generate(
        input_ids=prompt, max_new_tokens=2, pad_token_id=0, cache_implementation="paged", cache_config={"block_size": 4}
    )
    with CountTokens(model) as counter:
        paged = model.generate(input_ids=prompt, **options, **beams, cache_implementation="paged")
    assert counter.calls[0] == 1  # 5 cached blocks per prompt; only the last prompt token is computed
    assert torch.equal(reference.sequences, paged.sequences)
    assert_scores_match(reference.sequences_scores, paged.sequences_scores)
    paged.past_key_values.release()

    torch.manual_seed(9)
    sampled_reference = model.generate(
        input_ids=prompt, do_sample=True, num_return_sequences=3, max_new_tokens=6, pad_token_id=0
    )
    torch.manual_seed(9)
    sampled = model.generate(
        input_ids=prompt,
        do_sample=True,
        num_return_sequences=3,
        max_new_tokens=6,
        pad_token_id=0,
        cache_implementation="paged",
    )
    assert torch.equal(sampled_reference, sampled)
    assert get_pool(model).stats().num_used == 0


def test_blocks_cached_before_a_weight_update_are_not_reused_after_it():
    """Training in the same process changes the K/V of the same tokens: the prefix cache must not serve old blocks."""
    model = tiny_model("llama")
    prompt = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    options = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    model.generate(prompt, cache_implementation="paged", cache_config={"block_size": 8}, **options)
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.add_(0.5)  # what an optimizer step does, in place
    out = model.generate(
        prompt, cache_implementation="paged", cache_config={"block_size": 8}, return_dict_in_generate=True, **options
    )
    assert out.past_key_values.stats().prefix_tokens_reused == 0
    out.past_key_values.release()
    assert torch.equal(out.sequences, model.generate(prompt, **options))


def test_a_cache_built_before_a_weight_update_does_not_reuse_blocks_from_before_it():
    """A caller's `PagedCache` built before training looks prefixes up under the weights as they are at `generate`."""
    model = tiny_model("llama")
    prompt = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(5))
    options = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    model.generate(prompt, cache_implementation="paged", cache_config={"block_size": 4}, **options)
    cache = PagedCache(model, block_size=4)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(-2.0)
    out = model.generate(prompt, past_key_values=cache, **options)
    assert cache.stats().prefix_tokens_reused == 0
    cache.release()
    assert torch.equal(out, model.generate(prompt, **options))


def two_adapter_model():
    from peft import LoraConfig, get_peft_model

    def lora():
        return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"], init_lora_weights=False)

    torch.manual_seed(0)
    peft_model = get_peft_model(tiny_model("llama"), lora(), adapter_name="one")
    peft_model.add_adapter("two", lora())
    return peft_model.eval()


def set_scale(peft_model, adapter: str, scale: float) -> None:
    for module in peft_model.modules():
        if hasattr(module, "set_scale"):
            module.set_scale(adapter, scale)


ADAPTER_CHANGES = {
    "set_adapter": lambda m: m.set_adapter("two"),
    "set_scale": lambda m: set_scale(m, "one", 3.0),
    "disable_adapter_layers": lambda m: m.base_model.disable_adapter_layers(),
}


@pytest.mark.parametrize("change", ADAPTER_CHANGES.values(), ids=ADAPTER_CHANGES.keys())
def test_a_lora_adapter_switched_rescaled_or_disabled_retires_the_blocks_cached_before(change):
    """Adapter state changes no weight: without `adapter_state_key` the second call took the first's blocks."""
    peft_model = two_adapter_model()
    prompt = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    options = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, "cache_implementation": "paged"}
    peft_model.generate(prompt, cache_config={"block_size": 8}, **options)
    change(peft_model)
    out = peft_model.generate(prompt, cache_config={"block_size": 8}, return_dict_in_generate=True, **options)
    assert out.past_key_values.stats().prefix_tokens_reused == 0
    out.past_key_values.release()
    del options["cache_implementation"]
    assert torch.equal(out.sequences, peft_model.generate(prompt, **options))


def test_an_engine_on_a_peft_model_follows_its_active_adapter():
    peft_model = two_adapter_model()
    prompts = [list(range(3, 43)), list(range(50, 85))]
    engine = hf_paged.Engine(peft_model, block_size=8, exact=True)
    stock_options = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    for change in (lambda: None, lambda: peft_model.set_adapter("two"), peft_model.disable_adapter):
        with change() or contextlib.nullcontext():
            outputs = engine.generate(prompts, max_new_tokens=6, min_new_tokens=6)
            expected = [peft_model.generate(torch.tensor([p]), **stock_options)[0, len(p) :].tolist() for p in prompts]
        assert [o.token_ids for o in outputs] == expected
    engine.close()


def test_blocks_computed_in_training_mode_are_never_reused():
    """Dropout makes K/V computed in training mode differ from eval mode's (and from one call to the next)."""
    model = tiny_model("llama", attention_dropout=0.5)
    prompt = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(5))
    options = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    model.train()
    model.generate(prompt, cache_implementation="paged", cache_config={"block_size": 8}, **options)
    model.eval()
    out = model.generate(
        prompt, cache_implementation="paged", cache_config={"block_size": 8}, return_dict_in_generate=True, **options
    )
    assert out.past_key_values.stats().prefix_tokens_reused == 0
    out.past_key_values.release()
    assert torch.equal(out.sequences, model.generate(prompt, **options))


def test_the_weights_key_sees_what_the_readme_says():
    """README and faq: in-place changes made through a parameter bump its version; `.data` changes (no version) are
    seen where they touch one of the 16 strided samples of the parameter; a `.data` edit of unsampled elements is not
    seen: that is what `clear_prefix_cache()` is documented for."""
    from hf_paged.prefix import SAMPLES_PER_PARAMETER, weights_key

    model = tiny_model("llama")
    weight = model.model.layers[0].self_attn.q_proj.weight
    stride = weight.numel() // SAMPLES_PER_PARAMETER
    assert stride > 1
    keys = [weights_key(model)]
    with torch.no_grad():
        weight.add_(1e-3)  # an optimizer step's kind of change: the version moves
    keys.append(weights_key(model))
    weight.data.view(-1)[stride] += 1.0  # `.data`: no version, but a sampled element
    keys.append(weights_key(model))
    weight.data += 0.5  # a merge's kind of change: every element
    keys.append(weights_key(model))
    assert len(set(keys)) == len(keys)
    weight.data.view(-1)[1] += 1.0  # `.data` on an element no sample covers: unseen, as documented
    assert weights_key(model) == keys[-1]


def test_the_parameter_walk_lists_what_module_parameters_lists():
    """`prefix._parameters` (read at every Engine step) is `list(model.parameters())`: same tensors, same order, a
    tied weight and a module held twice listed once, a parameter set to `None` skipped, LoRA layers included."""
    from hf_paged.prefix import _parameters

    model = tiny_model("llama", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.model.extra = model.model.layers[0].mlp  # one module at two places
    model.model.layers[1].mlp.gate_proj.register_parameter("bias", None)
    assert [id(p) for p in _parameters(model)] == [id(p) for p in model.parameters()]
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert [id(p) for p in _parameters(lora)] == [id(p) for p in lora.parameters()]
    assert len(_parameters(lora)) > len(list(tiny_model("llama").parameters()))
