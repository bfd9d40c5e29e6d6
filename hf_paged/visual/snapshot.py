"""`pool_snapshot`: what the pictures show — every physical block's state, owners, refcount and fill."""

from __future__ import annotations

import math
import string
from collections.abc import Mapping
from dataclasses import dataclass

from ..allocator import BlockAllocator, BlockTable, tokens_per_block
from ..pool import BlockPool
from ..sizes import format_bytes

FREE, USED, EVICTABLE = "free", "used", "evictable"
GLYPHS = string.ascii_uppercase
FREE_GLYPH, EVICTABLE_GLYPH, SHARED_GLYPH, OTHER_GLYPH = ".", "o", "*", "#"


@dataclass(frozen=True)
class BlockView:
    """One physical block as a picture shows it.

    Attributes:
        block_id (`int`): the physical block id.
        state (`str`): `"free"`, `"used"` (refcount > 0) or `"evictable"` (cached content no table holds).
        ref_count (`int`): tables naming the block, shown or not.
        owners (`tuple[int, ...]`): indices of the shown sequences whose table names the block.
        num_tokens (`int`): tokens the shown sequences hold in it (a full `block_size` for an evictable block; 0 for
            a free block or one held only by tables not shown).
        cached (`bool`): the block is indexed by content in the prefix cache.

    Example:

    ```python
    >>> from hf_paged import BlockAllocator
    >>> allocator = BlockAllocator(num_blocks=2, block_size=4)
    >>> table = allocator.new_table()
    >>> _ = allocator.append(table, 3)
    >>> pool_snapshot(allocator, [table]).blocks[0]
    BlockView(block_id=0, state='used', ref_count=1, owners=(0,), num_tokens=3, cached=False)

    ```
    """

    block_id: int
    state: str
    ref_count: int
    owners: tuple[int, ...]
    num_tokens: int
    cached: bool

    @property
    def is_shared(self) -> bool:
        return self.ref_count > 1


@dataclass(frozen=True)
class PoolSnapshot:
    """The state of a pool at one moment, with the sequences to show.

    Attributes:
        block_size (`int`): tokens per block.
        blocks (`tuple[BlockView, ...]`): every physical block, by id.
        labels (`tuple[str, ...]`): a name for each shown sequence.
        tables (`tuple[tuple[int | None, ...], ...]`): the physical block ids of each shown sequence, in logical
            order (`None`: a block its sliding window skipped, given back).
        num_tokens (`tuple[int, ...]`): tokens in each shown sequence.
        kv_label (`str`, *optional*): how the pool stores K/V (`"float32"`, `"int8"`, ...), for a pool of a model.
        tiers (`str`, *optional*): the tiers behind the pool's prefix cache (`KVOffload.describe()`), if any.
        block_bytes (`int`, *optional*): what one block costs in memory (quantization scales included), for a pool
            of a model.

    Example:

    ```python
    >>> from hf_paged import BlockAllocator
    >>> allocator = BlockAllocator(num_blocks=40, block_size=4)
    >>> table = allocator.new_table()
    >>> _ = allocator.append(table, 9)
    >>> snap = pool_snapshot(allocator, {"A": table})
    >>> snap.labels, snap.tables, snap.count("used"), snap.count("free"), snap.default_window(columns=16)
    (('A',), ((0, 1, 2),), 3, 37, 16)

    ```
    """

    block_size: int
    blocks: tuple[BlockView, ...]
    labels: tuple[str, ...]
    tables: tuple[tuple[int | None, ...], ...]
    num_tokens: tuple[int, ...]
    kv_label: str | None = None
    block_bytes: int | None = None
    tiers: str | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def summary(self, shown: int) -> str:
        """The one-line summary the pictures put above the pool: blocks, used, free (cached), memory when known."""
        num_used, num_evictable = self.count(USED), self.count(EVICTABLE)
        free = f"{self.num_blocks - num_used} free" + (f" ({num_evictable} of them cached)" if num_evictable else "")
        memory = ""
        if self.block_bytes is not None:
            used, total = num_used * self.block_bytes, self.num_blocks * self.block_bytes
            memory = f"; {format_bytes(used)} of {format_bytes(total)} of {self.kv_label} K/V"
        return f"{self.num_blocks} blocks x {self.block_size} tokens: {num_used} used, {free}{memory}; " + (
            f"blocks 0-{shown - 1} shown"
        )

    def count(self, state: str) -> int:
        return sum(1 for block in self.blocks if block.state == state)

    def default_window(self, columns: int) -> int:
        """Blocks to show: up to the last block that is not plain free, rounded up to whole rows of `columns`."""
        last = max((b.block_id for b in self.blocks if b.state != FREE), default=-1)
        return min(self.num_blocks, max(columns, math.ceil((last + 1) / columns) * columns))


