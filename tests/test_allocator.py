"""Exact-state tests of the block allocator: tables, free order, refcounts and copy-on-write after each step."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hf_paged import BlockAllocator, InvariantError, PoolExhaustedError
from hf_paged.accounting import naive_footprint, paged_footprint
from hf_paged.allocator import BlockCopy
from hf_paged.groups import skipped_tokens
from hf_paged.prefix import chain, root_hash

from .conftest import LONG_TESTS

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


# ---------------------------------------------------------------------- truncate
def test_truncate_releases_blocks_that_become_empty():
    allocator = BlockAllocator(num_blocks=4, block_size=4)
    table = allocator.new_table()
    allocator.append(table, 10)
    allocator.truncate(table, 5)
    assert table.block_ids == [0, 1] and table.num_tokens == 5 and allocator.free_block_ids == [3, 2]
    allocator.truncate(table, 0)
    assert table.block_ids == [] and allocator.num_free == 4
    with pytest.raises(ValueError, match="cannot truncate a table of 0 tokens to 1"):
        allocator.truncate(table, 1)


def test_truncate_inside_a_shared_block_then_write_copies_it():
    allocator = BlockAllocator(num_blocks=4, block_size=4)
    parent = allocator.new_table()
    allocator.append(parent, 3)
    child = allocator.fork(parent)
    allocator.truncate(child, 1)
    assert allocator.append(child, 1) == [BlockCopy(src=0, dst=1)]
    assert parent.num_tokens == 3 and allocator.ref_count(0) == 1
    allocator.check_invariants()


# ---------------------------------------------------------------------- exhaustion and bad input
def test_pool_exhausted_names_needed_and_free_and_changes_nothing():
    allocator = BlockAllocator(num_blocks=3, block_size=2)
    table = allocator.new_table()
    allocator.append(table, 3)
    before = snapshot(allocator), list(table.block_ids), table.num_tokens
    with pytest.raises(PoolExhaustedError, match="needs 2 more block\\(s\\) but only 1 is free") as info:
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
TOKENS = st.integers(0, 2)  # a tiny alphabet, so that prompts repeat and prefix lookups hit
MAX_TABLES = 8  # rules that add a table wait while this many are live


class AllocatorMachine(RuleBasedStateMachine):
    """Random table operations on a small pool, checked after every step against a plain reference model.

    The reference model is a list of token ids per table. The machine also plays the KV storage: `slots` holds
    the token written into every physical slot, `append` performs the copy-on-write copies and then writes the new
    tokens, and every check reads each table back through its block table. So a write into a shared block, a missed
    copy, a wrong truncate or a cached block reused while still indexed shows up as a table reading the wrong tokens.
    `steps` counts the rules executed and `seen` what they ran into (all examples together).
    """

    steps = 0
    seen = Counter()

    @initialize(num_blocks=st.integers(3, 48), block_size=st.integers(1, 4))
    def create(self, num_blocks, block_size):
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.size = block_size
        self.slots = [None] * (num_blocks * block_size)  # the token in every physical slot
        self.tables = []  # live tables
        self.tokens = {}  # table_id -> token ids (the reference model)
        self.history = []  # token ids of freed tables: prompts that come back

    def _count(self):
        type(self).steps += 1

    def _table(self, index):
        return self.tables[index % len(self.tables)]

    def _state(self):
        allocator = self.allocator
        refs = [allocator.ref_count(b) for b in range(allocator.num_blocks)]
        tables = [(list(t.block_ids), t.num_tokens) for t in self.tables]
        index = {b: allocator.block_hash(b) for b in range(allocator.num_blocks)}
        return allocator.free_block_ids, allocator.evictable_block_ids, refs, tables, index

    def _read(self, table):
        """The tokens `table` reads through its block table (from its first block not skipped)."""
        size = self.size
        first = table.num_skipped * size
        return [self.slots[table.block_ids[p // size] * size + p % size] for p in range(first, table.num_tokens)]

    def _append(self, requests, insert=False):
        """`append_all` of `(table, new tokens)`, then the storage's part: copies first, then the writes; `insert`
        then indexes the tables' full blocks, as a cache with prefix caching does after every forward."""
        allocator = self.allocator
        free_before, state = allocator.num_free, self._state()
        needed = allocator.num_blocks_needed_for([(t, len(new)) for t, new in requests])
        starts = [t.num_tokens for t, _ in requests]
        try:
            copies = allocator.append_all([(t, len(new)) for t, new in requests])
        except PoolExhaustedError as error:
            self.seen["pool exhausted"] += 1
            assert needed > free_before and (error.num_needed, error.num_free) == (needed, free_before)
            assert self._state() == state  # nothing changed
            return
        assert free_before - allocator.num_free == needed
        self.seen["copy-on-write"] += len(copies)
        for copy in copies:
            assert allocator.ref_count(copy.dst) == 1
            self.slots[copy.dst * self.size : (copy.dst + 1) * self.size] = self.slots[
                copy.src * self.size : (copy.src + 1) * self.size
            ]
        for (table, new), start in zip(requests, starts):
            for offset, token in enumerate(new):
                block_id = table.block_ids[(start + offset) // self.size]
                assert allocator.ref_count(block_id) == 1, f"write into block {block_id} shared by several tables"
                assert allocator.block_hash(block_id) is None, f"write into cached block {block_id}"
                self.slots[block_id * self.size + (start + offset) % self.size] = token
            self.tokens[table.table_id] += new
        for table, _ in requests if insert else ():
            self._insert_prefix(table)

    @precondition(lambda self: len(self.tables) < MAX_TABLES)
    @rule()
    def new_table(self):
        self._count()
        table = self.allocator.new_table()
        self.tables.append(table)
        self.tokens[table.table_id] = []

    @precondition(lambda self: self.tables)
    @rule(index=st.integers(0, 1000), new=st.lists(TOKENS, max_size=8), insert=st.booleans())
    def append(self, index, new, insert):
        self._count()
        self._append([(self._table(index), new)], insert)

    @precondition(lambda self: self.tables)
    @rule(
        indices=st.sets(st.integers(0, 1000), min_size=1, max_size=6),
        new=st.lists(TOKENS, min_size=1, max_size=3),
        insert=st.booleans(),
    )
    def write_step(self, indices, new, insert):
        """Several tables write at once (a decode step of forked rows: copy-on-write of their shared last block)."""
        self._count()
        tables = list({id(t): t for t in (self._table(i) for i in sorted(indices))}.values())
        self._append([(table, [(token + i) % 3 for token in new]) for i, table in enumerate(tables)], insert)

    @precondition(lambda self: 0 < len(self.tables) < MAX_TABLES)
    @rule(index=st.integers(0, 1000))
    def fork(self, index):
        self._count()
        parent = self._table(index)
        used = self.allocator.num_used
        child = self.allocator.fork(parent)
        assert self.allocator.num_used == used and child.block_ids == parent.block_ids
        self.tables.append(child)
        self.tokens[child.table_id] = list(self.tokens[parent.table_id])

    @precondition(lambda self: 0 < len(self.tables) < MAX_TABLES)
    @rule(
        index=st.integers(0, 1000),
        width=st.integers(1, 3),
        new=st.lists(TOKENS, min_size=1, max_size=2),
        insert=st.booleans(),
    )
    def beam_step(self, index, width, new, insert):
        """Fork a table `width` times, then every copy writes different tokens: its shared last block is copied
        on write (min(writers, sharers - 1) copies; the last writer writes in place)."""
        self._count()
        parent = self._table(index)
        children = [self.allocator.fork(parent) for _ in range(min(width, MAX_TABLES - len(self.tables)))]
        for child in children:
            self.tables.append(child)
            self.tokens[child.table_id] = list(self.tokens[parent.table_id])
        family = [parent, *children]
        self._append([(table, [(token + i) % 3 for token in new]) for i, table in enumerate(family)], insert)

    @precondition(lambda self: self.tables)
    @rule(index=st.integers(0, 1000), keep=st.integers(0, 30))
    def truncate(self, index, keep):
        self._count()
        table = self._table(index)
        keep = min(keep, table.num_tokens)
        if keep and table.block_ids[(keep - 1) // self.size] is None:  # would end inside a skipped block
            state = self._state()
            with pytest.raises(ValueError, match="skipped"):
                self.allocator.truncate(table, keep)
            assert self._state() == state
            self.seen["truncate into skipped blocks refused"] += 1
            return
        self.allocator.truncate(table, keep)
        del self.tokens[table.table_id][keep:]

    @precondition(lambda self: self.tables)
    @rule(index=st.integers(0, 1000))
    def free(self, index):
        """Blocks reaching refcount 0 join the free queue in table order, cached ones the LRU list tail first."""
        self._count()
        allocator = self.allocator
        table = self.tables.pop(index % len(self.tables))
        evictable = allocator.evictable_block_ids
        plain = allocator.free_block_ids[: allocator.num_free - len(evictable)]
        released = table.live_block_ids
        allocator.free(table)
        self.history = [self.tokens.pop(table.table_id)] + self.history[:7]
        gone = [b for b in released if allocator.ref_count(b) == 0]
        cached = [b for b in reversed(gone) if allocator.block_hash(b) is not None]
        assert allocator.evictable_block_ids == evictable + cached
        assert allocator.free_block_ids == plain + [b for b in gone if b not in cached] + evictable + cached

    @precondition(lambda self: self.tables)
    @rule(index=st.integers(0, 1000), skipped=st.integers(0, 30))
    def free_skipped(self, index, skipped):
        """A sliding window skipped the first `skipped` tokens: their whole blocks are given back, in logical order
        (plain ones to the back of the free queue, cached ones to the evictable list); the rest reads unchanged."""
        self._count()
        allocator = self.allocator
        table = self._table(index)
        skipped = min(skipped, table.num_tokens)
        evictable = allocator.evictable_block_ids
        plain = allocator.free_block_ids[: allocator.num_free - len(evictable)]
        before = list(table.block_ids)
        count = allocator.free_skipped(table, skipped)
        given_back = [b for b in before[: skipped // self.size] if b is not None]
        head = skipped // self.size
        assert count == len(given_back) and table.block_ids[:head] == [None] * head
        assert table.block_ids[head:] == before[head:]
        self.seen["skipped block given back"] += count
        gone = [b for b in given_back if allocator.ref_count(b) == 0]
        cached = [b for b in reversed(gone) if allocator.block_hash(b) is not None]
        assert allocator.evictable_block_ids == evictable + cached
        assert allocator.free_block_ids == plain + [b for b in gone if b not in cached] + evictable + cached

    @precondition(lambda self: self.tables)
    @rule(index=st.integers(0, 1000))
    def insert_prefix(self, index):
        """Index a table's full blocks by content (a block already cached elsewhere is replaced by that one)."""
        self._count()
        self._insert_prefix(self._table(index))

    def _insert_prefix(self, table):
        full_blocks = chain(ROOT, self.tokens[table.table_id], self.size)
        for position, (block_hash, block_tokens) in enumerate(full_blocks):
            if table.block_ids[position] is None:  # skipped: not indexed again
                continue
            holder = self.allocator.cache_block(table.block_ids[position], block_hash, block_tokens)
            if holder != table.block_ids[position]:
                self.seen["deduplicated block"] += 1
                self.allocator.replace_block(table, position, holder)
        if not table.num_skipped:
            assert self.allocator.lookup_prefix(full_blocks) == table.block_ids[: len(full_blocks)]

    def _prompt(self, source, keep, suffix):
        """The first `keep` tokens of a live or freed table (chosen by `source`), then `suffix`."""
        known = [self.tokens[t.table_id] for t in self.tables] + self.history
        return (known[source % len(known)][:keep] if known else []) + suffix

    @precondition(lambda self: len(self.tables) < MAX_TABLES)
    @rule(source=st.integers(0, 1000), keep=st.integers(0, 12), suffix=st.lists(TOKENS, max_size=4))
    def reuse_prefix(self, source, keep, suffix):
        """A new table starting with the longest cached prefix of a prompt (often one seen before)."""
        self._count()
        allocator = self.allocator
        prompt = self._prompt(source, keep, suffix)
        full_blocks = chain(ROOT, prompt, self.size)
        found = allocator.lookup_prefix(full_blocks)
        if len(found) < len(full_blocks):  # the longest: the next block is not cached
            assert allocator.lookup_prefix(full_blocks[: len(found) + 1]) == found
        self.seen["prefix hit"] += bool(found)
        table = allocator.new_table()
        allocator.share_cached(table, found)
        self.tables.append(table)
        self.tokens[table.table_id] = prompt[: len(found) * self.size]

    @precondition(lambda self: len(self.tables) < MAX_TABLES)
    @rule(
        source=st.integers(0, 1000),
        keep=st.integers(0, 12),
        suffix=st.lists(TOKENS, max_size=4),
        window=st.integers(1, 8),
    )
    def reuse_window(self, source, keep, suffix, window):
        """A new table of a sliding-window layer group: the longest cached prefix whose blocks inside the window
        of its next token are all cached, each looked up on its own; the blocks before the window are skipped."""
        self._count()
        allocator = self.allocator
        prompt = self._prompt(source, keep, suffix)
        links = chain(ROOT, prompt, self.size)
        found = allocator.lookup_blocks(links)
        count = len(links)
        while count and None in found[skipped_tokens(count * self.size, window) // self.size : count]:
            count -= 1
        skipped = skipped_tokens(count * self.size, window) // self.size
        refs = [allocator.ref_count(b) for b in found[skipped:count]]
        table = allocator.new_table()
        allocator.share_cached(table, [None] * skipped + found[skipped:count])
        assert table.block_ids == [None] * skipped + found[skipped:count] and table.num_tokens == count * self.size
        assert [allocator.ref_count(b) for b in found[skipped:count]] == [r + 1 for r in refs]
        self.seen["window hit"] += bool(count)
        self.tables.append(table)
        self.tokens[table.table_id] = prompt[: count * self.size]

    @precondition(lambda self: len(self.tables) < MAX_TABLES)
    @rule(source=st.integers(0, 1000), keep=st.integers(1, 12), insert=st.booleans())
    def recompute(self, source, keep, insert):
        """A new table appending the tokens of one seen before (its full blocks deduplicate on insert_prefix)."""
        self._count()
        table = self.allocator.new_table()
        self.tables.append(table)
        self.tokens[table.table_id] = []
        self._append([(table, self._prompt(source, keep, []))], insert)

    @precondition(lambda self: len(self.tables) < MAX_TABLES and self.allocator.evictable_block_ids)
    @rule(extra=st.integers(1, 4), token=TOKENS)
    def evict(self, extra, token):
        """A new table takes every plain free block and `extra` more: the least recently used cached blocks go."""
        self._count()
        allocator = self.allocator
        evictable = allocator.evictable_block_ids
        plain = allocator.num_free - len(evictable)
        take = min(plain + extra, allocator.num_free)
        if take == 0:
            return
        expected = allocator.free_block_ids[:take]
        victims = [(allocator.block_hash(b), tuple(self._read_block(b))) for b in expected[plain:]]
        evictions = allocator.stats().evictions
        table = allocator.new_table()
        self.tables.append(table)
        self.tokens[table.table_id] = []
        self._append([(table, [token] * (take * self.size))])
        assert table.block_ids == expected
        assert allocator.stats().evictions == evictions + len(victims)
        for victim in victims:  # an evicted block is no longer found under its old content
            assert allocator.lookup_prefix([victim]) == []

    def _read_block(self, block_id):
        return self.slots[block_id * self.size : (block_id + 1) * self.size]

    @precondition(lambda self: self.allocator.stats().num_cached)
    @rule(dice=st.integers(0, 9))
    def clear_prefix_cache(self, dice):
        self._count()
        if dice == 0:  # rarely: it empties the prefix index the other rules feed on
            self.allocator.clear_prefix_cache()
            assert self.allocator.stats().num_cached == 0 and self.allocator.evictable_block_ids == []

    @invariant()
    def consistent(self):
        allocator = self.allocator
        allocator.check_invariants()
        for table in self.tables:  # every table reads exactly its reference tokens through its block table
            assert self._read(table) == self.tokens[table.table_id][table.num_skipped * self.size :], table
        for block_id in range(allocator.num_blocks):  # a cached block holds the tokens it is indexed under
            cached = allocator._block_tokens.get(block_id)
            assert cached is None or tuple(self._read_block(block_id)) == cached, block_id
        held = {b for table in self.tables for b in table.live_block_ids}
        stats = allocator.stats()
        assert stats.num_used == len(held) and stats.num_free + stats.num_used == stats.num_blocks
        assert stats.num_tables == len(self.tables)
        assert 0 <= stats.waste_fraction < 1

    def teardown(self):
        self.seen["eviction"] += self.allocator.stats().evictions
        for table in self.tables:
            self.allocator.free(table)
        assert self.allocator.num_free == self.allocator.num_blocks
        self.allocator.check_invariants()


MACHINE_STEPS_TARGET = 10_000
MACHINE_SETTINGS = (
    settings(max_examples=2_000, stateful_step_count=150, deadline=None, suppress_health_check=list(HealthCheck))
    if LONG_TESTS
    else settings(
        max_examples=400,
        stateful_step_count=80,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
)


@pytest.mark.slow
def test_allocator_state_machine_runs_the_target_number_of_steps():
    AllocatorMachine.steps, AllocatorMachine.seen = 0, Counter()
    run_state_machine_as_test(AllocatorMachine, settings=MACHINE_SETTINGS)
    print(f"allocator state machine: {AllocatorMachine.steps} steps, {dict(AllocatorMachine.seen)}")
    assert all(
        AllocatorMachine.seen[what] > 0
        for what in (
            "pool exhausted",
            "copy-on-write",
            "deduplicated block",
            "prefix hit",
            "window hit",
            "eviction",
            "skipped block given back",
            "truncate into skipped blocks refused",
        )
    )
    assert AllocatorMachine.steps >= (10 * MACHINE_STEPS_TARGET if LONG_TESTS else MACHINE_STEPS_TARGET)


class NoCopyOnWriteMachine(AllocatorMachine):
    @initialize(num_blocks=st.integers(3, 48), block_size=st.integers(1, 4))
    def create(self, num_blocks, block_size):
        super().create(num_blocks, block_size)
        self.allocator._needs_copy_on_write = lambda block_id: False  # tables write into the blocks they share


def test_negative_control_state_machine_catches_writes_into_shared_blocks():
    """Without copy-on-write, forked tables write into each other's blocks: the machine must notice."""
    quick = settings(MACHINE_SETTINGS, max_examples=200, phases=[Phase.generate], report_multiple_bugs=False)
    with pytest.raises(AssertionError, match="shared by several tables|InvariantError|invariant"):
        run_state_machine_as_test(NoCopyOnWriteMachine, settings=quick)


# ---------------------------------------------------------------------------- blocks loaded from a KV tier
def test_adopt_cached_indexes_a_loaded_block_as_evictable_content():
    allocator = BlockAllocator(num_blocks=3, block_size=2)
    links = chain(root_hash(b"m"), [1, 2, 3, 4, 5, 6, 7, 8], 2)
    first = allocator.adopt_cached(*links[0])
    second = allocator.adopt_cached(*links[1])
    assert (first, second) == (0, 1)
    assert allocator.evictable_block_ids == [0, 1] and allocator.num_free == 3 and allocator.num_used == 0
    assert allocator.lookup_blocks(links[:3]) == [0, 1, None]
    allocator.check_invariants()
    table = allocator.new_table()
    allocator.share_cached(table, [0, 1])
    assert [allocator.ref_count(b) for b in range(3)] == [1, 1, 0]
    allocator.free(table)
    allocator.check_invariants()


def test_forget_cached_frees_adopted_blocks_and_refuses_blocks_in_use():
    allocator = BlockAllocator(num_blocks=3, block_size=2)
    links = chain(root_hash(b"m"), [1, 2, 3, 4, 5, 6], 2)
    adopted = [allocator.adopt_cached(*link) for link in links[:2]]
    table = allocator.new_table()
    allocator.share_cached(table, [adopted[0]])
    with pytest.raises(ValueError, match="block 0 is not unreferenced cached content"):
        allocator.forget_cached(adopted)  # block 0 is in a table
    with pytest.raises(ValueError, match="block 2 is not unreferenced cached content"):
        allocator.forget_cached([2])  # free, not cached
    allocator.forget_cached([adopted[1]])
    assert allocator.lookup_blocks(links[:2]) == [0, None]
    assert allocator.evictable_block_ids == [] and allocator.free_block_ids == [2, 1]
    allocator.check_invariants()
    allocator.free(table)
    assert allocator.evictable_block_ids == [0]
    allocator.check_invariants()


def test_adopt_cached_evicts_the_least_recently_used_and_refuses_what_it_cannot_take():
    allocator = BlockAllocator(num_blocks=2, block_size=2)
    links = chain(root_hash(b"m"), [1, 2, 3, 4, 5, 6], 2)
    allocator.adopt_cached(*links[0])
    allocator.adopt_cached(*links[1])
    allocator.pin_cached([0])  # pinned: the next load cannot evict it
    assert allocator.adopt_cached(*links[2]) == 1 and allocator.stats().evictions == 1
    assert allocator.lookup_blocks(links) == [0, None, 1]
    with pytest.raises(ValueError, match="cached already"):
        allocator.adopt_cached(*links[2])
    table = allocator.new_table()
    allocator.share_cached(table, [1])
    with pytest.raises(PoolExhaustedError, match="a block loaded from a KV tier"):
        allocator.adopt_cached(*chain(root_hash(b"other"), [9, 9], 2)[0])
    assert allocator.lookup_blocks(links) == [0, None, 1]  # nothing changed
    allocator.unpin_cached([0])
    allocator.free(table)
    assert allocator.evictable_block_ids == [0, 1]
    allocator.check_invariants()
