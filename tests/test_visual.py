"""Pool pictures: the text rendering is exact for a known state, and the figures draw one artist per block in the
right role (owned, shared, evictable, other tables, free), read back from the figure's patches."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
import torch

import hf_paged
from hf_paged import BlockAllocator, BlockPool
from hf_paged.prefix import chain, root_hash
from hf_paged.visual import plot_fragmentation, plot_pool, pool_snapshot, render_pool_text

pytest.importorskip("matplotlib")


def known_state():
    """12 blocks of 4 tokens:

        block  0  1  2  3  4  5  6 ... 11
               *  *  #  o  o  c  .      .
    A = [0, 1] with 6 tokens, B = fork(A) (blocks 0 and 1 shared, refcount 2), a hidden table holds block 2, a freed
    table left blocks 3 and 4 cached by content (evictable), C = [5] with 1 token.
    """
    allocator = BlockAllocator(num_blocks=12, block_size=4)
    a = allocator.new_table()
    allocator.append(a, 6)
    b = allocator.fork(a)
    hidden = allocator.new_table()
    allocator.append(hidden, 4)
    cached = allocator.new_table()
    allocator.append(cached, 8)
    tokens = list(range(10, 18))
    for block_id, (block_hash, block_tokens) in zip(cached.block_ids, chain(root_hash(b"test"), tokens, 4)):
        allocator.cache_block(block_id, block_hash, block_tokens)
    allocator.free(cached)
    c = allocator.new_table()
    allocator.append(c, 1)
    return allocator, {"A": a, "B": b, "C": c}, hidden


def gids(fig, axes_index: int = 0) -> Counter:
    """How many patches of each role (the gid before the first colon) the axes holds."""
    return Counter(p.get_gid().split(":")[0] for p in fig.axes[axes_index].patches if p.get_gid())


# ---------------------------------------------------------------------------------------------------- text
def test_text_rendering_of_a_known_state_is_exact():
    allocator, tables, _ = known_state()
    assert render_pool_text(allocator, tables, columns=8) == "\n".join(
        [
            "12 blocks x 4 tokens: 4 used, 8 free (2 of them cached); blocks 0-7 shown",
            "     0 **#ooc..",
            "A [0, 1] 6 tokens",
            "B [0, 1] 6 tokens",
            "C [5] 1 token",
            "* [0, 1] shared by A B (refcount 2)",
        ]
    )


def test_text_rendering_names_hidden_used_blocks_and_unshown_sharers():
    allocator, tables, hidden = known_state()
    extra = allocator.fork(hidden)
    text = render_pool_text(allocator, {"hidden": hidden}, columns=4, max_blocks=4)
    assert text.splitlines() == [
        "12 blocks x 4 tokens: 4 used, 8 free (2 of them cached); blocks 0-3 shown",
        "     0 ***o",
        "A hidden [2] 4 tokens",
        "* [0, 1] shared by tables not shown (refcount 2)",
        "* [2] shared by A and 1 table(s) not shown (refcount 2)",
        "blocks 4-11 not shown (1 used)",
    ]
    allocator.free(extra)


def test_text_rendering_follows_the_allocator_after_copy_on_write():
    allocator, tables, _ = known_state()
    before = render_pool_text(allocator, tables, columns=8)
    allocator.append(tables["B"], 1)  # B writes into shared block 1: copy-on-write into block 6
    after = render_pool_text(allocator, tables, columns=8)
    assert before != after
    assert after.splitlines()[1] == "     0 *a#oocb."
    assert "* [0] shared by A B (refcount 2)" in after


def test_text_rendering_of_a_paged_cache_after_beam_search(llama):
    input_ids = torch.randint(3, 128, (1, 13), generator=torch.Generator().manual_seed(0))
    out = llama.generate(
        input_ids,
        num_beams=3,
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
        cache_implementation="paged",
        cache_config={"block_size": 4, "num_blocks": 48},
        return_dict_in_generate=True,
    )
    cache = out.past_key_values
    try:
        snapshot = pool_snapshot(cache)
        assert snapshot.labels == ("row 0", "row 1", "row 2")
        assert snapshot.tables == tuple(tuple(t.block_ids) for t in cache.row_tables)
        text = render_pool_text(cache, columns=48)
        grid = text.splitlines()[1].split()[1]
        distinct = {b for t in cache.row_tables for b in t.block_ids}
        assert sum(grid.count(ch) for ch in "*ABCabc") == len(distinct) == cache.stats().num_blocks
        shared = [b for b in distinct if hf_paged.get_pool(llama).allocator.ref_count(b) > 1]
        assert grid.count("*") == len(shared) >= 3  # the prompt's three full blocks are shared by every beam
    finally:
        cache.release()


def test_text_rendering_refuses_bad_input():
    allocator, tables, hidden = known_state()
    with pytest.raises(ValueError, match="columns must be a positive int, got 0"):
        render_pool_text(allocator, tables, columns=0)
    many = [allocator.fork(hidden) for _ in range(27)]
    with pytest.raises(ValueError, match="at most 26 sequences, got 27"):
        render_pool_text(allocator, many)
    for table in many:
        allocator.free(table)
    allocator.free(hidden)
    with pytest.raises(ValueError, match="'hidden'.*was freed"):
        pool_snapshot(allocator, {"hidden": hidden})
    other = BlockAllocator(num_blocks=12, block_size=4)
    with pytest.raises(ValueError, match="names block 0, which this allocator of 12 blocks does not hold in use"):
        pool_snapshot(other, tables)
    with pytest.raises(TypeError, match="expected a BlockAllocator, BlockPool or PagedCache, got list"):
        pool_snapshot([1, 2])


def test_snapshot_of_a_pool_and_of_an_allocator_agree():
    pool = BlockPool(num_blocks=8, block_size=4)
    table = pool.allocator.new_table()
    pool.allocator.append(table, 5)
    assert pool_snapshot(pool, [table]) == pool_snapshot(pool.allocator, [table])
    assert render_pool_text(pool, [table], columns=4).splitlines()[1:] == ["     0 Aa..", "A seq 0 [0, 1] 5 tokens"]
    pool.allocator.free(table)


# ---------------------------------------------------------------------------------------------------- figures
def test_pool_figure_draws_each_block_in_its_role():
    allocator, tables, _ = known_state()
    fig = plot_pool(allocator, tables, columns=6, max_blocks=12)
    assert gids(fig) == Counter({"block": 3, "fill": 5, "shared": 2, "evictable": 2, "other": 1, "free": 6})
    ax = fig.axes[0]
    refcounts = {t.get_gid(): t.get_text() for t in ax.texts if (t.get_gid() or "").startswith("refcount")}
    assert refcounts == {"refcount:0": "×2", "refcount:1": "×2"}
    fills = {p.get_gid(): p.get_height() for p in ax.patches if (p.get_gid() or "").startswith("fill")}
    assert fills == pytest.approx(
        {"fill:0:0": 0.9, "fill:0:1": 0.9, "fill:1:0": 0.45, "fill:1:1": 0.45, "fill:5:2": 0.225}
    )
    stripes = {p.get_gid(): p.get_width() for p in ax.patches if (p.get_gid() or "").startswith("fill:0")}
    assert stripes == pytest.approx({"fill:0:0": 0.45, "fill:0:1": 0.45})  # one stripe per owner
    legend = [text.get_text() for text in ax.get_legend().get_texts()]
    assert legend == ["A", "B", "C", "shared (×refcount)", "cached, evictable", "other tables", "free"]


def test_pool_figure_changes_with_the_state_negative_control():
    allocator, tables, _ = known_state()
    before = gids(plot_pool(allocator, tables, max_blocks=12))
    allocator.append(tables["B"], 1)  # copy-on-write: block 1 is no longer shared, B owns block 6
    after = gids(plot_pool(allocator, tables, max_blocks=12))
    assert before != after
    assert (after["shared"], after["block"], after["free"]) == (1, 4, 5)


def test_pool_figure_default_window_and_tables_panel():
    allocator, tables, _ = known_state()
    fig = plot_pool(allocator, tables, columns=4, show_tables=True)
    counts = gids(fig)
    assert counts["block"] + counts["evictable"] + counts["other"] + counts["free"] == 8  # up to the last used row
    assert gids(fig, 1) == Counter({"table": 5})  # A: 2 logical blocks, B: 2, C: 1
    ids = [t.get_text() for t in fig.axes[1].texts if t.get_text().isdigit()]
    assert ids == ["0", "1", "0", "1", "5"]


def drawn_outside(fig) -> list[str]:
    """What `fig.savefig` would cut: every text, legend and patch whose extent leaves the saved figure."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if not isinstance(fig.canvas, FigureCanvasAgg):
        FigureCanvasAgg(fig)
    fig.savefig(io.BytesIO(), format="png")  # a plain savefig, as the README shows (no bbox_inches)
    renderer, frame = fig.canvas.get_renderer(), fig.bbox
    artists = [fig._suptitle] if fig._suptitle is not None else []
    artists += fig.legends
    for ax in fig.axes:
        artists += [ax.title, *ax.texts, *ax.patches] + ([ax.get_legend()] if ax.get_legend() else [])
    outside = []
    for artist in artists:
        box = artist.get_window_extent(renderer)
        if box.width and not (
            box.x0 >= frame.x0 - 1 and box.x1 <= frame.x1 + 1 and box.y0 >= frame.y0 - 1 and box.y1 <= frame.y1 + 1
        ):
            outside.append(artist.get_text() if hasattr(artist, "get_text") else type(artist).__name__)
    return outside


