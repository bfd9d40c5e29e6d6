"""KV storage: layout, writes, gathers and block copies."""

from __future__ import annotations

import pytest
import torch

from hf_paged import BlockCopy, KVStorage


def test_layout_is_blocks_by_slots_by_heads_by_dim():
    storage = KVStorage(num_blocks=5, block_size=4)
    storage.ensure_layer(3, torch.zeros(1, 2, 8, dtype=torch.float16))
    assert storage.keys[3].shape == (5, 4, 2, 8) and storage.values[3].dtype == torch.float16
    assert storage.nbytes == 2 * 5 * 4 * 2 * 8 * 2


def test_write_then_gather_round_trips_through_scattered_slots():
    storage = KVStorage(num_blocks=6, block_size=2)
    keys = torch.randn(5, 3, 4)
    values = torch.randn(5, 3, 4)
    slots = torch.tensor([10, 11, 2, 7, 0])
    storage.write(0, slots, keys, values)
    got_keys, got_values = storage.gather(0, torch.tensor([[10, 11, 2], [7, 0, 0]]))
    assert got_keys.shape == (2, 3, 3, 4)
    assert torch.equal(got_keys[0].transpose(0, 1), keys[:3])
    assert torch.equal(got_values[1, :, :2].transpose(0, 1), values[3:])
    assert torch.equal(got_values[1, :, 2], values[4])


def test_copy_blocks_copies_whole_blocks_in_every_layer():
    storage = KVStorage(num_blocks=4, block_size=2)
    for layer in (0, 1):
        storage.write(layer, torch.arange(4), torch.randn(4, 1, 2), torch.randn(4, 1, 2))
    storage.copy_blocks([BlockCopy(src=1, dst=3)])
    for layer in (0, 1):
        assert torch.equal(storage.keys[layer][3], storage.keys[layer][1])
        assert torch.equal(storage.values[layer][3], storage.values[layer][1])


def test_mismatched_dtype_or_shape_is_refused_with_both_named():
    storage = KVStorage(num_blocks=2, block_size=2)
    storage.ensure_layer(0, torch.zeros(1, 2, 8))
    with pytest.raises(
        ValueError, match="holds 2 heads x 8 dims of torch.float32 .* produced 2 heads x 8 dims of torch.bfloat16"
    ):
        storage.ensure_layer(0, torch.zeros(1, 2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="produced 4 heads x 8 dims"):
        storage.ensure_layer(0, torch.zeros(1, 4, 8))
