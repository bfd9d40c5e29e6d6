"""The reference for quantized pages: a stock `DynamicCache` whose layers store every token's K/V as the pages would
give it back (quantized and dequantized by the same `KVFormat`), so paged generation in a quantized format can be
held token-identical to stock `generate` on the same K/V values."""

from __future__ import annotations

import torch
from transformers import DynamicCache

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
