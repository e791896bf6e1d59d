"""The explorer's widgets and its drawing thread (the part of `PageTableExplorer` that is not about
page tables): the controls, the tokens box that carries every click, and the worker that renders the
picture to PNG off the kernel's main thread."""

from __future__ import annotations

import html
import io
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from vllmini.course.page_table import draw_page_table
from vllmini.course.snapshot import Snapshot, snapshot

NEW_TOKENS = "new"  # the `starts with` choice for a sequence of tokens no other sequence has
ACTIONS = ("add", "append", "fork", "free", "step")  # the buttons whose click travels with the tokens box
TIPS = {  # what each control drives (also shown as its tooltip)
    "tokens": "how many tokens `add` starts a sequence with, and how many `append` adds",
    "seq": "the sequence that `append`, `fork` and `free` act on (a fork selects its first new sequence)",
    "samples": "how many samples `fork` makes of the selected sequence: it adds samples - 1 new sequences",
    "prefix": "what `add` starts the new sequence with: new tokens, or another sequence's tokens "
    "(its full blocks found in the prefix cache are shared, not allocated)",
    "add": "start a new sequence of `tokens` tokens, starting with `starts with`",
    "append": "grow the selected sequence by `tokens` tokens (copy-on-write if its last block is shared)",
    "fork": "make the selected sequence one of `samples` samples sharing every block (parallel sampling)",
    "free": "finish the selected sequence: its blocks go back; full cached ones stay cached but free",
    "step": "one decode step: every sequence samples 1 token (copy-on-write where a block is shared)",
}
HELP = (
    "<div style='font-size:11px;line-height:1.4;color:#555'>tokens → add, append · sequence → append, "
    "fork, free · samples → fork · starts with → add</div>"
)
CSS = (  # a toggled button looks like any other button: the toggle is only the click's messenger
    "<style>.vllmini-explorer .vllmini-action.mod-active {box-shadow: none; "
    "background-color: var(--jp-layout-color2); color: var(--jp-ui-font-color1);}</style>"
)


def in_kernel() -> bool:
    """Are we running inside a Jupyter kernel (where widgets talk to a browser)?"""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def tokens_box(**kwargs):
    """A BoundedIntText with one extra synced flag per action button (see `build_controls`)."""
    import ipywidgets as w
    from traitlets import Bool

    flags = {f"{name}_click": Bool(False).tag(sync=True) for name in ACTIONS}
    return type("TokensBox", (w.BoundedIntText,), flags)(**kwargs)


@dataclass
class Controls:
    """The explorer's widgets: its selections, one toggle button per action, the status line and the
    picture, laid out in `widget`."""

    num_tokens: object  # the tokens box (also carries every click, see `build_controls`)
    seq_select: object
    samples: object
    prefix_select: object
    buttons: dict  # action name -> its ToggleButton
    links: list  # the browser-side links button -> tokens box flag
    reset_button: object
    status: object
    image: object
    controls: object  # the selections and buttons, in one column
    widget: object  # everything: status line, then controls beside the picture

    def add_handles(self) -> None:
        """CSS classes vllmini-<name>: stable handles for the browser test."""
        named = {"explorer": self.widget, "tokens": self.num_tokens, "seq": self.seq_select}
        named |= {"samples": self.samples, "prefix": self.prefix_select, "reset": self.reset_button}
        named |= {"status": self.status, "image": self.image, **self.buttons}
        for name, widget in named.items():
            widget.add_class(f"vllmini-{name}")


def _selections(block_size: int, max_tokens: int, layout) -> tuple:
    """The tokens box and the sequence, samples and `starts with` dropdowns."""
    import ipywidgets as w

    num_tokens = tokens_box(
        value=block_size + 1, min=1, max=max_tokens, description="tokens", continuous_update=True,
        layout=layout, tooltip=TIPS["tokens"],
    )  # fmt: skip
    seq_select = w.Dropdown(options=[], description="sequence", layout=layout, tooltip=TIPS["seq"])
    samples = w.Dropdown(
        options=[2, 3, 4, 5, 6], value=2, description="samples", layout=layout, tooltip=TIPS["samples"]
    )
    prefix_select = w.Dropdown(
        options=[("new tokens", NEW_TOKENS)], description="starts with", layout=layout, tooltip=TIPS["prefix"]
    )
    return num_tokens, seq_select, samples, prefix_select


