"""`PagedLayer`: one decoder layer's view of a `PagedCache`."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin

from .support import ATTENTION_LAYER_KINDS, layer_kinds

if TYPE_CHECKING:
    from .cache import PagedCache


class PagedLayer(CacheLayerMixin):
    """One decoder layer's view of a `PagedCache`: writes this layer's new K/V into the planned slots.

    Every row's block table covers all layers (a block holds K and V of its tokens for every layer), so the token
    bookkeeping lives in `PagedCache`; a layer only moves tensors. A sliding-window layer attends to the last
    `sliding_window - 1` cached positions plus the new ones, exactly as transformers' `DynamicSlidingWindowLayer`.
    """

    is_croppable = True
    supports_early_init = False

    def __init__(self, cache: PagedCache, layer_idx: int, sliding_window: int | None = None):
        super().__init__()
        self._cache = weakref.proxy(cache)
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None

    @property
    def keys(self) -> torch.Tensor | None:
        """This layer's keys as a dense `[batch, num_kv_heads, length, head_dim]` copy gathered through the block
        tables, left pads zero (see `PagedCache.dense_layer`); `None` while the cache is empty. Read-only."""
        return self._cache.dense_layer(self.layer_idx)[0]

    @keys.setter
    def keys(self, value) -> None:
        _refuse_assignment("keys", value)

    @property
    def values(self) -> torch.Tensor | None:
        """This layer's values, laid out as `keys`. Read-only."""
        return self._cache.dense_layer(self.layer_idx)[1]

    @values.setter
    def values(self, value) -> None:
        _refuse_assignment("values", value)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._cache.pool.storage.ensure_layer(self.layer_idx, key_states.transpose(1, 2))
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self._cache._write_layer(self.layer_idx, key_states, value_states)

    def first_visible(self, past_length: int) -> int:
        """First padded position this layer attends to when `past_length` positions are cached."""
        if self.sliding_window is None:
            return 0
        return max(past_length - self.sliding_window + 1, 0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        past_length = self._cache.get_seq_length()
        offset = self.first_visible(past_length)
        return past_length - offset + query_length, offset

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:  # token bookkeeping is cache-wide; see PagedCache.reset
        pass


def _refuse_assignment(name: str, value) -> None:
    if value is not None:  # `CacheLayerMixin.__init__` assigns None
        raise AttributeError(
            f"PagedLayer.{name} is a read-only view of the block pool; write K/V through PagedCache.update"
        )


def layer_windows(model: torch.nn.Module, text_config) -> list[int | None]:
    """The sliding window of each decoder layer (`None` for full attention); other layer kinds are refused."""
    window = getattr(text_config, "sliding_window", None)
    layer_types = layer_kinds(text_config)
    unsupported = sorted({t for t in layer_types if t not in ATTENTION_LAYER_KINDS})
    if unsupported:
        raise NotImplementedError(
            f"{type(model).__name__} has {unsupported} layers; PagedCache serves full and sliding-window attention"
        )
    return [window if layer_type == "sliding_attention" else None for layer_type in layer_types]
