"""Memory footprint of a set of sequence lengths under naive reservation and under paging."""

from __future__ import annotations

from dataclasses import dataclass

from .allocator import BlockAllocator


@dataclass(frozen=True)
class Footprint:
    """Slots a scheme allocates for some sequences, and how many of them hold a real token."""

    slots_allocated: int
    tokens_stored: int

    @property
    def slots_wasted(self) -> int:
        return self.slots_allocated - self.tokens_stored

    @property
    def waste_fraction(self) -> float:
        return self.slots_wasted / self.slots_allocated if self.slots_allocated else 0.0


def naive_footprint(lengths: list[int], reserve: int) -> Footprint:
    """Every sequence reserves `reserve` contiguous slots up front, whatever its real length.

    Example:

    ```python
    >>> fp = naive_footprint([1, 4, 2], reserve=4)
    >>> fp.slots_allocated, fp.slots_wasted, round(fp.waste_fraction, 3)
    (12, 5, 0.417)

    ```
    """
    if any(length > reserve for length in lengths):
        raise ValueError(f"a length in {lengths} exceeds the reservation of {reserve} slots")
    return Footprint(slots_allocated=reserve * len(lengths), tokens_stored=sum(lengths))


def paged_footprint(lengths: list[int], block_size: int) -> Footprint:
    """Each sequence takes blocks one at a time from a real `BlockAllocator` as its tokens arrive.

    Example:

    ```python
    >>> fp = paged_footprint([1, 4, 2], block_size=2)
    >>> fp.slots_allocated, fp.slots_wasted, fp.waste_fraction
    (8, 1, 0.125)

    ```
    """
    num_blocks = sum(-(-length // block_size) for length in lengths) or 1
    allocator = BlockAllocator(num_blocks, block_size)
    for length in lengths:
        allocator.append(allocator.new_table(), length)
    stats = allocator.stats()
    return Footprint(slots_allocated=stats.slots_allocated, tokens_stored=stats.tokens_stored)
