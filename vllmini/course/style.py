"""Colours and small helpers every picture in `vllmini.course` shares."""

from __future__ import annotations

# tab10 without its grey (grey means "free" here)
PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#bcbd22", "#17becf",
)  # fmt: skip
FREE_FACE, FREE_EDGE = "#f3f3f3", "#b0b0b0"
CACHED_FACE, CACHED_EDGE = "#e0f2f1", "#00897b"  # free, but still holding a cached prefix (hatched)
# the words for a free block that still holds a cached prefix, and for free blocks new sequences must leave
CACHED_FREE, RESERVED = "cached but free", "reserved by the watermark"
HIGHLIGHT = "#ffd54f"  # the glow behind a block that was just copied (copy-on-write)
ROW_HEIGHT = 0.8  # drawn height of a block row (rows are 1 apart)

PROMPT_FACE, OUTPUT_FACE, EMPTY_FACE, EMPTY_EDGE = "#4C72B0", "#DD8452", "#F4CCCC", "#C0392B"
SCHEME_COLORS = {"static": "#C0392B", "pow2": "#8E44AD", "oracle": "#7F8C8D", "paged": "#27AE60"}
# one colour per policy in every picture of the course (the three serving policies are schemes of 01)
POLICY_COLORS = {p: SCHEME_COLORS[p] for p in ("static", "oracle", "paged")}


def plural(count: int, word: str) -> str:
    """'1 token', '2 tokens'."""
    return f"{count} {word}" + ("" if count == 1 else "s")


def seq_color(seq_id, order: int = 0) -> str:
    """The colour of a sequence: fixed by an int seq_id (stable across redraws), else by its order."""
    key = seq_id if isinstance(seq_id, int) and not isinstance(seq_id, bool) else order
    return PALETTE[key % len(PALETTE)]


def assign_colors(live: list, colors: dict) -> dict:
    """Colours for the live sequences, distinct for every one: each keeps the colour it has, a new one
    gets the first not in use (PALETTE, then evenly spread hues); freed sequences give theirs back."""
    kept = {s: colors[s] for s in live if s in colors}
    used = set(kept.values())
    k = 0
    for s in live:
        if s in kept:
            continue
        while (color := _nth_color(k)) in used:
            k += 1
        kept[s] = color
        used.add(color)
    return kept


def _nth_color(k: int) -> str:
    if k < len(PALETTE):
        return PALETTE[k]
    import colorsys

    hue = ((k - len(PALETTE)) * 0.618034 + 0.05) % 1.0  # golden-ratio steps: far from the hues before
    r, g, b = colorsys.hls_to_rgb(hue, 0.38 + 0.12 * (k % 2), 0.75)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def bare(ax, keep=("bottom",)) -> None:
    """Hide the spines a schematic picture does not need."""
    for side in ("top", "right", "left", "bottom"):
        if side not in keep:
            ax.spines[side].set_visible(False)


def swatches(*styles: dict) -> list:
    """Legend handles: one small rectangle per style dict (matplotlib Rectangle keyword arguments)."""
    from matplotlib.patches import Rectangle

    return [Rectangle((0, 0), 1, 1, **style) for style in styles]
