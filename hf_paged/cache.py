"""`PagedCache`: a transformers `Cache` whose rows own block tables in the model's global block pool."""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from .allocator import BlockAllocator, tokens_per_block
from .config import PagedCacheConfig
from .forward import ForwardBoundCache, attach_to_model
from .groups import KVLayout
from .layer import PagedLayer, layer_windows
from .plan import ForwardInputs, ForwardPlan, address_tables, duplicate_row_leaders, extend_addressing
from .pool import BlockPool, get_pool
from .prefix import group_roots, prefix_namespace, root_hash
from .rows import Row
from .support import check_supported

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheStats:
    """One cache's use of the pool. Shared blocks count once.

    Attributes:
        num_rows (`int`): rows (sequences) in the cache.
        seq_length (`int`): padded length of every row.
        num_blocks (`int`): distinct blocks the rows hold now.
        peak_blocks (`int`): most distinct blocks held at once since the cache was created.
        tokens_stored (`int`): tokens in those blocks (a block shared by 4 rows counts its tokens once; in a hybrid
            model's layer groups a token counts once per group whose blocks hold it).
        cow_copies (`int`): blocks copied because a row wrote into a shared block.
        prefix_tokens_reused (`int`): prompt tokens taken from the prefix cache instead of being computed.
        block_size (`int`): tokens per block.
    """

    num_rows: int
    seq_length: int
    num_blocks: int
    peak_blocks: int
    tokens_stored: int
    cow_copies: int
    prefix_tokens_reused: int
    block_size: int


def _free_rows(allocator: BlockAllocator, rows: list[Row]) -> None:
    """Return every row's blocks (also the finalizer of a dropped cache: it holds no reference to the cache)."""
    with allocator.lock:
        for row in rows:
            row.free(allocator)
        rows.clear()


