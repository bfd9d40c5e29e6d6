"""`PagedLayer`: one decoder layer's view of a `PagedCache`."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin

from .groups import skipped_tokens

if TYPE_CHECKING:
    from .batch_cache import BatchCache


class PagedLayer(CacheLayerMixin):
    """One decoder layer's view of a `PagedCache` (or `BatchCache`): its mask sizes and a dense view of its K/V.

    A row's block table covers the layers of its layer group, so the token bookkeeping lives in the cache, which
    writes and reads every layer's K/V (`update` here hands over to `cache.update`). A sliding-window layer attends
    to the last `sliding_window - 1` cached positions plus the new ones, exactly as transformers'
    `DynamicSlidingWindowLayer`.
    """

    is_croppable = True
    supports_early_init = False

    def __init__(self, cache: BatchCache, layer_idx: int, sliding_window: int | None = None):
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
        self._cache.pool.storage.ensure_layer(self.layer_idx, key_states.transpose(1, 2), value_states.transpose(1, 2))
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self._cache.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        past_length = self._cache.get_seq_length()
        offset = skipped_tokens(past_length, self.sliding_window)
        return past_length - offset + query_length, offset

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length()

    def get_max_length(self) -> int:
        """The sliding window of a sliding layer (as `DynamicSlidingWindowLayer`), else -1 (no maximum)."""
        return -1 if self.sliding_window is None else self.sliding_window

    def reset(self) -> None:  # token bookkeeping is cache-wide; see PagedCache.reset
        pass


def _refuse_assignment(name: str, value) -> None:
    if value is not None:  # `CacheLayerMixin.__init__` assigns None
        raise AttributeError(
            f"PagedLayer.{name} is a read-only view of the block pool; write K/V through PagedCache.update"
        )
