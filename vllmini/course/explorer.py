"""`PageTableExplorer`: the page-table picture with buttons, to try paging and sharing in JupyterLab.

A learner adds sequences (new tokens, or starting with another sequence's tokens: a prefix-cache hit
shares its full blocks), appends tokens (copy-on-write when the last block is shared), forks a sequence
into n samples, frees one (its full blocks stay cached but free), runs a decode step, and watches the
picture. With a tokenizer, `add_text("The capital of France is")` adds a sequence of real tokens and
each of its slots shows its token's text. The state and its messages live in `playground`; the widget,
the message each click sends and the drawing thread in `explorer_widgets`; the picture in
`explorer_picture`.
"""

from __future__ import annotations

import functools
import html
from collections import deque

from vllmini.checks import as_int, as_token_ids, one_of
from vllmini.course.explorer_picture import Picture, draw_explorer_picture, page_of
from vllmini.course.explorer_widgets import ACTIONS, NEW_TOKENS, BackgroundPainter, explorer_view, read_int
from vllmini.course.playground import MAX_SAMPLES, PageTablePlayground, free_blocks_text
from vllmini.course.snapshot import snapshot
from vllmini.course.style import assign_colors, plural
from vllmini.errors import InvalidArgumentError, InvalidTypeError, VllminiError

FIELDS = ("tokens", "seq", "samples", "prefix")  # the boxes a click reads


