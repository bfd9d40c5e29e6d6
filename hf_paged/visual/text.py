"""`render_pool_text`: the pool in a few lines of text, one character per block."""

from __future__ import annotations

from .snapshot import (
    EVICTABLE,
    EVICTABLE_GLYPH,
    FREE,
    FREE_GLYPH,
    GLYPHS,
    OTHER_GLYPH,
    SHARED_GLYPH,
    USED,
    BlockView,
    PoolSnapshot,
    check_positive,
    plural,
    pool_snapshot,
    shown_blocks,
)


def render_pool_text(source, tables=None, *, columns: int = 64, max_blocks: int | None = None) -> str:
    """The pool in a few lines of text: one character per physical block, then each sequence's block table.

    A block of the n-th shown sequence is the n-th capital letter, or the sequence's own label when every label is a
    single capital letter (lower case when the block is partly filled),
    `*` a block shared by several tables (refcount > 1), `o` a cached block no table holds (evictable, counts as
    free), `#` a block held only by tables not shown, `.` a free block. A pool with tiers behind its prefix cache
    (`kv_offload`) names them on the second line.

    Args:
        source, tables: as for `pool_snapshot` (at most 26 sequences).
        columns (`int`): blocks per line.
        max_blocks (`int`, *optional*): blocks to show from block 0; by default up to the last block that is not
            free, in whole lines.

    Example (seed 003's worked example after three decode steps):

    ```python
    >>> from hf_paged import BlockAllocator
    >>> allocator = BlockAllocator(num_blocks=100, block_size=10)
    >>> tables = {name: allocator.new_table() for name in "ABCD"}
    >>> for name, prompt_length in zip("ABCD", [8, 5, 12, 9]):
    ...     _ = allocator.append(tables[name], prompt_length)
    >>> for step in range(3):
    ...     for table in tables.values():
    ...         _ = allocator.append(table, 1)
    >>> print(render_pool_text(allocator, tables, columns=10))
    100 blocks x 10 tokens: 7 used, 93 free; blocks 0-9 shown
         0 AbCcDda...
    A [0, 6] 11 tokens
    B [1] 8 tokens
    C [2, 3] 15 tokens
    D [4, 5] 12 tokens

    ```
    """
    snapshot = source if isinstance(source, PoolSnapshot) else pool_snapshot(source, tables)
    check_positive("columns", columns)
    if len(snapshot.labels) > len(GLYPHS):
        raise ValueError(
            f"render_pool_text letters at most {len(GLYPHS)} sequences, got {len(snapshot.labels)}; "
            "pass the tables to show"
        )
    shown = shown_blocks(snapshot, columns, max_blocks)
    glyphs = _glyphs(snapshot.labels)
    lines = [snapshot.summary(shown)]
    if snapshot.tiers is not None:
        lines.append(snapshot.tiers)
    for start in range(0, shown, columns):
        row = "".join(_glyph(snapshot, glyphs, block) for block in snapshot.blocks[start : min(start + columns, shown)])
        lines.append(f"{start:>6} {row}")
    for index, (label, block_ids, num_tokens) in enumerate(zip(snapshot.labels, snapshot.tables, snapshot.num_tokens)):
        name = glyphs[index] if label == glyphs[index] else f"{glyphs[index]} {label}"
        lines.append(f"{name} {list(block_ids)} {plural(num_tokens, 'token')}")
    lines += _shared_lines(snapshot, glyphs)
    hidden_used = sum(1 for block in snapshot.blocks[shown:] if block.state == USED)
    if hidden_used:
        lines.append(f"blocks {shown}-{snapshot.num_blocks - 1} not shown ({hidden_used} used)")
    return "\n".join(lines)


def _glyphs(labels: tuple[str, ...]) -> tuple[str, ...]:
    if len(set(labels)) == len(labels) and all(len(label) == 1 and label in GLYPHS for label in labels):
        return labels
    return tuple(GLYPHS[: len(labels)])


def _glyph(snapshot: PoolSnapshot, glyphs: tuple[str, ...], block: BlockView) -> str:
    if block.state == FREE:
        return FREE_GLYPH
    if block.state == EVICTABLE:
        return EVICTABLE_GLYPH
    if block.is_shared:
        return SHARED_GLYPH
    if not block.owners:
        return OTHER_GLYPH
    letter = glyphs[block.owners[0]]
    return letter if block.num_tokens == snapshot.block_size else letter.lower()


def _shared_lines(snapshot: PoolSnapshot, glyphs: tuple[str, ...]) -> list[str]:
    groups: dict[tuple[tuple[int, ...], int], list[int]] = {}
    for block in snapshot.blocks:
        if block.state == USED and block.is_shared:
            groups.setdefault((block.owners, block.ref_count), []).append(block.block_id)
    lines = []
    for (owners, ref_count), block_ids in groups.items():
        holders = " ".join(glyphs[owner] for owner in owners) or "tables not shown"
        others = ref_count - len(owners)
        if owners and others:
            holders += f" and {others} table(s) not shown"
        lines.append(f"* {block_ids} shared by {holders} (refcount {ref_count})")
    return lines