def test_pool_figure_title_counts_cached_blocks_as_the_text_does():
    allocator, tables, _ = known_state()
    title = plot_pool(allocator, tables, max_blocks=12).axes[0].get_title()
    assert title == render_pool_text(allocator, tables, max_blocks=12).splitlines()[0]
    assert "(2 of them cached)" in title


@pytest.mark.parametrize("show_tables", [False, True], ids=["grid", "grid-and-tables"])
def test_a_plain_savefig_shows_the_whole_pool_figure(show_tables):
    """A narrow grid (two blocks shown) under a long title, long labels and the whole legend: nothing is cut."""
    allocator = BlockAllocator(num_blocks=65_536, block_size=16)
    tables = {}
    for name in ["a sequence with a long label", "another one"]:
        tables[name] = allocator.new_table()
        allocator.append(tables[name], 4000)
    cached = allocator.new_table()
    allocator.append(cached, 16)
    ((block_hash, block_tokens),) = chain(root_hash(b"test"), list(range(16)), 16)
    allocator.cache_block(cached.block_ids[0], block_hash, block_tokens)
    allocator.free(cached)
    fig = plot_pool(allocator, tables, columns=4, max_blocks=4, show_tables=show_tables)
    assert drawn_outside(fig) == []
    assert "(1 of them cached)" in fig.axes[0].get_title()


