"""Layer groups (`KVLayout`): which layers share a block table, how hybrid models (full and sliding-window layers,
Gemma2/3) split, and how one pool's blocks hold one group's layers. Release and exactness on hybrids are in
`test_sliding.py`."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import Step3p7TextConfig

from hf_paged import PagedCache, get_pool
from hf_paged.groups import KVLayout, LayerGroup, layer_kv_shapes, layer_windows
from hf_paged.pool import KVShape
from hf_paged.reference_models import tiny_model

WINDOW = 32
BLOCK_SIZE = 8


def hybrid(family: str):
    return tiny_model(family, sliding_window=WINDOW, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def gemma2():
    return hybrid("gemma2")


def prompt(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------------- layout
def test_layout_of_models_whose_layers_attend_alike_is_one_group():
    assert KVLayout.for_windows([None, None, None]).groups == (LayerGroup((0, 1, 2), None),)
    all_sliding = KVLayout.for_windows([8, 16])
    assert all_sliding.groups == (LayerGroup((0, 1), 16),) and all_sliding.lanes_per_block == 2
    assert all_sliding.lane_of == (0, 1) and all_sliding.windows == [16]


def test_layout_of_alternating_layers_is_two_groups_half_as_wide():
    layout = KVLayout.for_windows([WINDOW, None] * 4)  # Gemma2
    assert [g.layers for g in layout.groups] == [(1, 3, 5, 7), (0, 2, 4, 6)]
    assert layout.windows == [None, WINDOW] and layout.lanes_per_block == 4
    assert layout.group_of == (1, 0) * 4 and layout.lane_of == (0, 0, 1, 1, 2, 2, 3, 3)


def test_layout_of_a_gemma3_1b_pattern_pads_only_the_last_sliding_group():
    windows = [None if layer % 6 == 5 else 512 for layer in range(26)]  # 22 sliding, 4 full
    layout = KVLayout.for_windows(windows)
    assert layout.lanes_per_block == 4 and layout.num_groups == 7
    assert layout.groups[0] == LayerGroup((5, 11, 17, 23), None)
    assert [len(g.layers) for g in layout.groups[1:]] == [4, 4, 4, 4, 4, 2]
    assert sorted(layer for g in layout.groups for layer in g.layers) == list(range(26))
    # every layer has a lane of its group's blocks, no two layers of a group share one
    for group in layout.groups:
        assert sorted(layout.lane_of[layer] for layer in group.layers) == list(range(len(group.layers)))


def test_layout_without_split_keeps_one_group_that_never_skips():
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
    assert sorted(pool.storage.keys) == [0]  # both layers' K/V live in lane 0 of their group's blocks
    assert pool.storage.keys[0].shape == (128, BLOCK_SIZE, 2, 16)
    cache.release()


def test_a_hybrid_whose_layers_differ_in_kv_shape_keeps_one_group():
    model = tiny_model("gemma4")  # sliding layers 2 KV heads x 16, the full layer 1 x 32
    assert layer_kv_shapes(model.config) == [(2, 16), (2, 16), (1, 32)]
    assert KVLayout.for_model(model).num_groups == 1
    shape = KVShape.from_model(model)
    assert shape.layer_kv == ((2, 16), (2, 16), (1, 32))
    assert shape.bytes_per_token == shape.bytes_per_block_token == 2 * (32 + 32 + 32) * 4
    assert KVShape.from_model(tiny_model("gemma3")).layer_kv is None  # every layer alike


@given(st.lists(st.one_of(st.none(), st.integers(1, 64)), min_size=1, max_size=40))
def test_every_layout_places_each_layer_once_in_a_group_of_its_kind(windows):
    layout = KVLayout.for_windows(windows)
    layers = sorted(layer for group in layout.groups for layer in group.layers)
    assert layers == list(range(len(windows)))  # every layer, once
    full = [i for i, w in enumerate(windows) if w is None]
    sliding = [i for i, w in enumerate(windows) if w is not None]
    if not full or not sliding:
        assert layout.num_groups == 1 and layout.lanes_per_block == len(windows)
        assert layout.windows == [max(windows[i] for i in sliding) if sliding else None]
        return
    width = min(len(full), len(sliding))
    assert layout.lanes_per_block == width
    assert layout.num_groups == -(-len(full) // width) + -(-len(sliding) // width)
    kinds = [group.window is None for group in layout.groups]
    assert kinds == sorted(kinds, reverse=True)  # full groups first
    for index, group in enumerate(layout.groups):
        assert all((windows[layer] is None) == (group.window is None) for layer in group.layers)  # one kind
        assert group.window is None or group.window == max(windows[i] for i in sliding)
        assert 1 <= len(group.layers) <= width
        assert [layout.lane_of[layer] for layer in group.layers] == list(range(len(group.layers)))
        assert all(layout.group_of[layer] == index for layer in group.layers)


def test_windows_set_layer_by_layer_in_a_heterogeneous_config():
    """transformers' `per_layer_config` may give a sliding layer a window of its own (reading it globally raises)."""
    config = Step3p7TextConfig(
        num_hidden_layers=4,
        layer_types=["full_attention", "sliding_attention"] * 2,
        sliding_window=4,
        per_layer_config={1: {"sliding_window": 6}},
    )
    assert config.is_heterogeneous
    assert layer_windows(torch.nn.Module(), config) == [None, 6, None, 4]
