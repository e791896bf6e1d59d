"""Tests for the pictures of vllmini.course: the static page-table figure and the interactive explorer
(driven by clicking its buttons programmatically), and the notebooks' other figures. A picture must only
read what it draws."""

import html
import os
import re

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import FancyArrowPatch  # noqa: E402

from vllmini import BlockAllocator, BlockManager, BlockTable  # noqa: E402
from vllmini.course.explorer import PageTableExplorer  # noqa: E402
from vllmini.course.explorer_picture import page_of  # noqa: E402
from vllmini.course.page_table import draw_page_table  # noqa: E402
from vllmini.course.page_table_layout import page_table_layout  # noqa: E402
from vllmini.course.style import CACHED_EDGE, seq_color  # noqa: E402
from vllmini.errors import InvalidArgumentError, InvalidIndexError, InvalidTypeError, VllminiError  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def full_state(m: BlockManager):
    """Every observable bit of a manager, including copy-on-write jobs and the free-list order."""
    a = m.allocator
    tables = {
        s: (m.block_table(s).block_ids, m.seq_len(s), list(m.block_table(s).pending_copies))
        for s in m.seq_ids
    }
    return m.seq_ids, tables, a.free_block_ids, [a.ref_count(b) for b in range(a.num_blocks)]


def busy_manager() -> BlockManager:
    m = BlockManager(16, 4)
    m.allocate(0, 7)  # blocks 0, 1
    m.allocate(1, 3)  # block 2
    m.allocate(2, 9)  # blocks 3, 4, 5
    m.free(1)  # block 2 back on the free list
    m.allocate(3, 5)  # blocks 2, 6
    m.fork(3, 4)  # 4 shares 2 and 6
    m.append(4, 1)  # copy-on-write of block 6 -> pending copy
    return m


def patches_by_gid(fig: Figure) -> dict:
    (ax,) = fig.axes
    return {p.get_gid(): p for p in ax.patches if p.get_gid()}


def texts(fig: Figure) -> list[str]:
    return [t.get_text() for t in fig.axes[0].texts] + [fig.axes[0].get_title()]


# ---- draw_page_table


def test_figure_has_every_block_and_arrow():
    m = busy_manager()
    fig = draw_page_table(m)
    assert isinstance(fig, Figure) and len(fig.axes) == 1
    gids = patches_by_gid(fig)
    for s in m.seq_ids:
        ids = m.block_table(s).block_ids
        for i, b in enumerate(ids):
            assert f"logical:{s}:{i}" in gids
            assert f"arrow:{s}:{i}->{b}" in gids  # the arrow points at the right physical block
    for b in range(16):
        assert f"physical:{b}" in gids
    arrows = [
        p for p in fig.axes[0].patches if isinstance(p, FancyArrowPatch) and p.get_gid().startswith("arrow:")
    ]
    assert len(arrows) == sum(m.block_table(s).num_blocks for s in m.seq_ids)
    labels = texts(fig)
    for s in m.seq_ids:
        assert f"seq {s}\n{m.seq_len(s)} tok" in labels
    assert "2 shared ×2" in labels  # seq 3 and 4 share block 2
    assert sum("free" in t for t in labels) >= m.num_free_blocks
    assert any(t.endswith("free (next)") and t.startswith(str(m.allocator.free_block_ids[0])) for t in labels)
    assert any(t.startswith("free list (next first): [") for t in labels)
    used = 16 - m.num_free_blocks
    assert fig.axes[0].get_title().startswith(f"4 sequences, block_size 4: {used}/16 blocks used")


def test_one_colour_per_sequence_in_both_views():
    m = busy_manager()
    gids = patches_by_gid(draw_page_table(m))
    for s in m.seq_ids:
        c = seq_color(s)
        ids = m.block_table(s).block_ids
        for i, b in enumerate(ids):
            assert to_hex(gids[f"logical:{s}:{i}"].get_edgecolor()) == c
            assert to_hex(gids[f"arrow:{s}:{i}->{b}"].get_edgecolor()) == c
    assert to_hex(gids["physical:0"].get_edgecolor()) == seq_color(0)  # owned by seq 0 alone
    assert to_hex(gids["physical:2"].get_edgecolor()) == "#000000"  # shared: black frame
    assert gids["physical:15"].get_linestyle() == "--"  # free: dashed


def test_partially_filled_blocks_show_their_tokens():
    m = BlockManager(4, 4)
    m.allocate("x", 6)
    fig = draw_page_table(m)
    labels = texts(fig)
    # token indices 0..5 on the left, their slots 0..7 (all of blocks 0, 1) on the right
    for tok in range(6):
        assert labels.count(str(tok)) >= 2
    assert "6 tok" in labels[labels.index("seq x\n6 tok")]
    ax = fig.axes[0]
    white = [p for p in ax.patches if p.get_facecolor()[:3] == (1.0, 1.0, 1.0) and p.get_fill()]
    assert sorted(p.get_width() for p in white) == [2, 2]  # two empty slots in L1, the same two in block 1


def test_accepts_tables_dict_single_table_and_empty_manager():
    a = BlockAllocator(6)
    t1, t2 = BlockTable(a, 2), BlockTable(a, 2)
    t1.append_tokens(3)
    t2.append_tokens(1)
    gids = patches_by_gid(draw_page_table({"a": t1, "b": t2}, a))
    assert {"logical:a:1", "logical:b:0", "arrow:b:0->2"} <= set(gids)
    gids = patches_by_gid(draw_page_table({"a": t1, "b": t2}))  # allocator taken from the tables
    assert "physical:5" in gids
    gids = patches_by_gid(draw_page_table(t1))
    assert "arrow:0:1->1" in gids
    gids = patches_by_gid(draw_page_table(BlockManager(3, 4)))
    assert set(gids) == {"physical:0", "physical:1", "physical:2"}
    gids = patches_by_gid(draw_page_table({}, a))
    assert len(gids) == 6


def test_draws_a_page_table_of_your_own():
    """Notebook 03 draws the tables it builds itself: anything with block_ids, num_tokens, block_size and
    allocator (and, optionally, pending_copies) is drawn like a BlockTable."""

    class MyTable:
        def __init__(self, allocator, ids, n):
            self.allocator, self.block_size, self.block_ids, self.num_tokens = allocator, 4, ids, n
            self.pending_copies = [(1, 2)] if n == 7 else []

    a = BlockAllocator(4)
    ids = [a.allocate(), a.allocate(), a.allocate()]
    a.incref(ids[0])
    fig = draw_page_table({"p": MyTable(a, ids[:2], 6), "c": MyTable(a, [ids[0], ids[2]], 7)}, a)
    gids = patches_by_gid(fig)
    assert {"arrow:p:1->1", "arrow:c:1->2", "copy:1->2"} <= set(gids)
    assert "0 shared ×2" in texts(fig)
    assert fig.axes[0].get_title().startswith("2 sequences, block_size 4: 3/4 blocks used, 9/12")


def test_seq_ids_picks_which_sequences_to_draw():
    m = busy_manager()
    gids = patches_by_gid(draw_page_table(m, seq_ids=[2]))
    assert not any(g.startswith(("logical:0", "logical:3")) for g in gids)
    assert "logical:2:2" in gids


def test_bad_inputs_raise():
    a, b = BlockAllocator(2), BlockAllocator(2)
    with pytest.raises(InvalidTypeError, match="BlockManager"):
        draw_page_table([1, 2])
    with pytest.raises(InvalidTypeError, match="BlockTable"):
        draw_page_table({0: "table"}, a)
    with pytest.raises(InvalidArgumentError, match="allocator="):
        draw_page_table({})
    with pytest.raises(InvalidTypeError, match="allocator must be a BlockAllocator"):
        draw_page_table({}, "pool")
    with pytest.raises(InvalidArgumentError, match="allocator"):
        draw_page_table({0: BlockTable(a, 2)}, b)
    with pytest.raises(InvalidArgumentError, match="block_size"):
        draw_page_table({0: BlockTable(a, 2), 1: BlockTable(a, 4)})
    with pytest.raises(InvalidArgumentError, match=r"seq_ids \[9\]"):
        draw_page_table(BlockManager(2, 2), seq_ids=[9])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_pool_rows": 0}, "max_pool_rows must be >= 1, got 0"),  # was a ZeroDivisionError
        ({"max_pool_rows": 2.5}, "max_pool_rows must be an int, got float 2.5"),
        ({"max_blocks": 0}, "max_blocks must be >= 1, got 0"),
        ({"max_seq_blocks": 2}, "max_seq_blocks must be >= 3, got 2"),
        ({"max_seqs": True}, "max_seqs must be an int, got bool True"),
    ],
)
def test_bad_limits_raise_clear_errors(kwargs, message):
    m = busy_manager()
    before = full_state(m)
    with pytest.raises(VllminiError, match=re.escape(message)):
        draw_page_table(m, **kwargs)
    assert full_state(m) == before


