"""The explorer's widget and its drawing thread (the part of `PageTableExplorer` that is not about page
tables): one anywidget that draws the controls, the status line and the SVG picture in the browser, and
sends every click as one message that carries the action and the numbers it uses.

Why one message: with ipywidgets' own text box and buttons, a click and the number typed before it
travel as separate messages, and the browser merges a widget's updates while one is unanswered, so a
click could overtake its number, or two clicks cancel. Here the browser reads the boxes at the moment of
the click and sends {"action", "tokens", "seq", "samples", "prefix", "click"} in one custom message;
the kernel queues them and applies each once, in order, checking every number (`read_int`).
"""

from __future__ import annotations

import html
import os
import re
import threading

from vllmini.errors import InvalidArgumentError

NEW_TOKENS = "new"  # the `starts with` choice for a sequence of tokens no other sequence has
ACTIONS = ("add", "append", "fork", "free", "step")  # the buttons that change the pool
TIPS = {  # what each control drives (its tooltip)
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
    "reset": "start over with an empty pool",
}
WHOLE = re.compile(r"\s*\d+\s*")

ESM = """
const FIELDS = [["tokens", "tokens", "text"], ["seq", "sequence", "select"],
                ["samples", "samples", "text"], ["prefix", "starts with", "select"]];
const ACTIONS = ["add", "append", "fork", "free", "step", "reset"];
function h(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}
function render({ model, el }) {
  el.classList.add("vllmini-explorer");
  const tips = model.get("tips");
  const status = h("div", "vllmini-status"), controls = h("div", "vllmini-controls");
  const picture = h("div", "vllmini-image"), body = h("div", "vllmini-body");
  const fields = {}, buttons = {};
  let clicks = 0, chosen = -1;
  const values = () => Object.fromEntries(FIELDS.map(([name]) => [name, fields[name].input.value]));
  let edits = 0;  // only the box just edited: the others may hold a choice the kernel made meanwhile
  const sendInput = (name) => {
    edits += 1;
    model.set("inputs", { [name]: fields[name].input.value, edit: edits });
    model.save_changes();
  };
  for (const [name, label, kind] of FIELDS) {
    const row = h("label", "vllmini-field vllmini-" + name);
    row.title = tips[name];
    const input = h(kind === "select" ? "select" : "input");
    if (kind === "text") { input.type = "text"; input.inputMode = "numeric"; input.autocomplete = "off"; }
    const error = h("div", "vllmini-input-error");
    row.append(h("span", "vllmini-name", label), input, error);
    controls.append(row);
    input.addEventListener(kind === "select" ? "change" : "input", () => sendInput(name));
    fields[name] = { input, error };
  }
  const send = (action, extra) => {
    clicks += 1;
    model.send({ action, ...values(), ...extra, click: clicks });
  };
  for (const name of ACTIONS) {
    const b = h("button", "vllmini-action vllmini-" + name);
    b.title = tips[name];
    b.addEventListener("click", () => send(name, {}));
    controls.append(b);
    buttons[name] = b;
  }
  const pager = h("div", "vllmini-pager");
  for (const [name, text, delta] of [["prev", "◀ blocks", -1], ["next", "blocks ▶", 1]]) {
    const b = h("button", "vllmini-" + name, text);
    b.addEventListener("click", () => send("page", { page: String(model.get("state").page + delta) }));
    pager.append(b);
  }
  controls.append(pager);
  const setOptions = (select, options) => {
    const value = select.value;
    select.replaceChildren(...options.map(([label, v]) => {
      const o = h("option", "", label);
      o.value = v;
      return o;
    }));
    if (options.some(([, v]) => v === value)) select.value = value;
  };
  const update = () => {
    const s = model.get("state");
    setOptions(fields.seq.input, s.seqs);
    setOptions(fields.prefix.input, s.prefixes);
    if (s.choose.n !== chosen) {  // the kernel picks a value (at the start, after add, fork or reset)
      chosen = s.choose.n;
      for (const [name, value] of Object.entries(s.choose)) {
        if (name in fields) fields[name].input.value = value;
      }
    }
    for (const name of ACTIONS) {
      buttons[name].textContent = s.labels[name];
      buttons[name].disabled = !!s.disabled[name];
    }
    for (const [name, f] of Object.entries(fields)) {
      f.error.textContent = s.errors[name] || "";
      f.input.classList.toggle("vllmini-bad", !!s.errors[name]);
    }
    pager.style.display = s.pages > 1 ? "" : "none";
    el.dataset.applied = s.applied;
  };
  model.on("change:state", update);
  model.on("change:status", () => { status.innerHTML = model.get("status"); });
  model.on("change:picture", () => { picture.innerHTML = model.get("picture"); });
  body.append(controls, picture);
  el.append(status, body);
  update();
  status.innerHTML = model.get("status");
  picture.innerHTML = model.get("picture");
}
export default { render };
"""

