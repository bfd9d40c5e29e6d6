"""`BatchCache`: a transformers `Cache` that writes and reads K/V through the `ForwardBatch` of the running forward."""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache

from .batch import ForwardBatch, ForwardInputs, address_tables
from .forward import ForwardBoundCache, attach_to_model
from .groups import KVLayout
from .kernels import KernelChoice, resolve_kernel
from .layer import PagedLayer
from .planner import ForwardPlanner
from .pool import BlockPool
from .rows import Row


class BatchCache(Cache, ForwardBoundCache):
    """A `Cache` over a model's `BlockPool` that only writes and reads: every forward runs a `ForwardBatch` planned
    before the model runs (blocks taken, slots addressed), given with `run(batch)`. The Engine runs its scheduler's
    batches through one; `PagedCache` subclasses it and plans its own batches for `generate`.

    `update(key_states, value_states, layer_idx)` writes the new tokens' K/V into the planned slots. Under the
    `"hf_paged"` attention it returns only those new tokens: the attention reads the layer's whole K/V through the
    block tables (`read_layer`). Under any other attention it returns the layer's K/V gathered densely,
    `[batch, num_kv_heads, positions read, head_dim]`, as transformers' dynamic layers do (a sliding layer: its
    last `sliding_window - 1` positions and the new ones).

    Args:
        model (`PreTrainedModel`): the model whose forwards use this cache.
        planner (`ForwardPlanner`): plans the batches (its pool and layout are the cache's).
        kernel (`str`, *optional*): the paged-attention backend (`cache_config` `kernel`: `"auto"`, `"gather"`,
            `"cpu"`; default `kernels.DEFAULT_KERNEL`), resolved for the model's device (see `kernels`).

    Attributes:
        eager_math (`bool`): the `"hf_paged"` attention computes in eager attention's plain torch ops instead of SDPA
            (the Engine sets it for a model set to eager attention, so its outputs stay those of stock eager).
        kernel (`KernelChoice`): the backend the `"hf_paged"` attention calls, and for which shapes.
        attention_calls (`dict[str, int]`): attention calls (one per layer and forward) by the backend that ran
            them (`"gather"` or an in-place backend such as `"cpu"`); a packed forward split between both counts
            once for each.

    Example:

    ```python
    >>> import torch, hf_paged
    >>> from hf_paged.planner import ForwardPlanner
    >>> from hf_paged.reference_models import tiny_model
    >>> model = tiny_model("llama")
    >>> pool = hf_paged.get_pool(model, block_size=4, num_blocks=16)
    >>> planner = ForwardPlanner(pool, pool.layout)
    >>> rows = pool.new_rows(1, pool.layout.num_groups, track_tokens=False)
    >>> cache = BatchCache(model, planner)
    >>> cache.run(planner.plan_step(rows, [3]))
    >>> logits = model(torch.tensor([[5, 6, 7]]), past_key_values=cache).logits
    >>> cache.get_seq_length(), rows[0].num_tokens
    (3, 3)
    >>> pool.free_rows(rows)

    ```
    """

    def __init__(self, model: torch.nn.Module, planner: ForwardPlanner, kernel: str | None = None):
        layout = planner.layout
        super().__init__(layers=[PagedLayer(self, i, window) for i, window in enumerate(layout.layer_windows)])
        self.planner = planner
        self.pool: BlockPool = planner.pool
        self._model_ref = weakref.ref(model)
        self._model_name = type(model).__name__
        self._last_update: tuple | None = None  # (layer, keys, values) the last update returned to the attention
        self._batch: ForwardBatch | None = None
        self._layers_per_forward = 0  # most layers seen writing in one forward
        self.eager_math = False
        self.kernel: KernelChoice = resolve_kernel(kernel, _model_device(model), self.pool.block_size)
        self.attention_calls: dict[str, int] = {}
        self._query_starts: dict[tuple, torch.Tensor] = {}
        attach_to_model(model)

    # ------------------------------------------------------------------ views
    @property
    def layout(self) -> KVLayout:
        """The model's layer groups (see `KVLayout`); every row holds one block table per group."""
        return self.planner.layout

    @property
    def skip_window(self) -> int | None:
        """The widest window by which the sliding layer groups skip blocks (`None`: every group keeps its blocks);
        setting it overrides every sliding group's window (`None`: keep every block)."""
        return self.layout.skip_window

    @skip_window.setter
    def skip_window(self, window: int | None) -> None:
        self.planner.layout = self.layout.with_skip_window(window)
        self.planner.forget_previous()

    @property
    def rows(self) -> list[Row]:
        """The rows of the current forward (do not modify)."""
        return [] if self._batch is None else self._batch.rows

    @property
    def row_tables(self) -> list:
        """The `BlockTable` of every row in the first layer group, the only one unless the model is a hybrid (do not
        modify)."""
        return [row.table for row in self.rows]

    @property
    def group_tables(self) -> list[list]:
        """`group_tables[g][i]`: the `BlockTable` of row `i` in layer group `g` (see `layout`; do not modify)."""
        return [[row.tables[group] for row in self.rows] for group in range(self.layout.num_groups)]

    @property
    def leading_pads(self) -> list[int]:
        """Left-pad positions of every row, which hold no block slots."""
        return [row.leading_pads for row in self.rows]

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def prefix_caching(self) -> bool:
        return self.planner.prefix_caching

    def stop_prefix_caching(self) -> None:
        """Stop addressing blocks by token ids, for good: no prefix lookups, and no block filled from now on is
        indexed (the K/V of a forward with images, `inputs_embeds`, ... depend on more than the token ids)."""
        self.planner.stop_prefix_caching()
        for row in self.rows:
            row.record(None)

    def _cached_length(self) -> int:
        """Padded positions cached once the current forward has written."""
        return 0 if self._batch is None else self._batch.length

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Padded length of every row: before the running forward's first layer writes, the positions cached before
        it (what transformers reads to place the new tokens and size the masks)."""
        batch = self._batch
        if batch is not None and not batch.layers_written:
            return batch.past_length
        return self._cached_length()

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def __iter__(self):
        """Per layer, as `DynamicCache` yields: `(keys, values, window)`, the dense views of `layers[i]` and a sliding
        layer's window as a tensor (`None` for a full layer)."""
        for layer in self.layers:
            window = None if layer.sliding_window is None else torch.tensor(layer.sliding_window, dtype=torch.long)
            yield layer.keys, layer.values, window

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        """Whether the cache held K/V before the running forward (after it, once a forward has run), as a
        `DynamicCache` is initialized by its first forward: models such as PaliGemma, Molmo2 and HRM tell their first
        forward by it. Rows that hold no token yet (a prompt aligned before its first forward) do not count."""
        return self.get_seq_length() > 0

    # ------------------------------------------------------------------ the running forward
    def run(self, batch: ForwardBatch) -> None:
        """Run the next forward of the model on `batch` (planned by the caller with this cache's planner)."""
        self._check_finished_forward()
        self._batch = batch

    def detach(self) -> None:
        """Forget the current batch (its rows' owner frees their blocks)."""
        self._batch = None

    def prepare_forward(self, model: torch.nn.Module, inputs: ForwardInputs) -> None:
        """Called by the forward pre-hook before each forward of `model` with its inputs."""
        self._check_model(model)
        batch = self._batch
        if batch is None or batch.layers_written:
            raise RuntimeError("BatchCache: no batch was given with run() for this forward")
        if inputs.shape is not None and inputs.shape != batch.input_shape:
            raise ValueError(
                f"the forward's inputs have shape {inputs.shape} but its batch plans inputs of {batch.input_shape}"
            )
        if batch.packed is not None and not inputs.reads_tables:
            raise ValueError("a packed batch needs the 'hf_paged' attention, which reads each row through its table")
        self._follow_inputs(inputs)
        batch.reads_tables = inputs.reads_tables

    def _follow_inputs(self, inputs: ForwardInputs) -> None:
        """Stop prefix caching for good when the forward's K/V depend on more than its token ids."""
        if inputs.beyond_token_ids and self.prefix_caching:
            self.stop_prefix_caching()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write layer `layer_idx`'s new K/V (`[batch, num_kv_heads, new positions, head_dim]`) through the running
        forward's write slots; returns the new K/V under `"hf_paged"` attention, else the layer's K/V read densely
        (the new positions' own K/V at the end, pads included)."""
        batch = self._batch_for(layer_idx, key_states)
        if (key_states.shape[0], key_states.shape[2]) != batch.input_shape:
            raise NotImplementedError(
                f"{self._model_name}: layer {layer_idx} wrote K/V of {key_states.shape[0]} x {key_states.shape[2]} "
                f"positions in a forward whose input was {batch.input_shape[0]} x {batch.input_shape[1]} (the model "
                "adds positions of its own, as CPM-Ant's prompt tokens do), where the Engine plans every step's "
                "slots from its input tokens; model.generate(..., cache_implementation='paged') serves it"
            )
        unread = batch.unread_layer(layer_idx, len(self.layers))
        if unread is not None:
            raise self._unread_error(unread)
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
        storage = self.pool.storage
        batch.write(storage, layer_idx, key_states, value_states)
        if batch.is_complete(len(self.layers)) and self.prefix_caching:
            # every layer wrote: the full blocks can be found by others (deduplicated at the next planning)
            self.pool.index_full_blocks(batch.rows, self.planner.roots, share=False)
        if batch.reads_tables:
            self._last_update = (layer_idx, key_states, value_states)
            return key_states, value_states
        return batch.read(storage, layer_idx, new=(key_states, value_states))

    def record_compiled_forward(self) -> None:
        """Account for the running batch's forward run by a compiled step (`engine.step_runner`), whose attention
        wrote and read every layer through the ops rather than `update`: every layer counts as written and read, and
        the batch's full blocks are indexed for prefix reuse, as `update` does after the last layer."""
        batch = self._batch
        layers = range(len(self.layers))
        batch.layers_written.update(layers)
        batch.layers_read.update(layers)
        batch.last_layer = layers[-1]
        batch.reads_tables = True
        if self.prefix_caching:
            self.pool.index_full_blocks(batch.rows, self.planner.roots, share=False)

    def read_layer(
        self,
        layer_idx: int | None,
        rows: torch.Tensor | None = None,
        start: int = 0,
        stop: int | None = None,
        new: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of `layer_idx` (default: the layer that wrote last) for every padded position it attends to, gathered
        through the block tables: `[batch, num_kv_heads, length, head_dim]`; only `rows` and positions `start ..
        stop - 1` when given, the forward's own K/V `new` in the last positions (see `ForwardBatch.read`)."""
        batch = self._batch
        if batch is None or batch.last_layer is None:
            raise RuntimeError("read_layer called before any update in this forward")
        layer_idx = batch.last_layer if layer_idx is None else layer_idx
        return batch.read(self.pool.storage, layer_idx, rows, start, stop, new)

    def check_attention_inputs(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Refuse (`NotImplementedError`) an attention handed other K/V than its layer's update returned: the model
        transformed them after the update (split, repeated, widened), which the K/V it reads through the block
        tables would not have been. The usual case (the same tensors) costs two identity checks."""
        last = self._last_update
        if last is None or last[0] != layer_idx:
            return
        updated_keys, updated_values = last[1], last[2]
        if _same_tensor(key, updated_keys) and _same_tensor(value, updated_values):
            return
        raise NotImplementedError(
            f"{self._model_name}: layer {last[0]}'s attention got other K/V than its cache update returned (keys "
            f"{tuple(key.shape)} for {tuple(updated_keys.shape)}, values {tuple(value.shape)} for "
            f"{tuple(updated_values.shape)}): the model transforms its K/V after the update, which the 'hf_paged' "
            "attention cannot apply to the cached tokens it reads through the block tables. Generate with "
            "cache_config={'attn_implementation': 'sdpa'} (or 'eager') to read dense K/V instead."
        )

    def forward_finished(self) -> None:
        self._last_update = None

    def key_groups(self):
        """How the running right-aligned forward's rows split to read their keys (`ForwardBatch.key_groups`), or
        `None`: all rows together."""
        return None if self._batch is None else self._batch.key_groups(self.planner.key_group_cost)

    def reads_tables_in_attention(self) -> bool:
        return self._batch is not None and self._batch.reads_tables

    def attending_layer(self, module_layer: int | None) -> int | None:
        """The layer whose K/V an attention call of the running forward reads: the one that wrote last, while its
        attention has not read it yet (the cache slot the model's update named, which may differ from the module's
        `layer_idx`: HRM offsets it per recurrent cycle); else `module_layer` when that layer wrote. `None`: the call
        belongs to no layer of this cache (a vision encoder's attention, before any layer wrote)."""
        batch = self._batch
        if batch is None:
            return None
        last = batch.last_layer
        if module_layer is None or (last is not None and last not in batch.layers_read):
            return last
        return module_layer if module_layer in batch.layers_written else None

    @property
    def forward_batch(self) -> ForwardBatch | None:
        """The running forward's `ForwardBatch` (`None` between forwards)."""
        return self._batch

    def layer_blocks(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V blocks of `layer_idx` as they lie, `[num_blocks, block_size, num_kv_heads, head_dim]`."""
        return self.pool.storage.layer_tensors(layer_idx)

    def query_starts(self, rows: int, num_new: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """int32 `[rows + 1]` query starts of `rows` rows of `num_new` queries each, on `device` (cached: built once,
        not per layer)."""
        key = (rows, num_new, torch.device(device))
        if key not in self._query_starts:
            self._query_starts[key] = torch.arange(0, (rows + 1) * num_new, num_new, dtype=torch.int32, device=key[2])
        return self._query_starts[key]

    def count_attention(self, backend: str) -> None:
        """Count one attention call run by `backend` (see `attention_calls`)."""
        self.attention_calls[backend] = self.attention_calls.get(backend, 0) + 1

    def packed_rows(self):
        """The `PackedRows` of the running forward when its tokens are packed (no pad position), else `None`."""
        return None if self._batch is None else self._batch.packed

    def layer_window(self, layer_idx: int) -> int | None:
        """The attention window of layer `layer_idx` (`None`: full attention)."""
        return self.layout.layer_windows[layer_idx]

    def dense_layer(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A copy of layer `layer_idx`'s K/V laid out as transformers' dynamic layers hold them:
        `[batch, num_kv_heads, length, head_dim]` over the padded positions (a sliding-window layer: its last
        `sliding_window - 1`), left-pad positions zero (they are never stored). `(None, None)` while no token is
        cached. For inspection (`cache.layers[i].keys`); the pages themselves are not changed."""
        length = self._cached_length()
        storage = self.pool.storage
        rows = self.rows
        if not rows or length == 0 or not storage.has_layer(layer_idx):
            return None, None
        device = storage.device_of(layer_idx)
        tables = [row.tables[self.layout.group_of[layer_idx]] for row in rows]
        pads = [row.leading_pads for row in rows]
        addressing = address_tables(tables, pads, self.pool.block_size, length, 0, device)
        first = self.layout.first_read(layer_idx, length)
        keys, values = storage.gather(layer_idx, addressing.slot_map[:, first:])
        position = torch.arange(first, length, device=device)
        stored = (position[None, :] >= torch.tensor(pads, device=device)[:, None])[:, None, :, None]
        return keys.where(stored, 0), values.where(stored, 0)

    # ------------------------------------------------------------------ checks
    def _batch_for(self, layer_idx: int, key_states: torch.Tensor) -> ForwardBatch:
        """The batch layer `layer_idx` writes through."""
        batch = self._batch
        if batch is None or layer_idx in batch.layers_written:
            raise RuntimeError(f"BatchCache: layer {layer_idx} wrote with no batch given with run() for this forward")
        return batch

    def _check_finished_forward(self) -> None:
        """Refuse to start a forward while the last complete one left a layer unread (see `_unread_error`), and
        learn how many layers write in one forward."""
        batch = self._batch
        if batch is None:
            return
        unread = batch.unread_layer(None, len(self.layers))
        if unread is not None:
            raise self._unread_error(unread)
        self._layers_per_forward = max(self._layers_per_forward, len(batch.layers_written))

    def _unread_error(self, layer_idx: int) -> NotImplementedError:
        return NotImplementedError(
            f"{self._model_name}: layer {layer_idx} stored its K/V in the paged cache but its attention did not read "
            "them back through the block tables (the model does not route that attention through the 'hf_paged' "
            "attention function), so it would have attended to the new tokens only. Generate with "
            "cache_config={'attn_implementation': 'sdpa'} (or 'eager') to read dense K/V instead."
        )

    def _check_model(self, model: torch.nn.Module) -> None:
        owner = self._model_ref()
        if owner is not model:
            raise ValueError(
                f"this {type(self).__name__} was built for a {self._model_name} (id {id(owner):#x}) and cannot be "
                f"used with a {type(model).__name__} (id {id(model):#x}); build one per model"
            )


def _model_device(model: torch.nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return torch.device("cpu") if parameter is None else parameter.device


def _same_tensor(given: torch.Tensor, returned: torch.Tensor) -> bool:
    """Whether `given` is `returned`, or holds the same values (a copy, another layout)."""
    if given is returned:
        return True
    return given.shape == returned.shape and torch.equal(given, returned.to(given.dtype))
