"""`PagedCache`: a transformers `Cache` whose rows own block tables in the model's global block pool."""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .allocator import BlockAllocator, BlockTable
from .config import PagedCacheConfig
from .plan import ForwardPlan, extend_plan, plan_forward
from .pool import BlockPool, get_pool


def _free_tables(allocator: BlockAllocator, rows: list[BlockTable]) -> None:
    """Finalizer: return the blocks of a dropped cache (no reference to the cache itself)."""
    with allocator.lock:
        for table in rows:
            if not table.is_freed:
                allocator.free(table)
        rows.clear()


class PagedLayer(CacheLayerMixin):
    """One decoder layer's view of a `PagedCache`: writes this layer's new K/V into the planned slots.

    Every row's block table covers all layers (a block holds K and V of its tokens for every layer), so the token
    bookkeeping lives in `PagedCache`; a layer only moves tensors.
    """

    is_croppable = True
    supports_early_init = False

    def __init__(self, cache: PagedCache, layer_idx: int, is_sliding: bool = False):
        super().__init__()
        self._cache = weakref.proxy(cache)
        self.layer_idx = layer_idx
        self.is_sliding = is_sliding

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._cache.pool.storage.ensure_layer(self.layer_idx, key_states.transpose(1, 2))
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self._cache._write_layer(self.layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self._cache.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:  # token bookkeeping is cache-wide; see PagedCache.reset
        pass


class PagedCache(Cache):
    """A KV cache whose rows own block tables in the model's global `BlockPool`.

    Blocks are taken one at a time as tokens arrive, pad tokens of left-padded batches are never stored, rows that
    `generate` expands (beams, `num_return_sequences`) and `reorder_cache` share blocks by refcount, and a shared
    block is copied only when a row writes into it. Blocks go back to the pool on `reset()`/`release()` or when the
    cache is garbage collected.

    Args:
        model (`PreTrainedModel`): the model this cache serves; its pool is `hf_paged.get_pool(model)`.
        **cache_config: `block_size`, `num_blocks`, `max_memory`, `memory_fraction`, `attn_implementation`
            (see `PagedCacheConfig`).

    Example:

    ```python
    >>> import torch, hf_paged
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    ...                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=100))
    >>> cache = hf_paged.PagedCache(model, block_size=4, num_blocks=32)
    >>> out = model.generate(torch.tensor([[1, 2, 3, 4, 5]]), past_key_values=cache, max_new_tokens=3,
    ...                      do_sample=False, pad_token_id=0)
    >>> cache.get_seq_length(), cache.row_tables[0].num_tokens, len(cache.row_tables[0].block_ids)
    (7, 7, 2)
    >>> cache.release()
    >>> hf_paged.get_pool(model).stats().num_used
    0

    ```
    """

    def __init__(self, model: torch.nn.Module, **cache_config):
        from .generation import attach_to_model

        self.cache_config = PagedCacheConfig.from_dict(cache_config)
        text_config = model.config.get_text_config(decoder=True)
        if getattr(model.config, "is_encoder_decoder", False):
            raise NotImplementedError(
                f"{type(model).__name__} is an encoder-decoder model; PagedCache serves decoder-only models"
            )
        self.pool: BlockPool = get_pool(model, config=self.cache_config)
        layer_types = getattr(text_config, "layer_types", None) or ["full_attention"] * text_config.num_hidden_layers
        layers = [
            PagedLayer(self, i, is_sliding=layer_type == "sliding_attention")
            for i, layer_type in enumerate(layer_types)
        ]
        super().__init__(layers=layers)
        self._model_ref = weakref.ref(model)
        self._model_name = type(model).__name__
        self._rows: list[BlockTable] = []
        self._leading_pads: list[int] = []
        self._seq_length = 0
        self._plan: ForwardPlan | None = None
        self._pending: tuple[torch.Tensor | None, bool] | None = None
        self._released = False
        self._finalizer = weakref.finalize(self, _free_tables, self.pool.allocator, self._rows)
        attach_to_model(model)

    # ------------------------------------------------------------------ read-only views
    @property
    def row_tables(self) -> list[BlockTable]:
        """The block table of every row (do not modify)."""
        return list(self._rows)

    @property
    def leading_pads(self) -> list[int]:
        """Left-pad positions of every row, which hold no block slots."""
        return list(self._leading_pads)

    @property
    def batch_size(self) -> int:
        return len(self._rows)

    @property
    def is_released(self) -> bool:
        return self._released

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The padded length, equal for every row."""
        return self._seq_length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._seq_length + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return True

    # ------------------------------------------------------------------ forward protocol
    def bind_forward(self, model: torch.nn.Module, attention_mask: torch.Tensor | None, reads_tables: bool) -> None:
        """Called before each forward of `model` (by the forward pre-hook hf_paged installs) with its 2D mask."""
        self._check_open()
        owner = self._model_ref()
        if owner is not model:
            raise ValueError(
                f"this PagedCache was built for a {self._model_name} (id {id(owner):#x}) and cannot be used with a "
                f"{type(model).__name__} (id {id(model):#x}); build one PagedCache per model"
            )
        self._pending = (attention_mask, reads_tables)

    def read_layer(self, layer_idx: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of `layer_idx` for every padded position, gathered through the block tables: `[B, H, L, D]`."""
        plan = self._plan
        if plan is None:
            raise RuntimeError("PagedCache.read_layer called before any update in this forward")
        layer_idx = plan.last_layer if layer_idx is None else layer_idx
        if layer_idx not in plan.layers_written:
            raise RuntimeError(f"layer {layer_idx} did not write its K/V in this forward")
        slot_map = plan.on(self.pool.storage.device_of(layer_idx)).slot_map
        return self.pool.storage.gather(layer_idx, slot_map)

    def reads_tables_in_attention(self) -> bool:
        return self._plan is not None and self._plan.reads_tables

    def _write_layer(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor):
        plan = self._plan
        if plan is None or layer_idx in plan.layers_written:
            plan = self._plan_forward(key_states)
        plan.layers_written.add(layer_idx)
        plan.last_layer = layer_idx
        batch, num_heads, num_new, head_dim = key_states.shape
        local = plan.on(key_states.device)
        write_slots, write_index = local.write_slots, local.write_index
        new_keys = key_states.transpose(1, 2).reshape(batch * num_new, num_heads, head_dim)
        new_values = value_states.transpose(1, 2).reshape(batch * num_new, num_heads, head_dim)
        if write_index is not None:
            new_keys, new_values = new_keys.index_select(0, write_index), new_values.index_select(0, write_index)
        self.pool.storage.write(layer_idx, write_slots, new_keys, new_values)
        if plan.reads_tables:
            return key_states, value_states
        return self.read_layer(layer_idx)

    def _plan_forward(self, key_states: torch.Tensor) -> ForwardPlan:
        self._check_open()
        batch, num_new = key_states.shape[0], key_states.shape[-2]
        attention_mask, reads_tables = self._pending or (None, False)
        self._pending = None
        allocator = self.pool.allocator
        with allocator.lock:
            created = self._ensure_rows(batch)
            try:
                stores, pads = self._tokens_to_store(attention_mask, batch, num_new)
                copies = allocator.append_all(
                    list(zip(self._rows, stores)), what=f"a forward of {batch} row(s) x {num_new} token(s)"
                )
            except BaseException:
                if created:
                    self._free_rows()
                raise
            for row, added in enumerate(pads):
                self._leading_pads[row] += added
            self._seq_length += num_new
            self.pool.storage.copy_blocks(copies)
            block_size, previous = self.pool.block_size, self._plan
            if previous is not None and not created and not copies and not any(pads):
                self._plan = extend_plan(previous, self._rows, block_size, num_new, reads_tables)
            else:
                self._plan = plan_forward(
                    self._rows,
                    self._leading_pads,
                    block_size,
                    self._seq_length,
                    num_new,
                    key_states.device,
                    reads_tables,
                )
        return self._plan

    def _ensure_rows(self, batch: int) -> bool:
        """Create (first forward) or broadcast (a 1-row prefix meeting `batch` rows) the row tables."""
        allocator = self.pool.allocator
        if not self._rows:
            self._rows.extend(allocator.new_table() for _ in range(batch))
            self._leading_pads.extend([0] * batch)
            return True
        if len(self._rows) == batch:
            return False
        if len(self._rows) == 1:
            self.batch_repeat_interleave(batch)
            return False
        raise ValueError(f"this PagedCache holds {len(self._rows)} rows but the forward has batch size {batch}")

    def _tokens_to_store(self, attention_mask, batch: int, num_new: int) -> tuple[list[int], list[int]]:
        """New tokens each row stores, and leading pad positions each row adds (pads before its first real token)."""
        stores, pads = [num_new] * batch, [0] * batch
        if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[-1] >= num_new:
            if attention_mask.shape[0] != batch:
                raise ValueError(f"attention_mask has {attention_mask.shape[0]} rows but the batch has {batch}")
            leading = (attention_mask[:, -num_new:].to(torch.int32).cumsum(-1) == 0).sum(-1).tolist()
            for row, table in enumerate(self._rows):
                if table.num_tokens == 0:
                    pads[row], stores[row] = leading[row], num_new - leading[row]
        for row, table in enumerate(self._rows):
            if table.num_tokens + stores[row] == 0:
                raise ValueError(
                    f"row {row} has no real token: its attention_mask is all zeros (an empty prompt?); every row "
                    "needs at least one token"
                )
        return stores, pads

    # ------------------------------------------------------------------ row operations used by generate
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i becomes a copy of row `beam_idx[i]` by sharing its blocks (no K/V is copied)."""
        self._select_rows(beam_idx.tolist(), "reorder_cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(torch.as_tensor(indices).tolist(), "batch_select_indices")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows([row for row in range(len(self._rows)) for _ in range(repeats)], "batch_repeat_interleave")

    def _select_rows(self, sources: list[int], caller: str) -> None:
        self._check_open()
        if not self._rows:
            return
        bad = [i for i in sources if not 0 <= i < len(self._rows)]
        if bad:
            raise IndexError(f"{caller}: row indices {bad[:5]} are out of range for a cache of {len(self._rows)} rows")
        allocator = self.pool.allocator
        with allocator.lock:
            new_rows = [allocator.fork(self._rows[i]) for i in sources]
            new_pads = [self._leading_pads[i] for i in sources]
            self._free_rows()
            self._rows.extend(new_rows)
            self._leading_pads.extend(new_pads)
        self._plan = None

    def crop(self, max_length: int) -> None:
        """Remove the last `-max_length` positions (a negative number, as in transformers); blocks that become
        empty go back to the pool."""
        self._check_open()
        if max_length > 0:
            raise ValueError(
                f"crop({max_length}): pass a negative number of positions to remove (or 0); positive values are "
                "not supported"
            )
        if -max_length > self._seq_length:
            raise ValueError(f"crop({max_length}) would remove more than the {self._seq_length} cached positions")
        new_length = self._seq_length + max_length
        allocator = self.pool.allocator
        with allocator.lock:
            for row, table in enumerate(self._rows):
                self._leading_pads[row] = min(self._leading_pads[row], new_length)
                allocator.crop(table, new_length - self._leading_pads[row])
        self._seq_length = new_length
        self._plan = None

    def activate_past_recording(self) -> None:
        """Nothing to do: every position stays in the pool until `crop` removes it."""

    def reset(self) -> None:
        """Return every block to the pool and empty the cache; it can be used again."""
        self._check_open()
        with self.pool.allocator.lock:
            self._free_rows()
        self._seq_length = 0
        self._plan = None
        self._pending = None

    def release(self) -> None:
        """Return every block to the pool for good; using the cache afterwards raises."""
        self.reset()
        self._released = True
        self._finalizer.detach()

    def _free_rows(self) -> None:
        _free_tables(self.pool.allocator, self._rows)
        self._leading_pads.clear()

    def _check_open(self) -> None:
        if self._released:
            raise RuntimeError("this PagedCache was released; its blocks are back in the pool. Build a new one.")

    def __repr__(self) -> str:
        return (
            f"PagedCache(rows={len(self._rows)}, seq_length={self._seq_length}, "
            f"block_size={self.pool.block_size}, blocks={sum(len(t.block_ids) for t in self._rows)})"
        )
