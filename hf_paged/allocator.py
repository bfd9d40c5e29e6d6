"""Block allocator: free queue, refcounts, block tables and copy-on-write decisions (pure Python, no torch)."""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass, field

from .errors import InvariantError, PoolExhaustedError


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int, got {value!r} ({type(value).__name__})")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int (>= 1), got {value}")
    return value


def _num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(eq=False)
class BlockTable:
    """Logical → physical block mapping of one sequence.

    `block_ids[i]` is the physical block holding tokens `[i * block_size, (i + 1) * block_size)` of the sequence.
    Tables are created and changed only through their `BlockAllocator`.

    Attributes:
        block_ids (`list[int]`): physical block ids, in logical order.
        num_tokens (`int`): tokens recorded in the table.
    """

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0
    table_id: int = -1
    is_freed: bool = False

    def __repr__(self) -> str:
        return f"BlockTable(id={self.table_id}, block_ids={self.block_ids}, num_tokens={self.num_tokens})"


@dataclass(frozen=True)
class BlockCopy:
    """A copy-on-write decision: copy physical block `src` into the freshly allocated block `dst`."""

    src: int
    dst: int


@dataclass(frozen=True)
class AllocatorStats:
    """A snapshot of the allocator's accounting.

    `tokens_stored` counts each physical block once (a block shared by four tables holds its tokens once), and
    `waste_fraction = (slots_allocated - tokens_stored) / slots_allocated` (0 when nothing is allocated).
    """

    num_blocks: int
    block_size: int
    num_free: int
    num_used: int
    peak_used: int
    tokens_stored: int
    slots_allocated: int
    waste_fraction: float
    cow_copies: int
    num_tables: int