def test_token_text_labels_each_logical_slot_with_its_token():
    m = BlockManager(8, 4)
    m.allocate("x", 3)
    m.allocate("p", 5)  # blocks 1, 2: slots 4..8
    words = ["The", " capital", " of", " France", " is"]
    layout = page_table_layout(m, token_text={"p": words})
    cells = {box.gid: box.numbers for box in layout.boxes}
    assert cells["logical:p:0"] == ("The", "capital", "of", "France")  # surrounding spaces dropped
    assert cells["logical:p:1"] == ("is", "", "", "")
    assert cells["logical:x:0"] == (0, 1, 2, "")  # other sequences keep their token indices
    assert cells["physical:1"] == (4, 5, 6, 7)  # the pool still shows slots
    assert {"The", "capital", "France", "is"} <= set(texts(draw_page_table(m, token_text={"p": words})))
    long = page_table_layout(m, token_text={"p": ["internationalization", " ", "a", "b", "c"]})
    assert {b.gid: b.numbers for b in long.boxes}["logical:p:0"] == (
        "intern…",
        "␣",
        "a",
        "b",
    )  # 7 characters at most


@pytest.mark.parametrize(
    ("token_text", "message"),
    [
        ({"q": ["a"]}, "token_text names seq 'q', which is not drawn"),
        ({"p": ["a", "b"]}, "seq 'p' has 5 tokens, got ['a', 'b']"),
        ({"p": [1, 2, 3, 4, 5]}, "must hold one str per token"),
        (["a"], "token_text must be a dict"),
    ],
)
def test_bad_token_text_raises_a_clear_error(token_text, message):
    m = BlockManager(8, 4)
    m.allocate("p", 5)
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        draw_page_table(m, token_text=token_text)


def test_draws_into_a_given_figure_or_axes():
    m = busy_manager()
    fig = Figure()
    assert draw_page_table(m, fig=fig) is fig
    first = len(fig.axes[0].patches)
    m.free(2)
    assert draw_page_table(m, fig=fig) is fig  # redraw: old artists gone, not stacked on top
    assert len(fig.axes) == 1 and len(fig.axes[0].patches) < first
    fig2, ax = plt.subplots(figsize=(6, 4))
    assert draw_page_table(m, ax=ax, title="mine") is fig2
    assert ax.get_title() == "mine"
    assert tuple(draw_page_table(m, figsize=(5, 3)).get_size_inches()) == (5, 3)


def test_large_pool_wraps_into_columns_without_numbers():
    m = BlockManager(40, 16)
    m.allocate(0, 20)
    fig = draw_page_table(m, max_pool_rows=16)
    gids = patches_by_gid(fig)
    assert len([g for g in gids if g.startswith("physical:")]) == 40
    xs = {round(gids[f"physical:{b}"].get_x(), 3) for b in range(40)}
    assert len(xs) == 3  # 40 blocks in columns of 16
    assert "100" not in texts(fig)  # block_size 16: cells too small for slot numbers
    m.allocate(1, 300)  # 19 more logical rows: the pool uses the height the figure has anyway
    gids = patches_by_gid(draw_page_table(m, max_pool_rows=16, max_seq_blocks=30))
    assert len({round(gids[f"physical:{b}"].get_x(), 3) for b in range(40)}) == 2


def test_pending_copies_are_drawn_and_highlight_marks_blocks():
    m = busy_manager()
    ((src, dst),) = m.block_table(4).pending_copies  # seq 4's copy-on-write of block 6
    gids = patches_by_gid(draw_page_table(m, highlight=[dst]))
    assert f"copy:{src}->{dst}" in gids  # the copy pair, drawn between the two pool blocks
    assert [g for g in gids if g.startswith("highlight:")] == [f"highlight:{dst}"]
    m.take_pending_copies()
    gids = patches_by_gid(draw_page_table(m))
    assert not any(g.startswith(("copy:", "highlight:")) for g in gids)


def test_big_pools_and_long_sequences_draw_only_what_fits():
    """1000 blocks of 16 used to draw ~48k artists (23 s); now at most max_blocks pool blocks."""
    m = BlockManager(1000, 16)
    m.allocate(0, 300)  # 19 blocks: first 6, a gap row, the last one
    m.allocate(1, 17)
    m.fork(0, 2)
    m.append(2, 3)  # copy-on-write of seq 0's last block
    fig = draw_page_table(m, max_blocks=40, max_seq_blocks=8)
    gids = patches_by_gid(fig)
    physical = [g for g in gids if g.startswith("physical:")]
    assert len(physical) == 40
    for s in m.seq_ids:  # the last logical block of every sequence is drawn, with its arrow
        ids = m.block_table(s).block_ids
        assert f"arrow:{s}:{len(ids) - 1}->{ids[-1]}" in gids and f"physical:{ids[-1]}" in gids
        assert f"physical:{m.allocator.free_block_ids[0]}" in gids  # the next free block too
    assert "logical:0:6" not in gids and "logical:0:18" in gids
    labels = texts(fig)
    assert labels.count("⋮ 12 more blocks") == 2  # seq 0 and its fork
    not_drawn = [t for t in labels if "not drawn" in t]
    assert (
        not_drawn
        and sum(int(re.search(r"\((\d+)", t).group(1)) for t in not_drawn if "blocks" in t)
        + sum(1 for t in not_drawn if t.startswith("⋮ block "))
        == 1000 - 40
    )
    assert len(fig.axes[0].get_children()) < 1500  # bounded, whatever the pool size


def test_many_sequences_are_summarized():
    m = BlockManager(64, 4)
    for s in range(64):
        m.allocate(s, 1)
    fig = draw_page_table(m, max_seqs=16)
    gids = patches_by_gid(fig)
    assert len([g for g in gids if g.startswith("logical:")]) == 16
    assert "+ 48 more sequences not drawn" in texts(fig)
    assert fig.axes[0].get_title().startswith("64 sequences, block_size 4: 64/64 blocks used")


def test_drawing_never_changes_what_it_draws():
    m = busy_manager()
    before = full_state(m)
    assert m.block_table(4).pending_copies  # a pending copy-on-write job must survive drawing
    draw_page_table(m)
    draw_page_table({s: m.block_table(s) for s in m.seq_ids}, m.allocator)
    draw_page_table(m, seq_ids=[4, 0])
    assert full_state(m) == before


# ---- sharing in the picture: reference counts, copy-on-write pairs, cached-but-free blocks


def shared_and_cached_manager() -> BlockManager:
    """Three samples of a 10-token prompt (one copied its partial block), and a finished request whose
    two full blocks stay in the prefix cache."""
    m = BlockManager(16, 4, enable_prefix_caching=True)
    m.allocate("a", 10)  # blocks 0, 1 full, 2 holds 2 tokens
    m.cache_full_blocks("a", list(range(100, 110)), [], 0, 10)  # 0 and 1 named by their hash
    m.fork("a", "b")
    m.fork("a", "c")
    m.append("b", 1)  # b writes into the shared partial block 2: copy 2 -> 3 pending
    m.allocate("d", 9)  # blocks 4, 5 full, 6 partial
    m.cache_full_blocks("d", list(range(200, 209)), [], 0, 9)
    m.free("d")  # 4 and 5 stay cached (reference count 0), 6 is plainly free
    return m


