"""Where everything in the page-table picture goes, as plain data (no matplotlib).

`page_table_layout(manager)` returns a `PageTableLayout`: one `Box` per drawn block (each sequence's
logical blocks on the left, the physical pool on the right), one `Arrow` per logical -> physical mapping
and per copy-on-write pair (source -> copy), the `Label`s, the legend and the figure's extent.
`vllmini.course.page_table` paints it; tests read it directly. Positions come from `page_table_places`.

What a physical block looks like is decided in one place, `_pool_style`, by its kind:
"used" (one owner), "shared" (several: black frame, one stripe per owner, "shared ×N" = its reference
count = its arrows), "free" (dashed grey), "cached" (free, reference count 0, but still named by a hash
in the prefix cache: hatched teal, evicted least recently used first) and "pinned" (freed, kept as the
source of a pending copy).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from vllmini.allocator import BlockAllocator
from vllmini.checks import as_int, cdiv
from vllmini.course.page_table_places import LABEL_CHAR, LABEL_ROOM, Places, place
from vllmini.course.snapshot import Snapshot, snapshot
from vllmini.course.style import (
    CACHED_EDGE,
    CACHED_FACE,
    FREE_EDGE,
    FREE_FACE,
    HIGHLIGHT,
    ROW_HEIGHT,
    plural,
    seq_color,
)
from vllmini.errors import InvalidArgumentError

GREY = "#777777"
MID = ROW_HEIGHT / 2  # from a row's top to its middle, where labels and arrows attach
# the colour of a pool block's label, by its kind (black for the others)
LABEL_COLORS = {"cached": CACHED_EDGE, "free": "#999999", "pinned": GREY}


@dataclass(frozen=True)
class Look:
    """How a block looks: the first `filled` slots coloured, one horizontal stripe per owner; a frame."""

    kind: str  # "logical", "used", "shared", "free", "cached" or "pinned"
    stripes: tuple[str, ...]
    filled: int
    frame: str
    linewidth: float
    linestyle: str = "-"
    hatch: str | None = None


@dataclass(frozen=True, kw_only=True)
class Box(Look):
    """One block drawn at (x, y) as a row of `slots` token slots, each `cell` wide; optional text per slot."""

    gid: str  # "logical:<seq>:<i>" or "physical:<block>"
    x: float
    y: float
    cell: float
    slots: int
    numbers: tuple | None = None
    block_id: int | None = None  # the physical block (for a logical box: the one it maps to)
    ref_count: int = 0  # physical boxes: sequences pointing at the block

    @property
    def width(self) -> float:
        return self.slots * self.cell


@dataclass(frozen=True)
class Arrow:
    """Logical block -> physical block ("map"), or copy-on-write source -> its copy ("copy")."""

    gid: str
    start: tuple[float, float]
    end: tuple[float, float]
    color: str
    kind: str  # "map" or "copy"
    src: object  # the seq_id ("map") or the source block ("copy")
    dst: int  # the physical block it points at


@dataclass(frozen=True)
class Label:
    """A text at (x, y), aligned by `ha`/`va`."""

    x: float
    y: float
    text: str
    color: str = "black"
    size: float = 8
    ha: str = "left"
    va: str = "center"
    bold: bool = False


@dataclass
class PageTableLayout:
    """Everything the picture shows, in data units; `size` is the natural figure size in inches."""

    boxes: list[Box] = field(default_factory=list)
    arrows: list[Arrow] = field(default_factory=list)
    labels: list[Label] = field(default_factory=list)
    bars: list[tuple[float, float, float, str]] = field(default_factory=list)  # (x, y0, y1, colour) per seq
    glows: list[tuple[int, float, float, float]] = field(default_factory=list)  # (block, x, y, width)
    legend: list[tuple[str, dict]] = field(default_factory=list)  # (text, swatch style)
    legend_at: tuple[float, float] = (0.0, 0.0)  # upper left corner of the legend
    legend_cols: int = 1
    title: str = ""
    xlim: tuple[float, float] = (0.0, 1.0)
    ylim: tuple[float, float] = (1.0, 0.0)  # (bottom, top): row 0 at the top
    size: tuple[float, float] = (6.0, 4.0)
    snap: Snapshot | None = None

    def arrows_to(self, block_id: int) -> list[Arrow]:
        """The logical -> physical arrows pointing at `block_id`."""
        return [a for a in self.arrows if a.kind == "map" and a.dst == block_id]

    def box(self, gid: str) -> Box:
        """The box with this gid, e.g. "physical:3" or "logical:0:1"."""
        for box in self.boxes:
            if box.gid == gid:
                return box
        raise InvalidArgumentError(f"no box {gid!r} in the layout (blocks that did not fit are not drawn)")


def _pool_style(b: int, snap: Snapshot, colors: dict) -> tuple[Look, str]:
    """How physical block `b` looks (its kind, owner stripes, filled slots, frame) and its label."""
    owners, bs = snap.owners.get(b, []), snap.block_size
    if b in snap.cached_free:  # a cached block is full: only full blocks are named by a hash
        first = " (evicted 1st)" if b == snap.cached_free[0] else ""
        return Look("cached", (CACHED_FACE,), bs, CACHED_EDGE, 1.4, hatch="///"), f"{b} cached, free{first}"
    if snap.ref_counts[b] == 0:
        label = f"{b} free" + (" (next)" if snap.free_ids and b == snap.free_ids[0] else "")
        return Look("free", (FREE_FACE,), bs, FREE_EDGE, 1.2, "--"), label
    filled = snap.fill.get(b, 0)
    if not owners and snap.pinned(b):
        return Look("pinned", (GREY,), filled, GREY, 1.6, ":"), f"{b} copy source"
    stripes = tuple(dict.fromkeys(colors.get(s, GREY) for s in owners)) or (GREY,)  # one per owner
    notes = ["cached"] if b in snap.cached else []
    notes += [f"copy of {src}" for src, dst in snap.copies if dst == b]
    notes = f" ({', '.join(notes)})" if notes else ""
    if len(owners) > 1:
        return Look("shared", stripes, filled, "black", 2.4), f"{b} shared ×{len(owners)}{notes}"
    return Look("used", stripes, filled, stripes[0], 1.6), f"{b}{notes}"


def _check_token_text(snap: Snapshot, token_text) -> dict:
    """{seq_id: one string per token}, for drawn sequences only, one string per token they hold."""
    if token_text is None:
        return {}
    if not isinstance(token_text, dict):
        raise InvalidArgumentError(f"token_text must be a dict seq_id -> list of str, got {token_text!r}")
    counts = {s: count for s, _, count in snap.seqs}
    out = {}
    for s, texts in token_text.items():
        if s not in counts:
            raise InvalidArgumentError(
                f"token_text names seq {s!r}, which is not drawn; drawn: {list(counts)}"
            )
        texts = list(texts)
        if len(texts) != counts[s] or not all(isinstance(t, str) for t in texts):
            raise InvalidArgumentError(
                f"token_text[{s!r}] must hold one str per token: seq {s!r} has {counts[s]} tokens, "
                f"got {texts!r}"
            )
        out[s] = texts
    return out


def _cell_text(text: str, limit: int = 7) -> str:
    """A token's text as it fits in one cell: no surrounding spaces, at most `limit` characters."""
    text = text.strip() or "␣"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _logical_boxes(snap: Snapshot, places: Places, colors: dict, show_numbers: bool, out: PageTableLayout,
                   token_text: dict):  # fmt: skip
    """Left side: each sequence's bar and name, its logical blocks, and '⋮' for hidden ones. A cell of a
    sequence in `token_text` shows its token's text instead of the token's index."""
    bs = snap.block_size
    for (s, block_ids, count), (first, last) in zip(snap.seqs, places.seq_rows, strict=False):
        out.bars.append((-2.0, first + 0.05, last + ROW_HEIGHT - 0.05, colors[s]))
        middle = (first + last + ROW_HEIGHT) / 2
        out.labels.append(Label(-2.3, middle, f"seq {s}\n{count} tok", colors[s], 9, "right", bold=True))
        if not block_ids:
            out.labels.append(Label(0, first + MID, "(no blocks)", "grey"))
    for k, i, row in places.logical:
        s, block_ids, count = snap.seqs[k]
        filled = min(bs, count - i * bs)
        numbers = tuple(i * bs + j if j < filled else "" for j in range(bs)) if show_numbers else None
        if s in token_text:
            numbers = tuple(_cell_text(token_text[s][i * bs + j]) if j < filled else "" for j in range(bs))
        look = Look("logical", (colors[s],), filled, colors[s], 1.6)
        at = {"x": 0.0, "y": row, "cell": places.cell, "slots": bs, "numbers": numbers}
        out.boxes.append(Box(**asdict(look), **at, gid=f"logical:{s}:{i}", block_id=block_ids[i]))
        out.labels.append(Label(-0.25, row + MID, f"L{i}", "#444444", ha="right"))
    for k, row, hidden in places.logical_gaps:
        out.labels.append(Label(0.2, row + MID, f"⋮ {plural(hidden, 'more block')}", colors[snap.seqs[k][0]]))
    if places.hidden_seqs:
        text = f"+ {plural(places.hidden_seqs, 'more sequence')} not drawn"
        out.labels.append(Label(places.x_min + 0.2, places.seq_rows[-1][1] + 1.1, text, "grey", va="top"))


