"""Block allocator: free queue, refcounts, block tables and copy-on-write decisions (pure Python, no torch)."""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from .errors import InvariantError, PoolExhaustedError
from .staging import Staging


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a positive int, got {value!r} ({type(value).__name__})")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int (>= 1), got {value}")
    return value


def _num_blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def tokens_per_block(tables, block_size: int) -> dict[int, int]:
    """Tokens each distinct block of `tables` holds (a block shared by several tables counts once, at the most any
    of them holds in it)."""
    held: dict[int, int] = {}
    for table in tables:
        for index, block_id in enumerate(table.block_ids):
            if block_id is None:
                continue
            tokens = min(block_size, table.num_tokens - index * block_size)
            held[block_id] = max(held.get(block_id, 0), tokens)
    return held


@dataclass(eq=False)
class BlockTable:
    """Logical → physical block mapping of one sequence.

    `block_ids[i]` is the physical block holding tokens `[i * block_size, (i + 1) * block_size)` of the sequence,
    or `None` once `BlockAllocator.free_skipped` gave that block back (tokens a sliding window skipped: no layer of
    the table's group attends to them again; skipped entries always form a leading run). Tables are created and
    changed only through their `BlockAllocator`.

    Attributes:
        block_ids (`list[int | None]`): physical block ids, in logical order (`None`: skipped, given back).
        num_tokens (`int`): tokens recorded in the table.
    """

    block_ids: list[int | None] = field(default_factory=list)
    num_tokens: int = 0
    table_id: int = -1
    is_freed: bool = False

    @property
    def num_skipped(self) -> int:
        """Leading blocks given back by `BlockAllocator.free_skipped` (their entries are `None`)."""
        count = 0
        for block_id in self.block_ids:
            if block_id is not None:
                break
            count += 1
        return count

    @property
    def live_block_ids(self) -> list[int]:
        """The blocks the table still holds, in logical order."""
        return [block_id for block_id in self.block_ids if block_id is not None]

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
    `waste_fraction = (slots_allocated - tokens_stored) / slots_allocated` (0 when nothing is allocated). Prefix
    cache: `num_cached` full blocks are indexed by content hash (in use or not), `num_evictable` of them are held by
    no table (they count as free), `prefix_queries` lookups let their callers reuse `prefix_tokens_reused` tokens, and
    `evictions` cached blocks were reused for other content.
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
    num_cached: int = 0
    num_evictable: int = 0
    prefix_queries: int = 0
    prefix_tokens_reused: int = 0
    evictions: int = 0


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
        companions (`int`, *optional*): blocks every open block (one being filled) also takes to hold its keys in
            full precision, for a format that quantizes keys once a block is full (`kv_dtype="int4-channel"`, see
            `hf_paged.staging`); 0 (the default) for every other format.

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

    def __init__(self, num_blocks: int, block_size: int, companions: int = 0):
        self.num_blocks = _check_positive_int("num_blocks", num_blocks)
        self.block_size = _check_positive_int("block_size", block_size)
        self.staging = Staging(companions)
        self.lock = threading.RLock()
        self.sized_by: str | None = None  # what set num_blocks, named in PoolExhaustedError (set by a BlockPool)
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts: list[int] = [0] * num_blocks
        self._fill: list[int] = [0] * num_blocks  # slots written since the block was taken from the free queue
        self._tables: dict[int, BlockTable] = {}
        self._table_ids = itertools.count()
        self._peak_used = 0
        self._cow_copies = 0
        # prefix cache: content hash <-> full block, and blocks no table holds that keep their content (LRU first)
        self._hash_to_block: dict[bytes, int] = {}
        self._block_hash: dict[int, bytes] = {}
        self._block_tokens: dict[int, tuple[int, ...]] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._prefix_queries = 0
        self._prefix_tokens_reused = 0
        self._evictions = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out: plain free ones, then cached ones no table holds (evicted LRU first)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def free_block_ids(self) -> list[int]:
        """Free block ids in the order they will be handed out (plain free blocks, then evictable cached ones)."""
        with self.lock:
            return list(self._free) + list(self._evictable)

    @property
    def evictable_block_ids(self) -> list[int]:
        """Cached blocks no table holds, least recently used first (the next to be evicted)."""
        with self.lock:
            return list(self._evictable)

    def ref_count(self, block_id: int) -> int:
        self._check_block_id(block_id)
        return self._ref_counts[block_id]

    def num_blocks_needed(self, table: BlockTable, num_new_tokens: int) -> int:
        """Blocks that `append(table, num_new_tokens)` would take from the free queue (copy-on-write included)."""
        return self.num_blocks_needed_for([(table, num_new_tokens)])

    def num_blocks_needed_for(self, requests: list[tuple[BlockTable, int]]) -> int:
        """Blocks that appending each `(table, num_new_tokens)` in turn would take.

        A partly filled block shared by R tables and written by k of them is copied min(k, R - 1) times: the last
        holder writes in place. With `companions`, net of the companions the tables' last appends left to give back
        (so it can be negative).
        """
        with self.lock:
            total = 0
            writers: dict[int, int] = {}
            companions = self.staging.per_open_block
            released = set()
            for table, num_new_tokens in requests:
                self._check_live(table)
                if num_new_tokens < 0:
                    raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
                if num_new_tokens == 0:
                    continue
                released.add(table.table_id)
                room = len(table.block_ids) * self.block_size - table.num_tokens
                copied = room > 0 and self._needs_copy_on_write(table.block_ids[-1])
                if copied:
                    writers[table.block_ids[-1]] = writers.get(table.block_ids[-1], 0) + 1
                new_blocks = _num_blocks_for(max(0, num_new_tokens - room), self.block_size)
                total += new_blocks
                if companions and new_blocks and (table.num_tokens + num_new_tokens) % self.block_size:
                    total += companions  # a new block left open at the end
            # every copy is open when made (it takes companions too)
            total += (1 + companions) * sum(min(k, self._ref_counts[b] - 1) for b, k in writers.items())
            if companions:  # the companions of blocks the tables filled last time are given back first
                total -= len(self.staging.sealing_companions(released))
            return total  # negative when more companions come back than the appends take

    def _needs_copy_on_write(self, block_id: int) -> bool:
        """Whether a table writing into `block_id` must first replace it by a private copy: the block is shared."""
        return self._ref_counts[block_id] > 1

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

    def append_all(
        self, requests: list[tuple[BlockTable, int]], what: str | None = None, keep_free: int = 0
    ) -> list[BlockCopy]:
        """`append` for several `(table, num_new_tokens)` at once: all of them, or (`PoolExhaustedError`) none.

        `what` names the request in the error message; `keep_free` blocks must stay free afterwards (a reserve the
        caller holds for other tables' next tokens).
        """
        with self.lock:
            needed = self.num_blocks_needed_for(requests)  # net of the companions given back first
            if needed + keep_free > self.num_free:
                what = what or f"appending {sum(count for _, count in requests)} token(s)"
                if keep_free:
                    what += f" while keeping {keep_free} block(s) free"
                raise PoolExhaustedError(
                    needed + keep_free, self.num_free, what=what, num_blocks=self.num_blocks, sized_by=self.sized_by
                )
            for table, num_new_tokens in requests:
                if num_new_tokens:
                    self._release_sealed(table)
            copies = []
            for table, num_new_tokens in requests:
                if num_new_tokens:
                    self._append_checked(table, num_new_tokens, copies)
            self._peak_used = max(self._peak_used, self.num_used)
            return copies

    def _append_checked(self, table: BlockTable, num_new_tokens: int, copies: list[BlockCopy]) -> None:
        room = len(table.block_ids) * self.block_size - table.num_tokens
        if room > 0 and self._needs_copy_on_write(table.block_ids[-1]):
            src = table.block_ids[-1]
            dst = self._take_free_block()
            self._ref_counts[src] -= 1
            table.block_ids[-1] = dst
            copies.append(BlockCopy(src, dst))
            self._cow_copies += 1
            if self.staging.enabled:  # the copy is open too: its own companions, holding the same keys
                own = self._open(dst)
                copies.extend(BlockCopy(s, d) for s, d in zip(self.staging.companions_of(src), own))
        elif room > 0 and table.block_ids[-1] in self._block_hash:  # a truncated cached block is written again
            self._unhash(table.block_ids[-1])
        first_written = table.num_tokens // self.block_size
        total = table.num_tokens + num_new_tokens
        while len(table.block_ids) < _num_blocks_for(total, self.block_size):
            table.block_ids.append(self._take_free_block())
        for index in range(first_written, len(table.block_ids)):
            block_id = table.block_ids[index]
            if self._needs_copy_on_write(block_id):
                raise InvariantError(
                    f"invariant 5: about to write into block {block_id} with refcount {self._ref_counts[block_id]}"
                )
            self._fill[block_id] = min(self.block_size, total - index * self.block_size)
            if self.staging.enabled:
                if self._fill[block_id] == self.block_size:
                    self.staging.seal(block_id, table.table_id)
                elif self.staging.companions_of(block_id) is None:
                    self._open(block_id)
        table.num_tokens = total

    def fork(self, table: BlockTable) -> BlockTable:
        """A new table sharing every block of `table` (each refcount + 1); nothing is copied."""
        with self.lock:
            self._check_live(table)
            child = self.new_table()
            child.block_ids = list(table.block_ids)
            child.num_tokens = table.num_tokens
            for block_id in child.live_block_ids:
                self._ref_counts[block_id] += 1
            return child

    def truncate(self, table: BlockTable, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens of `table`; blocks no longer needed are released.

        Raises:
            ValueError: `num_tokens` is out of range, or would end the table inside a skipped block.
        """
        with self.lock:
            self._check_live(table)
            if not 0 <= num_tokens <= table.num_tokens:
                raise ValueError(f"cannot truncate a table of {table.num_tokens} tokens to {num_tokens} tokens")
            keep = _num_blocks_for(num_tokens, self.block_size)
            if keep and table.block_ids[keep - 1] is None:
                raise ValueError(
                    f"cannot truncate {table!r} to {num_tokens} tokens: its first "
                    f"{table.num_skipped * self.block_size} tokens were skipped and given back (free_skipped), so it "
                    f"cannot end before token {table.num_skipped * self.block_size + 1}"
                )
            last = table.block_ids[keep - 1] if keep else None
            reopens = self.staging.enabled and num_tokens % self.block_size and last is not None
            reopens = reopens and self.staging.companions_of(last) is None
            dropped = [block_id for block_id in table.block_ids[keep:] if block_id is not None]
            if reopens:
                freed = [b for b in dropped if self._ref_counts[b] == 1]
                freed += [c for b in freed for c in self.staging.companions_of(b) or ()]
                freed += self.staging.sealing_companions((table.table_id,))
                if self.num_free + len(freed) < self.staging.per_open_block:
                    raise PoolExhaustedError(
                        self.staging.per_open_block,
                        self.num_free + len(freed),
                        f"truncating {table!r} to {num_tokens} tokens (its last block is open again, and its keys "
                        "are kept in full precision)",
                        self.num_blocks,
                        self.sized_by,
                    )
            self._release_sealed(table)
            del table.block_ids[keep:]
            table.num_tokens = num_tokens
            self._release_blocks(dropped)
            if reopens:
                self._open(last)
                self.staging.reopened.append(last)

    def free_skipped(self, table: BlockTable, num_skipped_tokens: int) -> int:
        """Give back the blocks holding only the first `num_skipped_tokens` tokens of `table` (tokens its sliding
        window skipped, never read again; see `groups.skipped_tokens`): each block `b` with
        `(b + 1) * block_size <= num_skipped_tokens` loses this table's reference and its entry becomes `None`.

        The table keeps counting those tokens (`num_tokens` and positions do not change). A block that no other
        table holds joins the free queue, or, when it is in the prefix index, the evictable list. Entries already
        given back are left as they are.

        Returns:
            `int`: blocks given back by this call.

        Example:

        ```python
        >>> from hf_paged import BlockAllocator
        >>> allocator = BlockAllocator(num_blocks=8, block_size=4)
        >>> table = allocator.new_table()
        >>> _ = allocator.append(table, 10)
        >>> allocator.free_skipped(table, 9), table.block_ids, allocator.free_block_ids
        (2, [None, None, 2], [3, 4, 5, 6, 7, 0, 1])
        >>> allocator.free(table)

        ```
        """
        with self.lock:
            self._check_live(table)
            if isinstance(num_skipped_tokens, bool) or not isinstance(num_skipped_tokens, int):
                raise TypeError(f"num_skipped_tokens must be an int, got {num_skipped_tokens!r}")
            if not 0 <= num_skipped_tokens <= table.num_tokens:
                raise ValueError(
                    f"num_skipped_tokens must be in [0, {table.num_tokens}] (the table's tokens), "
                    f"got {num_skipped_tokens}"
                )
            skipped = []
            self._release_sealed(table)
            for index in range(table.num_skipped, num_skipped_tokens // self.block_size):
                skipped.append(table.block_ids[index])
                table.block_ids[index] = None
            self._release_blocks(skipped)
            return len(skipped)

    def free(self, table: BlockTable) -> None:
        """Release every block of `table` (blocks whose refcount reaches 0 join the back of the free queue)."""
        with self.lock:
            self._check_live(table)
            self._release_sealed(table)
            self._release_blocks(table.live_block_ids)
            table.block_ids = []
            table.num_tokens = 0
            table.is_freed = True
            del self._tables[table.table_id]

    def reset_peak(self) -> None:
        """Start a new peak-usage window at the current usage."""
        with self.lock:
            self._peak_used = self.num_used

    # ------------------------------------------------------------------ prefix cache
    def cache_block(self, block_id: int, block_hash: bytes, tokens: tuple[int, ...]) -> int:
        """Index the full, written block `block_id` under `block_hash` (its tokens are kept to verify hits).

        Returns the block that holds this content: `block_id`, or an already cached block with the same hash and
        the same tokens (the caller may share that one instead). A hash already naming other tokens (a collision)
        leaves `block_id` uncached.
        """
        with self.lock:
            self._check_block_id(block_id)
            if self._ref_counts[block_id] < 1 or self._fill[block_id] != self.block_size:
                raise ValueError(f"only a full, used block can be cached; block {block_id} is not")
            if len(tokens) != self.block_size:
                raise ValueError(f"a cached block holds {self.block_size} tokens, got {len(tokens)}")
            existing = self._hash_to_block.get(block_hash)
            if existing is not None:
                return existing if self._block_tokens[existing] == tuple(tokens) else block_id
            if block_id in self._block_hash:  # already cached under another hash (other prefix, same block)
                return block_id
            self._hash_to_block[block_hash] = block_id
            self._block_hash[block_id] = block_hash
            self._block_tokens[block_id] = tuple(tokens)
            return block_id

    def lookup_prefix(self, chain: list[tuple[bytes, tuple[int, ...]]]) -> list[int]:
        """The cached blocks holding the longest prefix of `chain` (`(block hash, block tokens)` per full block),
        verified token by token; one query in `stats()`, whose caller is taken to reuse every block found."""
        with self.lock:
            found = []
            for block_hash, tokens in chain:
                block_id = self._cached_block(block_hash, tokens)
                if block_id is None:
                    break
                found.append(block_id)
            self.record_prefix_reuse(len(found) * self.block_size)
            return found

    def lookup_blocks(self, chain: list[tuple[bytes, tuple[int, ...]]]) -> list[int | None]:
        """The cached block of every link of `chain`, each looked up on its own and verified token by token
        (`None` where not cached); not counted in `stats()` (see `record_prefix_reuse`)."""
        with self.lock:
            return [self._cached_block(block_hash, tokens) for block_hash, tokens in chain]

    def _cached_block(self, block_hash: bytes, tokens: tuple[int, ...]) -> int | None:
        block_id = self._hash_to_block.get(block_hash)
        return None if block_id is None or self._block_tokens[block_id] != tuple(tokens) else block_id

    def record_prefix_reuse(self, num_tokens: int) -> None:
        """Count one prefix-cache query whose caller reused `num_tokens` cached tokens (0: a miss)."""
        with self.lock:
            self._prefix_queries += 1
            self._prefix_tokens_reused += num_tokens

    def share_cached(self, table: BlockTable, block_ids: list[int | None]) -> None:
        """Append cached full blocks to `table` (which must end on a block boundary), taking a reference to each.

        A leading run of `None` entries (in a table that holds no block yet) records blocks the table starts
        without: tokens its sliding window skipped, counted but never read (as after `free_skipped`).
        """
        with self.lock:
            self._check_live(table)
            if table.num_tokens % self.block_size:
                raise ValueError(f"{table!r} does not end on a block boundary")
            holds_blocks = bool(table.live_block_ids)
            for block_id in block_ids:
                if block_id is None and holds_blocks:
                    raise ValueError(f"only a leading run of blocks can be skipped, got {block_ids} for {table!r}")
                if block_id is not None and block_id not in self._block_hash:
                    raise ValueError(f"block {block_id} is not a cached block")
                holds_blocks |= block_id is not None
            for block_id in block_ids:
                if block_id is not None:
                    self._acquire_cached(block_id)
                table.block_ids.append(block_id)
                table.num_tokens += self.block_size
            self._peak_used = max(self._peak_used, self.num_used)

    def replace_block(self, table: BlockTable, index: int, block_id: int) -> None:
        """Let `table` use the cached block `block_id` (same content) instead of its full block at `index`."""
        with self.lock:
            self._check_live(table)
            old = table.block_ids[index]
            if old == block_id:
                return
            if old is None:
                raise ValueError(f"block {index} of {table!r} was skipped (given back) and cannot be replaced")
            if block_id not in self._block_hash or self._fill[old] != self.block_size:
                raise ValueError(f"block {old} can only be replaced by a cached block holding the same full content")
            self._acquire_cached(block_id)
            table.block_ids[index] = block_id
            self._release_blocks([old])

    def adopt_cached(self, block_hash: bytes, tokens: tuple[int, ...]) -> int:
        """Take a block for content loaded from outside the pool (a tier of `hf_paged.offload`), indexed under
        `block_hash` as a full, unreferenced cached block: evictable, most recently used. The caller writes its K/V
        before releasing the lock. Raises `PoolExhaustedError` when no block is free or evictable, and `ValueError`
        when `block_hash` is cached already."""
        with self.lock:
            if block_hash in self._hash_to_block:
                raise ValueError("this content is cached already")
            if len(tokens) != self.block_size:
                raise ValueError(f"a cached block holds {self.block_size} tokens, got {len(tokens)}")
            if not self._free and not self._evictable:
                raise PoolExhaustedError(1, 0, "a block loaded from a KV tier", self.num_blocks, self.sized_by)
            block_id = self._take_free_block()
            self._fill[block_id] = self.block_size
            self._ref_counts[block_id] = 0
            self._hash_to_block[block_hash] = block_id
            self._block_hash[block_id] = block_hash
            self._block_tokens[block_id] = tuple(tokens)
            self._evictable[block_id] = None
            return block_id

    def forget_cached(self, block_ids: list[int]) -> None:
        """Give back blocks `adopt_cached` took whose K/V could not be written: unindexed and free again."""
        with self.lock:
            for block_id in block_ids:  # all checked before any changes
                if self._ref_counts[block_id] != 0 or block_id not in self._block_hash:
                    raise ValueError(f"block {block_id} is not unreferenced cached content")
            for block_id in block_ids:
                self._unhash(block_id)
                del self._evictable[block_id]
                self._free.append(block_id)

    def pin_cached(self, block_ids: list[int]) -> None:
        """Take a reference to cached blocks (so that nothing evicts them) until `unpin_cached`."""
        with self.lock:
            for block_id in block_ids:
                self._acquire_cached(block_id)

    def unpin_cached(self, block_ids: list[int]) -> None:
        with self.lock:
            self._release_blocks(list(block_ids))

    def block_hash(self, block_id: int) -> bytes | None:
        return self._block_hash.get(block_id)

    def clear_prefix_cache(self) -> None:
        """Forget every cached content (e.g. after the model's weights changed); evictable blocks become free."""
        with self.lock:
            for block_id in list(self._block_hash):
                self._unhash(block_id)
            self._free.extend(self._evictable)
            self._evictable.clear()

    def _acquire_cached(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            del self._evictable[block_id]
        self._ref_counts[block_id] += 1

    # ------------------------------------------------------------------ accounting
    def stats(self) -> AllocatorStats:
        with self.lock:
            tokens = sum(tokens_per_block(self._tables.values(), self.block_size).values())
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
                num_cached=len(self._hash_to_block),
                num_evictable=len(self._evictable),
                prefix_queries=self._prefix_queries,
                prefix_tokens_reused=self._prefix_tokens_reused,
                evictions=self._evictions,
            )

    def check_invariants(self) -> None:
        """Raise `InvariantError` unless the allocator's invariants hold.

        1. every block is either free (refcount 0) or used (refcount > 0), never both;
        2. a block's refcount equals the number of live block-table entries naming it;
        3. the free queue has no duplicates, and free + used = total (evictable cached blocks count as free);
        4. a prefix hash maps to exactly one full block and back; plain free blocks carry no hash (a block's hash is
           cleared when the block is reused), and evictable blocks all carry one;
        5. writes go only to blocks with refcount 1 (`append` copies a shared block first and checks this before
           every write), so no table claims a slot that was never written: its tokens in a block <= the block's fill;
        6. a table of n tokens has ceil(n / block_size) entries (skipped ones, `None`, included);
        7. with no live tables, every block is free (evictable cached blocks count as free);
        8. skipped entries (`None`) form a leading run of a table's entries and hold no reference;
        9. with `companions`, every table's partial last block owns that many companion blocks, each held once (its
           refcount counts its owner), and only blocks in use own companions (see `hf_paged.staging`).
        """
        with self.lock:
            free = list(self._free) + list(self._evictable)
            free_set = set(free)
            if len(free_set) != len(free):
                raise InvariantError(f"invariant 3: free queue has duplicates: {sorted(free)}")
            self._check_prefix_index()
            expected = [0] * self.num_blocks
            for companion in self.staging.owned():
                expected[companion] += 1
            partial_last = set()
            for table in self._tables.values():
                if table.num_tokens % self.block_size and table.block_ids:
                    partial_last.add(table.block_ids[-1])
                want = _num_blocks_for(table.num_tokens, self.block_size)
                if len(table.block_ids) != want:
                    raise InvariantError(
                        f"invariant 6: {table!r} holds {len(table.block_ids)} blocks for {table.num_tokens} tokens "
                        f"(expected {want})"
                    )
                skipped = table.num_skipped
                if None in table.block_ids[skipped:]:
                    raise InvariantError(f"invariant 8: {table!r} has a skipped entry after a live one")
                for index, block_id in enumerate(table.block_ids[skipped:], start=skipped):
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
            try:
                self.staging.check(self._ref_counts, partial_last, set(self._tables))
            except InvariantError as error:
                raise InvariantError(f"invariant 9: {error}") from None

    def _check_prefix_index(self) -> None:
        if len(self._hash_to_block) != len(self._block_hash) or any(
            self._block_hash.get(b) != h for h, b in self._hash_to_block.items()
        ):
            raise InvariantError("invariant 4: the hash -> block and block -> hash maps disagree")
        for block_id in self._block_hash:
            if self._fill[block_id] != self.block_size or len(self._block_tokens[block_id]) != self.block_size:
                raise InvariantError(f"invariant 4: cached block {block_id} is not a full block")
        hashed_free = [b for b in self._free if b in self._block_hash]
        if hashed_free:
            raise InvariantError(f"invariant 4: free blocks {hashed_free[:5]} still carry a prefix hash")
        unhashed = [b for b in self._evictable if b not in self._block_hash]
        if unhashed:
            raise InvariantError(f"invariant 4: evictable blocks {unhashed[:5]} carry no prefix hash")

    # ------------------------------------------------------------------ internals
    def _take_free_block(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            self._unhash(block_id)
            self._evictions += 1
        self._ref_counts[block_id] = 1
        self._fill[block_id] = 0
        return block_id

    def _open(self, block_id: int) -> tuple[int, ...]:
        """Give the open block `block_id` its companions (checked free by the caller)."""
        companions = tuple(self._take_free_block() for _ in range(self.staging.per_open_block))
        self.staging.open_block(block_id, companions)
        return companions

    def _release_sealed(self, table: BlockTable) -> None:
        """Give back the companions of the blocks `table` filled in its last append (that forward has run)."""
        if self.staging.sealing:
            self._release_blocks(self.staging.sealed_by(table.table_id))

    def _release_blocks(self, block_ids: list[int]) -> None:
        """Blocks whose refcount reaches 0 join the back of the free queue, or, when they hold cached content, the
        evictable list, tail of the table first (so a chain is evicted from its tail before its head); the
        companions an open block owned go with it."""
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0 and block_id not in self._block_hash:
                self._free.append(block_id)
            if self._ref_counts[block_id] == 0 and self.staging.enabled:
                self._release_blocks(self.staging.block_released(block_id))
        for block_id in reversed(block_ids):
            if self._ref_counts[block_id] == 0 and block_id in self._block_hash:
                self._evictable[block_id] = None

    def _unhash(self, block_id: int) -> None:
        block_hash = self._block_hash.pop(block_id)
        del self._hash_to_block[block_hash]
        del self._block_tokens[block_id]

    def _check_block_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is out of range [0, {self.num_blocks})")

    def _check_live(self, table: BlockTable) -> None:
        if self._tables.get(table.table_id) is not table:
            state = "was already freed" if table.is_freed else "belongs to another allocator"
            raise ValueError(f"{table!r} {state}")