def test_layout_has_one_arrow_per_reference():
    m = shared_and_cached_manager()
    layout = page_table_layout(m)
    sequences = {b for s in m.seq_ids for b in m.block_table(s).block_ids}
    assert sequences == {0, 1, 2, 3}
    for b in range(m.num_blocks):
        box = layout.box(f"physical:{b}")
        holders = sum(b in m.block_table(s).block_ids for s in m.seq_ids)
        assert len(layout.arrows_to(b)) == box.ref_count == holders
        if b in sequences:  # no pins, no cache hold: the allocator's count is the arrows' count
            assert m.allocator.ref_count(b) == holders
    assert [len(layout.arrows_to(b)) for b in (0, 1, 2, 3)] == [3, 3, 2, 1]
    for arrow in layout.arrows_to(0):  # each arrow starts at its own sequence's logical block 0
        assert layout.box(f"logical:{arrow.src}:0").block_id == 0
        assert arrow.start[1] == pytest.approx(layout.box(f"logical:{arrow.src}:0").y + 0.4)
    kinds = {b: layout.box(f"physical:{b}").kind for b in range(7)}
    assert kinds == {0: "shared", 1: "shared", 2: "shared", 3: "used", 4: "cached", 5: "cached", 6: "free"}
    labels = [label.text for label in layout.labels]
    assert (
        "0 shared ×3 (cached)" in labels and "3 (copy of 2)" in labels and "2 shared ×2" in labels
    )  # reference counts, named blocks
    assert any(text.startswith("shared ×N") for text, _ in layout.legend)


def test_cached_free_blocks_are_drawn_apart_from_free_ones():
    m = shared_and_cached_manager()
    layout = page_table_layout(m)
    cached, free = layout.box("physical:4"), layout.box("physical:6")
    assert m.num_cached_free_blocks == 2 and m.prefix_cache.evictable.keys() == {4, 5}
    assert cached.kind == "cached" and cached.hatch and cached.frame == CACHED_EDGE
    assert free.kind == "free" and not free.hatch and free.linestyle == "--"
    assert (cached.stripes, cached.frame) != (free.stripes, free.frame)
    assert not layout.arrows_to(4) and cached.ref_count == 0
    labels = [label.text for label in layout.labels]
    assert "5 cached, free (evicted 1st)" in labels  # the tail is released first, so evicted first
    assert "cached but free (evicted first to last): [5, 4]" in labels
    legend = [text for text, _ in layout.legend]
    assert any(t.startswith("cached, free") for t in legend) and "free" in legend
    m.allocate("e", 4 * 12)  # needs every block: both cached ones are evicted
    layout = page_table_layout(m)
    assert not any(b.kind == "cached" for b in layout.boxes) and m.num_cached_free_blocks == 0
    assert not any(t.startswith("cached, free") for t, _ in layout.legend)
    gids = patches_by_gid(draw_page_table(shared_and_cached_manager()))
    assert gids["physical:4"].get_hatch() and not gids["physical:6"].get_hatch()


def test_copy_arcs_start_and_end_past_the_labels_they_pass():
    """A copy-on-write arc runs from just past its source's label to just past its copy's, and clear of
    every label between them: measured on the drawn text, not on the layout's own width guess."""
    m = BlockManager(40, 4)
    m.allocate("a", 10)  # blocks 0-2
    m.allocate("c", 30)  # blocks 3-10, between a's last block and its copy
    m.fork("c", "d")  # ... each labelled "N shared ×2", longer than a's "2"
    m.fork("a", "b")
    m.append("b", 1)  # b writes into the shared, partly filled block 2: copy 2 -> 11
    layout = page_table_layout(m)
    (arc,) = [a for a in layout.arrows if a.kind == "copy"]
    src, dst = layout.box(f"physical:{arc.src}"), layout.box(f"physical:{arc.dst}")
    assert src.x == dst.x and dst.y - src.y > 2  # one column, rows apart
    fig = draw_page_table(m)
    fig.canvas.draw()
    ax = fig.axes[0]
    renderer, to_data = fig.canvas.get_renderer(), ax.transData.inverted()
    label_x = src.x + src.width + 0.25

    def right_edge(row: float) -> float:
        (text,) = [t for t in ax.texts if t.get_position() == pytest.approx((label_x, row + 0.4))]
        return to_data.transform(text.get_window_extent(renderer).corners()[-1])[0]

    passed = max(right_edge(row) for row in range(int(src.y), int(dst.y)))
    assert 0 < arc.start[0] - passed < 1.0  # just past the longest label it passes (once: 1.7 away)
    assert 0 < arc.end[0] - right_edge(dst.y) < 1.0  # and ends just past its copy's
    assert arc.start[0] - right_edge(src.y) > 1.0  # it had to step past the longer labels in between
    plt.close(fig)


def test_copy_pairs_are_drawn_pending_or_given():
    m = shared_and_cached_manager()
    layout = page_table_layout(m)
    copies = [a for a in layout.arrows if a.kind == "copy"]
    assert [(a.src, a.dst, a.gid) for a in copies] == [(2, 3, "copy:2->3")]
    (src_box, dst_box) = layout.box("physical:2"), layout.box("physical:3")
    assert copies[0].start[1] == pytest.approx(src_box.y + 0.4) and copies[0].end[1] == pytest.approx(
        dst_box.y + 0.4
    )
    assert m.take_pending_copies() == [(2, 3)]
    assert not [a for a in page_table_layout(m).arrows if a.kind == "copy"]  # taken: not pending any more
    layout = page_table_layout(m, copies=[(2, 3)], highlight=[3])  # a step's copies, as the explorer draws
    assert [(a.src, a.dst) for a in layout.arrows if a.kind == "copy"] == [(2, 3)]
    assert [g[0] for g in layout.glows] == [3]
    assert {"copy-on-write: source → copy", "just copied"} <= {t for t, _ in layout.legend}
    gids = patches_by_gid(draw_page_table(m, copies=[(2, 3)]))
    assert "copy:2->3" in gids
    with pytest.raises(InvalidIndexError, match=r"copies\[0\] block must be in \[0, 16\), got 16"):
        page_table_layout(m, copies=[(2, 16)])
    with pytest.raises(InvalidArgumentError, match=r"copies\[0\] must be a pair"):
        page_table_layout(m, copies=[3])


def test_a_pinned_copy_source_is_drawn_as_such():
    m = BlockManager(8, 4)
    m.allocate("a", 6)
    m.fork("a", "b")
    m.append("b", 1)  # copy 1 -> 2 pending
    m.free("a")  # block 1 has no owner left, but b still has to copy from it: pinned
    layout = page_table_layout(m)
    assert layout.box("physical:1").kind == "pinned" and not layout.arrows_to(1)
    assert "1 copy source" in [label.text for label in layout.labels]
    m.take_pending_copies()
    assert page_table_layout(m).box("physical:1").kind == "free"


def test_a_plain_picture_has_no_legend():
    m = BlockManager(8, 4)
    m.allocate(0, 5)
    assert page_table_layout(m).legend == []


# ---- the explorer


def svg_gids(e) -> set[str]:
    """The data-gid of every mark in the explorer's picture."""
    return set(re.findall(r"data-gid='([^']+)'", e.view.picture))


def svg_texts(svg: str) -> list[str]:
    import html

    return [html.unescape(t) for t in re.findall(r"<text[^>]*>([^<]*)</text>", svg)]


def test_explorer_starts_empty_and_displays():
    e = PageTableExplorer(num_blocks=8, block_size=4)
    assert e.manager.num_blocks == 8 and e.manager.seq_ids == []
    assert e.view.picture.startswith("<svg") and "physical:7" in svg_gids(e)
    assert "8 of 8 blocks free, next first: [0, 1, 2, 3, 4, 5, 6, 7]" in e.view.status
    assert e.view.state["labels"]["add"] == "add a sequence of 5 tokens"
    assert e.view.state["disabled"] == {"append": True, "fork": True, "free": True, "step": True}
    assert e.view.state["prefixes"] == [["new tokens", "new"]] and e.inputs["samples"] == "2"


def test_explorer_picture_keeps_its_size_and_readable_text():
    """One size per pool, whatever happens in it; no text under 11 px."""
    e = PageTableExplorer(num_blocks=16, block_size=4)
    size = re.search(r"width='(\d+)' height='(\d+)'", e.view.picture).groups()
    for tokens in (9, 30, 2, 5):
        e.click("add", tokens=tokens)
    e.click("fork", samples=8)
    e.click("step")
    assert re.search(r"width='(\d+)' height='(\d+)'", e.view.picture).groups() == size
    sizes = {float(s) for s in re.findall(r"font-size='([\d.]+)'", e.view.picture)}
    assert sizes and min(sizes) >= 11
    big = PageTableExplorer(num_blocks=1000, block_size=16)
    width = int(re.search(r"width='(\d+)'", big.view.picture).group(1))
    assert width < 1000  # fits beside the controls in a 1280-pixel window without shrinking


