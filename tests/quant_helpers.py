"""The reference for quantized pages: a stock `DynamicCache` whose layers store every token's K/V as the pages would
give it back (quantized and dequantized by the same `KVFormat`), so paged generation in a quantized format can be
held token-identical to stock `generate` on the same K/V values."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from hf_paged.channel_keys import round_trip_key_blocks
from hf_paged.kv_format import kv_format


def round_trip_cache(model: torch.nn.Module, kv_dtype: str) -> DynamicCache:
    """A `DynamicCache` for `model` that stores K/V through `kv_format(kv_dtype).round_trip`."""
    fmt = kv_format(kv_dtype)
    cache = DynamicCache(config=model.config)
    for layer in cache.layers:
        update = layer.update

        def quantized_update(keys, values, *args, _update=update, **kwargs):
            return _update(fmt.round_trip(keys), fmt.round_trip(values), *args, **kwargs)

        layer.update = quantized_update
    return cache


def generate_round_trip(model: torch.nn.Module, kv_dtype: str, input_ids: torch.Tensor, **kwargs):
    """Stock `generate` over a `round_trip_cache` (beam search expands and reorders it as any `DynamicCache`)."""
    return model.generate(input_ids, past_key_values=round_trip_cache(model, kv_dtype), **kwargs)


def staged_round_trip_cache(model: torch.nn.Module, block_size: int, pads: list[int] | None = None) -> DynamicCache:
    """A `DynamicCache` for `model` holding K/V as `kv_dtype="int4-channel"` pages give them back: values quantized
    per token as `"int4"`; keys exact in the layer, read back with every full block of `block_size` tokens of a row
    (counted from its first token after `pads[row]` left pads, which the pages do not store) quantized per channel,
    and the open block's keys exact. Rows repeated by beam search keep their source row's pads."""
    values_format = kv_format("int4")
    cache = DynamicCache(config=model.config)
    for layer in cache.layers:
        update = layer.update
        exact: list[torch.Tensor] = []  # a sliding layer's every key (it keeps only its window; blocks need all)

        def staged_update(keys, values, *args, _update=update, _exact=exact, **kwargs):
            stored_keys, stored_values = _update(keys, values_format.round_trip(values), *args, **kwargs)
            if not hasattr(_update.__self__, "sliding_window"):
                return read_back_keys(stored_keys, block_size, pads), stored_values
            if _exact and _exact[0].shape[0] != keys.shape[0]:
                raise NotImplementedError("this reference follows a sliding layer's rows only while they stay put")
            _exact[:] = [torch.cat([*_exact, keys], dim=2)]
            return read_back_keys(_exact[0], block_size, pads)[:, :, -stored_keys.shape[2] :], stored_values

        layer.update = staged_update
    return cache


def read_back_keys(keys: torch.Tensor, block_size: int, pads: list[int] | None) -> torch.Tensor:
    """`keys` (`[batch, heads, length, head_dim]`, exact) with every row's full blocks quantized per channel."""
    out = keys.clone()
    batch = keys.shape[0]
    pads = [0] * batch if pads is None else [pads[row * len(pads) // batch] for row in range(batch)]
    for row, pad in enumerate(pads):
        real = keys[row, :, pad:]  # [H, L, D]
        full = real.shape[1] // block_size * block_size
        if full:
            heads, _, dim = real.shape
            blocks = real[:, :full].reshape(heads, full // block_size, block_size, dim).permute(1, 2, 0, 3)
            back = round_trip_key_blocks(blocks).permute(2, 0, 1, 3).reshape(heads, full, dim)
            out[row, :, pad : pad + full] = back
    return out


def generate_staged_round_trip(model: torch.nn.Module, input_ids: torch.Tensor, block_size: int, **kwargs):
    """Stock `generate` over a `staged_round_trip_cache` (the rows' left pads read from `attention_mask`)."""
    mask = kwargs.get("attention_mask")
    pads = None if mask is None else (mask.shape[1] - mask.sum(dim=1)).tolist()
    return model.generate(input_ids, past_key_values=staged_round_trip_cache(model, block_size, pads), **kwargs)
