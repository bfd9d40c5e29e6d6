"""Sliding windows give back the blocks they skip. A model whose every layer slides over the last W positions
(Mistral-style) gives a row's blocks its window skipped back to the pool during generation, so a long generation holds
about ceil(W / block_size) + 1 blocks per row; a hybrid model (Gemma2/3: full and sliding layers) does the same in the
block tables of its sliding layer groups while the full groups keep every block. Either way it generates exactly what
`DynamicCache` generates."""

from __future__ import annotations

import pytest
import torch

from hf_paged import BlockAllocator, Engine, PagedCache, get_pool
from hf_paged.errors import InvariantError, PoolExhaustedError
from hf_paged.prefix import chain, group_roots
from hf_paged.reference_models import tiny_model
from hf_paged.visual import pool_snapshot

from .conftest import left_padded_batch

pytestmark = pytest.mark.kernel_matrix  # every test runs on the in-place kernel and on gather

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


def hybrid(family: str):
    return tiny_model(family, sliding_window=WINDOW, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def gemma2():
    return hybrid("gemma2")


@pytest.fixture(scope="module")
def gemma3():
    return hybrid("gemma3")


class BlockMeter:
    """Records, after every forward of `model`: the most live blocks any row of `cache` holds in each layer group
    (`per_group`) and in any sliding group (`per_row`), and the distinct blocks the cache holds."""

    def __init__(self, model, cache):
        self.cache, self.per_group, self.per_row, self.distinct = cache, [], [], []
        self.handle = model.register_forward_hook(self._record)

    def _record(self, module, args, output):
        per_group = [max(len(t.live_block_ids) for t in tables) for tables in self.cache.group_tables]
        layout = self.cache.layout
        sliding = [count for count, group in zip(per_group, layout.groups) if layout.layer_windows[group.layers[-1]]]
        self.per_group.append(per_group)
        self.per_row.append(max(sliding))
        self.distinct.append(len({b for tables in self.cache.group_tables for t in tables for b in t.live_block_ids}))

    def most(self, group: int) -> int:
        return max(sample[group] for sample in self.per_group)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def run_both(model, input_ids, attention_mask=None, num_blocks=512, window=None, **options):
    """`(DynamicCache output, paged output, meter)` of the same `generate` call (logits kept); `window` overrides
    the skip window."""
    options = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "pad_token_id": 0, **options}
    options.update(return_dict_in_generate=True, output_logits=True)
    if options.get("do_sample"):
        torch.manual_seed(7)
    reference = model.generate(input_ids, attention_mask=attention_mask, **options)
    cache = PagedCache(model, block_size=BLOCK_SIZE, num_blocks=num_blocks)
    if window is not None:
        cache.skip_window = window
    if options.get("do_sample"):
        torch.manual_seed(7)
    with BlockMeter(model, cache) as meter:
        paged = model.generate(input_ids, attention_mask=attention_mask, past_key_values=cache, **options)
    if None not in cache.layout.windows:  # every layer slides: the whole cache stays within the bound
        assert cache.row_tables and cache.stats().num_blocks <= len(cache.row_tables) * BOUND
    cache.release()
    cache.pool.check_invariants()
    assert cache.pool.stats().num_used == 0
    return reference, paged, meter


def logits_gap(reference, paged) -> float:
    return max((a - b).abs().max().item() for a, b in zip(reference.logits, paged.logits))


def prompt(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(seed))