def _pool_boxes(snap, places, styles, show_numbers, highlight, out: PageTableLayout) -> None:
    """Right side: the physical pool, each block styled by `_pool_style`, and '⋮' for runs not drawn."""
    bs = snap.block_size
    for b, (x, y) in places.pool.items():
        look, label = styles[b]
        if b in highlight:
            out.glows.append((b, x, y, bs * places.cell))
        numbers = tuple(b * bs + j for j in range(bs)) if show_numbers else None
        at = {"x": x, "y": y, "cell": places.cell, "slots": bs, "numbers": numbers, "block_id": b}
        box = Box(**asdict(look), **at, gid=f"physical:{b}", ref_count=len(snap.owners.get(b, ())))
        out.boxes.append(box)
        color = LABEL_COLORS.get(look.kind, "black")
        out.labels.append(Label(x + box.width + 0.25, y + MID, label, color, bold=look.kind == "shared"))
    for x, y, first, last in places.pool_gaps:
        count = last - first + 1
        free = sum(1 for b in range(first, last + 1) if snap.ref_counts[b] == 0)
        text = f"⋮ block {first} not drawn" if count == 1 else f"⋮ blocks {first}–{last} not drawn ({count}"
        text += f", {free} free)" if count > 1 else f" ({'free' if free else 'in use'})"
        out.labels.append(Label(x, y + MID, text, GREY))


