"""Which rows of a forward attend together: rows of very different lengths read their keys in separate groups, so
a short row does not read (and mask) the pad positions up to the longest row's length."""

from __future__ import annotations

# A group costs one more call of every per-group operation per layer (query select, K/V gather, attention, output
# copy): about what reading this many bytes of K/V costs on a CPU (measured with benchmarks/packed_attention.py).
GROUP_COST_BYTES = 128 * 1024
MIN_GROUP_COST = 16  # key positions


def group_cost(bytes_per_position: int | None) -> int:
    """The cost of one more group, in key positions of one layer (`bytes_per_position`: its K and V bytes)."""
    if not bytes_per_position:
        return GROUP_COST_BYTES // 256
    return max(MIN_GROUP_COST, GROUP_COST_BYTES // bytes_per_position)


def split_by_length(lengths: list[int], cost: int) -> list[list[int]]:
    """Rows `0 .. len(lengths) - 1` split into groups that minimise the positions read plus `cost` per group:
    every row of a group reads as many key positions as the group's longest row. Groups are runs of the rows
    sorted by length (an optimal split always is one); each group lists its rows in ascending order, and the
    groups come longest first.

    Example:

    ```python
    >>> split_by_length([300, 8, 290, 10], cost=64)
    [[0, 2], [1, 3]]
    >>> split_by_length([300, 8, 290, 10], cost=10_000)
    [[0, 1, 2, 3]]

    ```
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    sorted_lengths = [lengths[row] for row in order]
    best = [0] * (len(order) + 1)  # best[j]: cheapest split of the j shortest rows
    start = [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        longest = sorted_lengths[end - 1]
        best[end], start[end] = min((best[i] + (end - i) * longest, i) for i in range(end))
        best[end] += cost
    groups = []
    end = len(order)
    while end:
        groups.append(sorted(order[start[end] : end]))
        end = start[end]
    return groups