CSS = """
.vllmini-explorer { font-family: var(--jp-ui-font-family, sans-serif); font-size: 13px; color: #222; }
.vllmini-explorer .vllmini-status { font-family: monospace; font-size: 13px; line-height: 1.5;
  margin-bottom: 6px; min-height: 3em; }
.vllmini-explorer .vllmini-body { display: flex; flex-wrap: wrap; gap: 12px; align-items: flex-start; }
.vllmini-explorer .vllmini-controls { display: flex; flex-direction: column; gap: 4px; width: 250px;
  flex: 0 0 250px; }
.vllmini-explorer .vllmini-field { display: grid; grid-template-columns: 80px 1fr; align-items: center; }
.vllmini-explorer .vllmini-field input, .vllmini-explorer .vllmini-field select { font-size: 13px;
  padding: 2px 4px; min-width: 0; }
.vllmini-explorer .vllmini-input-error { grid-column: 1 / 3; color: #c62828; font-size: 12px; }
.vllmini-explorer .vllmini-input-error:empty { display: none; }
.vllmini-explorer input.vllmini-bad { border: 2px solid #c62828; }
.vllmini-explorer button { font-size: 13px; padding: 4px 6px; text-align: left; cursor: pointer; }
.vllmini-explorer .vllmini-pager { display: flex; gap: 4px; }
.vllmini-explorer .vllmini-image { overflow-x: auto; flex: 0 1 auto; max-width: 100%; }
.vllmini-explorer .vllmini-image svg { display: block; }
"""


def in_kernel() -> bool:
    """Are we running inside a Jupyter kernel (where widgets talk to a browser)?"""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def read_int(value, name: str, low: int, high: int) -> int:
    """A number from a box: an int, or text that is only digits, within [low, high]. Anything else (empty,
    2.5, 1e3, -5, abc, out of range) is refused with a message that says what the box takes."""
    if isinstance(value, str) and WHOLE.fullmatch(value):
        number = int(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        number = None
    if number is None or not low <= number <= high:
        raise InvalidArgumentError(f"{name} takes a whole number from {low} to {high}, got {str(value)!r}")
    return number


def explorer_view():
    """The widget: `state`, `status` and `picture` go to the browser, `inputs` (the box just edited, for
    the button labels) comes back; clicks arrive as custom messages (`on_msg`)."""
    import anywidget
    import traitlets

    class ExplorerView(anywidget.AnyWidget):
        _esm = ESM
        _css = CSS
        tips = traitlets.Dict(TIPS).tag(sync=True)
        state = traitlets.Dict().tag(sync=True)
        inputs = traitlets.Dict().tag(sync=True)
        status = traitlets.Unicode("").tag(sync=True)
        picture = traitlets.Unicode("").tag(sync=True)

    return ExplorerView()


class BackgroundPainter:
    """Redraws the explorer's picture (SVG text) and status line, on a worker thread when `background`
    is set, so a click is answered at once and a run of clicks is drawn once."""

    def _start_painter(self, background: bool | None) -> None:
        self.background = in_kernel() if background is None else bool(background)
        self._lock = threading.RLock()  # guards the playground and the explorer's state
        self._wake = threading.Condition()
        self._want: bool | None = None  # None: nothing to do; False: status only; True: picture too
        self._idle = threading.Event()
        self._idle.set()
        self._worker: threading.Thread | None = None

    def refresh(self, picture: bool = True) -> None:
        """Show the current state: the picture (unless picture=False), then the status line, so the
        status never runs ahead. In the background, this only asks the worker."""
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
        with self._lock:  # one consistent state for the status line and the picture
            status = self._status_html()
            svg = self.render_svg() if picture else None
        if svg is not None:
            self.view.picture = svg
        self.view.status = status

    def _work(self) -> None:
        try:  # drawing yields the CPU to the kernel's main thread, which answers the browser
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass  # not Linux: no per-thread priority
        while True:
            with self._wake:
                while self._want is None:
                    self._wake.wait()
                while self._wake.wait(timeout=0.02):  # let a quick run of clicks finish first
                    pass
                picture, self._want = self._want, None
            try:
                self._update(picture)
            except Exception as e:  # keep the worker alive; say what happened where the learner looks
                self.view.status = f"<pre>explorer could not draw: {html.escape(repr(e))}</pre>"
            with self._wake:
                if self._want is None:
                    self._idle.set()
