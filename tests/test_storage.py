"""KV storage: layout, writes, gathers and block copies."""

from __future__ import annotations

import pytest
import torch

from hf_paged.allocator import BlockCopy
from hf_paged.reference_models import tiny_model
from hf_paged.storage import KVStorage


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


PLACEMENTS = {
    "cpu+disk": ["cpu", "disk", "cpu", "disk"],
    "cuda+cpu+disk": ["cuda:0", "cpu", "disk", "cuda:0"],
}


@pytest.mark.parametrize(
    "placement",
    [
        "cpu+disk",
        pytest.param("cuda+cpu+disk", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    ],
)
@pytest.mark.parametrize("num_beams", [1, 4], ids=["greedy", "beams"])
def test_layers_dispatched_by_accelerate_keep_their_blocks_where_their_kv_is_produced(tmp_path, placement, num_beams):
    """A model loaded with a `device_map` that offloads layers to disk (accelerate's hooks load their weights for
    each forward and run them on the CPU) or spreads them over devices generates exactly as the plain model on
    `DynamicCache`, and each layer's block storage sits where that layer's K/V is computed."""
    from transformers import AutoModelForCausalLM

    from hf_paged import get_pool
    from hf_paged.reference_models import tiny_model

    from .conftest import left_padded_batch

    layers = PLACEMENTS[placement]
    plain = tiny_model("llama", num_hidden_layers=len(layers))
    plain.save_pretrained(tmp_path / "model")
    first = "cuda:0" if layers[0].startswith("cuda") else "cpu"
    device_map = {"model.embed_tokens": first, "model.rotary_emb": first, "model.norm": "cpu", "lm_head": "cpu"}
    device_map.update({f"model.layers.{i}": place for i, place in enumerate(layers)})
    dispatched = AutoModelForCausalLM.from_pretrained(
        tmp_path / "model", device_map=device_map, offload_folder=tmp_path / "offload", dtype=torch.float32
    ).eval()
    assert "disk" in dispatched.hf_device_map.values()
    input_ids, attention_mask = left_padded_batch([5, 11, 8])
    options = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=10,
        num_beams=num_beams,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
    )
    reference = plain.generate(**options)
    paged = dispatched.generate(
        **{**options, "input_ids": input_ids.to(first), "attention_mask": attention_mask.to(first)},
        cache_implementation="paged",
        cache_config={"block_size": 4, "num_blocks": 128},
    )
    assert torch.equal(reference.sequences, paged.sequences.cpu())
    assert max((a - b.cpu()).abs().max().item() for a, b in zip(reference.logits, paged.logits)) <= 1e-5
    storage = get_pool(dispatched).storage
    for index, place in enumerate(layers):
        produced_on = torch.device("cpu" if place == "disk" else place)
        assert storage.device_of(index) == produced_on
        assert storage.values[index].device == produced_on
    paged.past_key_values.release()
    assert get_pool(dispatched).stats().num_used == 0


def test_a_pool_first_used_in_inference_mode_serves_calls_outside_it():
    model = tiny_model("llama")
    prompt = torch.tensor([[1, 2, 3]])
    options = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0, "cache_implementation": "paged"}
    with torch.inference_mode():
        first = model.generate(prompt, **options)
    assert torch.equal(model.generate(prompt, **options), first)