def test_explorer_buttons_say_what_they_do():
    e = PageTableExplorer(num_blocks=8, block_size=4)
    e.set_inputs(tokens=1)
    assert e.labels()["add"] == "add a sequence of 1 token"
    e.click("add")
    e.set_inputs(tokens=3)
    labels = e.view.state["labels"]
    assert labels["append"] == "append 3 tokens to seq 0"
    assert (labels["fork"], labels["free"]) == ("fork seq 0 → seq 1", "free seq 0")
    assert e.view.state["seqs"] == [["seq 0 · 1 token", "0"]]  # the dropdown says what each holds
    e.click("fork")
    assert e.inputs["seq"] == "1" and e.view.state["choose"]["seq"] == "1"  # the browser selects it
    assert e.labels()["append"] == "append 3 tokens to seq 1"
    assert "forked seq 0 into seq 1 (now selected)" in e.view.status


def test_explorer_buttons_change_state_and_picture():
    e = PageTableExplorer(num_blocks=8, block_size=4)
    svg = e.view.picture
    e.click("add", tokens=6)
    assert e.manager.seq_ids == [0] and e.manager.seq_len(0) == 6 and e.inputs["seq"] == "0"
    assert e.view.picture != svg and "logical:0:1" in svg_gids(e)
    assert "added seq 0 with 6 tokens" in e.view.status and e.last_error is None
    e.click("append", tokens=3)
    assert e.manager.seq_len(0) == 9 and e.manager.block_table(0).block_ids == [0, 1, 2]
    e.click("fork")
    assert e.manager.seq_ids == [0, 1] and e.inputs["seq"] == "1" and e.manager.allocator.ref_count(0) == 2
    e.click("append", tokens=1)  # seq 1's last block is shared and partly full: copy-on-write
    assert e.manager.block_table(1).block_ids == [0, 1, 3]
    assert "appended 1 token to seq 1" in e.status_text() and "copy-on-write: block 2 → 3" in e.status_text()
    assert e.last_copies == [(2, 3)] and e.manager.take_pending_copies() == []
    assert {"highlight:3", "copy:2->3"} <= svg_gids(e)  # the copy is highlighted once ...
    e.click("free", seq=0)
    assert e.manager.seq_ids == [1] and e.inputs["seq"] == "1"
    assert not any(g.startswith("highlight:") for g in svg_gids(e))  # ... and only once
    assert e.history[0] == "added seq 0 with 6 tokens → slots [0, 1, 2, 3, 4, 5]" and len(e.history) == 5
    e.click("reset")
    assert e.manager.seq_ids == [] and e.manager.num_free_blocks == 8 and e.history == []
    assert e.inputs["seq"] == "" and "reset" in e.view.status and e.applied == 6


def test_explorer_each_click_is_one_message_with_its_numbers():
    """A burst of messages, as the browser sends them (each with the boxes' text at its click): every
    one is applied once, in order, with its own numbers."""
    e = PageTableExplorer(num_blocks=16, block_size=4)
    for n in (3, 7, 2, 5):
        e._on_msg(e.view, {"action": "add", "tokens": str(n), "seq": "", "samples": "2", "prefix": "new"}, [])
    assert [e.manager.seq_len(s) for s in e.manager.seq_ids] == [3, 7, 2, 5]
    for _ in range(5):
        e._on_msg(e.view, {"action": "step", "tokens": "2", "seq": "0", "samples": "2", "prefix": "new"}, [])
    assert [e.manager.seq_len(s) for s in e.manager.seq_ids] == [8, 12, 7, 10] and e.applied == 9
    assert e.view.state["applied"] == 9  # the browser sees how many clicks were applied
    with pytest.raises(InvalidArgumentError, match="name must be one of"):
        e.click("undo")


@pytest.mark.parametrize("text", ["", "2.5", "1e3", "-5", "0", "abc", "65", " ", "3x"])
def test_explorer_refuses_a_bad_number_beside_its_box(text):
    e = PageTableExplorer(num_blocks=16, block_size=4)
    e.click("add", tokens=4)
    before, svg = full_state(e.manager), e.view.picture
    e.click("append", tokens=text)
    assert full_state(e.manager) == before and e.view.picture == svg
    message = f"tokens takes a whole number from 1 to 64, got {text!r}"
    assert e.errors == {"tokens": message} and e.view.state["errors"]["tokens"] == message
    assert e.last_error == f"append refused: {message}"
    e.click("append", tokens=" 12 ")  # digits, spaces around: fine; the message goes away
    assert e.manager.seq_len(0) == 16 and e.errors == {} and e.view.state["errors"] == {}


def test_explorer_caps_fork_samples():
    e = PageTableExplorer(num_blocks=16, block_size=4)
    e.click("add", tokens=5)
    e.click("fork", samples=9)
    assert e.errors["samples"] == "samples takes a whole number from 2 to 8, got '9'"
    assert e.manager.seq_ids == [0]
    e.set_inputs(samples=1)  # typing is checked at once, before any click
    assert (
        e.view.state["errors"]["samples"].endswith("got '1'")
        and e.labels()["fork"] == "fork seq 0 → ? samples"
    )
    e.click("fork", samples=8)
    assert len(e.manager.seq_ids) == 8


def test_explorer_colours_stay_distinct_for_live_sequences():
    e = PageTableExplorer(num_blocks=64, block_size=4)
    for _ in range(4):
        e.add_sequence(2)
    e.fork(0, 8)
    e.fork(1, 8)  # 18 live sequences
    assert len(set(e.colors.values())) == len(e.manager.seq_ids) == 18
    keep = dict(e.colors)
    e.free(2)
    e.add_sequence(1)  # the new one takes the freed colour; the others keep theirs
    assert e.colors[18] == keep[2] and all(e.colors[s] == keep[s] for s in e.manager.seq_ids if s != 18)


def test_explorer_status_errors_and_legend_share_words():
    e = PageTableExplorer(num_blocks=6, block_size=2, watermark_blocks=1)
    e.add_sequence(4)
    e.free(0)  # 2 full blocks: cached but free
    assert "6 of 6 blocks free (2 of them cached but free; 1 reserved by the watermark)" in e.status_text()
    assert any(t.startswith("cached but free:") for t in svg_texts(e.view.picture))  # the legend's entry
    assert "0 cached but free" in svg_texts(e.view.picture)  # the block's label
    e.add_sequence(12)  # 6 blocks, 1 must stay free
    assert e.last_error == (
        "OutOfBlocksError: seq 1 with 12 tokens needs 6 new blocks, but 6 of 6 blocks free "
        "(2 of them cached but free; 1 reserved by the watermark)"
    )
    e.add_sequence(3)
    e.fork(0 if 0 in e.manager else 1, 2)
    e.add_sequence(4)
    e.step()
    assert not re.search(r"\b1 (blocks|tokens)\b", f"{e.last_error} {e.status_text()} {e.history}")


def test_explorer_step_error_counts_the_whole_step():
    e = PageTableExplorer(num_blocks=4, block_size=2)
    e.add_sequence(4)  # blocks 0, 1, full
    e.fork(0, 3)  # 3 sequences share both; a step needs 3 new blocks, 2 are free
    before = full_state(e.manager)
    e.step()
    assert e.last_error == (
        "OutOfBlocksError: step needs 3 new blocks (one for each sequence whose last block is full, or "
        "shared and partly full), but 2 of 4 blocks free"
    )
    assert full_state(e.manager) == before


def test_explorer_explains_prefix_misses_and_partial_hits():
    e = PageTableExplorer(num_blocks=16, block_size=4)
    e.add_sequence(12)  # blocks 0, 1, 2, all full and cached
    e.add_sequence(4, prefix_of=0)
    assert "no prefix-cache hit: the prompt's only full block holds its last token" in e.history[-1]
    e.add_sequence(8, prefix_of=0)
    assert "prefix cache hit: shares 1 block [0]; block 1 holds the prompt's last token" in e.history[-1]
    e.add_sequence(3, prefix_of=0)
    assert "no prefix-cache hit: seq 0's first 3 tokens fill no whole block" in e.history[-1]
    e.add_sequence(9, prefix_of=0)
    assert e.history[-1].split(" → ")[0].endswith("prefix cache hit: shares 2 blocks [0, 1]")


def test_explorer_status_and_picture_change_together():
    """The status line is set after the new picture, never before it."""
    e = PageTableExplorer(num_blocks=8, block_size=4)
    order = []
    e.view.observe(lambda _: order.append("picture"), "picture")
    e.view.observe(lambda _: order.append("status"), "status")
    e.add_sequence(3)
    assert order == ["picture", "status"]


