"""`PagedCache`: a transformers `Cache` whose rows own block tables in the model's global block pool."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .allocator import BlockAllocator, BlockTable
from .config import PagedCacheConfig
from .plan import ForwardPlan, extend_plan, plan_forward
from .pool import BlockPool, get_pool


@dataclass(frozen=True)
class ForwardInputs:
    """What the forward pre-hook tells the cache about the coming forward."""

    attention_mask: torch.Tensor | None = None
    input_ids: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    reads_tables: bool = False


@dataclass(frozen=True)
class CacheStats:
    """One cache's use of the pool. Shared blocks count once.

    Attributes:
        num_rows (`int`): rows (sequences) in the cache.
        seq_length (`int`): padded length of every row.
        num_blocks (`int`): distinct blocks the rows hold now.
        peak_blocks (`int`): most distinct blocks held at once since the cache was created.
        tokens_stored (`int`): tokens in those blocks (a block shared by 4 rows counts its tokens once).
        cow_copies (`int`): blocks copied because a row wrote into a shared block.
        block_size (`int`): tokens per block.
    """

    num_rows: int
    seq_length: int
    num_blocks: int
    peak_blocks: int
    tokens_stored: int
    cow_copies: int
    block_size: int


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


def _layer_windows(model: torch.nn.Module, text_config) -> list[int | None]:
    """The sliding window of each decoder layer (`None` for full attention); other layer kinds are refused."""
    num_layers = text_config.num_hidden_layers
    window = getattr(text_config, "sliding_window", None)
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is None:
        layer_types = ["sliding_attention" if window is not None else "full_attention"] * num_layers
    unsupported = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if unsupported:
        raise NotImplementedError(
            f"{type(model).__name__} has {unsupported} layers; PagedCache serves full and sliding-window attention"
        )
    return [window if layer_type == "sliding_attention" else None for layer_type in layer_types]


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
        layers = [PagedLayer(self, i, window) for i, window in enumerate(_layer_windows(model, text_config))]
        super().__init__(layers=layers)
        self._model_ref = weakref.ref(model)
        self._model_name = type(model).__name__
        self._rows: list[BlockTable] = []
        self._leading_pads: list[int] = []
        self._seq_length = 0
        self._plan: ForwardPlan | None = None
        self._pending: ForwardInputs | None = None
        self._cow_copies = 0
        self._peak_blocks = 0
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

    def stats(self) -> CacheStats:
        """This cache's use of the pool (see `CacheStats`)."""
        block_size = self.pool.block_size
        held: dict[int, int] = {}
        for table in self._rows:
            for index, block_id in enumerate(table.block_ids):
                tokens = min(block_size, table.num_tokens - index * block_size)
                held[block_id] = max(held.get(block_id, 0), tokens)
        return CacheStats(
            num_rows=len(self._rows),
            seq_length=self._seq_length,
            num_blocks=len(held),
            peak_blocks=self._peak_blocks,
            tokens_stored=sum(held.values()),
            cow_copies=self._cow_copies,
            block_size=block_size,
        )

    def _distinct_blocks(self) -> set[int]:
        return {block_id for table in self._rows for block_id in table.block_ids}

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The padded length, equal for every row."""
        return self._seq_length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return True

    # ------------------------------------------------------------------ forward protocol
    def bind_forward(self, model: torch.nn.Module, inputs: ForwardInputs) -> None:
        """Called before each forward of `model` (by the forward pre-hook hf_paged installs) with its inputs."""
        self._check_open()
        owner = self._model_ref()
        if owner is not model:
            raise ValueError(
                f"this PagedCache was built for a {self._model_name} (id {id(owner):#x}) and cannot be used with a "
                f"{type(model).__name__} (id {id(model):#x}); build one PagedCache per model"
            )
        self._pending = inputs

    def read_layer(self, layer_idx: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of `layer_idx` for every padded position, gathered through the block tables: `[B, H, L, D]`."""
        plan = self._plan
        if plan is None:
            raise RuntimeError("PagedCache.read_layer called before any update in this forward")
        layer_idx = plan.last_layer if layer_idx is None else layer_idx
        if layer_idx not in plan.layers_written:
            raise RuntimeError(f"layer {layer_idx} did not write its K/V in this forward")
        slot_map = plan.on(self.pool.storage.device_of(layer_idx)).slot_map
        first = self.layers[layer_idx].first_visible(self._seq_length - plan.num_new)
        return self.pool.storage.gather(layer_idx, slot_map[:, first:] if first else slot_map)

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
        inputs = self._pending or ForwardInputs()
        self._pending = None
        allocator = self.pool.allocator
        with allocator.lock:
            free_before = allocator.num_free
            created = self._ensure_rows(batch)
            try:
                stores, pads = self._tokens_to_store(inputs.attention_mask, batch, num_new)
                leaders = _duplicate_row_leaders(inputs, batch, num_new) if created else None
                writers = None if leaders is None else [leader == row for row, leader in enumerate(leaders)]
                requests = [(t, n) for row, (t, n) in enumerate(zip(self._rows, stores)) if not writers or writers[row]]
                copies = allocator.append_all(requests, what=f"a forward of {batch} row(s) x {num_new} token(s)")
            except BaseException:
                if created:
                    self._free_rows()
                raise
            for row, added in enumerate(pads):
                self._leading_pads[row] += added
            if leaders is not None:  # identical prompts: one copy of the blocks, shared by refcount
                for row, leader in enumerate(leaders):
                    if leader != row:
                        allocator.free(self._rows[row])
                        self._rows[row] = allocator.fork(self._rows[leader])
            self._seq_length += num_new
            self.pool.storage.copy_blocks(copies)
            self._cow_copies += len(copies)
            if allocator.num_free != free_before:
                self._peak_blocks = max(self._peak_blocks, len(self._distinct_blocks()))
            block_size, previous = self.pool.block_size, self._plan
            if previous is not None and not created and not copies and not any(pads):
                self._plan = extend_plan(previous, self._rows, block_size, num_new, inputs.reads_tables)
            else:
                self._plan = plan_forward(
                    self._rows,
                    self._leading_pads,
                    block_size,
                    self._seq_length,
                    num_new,
                    key_states.device,
                    inputs.reads_tables,
                    writers,
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
        """Return every block to the pool for good; using the cache afterwards raises. The cache's final `stats()`
        stay readable as `pool.last_cache_stats`."""
        self._check_open()
        self.pool.last_cache_stats = self.stats()
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


def _duplicate_row_leaders(inputs: ForwardInputs, batch: int, num_new: int) -> list[int] | None:
    """For each row, the first row with the same new tokens, mask and positions; `None` when all rows differ or the
    inputs are unknown (e.g. `inputs_embeds`). `generate` repeats every prompt `num_beams` / `num_return_sequences`
    times before prefill: those rows then share one copy of the prompt's blocks."""
    input_ids = inputs.input_ids
    if batch < 2 or input_ids is None or input_ids.dim() != 2 or input_ids.shape != (batch, num_new):
        return None
    parts = [input_ids]
    for extra in (inputs.attention_mask, inputs.position_ids):
        if extra is not None and extra.dim() == 2 and extra.shape[0] == batch:
            parts.append(extra[:, -num_new:].to(input_ids.device, input_ids.dtype))
    keys = torch.cat(parts, dim=1)
    _, group = torch.unique(keys, dim=0, return_inverse=True)
    first = torch.full((int(group.max()) + 1,), batch, dtype=torch.long, device=group.device)
    first.scatter_reduce_(0, group, torch.arange(batch, device=group.device), reduce="amin")
    leaders = first[group].tolist()
    return None if leaders == list(range(batch)) else leaders