def _arrows(snap: Snapshot, places: Places, colors: dict, labels: dict, out: PageTableLayout) -> None:
    """Logical -> physical block; copy-on-write pairs from the end of the source block's label to the end
    of its copy's (`labels`: block -> its label text)."""
    x0 = snap.block_size * places.cell + 0.1
    for k, i, row in places.logical:
        s, b = snap.seqs[k][0], snap.seqs[k][1][i]
        if b in places.pool:
            x, y = places.pool[b]
            out.arrows.append(
                Arrow(f"arrow:{s}:{i}->{b}", (x0, row + MID), (x - 0.1, y + MID), colors[s], "map", s, b)
            )
    width = snap.block_size * places.cell

    def label_end(b: int) -> float:  # `place` leaves room by the same guess of a label's width
        return places.pool[b][0] + width + 0.55 + LABEL_CHAR * len(labels[b])

    for src, dst in snap.copies:
        if src in places.pool and dst in places.pool:
            # from just past the source's label to just past its copy's, bulging right; clear of the
            # labels of the rows in between
            (xs, ys), yd = places.pool[src], places.pool[dst][1]
            top, bottom = min(ys, yd), max(ys, yd)
            between = [b for b, (x, y) in places.pool.items() if x == xs and top < y < bottom]
            clear = max(map(label_end, between), default=0.0)
            start, end = (max(label_end(src), clear), ys + MID), (max(label_end(dst), clear), yd + MID)
            out.arrows.append(Arrow(f"copy:{src}->{dst}", start, end, "black", "copy", src, dst))


def _legend(snap: Snapshot, kinds: set[str], highlight) -> list[tuple[str, dict]]:
    """Legend entries for the kinds of block in the picture (none for a picture of plain blocks)."""
    entries = []
    if "shared" in kinds:
        text = "shared ×N: N sequences point at it (its reference count)"
        entries.append((text, {"facecolor": "white", "edgecolor": "black", "lw": 2.4}))
    if "cached" in kinds:
        text = "cached, free: reference count 0, keeps its prefix until evicted (oldest first)"
        entries.append((text, {"facecolor": CACHED_FACE, "edgecolor": CACHED_EDGE, "hatch": "////"}))
    if "pinned" in kinds:
        entries.append(("copy source: freed, kept until its copy is made", {"facecolor": GREY, "ls": ":"}))
    if snap.copies:
        entries.append(("copy-on-write: source → copy", {"line": True, "color": "black", "ls": "--"}))
    if highlight:
        entries.append(("just copied", {"facecolor": HIGHLIGHT, "edgecolor": HIGHLIGHT}))
    if entries and "free" in kinds:
        entries.append(("free", {"facecolor": FREE_FACE, "edgecolor": FREE_EDGE, "ls": "--"}))
    return entries