def test_explorer_draws_in_the_background_in_a_kernel():
    """In a kernel a click only changes state and wakes a drawing thread; wait() returns when picture and
    status show the new state, together."""
    e = PageTableExplorer(num_blocks=8, block_size=4, background=True)
    assert e.wait(60)
    svg = e.view.picture
    for n in (3, 2, 5):
        e.click("add", tokens=n)
    assert [e.manager.seq_len(s) for s in e.manager.seq_ids] == [3, 2, 5]
    assert e.wait(60)
    assert e.view.picture != svg and "added seq 2 with 5 tokens" in e.view.status
    assert "4 of 8 blocks free" in e.view.status and {"logical:2:1", "arrow:2:1->3"} <= svg_gids(e)
    e.add_sequence(100)
    svg = e.view.picture
    assert e.wait(60) and "error: OutOfBlocksError" in e.view.status and e.view.picture == svg


def test_explorer_out_of_blocks_shows_error_and_changes_nothing():
    e = PageTableExplorer(num_blocks=4, block_size=4)
    e.click("add", tokens=10)
    before, svg = full_state(e.manager), e.view.picture
    e.click("add", tokens=16)  # needs 4 blocks, 1 left
    assert e.last_error == "OutOfBlocksError: seq 1 with 16 tokens needs 4 new blocks, but 1 of 4 blocks free"
    assert "error: OutOfBlocksError" in e.view.status and full_state(e.manager) == before
    assert e.view.picture == svg
    e.click("append")  # 10 + 16 tokens: also too many
    assert e.last_error == (
        "OutOfBlocksError: appending 16 tokens to seq 0 needs 4 new blocks, but 1 of 4 blocks free"
    )
    e.click("append", tokens=2)
    assert e.last_error is None and e.manager.seq_len(0) == 12


def test_explorer_without_a_sequence_reports_it():
    e = PageTableExplorer(num_blocks=4, block_size=2)
    for name in ("append", "fork", "free"):
        e.click(name)  # disabled in the browser; a click from code still gets an answer
        assert (
            e.last_error == "no sequence selected: add one first" and "no sequence selected" in e.view.status
        )
    assert e.manager.seq_ids == []


def test_explorer_methods_can_be_called_directly():
    e = PageTableExplorer(num_blocks=6, block_size=2)
    assert e.add_sequence(3) == 0
    assert e.fork(0) == 1
    e.append(1, 2)
    assert e.manager.seq_len(1) == 5
    assert e.add_sequence(100) is None and "OutOfBlocksError" in e.last_error
    e.free(0)
    e.free(0)  # already gone: an error message, not an exception
    assert "unknown seq_id 0" in e.last_error
    assert e.add_sequence(1) == 2
    assert e.picture().data.startswith("<svg")


def test_explorer_shows_only_vllmini_errors(monkeypatch):
    e = PageTableExplorer(num_blocks=4, block_size=2)
    e.add_sequence(1)

    def broken(*args):
        raise RuntimeError("a bug, not a user error")

    monkeypatch.setattr(e.playground, "append", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        e.append(0, 1)


def test_explorer_rejects_bad_sizes():
    with pytest.raises(InvalidArgumentError, match="num_blocks must be >= 1, got 0"):
        PageTableExplorer(num_blocks=0)
    with pytest.raises(InvalidTypeError, match="block_size must be an int"):
        PageTableExplorer(block_size=2.0)


def test_explorer_big_pool_shows_a_window_and_the_whole_pool():
    e = PageTableExplorer(num_blocks=1000, block_size=16)
    for _ in range(40):
        e.add_sequence(300)  # 19 blocks each: 760 blocks
    pic = e.last_picture
    assert pic.page == page_of(e.manager.block_table(39).block_ids[-1], 1000) and len(pic.blocks) == 32
    gids = svg_gids(e)
    assert sum(g.startswith("physical:") for g in gids) == 32  # the window
    assert len(re.findall(r"<rect [^>]*height='12.0'", e.view.picture)) >= 1000  # the overview: every block
    assert 39 in pic.seqs and pic.hidden_seqs == 40 - len(pic.seqs)
    assert len(e.view.picture) < 400_000
    e.click("page", page=0)
    assert e.last_picture.blocks == range(0, 32) and "arrow:0:0->0" in svg_gids(e)
    e.click("page", page=99)  # past the end: nothing changes
    assert e.last_picture.blocks == range(0, 32)


def test_explorer_displays_its_widget_with_a_text_hint(monkeypatch):
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False: shown.append((obj, raw)))
    explorer = PageTableExplorer(num_blocks=8, block_size=4)
    explorer.display()
    ((bundle, raw),) = shown
    assert raw is True
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == explorer.view.model_id
    assert bundle["text/plain"].startswith("PageTableExplorer(8 blocks of 4)")
    assert "(-)" in explorer.status_text()


def test_explorer_fork_into_samples_names_the_new_ids():
    e = PageTableExplorer(num_blocks=12, block_size=4)
    e.add_sequence(10)
    e.set_inputs(samples=4)
    assert e.labels()["fork"] == "fork seq 0 → seqs 1–3 (4 samples)"
    e.click("fork")
    assert e.manager.seq_ids == [0, 1, 2, 3] and e.inputs["seq"] == "1"
    assert "forked seq 0 into seqs 1, 2, 3 (now selected: seq 1); they share every block" in e.status_text()
    assert "2 shared ×4" in svg_texts(e.view.picture)
    assert sum(g.startswith("arrow:") and g.endswith("->2") for g in svg_gids(e)) == 4


def test_explorer_step_copies_and_shows_the_copy_pair():
    e = PageTableExplorer(num_blocks=12, block_size=4)
    e.add_sequence(10)
    e.fork(0, num_samples=3)
    e.click("step")
    assert [e.manager.seq_len(s) for s in (0, 1, 2)] == [11, 11, 11]
    assert e.last_copies == [(2, 3), (2, 4)] and e.manager.take_pending_copies() == []
    assert "copy-on-write: block 2 → 3; copy-on-write: block 2 → 4" in e.history[-1]
    assert {"copy:2->3", "copy:2->4", "highlight:3", "highlight:4"} <= svg_gids(e)
    e.fork(0)
    assert e.last_copies == [] and not any(g.startswith(("copy:", "highlight:")) for g in svg_gids(e))


def test_explorer_free_keeps_cached_blocks_and_add_reuses_them():
    e = PageTableExplorer(num_blocks=8, block_size=4)
    e.add_sequence(9)
    e.free(0)
    assert e.history[-1] == "freed seq 0; 2 blocks [0, 1] stay cached (free, found again by their hash)"
    assert "8 of 8 blocks free (2 of them cached but free)" in e.status_text()
    assert e.view.state["prefixes"] == [["new tokens", "new"], ["seq 0's 9 tokens (freed)", "0"]]
    e.set_inputs(prefix=0, tokens=12)
    assert e.labels()["add"] == "add 12 tokens: seq 0's first 9 + 3 new"
    e.click("add")
    assert e.manager.block_table(1).block_ids[:2] == [0, 1] and e.manager.num_cached_free_blocks == 0
    assert "the first 9 from seq 0; prefix cache hit: shares 2 blocks [0, 1]" in e.history[-1]
    e.click("add", prefix="new")
    assert not {0, 1} & set(e.manager.block_table(2).block_ids) and "hit" not in e.history[-1]
    e.set_inputs(prefix=1)
    e.reset()  # the prefix's source is gone: the selection goes back to new tokens
    assert e.inputs["prefix"] == "new" and e.labels()["add"] == "add a sequence of 12 tokens"
    assert e.add_sequence(4, prefix_of=7) is None and "prefix_of=7 is no sequence" in e.last_error


def test_explorer_evicts_cached_blocks_only_when_needed_and_says_so():
    e = PageTableExplorer(num_blocks=4, block_size=4)
    e.add_sequence(8)
    e.free(0)
    e.add_sequence(8)
    assert e.manager.num_cached_free_blocks == 2 and "evicted" not in e.history[-1]
    before = full_state(e.manager)
    e.append(1, 12)
    assert "OutOfBlocksError" in e.last_error and full_state(e.manager) == before
    e.append(1, 4)
    assert e.history[-1].endswith("evicted cached block [1] (least recently used)")


def test_explorer_without_prefix_caching_frees_plainly():
    e = PageTableExplorer(num_blocks=8, block_size=4, prefix_caching=False)
    e.add_sequence(9)
    e.free(0)
    assert e.manager.prefix_cache is None and e.history[-1] == "freed seq 0"
    e.add_sequence(9, prefix_of=0)
    assert "hit" not in e.history[-1] and e.manager.allocator.ref_count(0) == 1