def full_blocks(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def test_skip_windows_follow_the_layer_groups(mistral):
    cache = PagedCache(mistral, block_size=BLOCK_SIZE, num_blocks=16)
    assert cache.skip_window == WINDOW and cache.layout.windows == [WINDOW]
    assert PagedCache(tiny_model("mistral"), num_blocks=16).skip_window is None  # no window
    hybrid = PagedCache(tiny_model("gemma2"), num_blocks=16)  # full + sliding layers: one group of each
    assert hybrid.layout.windows == [None, 6] and hybrid.skip_window == 6
    hybrid.skip_window = None
    assert hybrid.layout.windows == [None, None]


def test_greedy_400_tokens_match_dynamic_cache_in_a_pool_too_small_to_keep_every_block(mistral):
    # 20 + 400 tokens need 53 blocks without skipping; the pool has 8
    reference, paged, meter = run_both(mistral, prompt(20), num_blocks=8)
    assert torch.equal(reference.sequences, paged.sequences)
    assert logits_gap(reference, paged) <= TOLERANCE
    assert len(meter.per_row) == NEW_TOKENS and max(meter.per_row) <= BOUND
    assert max(meter.per_row[WINDOW:]) == BOUND  # the bound is reached


def test_without_skipping_the_row_keeps_every_block(mistral):
    cache = PagedCache(mistral, block_size=BLOCK_SIZE, num_blocks=64)
    cache.skip_window = None
    with BlockMeter(mistral, cache) as meter:
        mistral.generate(prompt(20), past_key_values=cache, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    assert max(meter.per_row) == -(-(20 + NEW_TOKENS - 1) // BLOCK_SIZE) == 53
    cache.release()
    small = PagedCache(mistral, block_size=BLOCK_SIZE, num_blocks=8)
    small.skip_window = None
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


def test_negative_control_skipping_one_token_too_many_changes_the_output(mistral):
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
    engine = Engine(mistral, block_size=BLOCK_SIZE, num_blocks=4 * BOUND + 4, exact=True)
    assert engine.skip_window == WINDOW
    with BlockMeter(mistral, engine.cache) as meter:
        outputs = engine.generate(prompts, max_new_tokens=150, min_new_tokens=150, do_sample=False)
    assert [o.token_ids for o in outputs] == [a.tolist() for a in alone]
    assert max(meter.per_row) <= BOUND
    assert engine.pool.stats().num_used == 0


def test_engine_counts_the_blocks_a_sliding_window_gives_back_as_free():
    # window 33, blocks of 8: every 8th step the forward gives back a block and takes one. Before it the row holds
    # 5 blocks; a pool of 5 has no free block then, and counting only free blocks the request would fail
    model = tiny_model("mistral", sliding_window=33, max_position_embeddings=1024)
    request = prompt(5, seed=30)[0].tolist()
    alone = model.generate(torch.tensor([request]), max_new_tokens=150, min_new_tokens=150, do_sample=False)
    engine = Engine(model, block_size=BLOCK_SIZE, num_blocks=5, exact=True)
    (output,) = engine.generate([request], max_new_tokens=150, min_new_tokens=150, do_sample=False)
    assert output.finish_reason == "length" and output.token_ids == alone[0, 5:].tolist()
    assert engine.stats().preemptions == 0 and engine.pool.stats().num_used == 0


def test_chunked_prefill_runs_a_prompt_far_larger_than_the_pool(mistral, gemma3):
    # a 400-token prompt in chunks of 16: a sliding row holds its window and one chunk, 7 blocks of 8, at most
    request = prompt(400, seed=31)[0].tolist()
    alone = mistral.generate(torch.tensor([request]), max_new_tokens=40, min_new_tokens=40, do_sample=False)
    engine = Engine(mistral, block_size=BLOCK_SIZE, num_blocks=8, max_prefill_tokens=16, exact=True)
    assert engine.planner.blocks_to_run(400, chunk=16) == 7
    with BlockMeter(mistral, engine.cache) as meter:
        (output,) = engine.generate([request], max_new_tokens=40, min_new_tokens=40, do_sample=False)
    assert output.token_ids == alone[0, 400:].tolist() and max(meter.per_row) <= 7
    assert engine.stats().prefill_steps == 25 and engine.pool.stats().num_used == 0
    # a hybrid's full layers keep every block: 51 blocks for them, 7 for each sliding group
    hybrid_engine = Engine(gemma3, block_size=BLOCK_SIZE, num_blocks=64, max_prefill_tokens=16, exact=True)
    assert hybrid_engine.planner.blocks_to_run(400, chunk=16) == 51 + 2 * 7
    assert "needs 65 blocks of 8 tokens over its 3 layer groups" in hybrid_engine.scheduler.never_fits(400)
    hybrid_engine = Engine(gemma3, block_size=BLOCK_SIZE, num_blocks=72, max_prefill_tokens=16, exact=True)
    (output,) = hybrid_engine.generate([request], max_new_tokens=20, min_new_tokens=20, do_sample=False)
    alone = gemma3.generate(torch.tensor([request]), max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert output.token_ids == alone[0, 400:].tolist() and hybrid_engine.pool.stats().num_used == 0


def test_crop_before_skipped_blocks_is_refused_and_a_new_prompt_recomputes(mistral):
    cache = PagedCache(mistral, block_size=BLOCK_SIZE, num_blocks=16)
    first = mistral.generate(prompt(20), past_key_values=cache, max_new_tokens=60, do_sample=False)
    assert cache.row_tables[0].num_skipped > 0
    with pytest.raises(ValueError, match="sliding window"):
        cache.crop(-40)
    cache.crop(-1)  # still inside the window: allowed
    # a prompt diverging early: the cache recomputes it rather than reading skipped blocks
    other = torch.cat([first[:, :10], prompt(15, seed=5)], dim=1)
    again = mistral.generate(other, past_key_values=cache, max_new_tokens=60, do_sample=False)
    assert torch.equal(again, mistral.generate(other, max_new_tokens=60, do_sample=False))
    cache.release()


# ------------------------------------------------------------------------------------------------------ hybrids
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_greedy_400_tokens_match_dynamic_cache_and_sliding_groups_hold_the_window(family, gemma2, gemma3):
    model = {"gemma2": gemma2, "gemma3": gemma3}[family]
    layout = get_pool(model, block_size=BLOCK_SIZE, num_blocks=512).layout
    reference, paged, meter = run_both(model, prompt(20))
    assert torch.equal(reference.sequences, paged.sequences)
    assert logits_gap(reference, paged) <= TOLERANCE
    for group, window in enumerate(layout.windows):
        if window is None:  # full attention: every block of the 419 stored tokens
            assert meter.most(group) == full_blocks(20 + NEW_TOKENS - 1) == 53
        else:
            assert meter.most(group) == BOUND


def test_hybrid_fits_a_pool_that_only_skipping_makes_big_enough(gemma2):
    # the full group needs 53 blocks, the sliding group at most BOUND; without skipping it would need 53 too
    tight = 53 + BOUND
    reference, paged, _ = run_both(gemma2, prompt(20), num_blocks=tight)
    assert torch.equal(reference.sequences, paged.sequences)
    cache = PagedCache(gemma2, block_size=BLOCK_SIZE, num_blocks=tight)
    cache.skip_window = None
    with pytest.raises(PoolExhaustedError):
        gemma2.generate(prompt(20), past_key_values=cache, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    cache.release()
    cache.pool.check_invariants()


def test_left_padded_batch_sampling_and_beams_match_dynamic_cache(gemma3):
    input_ids, attention_mask = left_padded_batch([20, 13], seed=1)
    reference, paged, meter = run_both(gemma3, input_ids, attention_mask, max_new_tokens=150, min_new_tokens=150)
    assert torch.equal(reference.sequences, paged.sequences) and logits_gap(reference, paged) <= TOLERANCE
    assert meter.most(1) <= BOUND and meter.most(2) <= BOUND
    options = {"do_sample": True, "top_k": 20, "max_new_tokens": 150, "min_new_tokens": 150}
    reference, paged, _ = run_both(gemma3, prompt(17, seed=2), **options)
    assert torch.equal(reference.sequences, paged.sequences)
    options = {"num_beams": 4, "do_sample": False, "output_scores": True, "max_new_tokens": 120}
    reference, paged, meter = run_both(gemma3, prompt(12, seed=3), min_new_tokens=120, **options)
    assert torch.equal(reference.sequences, paged.sequences)
    assert (reference.sequences_scores - paged.sequences_scores).abs().max() <= TOLERANCE
    assert meter.most(1) <= BOUND


def test_negative_control_on_a_hybrid_skipping_one_token_too_many_changes_the_output(gemma2):
    reference, paged, _ = run_both(gemma2, prompt(20), window=WINDOW - 1, max_new_tokens=120, min_new_tokens=120)
    assert not torch.equal(reference.sequences, paged.sequences) or logits_gap(reference, paged) > 1e-3


# ------------------------------------------------------------------------------------------------ prefix sharing
def test_a_long_shared_prefix_is_reused_the_sliding_groups_keep_only_its_window(gemma2):
    system = prompt(96, seed=4)
    first = torch.cat([system, prompt(5, seed=5)], dim=1)
    second = torch.cat([system, prompt(7, seed=6)], dim=1)
    cache = PagedCache(gemma2, block_size=BLOCK_SIZE, num_blocks=256)
    gemma2.generate(first, past_key_values=cache, max_new_tokens=4, do_sample=False)
    cache.release()
    again = PagedCache(gemma2, block_size=BLOCK_SIZE, num_blocks=256)
    out = gemma2.generate(second, past_key_values=again, max_new_tokens=40, do_sample=False)
    assert torch.equal(out, gemma2.generate(second, max_new_tokens=40, do_sample=False))
    assert again.stats().prefix_tokens_reused == 96  # 12 full blocks of the system prompt in every group
    full, sliding = again.group_tables[0][0], again.group_tables[1][0]
    assert full.num_skipped == 0 and sliding.num_skipped > 96 // BLOCK_SIZE - BOUND
    again.release()
    again.pool.check_invariants()


def test_batch_rows_with_different_cached_prefixes_share_the_shorter_one(gemma2):
    system = prompt(96, seed=11)
    cache = PagedCache(gemma2, block_size=BLOCK_SIZE, num_blocks=512)  # the pool of run_both
    gemma2.generate(torch.cat([system, prompt(4, seed=12)], dim=1), past_key_values=cache, max_new_tokens=1)
    cache.release()
    # row 0 finds 96 cached tokens, row 1 only 40: both start from 40, and row 0's sliding table must then hold
    # the window of token 40, not of token 96
    batch = torch.cat(
        [torch.cat([system, prompt(6, seed=13)], dim=1), torch.cat([system[:, :40], prompt(62, seed=14)], dim=1)]
    )
    again = PagedCache(gemma2, block_size=BLOCK_SIZE, num_blocks=512)
    assert again.start_from_prompt(batch) == 40
    sliding = again.group_tables[1]  # the window of token 40 starts in block 1
    assert sliding[0].block_ids[0] is None and sliding[0].block_ids == sliding[1].block_ids
    assert None not in sliding[0].block_ids[1:] and len(sliding[0].block_ids) == 5
    again.release()
    reference, paged, _ = run_both(gemma2, batch, max_new_tokens=60, min_new_tokens=60)
    assert torch.equal(reference.sequences, paged.sequences) and logits_gap(reference, paged) <= TOLERANCE
    assert get_pool(gemma2).last_cache_stats.prefix_tokens_reused == 2 * 40


def test_a_prefix_whose_head_was_evicted_is_still_a_hit_for_the_sliding_groups(gemma3):
    # Gemma3's layout: the full layer in group 0, each sliding layer in a group of its own
    cache = PagedCache(gemma3, block_size=BLOCK_SIZE, num_blocks=256)
    text = gemma3.generate(prompt(80, seed=8), past_key_values=cache, max_new_tokens=60, do_sample=False)
    cache.release()  # 139 tokens stored; blocks 0-16 are full and cached in every group
    allocator = cache.pool.allocator
    # the first decode step gave back blocks 0-5 of both sliding groups (tokens 0-47, skipped by the window of token
    # 80): the 12 oldest evictable blocks. Take every free block and those 12
    stats = allocator.stats()
    hog = allocator.new_table()
    allocator.append(hog, (stats.num_free - stats.num_evictable + 12) * BLOCK_SIZE)
    roots = group_roots(cache.prefix_root, 3)
    links = [chain(root, text[0, :136].tolist(), BLOCK_SIZE) for root in roots]
    found = [allocator.lookup_blocks(group_links) for group_links in links]
    assert None not in found[0] and [f[:6] for f in found[1:]] == [[None] * 6] * 2
    assert None not in found[1][13:] + found[2][13:]
    allocator.free(hog)
    # the window of a 136-token hit starts at block 13: the evicted heads are not needed
    reused = PagedCache(gemma3, block_size=BLOCK_SIZE, num_blocks=256)
    out = gemma3.generate(text, past_key_values=reused, max_new_tokens=30, do_sample=False)
    assert torch.equal(out, gemma3.generate(text, max_new_tokens=30, do_sample=False))
    assert reused.stats().prefix_tokens_reused == 136
    reused.release()
    allocator.check_invariants()


# ------------------------------------------------------------------------------------------------- engine, views
def test_engine_on_a_hybrid_matches_generate_alone_and_holds_the_window(gemma2):
    prompts = [prompt(length, seed=10 + length)[0].tolist() for length in (5, 18, 27, 9)]
    alone = [
        gemma2.generate(torch.tensor([p]), max_new_tokens=120, min_new_tokens=120, do_sample=False)[0, len(p) :]
        for p in prompts
    ]
    engine = Engine(gemma2, block_size=BLOCK_SIZE, num_blocks=4 * (full_blocks(27 + 120) + BOUND) + 8, exact=True)
    assert engine.planner.layout.windows == [None, WINDOW]
    with BlockMeter(gemma2, engine.cache) as meter:
        outputs = engine.generate(prompts, max_new_tokens=120, min_new_tokens=120, do_sample=False)
    assert [o.token_ids for o in outputs] == [a.tolist() for a in alone]
    assert meter.most(1) <= BOUND
    assert engine.pool.stats().num_used == 0
    engine.pool.check_invariants()


def test_engine_follows_a_skip_window_set_on_it(gemma2):
    request = prompt(20, seed=50)[0].tolist()
    alone = gemma2.generate(torch.tensor([request]), max_new_tokens=60, min_new_tokens=60, do_sample=False)
    engine = Engine(gemma2, block_size=BLOCK_SIZE, num_blocks=64, exact=True)
    engine.skip_window = None  # keep every block
    with BlockMeter(gemma2, engine.cache) as meter:
        (output,) = engine.generate([request], max_new_tokens=60, min_new_tokens=60, do_sample=False)
    assert engine.planner.layout.windows == [None, None] and output.token_ids == alone[0, 20:].tolist()
    assert max(meter.per_row) == full_blocks(20 + 60 - 1) == 10  # the sliding group kept every block too


def test_engine_on_a_hybrid_stays_exact_through_preemption(gemma2):
    # 8 requests would hold about 8 x (17 + 5) blocks at the end; the pool has 60: requests are preempted and
    # recomputed (under this pressure their cached blocks are mostly evicted before they come back)
    prompts = [prompt(length, seed=40 + length)[0].tolist() for length in (5, 30, 12, 22, 9, 27, 16, 3)]
    alone = [
        gemma2.generate(torch.tensor([p]), max_new_tokens=100, min_new_tokens=100, do_sample=False)[0, len(p) :]
        for p in prompts
    ]
    engine = Engine(gemma2, block_size=BLOCK_SIZE, num_blocks=60, exact=True)
    outputs = engine.generate(prompts, max_new_tokens=100, min_new_tokens=100, do_sample=False)
    assert [o.token_ids for o in outputs] == [a.tolist() for a in alone]
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.peak_blocks <= 60
    assert engine.pool.stats().num_used == 0
    engine.pool.check_invariants()


def test_engine_on_a_hybrid_reuses_a_long_shared_prefix(gemma3):
    system = prompt(100, seed=20)[0].tolist()
    first, second = system + [5, 6, 7], system + [9, 10]
    engine = Engine(gemma3, block_size=BLOCK_SIZE, num_blocks=256, exact=True)
    engine.generate([first], max_new_tokens=40, do_sample=False)
    (output,) = engine.generate([second], max_new_tokens=40, do_sample=False)
    alone = gemma3.generate(torch.tensor([second]), max_new_tokens=40, do_sample=False)[0, len(second) :]
    assert output.token_ids == alone.tolist()
    assert output.prefix_tokens_reused == 96  # 12 full blocks of the 100-token system prompt
    assert engine.pool.stats().num_used == 0
    engine.pool.check_invariants()


def test_snapshot_of_a_hybrid_cache_labels_every_group(gemma2):
    cache = PagedCache(gemma2, block_size=BLOCK_SIZE, num_blocks=64)
    gemma2.generate(prompt(12), past_key_values=cache, max_new_tokens=2, do_sample=False)
    snapshot = pool_snapshot(cache)
    assert snapshot.labels == ("row 0 group 0", "row 0 group 1")
    assert snapshot.tables == tuple(tuple(t.block_ids) for tables in cache.group_tables for t in tables)
    cache.release()


# ---------------------------------------------------------------------------------------------------- allocator
def test_free_skipped_gives_back_full_leading_blocks_in_order():
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    table = allocator.new_table()
    allocator.append(table, 14)
    assert table.block_ids == [0, 1, 2, 3]
    assert allocator.free_skipped(table, 7) == 1  # tokens 0-6 skipped: only block 0 is wholly skipped
    assert table.block_ids == [None, 1, 2, 3] and table.num_skipped == 1 and table.num_tokens == 14
    assert allocator.free_block_ids == [4, 5, 6, 7, 0]
    assert allocator.free_skipped(table, 8) == 1 and allocator.free_skipped(table, 8) == 0
    assert table.block_ids == [None, None, 2, 3] and allocator.free_block_ids == [4, 5, 6, 7, 0, 1]
    assert allocator.stats().num_used == 2 and allocator.stats().tokens_stored == 6
    allocator.append(table, 3)  # fills block 3, then takes block 4
    assert table.block_ids == [None, None, 2, 3, 4]
    allocator.check_invariants()
    allocator.free(table)
    assert allocator.free_block_ids == [5, 6, 7, 0, 1, 2, 3, 4]
    allocator.check_invariants()


def test_free_skipped_of_a_shared_block_keeps_it_for_the_other_holder():
    allocator = BlockAllocator(num_blocks=6, block_size=2)
    parent = allocator.new_table()
    allocator.append(parent, 5)
    child = allocator.fork(parent)
    allocator.free_skipped(parent, 4)
    assert parent.block_ids == [None, None, 2] and child.block_ids == [0, 1, 2]
    assert [allocator.ref_count(b) for b in range(3)] == [1, 1, 2] and allocator.free_block_ids == [3, 4, 5]
    grandchild = allocator.fork(parent)  # skipped entries are forked as skipped
    assert grandchild.block_ids == [None, None, 2] and allocator.ref_count(2) == 3
    allocator.free_skipped(child, 2)
    assert allocator.free_block_ids == [3, 4, 5, 0]
    allocator.check_invariants()
    for table in (parent, child, grandchild):
        allocator.free(table)
    allocator.check_invariants()


def test_skipped_cached_block_stays_findable_as_evictable():
    allocator = BlockAllocator(num_blocks=4, block_size=2)
    table = allocator.new_table()
    allocator.append(table, 3)
    allocator.cache_block(0, b"h0", (5, 6))
    allocator.free_skipped(table, 2)
    assert allocator.evictable_block_ids == [0] and allocator.free_block_ids == [2, 3, 0]
    assert allocator.lookup_prefix([(b"h0", (5, 6))]) == [0]
    allocator.free(table)
    allocator.check_invariants()


def test_truncate_into_skipped_blocks_is_refused_and_changes_nothing():
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    table = allocator.new_table()
    allocator.append(table, 14)
    allocator.free_skipped(table, 8)
    with pytest.raises(ValueError, match="skipped"):
        allocator.truncate(table, 6)
    assert table.block_ids == [None, None, 2, 3] and table.num_tokens == 14
    allocator.truncate(table, 9)
    assert table.block_ids == [None, None, 2] and allocator.free_block_ids == [4, 5, 6, 7, 0, 1, 3]
    allocator.truncate(table, 0)
    assert table.block_ids == [] and allocator.num_free == 8
    allocator.free(table)


@pytest.mark.parametrize("skipped", [-1, 15, 2.0, True])
def test_free_skipped_refuses_bad_counts(skipped):
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    table = allocator.new_table()
    allocator.append(table, 14)
    with pytest.raises((ValueError, TypeError), match="num_skipped_tokens"):
        allocator.free_skipped(table, skipped)
    allocator.free(table)


def test_check_invariants_catches_a_skipped_entry_after_a_live_one():
    allocator = BlockAllocator(num_blocks=4, block_size=2)
    table = allocator.new_table()
    allocator.append(table, 4)
    allocator.free_skipped(table, 2)
    table.block_ids[:] = [1, None]  # corrupt: a hole after a live entry
    allocator._ref_counts[0], allocator._ref_counts[1] = 0, 1
    with pytest.raises(InvariantError, match="invariant 8"):
        allocator.check_invariants()
    table.block_ids[:] = [None, 1]
    allocator.free(table)
