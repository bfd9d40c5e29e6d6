"""`plot_pool` and `plot_fragmentation`: matplotlib figures of the pool, and of naive reservation next to paging.
matplotlib is imported when a figure is drawn, never by `import hf_paged`."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..accounting import naive_footprint, paged_footprint
from ..allocator import BlockAllocator, tokens_per_block
from .snapshot import (
    EVICTABLE,
    FREE,
    USED,
    BlockView,
    PoolSnapshot,
    check_positive,
    plural,
    pool_snapshot,
    shown_blocks,
)

MAX_FRAGMENTATION_SLOTS = 10_000

_FREE_FACE, _FREE_EDGE = "white", "#b0b0b0"
_EVICTABLE_FACE, _OTHER_FACE = "#e4e4e4", "#7a7a7a"
_WASTE_FACE = "#f3d3d3"


def _matplotlib():
    try:
        import matplotlib
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch, Rectangle
    except ImportError as error:
        raise ImportError(
            'hf_paged.visual needs matplotlib to draw figures: pip install "hf_paged[viz]" (or pip install '
            "matplotlib); render_pool_text works without it"
        ) from error
    return matplotlib, Figure, Patch, Rectangle


def _colors(matplotlib, count: int) -> list:
    name = "tab10" if count <= 10 else "tab20"
    cmap = matplotlib.colormaps[name]
    return [cmap(index % cmap.N) for index in range(count)]


def plot_pool(
    source,
    tables=None,
    *,
    columns: int | None = None,
    max_blocks: int | None = None,
    show_tables: bool = False,
    title: str | None = None,
    ax=None,
):
    """Draw the pool as a grid of physical blocks coloured by the sequence that owns them.

    Each block is a square (its id in the corner when the grid is small); the owner's colour fills it from the
    bottom in proportion to the tokens it holds, so a partly filled block is partly coloured. A block shared by
    several tables (refcount > 1) is split into one stripe per shown owner, hatched, outlined in black and marked
    with its refcount; a cached block no table holds (evictable) is grey and dotted; a block held only by tables not
    shown is dark grey; a free block is blank. Every block patch carries a `gid` (`"block:<id>"`, `"free:<id>"`,
    `"evictable:<id>"`, `"other:<id>"`, `"fill:<id>:<owner>"`, `"shared:<id>"`, `"refcount:<id>"`) for tools and
    tests.

    Args:
        source, tables: as for `pool_snapshot`, or a `PoolSnapshot`.
        columns (`int`, *optional*): blocks per grid row (default: about the square root of the blocks shown).
        max_blocks (`int`, *optional*): blocks to show from block 0; by default up to the last block that is not
            free, in whole rows.
        show_tables (`bool`): add a panel below the grid with each sequence's block table: logical block `L<i>`
            → physical block id.
        title (`str`, *optional*): the figure's title (default: a one-line summary of the pool).
        ax (`matplotlib.axes.Axes`, *optional*): draw the grid into this axes instead of a new figure (not with
            `show_tables`).

    Returns:
        `matplotlib.figure.Figure`: the figure; save it with `fig.savefig(path)`, or, in a notebook after
            `%matplotlib inline`, let it display as the cell's value.

    Example:

    ```python
    >>> from hf_paged import BlockAllocator
    >>> allocator = BlockAllocator(num_blocks=16, block_size=4)
    >>> a = allocator.new_table()
    >>> _ = allocator.append(a, 6)
    >>> fig = plot_pool(allocator, {"A": a}, columns=8)
    >>> sorted(p.get_gid() for p in fig.axes[0].patches if p.get_gid().startswith("block:"))
    ['block:0', 'block:1']

    ```
    """
    matplotlib, Figure, Patch, Rectangle = _matplotlib()
    snapshot = source if isinstance(source, PoolSnapshot) else pool_snapshot(source, tables)
    if columns is None:
        guess = snapshot.default_window(16) if max_blocks is None else min(max_blocks, snapshot.num_blocks)
        columns = max(4, min(32, math.ceil(math.sqrt(guess))))
    check_positive("columns", columns)
    shown = shown_blocks(snapshot, columns, max_blocks)
    num_rows = math.ceil(shown / columns)
    if ax is not None and show_tables:
        raise ValueError("show_tables draws its own panel: call plot_pool without ax")
    colors = _colors(matplotlib, len(snapshot.labels))
    span = max([columns] + [len(ids) for ids in snapshot.tables] if show_tables else [columns])
    own_figure = ax is None
    if ax is None:
        cell = min(0.42, 12.5 / span)  # inches per block
        grid_height = num_rows * cell + 0.7
        table_height = (len(snapshot.labels) + 1) * cell + 0.5
        figsize = (span * cell + 3.4, grid_height + (table_height if show_tables else 0))
        fig = Figure(figsize=figsize, layout="constrained")
        if show_tables:
            ax, table_ax = fig.subplots(2, 1, height_ratios=[grid_height, table_height])
        else:
            ax, table_ax = fig.subplots(), None
    else:
        fig, table_ax = ax.figure, None
    small = shown <= 256
    for block in snapshot.blocks[:shown]:
        x, y = block.block_id % columns, num_rows - 1 - block.block_id // columns
        _draw_block(ax, Rectangle, snapshot, block, x, y, colors, small)
    _frame(ax, span, num_rows)
    summary = snapshot.summary(shown)
    ax.set_title(summary if title is None else title, fontsize=10)
    handles = [Patch(facecolor=color, label=label) for color, label in zip(colors, snapshot.labels)]
    handles += _state_handles(Patch, snapshot, shown)
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    if table_ax is not None:
        _draw_tables(table_ax, Rectangle, snapshot, colors, span)
    if own_figure:
        fit_to_contents(fig)
    return fig


def _draw_block(ax, Rectangle, snapshot: PoolSnapshot, block: BlockView, x: float, y: float, colors, small: bool):
    size = 0.9
    block_id = block.block_id
    if block.state == FREE:
        ax.add_patch(Rectangle((x, y), size, size, facecolor=_FREE_FACE, edgecolor=_FREE_EDGE, gid=f"free:{block_id}"))
    elif block.state == EVICTABLE:
        ax.add_patch(
            Rectangle(
                (x, y),
                size,
                size,
                facecolor=_EVICTABLE_FACE,
                edgecolor="#8a8a8a",
                hatch="..",
                linestyle="--",
                gid=f"evictable:{block_id}",
            )
        )
    elif not block.owners:
        ax.add_patch(Rectangle((x, y), size, size, facecolor=_OTHER_FACE, edgecolor="#555555", gid=f"other:{block_id}"))
    else:
        first = colors[block.owners[0]]
        ax.add_patch(
            Rectangle((x, y), size, size, facecolor=(*first[:3], 0.18), edgecolor=first, gid=f"block:{block_id}")
        )
        height = size * block.num_tokens / snapshot.block_size
        stripe = size / len(block.owners)
        for position, owner in enumerate(block.owners):
            ax.add_patch(
                Rectangle(
                    (x + position * stripe, y),
                    stripe,
                    height,
                    facecolor=colors[owner],
                    edgecolor="none",
                    gid=f"fill:{block_id}:{owner}",
                )
            )
    if block.state == USED and block.is_shared:
        ax.add_patch(
            Rectangle(
                (x, y),
                size,
                size,
                facecolor="none",
                edgecolor="black",
                hatch="///",
                linewidth=2.0,
                gid=f"shared:{block_id}",
            )
        )
        ax.text(
            x + size - 0.04,
            y + 0.05,
            f"×{block.ref_count}",
            ha="right",
            va="bottom",
            fontsize=8,
            fontweight="bold",
            color="black",
            gid=f"refcount:{block_id}",
            bbox={"boxstyle": "round,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.85},
        )
    if small:
        ax.text(x + 0.05, y + size - 0.05, str(block_id), ha="left", va="top", fontsize=6, color="#444444")


def _state_handles(Patch, snapshot: PoolSnapshot, shown: int) -> list:
    visible = snapshot.blocks[:shown]
    handles = []
    if any(b.state == USED and b.is_shared for b in visible):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///", label="shared (×refcount)"))
    if any(b.state == EVICTABLE for b in visible):
        handles.append(Patch(facecolor=_EVICTABLE_FACE, edgecolor="#8a8a8a", hatch="..", label="cached, evictable"))
    if any(b.state == USED and not b.owners for b in visible):
        handles.append(Patch(facecolor=_OTHER_FACE, label="other tables"))
    handles.append(Patch(facecolor=_FREE_FACE, edgecolor=_FREE_EDGE, label="free"))
    return handles


def _draw_tables(ax, Rectangle, snapshot: PoolSnapshot, colors, span: int) -> None:
    rows = len(snapshot.tables)
    for logical in range(max((len(ids) for ids in snapshot.tables), default=0)):
        ax.text(logical + 0.45, rows + 0.1, f"L{logical}", ha="center", va="bottom", fontsize=7, color="#444444")
    for row, (label, block_ids, num_tokens) in enumerate(zip(snapshot.labels, snapshot.tables, snapshot.num_tokens)):
        y, color = rows - 1 - row, colors[row]
        ax.text(-0.2, y + 0.45, f"{label} ({plural(num_tokens, 'token')})", ha="right", va="center", fontsize=8)
        for logical, block_id in enumerate(block_ids):
            if block_id is None:  # skipped by the sliding window (given back)
                ax.text(logical + 0.45, y + 0.45, "-", ha="center", va="center", fontsize=7, color="#888888")
                continue
            tokens = min(snapshot.block_size, num_tokens - logical * snapshot.block_size)
            ax.add_patch(
                Rectangle((logical, y), 0.9, 0.9, facecolor=(*color[:3], 0.18), edgecolor=color, gid=f"table:{row}")
            )
            ax.add_patch(Rectangle((logical, y), 0.9, 0.9 * tokens / snapshot.block_size, facecolor=color, alpha=0.7))
            ax.text(logical + 0.45, y + 0.45, str(block_id), ha="center", va="center", fontsize=7, fontweight="bold")
    _frame(ax, span, rows + 0.6)
    ax.set_title("block tables: logical block L<i> → physical block id", fontsize=9)


def plot_fragmentation(
    lengths: Sequence[int],
    reserve: int | None = None,
    block_size: int = 2,
    *,
    capacity: int | None = None,
    columns: int | None = None,
    title: str | None = None,
):
    """Naive max-length reservation next to paging for the same sequence lengths (seed 004's figure).

    Left: every sequence reserves `reserve` contiguous slots (a row each, wrapped at `columns`); slots holding a
    token are coloured, reserved but unused slots are hatched. Right: the same cache of `capacity` slots cut into
    pages of `block_size` slots and handed out by a real `BlockAllocator`, page by page as each sequence grows; the
    only waste is inside a sequence's last page, and untouched pages stay free for other sequences. Both titles give
    slots allocated, slots wasted and the fragmentation (`wasted / allocated`), from `naive_footprint` and
    `paged_footprint`. Slot patches carry gids `"naive-used"`, `"naive-wasted"`, `"paged-used"`, `"paged-wasted"`,
    `"paged-free"`.

    Args:
        lengths (`Sequence[int]`): tokens in each sequence (each >= 1).
        reserve (`int`, *optional*): slots the naive scheme reserves per sequence (default: the longest length).
        block_size (`int`): slots per page.
        capacity (`int`, *optional*): slots in the cache, a multiple of `block_size` (default: what naive
            reserves, `reserve * len(lengths)`, rounded up to whole pages).
        columns (`int`, *optional*): slots per drawn row (default: `reserve` up to 32 slots, else 32 rounded to whole
            pages); longer reservations wrap, and the paged panel shows `columns // block_size` pages per row.
        title (`str`, *optional*): the figure's title.

    Returns:
        `matplotlib.figure.Figure`.

    Example:

    ```python
    >>> fig = plot_fragmentation([1, 4, 2], reserve=4, block_size=2)
    >>> [ax.get_title().splitlines()[1] for ax in fig.axes]
    ['wasted 5 of 12 slots: fragmentation 0.417', 'wasted 1 of 8 slots: fragmentation 0.125']

    ```
    """
    matplotlib, Figure, Patch, Rectangle = _matplotlib()
    lengths = list(lengths)
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lengths):
        raise ValueError(f"lengths must be a non-empty list of positive ints, got {lengths!r}")
    check_positive("block_size", block_size)
    reserve = max(lengths) if reserve is None else reserve
    check_positive("reserve", reserve)
    if capacity is None:
        capacity = -(-reserve * len(lengths) // block_size) * block_size
    check_positive("capacity", capacity)
    if capacity % block_size:
        raise ValueError(f"capacity ({capacity} slots) must be a multiple of block_size ({block_size})")
    if max(capacity, reserve * len(lengths)) > MAX_FRAGMENTATION_SLOTS:
        raise ValueError(
            f"plot_fragmentation draws one square per slot: {max(capacity, reserve * len(lengths))} slots is over "
            f"the limit of {MAX_FRAGMENTATION_SLOTS}; scale the lengths down"
        )
    naive = naive_footprint(lengths, reserve)
    paged = paged_footprint(lengths, block_size)
    if paged.slots_allocated > capacity:
        raise ValueError(
            f"the sequences need {paged.slots_allocated} paged slots but the cache has capacity={capacity}"
        )
    allocator = BlockAllocator(capacity // block_size, block_size)
    tables = [allocator.new_table() for _ in lengths]
    for table, length in zip(tables, lengths):
        allocator.append(table, length)
    colors = _colors(matplotlib, len(lengths))
    if columns is None:
        columns = reserve if reserve <= 32 else max(block_size, 32 // block_size * block_size)
    check_positive("columns", columns)
    page_columns = max(1, columns // block_size)
    rows_per_sequence = math.ceil(reserve / columns)
    gap = 0.4 if rows_per_sequence > 1 else 0.0
    naive_height = len(lengths) * rows_per_sequence + (len(lengths) - 1) * gap
    page_rows = math.ceil(allocator.num_blocks / page_columns)
    cell = min(0.5, 13.0 / (columns + page_columns * block_size))
    height = max(naive_height, page_rows) * cell + 1.6
    fig = Figure(figsize=((columns + page_columns * block_size) * cell + 2.5, height), layout="constrained")
    naive_ax, paged_ax = fig.subplots(1, 2, width_ratios=[columns, page_columns * block_size])
    for row, length in enumerate(lengths):
        top = naive_height - 1 - row * (rows_per_sequence + gap)
        for slot in range(reserve):
            used = slot < length
            naive_ax.add_patch(
                Rectangle(
                    (slot % columns, top - slot // columns),
                    0.92,
                    0.92,
                    facecolor=colors[row] if used else _WASTE_FACE,
                    edgecolor=colors[row],
                    hatch=None if used else "///",
                    gid="naive-used" if used else "naive-wasted",
                )
            )
        naive_ax.text(-0.3, top + 0.46, f"len {length}", ha="right", va="center", fontsize=8)
    _frame(naive_ax, columns, naive_height)
    naive_ax.set_title(
        f"naive: {reserve} slots reserved per sequence\n"
        f"wasted {naive.slots_wasted} of {naive.slots_allocated} slots: fragmentation {naive.waste_fraction:.3f}",
        fontsize=9,
    )
    owner = {block_id: (index, table) for index, table in enumerate(tables) for block_id in table.live_block_ids}
    for block_id in range(allocator.num_blocks):
        px = (block_id % page_columns) * block_size
        py = page_rows - 1 - block_id // page_columns
        index, table = owner.get(block_id, (None, None))
        tokens = 0 if table is None else tokens_per_block([table], block_size)[block_id]
        for slot in range(block_size):
            kind = "paged-free" if table is None else "paged-used" if slot < tokens else "paged-wasted"
            face = {"paged-free": _FREE_FACE, "paged-used": None, "paged-wasted": _WASTE_FACE}[kind]
            paged_ax.add_patch(
                Rectangle(
                    (px + slot, py),
                    0.92,
                    0.92,
                    facecolor=face or colors[index],
                    edgecolor=_FREE_EDGE if table is None else colors[index],
                    hatch="///" if kind == "paged-wasted" else None,
                    gid=kind,
                )
            )
        paged_ax.add_patch(
            Rectangle((px - 0.04, py - 0.04), block_size, 1.0, facecolor="none", edgecolor="black", linewidth=1.2)
        )
        paged_ax.text(px + 0.05, py + 0.88, f"p{block_id}", ha="left", va="top", fontsize=6, color="#444444")
    _frame(paged_ax, page_columns * block_size, page_rows)
    free_slots = capacity - paged.slots_allocated
    paged_ax.set_title(
        f"paged: pages of {block_size} slots, {free_slots} slots still free\n"
        f"wasted {paged.slots_wasted} of {paged.slots_allocated} slots: fragmentation {paged.waste_fraction:.3f}",
        fontsize=9,
    )
    handles = [
        Patch(facecolor=color, label=f"seq {i} ({plural(n, 'token')})")
        for i, (color, n) in enumerate(zip(colors, lengths))
    ]
    handles += [
        Patch(facecolor=_WASTE_FACE, edgecolor="#999999", hatch="///", label="allocated, unused"),
        Patch(facecolor=_FREE_FACE, edgecolor=_FREE_EDGE, label="free"),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 6), fontsize=8, frameon=False)
    total = sum(lengths)
    fig.suptitle(title or f"{len(lengths)} sequences, {total} tokens: naive reservation vs paging", fontsize=10)
    fit_to_contents(fig)
    return fig


def fit_to_contents(fig, margin_in: float = 0.05, rounds: int = 3) -> None:
    """Grow `fig` until everything drawn (titles, legends, labels outside the axes) lies inside it, so that a plain
    `fig.savefig(path)` shows it all (constrained layout moves axes to make room, but never enlarges the figure, so a
    title or legend wider than the figure would be cut). The figure gets an Agg canvas, which draws off screen."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if not isinstance(fig.canvas, FigureCanvasAgg):
        FigureCanvasAgg(fig)
    for _ in range(rounds):
        renderer = fig.canvas.get_renderer()
        fig.draw_without_rendering()
        box = fig.get_tightbbox(renderer)  # inches
        width, height = fig.get_size_inches()
        grow_x = max(0.0, -box.x0) + max(0.0, box.x1 - width)
        grow_y = max(0.0, -box.y0) + max(0.0, box.y1 - height)
        if grow_x <= 0.01 and grow_y <= 0.01:
            return
        fig.set_size_inches(
            width + grow_x + 2 * margin_in * (grow_x > 0), height + grow_y + 2 * margin_in * (grow_y > 0)
        )


def _frame(ax, width: int, height: int) -> None:
    ax.set_xlim(-0.1, width)
    ax.set_ylim(-0.1, height)
    ax.set_aspect("equal")
    ax.axis("off")
