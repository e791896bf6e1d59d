"""Tests for vllmini.viz: the static page-table figure and the interactive explorer (driven by clicking its
buttons programmatically). Viz must only read what it draws."""

import matplotlib
import pytest

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import FancyArrowPatch  # noqa: E402

from vllmini import BlockAllocator, BlockManager, BlockTable  # noqa: E402
from vllmini.viz import PageTableExplorer, draw_page_table, seq_color  # noqa: E402


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
    arrows = [p for p in fig.axes[0].patches if isinstance(p, FancyArrowPatch)]
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
    white = [p for p in ax.patches if p.get_facecolor()[:3] == (1.0, 1.0, 1.0) and p.get_width() == 1]
    assert len(white) == 2 * 2  # two empty slots in logical L1 and the same two in physical block 1


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


def test_seq_ids_picks_which_sequences_to_draw():
    m = busy_manager()
    gids = patches_by_gid(draw_page_table(m, seq_ids=[2]))
    assert not any(g.startswith(("logical:0", "logical:3")) for g in gids)
    assert "logical:2:2" in gids


def test_bad_inputs_raise():
    a, b = BlockAllocator(2), BlockAllocator(2)
    with pytest.raises(TypeError, match="BlockManager"):
        draw_page_table([1, 2])
    with pytest.raises(TypeError, match="BlockTable"):
        draw_page_table({0: "table"}, a)
    with pytest.raises(ValueError, match="allocator="):
        draw_page_table({})
    with pytest.raises(ValueError, match="allocator"):
        draw_page_table({0: BlockTable(a, 2)}, b)
    with pytest.raises(ValueError, match="block_size"):
        draw_page_table({0: BlockTable(a, 2), 1: BlockTable(a, 4)})
    with pytest.raises(ValueError, match=r"seq_ids \[9\]"):
        draw_page_table(BlockManager(2, 2), seq_ids=[9])


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
    gids = patches_by_gid(draw_page_table(m, max_pool_rows=16))
    assert len({round(gids[f"physical:{b}"].get_x(), 3) for b in range(40)}) == 2


def test_drawing_never_changes_what_it_draws():
    m = busy_manager()
    before = full_state(m)
    assert m.block_table(4).pending_copies  # a pending copy-on-write job must survive drawing
    draw_page_table(m)
    draw_page_table({s: m.block_table(s) for s in m.seq_ids}, m.allocator)
    draw_page_table(m, seq_ids=[4, 0])
    assert full_state(m) == before


# ---- the explorer


def test_explorer_starts_empty_and_displays():
    e = PageTableExplorer(num_blocks=8, block_size=4)
    assert e.manager.num_blocks == 8 and e.manager.seq_ids == []
    assert e.image.value[:8] == b"\x89PNG\r\n\x1a\n"
    assert "free list: [0, 1, 2, 3, 4, 5, 6, 7]" in e.status.value
    assert e.widget.__class__.__name__ == "VBox"
    assert callable(e._ipython_display_) and callable(e.display)
    for button in (e.add_button, e.append_button, e.fork_button, e.free_button, e.reset_button):
        assert button in e.widget.children[1].children


def test_explorer_buttons_change_state_and_picture():
    e = PageTableExplorer(num_blocks=8, block_size=4)
    png = e.image.value

    e.num_tokens.value = 6
    e.add_button.click()
    assert e.manager.seq_ids == [0] and e.manager.seq_len(0) == 6
    assert e.seq_select.value == 0 and list(e.seq_select.options) == [0]
    assert e.image.value != png
    png = e.image.value
    assert "added seq 0 with 6 tokens" in e.status.value and e.last_error is None

    e.num_tokens.value = 3
    e.append_button.click()
    assert e.manager.seq_len(0) == 9 and e.manager.block_table(0).block_ids == [0, 1, 2]
    assert e.image.value != png

    e.fork_button.click()
    assert e.manager.seq_ids == [0, 1] and e.seq_select.value == 1
    assert e.manager.allocator.ref_count(0) == 2

    e.num_tokens.value = 1
    e.append_button.click()  # seq 1's last block is shared and partly full: copy-on-write
    assert e.manager.block_table(1).block_ids == [0, 1, 3]

    e.seq_select.value = 0
    e.free_button.click()
    assert e.manager.seq_ids == [1] and e.seq_select.value == 1
    assert e.manager.allocator.ref_count(0) == 1

    e.reset_button.click()
    assert e.manager.seq_ids == [] and e.manager.num_free_blocks == 8
    assert e.seq_select.value is None and "reset" in e.status.value


