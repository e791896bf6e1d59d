"""Tests for vllmini.course.block_plots: each picture draws what its state says and rejects bad input."""

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from vllmini import BlockManager  # noqa: E402
from vllmini.allocator import BlockAllocator  # noqa: E402
from vllmini.course.block_plots import ONE_OWNER, SHARED, draw_pool_history, draw_slots_read  # noqa: E402
from vllmini.errors import InvalidArgumentError, InvalidTypeError  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_pool_history_colours_each_block_by_its_ref_count():
    a = BlockAllocator(4)
    history = [("fresh", [a.ref_count(b) for b in range(4)], a.free_block_ids)]
    a.allocate()
    a.allocate()
    a.fork([0])
    history.append(("fork", [a.ref_count(b) for b in range(4)], a.free_block_ids))
    fig = draw_pool_history(history, 4, title="t")
    ax = fig.axes[0]
    faces = [matplotlib.colors.to_hex(p.get_facecolor()) for p in ax.patches if isinstance(p, Rectangle)]
    assert len(faces) == 8  # 2 rows x 4 blocks
    assert faces[4:6] == [SHARED, ONE_OWNER]  # block 0 shared (rc 2), block 1 one owner
    texts = [t.get_text() for t in ax.texts]
    assert "rc 2" in texts and f"free list: {list(a.free_block_ids)}" in texts and ax.get_title() == "t"
    with pytest.raises(InvalidArgumentError, match="ref counts"):
        draw_pool_history([("x", [0, 0], [])], 4)
    with pytest.raises(InvalidTypeError, match=r"history\[0\]"):
        draw_pool_history(["not a row"], 4)


def test_slots_read_outlines_exactly_the_slots_of_one_sequence():
    m = BlockManager(num_blocks=6, block_size=4)
    m.allocate(0, 7)
    m.allocate(1, 3)
    block_tables, seq_lens = m.build_block_tables([0, 1])
    key_cache = torch.full((6, 4, 1, 2), float("nan"))
    for s in (0, 1):
        key_cache.view(-1, 1, 2)[torch.tensor(m.slot_mapping(s))] = 1.0
    fig, ax = plt.subplots()
    draw_slots_read(ax, key_cache, block_tables, seq_lens, 0, names="AB")
    outlined = [p for p in ax.patches if isinstance(p, Rectangle) and not p.get_fill()]
    assert len(outlined) == 7  # A's 7 slots
    want = {(s % 4, -(s // 4)) for s in m.slot_mapping(0)}  # (offset, -page) of each slot A reads
    assert {(int(p.get_x()), int(p.get_y())) for p in outlined} == want
    labels = [t.get_text() for t in ax.texts]
    assert labels.count("NaN") == 6 * 4 - 10 and "A6" in labels and "B2" in labels
    with pytest.raises(InvalidArgumentError, match="seq"):
        draw_slots_read(ax, key_cache, block_tables, seq_lens, 2)
    bad = block_tables.clone()
    bad[1, 0] = 9
    with pytest.raises(InvalidArgumentError, match=r"block_tables\[1, 0\] = 9"):
        draw_slots_read(ax, key_cache, bad, seq_lens, 0)
