"""`Row`: one sequence of a `PagedCache` — its block table, its left padding, and what the prefix cache needs."""

from __future__ import annotations

from dataclasses import dataclass, field

from .allocator import BlockAllocator, BlockTable
from .prefix import block_hash, chain


@dataclass(eq=False)
class Row:
    """One sequence of a `PagedCache`.

    Attributes:
        table (`BlockTable`): the row's blocks; it holds the row's tokens from its first real one.
        leading_pads (`int`): left-pad positions before the first real token (never stored).
        tokens (`list[int] | None`): the token ids in the table, for content hashing; `None` when unknown (the
            forward got `inputs_embeds`) or when prefix caching is off.
        hashes (`list[bytes]`): chained hashes of the first `len(hashes)` full blocks, already in the prefix index.
    """

    table: BlockTable
    leading_pads: int = 0
    tokens: list[int] | None = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)

    @classmethod
    def from_prefix_cache(cls, allocator: BlockAllocator, root: bytes, tokens: list[int]) -> Row:
        """A new row holding the longest cached, block-aligned prefix of `tokens` that leaves at least one token to
        compute (possibly none of it)."""
        size = allocator.block_size
        links = chain(root, tokens[: (len(tokens) - 1) // size * size], size)
        blocks = allocator.lookup_prefix(links)
        row = cls(allocator.new_table(), 0, list(tokens[: len(blocks) * size]), [h for h, _ in links[: len(blocks)]])
        allocator.share_cached(row.table, blocks)
        return row

    def fork(self, allocator: BlockAllocator) -> Row:
        """A row sharing every block of this one."""
        tokens = None if self.tokens is None else list(self.tokens)
        return Row(allocator.fork(self.table), self.leading_pads, tokens, list(self.hashes))

    def record(self, new_tokens: list[int] | None) -> None:
        """Remember the ids of tokens just appended to the table (`None`: unknown from now on)."""
        if self.tokens is None:
            return
        if new_tokens is None:
            self.tokens = None
        else:
            self.tokens.extend(new_tokens)

    def crop(self, allocator: BlockAllocator, length: int) -> None:
        """Keep the first `length` padded positions."""
        self.leading_pads = min(self.leading_pads, length)
        kept = length - self.leading_pads
        allocator.crop(self.table, kept)
        if self.tokens is not None:
            del self.tokens[kept:]
        del self.hashes[kept // allocator.block_size :]

    def cache_full_blocks(self, allocator: BlockAllocator, root: bytes, share: bool = True) -> bool:
        """Put every full block not yet indexed into the prefix index. A block whose content is already cached in
        another block is replaced by that one (storage shared) when `share`; without `share` (mid-forward, when the
        table must not change) indexing stops there and resumes on the next call. Returns whether the table
        changed."""
        if self.tokens is None:
            return False
        size = allocator.block_size
        changed = False
        parent = self.hashes[-1] if self.hashes else root
        for index in range(len(self.hashes), self.table.num_tokens // size):
            tokens = tuple(self.tokens[index * size : (index + 1) * size])
            parent = block_hash(parent, tokens)
            own = self.table.block_ids[index]
            if own is None:  # released before it was indexed: its hash still links the chain
                self.hashes.append(parent)
                continue
            holder = allocator.cache_block(own, parent, tokens)
            if holder != own:
                if not share:
                    break
                allocator.replace_block(self.table, index, holder)
                changed = True
            self.hashes.append(parent)
        return changed