# ---- the explorer with a tokenizer: each slot shows its token's text


class WordTokenizer:
    """A tiny tokenizer for the tests: one token per word, with the whitespace before it (" capital");
    ids are given in order of first sight."""

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [self.vocab.setdefault(w, len(self.vocab)) for w in re.findall(r"\s*\S+|\s+", text)]

    def decode(self, ids) -> str:
        words = {i: w for w, i in self.vocab.items()}
        return "".join(words[i] for i in ids)


def slot_labels(e, seq_id) -> list[str]:
    """The labels in seq_id's logical slots, in order, read from the explorer's SVG (x within a row)."""
    svg, labels = e.view.picture, []
    for i in range(len(e.manager.block_table(seq_id).block_ids)):
        frame = rf"<rect x='([\d.]+)' y='([\d.]+)' width='([\d.]+)'[^>]*data-gid='logical:{seq_id}:{i}'"
        x, y, w = map(float, re.search(frame, svg).groups())
        row = re.findall(rf"<text x='([\d.]+)' y='{y + 11:.1f}'[^>]*>([^<]*)</text>", svg)
        labels += [
            html.unescape(t) for tx, t in sorted(row, key=lambda r: float(r[0])) if x < float(tx) < x + w
        ]
    return labels[: e.manager.seq_len(seq_id)]


FRANCE = ["The", "·capital", "·of", "·France", "·is"]


def test_explorer_slots_show_the_text_of_tokens_added_from_text():
    e = PageTableExplorer(num_blocks=16, block_size=4, tokenizer=WordTokenizer())
    size = re.search(r"width='(\d+)' height='(\d+)'", e.view.picture).groups()
    assert e.add_text("The capital of France is") == 0
    assert e.history[-1] == "added seq 0 with 5 tokens → slots [0, 1, 2, 3, 4]"
    assert slot_labels(e, 0) == FRANCE
    e.click("append", tokens=2)  # made-up tokens, no text: their index
    assert slot_labels(e, 0) == [*FRANCE, "5", "6"]
    e.append_text(" Paris\n\tat\x07  internationalization", seq_id=0)  # whitespace shown, cut to fit
    assert slot_labels(e, 0)[7:] == ["·Paris", "↵⇥at\\x07", "··inter…"]
    e.add_sequence(3)  # an explorer with a tokenizer still adds made-up tokens
    assert slot_labels(e, 1) == ["0", "1", "2"]
    assert re.search(r"width='(\d+)' height='(\d+)'", e.view.picture).groups() == size  # never jumps
    plain = PageTableExplorer(num_blocks=16, block_size=4)
    plain.add_sequence(5)
    assert slot_labels(plain, 0) == ["0", "1", "2", "3", "4"]  # without a tokenizer: indices, as before
    assert int(re.search(r"width='(\d+)'", plain.view.picture).group(1)) < int(size[0])  # narrower blocks


def test_explorer_text_with_a_cached_start_shares_blocks_as_prefix_of_does():
    by_text = PageTableExplorer(num_blocks=16, block_size=4, tokenizer=WordTokenizer())
    by_text.add_text("The capital of France is")
    by_text.add_text("The capital of France is Paris . Yes")
    by_hand = PageTableExplorer(num_blocks=16, block_size=4)
    by_hand.add_sequence(5)
    by_hand.add_sequence(8, prefix_of=0)
    assert by_text.history == by_hand.history and full_state(by_text.manager) == full_state(by_hand.manager)
    assert "the first 5 from seq 0; prefix cache hit: shares 1 block [0]" in by_text.history[-1]
    assert slot_labels(by_text, 1) == [*FRANCE, "·Paris", "·.", "·Yes"]
    by_text.free(0)
    by_text.free(1)  # its full blocks 0 and 2 stay cached
    by_text.add_text("The capital of France is Paris . Yes !")
    assert by_text.manager.block_table(2).block_ids[:2] == [0, 2]
    assert "the first 8 from seq 1; prefix cache hit: shares 2 blocks [0, 2]" in by_text.history[-1]
    by_text.add_text("The capital of Italy is")  # 3 words alike fill no whole block: no hit
    assert "the first 3 from seq 0; no prefix-cache hit: seq 0's first 3" in by_text.history[-1]
    by_text.add_sequence(9)  # made-up tokens never match a text's
    tables = by_text.manager.block_table
    assert not set(tables(4).block_ids) & {b for s in (2, 3) for b in tables(s).block_ids}


def test_explorer_forks_keep_their_token_text():
    e = PageTableExplorer(num_blocks=16, block_size=4, tokenizer=WordTokenizer())
    e.add_text("The capital of France is")
    assert e.fork(0, num_samples=3) == 1
    assert [slot_labels(e, s) for s in (0, 1, 2)] == [FRANCE] * 3
    e.append_text(" Paris", seq_id=1)  # copy-on-write of the shared half-full block, text and all
    e.click("step")
    assert e.last_copies == [(1, 3)]  # seq 0 writes into the block it and seq 2 still share
    assert [slot_labels(e, s) for s in (0, 1, 2)] == [
        [*FRANCE, "5"], [*FRANCE, "·Paris", "6"], [*FRANCE, "5"]
    ]  # fmt: skip
    e.add_sequence(7, prefix_of=1)  # starting with another's tokens starts with their text too
    assert slot_labels(e, 3) == [*FRANCE, "·Paris", "6"]


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda e: e.add_text(["The"]), InvalidTypeError, "text must be a str, got list ['The']"),
        (lambda e: e.add_text(b"The"), InvalidTypeError, "text must be a str, got bytes"),
        (lambda e: e.add_text(""), InvalidArgumentError, "text must have tokens: the tokenizer gave ids []"),
        (lambda e: e.append_text(None, 0), InvalidTypeError, "text must be a str, got NoneType"),
        (lambda e: PageTableExplorer().add_text("hi"), InvalidArgumentError, "add_text needs a tokenizer"),
        (lambda e: PageTableExplorer(tokenizer=1), InvalidTypeError, "tokenizer must have encode(text)"),
        (lambda e: PageTableExplorer(tokenizer=re), InvalidTypeError, "methods, got module"),  # no decode
    ],
)
def test_explorer_refuses_bad_text_and_tokenizers_and_changes_nothing(call, error, message):
    e = PageTableExplorer(num_blocks=4, block_size=4, tokenizer=WordTokenizer())
    e.add_text("The capital of France is")

    def seen():
        return full_state(e.manager), e.history[:], e.view.picture, e.view.status, dict(e.playground.tokens)

    before = seen()
    with pytest.raises(error, match=re.escape(message)):
        call(e)
    assert seen() == before


def test_explorer_text_that_does_not_fit_is_an_error_in_the_status_line():
    e = PageTableExplorer(num_blocks=2, block_size=4, tokenizer=WordTokenizer())
    e.add_text("The capital of France is")
    assert e.add_text("a b c d e f g h i") is None and full_state(e.manager)[0] == [0]
    assert e.last_error == "OutOfBlocksError: seq 1 with 9 tokens needs 3 new blocks, but 0 of 2 blocks free"


@pytest.fixture(scope="module")
def course_tokenizer():
    """The course model's tokenizer, loaded as notebook 03 loads it (skips only where the model cannot
    be fetched; under CI it fails instead)."""
    from tokenizers import Tokenizer

    from vllmini import models
    from vllmini.errors import CheckpointError

    try:
        path = models.fetch("SmolLM2-135M-Instruct")
    except CheckpointError as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI must fetch the course model: {e}")
        pytest.skip(f"the course model cannot be fetched here: {e}")
    return Tokenizer.from_file(str(path / "tokenizer.json"))


def test_explorer_shows_the_course_models_tokens(course_tokenizer):
    e = PageTableExplorer(num_blocks=16, block_size=4, tokenizer=course_tokenizer)
    e.add_text("The capital of France is")
    assert e.playground.tokens[0] == [504, 3575, 282, 4649, 314] and slot_labels(e, 0) == FRANCE
    e.add_text("The capital of France is Paris")
    assert e.manager.block_table(1).block_ids[0] == 0 and slot_labels(e, 1) == [*FRANCE, "·Paris"]


# ---- course pictures (notebooks 01, 04, 06)


