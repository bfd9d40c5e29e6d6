"""Exact-state tests of the block allocator: tables, free order, refcounts and copy-on-write after each step."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hf_paged import BlockAllocator, BlockCopy, InvariantError, PoolExhaustedError
from hf_paged.accounting import naive_footprint, paged_footprint
from hf_paged.prefix import chain, root_hash

ROOT = root_hash(b"state machine")


def snapshot(allocator: BlockAllocator):
    return allocator.free_block_ids, [allocator.ref_count(b) for b in range(allocator.num_blocks)]


# ---------------------------------------------------------------------- seed 003: the worked example
def test_seed_003_prefill_and_three_decode_steps():
    allocator = BlockAllocator(num_blocks=100, block_size=10)
    tables = {name: allocator.new_table() for name in "ABCD"}
    for name, length in zip("ABCD", [8, 5, 12, 9]):
        allocator.append(tables[name], length)

    # A: [0] 8/10   B: [1] 5/10   C: [2] 10/10, [3] 2/10   D: [4] 9/10
    assert {n: t.block_ids for n, t in tables.items()} == {"A": [0], "B": [1], "C": [2, 3], "D": [4]}
    assert allocator.free_block_ids[:3] == [5, 6, 7] and allocator.num_free == 95

    def decode_step():
        for name in "ABCD":
            allocator.append(tables[name], 1)

    decode_step()  # D fills block 4 (10/10); nobody needs a new block yet
    assert {n: t.block_ids for n, t in tables.items()} == {"A": [0], "B": [1], "C": [2, 3], "D": [4]}
    assert allocator.free_block_ids[0] == 5

    decode_step()  # D spills into block 5
    assert tables["D"].block_ids == [4, 5] and tables["A"].block_ids == [0]
    assert allocator.free_block_ids[0] == 6

    decode_step()  # A spills into block 6
    assert {n: t.block_ids for n, t in tables.items()} == {"A": [0, 6], "B": [1], "C": [2, 3], "D": [4, 5]}
    assert [t.num_tokens for t in tables.values()] == [11, 8, 15, 12]
    assert allocator.free_block_ids[:2] == [7, 8] and allocator.num_free == 93
    allocator.check_invariants()


# ---------------------------------------------------------------------- seed 004: paging vs naive reservation
def test_seed_004_paged_vs_naive_footprint():
    paged = paged_footprint([1, 4, 2], block_size=2)
    naive = naive_footprint([1, 4, 2], reserve=4)
    assert (paged.slots_allocated, paged.slots_wasted, paged.waste_fraction) == (8, 1, 0.125)
    assert (naive.slots_allocated, naive.slots_wasted, round(naive.waste_fraction, 3)) == (12, 5, 0.417)


def test_seed_004_stats_waste_counts_each_block_once():
    allocator = BlockAllocator(num_blocks=8, block_size=2)
    for length in [1, 4, 2]:
        allocator.append(allocator.new_table(), length)
    stats = allocator.stats()
    assert (stats.slots_allocated, stats.tokens_stored, stats.waste_fraction) == (8, 7, 0.125)
    shared = allocator.fork(allocator.new_table())  # an empty fork adds no blocks
    assert shared.block_ids == []
    assert allocator.stats().tokens_stored == 7


def test_naive_footprint_rejects_length_over_reservation():
    with pytest.raises(ValueError, match="exceeds the reservation of 4"):
        naive_footprint([5], reserve=4)


# ---------------------------------------------------------------------- free queue order
def test_fresh_allocator_hands_out_ascending_ids_and_freed_blocks_go_to_the_back():
    allocator = BlockAllocator(num_blocks=6, block_size=4)
    a, b = allocator.new_table(), allocator.new_table()
    allocator.append(a, 9)  # blocks 0, 1, 2
    allocator.append(b, 4)  # block 3
    assert (a.block_ids, b.block_ids, allocator.free_block_ids) == ([0, 1, 2], [3], [4, 5])
    allocator.free(a)
    assert allocator.free_block_ids == [4, 5, 0, 1, 2]
    c = allocator.new_table()
    allocator.append(c, 5)
    assert c.block_ids == [4, 5] and allocator.free_block_ids == [0, 1, 2]
    allocator.free(b)
    allocator.free(c)
    assert allocator.free_block_ids == [0, 1, 2, 3, 4, 5]
    allocator.check_invariants()


def test_append_takes_a_block_only_when_the_last_one_is_full():
    allocator = BlockAllocator(num_blocks=4, block_size=3)
    table = allocator.new_table()
    taken = []
    for _ in range(7):
        allocator.append(table, 1)
        taken.append(len(table.block_ids))
    assert taken == [1, 1, 1, 2, 2, 2, 3]
    assert allocator.append(table, 0) == [] and table.num_tokens == 7


# ---------------------------------------------------------------------- refcounts, fork and copy-on-write
def test_fork_shares_blocks_and_copy_on_write_copies_only_the_shared_partial_block():
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    parent = allocator.new_table()
    allocator.append(parent, 6)  # [0 full][1 2/4]
    child = allocator.fork(parent)
    assert child.block_ids == [0, 1] and [allocator.ref_count(b) for b in (0, 1)] == [2, 2]
    assert allocator.num_used == 2

    copies = allocator.append(child, 1)  # child writes into shared block 1 -> private copy 2
    assert copies == [BlockCopy(src=1, dst=2)]
    assert (parent.block_ids, child.block_ids) == ([0, 1], [0, 2])
    assert [allocator.ref_count(b) for b in (0, 1, 2)] == [2, 1, 1]

    assert allocator.append(parent, 1) == []  # block 1 is private again: written in place
    assert allocator.stats().cow_copies == 1

    allocator.free(parent)
    assert [allocator.ref_count(b) for b in (0, 1, 2)] == [1, 0, 1]
    assert allocator.free_block_ids == [3, 4, 5, 6, 7, 1]
    allocator.free(child)
    assert allocator.free_block_ids == [3, 4, 5, 6, 7, 1, 0, 2]
    allocator.check_invariants()


def test_full_shared_block_is_never_copied():
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    parent = allocator.new_table()
    allocator.append(parent, 8)
    child = allocator.fork(parent)
    assert allocator.append(child, 3) == []  # the shared blocks are full: the new token goes to a new block
    assert child.block_ids == [0, 1, 2] and allocator.ref_count(1) == 2


def test_blocks_needed_counts_one_copy_less_than_the_sharers_of_a_partial_block():
    allocator = BlockAllocator(num_blocks=16, block_size=4)
    root = allocator.new_table()
    allocator.append(root, 2)
    beams = [root] + [allocator.fork(root) for _ in range(3)]  # block 0 shared by 4 tables
    assert allocator.num_blocks_needed_for([(t, 1) for t in beams]) == 3
    copies = [c for t in beams for c in allocator.append(t, 1)]
    assert len(copies) == 3 and allocator.num_used == 4
    assert allocator.num_blocks_needed_for([(t, 5) for t in beams]) == 4  # 1 slot left each, then 1 new block


# ---------------------------------------------------------------------- crop
def test_crop_releases_blocks_that_become_empty():
    allocator = BlockAllocator(num_blocks=4, block_size=4)
    table = allocator.new_table()
    allocator.append(table, 10)
    allocator.crop(table, 5)
    assert table.block_ids == [0, 1] and table.num_tokens == 5 and allocator.free_block_ids == [3, 2]
    allocator.crop(table, 0)
    assert table.block_ids == [] and allocator.num_free == 4
    with pytest.raises(ValueError, match="cannot crop a table of 0 tokens to 1"):
        allocator.crop(table, 1)


def test_crop_inside_a_shared_block_then_write_copies_it():
    allocator = BlockAllocator(num_blocks=4, block_size=4)
    parent = allocator.new_table()
    allocator.append(parent, 3)
    child = allocator.fork(parent)
    allocator.crop(child, 1)
    assert allocator.append(child, 1) == [BlockCopy(src=0, dst=1)]
    assert parent.num_tokens == 3 and allocator.ref_count(0) == 1
    allocator.check_invariants()


# ---------------------------------------------------------------------- exhaustion and bad input
def test_pool_exhausted_names_needed_and_free_and_changes_nothing():
    allocator = BlockAllocator(num_blocks=3, block_size=2)
    table = allocator.new_table()
    allocator.append(table, 3)
    before = snapshot(allocator), list(table.block_ids), table.num_tokens
    with pytest.raises(PoolExhaustedError, match="needs 2 more block\\(s\\) but only 1 are free") as info:
        allocator.append(table, 4)
    assert isinstance(info.value, RuntimeError)
    assert (info.value.num_needed, info.value.num_free) == (2, 1)
    assert (snapshot(allocator), list(table.block_ids), table.num_tokens) == before
    allocator.check_invariants()


@pytest.mark.parametrize(
    "num_blocks, block_size, error, message",
    [
        (0, 16, ValueError, "num_blocks must be a positive int \\(>= 1\\), got 0"),
        (-3, 16, ValueError, "num_blocks must be a positive int \\(>= 1\\), got -3"),
        (8, 0, ValueError, "block_size must be a positive int \\(>= 1\\), got 0"),
        (8, 2.5, TypeError, "block_size must be a positive int, got 2.5"),
        (True, 4, TypeError, "num_blocks must be a positive int, got True"),
    ],
)
def test_invalid_sizes_are_refused(num_blocks, block_size, error, message):
    with pytest.raises(error, match=message):
        BlockAllocator(num_blocks, block_size)


def test_freed_table_cannot_be_used_again():
    allocator = BlockAllocator(num_blocks=2, block_size=2)
    table = allocator.new_table()
    allocator.free(table)
    with pytest.raises(ValueError, match="was already freed"):
        allocator.free(table)
    with pytest.raises(ValueError, match="was already freed"):
        allocator.append(table, 1)


def test_table_from_another_allocator_is_refused():
    table = BlockAllocator(2, 2).new_table()
    with pytest.raises(ValueError, match="belongs to another allocator"):
        BlockAllocator(2, 2).append(table, 1)


# ---------------------------------------------------------------------- invariants catch corruption
def test_check_invariants_catches_a_wrong_refcount():
    allocator = BlockAllocator(num_blocks=4, block_size=2)
    allocator.append(allocator.new_table(), 3)
    allocator._ref_counts[1] += 1
    with pytest.raises(InvariantError, match="invariant 2: block 1 has refcount 2 but 1 table entries"):
        allocator.check_invariants()


def test_check_invariants_catches_a_block_both_free_and_used():
    allocator = BlockAllocator(num_blocks=4, block_size=2)
    allocator.append(allocator.new_table(), 1)
    allocator._free.append(0)
    with pytest.raises(InvariantError, match="invariant 3: free queue has duplicates|invariant 1: block 0"):
        allocator.check_invariants()


def test_check_invariants_catches_a_table_with_too_few_blocks():
    allocator = BlockAllocator(num_blocks=4, block_size=2)
    table = allocator.new_table()
    allocator.append(table, 2)
    table.num_tokens = 3
    with pytest.raises(InvariantError, match="invariant 6"):
        allocator.check_invariants()


def test_check_invariants_catches_a_table_claiming_unwritten_slots():
    allocator = BlockAllocator(num_blocks=4, block_size=4)
    table = allocator.new_table()
    allocator.append(table, 2)
    table.num_tokens = 3
    with pytest.raises(InvariantError, match="invariant 5: .* claims 3 tokens in block 0"):
        allocator.check_invariants()


def test_check_invariants_catches_a_leak():
    allocator = BlockAllocator(num_blocks=4, block_size=2)
    allocator._free.popleft()
    allocator._ref_counts[0] = 1
    with pytest.raises(InvariantError, match="invariant 2"):
        allocator.check_invariants()


# ---------------------------------------------------------------------- property test: a state machine
class AllocatorMachine(RuleBasedStateMachine):
    """Random new/append/fork/crop/free and prefix-cache index/reuse, checked against a reference model of each
    table's token ids: every cached block a table holds must carry exactly that table's tokens."""

    def __init__(self):
        super().__init__()
        self.allocator = BlockAllocator(num_blocks=24, block_size=3)
        self.tables = []  # live tables
        self.tokens = {}  # table_id -> token ids (the reference contents)

    @rule()
    def new_table(self):
        table = self.allocator.new_table()
        self.tables.append(table)
        self.tokens[table.table_id] = []

    @precondition(lambda self: self.tables)
    @rule(index=st.integers(0, 1000), new=st.lists(st.integers(0, 2), max_size=10))
    def append(self, index, new):
        table = self.tables[index % len(self.tables)]
        free_before = self.allocator.num_free
        needed = self.allocator.num_blocks_needed(table, len(new))
        try:
            copies = self.allocator.append(table, len(new))
        except PoolExhaustedError:
            assert needed > free_before and self.allocator.num_free == free_before
            return
        assert free_before - self.allocator.num_free == needed
        assert len(copies) <= 1
        self.tokens[table.table_id] += new

    @precondition(lambda self: self.tables)
    @rule(index=st.integers(0, 1000))
    def fork(self, index):
        parent = self.tables[index % len(self.tables)]
        used = self.allocator.num_used
        child = self.allocator.fork(parent)
        assert self.allocator.num_used == used
        self.tables.append(child)
        self.tokens[child.table_id] = list(self.tokens[parent.table_id])

    @precondition(lambda self: self.tables)
    @rule(index=st.integers(0, 1000), keep=st.integers(0, 30))
    def crop(self, index, keep):
        table = self.tables[index % len(self.tables)]
        keep = min(keep, table.num_tokens)
        self.allocator.crop(table, keep)
        del self.tokens[table.table_id][keep:]

    @precondition(lambda self: self.tables)
    @rule(index=st.integers(0, 1000))
    def free(self, index):
        table = self.tables.pop(index % len(self.tables))
        self.allocator.free(table)
        del self.tokens[table.table_id]

    @precondition(lambda self: self.tables)
    @rule(index=st.integers(0, 1000))
    def index_full_blocks(self, index):
        table = self.tables[index % len(self.tables)]
        size = self.allocator.block_size
        for position, (block_hash, block_tokens) in enumerate(chain(ROOT, self.tokens[table.table_id], size)):
            holder = self.allocator.cache_block(table.block_ids[position], block_hash, block_tokens)
            if holder != table.block_ids[position]:
                self.allocator.replace_block(table, position, holder)

    @rule(prompt=st.lists(st.integers(0, 2), max_size=12))
    def reuse_cached_prefix(self, prompt):
        found = self.allocator.lookup_prefix(chain(ROOT, prompt, self.allocator.block_size))
        table = self.allocator.new_table()
        self.allocator.share_cached(table, found)
        self.tables.append(table)
        self.tokens[table.table_id] = prompt[: len(found) * self.allocator.block_size]

    @invariant()
    def consistent(self):
        self.allocator.check_invariants()
        size = self.allocator.block_size
        for table in self.tables:
            tokens = self.tokens[table.table_id]
            assert table.num_tokens == len(tokens)
            for position, block_id in enumerate(table.block_ids[: len(tokens) // size]):
                cached = self.allocator._block_tokens.get(block_id)
                assert cached is None or list(cached) == tokens[position * size : (position + 1) * size]
        stats = self.allocator.stats()
        assert stats.num_free + stats.num_used == stats.num_blocks
        assert 0 <= stats.waste_fraction < 1

    def teardown(self):
        for table in self.tables:
            self.allocator.free(table)
        assert self.allocator.num_free == self.allocator.num_blocks
        self.allocator.check_invariants()


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)