class BlockAllocator:
    """Hands out numbered fixed-size blocks to block tables, one block at a time, only when the last one is full.

    Free blocks form a queue: a fresh allocator hands them out in ascending id order, and freed blocks join the
    back. Blocks are refcounted; `fork` shares every block of a table, and `append` copies a shared partial block
    before writing into it (copy-on-write), returning the copies the KV storage must perform. Every method that can
    run out of blocks checks first and raises `PoolExhaustedError` without changing anything. All methods are
    thread-safe (one re-entrant lock per allocator, exposed as `lock` for callers that compose several calls).

    Args:
        num_blocks (`int`): number of physical blocks in the pool.
        block_size (`int`): tokens per block.

    Example:

    ```python
    >>> from hf_paged import BlockAllocator
    >>> allocator = BlockAllocator(num_blocks=100, block_size=10)
    >>> a, b = allocator.new_table(), allocator.new_table()
    >>> _ = allocator.append(a, 8), allocator.append(b, 12)
    >>> a.block_ids, b.block_ids, allocator.free_block_ids[:3]
    ([0], [1, 2], [3, 4, 5])
    >>> c = allocator.fork(b)          # shares blocks 1 and 2
    >>> allocator.ref_count(2)
    2
    >>> allocator.append(c, 1)         # block 2 is shared and partly full: copy it before writing
    [BlockCopy(src=2, dst=3)]
    >>> c.block_ids, allocator.ref_count(2)
    ([1, 3], 1)
    >>> for table in (a, b, c):
    ...     allocator.free(table)
    >>> allocator.num_free
    100
    >>> allocator.check_invariants()

    ```
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = _check_positive_int("num_blocks", num_blocks)
        self.block_size = _check_positive_int("block_size", block_size)
        self.lock = threading.RLock()
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts: list[int] = [0] * num_blocks
        self._fill: list[int] = [0] * num_blocks  # slots written since the block was taken from the free queue
        self._tables: dict[int, BlockTable] = {}
        self._table_ids = itertools.count()
        self._peak_used = 0
        self._cow_copies = 0
        self.copy_on_write = True  # test-only switch: False writes into shared blocks (to prove tests catch it)

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def free_block_ids(self) -> list[int]:
        """Free block ids in the order they will be handed out."""
        with self.lock:
            return list(self._free)

    def ref_count(self, block_id: int) -> int:
        self._check_block_id(block_id)
        return self._ref_counts[block_id]

    def num_blocks_needed(self, table: BlockTable, num_new_tokens: int) -> int:
        """Blocks that `append(table, num_new_tokens)` would take from the free queue (copy-on-write included)."""
        return self.num_blocks_needed_for([(table, num_new_tokens)])

    def num_blocks_needed_for(self, requests: list[tuple[BlockTable, int]]) -> int:
        """Blocks that appending each `(table, num_new_tokens)` in turn would take.

        A partly filled block shared by R tables and written by k of them is copied min(k, R - 1) times: the last
        holder writes in place.
        """
        with self.lock:
            total = 0
            writers: dict[int, int] = {}
            for table, num_new_tokens in requests:
                self._check_live(table)
                if num_new_tokens < 0:
                    raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
                if num_new_tokens == 0:
                    continue
                room = len(table.block_ids) * self.block_size - table.num_tokens
                if room > 0 and self.copy_on_write:
                    writers[table.block_ids[-1]] = writers.get(table.block_ids[-1], 0) + 1
                total += _num_blocks_for(max(0, num_new_tokens - room), self.block_size)
            return total + sum(min(k, self._ref_counts[b] - 1) for b, k in writers.items())

    def can_append(self, table: BlockTable, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(table, num_new_tokens) <= len(self._free)

    # ------------------------------------------------------------------ table lifecycle
    def new_table(self) -> BlockTable:
        """An empty table (no blocks) registered with this allocator."""
        with self.lock:
            table = BlockTable(table_id=next(self._table_ids))
            self._tables[table.table_id] = table
            return table

    def append(self, table: BlockTable, num_new_tokens: int) -> list[BlockCopy]:
        """Record `num_new_tokens` more tokens in `table`.

        A new block is taken only when the last one is full. If the last block is partly full and shared with
        another table, it is first replaced by a private copy (copy-on-write), so that writes only ever touch blocks
        with refcount 1.

        Returns:
            `list[BlockCopy]`: the block copies the KV storage must perform before writing (at most one).

        Raises:
            PoolExhaustedError: not enough free blocks; nothing was changed.
        """
        return self.append_all([(table, num_new_tokens)])

    def append_all(self, requests: list[tuple[BlockTable, int]], what: str | None = None) -> list[BlockCopy]:
        """`append` for several `(table, num_new_tokens)` at once: all of them, or (`PoolExhaustedError`) none.

        `what` names the request in the error message.
        """
        with self.lock:
            needed = self.num_blocks_needed_for(requests)
            if needed > len(self._free):
                what = what or f"appending {sum(count for _, count in requests)} token(s)"
                raise PoolExhaustedError(needed, len(self._free), what=what)
            copies = []
            for table, num_new_tokens in requests:
                if num_new_tokens:
                    self._append_checked(table, num_new_tokens, copies)
            self._peak_used = max(self._peak_used, self.num_used)
            return copies

    def _append_checked(self, table: BlockTable, num_new_tokens: int, copies: list[BlockCopy]) -> None:
        room = len(table.block_ids) * self.block_size - table.num_tokens
        if room > 0 and self.copy_on_write and self._ref_counts[table.block_ids[-1]] > 1:
            src = table.block_ids[-1]
            dst = self._take_free_block()
            self._ref_counts[src] -= 1
            table.block_ids[-1] = dst
            copies.append(BlockCopy(src, dst))
            self._cow_copies += 1
        first_written = table.num_tokens // self.block_size
        total = table.num_tokens + num_new_tokens
        while len(table.block_ids) < _num_blocks_for(total, self.block_size):
            table.block_ids.append(self._take_free_block())
        for index in range(first_written, len(table.block_ids)):
            block_id = table.block_ids[index]
            if self._ref_counts[block_id] != 1 and self.copy_on_write:
                raise InvariantError(
                    f"invariant 5: about to write into block {block_id} with refcount {self._ref_counts[block_id]}"
                )
            self._fill[block_id] = min(self.block_size, total - index * self.block_size)
        table.num_tokens = total

    def fork(self, table: BlockTable) -> BlockTable:
        """A new table sharing every block of `table` (each refcount + 1); nothing is copied."""
        with self.lock:
            self._check_live(table)
            child = self.new_table()
            child.block_ids = list(table.block_ids)
            child.num_tokens = table.num_tokens
            for block_id in child.block_ids:
                self._ref_counts[block_id] += 1
            return child

    def crop(self, table: BlockTable, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens of `table`; blocks no longer needed are released."""
        with self.lock:
            self._check_live(table)
            if not 0 <= num_tokens <= table.num_tokens:
                raise ValueError(f"cannot crop a table of {table.num_tokens} tokens to {num_tokens} tokens")
            keep = _num_blocks_for(num_tokens, self.block_size)
            dropped = table.block_ids[keep:]
            del table.block_ids[keep:]
            table.num_tokens = num_tokens
            self._release_blocks(dropped)

    def free(self, table: BlockTable) -> None:
        """Release every block of `table` (blocks whose refcount reaches 0 join the back of the free queue)."""
        with self.lock:
            self._check_live(table)
            self._release_blocks(table.block_ids)
            table.block_ids = []
            table.num_tokens = 0
            table.is_freed = True
            del self._tables[table.table_id]

    def reset_peak(self) -> None:
        """Start a new peak-usage window at the current usage."""
        with self.lock:
            self._peak_used = self.num_used

    # ------------------------------------------------------------------ accounting
    def stats(self) -> AllocatorStats:
        with self.lock:
            tokens_in_block: dict[int, int] = {}
            for table in self._tables.values():
                for index, block_id in enumerate(table.block_ids):
                    held = min(self.block_size, table.num_tokens - index * self.block_size)
                    tokens_in_block[block_id] = max(tokens_in_block.get(block_id, 0), held)
            tokens = sum(tokens_in_block.values())
            slots = self.num_used * self.block_size
            return AllocatorStats(
                num_blocks=self.num_blocks,
                block_size=self.block_size,
                num_free=self.num_free,
                num_used=self.num_used,
                peak_used=self._peak_used,
                tokens_stored=tokens,
                slots_allocated=slots,
                waste_fraction=(slots - tokens) / slots if slots else 0.0,
                cow_copies=self._cow_copies,
                num_tables=len(self._tables),
            )

    def check_invariants(self) -> None:
        """Raise `InvariantError` unless the allocator's invariants hold.

        1. every block is either free (refcount 0) or used (refcount > 0), never both;
        2. a block's refcount equals the number of live block-table entries naming it;
        3. the free queue has no duplicates, and free + used = total;
        4. (prefix hashes: no prefix index is kept by this allocator, so there is nothing to check);
        5. writes go only to blocks with refcount 1 (`append` copies a shared block first and checks this before
           every write), so no table claims a slot that was never written: its tokens in a block <= the block's fill;
        6. a table of n tokens has ceil(n / block_size) blocks;
        7. with no live tables, every block is free.
        """
        with self.lock:
            free = list(self._free)
            free_set = set(free)
            if len(free_set) != len(free):
                raise InvariantError(f"invariant 3: free queue has duplicates: {sorted(free)}")
            expected = [0] * self.num_blocks
            for table in self._tables.values():
                want = _num_blocks_for(table.num_tokens, self.block_size)
                if len(table.block_ids) != want:
                    raise InvariantError(
                        f"invariant 6: {table!r} holds {len(table.block_ids)} blocks for {table.num_tokens} tokens "
                        f"(expected {want})"
                    )
                for index, block_id in enumerate(table.block_ids):
                    self._check_block_id(block_id)
                    expected[block_id] += 1
                    held = min(self.block_size, table.num_tokens - index * self.block_size)
                    if held > self._fill[block_id]:
                        raise InvariantError(
                            f"invariant 5: {table!r} claims {held} tokens in block {block_id}, "
                            f"which holds only {self._fill[block_id]} written slots"
                        )
            for block_id in range(self.num_blocks):
                ref = self._ref_counts[block_id]
                is_free = block_id in free_set
                if is_free == (ref > 0):
                    where = "in" if is_free else "not in"
                    raise InvariantError(f"invariant 1: block {block_id} has refcount {ref}, {where} the free queue")
                if ref != expected[block_id]:
                    raise InvariantError(
                        f"invariant 2: block {block_id} has refcount {ref} but {expected[block_id]} table entries"
                    )
            if len(free) + sum(1 for r in self._ref_counts if r > 0) != self.num_blocks:
                raise InvariantError("invariant 3: free + used != total")
            if not self._tables and len(free) != self.num_blocks:
                raise InvariantError(f"invariant 7: no live tables but {self.num_blocks - len(free)} blocks used")

    # ------------------------------------------------------------------ internals
    def _take_free_block(self) -> int:
        block_id = self._free.popleft()
        self._ref_counts[block_id] = 1
        self._fill[block_id] = 0
        return block_id

    def _release_blocks(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)

    def _check_block_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is out of range [0, {self.num_blocks})")

    def _check_live(self, table: BlockTable) -> None:
        if self._tables.get(table.table_id) is not table:
            state = "was already freed" if table.is_freed else "belongs to another allocator"
            raise ValueError(f"{table!r} {state}")
