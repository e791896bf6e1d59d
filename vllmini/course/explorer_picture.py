"""The explorer's picture, as SVG text: a window of the pool, zoomed, and an overview of all of it.

Top: the overview, one small cell per physical block of the whole pool, coloured by what holds it (the
window shown below is outlined). Below: the window, at most `WINDOW` physical blocks (one page of the
pool) with their labels, the sequences that hold them (each logical block, an arrow to its physical
block, or "→ id" when that block is on another page), then the free and cached lists and a legend with
an entry for every mark. A logical slot shows its token's index, or with `token_text` (an explorer with a
tokenizer) its token's text, in wider logical blocks. The size depends only on the pool (num_blocks,
block_size) and on that choice, so the page never jumps; all text is at least `SMALL` px. Building the
text takes milliseconds, where a matplotlib PNG took seconds (see benchmarks/bench_explorer.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape

from vllmini.checks import cdiv
from vllmini.course.snapshot import Snapshot
from vllmini.course.style import (
    CACHED_EDGE,
    CACHED_FACE,
    CACHED_FREE,
    FREE_EDGE,
    FREE_FACE,
    HIGHLIGHT,
    plural,
)

WINDOW_ROWS = 16  # pool blocks per column of the window, and rows for the sequences beside it
FONT, SMALL = 12, 11  # px: labels; slot numbers and the smallest text
ROW, BOX = 28, 22  # px: from row to row; a block's height
BLOCK_W = 96  # px: a block's width (its slots share it)
SEQ_W = 130  # px: the column of sequence names
POOL_LABEL_W = 140  # px: right of a pool block, for its label
GAP = 70  # px: between the two sides, for the arrows
MAX_ROWS_PER_SEQ = 4  # a longer sequence shows its first blocks, a gap and its last block
MAX_STRIPES = 3  # a block shared by more sequences shows the first two and a grey "more" stripe
SHARED_FRAME, PINNED, GREY = "#111111", "#888888", "#777777"
LEGEND_ENTRIES = 6
LABEL_CHAR = 6.6  # px: about the width of one character of a label
TEXT_CELL, TEXT_BLOCK_W = 54, 240  # px: a logical slot showing text, and at most its block
TEXT_CHAR = 6.2  # px: about the width of one character of a slot's text (SMALL)
VISIBLE = str.maketrans({" ": "·", "\n": "↵", "\t": "⇥"})  # whitespace in a slot's text
OVERVIEW_COLORS = {"free": "#e4e4e4", "cached": CACHED_EDGE, "shared": SHARED_FRAME, "pinned": PINNED}


@dataclass
class Frame:
    """Where things go: fixed by the pool alone."""

    num_blocks: int
    block_size: int
    window: int = 0  # pool blocks per page
    cols: int = 1
    width: int = 0
    strip_cell: int = 0
    strip_per_row: int = 0
    strip_h: int = 0
    top: int = 0  # y of the first row of blocks
    height: int = 0
    pool_x: int = 0
    cell: float = 0.0
    numbers: bool = True
    legend_cols: int = 1
    text: bool = False  # logical slots wide enough for a token's text
    logical_cell: float = 0.0
    logical_numbers: bool = True
    text_chars: int = 0  # characters of text that fit a logical slot

    def __post_init__(self):
        self.window = min(self.num_blocks, 2 * WINDOW_ROWS)
        self.cols = cdiv(self.window, WINDOW_ROWS)
        self.cell = BLOCK_W / self.block_size
        self.logical_cell = self.cell
        if self.text:  # wider slots (up to TEXT_CELL, TEXT_BLOCK_W a block) where 3 characters then fit
            cell = max(self.cell, min(TEXT_CELL, TEXT_BLOCK_W / self.block_size))
            self.logical_cell = cell if cell - 4 >= 3 * TEXT_CHAR else self.cell
        self.pool_x = SEQ_W + 44 + self.logical_w + GAP
        self.width = self.pool_x + self.cols * (BLOCK_W + POOL_LABEL_W) + 24  # + room for copy arcs
        self.strip_cell = max(4, min(18, (self.width - 20) // self.num_blocks))
        self.strip_per_row = (self.width - 20) // self.strip_cell
        self.strip_h = cdiv(self.num_blocks, self.strip_per_row) * (self.strip_row + 1)
        self.top = 26 + self.strip_h + 34
        self.legend_cols = 2 if self.width >= 900 else 1
        self.height = self.top + WINDOW_ROWS * ROW + 2 * 20 + cdiv(LEGEND_ENTRIES, self.legend_cols) * 22 + 8
        digits = len(str(self.num_blocks * self.block_size - 1))
        self.numbers = self.cell >= 0.62 * SMALL * digits + 4  # slot numbers only where they fit
        self.logical_numbers = self.logical_cell >= 0.62 * SMALL * digits + 4
        self.text_chars = int((self.logical_cell - 4) // TEXT_CHAR) if self.text else 0

    @property
    def logical_w(self) -> int:
        return round(self.logical_cell * self.block_size)

    @property
    def strip_row(self) -> int:
        return max(self.strip_cell, 12)

    @property
    def num_pages(self) -> int:
        return cdiv(self.num_blocks, self.window)


@dataclass
class Picture:
    """The SVG text, plus what tests and the status line read from it."""

    svg: str
    page: int
    blocks: range  # the physical blocks in the window
    seqs: list  # the sequences drawn beside it, in order
    hidden_seqs: int  # live sequences not drawn beside it (they are in the overview)
    gids: list[str] = field(default_factory=list)


def block_kind(b: int, snap: Snapshot) -> str:
    """ "cached" (free, still named in the prefix cache), "free", "pinned" (freed, kept as the source of
    a pending copy), "shared" (several owners) or "used" (one)."""
    if b in snap.cached_free:
        return "cached"
    if snap.ref_counts[b] == 0:
        return "free"
    owners = snap.owners.get(b, [])
    if not owners:
        return "pinned"
    return "shared" if len(owners) > 1 else "used"


def _text(x, y, text, size=FONT, color="#222222", anchor="start", bold=False) -> str:
    weight = " font-weight='bold'" if bold else ""
    return (
        f"<text x='{x:.1f}' y='{y:.1f}' font-size='{size}' fill='{color}' text-anchor='{anchor}' "
        f"dominant-baseline='central'{weight}>{escape(str(text))}</text>"
    )


def _rect(x, y, w, h, fill, stroke="none", width=1.0, dash=None, gid=None) -> str:
    extra = f" stroke-dasharray='{dash}'" if dash else ""
    extra += f" data-gid='{gid}'" if gid else ""
    return (
        f"<rect x='{x:.1f}' y='{y:.1f}' width='{w:.1f}' height='{h:.1f}' fill='{fill}' stroke='{stroke}' "
        f"stroke-width='{width}'{extra}/>"
    )


def _block(out, f: Frame, x, y, stripes, filled, frame, width, dash, labels, gid, plain=False, cell=None):
    """One block of slots `cell` px wide (default: a pool slot's): `filled` slots coloured (one stripe
    per owner), the rest white, each slot's label (None: no labels), a frame."""
    cell = cell or f.cell
    out.append(_rect(x, y, cell * f.block_size, BOX, "white"))
    h = BOX / len(stripes)
    for k, color in enumerate(stripes):
        if filled:
            out.append(_rect(x, y + k * h, filled * cell, h, color))
    if cell >= 10:
        for j in range(1, f.block_size):
            line = "white" if j < filled and not plain else "#cccccc"
            out.append(f"<line x1='{x + j * cell:.1f}' y1='{y}' x2='{x + j * cell:.1f}' y2='{y + BOX}' "
                       f"stroke='{line}' stroke-width='0.8'/>")  # fmt: skip
    for j, label in enumerate(labels or ()):
        color = "white" if j < filled and not plain else "#555555"
        out.append(_text(x + (j + 0.5) * cell, y + BOX / 2, label, SMALL, color, "middle"))
    out.append(_rect(x, y, cell * f.block_size, BOX, "none", frame, width, dash, gid))