def _title(snap: Snapshot) -> str:
    u = snap.util
    used, slots, tokens = u["used_blocks"], u["allocated_slots"], u["num_tokens"]
    util = f", {tokens}/{slots} allocated slots hold tokens ({u['token_utilization']:.0%})" if used else ""
    seqs = plural(len(snap.seqs), "sequence")
    return f"{seqs}, block_size {snap.block_size}: {used}/{snap.num_blocks} blocks used{util}"


def _footer(snap: Snapshot, places: Places, out: PageTableLayout) -> float:
    """Column headers, the free list and the cached list under the picture; returns the lowest y used."""
    header = {"ha": "center", "va": "bottom", "size": 9, "bold": True}
    out.labels.append(Label(snap.block_size * places.cell / 2, -0.55, "logical blocks", **header))
    pool_mid = places.pool_x + (places.pool_cols * places.col_step - LABEL_ROOM) / 2
    out.labels.append(Label(pool_mid, -0.55, f"physical blocks (pool of {snap.num_blocks})", **header))
    y = places.num_rows + 0.5
    lists = [("free list (next first)", snap.free_ids)]
    if snap.cached_free:
        lists.append(("cached but free (evicted first to last)", snap.cached_free))
    for name, ids in lists:
        shown = ", ".join(map(str, ids[:16])) + (", ..." if len(ids) > 16 else "")
        out.labels.append(Label(places.x_min + 0.2, y, f"{name}: [{shown}]", "#555555", va="top"))
        y += 0.5
    return y


def page_table_layout(
    manager_or_tables,
    allocator: BlockAllocator | None = None,
    *,
    seq_ids=None,
    colors: dict | None = None,
    title: str | None = None,
    show_numbers: bool | None = None,
    max_pool_rows: int = 16,
    max_blocks: int = 64,
    max_seq_blocks: int = 8,
    max_seqs: int = 16,
    highlight=(),
    copies=(),
    token_text: dict | None = None,
) -> PageTableLayout:
    """The page-table picture as plain data: boxes, arrows, labels, legend, extent.

    `seq_ids`: which sequences to draw (default all); `colors`: {seq_id: colour}; `title`: None for
    the pool's utilization, "" for none; `show_numbers`: token/slot numbers in the cells (default: when
    they fit); at most `max_blocks` pool blocks, `max_seq_blocks` blocks per sequence and `max_seqs`
    sequences are drawn, the pool in columns of `max_pool_rows`; `highlight`: pool blocks to mark;
    `copies`: (src, dst) copy-on-write pairs already taken from the tables (drawn with the pending ones);
    `token_text`: {seq_id: one str per token}: those sequences' logical cells show each token's text (from
    a tokenizer) in place of its index, so a picture reads "text -> token -> slot".
    """
    limits = (
        as_int(max_pool_rows, "max_pool_rows", min=1),
        as_int(max_blocks, "max_blocks", min=1),
        as_int(max_seq_blocks, "max_seq_blocks", min=3),
        as_int(max_seqs, "max_seqs", min=1),
    )
    snap = snapshot(manager_or_tables, allocator, seq_ids, copies)
    token_text = _check_token_text(snap, token_text)
    colors = dict(colors or {})
    for k, (s, _, _) in enumerate(snap.seqs):
        colors.setdefault(s, seq_color(s, k))
    styles = {b: _pool_style(b, snap, colors) for b in range(snap.num_blocks)}
    labels = {b: label for b, (_, label) in styles.items()}  # each pool block's label text
    places = place(snap, {b: len(text) for b, text in labels.items()}, limits)
    if show_numbers is None:
        drawn = len(places.pool) + len(places.logical)
        show_numbers = snap.block_size <= 8 and places.num_rows <= 24 and drawn <= 48
    out = PageTableLayout(snap=snap, title=_title(snap) if title is None else title)
    highlight = {as_int(b, "highlight block") for b in highlight}
    _logical_boxes(snap, places, colors, show_numbers, out, token_text)
    _pool_boxes(snap, places, styles, show_numbers, highlight, out)
    _arrows(snap, places, colors, labels, out)
    bottom = _footer(snap, places, out)
    out.legend = _legend(snap, {styles[b][0].kind for b in places.pool}, highlight & set(places.pool))
    width = 0.42 * (places.x_max - places.x_min)
    out.legend_cols = 2 if width >= 9 else 1
    out.legend_at = (places.x_min + 0.2, bottom - 0.1)
    bottom += 0.5 * cdiv(len(out.legend), out.legend_cols) + (0.2 if out.legend else 0.0)
    out.xlim, out.ylim = (places.x_min, places.x_max), (max(bottom, places.num_rows + 1.4), -1.2)
    out.size = (min(16.0, width), min(14.0, 0.42 * (out.ylim[0] - out.ylim[1])))
    return out