def test_a_plain_savefig_shows_the_whole_fragmentation_figure():
    fig = plot_fragmentation([1, 3], reserve=3, block_size=1, title="naive reservation next to paging, " * 3)
    assert drawn_outside(fig) == []


def test_pool_figure_of_a_paged_cache_matches_its_stats(llama):
    input_ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    out = llama.generate(
        input_ids,
        num_return_sequences=2,
        do_sample=True,
        max_new_tokens=5,
        pad_token_id=0,
        cache_implementation="paged",
        cache_config={"block_size": 4, "num_blocks": 48},
        return_dict_in_generate=True,
    )
    cache = out.past_key_values
    try:
        counts = gids(plot_pool(cache))
        allocator = cache.pool.allocator
        distinct = {b for t in cache.row_tables for b in t.block_ids}
        assert counts["block"] == cache.stats().num_blocks == len(distinct)
        assert counts["shared"] == sum(1 for b in distinct if allocator.ref_count(b) > 1) >= 4
        assert counts["fill"] == sum(len(t.block_ids) for t in cache.row_tables)
    finally:
        cache.release()


def test_fragmentation_figure_reproduces_seed_004():
    fig = plot_fragmentation([1, 4, 2], reserve=4, block_size=2)
    naive, paged = gids(fig, 0), gids(fig, 1)
    assert naive == Counter({"naive-used": 7, "naive-wasted": 5})
    assert paged == Counter({"paged-used": 7, "paged-wasted": 1, "paged-free": 4})
    titles = [ax.get_title().splitlines()[1] for ax in fig.axes[:2]]
    assert titles == ["wasted 5 of 12 slots: fragmentation 0.417", "wasted 1 of 8 slots: fragmentation 0.125"]


def test_fragmentation_figure_with_a_larger_cache_and_bad_input():
    fig = plot_fragmentation([5, 3], reserve=8, block_size=4, capacity=24)
    assert gids(fig, 1) == Counter({"paged-used": 8, "paged-wasted": 4, "paged-free": 12})
    with pytest.raises(ValueError, match="positive ints, got \\[1, 0\\]"):
        plot_fragmentation([1, 0])
    with pytest.raises(ValueError, match="capacity \\(7 slots\\) must be a multiple of block_size \\(2\\)"):
        plot_fragmentation([1, 2], capacity=7)
    with pytest.raises(ValueError, match="exceeds the reservation of 2 slots"):
        plot_fragmentation([1, 3], reserve=2)
    with pytest.raises(ValueError, match="20000 slots is over the limit of 10000"):
        plot_fragmentation([10_000, 1])


# ---------------------------------------------------------------------------------------------------- optional extra
def test_import_hf_paged_does_not_need_matplotlib():
    script = """
import sys
class NoMatplotlib:
    def find_spec(self, name, path=None, target=None):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("no matplotlib here")
sys.meta_path.insert(0, NoMatplotlib())
import hf_paged, hf_paged.visual
from hf_paged.visual import plot_pool, render_pool_text
allocator = hf_paged.BlockAllocator(4, 2)
print(render_pool_text(allocator).splitlines()[1])
try:
    plot_pool(allocator)
except ImportError as error:
    print(error)
print("matplotlib" in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "     0 ...."
    assert 'pip install "hf_paged[viz]"' in lines[1]
    assert lines[2] == "False"
