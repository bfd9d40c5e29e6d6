"""Layer groups of hybrid models (full and sliding-window layers, Gemma2/3): a block table per group per row, the
sliding groups' blocks released behind their window while the full groups keep theirs, one pool shared by all
groups, and output identical to `DynamicCache`."""

from __future__ import annotations

import pytest
import torch

from hf_paged import Engine, KVLayout, LayerGroup, PagedCache, get_pool
from hf_paged.errors import PoolExhaustedError
from hf_paged.pool import KVShape
from hf_paged.prefix import chain, group_roots
from hf_paged.reference_models import tiny_model
from hf_paged.visual import pool_snapshot

from .conftest import left_padded_batch

WINDOW = 32
BLOCK_SIZE = 8
NEW_TOKENS = 400
BOUND = -(-WINDOW // BLOCK_SIZE) + 1  # live blocks of a sliding group per row: W - 1 tokens and the new one
TOLERANCE = 1e-5


def hybrid(family: str):
    return tiny_model(family, sliding_window=WINDOW, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def gemma2():
    return hybrid("gemma2")


@pytest.fixture(scope="module")
def gemma3():
    return hybrid("gemma3")


def prompt(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(seed))


class GroupMeter:
    """After every forward of `model`: the most live blocks any row of `cache` holds, per layer group."""

    def __init__(self, model, cache):
        self.cache, self.per_group = cache, []
        self.handle = model.register_forward_hook(self._record)

    def _record(self, module, args, output):
        self.per_group.append([max(len(t.live_block_ids) for t in tables) for tables in self.cache.group_tables])

    def most(self, group: int) -> int:
        return max(sample[group] for sample in self.per_group)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def run_both(model, input_ids, attention_mask=None, num_blocks=512, window=None, **options):
    """`(DynamicCache output, paged output, meter)` of the same `generate` call (logits kept)."""
    options = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "pad_token_id": 0, **options}
    options.update(return_dict_in_generate=True, output_logits=True)
    if options.get("do_sample"):
        torch.manual_seed(7)
    reference = model.generate(input_ids, attention_mask=attention_mask, **options)
    cache = PagedCache(model, block_size=BLOCK_SIZE, num_blocks=num_blocks)
    if window is not None:
        cache.sliding_release_window = window
    if options.get("do_sample"):
        torch.manual_seed(7)
    with GroupMeter(model, cache) as meter:
        paged = model.generate(input_ids, attention_mask=attention_mask, past_key_values=cache, **options)
    cache.release()
    cache.pool.check_invariants()
    assert cache.pool.stats().num_used == 0
    return reference, paged, meter


def logits_gap(reference, paged) -> float:
    return max((a - b).abs().max().item() for a, b in zip(reference.logits, paged.logits))


def full_blocks(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


# ------------------------------------------------------------------------------------------------------- layout
def test_layout_of_models_whose_layers_attend_alike_is_one_group():
    assert KVLayout.for_windows([None, None, None]).groups == (LayerGroup((0, 1, 2), None),)
    all_sliding = KVLayout.for_windows([8, 16])
    assert all_sliding.groups == (LayerGroup((0, 1), 16),) and all_sliding.slots_per_block == 2
    assert all_sliding.slot_of == (0, 1) and all_sliding.windows == [16]


def test_layout_of_alternating_layers_is_two_groups_half_as_wide():
    layout = KVLayout.for_windows([WINDOW, None] * 4)  # Gemma2
    assert [g.layers for g in layout.groups] == [(1, 3, 5, 7), (0, 2, 4, 6)]
    assert layout.windows == [None, WINDOW] and layout.slots_per_block == 4
    assert layout.group_of == (1, 0) * 4 and layout.slot_of == (0, 0, 1, 1, 2, 2, 3, 3)


def test_layout_of_a_gemma3_1b_pattern_pads_only_the_last_sliding_group():
    windows = [None if layer % 6 == 5 else 512 for layer in range(26)]  # 22 sliding, 4 full
    layout = KVLayout.for_windows(windows)
    assert layout.slots_per_block == 4 and layout.num_groups == 7
    assert layout.groups[0] == LayerGroup((5, 11, 17, 23), None)
    assert [len(g.layers) for g in layout.groups[1:]] == [4, 4, 4, 4, 4, 2]
    assert sorted(layer for g in layout.groups for layer in g.layers) == list(range(26))
    # every layer has a slot of its group's blocks, no two layers of a group share one
    for group in layout.groups:
        assert sorted(layout.slot_of[layer] for layer in group.layers) == list(range(len(group.layers)))


def test_layout_without_split_keeps_one_group_that_never_releases():
    layout = KVLayout.for_windows([WINDOW, None], split=False)
    assert layout.groups == (LayerGroup((0, 1), None),) and layout.windows == [None]


def test_a_hybrid_spread_over_several_devices_keeps_one_group():
    model = tiny_model("gemma2")
    assert KVLayout.for_model(model).num_groups == 2
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu"}
    assert KVLayout.for_model(model).num_groups == 1
    model.hf_device_map = {"model.layers.0": "cpu", "model.layers.1": "disk"}  # offloaded layers compute on CPU
    assert KVLayout.for_model(model).num_groups == 2


def test_hybrid_pool_blocks_hold_one_group_of_layers(gemma2):
    shape = KVShape.from_model(gemma2, layers_per_block=1)
    assert shape.bytes_per_block_token * 2 == shape.bytes_per_token  # 2 layers, 1 per block
    model = hybrid("gemma2")
    pool = get_pool(model, block_size=BLOCK_SIZE, max_memory=64 * BLOCK_SIZE * shape.bytes_per_token)
    assert pool.num_blocks == 128  # the same bytes buy twice the blocks, each half as large
    cache = PagedCache(model)
    model.generate(prompt(5), past_key_values=cache, max_new_tokens=2, do_sample=False)
    assert sorted(pool.storage.keys) == [0]  # both layers' K/V live in slot 0 of their group's blocks
    assert pool.storage.keys[0].shape == (128, BLOCK_SIZE, 2, 16)
    cache.release()


# -------------------------------------------------------------------------------------------- release, exactness
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


def test_hybrid_fits_a_pool_that_only_release_makes_big_enough(gemma2):
    # the full group needs 53 blocks, the sliding group at most BOUND; without release it would need 53 too
    tight = 53 + BOUND
    reference, paged, _ = run_both(gemma2, prompt(20), num_blocks=tight)
    assert torch.equal(reference.sequences, paged.sequences)
    cache = PagedCache(gemma2, block_size=BLOCK_SIZE, num_blocks=tight)
    cache.sliding_release_window = None
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


def test_negative_control_releasing_one_token_too_many_changes_the_output(gemma2):
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
    assert full.num_released == 0 and sliding.num_released > 96 // BLOCK_SIZE - BOUND
    again.release()
    again.pool.check_invariants()


def test_a_prefix_whose_head_was_evicted_is_still_a_hit_for_the_sliding_groups(gemma3):
    # Gemma3's layout: the full layer in group 0, each sliding layer in a group of its own
    cache = PagedCache(gemma3, block_size=BLOCK_SIZE, num_blocks=256)
    text = gemma3.generate(prompt(80, seed=8), past_key_values=cache, max_new_tokens=60, do_sample=False)
    cache.release()  # 139 tokens stored; blocks 0-16 are full and cached in every group
    allocator = cache.pool.allocator
    # the first decode step gave back blocks 0-5 of both sliding groups (tokens 0-47, behind the window of token
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
    engine = Engine(gemma2, block_size=BLOCK_SIZE, num_blocks=4 * (full_blocks(27 + 120) + BOUND) + 8)
    assert engine.scheduler.windows == [None, WINDOW]
    with GroupMeter(gemma2, engine.cache) as meter:
        outputs = engine.generate(prompts, max_new_tokens=120, min_new_tokens=120, do_sample=False)
    assert [o.token_ids for o in outputs] == [a.tolist() for a in alone]
    assert meter.most(1) <= BOUND
    assert engine.pool.stats().num_used == 0
    engine.pool.check_invariants()


def test_engine_on_a_hybrid_reuses_a_long_shared_prefix(gemma3):
    system = prompt(100, seed=20)[0].tolist()
    first, second = system + [5, 6, 7], system + [9, 10]
    engine = Engine(gemma3, block_size=BLOCK_SIZE, num_blocks=256)
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
