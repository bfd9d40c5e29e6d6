"""Which pool blocks hold the full-precision keys of open blocks (`kv_dtype="int4-channel"`): pure Python, kept by
the `BlockAllocator` beside its refcounts.

A format that quantizes a block's keys only once the block is full (`hf_paged.channel_keys`) keeps the keys of a
block still being filled in *companion* blocks, `per_open_block` of them, taken from the allocator's free queue like
any block: the pool's budget pays for them, and they return to the free queue when the block fills or is freed.

- An *open* block (a block some table holds fewer than `block_size` tokens of) owns its companions.
- When a table's append fills the block, its companions move to that table's *sealing* list: the forward that
  writes the last tokens still reads the earlier ones from them, so they are given back at the table's next call
  into the allocator (append, truncate, free), once that forward has run.
- A full block that `truncate` makes partial again takes companions (its keys are read back into them, see
  `reopened`).
- `changed` collects the blocks whose companions changed, for the storage's device-side tables.
"""

from __future__ import annotations

from .errors import InvariantError


class Staging:
    """Companion blocks of open blocks, and of blocks being sealed.

    Args:
        per_open_block (`int`): companions an open block takes (0: the format stages nothing).
    """

    def __init__(self, per_open_block: int = 0):
        self.per_open_block = per_open_block
        self.open: dict[int, tuple[int, ...]] = {}  # open block -> its companions
        self.sealing: dict[int, tuple[int, tuple[int, ...]]] = {}  # filled block -> (table id, its companions)
        self.changed: set[int] = set()  # blocks whose companions changed (for the storage)
        self.reopened: list[int] = []  # full blocks made partial again: keys to read back into their companions

    @property
    def enabled(self) -> bool:
        return self.per_open_block > 0

    def companions_of(self, block_id: int) -> tuple[int, ...] | None:
        """The companions holding `block_id`'s keys while it is open, else `None`."""
        return self.open.get(block_id)

    def sealing_companions_of(self, block_id: int) -> tuple[int, ...] | None:
        """The companions holding the keys written before the forward that fills `block_id`, else `None`."""
        entry = self.sealing.get(block_id)
        return None if entry is None else entry[1]

    def open_block(self, block_id: int, companions: tuple[int, ...]) -> None:
        self.open[block_id] = companions
        self.changed.add(block_id)

    def seal(self, block_id: int, table_id: int) -> None:
        """`table_id` filled `block_id`: its companions wait for that table's next call."""
        companions = self.open.pop(block_id, None)
        if companions is not None:
            self.sealing[block_id] = (table_id, companions)
            self.changed.add(block_id)

    def sealing_companions(self, table_ids) -> list[int]:
        """The companions the last appends of tables `table_ids` (a container of table ids) left to give back."""
        return [c for owner, companions in self.sealing.values() if owner in table_ids for c in companions]

    def sealed_by(self, table_id: int) -> list[int]:
        """Forget the blocks `table_id` filled; returns their companions (to give back)."""
        blocks = [block for block, (owner, _) in self.sealing.items() if owner == table_id]
        return self._drop_sealing(blocks)

    def _drop_sealing(self, blocks: list[int]) -> list[int]:
        released = []
        for block in blocks:
            released.extend(self.sealing.pop(block)[1])
            self.changed.add(block)
        return released

    def block_released(self, block_id: int) -> list[int]:
        """`block_id` joined the free queue (or the evictable list): the companions it owned, to give back."""
        released = list(self.open.pop(block_id, ()))
        if block_id in self.sealing:
            released += self._drop_sealing([block_id])
        elif released:
            self.changed.add(block_id)
        return released

    def owned(self) -> dict[int, int]:
        """Every companion block -> the block owning it."""
        return {c: block for block, cs in self.open.items() for c in cs} | {
            c: block for block, (_, cs) in self.sealing.items() for c in cs
        }

    def check(self, ref_counts: list[int], partial_last_blocks: set[int], live_tables: set[int]) -> None:
        """Raise `InvariantError` unless: every open block of a table (its partial last block) has its
        `per_open_block` companions, every companion has refcount 1 and one owner with refcount >= 1, and sealing
        lists belong to live tables."""
        if not self.enabled:
            if self.open or self.sealing:
                raise InvariantError("staging: companions without a staged format")
            return
        missing = [block for block in partial_last_blocks if len(self.open.get(block, ())) != self.per_open_block]
        if missing:
            raise InvariantError(f"staging: open blocks {sorted(missing)[:5]} lack their companions")
        seen: set[int] = set()
        for block, companions in [*self.open.items(), *((b, cs) for b, (_, cs) in self.sealing.items())]:
            if ref_counts[block] < 1:
                raise InvariantError(f"staging: free block {block} owns companions {companions}")
            for companion in companions:
                if companion in seen or ref_counts[companion] != 1:
                    raise InvariantError(f"staging: companion {companion} is shared or not held once")
                seen.add(companion)
        dead = {owner for owner, _ in self.sealing.values()} - live_tables
        if dead:
            raise InvariantError(f"staging: freed tables {sorted(dead)} still hold sealing companions")