def build_controls(
    block_size: int, max_tokens: int, on_click: Callable, on_change: Callable, on_reset: Callable
) -> Controls:
    """Give `explorer` its widgets: tokens box, selections, action buttons, status line, picture.

    A click must not overtake the number typed just before it. The browser holds back a widget's update
    while its previous one is unanswered, but sends a Button's click at once, so a click could reach the
    kernel before the number. Instead each action button toggles, and the browser itself copies the
    toggle into the tokens box (jsdlink): the click then travels in the tokens box's own message stream,
    after (or in one message with) the number. The other selections are dropdowns: one message each.
    `on_click(change)` sees the flag of the clicked action change, `on_change(change)` any selection,
    `on_reset()` the reset button.
    """
    import ipywidgets as w

    wide = w.Layout(width="270px")
    selections = _selections(block_size, max_tokens, wide)
    num_tokens = selections[0]
    buttons, links = {}, []
    for name in ACTIONS:
        button = w.ToggleButton(tooltip=TIPS[name], layout=wide)
        links.append(w.jsdlink((button, "value"), (num_tokens, f"{name}_click")))
        num_tokens.observe(on_click, f"{name}_click")
        button.add_class("vllmini-action")
        buttons[name] = button
    reset_button = w.Button(description="reset: empty pool", icon="refresh", layout=wide)
    reset_button.on_click(lambda _button: on_reset())
    for widget in selections:
        widget.observe(on_change, "value")
    status = w.HTML()
    picture = w.Layout(max_width="100%", min_width="0", height="auto", flex="0 1 auto", object_fit="contain")
    image = w.Image(format="png", layout=picture)  # shrinks (keeping its shape) in narrow cells
    controls = w.VBox(
        [*selections, w.HTML(HELP), *buttons.values(), reset_button], layout=w.Layout(min_width="280px")
    )
    style = w.HTML(CSS, layout=w.Layout(display="none"))
    widget = w.VBox([style, status, w.HBox([controls, image])])
    ui = Controls(*selections, buttons, links, reset_button, status, image, controls, widget)
    ui.add_handles()
    return ui


class BackgroundPainter:
    """Redraws the explorer's picture into one reused Figure, as a PNG shown at its natural size
    (rendered at RENDER_SCALE x for sharp text), on a worker thread when `background` is set."""

    CSS_PX_PER_INCH = 96  # the picture's natural size on the page
    RENDER_SCALE = 2  # pixels rendered per CSS pixel: sharp on high-density screens, and when zoomed

    def _start_painter(self, background: bool | None) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        # In a kernel the picture is drawn on a worker thread, so a click is answered in well under a
        # millisecond and the browser seldom has to hold an update back (see build_controls).
        self.background = in_kernel() if background is None else bool(background)
        self._lock = threading.RLock()  # guards the manager and the explorer's state
        self._draw_lock = threading.Lock()  # guards the figure
        self._wake = threading.Condition()
        self._want: bool | None = None  # None: nothing to do; False: status only; True: picture too
        self._idle = threading.Event()
        self._idle.set()
        self._worker: threading.Thread | None = None
        self.figure = Figure()  # not registered with pyplot: it never pops up on its own
        FigureCanvasAgg(self.figure)  # renders PNGs headless

    def _picture_state(self) -> tuple[Snapshot, list[int]]:
        """What to draw now (call under the lock): the manager, the last action's copies highlighted."""
        copies = self.last_copies
        return snapshot(self.manager, None, None, copies), [dst for _, dst in copies]

    def render_png(self, snap: Snapshot | None = None, highlight=None) -> tuple[bytes, int]:
        """The picture as PNG bytes (the last action's copied blocks highlighted) and the width in CSS
        pixels to show it at: its natural size, at most max_width, rendered at RENDER_SCALE x."""
        if snap is None:
            with self._lock:
                snap, highlight = self._picture_state()
        with self._draw_lock:
            draw_page_table(snap, fig=self.figure, figsize=self.figsize, highlight=highlight or ())
            width = min(self.max_width, round(self.figure.get_figwidth() * self.CSS_PX_PER_INCH))
            buf = io.BytesIO()
            dpi = self.RENDER_SCALE * width / self.figure.get_figwidth()
            self.figure.savefig(buf, format="png", dpi=dpi, pil_kwargs={"compress_level": 3})
        return buf.getvalue(), width

    def refresh(self, picture: bool = True) -> None:
        """Show the current state: redraw (unless picture=False), then swap the picture and the status
        line together, so the status never runs ahead. In the background, this only asks the worker."""
        if not self.background:
            self._update(picture)
            return
        with self._wake:
            self._want = picture or bool(self._want)
            self._idle.clear()
            self._wake.notify()
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="page-table-explorer", daemon=True)
                self._worker.start()

    def wait(self, timeout: float = 60.0) -> bool:
        """Block until the picture and status show the current state (True), or `timeout` passed."""
        return self._idle.wait(timeout)

    def _update(self, picture: bool) -> None:
        with self._lock:  # one consistent state for both: the status and the snapshot to draw
            status = self._status_html()
            snap, highlight = self._picture_state() if picture else (None, None)
        if picture:
            png, width = self.render_png(snap, highlight)
            self.image.layout.width = f"{width}px"
            self.image.value = png
        self.status.value = status

    def _work(self) -> None:
        try:  # drawing yields the CPU to the kernel's main thread, which answers the browser
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass  # not Linux: no per-thread priority
        while True:
            with self._wake:
                while self._want is None:
                    self._wake.wait()
                while self._wake.wait(timeout=0.03):  # let a quick run of clicks finish first
                    pass
                picture, self._want = self._want, None
            try:
                self._update(picture)
            except Exception as e:  # keep the worker alive; say what happened where the learner looks
                self.status.value = f"<pre>explorer could not draw: {html.escape(repr(e))}</pre>"
            with self._wake:
                if self._want is None:
                    self._idle.set()
