"""`ForwardPlanner`: the one place that takes blocks for a forward and turns the rows' block tables into the
`ForwardBatch` the model's layers write and read through."""

from __future__ import annotations

import dataclasses

import torch

from .batch import ForwardBatch, ForwardInputs, PackedRows, address_packed, address_tables, extend_addressing
from .config import PagedCacheConfig
from .groups import KVLayout, layer_windows
from .key_groups import group_cost
from .pool import BlockPool, get_pool
from .prefix import group_roots, prefix_namespace, root_hash
from .rows import Row
from .support import check_supported


class ForwardPlanner:
    """Plans forwards over one `BlockPool`: before a forward runs it gives back the blocks sliding windows skipped,
    indexes full blocks for prefix caching, takes the blocks of the new tokens (all or nothing, copy-on-write copies
    carried out) and addresses them. `PagedCache` plans each `generate` forward with it in the forward pre-hook; the
    Engine's `Scheduler` decides and takes blocks with it in one call, so what it decides is what runs.

    Args:
        pool (`BlockPool`): the model's pool.
        layout (`KVLayout`): the model's layer groups; the only source of the windows by which rows skip blocks.
        root (`bytes`, *optional*): the prefix-cache namespace (`prefix.root_hash` of the model).
        prefix_caching (`bool`): whether blocks are addressed by content (needs `root`).

    Example:

    ```python
    >>> from hf_paged.groups import KVLayout
    >>> from hf_paged.pool import BlockPool
    >>> pool = BlockPool(num_blocks=8, block_size=4)
    >>> planner = ForwardPlanner(pool, KVLayout.for_windows([None, None]))
    >>> rows = pool.new_rows(2, num_groups=1, track_tokens=False)
    >>> batch = planner.plan_step(rows, [5, 3])     # right-aligned: row 1 gets 2 left pads
    >>> batch.past_length, batch.num_new, batch.leading_pads, [row.table.block_ids for row in rows]
    (0, 5, [0, 2], [[0, 1], [2]])
    >>> pool.free_rows(rows)

    ```
    """

    def __init__(self, pool: BlockPool, layout: KVLayout, root: bytes | None = None, prefix_caching: bool = True):
        self.pool = pool
        self.layout = layout
        self.root = root
        self.roots: list[bytes] | None = None  # every layer group's chain root; None: no prefix caching
        if prefix_caching and root is not None:
            self.roots = group_roots(root, layout.num_groups)
        self._previous: ForwardBatch | None = None
        self._namespace_roots: dict[tuple, tuple[bytes, list[bytes]]] = {}
        shape = pool.kv_shape
        # what one more group of rows reading their keys together costs, in key positions (see key_groups)
        self.key_group_cost = group_cost(shape and shape.bytes_per_token // shape.num_layers)

    @classmethod
    def for_model(cls, model: torch.nn.Module, config: PagedCacheConfig, caller: str = "PagedCache") -> ForwardPlanner:
        """The planner of `model`'s pool (created on first use, see `get_pool`) under `config`; `caller` names who
        asks (`"Engine"`, `"generate"`), in what the pool says set its size."""
        check_supported(model)
        pool = cls.pool_for(model, config, caller)
        windows = layer_windows(model, model.config.get_text_config(decoder=True))
        layout = pool.layout
        if layout is None or len(layout.group_of) != len(windows):
            layout = KVLayout.for_windows(windows, split=False)
        return cls(pool, layout, pool_root(pool, model), config.resolved_prefix_caching)

    @staticmethod
    def pool_for(model: torch.nn.Module, config: PagedCacheConfig, caller: str = "PagedCache") -> BlockPool:
        """`get_pool(model)` under `config`, asked for by `caller`."""
        # the K/V format is never inherited from an earlier call: a call that does not ask for quantized pages
        # gets pages in the model's dtype (an idle pool of another format is rebuilt)
        return get_pool(model, config=dataclasses.replace(config, kv_dtype=config.resolved_kv_dtype), caller=caller)

    # ------------------------------------------------------------------ state
    @property
    def prefix_caching(self) -> bool:
        return self.roots is not None

    def roots_for(self, namespace: bytes | None) -> list[bytes] | None:
        """Every layer group's chain root for content computed under `namespace` on top of the model (a LoRA
        adapter's name and weights digest): blocks of different namespaces never stand in for each other. `None`
        gives the model's own `roots`; `None` is returned without prefix caching."""
        if self.roots is None or namespace is None:
            return self.roots
        key = (self.root, namespace)
        entry = self._namespace_roots.get(key)
        if entry is None:
            if len(self._namespace_roots) > 256:
                self._namespace_roots.clear()
            namespace_root = root_hash(self.root + namespace)
            entry = self._namespace_roots[key] = (namespace_root, group_roots(namespace_root, self.layout.num_groups))
        namespace_root, roots = entry
        if self.pool.offload is not None:  # the namespace is valid across processes: its blocks can be kept
            self.pool.offload.register_namespace(self.root, namespace, namespace_root, len(roots))
        return roots

    def stop_prefix_caching(self) -> None:
        """No prefix lookups and no indexing from now on."""
        self.roots = None

    def refresh_root(self, model: torch.nn.Module, rows: list[Row] = ()) -> bytes:
        """Recompute `root` from `model` as it is now (its weights may have been trained since). When it changed,
        `rows` (those holding K/V) are never indexed again: their K/V so far comes from the previous weights, so no
        block they fill from now on may stand for the new weights' K/V of its tokens."""
        root = pool_root(self.pool, model)
        if root != self.root:
            for row in rows:
                row.record(None)
        self.root = root
        if self.roots is not None:
            self.roots = group_roots(self.root, self.layout.num_groups)
        return self.root

    def forget_previous(self) -> None:
        """The rows' tables changed other than by appending (reorder, truncation): the next forward is addressed
        from scratch."""
        self._previous = None

    # ------------------------------------------------------------------ blocks
    def prepare(self, rows: list[Row]) -> None:
        """Before deciding what the next forward takes: put the rows' full blocks into the prefix index (every
        layer has written them) and give back the blocks their windows skipped from their next token on."""
        changed = self.roots is not None and self.pool.index_full_blocks(rows, self.roots)
        if self.pool.free_skipped(rows, self.layout.windows) or changed:
            self._previous = None

    def blocks_needed(self, rows: list[Row], counts: list[int]) -> int:
        """Free blocks taking `counts[i]` more tokens in every table of `rows[i]` would use now."""
        return self.pool.blocks_needed(_appends(rows, counts))

    def take(self, rows: list[Row], counts: list[int], what: str | None = None, keep_free: int = 0) -> int:
        """Take the blocks of `counts[i]` more tokens in every table of `rows[i]`: all of them or
        (`PoolExhaustedError`) none, leaving `keep_free` blocks free. Returns the blocks copied on write."""
        copies = self.pool.take_blocks(_appends(rows, counts), what, keep_free)
        if copies:
            self._previous = None
        return copies

    def admit(self, row: Row, num_new: int, chunk: int, keep_free: int = 0) -> int:
        """Take the blocks of the first `chunk` of a prompt's `num_new` uncomputed tokens for `row`, only if the pool
        also holds the rest of the prompt in the groups that keep every block (sliding groups give blocks back
        between chunks) and `keep_free` more; else `PoolExhaustedError`, nothing taken."""
        rest = 0
        if chunk < num_new:
            whole = [
                (table, num_new if window is None else chunk) for table, window in zip(row.tables, self.layout.windows)
            ]
            rest = self.pool.blocks_needed(whole) - self.pool.blocks_needed(row.appends(chunk))
        what = f"a prompt of {num_new} token(s)" if chunk == num_new else f"a prompt chunk of {chunk} token(s)"
        return self.take([row], [chunk], what=what, keep_free=keep_free + rest)

    def blocks_to_run(self, num_tokens: int, chunk: int) -> int:
        """The most blocks a request of `num_tokens` tokens holds at once on its way to its next token, prefilled in
        chunks of at most `chunk`: every block in a group that keeps its blocks; in a sliding group, at most its
        window and one chunk (skipped blocks go back before each forward)."""
        size = self.pool.block_size
        total = 0
        for window in self.layout.windows:
            blocks = -(-(num_tokens + 1) // size)
            if window is not None:
                blocks = min(blocks, self._window_blocks(window, chunk))
            total += blocks
        return total

    def _window_blocks(self, window: int, chunk: int) -> int:
        """The most blocks a row of a sliding group holds while computing `chunk` tokens: those of its last
        `window - 1` tokens and the chunk's, one block more where they start inside a block."""
        return -(-(window - 1 + chunk) // self.pool.block_size) + 1

    def peak_blocks(self, prompts: list[tuple[int, int, int]], prefill_chunk: int | None = None) -> int:
        """The most blocks a `generate` call's rows can hold at once, in the worst case. `prompts` lists one
        `(prompt tokens, tokens at the end, rows)` per distinct prompt (see `prompt_groups`); the prompt is
        prefilled once for its rows (in chunks of `prefill_chunk` tokens, when given), its full blocks stay shared by
        all of them, and every row holds blocks of its own past them (beams and sampled sequences may all differ). A
        sliding group holds at most its window and one block more per row. Both counts only grow after the
        prefill, so the peak is the prefill's or the last forward's.

        Example:

        ```python
        >>> from hf_paged.groups import KVLayout
        >>> from hf_paged.pool import BlockPool
        >>> planner = ForwardPlanner(BlockPool(num_blocks=64, block_size=4), KVLayout.for_windows([None]))
        >>> planner.peak_blocks([(6, 13, 2)])   # blocks [0] shared, blocks 1-3 of each of 2 rows
        7

        ```
        """
        size = self.pool.block_size
        prefill = last = 0
        for prompt, total, rows in prompts:
            shared = prompt // size
            for window in self.layout.windows:
                first, held = -(-prompt // size), shared + rows * (-(-total // size) - shared)
                if window is not None:
                    chunk = prompt if prefill_chunk is None else min(prefill_chunk, prompt)
                    first = min(first, self._window_blocks(window, chunk))
                    held = min(held, rows * self._window_blocks(window, 1))
                prefill, last = prefill + first, last + held
        return max(prefill, last)

    def never_fits(self, num_tokens: int, chunk: int) -> str | None:
        """Why a request of `num_tokens` tokens can never run in this pool (`blocks_to_run` exceeds the whole
        pool), or `None`."""
        blocks = self.blocks_to_run(num_tokens, chunk)
        if blocks <= self.pool.num_blocks:
            return None
        groups = "" if self.layout.num_groups == 1 else f" over its {self.layout.num_groups} layer groups"
        return (
            f"the request needs {blocks} blocks of {self.pool.block_size} tokens{groups} for its {num_tokens} tokens "
            f"and the next one, but the whole pool has {self.pool.num_blocks} blocks"
            + ("" if self.pool.sized_by is None else f", sized by {self.pool.sized_by}")
        )

    # ------------------------------------------------------------------ forwards
    def plan_step(
        self,
        rows: list[Row],
        new_tokens: list[int],
        token_ids: list[list[int]] | None = None,
        taken: bool = False,
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        """The forward of `rows`, row `i` storing `new_tokens[i]` new tokens (`token_ids[i]`, for the prefix index),
        right-aligned: its padded length is `max(row tokens + new tokens)` and it computes the last
        `max(new_tokens)` positions; positions a row already holds inside that window are recomputed but not
        written again. Takes the blocks first unless `taken` (the caller took them with `take`/`admit`)."""
        copies = self._take_and_record(rows, new_tokens, token_ids, taken)
        totals = [row.num_tokens for row in rows]
        length, num_new = max(totals), max(new_tokens)
        for row, total in zip(rows, totals):
            row.leading_pads = length - total
        return self.address(rows, length - num_new, num_new, new_tokens, None, copies, device)

    def _take_and_record(
        self, rows: list[Row], new_tokens: list[int], token_ids: list[list[int]] | None, taken: bool
    ) -> int:
        """Take the blocks of the new tokens (unless `taken`) and record their ids in the rows; returns the blocks
        copied on write."""
        if not rows or len(rows) != len(new_tokens) or min(new_tokens) < 1:
            raise ValueError(
                f"a forward needs one positive new-token count per row, got {len(rows)} row(s) and {new_tokens}"
            )
        copies = 0 if taken else self.take(rows, new_tokens, what=f"a forward of {len(rows)} row(s)")
        for index, row in enumerate(rows):
            if row.tokens is not None:
                row.record(None if token_ids is None else token_ids[index])
        return copies

    def plan_packed(
        self,
        rows: list[Row],
        new_tokens: list[int],
        token_ids: list[list[int]] | None = None,
        taken: bool = False,
        device: torch.device | str = "cpu",
    ) -> ForwardBatch:
        """The forward of `rows`, row `i` storing `new_tokens[i]` new tokens (`token_ids[i]`, for the prefix index),
        packed into one sequence of `sum(new_tokens)` tokens with no pad position: the model computes only real
        tokens, and attention reads each row's own keys through the tables. Takes the blocks first unless `taken`."""
        copies = self._take_and_record(rows, new_tokens, token_ids, taken)
        pasts = [row.num_tokens - count for row, count in zip(rows, new_tokens)]
        for row in rows:
            row.leading_pads = 0
        size = self.pool.block_size
        addressing = [
            address_packed([row.tables[group] for row in rows], new_tokens, size, device)
            for group in range(self.layout.num_groups)
        ]
        total = sum(new_tokens)
        batch = ForwardBatch(list(rows), addressing, self.layout, 0, total, True, copies, [0] * len(rows))
        batch.packed = PackedRows.of(pasts, new_tokens, device, cost=self.key_group_cost)
        self._previous = None  # a packed slot map is not extended
        return batch

    def address(
        self,
        rows: list[Row],
        past_length: int,
        num_new: int,
        stores: list[int],
        writers: list[bool] | None,
        num_copies: int,
        device: torch.device | str,
        reads_tables: bool = False,
    ) -> ForwardBatch:
        """The `ForwardBatch` of rows whose blocks for this forward are taken: each computes the last `num_new` of
        its `past_length + num_new` padded positions and stores the last `stores[i]` of them (not at all where
        `writers[i]` is False: a duplicate of another row). The previous forward's slot maps are extended when only
        appends happened since."""
        pads = [row.leading_pads for row in rows]
        previous = self._previous
        appended_only = (
            previous is not None
            and not num_copies
            and writers is None
            and min(stores) == num_new
            and previous.length == past_length
            and previous.leading_pads == pads
            and len(previous.rows) == len(rows)
            and all(old is new for old, new in zip(previous.rows, rows))
        )
        size, length = self.pool.block_size, past_length + num_new
        addressing = []
        for group in range(self.layout.num_groups):  # one slot map per layer group, used by its layers
            tables = [row.tables[group] for row in rows]
            if appended_only:
                addressing.append(extend_addressing(previous.groups[group], tables, size, num_new))
            else:
                addressing.append(address_tables(tables, pads, size, length, num_new, device, stores, writers))
        batch = ForwardBatch(list(rows), addressing, self.layout, past_length, num_new, reads_tables, num_copies, pads)
        self._previous = batch
        return batch


def _appends(rows: list[Row], counts: list[int]) -> list:
    return [append for row, count in zip(rows, counts) for append in row.appends(count)]


def duplicate_row_leaders(inputs: ForwardInputs, batch: int, num_new: int) -> list[int] | None:
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


def pool_root(pool: BlockPool, model: torch.nn.Module) -> bytes:
    """The prefix-cache root of `model`'s blocks in `pool`: the model's namespace (`prefix_namespace`) and the
    pool's K/V format, so blocks of different formats never stand in for each other."""
    root = root_hash(prefix_namespace(model) + f"\x1fkv:{pool.kv_dtype}".encode())
    if pool.offload is not None:
        pool.offload.register_root(model, root, pool)
    return root