def pool_snapshot(source, tables=None) -> PoolSnapshot:
    """Read the pool's state and the block tables to show.

    Args:
        source (`BlockAllocator`, `BlockPool` or `PagedCache`): the pool to read. A `PagedCache` also gives its rows
            (labelled `row 0`, `row 1`, ..., or `row 0 group 1` ... when a hybrid model's rows hold a table per layer
            group) when `tables` is `None`.
        tables (`Sequence[BlockTable]` or `Mapping[str, BlockTable]`, *optional*): the sequences to show, labelled
            `seq 0`, `seq 1`, ... or by the mapping's keys. Used blocks that no shown table names are drawn as held
            by other tables.

    Example:

    ```python
    >>> from hf_paged import BlockAllocator
    >>> allocator = BlockAllocator(num_blocks=4, block_size=2)
    >>> a = allocator.new_table()
    >>> _ = allocator.append(a, 3)
    >>> b = allocator.fork(a)
    >>> snap = pool_snapshot(allocator, {"a": a, "b": b})
    >>> [(v.block_id, v.state, v.owners, v.num_tokens, v.ref_count) for v in snap.blocks]
    [(0, 'used', (0, 1), 2, 2), (1, 'used', (0, 1), 1, 2), (2, 'free', (), 0, 0), (3, 'free', (), 0, 0)]

    ```
    """
    allocator, default_tables, default_prefix = _resolve_source(source)
    kv_label, block_bytes = _memory_of(source)
    if tables is None:
        tables = default_tables
    if isinstance(tables, Mapping):
        labels, table_list = [str(key) for key in tables], list(tables.values())
    else:
        table_list = list(tables)
        labels = [f"{default_prefix} {index}" for index in range(len(table_list))]
    with allocator.lock:
        for label, table in zip(labels, table_list):
            _check_table(allocator, label, table)
        owners: dict[int, list[int]] = {}
        for index, table in enumerate(table_list):
            for block_id in table.live_block_ids:
                owners.setdefault(block_id, []).append(index)
        held = tokens_per_block(table_list, allocator.block_size)
        evictable = set(allocator.evictable_block_ids)
        blocks = []
        for block_id in range(allocator.num_blocks):
            ref_count = allocator.ref_count(block_id)
            state = USED if ref_count else EVICTABLE if block_id in evictable else FREE
            tokens = allocator.block_size if state == EVICTABLE else held.get(block_id, 0)
            cached = allocator.block_hash(block_id) is not None
            blocks.append(BlockView(block_id, state, ref_count, tuple(owners.get(block_id, ())), tokens, cached))
        return PoolSnapshot(
            block_size=allocator.block_size,
            blocks=tuple(blocks),
            labels=tuple(labels),
            tables=tuple(tuple(table.block_ids) for table in table_list),
            num_tokens=tuple(table.num_tokens for table in table_list),
            kv_label=kv_label,
            block_bytes=block_bytes,
            tiers=_tiers_of(source),
        )


def _memory_of(source) -> tuple[str | None, int | None]:
    """`(kv_label, block_bytes)` of the pool behind `source` (`(None, None)` for an allocator or a pool without a
    model)."""
    pool = getattr(source, "pool", source)
    stats = pool.stats() if isinstance(pool, BlockPool) else None
    if stats is None or stats.block_bytes is None:
        return None, None
    label = stats.kv_dtype if stats.kv_dtype != "auto" else str(pool.kv_shape.dtype).removeprefix("torch.")
    return label, stats.block_bytes


def _tiers_of(source) -> str | None:
    """The tiers behind the pool of `source`, in one line (`None` without tiers)."""
    offload = getattr(getattr(source, "pool", source), "offload", None)
    return None if offload is None else offload.describe()


def _resolve_source(source) -> tuple[BlockAllocator, list[BlockTable], str]:
    from ..batch_cache import BatchCache

    if isinstance(source, BatchCache):
        if source.layout.num_groups == 1:
            return source.pool.allocator, source.row_tables, "row"
        tables = {
            f"row {row} group {group}": table
            for group, group_tables in enumerate(source.group_tables)
            for row, table in enumerate(group_tables)
        }
        return source.pool.allocator, tables, "row"
    if isinstance(source, BlockPool):
        return source.allocator, [], "seq"
    if isinstance(source, BlockAllocator):
        return source, [], "seq"
    raise TypeError(f"expected a BlockAllocator, BlockPool or PagedCache, got {type(source).__name__}")


def _check_table(allocator: BlockAllocator, label: str, table) -> None:
    if not isinstance(table, BlockTable):
        raise TypeError(f"sequence {label!r}: expected a BlockTable, got {type(table).__name__}")
    if table.is_freed:
        raise ValueError(f"sequence {label!r}: {table!r} was freed")
    for block_id in table.live_block_ids:
        if not 0 <= block_id < allocator.num_blocks or allocator.ref_count(block_id) == 0:
            raise ValueError(
                f"sequence {label!r}: {table!r} names block {block_id}, which this allocator of "
                f"{allocator.num_blocks} blocks does not hold in use (a table of another allocator?)"
            )


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def shown_blocks(snapshot: PoolSnapshot, columns: int, max_blocks: int | None) -> int:
    """How many blocks a picture shows: `max_blocks`, or what the snapshot suggests for `columns`."""
    if max_blocks is None:
        return snapshot.default_window(columns)
    check_positive("max_blocks", max_blocks)
    return min(max_blocks, snapshot.num_blocks)