def _locked(method):
    """Run an explorer method under the explorer's lock (the picture is drawn on another thread)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class PageTableExplorer(BackgroundPainter):
    """Add, grow, fork, free and step sequences with buttons and watch the page table change.

    Each click reaches the kernel as one message holding the action and the boxes' text at that moment;
    the messages are queued and applied once each, in order (`applied` counts them). A box's text must
    be a whole number in range: anything else is refused with a message beside the box and changes
    nothing. Errors such as running out of blocks go to the status line (and `last_error`), never
    raised, and leave state and picture unchanged. `click(name, **boxes)` sends a click from code, as
    the browser does. In a kernel the picture is drawn on a worker thread (`background`); `wait()`
    blocks until it shows the current state. `prefix_caching=False` runs the pool without a prefix
    cache; `watermark_blocks` keeps that many blocks free for running sequences when adding new ones.
    `tokenizer` (anything with `encode(text)` and `decode(ids)`, e.g. the course model's
    `tokenizers.Tokenizer`) lets `add_text`/`append_text` add real tokens, whose slots show their text.
    """

    def __init__(
        self,
        num_blocks: int = 16,
        block_size: int = 4,
        *,
        background: bool | None = None,
        prefix_caching: bool = True,
        watermark_blocks: int = 0,
        tokenizer=None,
    ):
        self.num_blocks = as_int(num_blocks, "num_blocks", min=1)
        self.block_size = as_int(block_size, "block_size", min=1)
        self.max_tokens = self.num_blocks * self.block_size
        self.prefix_caching, self.watermark_blocks = prefix_caching, watermark_blocks
        methods = [callable(getattr(tokenizer, name, None)) for name in ("encode", "decode")]
        if tokenizer is not None and not all(methods):
            raise InvalidTypeError(
                f"tokenizer must have encode(text) and decode(ids) methods, got {type(tokenizer).__name__}"
            )
        self.tokenizer = tokenizer
        self.token_text: dict[int, str] = {}  # token id -> its text, for the ids the tokenizer gave
        self.playground = PageTablePlayground(
            self.num_blocks, self.block_size, prefix_caching, watermark_blocks
        )
        self.last_error: str | None = None
        self.last_action = "empty pool: add a sequence"
        self.history: list[str] = []  # what every successful action did, oldest first (reset empties it)
        self.applied = 0  # clicks applied (each message once, in order)
        self.errors: dict[str, str] = {}  # box -> why its text was refused
        self.colors: dict = {}  # live seq_id -> its colour
        self.page, self.focus = 0, []  # the window of the pool drawn, and the last action's sequences
        self.last_picture: Picture | None = None
        self._queue: deque = deque()
        self._start_painter(background)
        self.inputs = {"tokens": str(self.block_size + 1), "seq": "", "samples": "2", "prefix": NEW_TOKENS}
        self._chosen, self._choice = 0, {}
        self.view = self.widget = explorer_view()
        self.view.on_msg(self._on_msg)
        self.view.observe(self._on_inputs, "inputs")
        self._publish(choose=FIELDS)
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

    # ---- the boxes

    def _read(self, name: str, inputs: dict | None = None):
        """The value of box `name` in `inputs` (default: the boxes now); InvalidArgumentError if refused."""
        text = (self.inputs if inputs is None else inputs).get(name, "")
        if name == "tokens":
            return read_int(text, "tokens", 1, self.max_tokens)
        if name == "samples":
            return read_int(text, "samples", 2, MAX_SAMPLES)
        if name == "seq":
            ids = {str(s): s for s in self.manager.seq_ids}
            return ids.get(str(text))  # None: no sequence selected
        if str(text) == NEW_TOKENS:
            return NEW_TOKENS
        source = int(text) if str(text).isdigit() else None
        return source if source in self.playground.tokens else None  # None: a source a reset forgot

    def set_inputs(self, **boxes) -> None:
        """Type into the boxes from code (tokens=, seq=, samples=, prefix=), as the browser shows them."""
        for name in boxes:
            one_of(name, "box", FIELDS)
        self.inputs = {**self.inputs, **{k: str(v) for k, v in boxes.items()}}
        self._publish(choose=tuple(boxes))

    def _on_inputs(self, change) -> None:
        """The browser's boxes changed: new labels, and a message beside a box whose text is refused."""
        with self._lock:
            self.inputs = {**self.inputs, **{k: str(v) for k, v in change["new"].items() if k in FIELDS}}
            self._publish()

    # ---- clicks: one message each, queued, applied in order

    def click(self, name: str, **boxes) -> None:
        """Click button `name` as the browser does: one message with the boxes' text (`boxes` override
        what they hold, e.g. click("add", tokens=3))."""
        one_of(name, "name", (*ACTIONS, "reset", "page"))
        self.inputs = {**self.inputs, **{k: str(v) for k, v in boxes.items() if k in FIELDS}}
        self._on_msg(self.view, {"action": name, **self.inputs, **{k: str(v) for k, v in boxes.items()}}, [])

    def _on_msg(self, _view, content, _buffers) -> None:
        self._queue.append(content)
        with self._lock:
            while self._queue:
                self._apply(self._queue.popleft())
                self.applied += 1
            self._publish()

    def _apply(self, msg: dict) -> None:
        """Apply one click with the boxes' text it carries; afterwards the boxes are as the browser shows
        them (its later edits arrive on their own), plus any box the action chose (a new selection)."""
        saved, chosen = dict(self.inputs), self._chosen
        self.inputs = {**saved, **{k: str(msg[k]) for k in FIELDS if k in msg}}
        try:
            self._run(msg)
        finally:
            self.inputs = {**saved, **(self._choice if self._chosen != chosen else {})}

    def _run(self, msg: dict) -> None:
        action = msg.get("action")
        if action == "reset":
            return self.reset()
        if action == "page":
            try:
                self.page = read_int(msg.get("page"), "page", 0, self._pages() - 1)
            except InvalidArgumentError:
                return None  # a page past either end: nothing to show
            return self.refresh()
        needs = {"add": ("tokens", "prefix"), "append": ("tokens",), "fork": ("samples",)}.get(action, ())
        self.errors = {}
        try:
            for name in needs:
                self._read(name)
        except InvalidArgumentError as e:
            self.errors[name] = str(e)
            self.last_error = f"{action} refused: {e}"
            return self.refresh(picture=False)
        if action == "add":
            self.add_sequence()
        elif action in ("append", "fork", "free", "step"):
            getattr(self, action)()
        else:
            self.last_error = f"unknown action {action!r}"
            self.refresh(picture=False)

    # ---- actions (the buttons call these; tests and notebooks may call them directly)

    @_locked
    def add_sequence(self, num_tokens: int | None = None, prefix_of=None):
        """Start a new sequence of `num_tokens` tokens (default: the tokens box), starting with the tokens
        of sequence `prefix_of`, or "new" tokens (default: the `starts with` box). Returns its id or None."""
        count = self._read("tokens") if num_tokens is None else num_tokens
        choice = self._read("prefix") if prefix_of is None else prefix_of
        prefix_of = None if choice in (NEW_TOKENS, None) else choice
        seq_id = self.next_seq_id
        if self._try(lambda: self.playground.add(count, prefix_of), [seq_id]):
            self._select(seq_id)
            return seq_id
        return None

    @_locked
    def add_text(self, text: str):
        """Start a new sequence with the tokens of `text` (through the tokenizer); each slot shows its
        token's text. A sequence that starts with the same tokens shares its cached full blocks, as
        `add_sequence(prefix_of=...)` does. Returns its id, or None (an error in the status line)."""
        token_ids = self._encode(text)
        seq_id = self.next_seq_id
        if self._try(lambda: self.playground.add_tokens(token_ids), [seq_id]):
            self._select(seq_id)
            return seq_id
        return None

    @_locked
    def append_text(self, text: str, seq_id=None) -> None:
        """Grow `seq_id` (default: the selected one) by the tokens of `text`, shown with their text."""
        token_ids = self._encode(text)
        seq_id = self._read("seq") if seq_id is None else seq_id
        if not self._no_seq(seq_id):
            self._try(lambda: self.playground.append(seq_id, len(token_ids), token_ids), [seq_id])

    def _encode(self, text) -> list[int]:
        """The token ids of `text`, each one's own text noted in `token_text` (the tokenizer's decode,
        a cache: nothing shows it until the ids are added). Bad input is refused before any change."""
        if self.tokenizer is None:
            raise InvalidArgumentError("add_text needs a tokenizer: PageTableExplorer(..., tokenizer=...)")
        if not isinstance(text, str):
            raise InvalidTypeError(f"text must be a str, got {type(text).__name__} {text!r}")
        encoded = self.tokenizer.encode(text)
        encoded = getattr(encoded, "ids", encoded)  # a tokenizers.Encoding holds its ids in .ids
        token_ids = as_token_ids(encoded, "tokenizer.encode(text)")
        texts = [self.tokenizer.decode([t]) for t in token_ids]
        if not token_ids or min(token_ids) < 0 or not all(isinstance(t, str) for t in texts):
            raise InvalidArgumentError(
                f"text must have tokens: the tokenizer gave ids {token_ids} and texts {texts} for {text!r}"
            )
        self.token_text.update(zip(token_ids, texts, strict=True))
        return token_ids

    @_locked
    def append(self, seq_id=None, num_tokens: int | None = None) -> None:
        """Grow `seq_id` (default: the selected one) by `num_tokens` (default: the tokens box)."""
        seq_id = self._read("seq") if seq_id is None else seq_id
        count = self._read("tokens") if num_tokens is None else num_tokens
        if not self._no_seq(seq_id):
            self._try(lambda: self.playground.append(seq_id, count), [seq_id])

    @_locked
    def fork(self, seq_id=None, num_samples: int | None = None):
        """Make `seq_id` (default: the selected one) one of `num_samples` samples (default: the samples
        box, at most MAX_SAMPLES): num_samples - 1 new sequences, the next ids, share all its blocks.
        Returns the first new id (selected) or None."""
        seq_id = self._read("seq") if seq_id is None else seq_id
        num_samples = self._read("samples") if num_samples is None else num_samples
        if self._no_seq(seq_id):
            return None
        first = self.next_seq_id

        def fork():
            children, message = self.playground.fork(seq_id, num_samples)
            selected = " (now selected)" if len(children) == 1 else f" (now selected: seq {first})"
            return f"{message}{selected}; they share every block"

        if not self._try(fork, [seq_id, *range(first, first + max(0, num_samples - 1))]):
            return None
        self._select(first)
        return first

    @_locked
    def free(self, seq_id=None) -> None:
        """Finish `seq_id` (default: the selected one): its blocks go back to the pool."""
        seq_id = self._read("seq") if seq_id is None else seq_id
        if not self._no_seq(seq_id) and self._try(lambda: self.playground.free(seq_id), []):
            self._select(None)

    @_locked
    def step(self) -> None:
        """One decode step: every sequence samples one token."""
        self._try(self.playground.step, list(self.manager.seq_ids))

    @_locked
    def reset(self) -> None:
        """Start over with an empty pool (sequence ids start at 0 again)."""
        self.playground = PageTablePlayground(
            self.num_blocks, self.block_size, self.prefix_caching, self.watermark_blocks
        )
        self.last_error, self.errors = None, {}
        self.last_action = "reset: empty pool"
        self.history, self.colors, self.page, self.focus = [], {}, 0, []
        self.inputs["prefix"] = NEW_TOKENS
        self._select(None)

    # ---- helpers

    def _try(self, action, focus: list) -> bool:
        """Run one playground action. On success remember its message, give colours to new sequences and
        turn the window to the action's blocks; on a VllminiError (the state is unchanged) show it, and
        keep the picture as it is."""
        try:
            message = action()
        except VllminiError as e:
            self.last_error = f"{type(e).__name__}: {e}"
            self.refresh(picture=False)
            return False
        self.last_error, self.errors = None, {}
        self.last_action = message
        self.history.append(message)
        self.colors = assign_colors(self.manager.seq_ids, self.colors)
        self.focus = [s for s in focus if s in self.manager]
        blocks = [dst for _, dst in self.last_copies]
        blocks += [
            self.manager.block_table(s).block_ids[-1] for s in self.focus[:1] if self.manager.seq_len(s)
        ]
        if blocks:
            self.page = page_of(blocks[0], self.num_blocks)
        self.refresh()
        return True

    def _no_seq(self, seq_id) -> bool:
        if seq_id is not None:
            return False
        self.last_error = "no sequence selected: add one first"
        self.refresh(picture=False)
        return True

    def _select(self, seq_id) -> None:
        """Select `seq_id` (or keep the selection if it is still live, else the first live sequence)."""
        ids = self.manager.seq_ids
        current = self._read("seq")
        chosen = seq_id if seq_id in ids else current if current in ids else (ids[0] if ids else "")
        self.inputs["seq"] = str(chosen)
        if self._read("prefix") is None:  # its source was forgotten (a reset)
            self.inputs["prefix"] = NEW_TOKENS
        self._publish(choose=("seq", "prefix"))  # never a number box: the learner may be typing there
        self.refresh()

    def _pages(self) -> int:
        return -(-self.num_blocks // min(self.num_blocks, 32))

    def labels(self) -> dict[str, str]:
        """What each button says it will do, with the boxes as they are."""
        tokens = self._checked("tokens")
        seq, samples, prefix = self._read("seq"), self._checked("samples"), self._checked("prefix")
        count = plural(tokens, "token") if tokens is not None else "? tokens"
        source = self.playground.tokens.get(prefix) if prefix not in (None, NEW_TOKENS) else None
        if source is None or tokens is None:
            add = f"add a sequence of {count}"
        else:
            head = min(tokens, len(source))
            add = f"add {count}: seq {prefix}'s first {head}" + (
                f" + {tokens - head} new" if tokens > head else ""
            )
        first = self.next_seq_id
        if samples is None:
            children = "? samples"
        else:
            children = (
                f"seq {first}" if samples == 2 else f"seqs {first}–{first + samples - 2} ({samples} samples)"
            )
        none = seq is None
        return {
            "add": add,
            "append": "append (no sequence)" if none else f"append {count} to seq {seq}",
            "fork": "fork (no sequence)" if none else f"fork seq {seq} → {children}",
            "free": "free (no sequence)" if none else f"free seq {seq}",
            "step": "step (no sequence)" if none else "step: every sequence +1 token",
            "reset": "reset: empty pool",
        }

    def _checked(self, name: str):
        try:
            return self._read(name)
        except (InvalidArgumentError, ValueError):
            return None

    def _publish(self, choose: tuple = ()) -> None:
        """Send the browser the options, labels, messages beside the boxes and the count of clicks."""
        errors = {}
        for name in ("tokens", "samples"):
            try:
                self._read(name)
            except InvalidArgumentError as e:
                errors[name] = str(e)
        self.errors = errors
        ids, tokens = self.manager.seq_ids, self.playground.tokens
        if choose:  # the boxes the kernel sets; the browser applies each choice once (by its number)
            self._chosen += 1
            self._choice = {name: self.inputs[name] for name in choose}
        state = {
            "seqs": [[f"seq {s} · {plural(self.manager.seq_len(s), 'token')}", str(s)] for s in ids],
            "prefixes": [["new tokens", NEW_TOKENS]]
            + [
                [f"seq {s}'s {len(t)} tokens" + ("" if s in ids else " (freed)"), str(s)]
                for s, t in tokens.items()
            ],
            "labels": self.labels(),
            "disabled": {name: not ids for name in ("append", "fork", "free", "step")},
            "errors": self.errors,
            "choose": {**self._choice, "n": self._chosen},
            "page": self.page,
            "pages": self._pages(),
            "applied": self.applied,
        }
        self.view.state = state

    def status_text(self) -> str:
        """The status line as plain text: last action or error, then the free list and utilization."""
        u = self.manager.utilization()
        free = list(self.manager.allocator.free_block_ids)
        shown = ", ".join(map(str, free[:16])) + (", ..." if len(free) > 16 else "")
        head = f"error: {self.last_error}" if self.last_error else self.last_action
        share = f"{u['token_utilization']:.0%}" if u["allocated_slots"] else "-"  # nothing allocated yet
        return (
            f"{head}\n{free_blocks_text(self.manager)}, next first: [{shown}] | "
            f"{u['num_tokens']} tokens in {u['allocated_slots']} allocated slots ({share}) | "
            f"pool {u['pool_utilization']:.0%}"
        )

    def _status_html(self) -> str:
        head, tail = self.status_text().split("\n", 1)
        color = "#c62828" if self.last_error else "#222222"
        return f"<b style='color:{color}'>{html.escape(head)}</b><br>{html.escape(tail)}"

    def render_svg(self) -> str:
        """The picture of the current state as SVG text (the last action's copies highlighted)."""
        with self._lock:
            snap = snapshot(self.manager, None, None, self.last_copies)
            highlight = [dst for _, dst in self.last_copies]
            texts = None  # with a tokenizer: each live sequence's token texts (None: a made-up token)
            if self.tokenizer is not None:
                tokens = self.playground.tokens
                texts = {s: [self.token_text.get(t) for t in tokens[s]] for s in self.manager.seq_ids}
            self.last_picture = draw_explorer_picture(
                snap, self.colors, self.page, highlight, self.focus, texts
            )
            return self.last_picture.svg

    def picture(self):
        """The current picture, for a notebook cell (an IPython SVG display object)."""
        from IPython.display import SVG

        return SVG(data=self.render_svg())

    def display(self) -> None:
        """Show the widget; where widgets cannot render (a saved notebook not yet run), a short hint
        stands in for the widget's repr."""
        from IPython.display import display

        view = {"model_id": self.view.model_id, "version_major": 2, "version_minor": 0}
        hint = f"PageTableExplorer({self.num_blocks} blocks of {self.block_size}): run this cell to use it"
        display({"application/vnd.jupyter.widget-view+json": view, "text/plain": hint}, raw=True)

    def _ipython_display_(self) -> None:
        self.display()