def test_draw_reservations_draws_one_square_per_slot_per_scheme():
    from matplotlib.patches import Rectangle

    from vllmini.course.chapter_plots import draw_reservations
    from vllmini.course.style import EMPTY_FACE, OUTPUT_FACE, PROMPT_FACE

    reqs = [(5, 3), (2, 4), (9, 5)]
    fig = draw_reservations(reqs, max_len=16, block_size=4)
    static, paged = fig.axes[:2]
    for ax in (static, paged):
        cells = [p for p in ax.patches if isinstance(p, Rectangle)]
        assert len(cells) == 3 * 16
        faces = [to_hex(p.get_facecolor()).lower() for p in cells]
        assert faces.count(PROMPT_FACE.lower()) == 16 and faces.count(OUTPUT_FACE.lower()) == 12
    empty = lambda ax: sum(to_hex(p.get_facecolor()).lower() == EMPTY_FACE.lower() for p in ax.patches)  # noqa: E731
    assert empty(static) == 48 - 28 and empty(paged) == 32 - 28
    assert "28 of 48" in static.get_title(loc="left") and "28 of 32" in paged.get_title(loc="left")


def test_draw_prefill_and_decode_counts_reads():
    from vllmini.course.chapter_plots import draw_prefill_and_decode

    fig = draw_prefill_and_decode(prompt_len=5, num_decode_steps=3)
    prefill, decode = fig.axes[:2]
    assert len(prefill.patches) == 25  # a 5 x 5 grid, the causal triangle coloured
    assert len(decode.patches) == sum(5 + t + 1 for t in range(3))  # step t reads 5 + t, writes 1
    assert "15 query-key products" in prefill.get_title(loc="left")


def test_plot_token_shares_and_length_sweeps_plot_the_given_numbers():
    from vllmini.course.chapter_plots import plot_length_sweeps, plot_token_shares

    schemes = ("static", "pow2", "oracle", "paged")
    share = {(w, snap, s): 0.1 * (k + 1) + (0.05 if snap == "half" else 0) for w in ("A", "B")
             for snap in ("done", "half") for k, s in enumerate(schemes)}  # fmt: skip
    paper = {s: 0.2 * (k + 1) for k, s in enumerate(schemes)}
    fig = plot_token_shares(share, paper)
    heights = sorted(round(p.get_height(), 6) for p in fig.axes[0].patches)
    assert heights == sorted(round(v, 6) for v in list(share.values()) + list(paper.values()))
    sweep = {}
    for w in ("A", "B"):
        for m in (512, 1024):
            sweep[w, "static", "max_len", m] = (0.2, 512 / m)
            sweep[w, "paged", "max_len", m] = (0.9, 30.0)
        for b in (8, 16):
            sweep[w, "paged", "block", b] = (1 - b / 100, 40 - b)
    fig = plot_length_sweeps(sweep, [512, 1024], [8, 16], budget_label="1 GB", default_max_len=1024)
    top_right = fig.axes[1]
    ys = [list(line.get_ydata()) for line in top_right.lines]
    assert [0.92, 0.84] in [[round(y, 6) for y in v] for v in ys]
    # one legend for the sweep: colour = scheme, line style = workload, and the dashed entry is dashed
    (legend,) = fig.legends
    styles = {
        t.get_text(): h.get_linestyle()
        for t, h in zip(legend.get_texts(), legend.legend_handles, strict=True)
    }
    assert styles["A"] == "-" and styles["B"] == "--"
    assert legend.handlelength >= 3  # long enough to show a dash pattern


def test_token_share_legend_sits_below_the_bars():
    from vllmini.course.chapter_plots import plot_token_shares

    schemes = ("static", "pow2", "oracle", "paged")
    share = {("A", snap, s): 1.0 for snap in ("done", "half") for s in schemes}
    fig = plot_token_shares(share, {s: 1.0 for s in schemes})
    fig.canvas.draw()
    ax = fig.axes[0]
    legend_box = ax.get_legend().get_window_extent()
    assert legend_box.y1 < ax.get_window_extent().y0  # under the axes: no bar, even a 100% one, is covered


def test_draw_causal_mask_shows_exactly_the_mask():
    import numpy as np

    from vllmini.course.chapter_plots import draw_causal_mask

    mask = np.arange(7)[None, :] <= np.arange(4, 7)[:, None]
    before = mask.copy()
    fig = draw_causal_mask(mask, start=4)
    (image,) = fig.axes[0].images
    assert np.array_equal(np.asarray(image.get_array()).astype(bool), mask)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["4", "5", "6"]
    assert np.array_equal(mask, before)


def test_draw_flat_batch_marks_query_start_loc():
    from vllmini.course.chapter_plots import draw_flat_batch

    fig = draw_flat_batch([3, 11], [7, 11], names="AB")
    ax = fig.axes[0]
    texts = [t.get_text() for t in ax.texts]
    assert [t for t in texts if t.startswith("query_start_loc")] == [
        "query_start_loc[0] = 0",
        "query_start_loc[1] = 3",
        "query_start_loc[2] = 14",
    ]
    assert len(ax.patches) == (3 + 11) + (7 + 11)  # the flat query, then each sequence's positions
    numbers = [t for t in texts if t.isdigit()]
    assert numbers == ["4", "5", "6"] + [str(p) for p in range(11)]  # positions of the new tokens


def test_plot_request_timeline_colours_each_state():
    from vllmini.course.serving_plots import TIMELINE_STATES, plot_request_timeline

    timeline = {0: ["prefill", "decode", "finished", None], 1: ["waiting", "prefill", "preempted", "waiting"]}
    fig = plot_request_timeline(timeline)
    ax = fig.axes[0]
    assert len(ax.patches) == 7  # one cell per non-None state
    faces = sorted(to_hex(p.get_facecolor()) for p in ax.patches)
    want = sorted(to_hex(TIMELINE_STATES[s][0]) for row in timeline.values() for s in row if s is not None)
    assert faces == want
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "1", "2", "3"]


def _fake_stats(n=6):
    from types import SimpleNamespace

    return [
        SimpleNamespace(
            step=i,
            allocated_slots=8 + i,
            num_tokens=6 + i,
            pool_slots=20,
            num_preemptions=int(i == 2),
            num_decodes=i,
            num_prefills=1,
            batch_size=i + 1,
        )  # fmt: skip
        for i in range(n)
    ]


def test_plot_pool_and_batch_plots_the_stats():
    from vllmini.course.serving_plots import plot_pool_and_batch

    stats = _fake_stats()
    fig = plot_pool_and_batch(stats)
    pool, batch = fig.axes[:2]
    assert list(pool.lines[0].get_ydata()) == [s.allocated_slots for s in stats]
    assert list(pool.lines[1].get_ydata()) == [s.num_tokens for s in stats]
    assert sum(1 for line in pool.lines if list(line.get_xdata()) == [2, 2]) == 1  # the preemption
    tops = sorted(p.get_y() + p.get_height() for p in batch.patches)
    assert tops[-1] == 6  # 5 decodes + 1 prefill at the last step


def test_plot_engine_experiment_bars_are_the_results():
    from vllmini.course.serving_plots import plot_engine_experiment

    pol = ("static", "oracle", "paged")
    results = {(w, p): {"batch": 7.0 * (k + 1) * (j + 1), "kv_tokens": 0.3 * (k + 1)}
               for j, w in enumerate(("sharegpt", "alpaca")) for k, p in enumerate(pol)}  # fmt: skip
    paper = {w: {p: 1.0 for p in pol} for w in ("sharegpt", "alpaca")}
    fig = plot_engine_experiment(results, {p: [0, 1, 3] for p in pol}, paper, {p: 0.5 for p in pol})
    assert sorted(p.get_height() for p in fig.axes[0].patches) == sorted(r["batch"] for r in results.values())
    assert [round(p.get_height(), 6) for p in fig.axes[1].patches] == [0.3, 0.6, 0.9]
    assert len(fig.axes[2].lines) == 3


def test_draw_pipeline_names_every_piece_in_order():
    from vllmini.course.chapter_plots import PIPELINE, draw_pipeline

    fig = draw_pipeline()
    texts = [t.get_text() for t in fig.axes[0].texts]
    names = [t for t in texts if t in {name for name, _, _ in PIPELINE}]
    assert names == [name for name, _, _ in PIPELINE]
    from importlib import import_module

    import vllmini

    # every box is a public name of the package, or (serving) a module of the course's tools
    assert all(hasattr(vllmini, name) or import_module(f"vllmini.course.{name}") for name in names)