def test_explorer_out_of_blocks_shows_error_and_changes_nothing():
    e = PageTableExplorer(num_blocks=4, block_size=4)
    e.num_tokens.value = 10
    e.add_button.click()
    before, png = full_state(e.manager), e.image.value
    e.num_tokens.value = 16
    e.add_button.click()  # needs 4 blocks, 1 left
    assert "OutOfBlocksError" in e.last_error
    assert "error: OutOfBlocksError" in e.status.value
    assert full_state(e.manager) == before
    assert e.image.value == png  # same state, same picture
    e.append_button.click()  # 10 + 16 tokens: also too many
    assert "OutOfBlocksError" in e.last_error and full_state(e.manager) == before
    e.num_tokens.value = 2
    e.append_button.click()  # fits: the error goes away
    assert e.last_error is None and e.manager.seq_len(0) == 12


def test_explorer_without_a_sequence_reports_it():
    e = PageTableExplorer(num_blocks=4, block_size=2)
    for button in (e.append_button, e.fork_button, e.free_button):
        button.click()
        assert e.last_error == "no sequence selected: add one first"
        assert "no sequence selected" in e.status.value
    assert e.manager.seq_ids == []


def test_explorer_methods_can_be_called_directly():
    e = PageTableExplorer(num_blocks=6, block_size=2)
    assert e.add_sequence(3) == 0
    assert e.fork(0) == 1
    e.append(1, 2)
    assert e.manager.seq_len(1) == 5
    assert e.add_sequence(100) is None and "OutOfBlocksError" in e.last_error
    e.free(0)
    assert e.manager.seq_ids == [1]
    e.free(0)  # already gone: an error message, not an exception
    assert "unknown seq_id 0" in e.last_error
    assert e.add_sequence(1) == 2  # ids are never reused, so colours stay put


def test_explorer_displays_its_widget_with_a_text_hint(monkeypatch):
    """In JupyterLab the widget view renders; a saved, unrun notebook shows a hint, not VBox(...)."""
    import IPython.display

    from vllmini.viz import PageTableExplorer

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False: shown.append((obj, raw)))
    explorer = PageTableExplorer(num_blocks=8, block_size=4)
    explorer.display()
    ((bundle, raw),) = shown
    assert raw is True
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == explorer.widget.model_id
    assert bundle["text/plain"].startswith("PageTableExplorer(8 blocks of 4)")
    assert "(-)" in explorer.status_text()  # nothing allocated: no made-up 100%


# ---- CUDA pictures (notebook 05)

from vllmini import viz  # noqa: E402


def test_butterfly_steps_leave_the_sum_in_every_lane():
    import random

    values = [random.Random(1).randint(-9, 9) for _ in range(32)]
    rows = viz.butterfly_steps(values)
    assert len(rows) == 6 and rows[0] == values
    assert rows[-1] == [float(sum(values))] * 32
    assert rows[1][0] == values[0] + values[16] and rows[1][16] == values[16] + values[0]


def test_online_softmax_trace_matches_the_direct_sum():
    import math

    scores = [0.5, -1.0, 3.0, 2.0, 7.5, -4.0]
    trace = viz.online_softmax_trace(scores)
    assert [m for m, _, _ in trace] == [0.5, 0.5, 3.0, 3.0, 7.5, 7.5]
    m, l, _ = trace[-1]
    assert math.isclose(l * math.exp(m), sum(math.exp(s) for s in scores), rel_tol=1e-12)
    assert trace[0][2] == 0.0 and trace[2][2] == math.exp(0.5 - 3.0)  # the rescale factors


def test_page_read_owner_maps_threads_to_elements():
    owner = viz.page_read_owner
    assert owner("1", 4, 64)[3].tolist() == [3] * 64  # thread t reads token t's row
    assert owner("2", 4, 64)[0, [0, 31, 32, 63]].tolist() == [0, 31, 0, 31]  # dims l, l + 32
    assert owner("3", 4, 64)[0, [0, 1, 2, 63]].tolist() == [0, 0, 1, 31]  # dims 2l, 2l + 1
    from vllmini.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="kernel must be"):
        owner("5")


def test_cuda_pictures_draw():
    figures = [
        viz.draw_cuda_hierarchy(),
        viz.draw_butterfly(list(range(32))),
        viz.draw_online_softmax([0.0, 2.0, 1.0, 5.0, -1.0, 3.0], chunks=2),
        viz.draw_page_reads(),
        viz.draw_token_mapping(seq_len=40),
    ]
    assert all(isinstance(f, Figure) and f.axes for f in figures)