class PagedCache(Cache, ForwardBoundCache):
    """A KV cache whose rows own block tables in the model's global `BlockPool`.

    Blocks are taken one at a time as tokens arrive, pad tokens of left-padded batches are never stored, rows that
    `generate` expands (beams, `num_return_sequences`) and `reorder_cache` share blocks by refcount, and a shared
    block is copied only when a row writes into it. Full blocks are indexed by content (prefix caching): a later
    prompt that starts with cached blocks shares them and skips their prefill. Blocks go back to the pool on
    `reset()`/`release()` or when the cache is garbage collected. Sliding-window layers give back, during
    generation, the blocks their window has left behind: all of a row's blocks when every layer slides
    (Mistral-style), those of the sliding layer groups in hybrid models (Gemma2/3, see `KVLayout`), while the
    full-attention groups keep theirs.

    Args:
        model (`PreTrainedModel`): the model this cache serves; its pool is `hf_paged.get_pool(model)`.
        **cache_config: `block_size`, `num_blocks`, `max_memory`, `memory_fraction`, `attn_implementation`,
            `prefix_caching` (see `PagedCacheConfig`).

    Attributes:
        layout (`KVLayout`): the model's layer groups; every row holds one block table per group.
        sliding_release_window (`int | None`): the widest window `W` of the sliding layer groups: before each
            forward a row gives back those groups' blocks holding only tokens older than its last `W - 1`, so a long
            generation holds about `W / block_size + 2` blocks per row in each of them. `None` when no layer slides.
            Setting it overrides the window of every sliding group (`None` keeps every block).

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
        self.cache_config = PagedCacheConfig.from_dict(cache_config)
        check_supported(model)
        text_config = model.config.get_text_config(decoder=True)
        self.pool: BlockPool = get_pool(model, config=self.cache_config)
        windows = layer_windows(model, text_config)
        layers = [PagedLayer(self, i, window) for i, window in enumerate(windows)]
        super().__init__(layers=layers)
        layout = self.pool.layout
        if layout is None or len(layout.group_of) != len(windows):
            layout = KVLayout.for_windows(windows, split=False)
        self.layout: KVLayout = layout
        self._release_windows = layout.windows  # per group; None: the group keeps its blocks
        self._model_ref = weakref.ref(model)
        self._model_name = type(model).__name__
        self._prefix_caching = self.cache_config.resolved_prefix_caching
        self._root = root_hash(prefix_namespace(model))
        self._roots = group_roots(self._root, layout.num_groups)
        self._rows: list[Row] = []
        self._seq_length = 0
        self._plan: ForwardPlan | None = None
        self._pending: ForwardInputs | None = None
        self._scheduled: list[int] | None = None  # tokens each row stores in the next forward (`schedule`)
        self._cow_copies = 0
        self._peak_blocks = 0
        self._layers_per_forward = 0  # most layers seen writing in one forward
        self._prefix_reused = 0
        self._released = False
        self._finalizer = weakref.finalize(self, _free_rows, self.pool.allocator, self._rows)
        attach_to_model(model)

    # ------------------------------------------------------------------ read-only views
    @property
    def row_tables(self) -> list:
        """The `BlockTable` of every row in the first layer group, the only one unless the model is a hybrid (do not
        modify)."""
        return [row.table for row in self._rows]

    @property
    def group_tables(self) -> list[list]:
        """`group_tables[g][i]`: the `BlockTable` of row `i` in layer group `g` (see `layout`; do not modify)."""
        return [[row.tables[group] for row in self._rows] for group in range(self.layout.num_groups)]

    @property
    def release_windows(self) -> list[int | None]:
        """The release window of every layer group (`None`: the group keeps its blocks)."""
        return list(self._release_windows)

    @property
    def sliding_release_window(self) -> int | None:
        return max((w for w in self._release_windows if w is not None), default=None)

    @sliding_release_window.setter
    def sliding_release_window(self, window: int | None) -> None:
        self._release_windows = [None if g.window is None else window for g in self.layout.groups]

    @property
    def leading_pads(self) -> list[int]:
        """Left-pad positions of every row, which hold no block slots."""
        return [row.leading_pads for row in self._rows]

    @property
    def row_tokens(self) -> list[list[int] | None]:
        """Token ids stored in every row (`None` where unknown or with prefix caching off)."""
        return [None if row.tokens is None else list(row.tokens) for row in self._rows]

    @property
    def batch_size(self) -> int:
        return len(self._rows)

    @property
    def prefix_caching(self) -> bool:
        return self._prefix_caching

    @property
    def prefix_root(self) -> bytes:
        """Root of this cache's prefix-hash chains (the model, dtype, adapters and weights it was built for)."""
        return self._root

    def stop_prefix_caching(self) -> None:
        """Stop addressing this cache's blocks by token ids, for good: no prefix lookups, and no block it fills from
        now on is indexed. hf_paged calls it when a forward's K/V depend on more than the token ids (images,
        `inputs_embeds`, ...), so a request is never served another request's image K/V behind the same
        placeholder ids, and never skips a prompt position whose other inputs the model must still consume."""
        self._prefix_caching = False
        for row in self._rows:
            row.record(None)

    def refresh_prefix_root(self) -> bytes:
        """Recompute `prefix_root` from the model as it is now (its weights may have been trained since)."""
        model = self._model_ref()
        if model is not None:
            self._root = root_hash(prefix_namespace(model))
            self._roots = group_roots(self._root, self.layout.num_groups)
        return self._root

    @property
    def is_released(self) -> bool:
        return self._released

    def stats(self) -> CacheStats:
        """This cache's use of the pool (see `CacheStats`)."""
        block_size = self.pool.block_size
        held = tokens_per_block([table for row in self._rows for table in row.tables], block_size)
        return CacheStats(
            num_rows=len(self._rows),
            seq_length=self._seq_length,
            num_blocks=len(held),
            peak_blocks=self._peak_blocks,
            tokens_stored=sum(held.values()),
            cow_copies=self._cow_copies,
            prefix_tokens_reused=self._prefix_reused,
            block_size=block_size,
        )

    def _note_peak_blocks(self) -> None:
        distinct = {block_id for row in self._rows for block_id in row.live_block_ids}
        self._peak_blocks = max(self._peak_blocks, len(distinct))

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
        self._settle()
        owner = self._model_ref()
        if owner is not model:
            raise ValueError(
                f"this PagedCache was built for a {self._model_name} (id {id(owner):#x}) and cannot be used with a "
                f"{type(model).__name__} (id {id(model):#x}); build one PagedCache per model"
            )
        self._pending = inputs

    def read_layer(self, layer_idx: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of `layer_idx` for every padded position it attends to, gathered through the block tables:
        `[batch, num_kv_heads, length, head_dim]`."""
        plan = self._plan
        if plan is None:
            raise RuntimeError("PagedCache.read_layer called before any update in this forward")
        layer_idx = plan.last_layer if layer_idx is None else layer_idx
        if layer_idx not in plan.layers_written:
            raise RuntimeError(f"layer {layer_idx} did not write its K/V in this forward")
        plan.layers_read.add(layer_idx)
        storage = self.pool.storage
        local = plan.groups[self.layout.group_of[layer_idx]].on(storage.device_of(layer_idx))
        first = self.layers[layer_idx].first_visible(self._seq_length - plan.num_new)
        slot_map = local.slot_map[:, first:] if first else local.slot_map
        return storage.gather(layer_idx, slot_map, local.head_rows(storage.num_heads(layer_idx), first))

    def dense_layer(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A copy of layer `layer_idx`'s K/V laid out as transformers' dynamic layers hold them:
        `[batch, num_kv_heads, length, head_dim]` over the padded positions (a sliding-window layer: its last
        `sliding_window - 1`), left-pad positions zero (they are never stored). `(None, None)` while the cache holds
        no token. For inspection (`cache.layers[i].keys`); the pages themselves are not changed."""
        self._check_open()
        length = self._seq_length
        storage = self.pool.storage
        if not self._rows or length == 0 or not storage.has_layer(layer_idx):
            return None, None
        device = storage.device_of(layer_idx)
        tables = [row.tables[self.layout.group_of[layer_idx]] for row in self._rows]
        pads = self.leading_pads
        addressing = address_tables(tables, pads, self.pool.block_size, length, 0, device)
        first = self.layers[layer_idx].first_visible(length)
        keys, values = storage.gather(layer_idx, addressing.slot_map[:, first:])
        position = torch.arange(first, length, device=device)
        stored = (position[None, :] >= torch.tensor(pads, device=device)[:, None])[:, None, :, None]
        return keys.where(stored, 0), values.where(stored, 0)

    def reads_tables_in_attention(self) -> bool:
        return self._plan is not None and self._plan.reads_tables

    def _write_layer(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor):
        plan = self._plan
        if plan is not None:
            self._check_tables_were_read(plan, layer_idx)
        if plan is None or layer_idx in plan.layers_written:
            plan = self._plan_forward(key_states)
        plan.layers_written.add(layer_idx)
        plan.last_layer = layer_idx
        batch, num_heads, num_new, head_dim = key_states.shape
        local = plan.groups[self.layout.group_of[layer_idx]].on(key_states.device)
        new_keys = key_states.transpose(1, 2).reshape(batch * num_new, num_heads, head_dim)
        new_values = value_states.transpose(1, 2).reshape(batch * num_new, num_heads, head_dim)
        if local.write_index is not None:
            new_keys = new_keys.index_select(0, local.write_index)
            new_values = new_values.index_select(0, local.write_index)
        self.pool.storage.write(layer_idx, local.write_slots, new_keys, new_values)
        if len(plan.layers_written) == len(self.layers):  # every layer wrote: full blocks can be found by others
            with self.pool.allocator.lock:
                self._cache_full_blocks(share=False)
        if plan.reads_tables:
            return key_states, value_states
        return self.read_layer(layer_idx)

    def _check_tables_were_read(self, plan: ForwardPlan, layer_idx: int) -> None:
        """Under the `"hf_paged"` attention `update` hands back only the new tokens: the layer that wrote last must
        have read its K/V through the tables, or its attention saw only those tokens (a model whose attention does
        not dispatch to the registered function). Checked when the next layer, or the next complete forward, writes.
        """
        last = plan.last_layer
        if not plan.reads_tables or last is None or last in plan.layers_read:
            return
        if layer_idx in plan.layers_written and len(plan.layers_written) < len(self.layers):
            return  # an unfinished forward: dropped by `_settle`, not a layer that skipped its read
        raise NotImplementedError(
            f"{self._model_name}: layer {last} stored its K/V in the paged cache but its attention did not read them "
            "back through the block tables (the model does not route that attention through the 'hf_paged' "
            "attention function), so it would have attended to the new tokens only. Generate with "
            "cache_config={'attn_implementation': 'sdpa'} (or 'eager') to read dense K/V instead."
        )

    def _plan_forward(self, key_states: torch.Tensor) -> ForwardPlan:
        self._settle()
        batch, num_new = key_states.shape[0], key_states.shape[-2]
        inputs = self._pending or ForwardInputs()
        scheduled, self._pending, self._scheduled = self._scheduled, None, None
        allocator = self.pool.allocator
        with allocator.lock:
            if self._cache_full_blocks():  # the last forward's full blocks: every layer has written them now
                self._plan = None
            if self._release_dead_blocks():
                self._plan = None
            free_before = allocator.num_free
            created = False if scheduled is not None else self._ensure_rows(batch)
            try:
                if scheduled is not None:
                    stores, pads = self._check_scheduled(scheduled, batch, num_new), [0] * batch
                else:
                    stores, pads = self._tokens_to_store(inputs.attention_mask, batch, num_new)
                leaders = duplicate_row_leaders(inputs, batch, num_new) if created else None
                writers = None if leaders is None else [leader == row for row, leader in enumerate(leaders)]
                requests = [
                    append
                    for i, (row, count) in enumerate(zip(self._rows, stores))
                    if not writers or writers[i]
                    for append in row.appends(count)
                ]
                copies = allocator.append_all(requests, what=f"a forward of {batch} row(s) x {num_new} token(s)")
            except BaseException:
                if created:
                    _free_rows(allocator, self._rows)
                raise
            new_ids = self._new_token_ids(inputs, batch, num_new)
            for index, row in enumerate(self._rows):
                row.leading_pads += pads[index]
                if not writers or writers[index]:
                    row.record(None if new_ids is None else new_ids[index][num_new - stores[index] :])
            if leaders is not None:  # identical prompts: one copy of the blocks, shared by refcount
                for index, leader in enumerate(leaders):
                    if leader != index:
                        self._rows[index].free(allocator)
                        self._rows[index] = self._rows[leader].fork(allocator)
            self._seq_length += num_new
            self.pool.storage.copy_blocks(copies)
            self._cow_copies += len(copies)
            if allocator.num_free != free_before:
                self._note_peak_blocks()
            previous = self._plan
            appended_only = not created and not copies and not any(pads) and min(stores) == num_new
            size, length, device = allocator.block_size, self._seq_length, key_states.device
            row_pads = [row.leading_pads for row in self._rows]
            addressing = []
            for group in range(self.layout.num_groups):  # one slot map per layer group, used by its layers
                tables = [row.tables[group] for row in self._rows]
                if previous is not None and appended_only:
                    addressing.append(extend_addressing(previous.groups[group], tables, size, num_new))
                else:
                    addressing.append(address_tables(tables, row_pads, size, length, num_new, device, stores, writers))
            self._plan = ForwardPlan(addressing, inputs.reads_tables, num_new)
        return self._plan

    def _release_dead_blocks(self) -> bool:
        """Sliding layer groups: give back each row's leading blocks that the group's layers do not attend to in the
        coming forward (a row of `n` tokens reads from logical position `n - W + 1` on). Returns whether a block was
        released."""
        if not any(window is not None for window in self._release_windows):
            return False
        allocator = self.pool.allocator
        return sum(row.release_behind(allocator, self._release_windows) for row in self._rows) > 0

    def _released_past(self, new_length: int) -> list[int]:
        """Rows that keeping only `new_length` padded positions would leave reading released blocks."""
        size = self.pool.block_size
        return [
            index
            for index, row in enumerate(self._rows)
            if row.reads_released(new_length - min(row.leading_pads, new_length), self._release_windows, size)
        ]

    def _check_scheduled(self, scheduled: list[int], batch: int, num_new: int) -> list[int]:
        if len(scheduled) != batch or max(scheduled) > num_new:
            raise ValueError(
                f"the forward has {batch} row(s) x {num_new} new position(s) but {len(scheduled)} row(s) storing up "
                f"to {max(scheduled)} token(s) were scheduled"
            )
        return scheduled

    def _forget_unfinished_forward(self) -> None:
        """If the last forward stopped before every layer wrote (an exception inside the model), drop its tokens:
        some layers never stored their K/V for them."""
        previous = self._plan
        if previous is None:
            return
        written = len(previous.layers_written)
        if written < self._layers_per_forward:
            logger.warning(
                "hf_paged: the last forward stopped after %d of %d layers; its tokens are dropped",
                written,
                self._layers_per_forward,
            )
            self._truncate(self._seq_length - previous.num_new)
            return
        self._layers_per_forward = max(self._layers_per_forward, written)

    def _new_token_ids(self, inputs: ForwardInputs, batch: int, num_new: int) -> list[list[int]] | None:
        ids = inputs.input_ids
        if not self._prefix_caching or ids is None or ids.dim() != 2 or ids.shape[0] != batch:
            return None
        return ids[:, -num_new:].tolist() if ids.shape[1] >= num_new else None

    def _ensure_rows(self, batch: int) -> bool:
        """Create the rows (first forward), or repeat each row to meet a batch `generate` expanded (a prompt cache of
        B rows meeting B x num_beams rows, repeated in interleaved order)."""
        allocator = self.pool.allocator
        if not self._rows:
            for _ in range(batch):
                self._rows.append(Row.empty(allocator, self.layout.num_groups, self._prefix_caching))
            return True
        if len(self._rows) == batch:
            return False
        if batch % len(self._rows) == 0:
            self.batch_repeat_interleave(batch // len(self._rows))
            return False
        raise ValueError(f"this PagedCache holds {len(self._rows)} rows but the forward has batch size {batch}")

    def _tokens_to_store(self, attention_mask, batch: int, num_new: int) -> tuple[list[int], list[int]]:
        """New tokens each row stores, and leading pad positions each row adds (pads before its first real token)."""
        stores, pads = [num_new] * batch, [0] * batch
        if all(row.num_tokens for row in self._rows):
            return stores, pads  # every row is past its left padding: all new tokens are stored
        if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[-1] >= num_new:
            if attention_mask.shape[0] != batch:
                raise ValueError(f"attention_mask has {attention_mask.shape[0]} rows but the batch has {batch}")
            leading = (attention_mask[:, -num_new:].to(torch.int32).cumsum(-1) == 0).sum(-1).tolist()
            for index, row in enumerate(self._rows):
                if row.num_tokens == 0:
                    pads[index], stores[index] = leading[index], num_new - leading[index]
        for index, row in enumerate(self._rows):
            if row.num_tokens + stores[index] == 0:
                raise ValueError(
                    f"row {index} has no real token: its attention_mask is all zeros (an empty prompt?); every row "
                    "needs at least one token"
                )
        return stores, pads

    def _cache_full_blocks(self, share: bool = True) -> bool:
        """Index the rows' full blocks by content; returns whether a table changed (a block was deduplicated, which
        `share=False` defers)."""
        if not self._prefix_caching:
            return False
        changed = False
        for row in self._rows:
            changed |= row.cache_full_blocks(self.pool.allocator, self._roots, share)
        return changed

    # ------------------------------------------------------------------ prompts and prefixes
    def start_from_prompt(
        self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None = None, lookup: bool = True
    ) -> int:
        """Prepare for a `generate` call on `input_ids` (`[batch, length]`, left-padded); returns the positions that
        need no prefill.

        - An empty cache takes the longest cached prefix every row shares a block-aligned start with (all rows need
          the same left padding), so `generate` prefills only the rest; not with `lookup=False` (a call that
          returns attention weights or hidden states of every prompt position must compute them all).
        - A cache that already holds tokens (a conversation continued with `past_key_values`) is cropped back to the
          longest prefix it shares with `input_ids`, so stale positions are never attended to.

        At least one position is always left to compute (`generate` needs the last prompt token's logits).
        """
        self._settle()
        if input_ids is None or input_ids.dim() != 2 or not self._prefix_caching:
            return 0
        batch, width = input_ids.shape
        mask = attention_mask if attention_mask is not None and attention_mask.shape == input_ids.shape else None
        pads = [0] * batch if mask is None else (mask.to(torch.int32).cumsum(-1) == 0).sum(-1).tolist()
        if mask is not None and int(mask.sum()) != sum(width - p for p in pads):
            return 0  # not plain left padding
        tokens = [input_ids[row, pads[row] :].tolist() for row in range(batch)]
        with self.pool.allocator.lock:
            if self._rows:
                return self._align_to_prompt(pads, tokens, width)
            return self._reuse_cached_prefix(pads, tokens) if lookup else 0

    def _reuse_cached_prefix(self, pads: list[int], tokens: list[list[int]]) -> int:
        if len(set(pads)) != 1:
            return 0
        allocator = self.pool.allocator
        windows = self._release_windows
        rows = [Row.from_prefix_cache(allocator, self._roots, windows, row_tokens) for row_tokens in tokens]
        num_tokens = min(row.num_tokens for row in rows)
        if any(row.reads_released(num_tokens, windows, allocator.block_size) for row in rows):
            # a longer hit started its sliding groups past blocks the common prefix reads: look up the common one
            _free_rows(allocator, rows)
            rows = [Row.from_prefix_cache(allocator, self._roots, windows, t[: num_tokens + 1]) for t in tokens]
        if num_tokens == 0:
            _free_rows(allocator, rows)
            return 0
        for row in rows:
            row.truncate(allocator, num_tokens)
            row.leading_pads = pads[0]
        self._rows.extend(rows)
        self._seq_length = pads[0] + num_tokens
        self._prefix_reused += len(tokens) * num_tokens
        self._note_peak_blocks()
        return self._seq_length

    def _align_to_prompt(self, pads: list[int], tokens: list[list[int]], width: int) -> int:
        if len(self._rows) != len(tokens) or any(row.tokens is None for row in self._rows):
            return 0
        common = width - 1
        for row, new_pads, new_tokens in zip(self._rows, pads, tokens):
            if row.leading_pads != new_pads:
                common = min(common, row.leading_pads, new_pads)
                continue
            same = 0
            for old, new in zip(row.tokens, new_tokens):
                if old != new:
                    break
                same += 1
            common = min(common, new_pads + same)
        if common < self._seq_length and self._released_past(common):
            logger.info(
                "hf_paged: the prompt leaves the cache at %d positions, before blocks it released behind the sliding "
                "window; recomputing the prompt",
                common,
            )
            _free_rows(self.pool.allocator, self._rows)
            self._seq_length = 0
            self._plan = None
            return self._reuse_cached_prefix(pads, tokens)
        if common < self._seq_length:
            logger.info(
                "hf_paged: cropping the cache from %d to %d positions to match the prompt", self._seq_length, common
            )
            self.crop(common - self._seq_length)
        return self._seq_length

    def fork(self, n: int | None = None) -> PagedCache | list[PagedCache]:
        """Caches that share every block of this one (nothing is copied; a shared partial block is copied when a
        fork writes into it). The paged replacement for `copy.deepcopy(prompt_cache)`.

        Returns one `PagedCache`, or a list of `n` of them when `n` is given.
        """
        self._settle()
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"fork(n): n must be a positive int, got {n!r}")
        model = self._model_ref()
        if model is None:
            raise RuntimeError("the model of this PagedCache is gone")
        forks = []
        options = self.cache_config.options()
        with self.pool.allocator.lock:
            self._cache_full_blocks()
            for _ in range(n or 1):
                twin = PagedCache(model, **options)
                twin._rows.extend(row.fork(self.pool.allocator) for row in self._rows)
                twin._seq_length = self._seq_length
                twin._layers_per_forward = self._layers_per_forward  # so a fork notices its own unfinished forward
                twin._note_peak_blocks()
                forks.append(twin)
        return forks[0] if n is None else forks

    # ------------------------------------------------------------------ continuous batching
    def schedule(self, rows: list[Row], new_tokens: list[int]) -> list[int]:
        """Run the next forward on `rows`, which the caller owns (the `Engine`'s requests), row `i` storing
        `new_tokens[i]` new tokens.

        The forward's layout right-aligns the rows: its padded length is `max(row tokens + new tokens)` and it
        computes the last `max(new_tokens)` positions; positions a row already holds inside that window are
        recomputed but not written again. Returns each row's left padding in that layout (the caller builds the
        matching `input_ids`, `attention_mask` and `position_ids`). Call `detach_rows()` before freeing rows.
        """
        self._settle()
        if not rows or len(rows) != len(new_tokens) or min(new_tokens) < 1:
            raise ValueError(
                f"schedule needs one positive new-token count per row, got {len(rows)} row(s) and {new_tokens}"
            )
        totals = [row.num_tokens + count for row, count in zip(rows, new_tokens)]
        length = max(totals)
        pads = [length - total for total in totals]
        unchanged = len(rows) == len(self._rows) and all(
            new is old and new.leading_pads == pad for new, old, pad in zip(rows, self._rows, pads)
        )
        if not unchanged:
            self._plan = None
        for row, pad in zip(rows, pads):
            row.leading_pads = pad
        self._rows[:] = rows
        self._seq_length = length - max(new_tokens)
        self._scheduled = list(new_tokens)
        return pads

    def detach_rows(self) -> None:
        """Forget the rows given to `schedule` without freeing their blocks (their owner frees them)."""
        self._rows.clear()
        self._seq_length = 0
        self._plan = None
        self._pending = None
        self._scheduled = None

    # ------------------------------------------------------------------ row operations used by generate
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i becomes a copy of row `beam_idx[i]` by sharing its blocks (no K/V is copied)."""
        self._select_rows(beam_idx.tolist(), "reorder_cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(torch.as_tensor(indices).tolist(), "batch_select_indices")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows([row for row in range(len(self._rows)) for _ in range(repeats)], "batch_repeat_interleave")

    def _select_rows(self, sources: list[int], caller: str) -> None:
        self._settle()
        if not self._rows:
            return
        if any(isinstance(i, bool) or not isinstance(i, int) for i in sources):
            raise TypeError(f"{caller}: row indices must be integers, got {sources[:5]}")
        bad = [i for i in sources if not 0 <= i < len(self._rows)]
        if bad:
            raise IndexError(f"{caller}: row indices {bad[:5]} are out of range for a cache of {len(self._rows)} rows")
        allocator = self.pool.allocator
        with allocator.lock:
            new_rows = [self._rows[i].fork(allocator) for i in sources]
            _free_rows(allocator, self._rows)
            self._rows.extend(new_rows)
        self._plan = None

    def crop(self, max_length: int) -> None:
        """Remove the last `-max_length` positions (a negative number, as in transformers); blocks that become
        empty go back to the pool."""
        self._settle()
        if max_length > 0:
            raise ValueError(
                f"crop({max_length}): pass a negative number of positions to remove (or 0); positive values are "
                "not supported"
            )
        if -max_length > self._seq_length:
            raise ValueError(f"crop({max_length}) would remove more than the {self._seq_length} cached positions")
        bad = self._released_past(self._seq_length + max_length)
        if bad:
            raise ValueError(
                f"crop({max_length}): rows {bad[:5]} gave back blocks behind the sliding window "
                f"({self.sliding_release_window}) that positions before {self._seq_length + max_length} would attend "
                "to again; start from a new cache (or reset()) instead"
            )
        with self.pool.allocator.lock:
            self._cache_full_blocks()
            self._truncate(self._seq_length + max_length)

    def _truncate(self, new_length: int) -> None:
        """Keep the first `new_length` padded positions of every row."""
        allocator = self.pool.allocator
        for row in self._rows:
            row.truncate(allocator, new_length)
        self._seq_length = new_length
        self._plan = None

    def activate_past_recording(self) -> None:
        """Nothing to do: every position stays in the pool until `crop` removes it."""

    def reset(self) -> None:
        """Return every block to the pool (full ones stay cached by content) and empty the cache for reuse."""
        self._settle()
        with self.pool.allocator.lock:
            self._cache_full_blocks()
            _free_rows(self.pool.allocator, self._rows)
        self._seq_length = 0
        self._plan = None
        self._pending = None

    def release(self) -> None:
        """Return every block to the pool for good; using the cache afterwards raises, releasing it again does
        nothing. The cache's final `stats()` stay readable as `pool.last_cache_stats`."""
        if self._released:
            return
        self._settle()
        self.pool.last_cache_stats = self.stats()
        self.reset()
        self._released = True
        self._finalizer.detach()

    def _settle(self) -> None:
        """Refuse a released cache, and drop what an interrupted forward left behind (every public entry point)."""
        self._check_open()
        with self.pool.allocator.lock:
            self._forget_unfinished_forward()

    def _check_open(self) -> None:
        if self._released:
            raise RuntimeError("this PagedCache was released; its blocks are back in the pool. Build a new one.")

    def __repr__(self) -> str:
        blocks = sum(len(row.live_block_ids) for row in self._rows)
        return (
            f"PagedCache(rows={len(self._rows)}, seq_length={self._seq_length}, "
            f"block_size={self.pool.block_size}, blocks={blocks})"
        )