def test_plot_requests_that_fit_draws_each_curve_and_the_paper():
    from vllmini.course.chapter_plots import plot_requests_that_fit

    budgets = [2, 4, 6]
    curves = {
        (w, s): [k * b for b in budgets] for w in ("A", "B") for k, s in enumerate(("static", "paged"), 1)
    }
    paper = {key: 3.0 for key in curves}
    fig = plot_requests_that_fit(budgets, curves, paper, paper_budget=4)
    assert len(fig.axes) == 2
    ys = [list(line.get_ydata()) for line in fig.axes[0].lines]
    assert [2, 4, 6] in ys and [4, 8, 12] in ys and ys.count([3.0]) == 2


# ---- CUDA pictures (notebook 05)

from vllmini.course import cuda_plots  # noqa: E402


def test_butterfly_steps_leave_the_sum_in_every_lane():
    import random

    values = [random.Random(1).randint(-9, 9) for _ in range(32)]
    rows = cuda_plots.butterfly_steps(values)
    assert len(rows) == 6 and rows[0] == values
    assert rows[-1] == [float(sum(values))] * 32
    assert rows[1][0] == values[0] + values[16] and rows[1][16] == values[16] + values[0]


def test_online_softmax_trace_matches_the_direct_sum():
    import math

    scores = [0.5, -1.0, 3.0, 2.0, 7.5, -4.0]
    trace = cuda_plots.online_softmax_trace(scores)
    assert [m for m, _, _ in trace] == [0.5, 0.5, 3.0, 3.0, 7.5, 7.5]
    m, l, _ = trace[-1]
    assert math.isclose(l * math.exp(m), sum(math.exp(s) for s in scores), rel_tol=1e-12)
    assert trace[0][2] == 0.0 and trace[2][2] == math.exp(0.5 - 3.0)  # the rescale factors


def test_page_read_owner_maps_threads_to_elements():
    owner = cuda_plots.page_read_owner
    assert owner("1", 4, 64)[3].tolist() == [3] * 64  # thread t reads token t's row
    assert owner("2", 4, 64)[0, [0, 31, 32, 63]].tolist() == [0, 31, 0, 31]  # dims l, l + 32
    assert owner("3", 4, 64)[0, [0, 1, 2, 63]].tolist() == [0, 0, 1, 31]  # dims 2l, 2l + 1
    from vllmini.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="kernel must be"):
        owner("5")


def test_cuda_pictures_draw():
    figures = [
        cuda_plots.draw_cuda_hierarchy(),
        cuda_plots.draw_butterfly(list(range(32))),
        cuda_plots.draw_online_softmax([0.0, 2.0, 1.0, 5.0, -1.0, 3.0], chunks=2),
        cuda_plots.draw_page_reads(),
        cuda_plots.draw_token_mapping(seq_len=40),
    ]
    assert all(isinstance(f, Figure) and f.axes for f in figures)


def test_butterfly_numbers_are_at_least_9_points_on_a_figure_shown_unscaled():
    fig = cuda_plots.draw_butterfly(list(range(32)))
    assert fig.get_size_inches()[0] * fig.dpi <= 1000  # shown at its own size in a notebook
    lane_values = [t for t in fig.axes[0].texts if t.get_text().isdigit()]
    assert len(lane_values) == 6 * 32 and min(t.get_fontsize() for t in lane_values) >= 9


def test_online_softmax_sum_drops_when_the_max_grows_then_rises():
    scores = [0.0, 2.0, 1.0, 5.0, -1.0]
    fig = cuda_plots.draw_online_softmax(scores, chunks=2)
    sum_ax = fig.axes[1]
    assert sum_ax.get_ylabel() == "running sum l" and not any(
        a.bbox.bounds == sum_ax.bbox.bounds for a in fig.axes if a is not sum_ax
    )
    trace = cuda_plots.online_softmax_trace(scores)
    red = [
        line for line in sum_ax.lines if line.get_color() == cuda_plots.PALETTE[3] and len(line.get_xdata())
    ]
    # one red segment per growth of the max after the first score (tokens 1 and 3), each going down
    assert [int(line.get_xdata()[1]) for line in red] == [1, 3]
    assert all(line.get_ydata()[1] < line.get_ydata()[0] for line in red)
    assert [round(trace[i - 1][1] * trace[i][2], 9) for i in (1, 3)] == [
        round(line.get_ydata()[1], 9) for line in red
    ]


def test_work_split_collapses_identical_versions_into_one_panel():
    from vllmini.course import kernel_plots

    per_head = [[h] * 8 for h in range(4)]
    split = [[0] * 4 + [1] * 4 for _ in range(4)]
    layouts = {"v1 a": per_head, "v2 b": per_head, "v3 c": per_head, "v5 d": split}
    assert list(kernel_plots.group_identical(layouts)) == ["v1 a · v2 b · v3 c", "v5 d"]
    fig = kernel_plots.plot_kernel_work_split(layouts)
    titles = [ax.get_title() for ax in fig.axes]
    assert (
        len(titles) == 2 and "v1 a, v2 b" in titles[0] and "read 4x" in titles[0] and "read 1x" in titles[1]
    )
    assert list(kernel_plots.group_identical({"x": per_head, "y": split, "z": per_head})) == ["x", "y", "z"]


def test_butterfly_in_groups_of_16_never_crosses_the_halves():
    from vllmini.errors import InvalidArgumentError

    values = list(range(32))
    assert cuda_plots.butterfly_masks(16) == [8, 4, 2, 1]
    rows = cuda_plots.butterfly_steps(values, group=16)
    assert len(rows) == 5 and rows[-1] == [float(sum(range(16)))] * 16 + [float(sum(range(16, 32)))] * 16
    fig = cuda_plots.draw_butterfly(values, group=16)
    assert "lanes 0-15 hold 120, lanes 16-31 hold 376" in fig.axes[0].get_title()
    with pytest.raises(InvalidArgumentError, match="group must be a power of two"):
        cuda_plots.butterfly_masks(12)


def test_transposed_butterfly_leaves_each_lane_one_tokens_sum():
    import random

    from vllmini.course import kernel_plots
    from vllmini.errors import InvalidArgumentError

    rng = random.Random(3)
    group, tokens = 16, 4
    parts = [[rng.randint(-9, 9) for _ in range(tokens)] for _ in range(group)]
    rows = kernel_plots.transposed_butterfly_steps(parts)
    assert [len(row[0]) for row in rows] == [4, 2, 1, 1, 1]  # 2 halving steps, then 2 plain ones
    # the kernel's my_token (paged_attention_9_guard.cu): lane & 8 -> tokens 2, 3; lane & 4 -> odd token
    my_token = [2 * bool(lane & 8) + bool(lane & 4) for lane in range(group)]
    assert rows[-1] == [[(u, float(sum(p[u] for p in parts)))] for u in my_token]
    assert rows[1][0] == [(0, parts[0][0] + parts[8][0]), (1, parts[0][1] + parts[8][1])]
    assert rows[1][8] == [(2, parts[8][2] + parts[0][2]), (3, parts[8][3] + parts[0][3])]
    assert kernel_plots.plot_transposed_butterfly(parts).axes
    with pytest.raises(InvalidArgumentError, match="power-of-two group"):
        kernel_plots.transposed_butterfly_steps([[1, 2, 3]] * 8)


def test_split_merge_equals_softmax_over_the_whole_context():
    import numpy as np

    from vllmini.course import kernel_plots
    from vllmini.errors import InvalidArgumentError

    gen = np.random.default_rng(1)
    scores, values = gen.normal(0, 3, 10), gen.normal(size=(10, 3))
    p = np.exp(scores - scores.max())
    for pieces in (1, 3, 4, 10):
        merge = kernel_plots.split_merge(scores, values, pieces)
        assert len(merge["m"]) == pieces and np.isclose(merge["w"].sum(), 1.0)
        assert np.allclose(merge["out"], p @ values / p.sum(), rtol=0, atol=1e-12)
    merge = kernel_plots.split_merge(scores, values, 3)  # pieces of 4, 4, 2 tokens
    assert merge["starts"] == [0, 4, 8] and merge["m"][2] == scores[8:].max()
    fig = kernel_plots.plot_split_merge(scores, merge)
    assert [round(b.get_height(), 12) for b in fig.axes[1].patches] == [round(w, 12) for w in merge["w"]]
    with pytest.raises(InvalidArgumentError, match="pieces <= tokens"):
        kernel_plots.split_merge(scores, values, 11)
