"""`Row`: one sequence of a `PagedCache` — its block tables, its left padding, and what the prefix cache needs."""

from __future__ import annotations

from dataclasses import dataclass, field

from .allocator import BlockAllocator, BlockTable
from .groups import skipped_tokens
from .prefix import block_hash, chain


@dataclass(eq=False)
class Row:
    """One sequence of a `PagedCache`: a block table per layer group (one, unless the model mixes full and
    sliding-window layers; see `KVLayout`), all holding the same tokens.

    Attributes:
        tables (`list[BlockTable]`): the row's blocks, one table per layer group; each holds the row's tokens from
            its first real one.
        leading_pads (`int`): left-pad positions before the first real token (never stored).
        tokens (`list[int] | None`): the token ids in the tables, for content hashing; `None` when unknown (the
            forward got `inputs_embeds`) or when prefix caching is off.
        hashes (`list[list[bytes]]`): per group, chained hashes of the first full blocks, already in the prefix
            index.
        roots (`list[bytes] | None`): per group, the chain roots the row was looked up under (`from_prefix_cache`),
            which its blocks are indexed under too: a LoRA adapter's requests chain from roots of their own. `None`:
            the roots the indexing call gives.

    Example:

    ```python
    >>> from hf_paged import BlockAllocator
    >>> allocator = BlockAllocator(num_blocks=8, block_size=4)
    >>> row = Row.empty(allocator, num_groups=2)
    >>> _ = allocator.append_all(row.appends(6))
    >>> [table.block_ids for table in row.tables], row.num_tokens
    ([[0, 1], [2, 3]], 6)
    >>> row.free_skipped(allocator, [None, 2]), [table.block_ids for table in row.tables]
    (1, [[0, 1], [None, 3]])
    >>> row.free(allocator)

    ```
    """

    tables: list[BlockTable]
    leading_pads: int = 0
    tokens: list[int] | None = field(default_factory=list)
    hashes: list[list[bytes]] = field(default_factory=list)
    roots: list[bytes] | None = None

    def __post_init__(self):
        if not self.hashes:
            self.hashes = [[] for _ in self.tables]

    @classmethod
    def empty(cls, allocator: BlockAllocator, num_groups: int = 1, track_tokens: bool = True) -> Row:
        """A row with no token yet (`track_tokens=False`: its token ids are not kept, prefix caching is off)."""
        return cls([allocator.new_table() for _ in range(num_groups)], tokens=[] if track_tokens else None)

    @classmethod
    def from_prefix_cache(
        cls,
        allocator: BlockAllocator,
        roots: list[bytes],
        windows: list[int | None],
        tokens: list[int],
        count_reuse: bool = True,
        links: list[list[tuple[bytes, tuple[int, ...]]]] | None = None,
    ) -> Row:
        """A new row holding the longest cached, block-aligned prefix of `tokens` that leaves at least one token to
        compute (possibly none of it). `roots` and `windows` give every layer group's chain root and sliding window:
        a full-attention group needs every block of the prefix, a sliding group only the blocks its window does not
        skip (it starts without the others). The lookup counts as one query reusing the row's tokens in the
        allocator's stats, unless `count_reuse=False` (the caller counts what it keeps). `links`: every group's
        `prefix_links(roots, tokens, block_size)`, where the caller has them already."""
        size = allocator.block_size
        usable = (len(tokens) - 1) // size * size
        if links is None:
            links = prefix_links(roots, tokens, size)
        with allocator.lock:  # no eviction between the lookup and the sharing
            found = [allocator.lookup_blocks(group_links) for group_links in links]
            num_blocks = usable // size
            for group_found, window in zip(found, windows):
                if window is None:
                    num_blocks = min(num_blocks, (group_found + [None]).index(None))
            while num_blocks and any(
                None in group_found[skipped_tokens(num_blocks * size, window) // size : num_blocks]
                for group_found, window in zip(found, windows)
                if window is not None
            ):
                num_blocks -= 1
            if count_reuse:
                allocator.record_prefix_reuse(num_blocks * size)
            row = cls.empty(allocator, len(roots))
            row.roots = list(roots)
            row.tokens = list(tokens[: num_blocks * size])
            for index, (table, group_found, window) in enumerate(zip(row.tables, found, windows)):
                skipped = skipped_tokens(num_blocks * size, window) // size
                allocator.share_cached(table, [None] * skipped + group_found[skipped:num_blocks])
                row.hashes[index] = [h for h, _ in links[index][:num_blocks]]
            return row

    @property
    def table(self) -> BlockTable:
        """The first group's table (the only one unless the model is a hybrid)."""
        return self.tables[0]

    @property
    def num_tokens(self) -> int:
        return self.tables[0].num_tokens

    @property
    def live_block_ids(self) -> list[int]:
        """Every block the row holds, group after group."""
        return [block_id for table in self.tables for block_id in table.live_block_ids]

    def appends(self, num_new_tokens: int) -> list[tuple[BlockTable, int]]:
        """`(table, num_new_tokens)` of every group, for `BlockAllocator.append_all` / `num_blocks_needed_for`."""
        return [(table, num_new_tokens) for table in self.tables]

    def fork(self, allocator: BlockAllocator) -> Row:
        """A row sharing every block of this one."""
        tokens = None if self.tokens is None else list(self.tokens)
        tables = [allocator.fork(table) for table in self.tables]
        return Row(tables, self.leading_pads, tokens, [list(hashes) for hashes in self.hashes], self.roots)

    def free(self, allocator: BlockAllocator) -> None:
        """Return every block (a second call does nothing)."""
        for table in self.tables:
            if not table.is_freed:
                allocator.free(table)

    def record(self, new_tokens: list[int] | None) -> None:
        """Remember the ids of tokens just appended to the tables (`None`: unknown from now on)."""
        if self.tokens is None:
            return
        if new_tokens is None:
            self.tokens = None
        else:
            self.tokens.extend(new_tokens)

    def truncate(self, allocator: BlockAllocator, length: int) -> None:
        """Keep the first `length` padded positions."""
        self.leading_pads = min(self.leading_pads, length)
        kept = length - self.leading_pads
        for table, hashes in zip(self.tables, self.hashes):
            allocator.truncate(table, kept)
            del hashes[kept // allocator.block_size :]
        if self.tokens is not None:
            del self.tokens[kept:]

    def free_skipped(self, allocator: BlockAllocator, windows: list[int | None]) -> int:
        """Give back, in every sliding group, the leading blocks its window (`windows[group]`) skips from the row's
        next token on; returns how many blocks were given back."""
        freed = 0
        for table, window in zip(self.tables, windows):
            if window is not None:
                freed += allocator.free_skipped(table, skipped_tokens(table.num_tokens, window))
        return freed

    def reads_skipped(self, num_tokens: int, windows: list[int | None], block_size: int) -> bool:
        """Whether keeping only the first `num_tokens` tokens would leave a group whose window reaches back into
        blocks it skipped and gave back."""
        if not num_tokens:
            return False
        return any(
            table.num_skipped * block_size > skipped_tokens(num_tokens, window)
            for table, window in zip(self.tables, windows)
        )

    def cache_full_blocks(
        self, allocator: BlockAllocator, roots: list[bytes], share: bool = True, links: list | None = None
    ) -> bool:
        """Put every full block not yet indexed into the prefix index, group by group (`roots[group]` starts each
        group's chain). A block whose content is already cached in another block is replaced by that one (storage
        shared) when `share`; without `share` (mid-forward, when the tables must not change) indexing of that group
        stops there and resumes on the next call. The row's own `roots`, when it has them, replace `roots`. Returns
        whether a table changed. `links`, when given, gets `(parent hash, hash, tokens, block id or None, newly
        indexed)` of every block the chain passed (for `hf_paged.offload`)."""
        if self.tokens is None:
            return False
        roots = self.roots or roots
        size = allocator.block_size
        changed = False
        for table, hashes, root in zip(self.tables, self.hashes, roots):
            parent = hashes[-1] if hashes else root
            for index in range(len(hashes), table.num_tokens // size):
                tokens = tuple(self.tokens[index * size : (index + 1) * size])
                previous, parent = parent, block_hash(parent, tokens)
                own = table.block_ids[index]
                if own is None:  # skipped before it was indexed: its hash still links the chain
                    hashes.append(parent)
                    if links is not None:
                        links.append((previous, parent, tokens, None, False))
                    continue
                was_cached = allocator.block_hash(own) is not None
                holder = allocator.cache_block(own, parent, tokens)
                if holder != own:
                    if not share:
                        break
                    allocator.replace_block(table, index, holder)
                    changed = True
                hashes.append(parent)
                if links is not None:
                    new = holder == own and not was_cached and allocator.block_hash(own) == parent
                    links.append((previous, parent, tokens, holder, new))
        return changed


def prefix_links(roots: list[bytes], tokens: list[int], block_size: int) -> list[list[tuple[bytes, tuple[int, ...]]]]:
    """Every layer group's `(hash, tokens)` chain over the longest block-aligned prefix of `tokens` that leaves at
    least one token to compute: what a prefix lookup of `tokens` reads."""
    usable = (len(tokens) - 1) // block_size * block_size
    return [chain(root, tokens[:usable], block_size) for root in roots]