def _slot_text(text: str, chars: int) -> str:
    """A token's text in at most `chars` characters: whitespace shown (VISIBLE), other characters that
    do not print escaped (\\x07), "∅" for no text, cut with "…"."""
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text.translate(VISIBLE)) or "∅"
    return shown if len(shown) <= chars else shown[: chars - 1] + "…"


def _pool_look(b: int, kind: str, snap: Snapshot, colors: dict) -> tuple:
    """(stripes, filled slots, frame colour, frame width, dash, label) of physical block `b`."""
    bs = snap.block_size
    if kind == "cached":
        first = " (1st out)" if b == snap.cached_free[0] else ""
        return (CACHED_FACE,), bs, CACHED_EDGE, 2.0, None, f"{b} {CACHED_FREE}{first}"
    if kind == "free":
        return (
            (FREE_FACE,),
            bs,
            FREE_EDGE,
            1.2,
            "4 3",
            f"{b} free" + (" (next)" if b == snap.free_ids[0] else ""),
        )
    filled = snap.fill.get(b, 0)
    if kind == "pinned":
        return (PINNED,), filled, GREY, 1.6, "2 2", f"{b} copy source"
    owners = [colors.get(s, GREY) for s in snap.owners[b]]
    stripes = tuple(dict.fromkeys(owners))
    if len(stripes) > MAX_STRIPES:
        stripes = (*stripes[: MAX_STRIPES - 1], GREY)
    notes = [f"copy of {src}" for src, dst in snap.copies if dst == b]
    notes += ["cached"] if b in snap.cached else []
    notes = f" ({', '.join(notes)})" if notes else ""
    if kind == "shared":
        return stripes, filled, SHARED_FRAME, 2.6, None, f"{b} shared ×{len(owners)}{notes}"
    return stripes, filled, stripes[0], 1.6, None, f"{b}{notes}"


