"""`PageTableExplorer`: the page-table picture with buttons, in ipywidgets, to try paging and sharing.

A learner adds sequences (new tokens, or starting with another sequence's tokens: a prefix-cache hit
shares its full blocks), appends tokens (copy-on-write when the last block is shared), forks a sequence
into n samples, frees one (its full blocks stay cached but free), runs a decode step, and watches the
picture. The state and its messages live in `playground`; widgets and the drawing thread in
`explorer_widgets`.
"""

from __future__ import annotations

import functools
import html

from vllmini.checks import as_int, one_of
from vllmini.course.explorer_widgets import ACTIONS, NEW_TOKENS, BackgroundPainter, build_controls
from vllmini.course.playground import PageTablePlayground
from vllmini.course.style import plural
from vllmini.errors import VllminiError


def _locked(method):
    """Run an explorer method under the explorer's lock (the picture is drawn on another thread)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class PageTableExplorer(BackgroundPainter):
    """Add, grow, fork, free and step sequences with buttons and watch the page table change.

    The picture is a PNG in an `ipywidgets.Image`, redrawn after every action, so it updates in place
    (no flicker, no ipympl needed). Errors such as running out of blocks are shown in the status line
    (and kept in `last_error`), never raised, and leave state and picture unchanged. `click(name)`
    clicks a button from code; in a Jupyter kernel the drawing runs on a worker thread (`background`)
    and `wait()` blocks until the picture shows the current state. `prefix_caching=False` runs the pool
    without a prefix cache (freed blocks are plainly free).
    """

    def __init__(
        self,
        num_blocks: int = 16,
        block_size: int = 4,
        *,
        figsize=None,
        max_width: int = 1000,
        background: bool | None = None,
        prefix_caching: bool = True,
    ):
        self.num_blocks = as_int(num_blocks, "num_blocks", min=1)
        self.block_size = as_int(block_size, "block_size", min=1)
        self.max_width = as_int(max_width, "max_width", min=100)
        self.figsize = figsize
        self.prefix_caching = prefix_caching
        self.playground = PageTablePlayground(self.num_blocks, self.block_size, prefix_caching)
        self.last_error: str | None = None
        self.last_action = "empty pool: add a sequence"
        self.history: list[str] = []  # what every successful action did, oldest first (reset empties it)
        self._start_painter(background)
        self.ui = build_controls(
            self.block_size,
            max_tokens=self.num_blocks * self.block_size,
            on_click=self._on_click,
            on_change=self._label_buttons,
            on_reset=self.reset,
        )
        ui = self.ui
        self.num_tokens, self.seq_select, self.samples = ui.num_tokens, ui.seq_select, ui.samples
        self.prefix_select, self.reset_button = ui.prefix_select, ui.reset_button
        self.status, self.image, self.controls, self.widget = ui.status, ui.image, ui.controls, ui.widget
        self.add_button, self.append_button = ui.buttons["add"], ui.buttons["append"]
        self.fork_button, self.free_button = ui.buttons["fork"], ui.buttons["free"]
        self.step_button = ui.buttons["step"]
        self._label_buttons()
        self.refresh()

    @property
    def manager(self):
        """The explorer's `BlockManager` (with a prefix cache unless prefix_caching=False)."""
        return self.playground.manager

    @property
    def next_seq_id(self) -> int:
        return self.playground.next_seq_id

    @property
    def last_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write pairs (src_block, dst_block) the last action made."""
        return self.playground.last_copies

    # ---- actions (the buttons call these; tests and notebooks may call them directly)

    @_locked
    def add_sequence(self, num_tokens: int | None = None, prefix_of=None):
        """Start a new sequence of `num_tokens` tokens (default: the tokens box), starting with the tokens
        of sequence `prefix_of`, or "new" tokens (default: the `starts with` selection). Returns its id
        or None."""
        count = self.num_tokens.value if num_tokens is None else num_tokens
        choice = self.prefix_select.value if prefix_of is None else prefix_of
        prefix_of = None if choice == NEW_TOKENS else choice
        seq_id = self.next_seq_id
        if self._try(lambda: self.playground.add(count, prefix_of)):
            self._refresh_select(seq_id)
            return seq_id
        return None

    @_locked
    def append(self, seq_id=None, num_tokens: int | None = None) -> None:
        """Grow `seq_id` (default: the selected one) by `num_tokens` (default: the tokens box)."""
        seq_id = self.seq_select.value if seq_id is None else seq_id
        count = self.num_tokens.value if num_tokens is None else num_tokens
        if not self._no_seq(seq_id) and self._try(lambda: self.playground.append(seq_id, count)):
            self.refresh()

    @_locked
    def fork(self, seq_id=None, num_samples: int | None = None):
        """Make `seq_id` (default: the selected one) one of `num_samples` samples (default: the samples
        box): num_samples - 1 new sequences, the next ids, share all its blocks. Returns the first new
        id (selected) or None."""
        seq_id = self.seq_select.value if seq_id is None else seq_id
        num_samples = self.samples.value if num_samples is None else num_samples
        if self._no_seq(seq_id):
            return None
        first = self.next_seq_id

        def fork():
            children, message = self.playground.fork(seq_id, num_samples)
            selected = " (now selected)" if len(children) == 1 else f" (now selected: seq {first})"
            return f"{message}{selected}; they share every block"

        if not self._try(fork):
            return None
        self._refresh_select(first)
        return first

    @_locked
    def free(self, seq_id=None) -> None:
        """Finish `seq_id` (default: the selected one): its blocks go back to the pool."""
        seq_id = self.seq_select.value if seq_id is None else seq_id
        if not self._no_seq(seq_id) and self._try(lambda: self.playground.free(seq_id)):
            self._refresh_select(None)

    @_locked
    def step(self) -> None:
        """One decode step: every sequence samples one token."""
        if self._try(self.playground.step):
            self.refresh()

    @_locked
    def reset(self) -> None:
        """Start over with an empty pool (sequence ids start at 0 again)."""
        self.playground = PageTablePlayground(self.num_blocks, self.block_size, self.prefix_caching)
        self.last_error = None
        self.last_action = "reset: empty pool"
        self.history = []
        self._refresh_select(None)

    def click(self, name: str) -> None:
        """Click the button `name` ("add", "append", "fork", "free" or "step") as the browser does: flip
        its flag on the tokens box."""
        one_of(name, "name", ACTIONS)
        flag = f"{name}_click"
        setattr(self.num_tokens, flag, not getattr(self.num_tokens, flag))

    def _on_click(self, change) -> None:
        action = change["name"].removesuffix("_click")  # every action's method has its name, but add's
        getattr(self, "add_sequence" if action == "add" else action)()

    # ---- helpers

    def _try(self, action) -> bool:
        """Run one playground action. On success remember its message; on a VllminiError (the state is
        unchanged) show it, and keep the picture as it is."""
        try:
            message = action()
        except VllminiError as e:
            self.last_error = f"{type(e).__name__}: {e}"
            self.refresh(picture=False)
            return False
        self.last_error = None
        self.last_action = message
        self.history.append(message)
        return True

    def _no_seq(self, seq_id) -> bool:
        if seq_id is not None:
            return False
        self.last_error = "no sequence selected: add one first"
        self.refresh(picture=False)
        return True

    def _refresh_select(self, value) -> None:
        """New dropdown options (live sequences; every sequence as a prefix source), labels, picture."""
        ids, tokens = self.manager.seq_ids, self.playground.tokens
        self.seq_select.options = [(f"seq {s}", s) for s in ids]
        if value in ids:
            self.seq_select.value = value
        elif ids and self.seq_select.value not in ids:
            self.seq_select.value = ids[0]
        prefix = self.prefix_select.value
        self.prefix_select.options = [("new tokens", NEW_TOKENS)] + [
            (f"seq {s}'s {len(t)} tokens" + ("" if s in ids else " (freed)"), s) for s, t in tokens.items()
        ]
        self.prefix_select.value = prefix if prefix in tokens else NEW_TOKENS
        self._label_buttons()
        self.refresh()

    def _label_buttons(self, _change=None) -> None:
        """The buttons say what they will do, with the current tokens, selection and samples."""
        count, seq, samples = self.num_tokens.value, self.seq_select.value, self.samples.value
        tokens, prefix = plural(count, "token"), self.prefix_select.value
        source = self.playground.tokens.get(prefix)  # None: new tokens (or a source a reset forgot)
        if source is None:
            self.add_button.description = f"add a sequence of {tokens}"
        else:
            head = min(count, len(source))
            new = f" + {count - head} new" if count > head else ""
            self.add_button.description = f"add {tokens}: seq {prefix}'s first {head}{new}"
        none = seq is None
        first = self.next_seq_id
        children = (
            f"seq {first}" if samples == 2 else f"seqs {first}–{first + samples - 2} ({samples} samples)"
        )
        self.append_button.description = "append (no sequence)" if none else f"append {tokens} to seq {seq}"
        self.fork_button.description = "fork (no sequence)" if none else f"fork seq {seq} → {children}"
        self.free_button.description = "free (no sequence)" if none else f"free seq {seq}"
        self.step_button.description = "step (no sequence)" if none else "step: every sequence +1 token"
        for button in (self.append_button, self.fork_button, self.free_button, self.step_button):
            button.disabled = none

    def status_text(self) -> str:
        """The status line as plain text: last action or error, then the free list and utilization."""
        u = self.manager.utilization()
        free = list(self.manager.allocator.free_block_ids)
        shown = ", ".join(map(str, free[:16])) + (", ..." if len(free) > 16 else "")
        cached = self.manager.num_cached_free_blocks
        cached = f" ({cached} of them cached)" if cached else ""
        head = f"error: {self.last_error}" if self.last_error else self.last_action
        share = f"{u['token_utilization']:.0%}" if u["allocated_slots"] else "-"  # nothing allocated yet
        return (
            f"{head}\n{u['free_blocks']} of {self.num_blocks} blocks free{cached}, next first: [{shown}] | "
            f"{u['num_tokens']} tokens in {u['allocated_slots']} allocated slots ({share}) | "
            f"pool {u['pool_utilization']:.0%}"
        )

    def _status_html(self) -> str:
        head, tail = self.status_text().split("\n", 1)
        color = "#c62828" if self.last_error else "#333333"
        return (
            f"<div style='font-family:monospace;font-size:12px;line-height:1.5'>"
            f"<b style='color:{color}'>{html.escape(head)}</b><br>{html.escape(tail)}</div>"
        )

    def display(self) -> None:
        """Show the widget; where widgets cannot render (a saved notebook not yet run), a short hint
        stands in for the raw VBox(...) repr."""
        from IPython.display import display

        view = {"model_id": self.widget.model_id, "version_major": 2, "version_minor": 0}
        hint = f"PageTableExplorer({self.num_blocks} blocks of {self.block_size}): run this cell to use it"
        display({"application/vnd.jupyter.widget-view+json": view, "text/plain": hint}, raw=True)

    def _ipython_display_(self) -> None:
        self.display()
