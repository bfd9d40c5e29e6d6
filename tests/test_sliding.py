"""Sliding-window block release: on a model whose every layer slides over the last W positions (Mistral-style), a
row gives its blocks behind the window back to the pool during generation, so a long generation holds about
ceil(W / block_size) + 1 blocks per row, and generates exactly what `DynamicCache` generates."""

from __future__ import annotations

import pytest
import torch

from hf_paged import BlockAllocator, Engine, PagedCache
from hf_paged.errors import InvariantError, PoolExhaustedError
from hf_paged.reference_models import tiny_model

from .conftest import left_padded_batch

WINDOW = 32
BLOCK_SIZE = 8
NEW_TOKENS = 400
# live blocks per row after any forward past the prompt: the window's W - 1 tokens and the new one span at most
# ceil(W / block_size) + 1 blocks
BOUND = -(-WINDOW // BLOCK_SIZE) + 1
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def mistral():
    return tiny_model("mistral", sliding_window=WINDOW, max_position_embeddings=1024)


class BlockMeter:
    """Records, after every forward of `model`, the most live blocks any row of `cache` holds and the distinct
    blocks the cache holds."""

    def __init__(self, model, cache):
        self.cache, self.per_row, self.distinct = cache, [], []
        self.handle = model.register_forward_hook(self._record)

    def _record(self, module, args, output):
        tables = self.cache.row_tables
        self.per_row.append(max(len(t.live_block_ids) for t in tables))
        self.distinct.append(self.cache.stats().num_blocks)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def run_both(model, input_ids, attention_mask=None, num_blocks=256, window=None, **options):
    """`(DynamicCache output, paged output, meter)` of the same `generate` call (logits kept)."""
    options = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "pad_token_id": 0, **options}
    options.update(return_dict_in_generate=True, output_logits=True)
    if options.get("do_sample"):
        torch.manual_seed(7)
    reference = model.generate(input_ids, attention_mask=attention_mask, **options)
    cache = PagedCache(model, block_size=BLOCK_SIZE, num_blocks=num_blocks)
    if window != "default":
        cache.sliding_release_window = WINDOW if window is None else window
    if options.get("do_sample"):
        torch.manual_seed(7)
    with BlockMeter(model, cache) as meter:
        paged = model.generate(input_ids, attention_mask=attention_mask, past_key_values=cache, **options)
    assert cache.row_tables and cache.stats().num_blocks <= len(cache.row_tables) * BOUND
    cache.release()
    assert cache.pool.stats().num_used == 0
    return reference, paged, meter


def logits_gap(reference, paged) -> float:
    return max((a - b).abs().max().item() for a, b in zip(reference.logits, paged.logits))


def prompt(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(seed))


def test_release_windows_follow_the_layer_groups(mistral):
    cache = PagedCache(mistral, block_size=BLOCK_SIZE, num_blocks=16)
    assert cache.sliding_release_window == WINDOW and cache.release_windows == [WINDOW]
    assert PagedCache(tiny_model("mistral"), num_blocks=16).sliding_release_window is None  # no window
    hybrid = PagedCache(tiny_model("gemma2"), num_blocks=16)  # full + sliding layers: one group of each
    assert hybrid.release_windows == [None, 6] and hybrid.sliding_release_window == 6
    hybrid.sliding_release_window = None
    assert hybrid.release_windows == [None, None]


def test_greedy_400_tokens_match_dynamic_cache_in_a_pool_too_small_to_keep_every_block(mistral):
    # 20 + 400 tokens need 53 blocks without release; the pool has 8
    reference, paged, meter = run_both(mistral, prompt(20), num_blocks=8)
    assert torch.equal(reference.sequences, paged.sequences)
    assert logits_gap(reference, paged) <= TOLERANCE
    assert len(meter.per_row) == NEW_TOKENS and max(meter.per_row) <= BOUND
    assert max(meter.per_row[WINDOW:]) == BOUND  # the bound is reached


