"""The allocator's companion blocks (`hf_paged.staging`): exact states, and the allocator state machine replayed with
a storage that keeps every open block's tokens in its companions, as `kv_dtype="int4-channel"` keeps its keys."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule, run_state_machine_as_test

from hf_paged import BlockAllocator, InvariantError, PoolExhaustedError
from hf_paged.allocator import BlockCopy

from .test_allocator import AllocatorMachine


def test_an_open_block_takes_its_companions_and_gives_them_back_after_the_forward_that_fills_it():
    allocator = BlockAllocator(num_blocks=8, block_size=4, companions=2)
    table = allocator.new_table()
    assert allocator.num_blocks_needed(table, 3) == 3
    allocator.append(table, 3)
    assert table.block_ids == [0] and allocator.staging.open == {0: (1, 2)} and allocator.num_used == 3
    assert allocator.staging.changed == {0}
    allocator.append(table, 1)  # fills block 0: its companions wait for the table's next call
    assert allocator.staging.open == {} and allocator.staging.sealing == {0: (table.table_id, (1, 2))}
    allocator.check_invariants()
    assert allocator.num_blocks_needed(table, 5) == 2 + 2 - 2  # two blocks, one left open, companions back first
    allocator.append(table, 5)
    assert table.block_ids == [0, 3, 4] and allocator.staging.open == {4: (5, 6)} and allocator.staging.sealing == {}
    assert allocator.free_block_ids == [7, 1, 2]
    allocator.check_invariants()
    allocator.free(table)
    assert allocator.num_free == 8
    allocator.check_invariants()


def test_a_block_filled_in_one_append_takes_no_companions():
    allocator = BlockAllocator(num_blocks=4, block_size=4, companions=2)
    table = allocator.new_table()
    assert allocator.num_blocks_needed(table, 8) == 2
    allocator.append(table, 8)
    assert table.block_ids == [0, 1] and allocator.staging.open == {} and allocator.staging.sealing == {}
    allocator.check_invariants()


def test_copy_on_write_copies_the_companions_with_the_block():
    allocator = BlockAllocator(num_blocks=10, block_size=4, companions=2)
    parent = allocator.new_table()
    allocator.append(parent, 2)  # block 0, companions 1 and 2
    child = allocator.fork(parent)
    assert allocator.num_blocks_needed(child, 1) == 3  # the copy and its two companions
    copies = allocator.append(child, 1)
    assert copies == [BlockCopy(0, 3), BlockCopy(1, 4), BlockCopy(2, 5)]
    assert child.block_ids == [3] and allocator.staging.open == {0: (1, 2), 3: (4, 5)}
    allocator.check_invariants()
    for table in (parent, child):
        allocator.free(table)
    assert allocator.num_free == 10
    allocator.check_invariants()


def test_truncating_into_a_full_block_opens_it_again():
    allocator = BlockAllocator(num_blocks=6, block_size=4, companions=1)
    table = allocator.new_table()
    allocator.append(table, 8)
    allocator.truncate(table, 6)
    assert table.block_ids == [0, 1] and allocator.staging.open == {1: (2,)} and allocator.staging.reopened == [1]
    allocator.check_invariants()
    allocator.truncate(table, 4)  # the open block goes, and its companion with it
    assert allocator.staging.open == {} and allocator.num_used == 1
    allocator.check_invariants()


def test_truncate_that_cannot_take_companions_is_refused_and_changes_nothing():
    allocator = BlockAllocator(num_blocks=2, block_size=4, companions=1)
    table = allocator.new_table()
    allocator.append(table, 8)
    with pytest.raises(PoolExhaustedError, match="truncating"):
        allocator.truncate(table, 6)
    assert table.num_tokens == 8 and table.block_ids == [0, 1] and allocator.staging.open == {}
    allocator.check_invariants()
    allocator.truncate(table, 3)  # block 1 is given back first: its place holds the companion
    assert allocator.staging.open == {0: (1,)}
    allocator.check_invariants()


def test_pool_exhausted_counts_the_companions_and_changes_nothing():
    allocator = BlockAllocator(num_blocks=3, block_size=4, companions=2)
    table = allocator.new_table()
    allocator.append(table, 4)
    with pytest.raises(PoolExhaustedError) as error:
        allocator.append(table, 1)  # one block and its two companions
    assert (error.value.num_needed, error.value.num_free) == (3, 2)
    assert table.num_tokens == 4 and allocator.num_used == 1
    allocator.check_invariants()


def test_check_invariants_catches_an_open_block_without_companions():
    allocator = BlockAllocator(num_blocks=4, block_size=4, companions=1)
    table = allocator.new_table()
    allocator.append(table, 2)
    allocator.staging.open.clear()  # negative control: the companion is held by nothing now
    with pytest.raises(InvariantError, match="invariant"):
        allocator.check_invariants()


class StagedMachine(AllocatorMachine):
    """The allocator state machine with companion blocks: the storage it plays keeps an open block's tokens only in
    its companions (the block's own slots get them when it fills, from the companions and the new tokens), and reads
    an open block from its companions. Block copies carry both; a block opened again by `truncate` gets its tokens
    read back into its companions. So a companion given back too early, shared, missing or not copied shows up as a
    table reading the wrong tokens."""

    @initialize(num_blocks=st.integers(4, 48), block_size=st.integers(1, 4), companions=st.integers(1, 2))
    def create(self, num_blocks, block_size, companions):
        super().create(num_blocks, block_size)
        self.allocator = BlockAllocator(num_blocks, block_size, companions)
        self.per_companion = -(-block_size // companions)  # tokens one companion holds

    def _staged_slot(self, companions, offset):
        return companions[offset // self.per_companion] * self.size + offset % self.per_companion

    def _write_token(self, block_id, offset, token):
        companions = self.allocator.staging.companions_of(block_id)
        if companions is not None:
            self.slots[self._staged_slot(companions, offset)] = token
        else:
            self.slots[block_id * self.size + offset] = token

    def _seal(self, block_id, new):
        """The forward that fills `block_id` writes its slots: earlier tokens from its sealing companions."""
        companions = self.allocator.staging.sealing_companions_of(block_id)
        for offset in range(self.size):
            if offset in new:
                self.slots[block_id * self.size + offset] = new[offset]
            elif companions is not None:
                self.slots[block_id * self.size + offset] = self.slots[self._staged_slot(companions, offset)]

    def _append(self, requests, insert=False):
        allocator = self.allocator
        free_before, state = allocator.num_free, self._state()
        needed = allocator.num_blocks_needed_for([(t, len(new)) for t, new in requests])
        starts = [t.num_tokens for t, _ in requests]
        try:
            copies = allocator.append_all([(t, len(new)) for t, new in requests])
        except PoolExhaustedError as error:
            self.seen["pool exhausted"] += 1
            assert (error.num_needed, error.num_free) == (needed, free_before)
            assert self._state() == state
            return
        assert free_before - allocator.num_free == needed
        self.seen["copy-on-write"] += len(copies)
        for copy in copies:
            self.slots[copy.dst * self.size : (copy.dst + 1) * self.size] = self._read_block(copy.src)
        for (table, new), start in zip(requests, starts):
            filled: dict[int, dict[int, int]] = {}
            for offset, token in enumerate(new):
                index, within = divmod(start + offset, self.size)
                block_id = table.block_ids[index]
                assert allocator.ref_count(block_id) == 1, f"write into block {block_id} shared by several tables"
                if allocator.staging.companions_of(block_id) is None:
                    filled.setdefault(block_id, {})[within] = token
                else:
                    self._write_token(block_id, within, token)
            for block_id, tokens in filled.items():
                self.seen["sealed"] += 1
                self._seal(block_id, tokens)
            self.tokens[table.table_id] += new
        for table, _ in requests if insert else ():
            self._insert_prefix(table)

    def _read(self, table):
        size = self.size
        first = table.num_skipped * size
        out = []
        for position in range(first, table.num_tokens):
            block_id = table.block_ids[position // size]
            companions = self.allocator.staging.companions_of(block_id)
            if companions is not None:
                out.append(self.slots[self._staged_slot(companions, position % size)])
            else:
                out.append(self.slots[block_id * size + position % size])
        return out

    @precondition(lambda self: self.tables)
    @rule(index=st.integers(0, 1000), keep=st.integers(0, 30))
    def truncate(self, index, keep):
        self._count()
        table = self._table(index)
        keep = min(keep, table.num_tokens)
        if keep and table.block_ids[(keep - 1) // self.size] is None:
            return
        try:
            self.allocator.truncate(table, keep)
        except PoolExhaustedError:
            self.seen["truncate refused"] += 1
            return
        del self.tokens[table.table_id][keep:]
        for block_id in self.allocator.staging.reopened:  # the storage reads the keys back into the companions
            self.seen["reopened"] += 1
            for offset in range(self.size):
                token = self.slots[block_id * self.size + offset]
                self.slots[self._staged_slot(self.allocator.staging.companions_of(block_id), offset)] = token
        self.allocator.staging.reopened.clear()

    @precondition(lambda self: self.tables)
    @rule(index=st.integers(0, 1000))
    def free(self, index):
        self._count()
        table = self.tables.pop(index % len(self.tables))
        self.allocator.free(table)
        self.history = [self.tokens.pop(table.table_id)] + self.history[:7]

    @precondition(lambda self: self.tables)
    @rule(index=st.integers(0, 1000), skipped=st.integers(0, 30))
    def free_skipped(self, index, skipped):
        self._count()
        table = self._table(index)
        self.seen["skipped block given back"] += self.allocator.free_skipped(table, min(skipped, table.num_tokens))

    @precondition(lambda self: False)
    @rule()
    def evict(self):
        """Not replayed: its expectations count the free queue without companions (the base machine checks it)."""

    @invariant()
    def consistent(self):
        allocator = self.allocator
        allocator.check_invariants()
        for table in self.tables:
            assert self._read(table) == self.tokens[table.table_id][table.num_skipped * self.size :], table
        for block_id in range(allocator.num_blocks):
            cached = allocator._block_tokens.get(block_id)
            if cached is not None and allocator.staging.companions_of(block_id) is None:
                assert tuple(self._read_block(block_id)) == cached, block_id
        held = {b for table in self.tables for b in table.live_block_ids} | set(allocator.staging.owned())
        assert allocator.num_used == len(held)


def test_staged_state_machine_keeps_every_table_readable():
    StagedMachine.steps, StagedMachine.seen = 0, Counter()
    quick = settings(
        max_examples=250,
        stateful_step_count=60,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    run_state_machine_as_test(StagedMachine, settings=quick)
    print(f"staged state machine: {StagedMachine.steps} steps, {dict(StagedMachine.seen)}")
    for what in ("pool exhausted", "copy-on-write", "sealed", "reopened", "prefix hit", "deduplicated block"):
        assert StagedMachine.seen[what] > 0, what