def _overview(out, f: Frame, snap: Snapshot, kinds: list, colors: dict, blocks: range) -> None:
    c, h = f.strip_cell, f.strip_row
    out.append(_text(10, 12, f"the whole pool: {plural(f.num_blocks, 'block')}, one cell each "
                     f"(outlined: blocks {blocks.start}–{blocks.stop - 1}, drawn below)",
                     SMALL, "#444444"))  # fmt: skip
    for b, kind in enumerate(kinds):
        row, col = divmod(b, f.strip_per_row)
        fill = colors.get(snap.owners[b][0], GREY) if kind == "used" else OVERVIEW_COLORS[kind]
        out.append(_rect(10 + col * c, 24 + row * (h + 1), c - 1, h, fill))
    for row in range(blocks.start // f.strip_per_row, (blocks.stop - 1) // f.strip_per_row + 1):
        lo = max(blocks.start, row * f.strip_per_row) - row * f.strip_per_row
        hi = min(blocks.stop, (row + 1) * f.strip_per_row) - row * f.strip_per_row
        y = 24 + row * (h + 1)
        out.append(_rect(9 + lo * c, y - 1.5, (hi - lo) * c + 1, h + 3, "none", "#000000", 1.5))


def _choose_seqs(snap: Snapshot, blocks: range, focus: list) -> tuple[list, int]:
    """The sequences drawn beside the window: the last action's first, then those holding a block in the
    window, then the others, as many as fit in WINDOW_ROWS rows."""
    in_window = [k for k, (_, ids, _) in enumerate(snap.seqs) if any(b in blocks for b in ids)]
    by_id = {s: k for k, (s, _, _) in enumerate(snap.seqs)}
    focus = [by_id[s] for s in focus if s in by_id]
    first = [k for k in focus if k in in_window]  # the last action's, where it happened
    order = list(dict.fromkeys([*first, *in_window, *focus, *range(len(snap.seqs))]))
    chosen, rows = [], 0
    for k in order:
        need = min(max(1, len(snap.seqs[k][1])), MAX_ROWS_PER_SEQ)
        if rows + need > WINDOW_ROWS:
            break
        chosen.append(k)
        rows += need
    chosen.sort()
    return chosen, len(snap.seqs) - len(chosen)


def page_of(block_id: int, num_blocks: int) -> int:
    """The window page that shows `block_id`."""
    return block_id // Frame(num_blocks, 1).window


def draw_explorer_picture(
    snap: Snapshot, colors: dict, page: int = 0, highlight=(), focus=(), token_text: dict | None = None
) -> Picture:
    """The picture for `snap`: the window `page` of the pool, `highlight`ed blocks glowing, the
    sequences in `focus` (the last action's) drawn first beside it. `colors`: seq_id -> colour.
    `token_text`: None, each logical slot shows its token's index; a dict {seq_id: one str or None per
    token} (may be empty), the logical blocks are wider and a slot shows its token's text where known."""
    f = Frame(snap.num_blocks, snap.block_size, text=token_text is not None)
    page = max(0, min(page, f.num_pages - 1))
    blocks = range(page * f.window, min(snap.num_blocks, (page + 1) * f.window))
    kinds = [block_kind(b, snap) for b in range(snap.num_blocks)]
    out: list[str] = []
    _overview(out, f, snap, kinds, colors, blocks)
    lx = SEQ_W + 44  # left edge of the logical blocks
    out.append(_text(lx + f.logical_w / 2, f.top - 14, "logical blocks", FONT, anchor="middle", bold=True))
    pages = f" (page {page + 1} of {f.num_pages})" if f.num_pages > 1 else ""
    header = f"physical blocks {blocks.start}–{blocks.stop - 1} of {snap.num_blocks}{pages}"
    out.append(_text(f.pool_x, f.top - 14, header, FONT, bold=True))
    where, labels = _pool_window(out, f, snap, kinds, colors, blocks, highlight)
    chosen, hidden = _choose_seqs(snap, blocks, list(focus))
    _sequences(out, f, snap, colors, chosen, where, lx, token_text or {})
    _copy_arcs(out, snap, where, labels)
    _footer(out, f, snap, hidden)
    return Picture(_svg(f, out), page, blocks, [snap.seqs[k][0] for k in chosen], hidden)


def _pool_window(out, f: Frame, snap: Snapshot, kinds, colors, blocks, highlight) -> tuple[dict, dict]:
    """The window's physical blocks; returns block -> (x, y) and block -> its label."""
    where, labels = {}, {}
    for j, b in enumerate(blocks):
        col, r = divmod(j, WINDOW_ROWS)
        x, y = f.pool_x + col * (BLOCK_W + POOL_LABEL_W), f.top + r * ROW
        where[b] = (x, y)
        if b in highlight:
            out.append(_rect(x - 5, y - 4, BLOCK_W + 10, BOX + 8, HIGHLIGHT, gid=f"highlight:{b}"))
        stripes, filled, frame, width, dash, label = _pool_look(b, kinds[b], snap, colors)
        labels[b] = label
        numbers = [b * snap.block_size + i for i in range(snap.block_size)] if f.numbers else None
        plain = kinds[b] in ("free", "cached")
        _block(out, f, x, y, stripes, filled, frame, width, dash, numbers, f"physical:{b}", plain)
        color = {"cached": CACHED_EDGE, "free": "#666666"}.get(kinds[b], "#222222")
        out.append(_text(x + BLOCK_W + 6, y + BOX / 2, label, FONT, color, bold=kinds[b] == "shared"))
    return where, labels


def _slot_labels(f: Frame, texts, first: int, filled: int) -> list | None:
    """The labels of a logical block's slots: a token's text where known and it fits, else its index
    where that fits, else nothing (None: no slot has room for a label)."""
    if not f.logical_numbers and f.text_chars < 3:
        return None
    labels = []
    for t in range(first, first + filled):
        text = texts[t] if texts and f.text_chars >= 3 else None
        labels.append(_slot_text(text, f.text_chars) if text is not None else t if f.logical_numbers else "")
    return labels + [""] * (f.block_size - filled)


def _sequences(out, f: Frame, snap: Snapshot, colors, chosen, where, lx, token_text: dict) -> None:
    """The chosen sequences' logical blocks, each with an arrow to its physical block in the window."""
    bs, top, arrows, row = snap.block_size, f.top, [], 0
    for k in chosen:
        s, ids, count = snap.seqs[k]
        shown = list(range(len(ids)))
        if len(ids) > MAX_ROWS_PER_SEQ:
            shown = [*range(MAX_ROWS_PER_SEQ - 2), None, len(ids) - 1]
        y0 = top + row * ROW
        out.append(
            _text(SEQ_W - 8, y0 + BOX / 2, f"seq {s} · {count} tok", FONT, colors[s], "end", bold=True)
        )
        rows = max(1, len(shown))
        out.append(_rect(SEQ_W - 2, y0, 4, (rows - 1) * ROW + BOX, colors[s]))
        for i in shown:
            y = top + row * ROW
            row += 1
            if i is None:
                more = plural(len(ids) - MAX_ROWS_PER_SEQ + 1, "more block")
                out.append(_text(lx + 6, y + BOX / 2, f"⋮ {more}", FONT, colors[s]))
                continue
            b, filled = ids[i], min(bs, count - i * bs)
            out.append(_text(lx - 5, y + BOX / 2, f"L{i}", SMALL, "#444444", "end"))
            labels = _slot_labels(f, token_text.get(s), i * bs, filled)
            look = ((colors[s],), filled, colors[s], 1.6, None, labels, f"logical:{s}:{i}")
            _block(out, f, lx, y, *look, cell=f.logical_cell)
            if b in where:
                x, yb = where[b]
                arrows.append(
                    (lx + f.logical_w + 2, y + BOX / 2, x - 3, yb + BOX / 2, colors[s], f"arrow:{s}:{i}->{b}")
                )
            else:
                out.append(_text(lx + f.logical_w + 5, y + BOX / 2, f"→ {b}", SMALL, colors[s]))
        if not ids:
            out.append(_text(lx, top + row * ROW + BOX / 2, "(no blocks)", SMALL, GREY))
            row += 1
    for x0, y0, x1, y1, color, gid in arrows:
        out.append(f"<g data-gid='{gid}'><line x1='{x0:.1f}' y1='{y0:.1f}' x2='{x1:.1f}' y2='{y1:.1f}' "
                   f"stroke='{color}' stroke-width='1.4'/>{_head(x0, y0, x1, y1, color)}</g>")  # fmt: skip


def _copy_arcs(out, snap: Snapshot, where, labels) -> None:
    """Copy-on-write arcs, from just past the source's label to just past its copy's."""
    for src, dst in snap.copies:
        if src in where and dst in where:
            (xs, ys), (xd, yd) = where[src], where[dst]
            ends = [x + BLOCK_W + 10 + LABEL_CHAR * len(labels[b]) for b, x in ((src, xs), (dst, xd))]
            x = min(max(ends) + 26, max(xs, xd) + BLOCK_W + POOL_LABEL_W + 20)
            start, end = (ends[0], ys + BOX / 2), (ends[1], yd + BOX / 2)
            out.append(f"<g data-gid='copy:{src}->{dst}'><path d='M {start[0]:.1f} {start[1]} C {x:.1f} "
                       f"{ys + BOX / 2}, {x:.1f} {yd + BOX / 2}, {end[0]:.1f} {end[1]}' fill='none' "
                       "stroke='black' "
                       f"stroke-dasharray='5 3' stroke-width='1.4'/>"
                       f"{_head(x, end[1], *end, 'black')}</g>")  # fmt: skip


def _footer(out, f: Frame, snap: Snapshot, hidden: int) -> None:
    y = f.top + WINDOW_ROWS * ROW + 4
    more = f"; {plural(hidden, 'more sequence')} not drawn here (see the overview)" if hidden else ""
    for name, ids in (
        ("free list (next first)", snap.free_ids),
        (f"{CACHED_FREE} (evicted first to last)", snap.cached_free),
    ):
        shown = ", ".join(map(str, ids[:12])) + (", …" if len(ids) > 12 else "")
        out.append(_text(10, y + 8, f"{name}: [{shown}]" + more, SMALL, "#444444"))
        y, more = y + 20, ""
    entries = [
        ("seq colour: that sequence's tokens (colours go to live sequences)", {"fill": "#1f77b4"}),
        ("shared ×N: N sequences point at it (its reference count)",
         {"fill": "white", "stroke": SHARED_FRAME, "width": 2.6}),
        (f"{CACHED_FREE}: free, keeps its prefix until evicted (oldest first)",
         {"fill": CACHED_FACE, "stroke": CACHED_EDGE, "width": 2}),
        ("free", {"fill": FREE_FACE, "stroke": FREE_EDGE, "dash": "4 3"}),
        ("just copied (copy-on-write); dashed arc: source → copy", {"fill": HIGHLIGHT}),
        ("copy source: freed, kept until its copy is made", {"fill": PINNED, "dash": "2 2", "stroke": GREY}),
    ]  # fmt: skip
    assert len(entries) == LEGEND_ENTRIES
    half = (f.width - 20) / f.legend_cols
    for n, (text, style) in enumerate(entries):
        row, col = divmod(n, f.legend_cols)
        x, yy = 10 + col * half, y + 4 + row * 22
        stroke, width, dash = style.get("stroke", "none"), style.get("width", 1), style.get("dash")
        out.append(_rect(x, yy, 26, 14, style["fill"], stroke, width, dash, gid=f"legend:{n}"))
        out.append(_text(x + 32, yy + 7, text, SMALL, "#333333"))


def _head(x0, y0, x1, y1, color) -> str:
    """An arrowhead at (x1, y1), pointing away from (x0, y0)."""
    dx, dy = x1 - x0, y1 - y0
    n = max((dx * dx + dy * dy) ** 0.5, 1e-9)
    ux, uy = dx / n, dy / n
    bx, by = x1 - 8 * ux, y1 - 8 * uy
    pts = [(x1, y1), (bx - 3.5 * uy, by + 3.5 * ux), (bx + 3.5 * uy, by - 3.5 * ux)]
    return f"<polygon points='{' '.join(f'{x:.1f},{y:.1f}' for x, y in pts)}' fill='{color}'/>"


def _svg(f: Frame, body: list[str]) -> str:
    return (
        f"<svg xmlns='http://www.w3.org/2000/svg' class='vllmini-picture' width='{f.width}' "
        f"height='{f.height}' "
        f"viewBox='0 0 {f.width} {f.height}' font-family='Liberation Sans, Arial, Helvetica, sans-serif'>"
        f"{''.join(body)}</svg>"
    )