def test_without_release_the_row_keeps_every_block(mistral):
    cache = PagedCache(mistral, block_size=BLOCK_SIZE, num_blocks=64)
    cache.sliding_release_window = None
    with BlockMeter(mistral, cache) as meter:
        mistral.generate(prompt(20), past_key_values=cache, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    assert max(meter.per_row) == -(-(20 + NEW_TOKENS - 1) // BLOCK_SIZE) == 53
    cache.release()
    small = PagedCache(mistral, block_size=BLOCK_SIZE, num_blocks=8)
    small.sliding_release_window = None
    with pytest.raises(PoolExhaustedError):
        mistral.generate(prompt(20), past_key_values=small, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    small.release()


def test_left_padded_batch_matches_dynamic_cache(mistral):
    input_ids, attention_mask = left_padded_batch([20, 13], seed=1)
    reference, paged, meter = run_both(mistral, input_ids, attention_mask, num_blocks=2 * BOUND + 2)
    assert torch.equal(reference.sequences, paged.sequences)
    assert logits_gap(reference, paged) <= TOLERANCE
    assert max(meter.per_row) <= BOUND


def test_sampling_with_a_seed_matches_dynamic_cache(mistral):
    reference, paged, meter = run_both(mistral, prompt(17, seed=2), do_sample=True, top_k=20, num_blocks=16)
    assert torch.equal(reference.sequences, paged.sequences)
    assert max(meter.per_row) <= BOUND


def test_beam_search_matches_dynamic_cache(mistral):
    options = {"num_beams": 4, "do_sample": False, "output_scores": True}
    reference, paged, meter = run_both(mistral, prompt(12, seed=3), num_blocks=64, **options)
    assert torch.equal(reference.sequences, paged.sequences)
    assert (reference.sequences_scores - paged.sequences_scores).abs().max() <= TOLERANCE
    assert max(meter.per_row) <= BOUND and max(meter.distinct) <= 4 * BOUND


def test_negative_control_releasing_one_token_too_many_changes_the_output(mistral):
    reference, paged, _ = run_both(
        mistral, prompt(20), num_blocks=16, window=WINDOW - 1, max_new_tokens=120, min_new_tokens=120
    )
    assert not torch.equal(reference.sequences, paged.sequences) or logits_gap(reference, paged) > 1e-3


def test_engine_matches_generate_alone_and_holds_the_window(mistral):
    prompts = [prompt(length, seed=10 + length)[0].tolist() for length in (5, 18, 27, 9)]
    alone = [
        mistral.generate(torch.tensor([p]), max_new_tokens=150, min_new_tokens=150, do_sample=False)[0, len(p) :]
        for p in prompts
    ]
    engine = Engine(mistral, block_size=BLOCK_SIZE, num_blocks=4 * BOUND + 4)
    assert engine.cache.sliding_release_window == WINDOW
    with BlockMeter(mistral, engine.cache) as meter:
        outputs = engine.generate(prompts, max_new_tokens=150, min_new_tokens=150, do_sample=False)
    assert [o.token_ids for o in outputs] == [a.tolist() for a in alone]
    assert max(meter.per_row) <= BOUND
    assert engine.pool.stats().num_used == 0


def test_crop_before_released_blocks_is_refused_and_a_new_prompt_recomputes(mistral):
    cache = PagedCache(mistral, block_size=BLOCK_SIZE, num_blocks=16)
    first = mistral.generate(prompt(20), past_key_values=cache, max_new_tokens=60, do_sample=False)
    assert cache.row_tables[0].num_released > 0
    with pytest.raises(ValueError, match="sliding window"):
        cache.crop(-40)
    cache.crop(-1)  # still inside the window: allowed
    # a prompt diverging early: the cache recomputes it rather than reading released blocks
    other = torch.cat([first[:, :10], prompt(15, seed=5)], dim=1)
    again = mistral.generate(other, past_key_values=cache, max_new_tokens=60, do_sample=False)
    assert torch.equal(again, mistral.generate(other, max_new_tokens=60, do_sample=False))
    cache.release()


# ---------------------------------------------------------------------------------------------------- allocator
def test_release_leading_gives_back_full_leading_blocks_in_order():
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    table = allocator.new_table()
    allocator.append(table, 14)
    assert table.block_ids == [0, 1, 2, 3]
    assert allocator.release_leading(table, 7) == 1  # tokens 0-6 dead: only block 0 is wholly dead
    assert table.block_ids == [None, 1, 2, 3] and table.num_released == 1 and table.num_tokens == 14
    assert allocator.free_block_ids == [4, 5, 6, 7, 0]
    assert allocator.release_leading(table, 8) == 1 and allocator.release_leading(table, 8) == 0
    assert table.block_ids == [None, None, 2, 3] and allocator.free_block_ids == [4, 5, 6, 7, 0, 1]
    assert allocator.stats().num_used == 2 and allocator.stats().tokens_stored == 6
    allocator.append(table, 3)  # fills block 3, then takes block 4
    assert table.block_ids == [None, None, 2, 3, 4]
    allocator.check_invariants()
    allocator.free(table)
    assert allocator.free_block_ids == [5, 6, 7, 0, 1, 2, 3, 4]
    allocator.check_invariants()


def test_release_leading_of_a_shared_block_keeps_it_for_the_other_holder():
    allocator = BlockAllocator(num_blocks=6, block_size=2)
    parent = allocator.new_table()
    allocator.append(parent, 5)
    child = allocator.fork(parent)
    allocator.release_leading(parent, 4)
    assert parent.block_ids == [None, None, 2] and child.block_ids == [0, 1, 2]
    assert [allocator.ref_count(b) for b in range(3)] == [1, 1, 2] and allocator.free_block_ids == [3, 4, 5]
    grandchild = allocator.fork(parent)  # released entries are forked as released
    assert grandchild.block_ids == [None, None, 2] and allocator.ref_count(2) == 3
    allocator.release_leading(child, 2)
    assert allocator.free_block_ids == [3, 4, 5, 0]
    allocator.check_invariants()
    for table in (parent, child, grandchild):
        allocator.free(table)
    allocator.check_invariants()


def test_released_cached_block_stays_findable_as_evictable():
    allocator = BlockAllocator(num_blocks=4, block_size=2)
    table = allocator.new_table()
    allocator.append(table, 3)
    allocator.cache_block(0, b"h0", (5, 6))
    allocator.release_leading(table, 2)
    assert allocator.evictable_block_ids == [0] and allocator.free_block_ids == [2, 3, 0]
    assert allocator.lookup_prefix([(b"h0", (5, 6))]) == [0]
    allocator.free(table)
    allocator.check_invariants()


def test_crop_into_released_blocks_is_refused_and_changes_nothing():
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    table = allocator.new_table()
    allocator.append(table, 14)
    allocator.release_leading(table, 8)
    with pytest.raises(ValueError, match="released"):
        allocator.crop(table, 6)
    assert table.block_ids == [None, None, 2, 3] and table.num_tokens == 14
    allocator.crop(table, 9)
    assert table.block_ids == [None, None, 2] and allocator.free_block_ids == [4, 5, 6, 7, 0, 1, 3]
    allocator.crop(table, 0)
    assert table.block_ids == [] and allocator.num_free == 8
    allocator.free(table)


@pytest.mark.parametrize("dead", [-1, 15, 2.0, True])
def test_release_leading_refuses_bad_counts(dead):
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    table = allocator.new_table()
    allocator.append(table, 14)
    with pytest.raises((ValueError, TypeError), match="num_dead_tokens"):
        allocator.release_leading(table, dead)
    allocator.free(table)


def test_check_invariants_catches_a_released_entry_after_a_live_one():
    allocator = BlockAllocator(num_blocks=4, block_size=2)
    table = allocator.new_table()
    allocator.append(table, 4)
    allocator.release_leading(table, 2)
    table.block_ids[:] = [1, None]  # corrupt: a hole after a live entry
    allocator._ref_counts[0], allocator._ref_counts[1] = 0, 1
    with pytest.raises(InvariantError, match="invariant 8"):
        allocator.check_invariants()
    table.block_ids[:] = [None, 1]
    allocator.free(table)
