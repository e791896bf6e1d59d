"""End to end: notebook 03's page-table explorer, used as a learner would, in JupyterLab in a real browser.

The test starts its own JupyterLab (a free localhost port, a random token, a temporary copy of the
notebook, settings and workspace in a temporary folder), opens the notebook in headless Chromium
(Debian's `chromium`, driven by Playwright through `executable_path`; no browser download), runs all
cells from the Run menu, then clicks through the explorer at 1280 x 800: add a sequence, append across a
block boundary, fork, append to the fork (copy-on-write), free, exhaust the pool, bad numbers (refused
beside the box, nothing changes), bursts of type-and-click rounds and rapid clicks with no waiting
(then the kernel's sequences must be exactly what the clicks asked for), reset, then sharing: free a
sequence (its full blocks stay cached), fork into 3 samples, step (two copies of the shared partial
block), add a request that starts with the freed sequence's tokens (a prefix-cache hit); last, the
1000-block explorer. It measures the smallest text drawn (at least 10 px). After each step it checks
the status text, the free-block
count and whether the picture changed, and saves a screenshot to tests/artifacts/explorer/ (ignored
by git; scripts/explorer_screenshot.py copies one into notebooks/images/ for the README and notebook
03). Any JavaScript console error fails the test, except JupyterLab's own messages listed in
ALLOWED_CONSOLE_ERRORS.

Without Chromium or Playwright the test is skipped with the reason, except when CI is set: CI
installs both (.ci/run), so there a missing browser is a failure.
"""

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "03_page_table.ipynb"
ARTIFACTS = ROOT / "tests" / "artifacts" / "explorer"
# JupyterLab's own console errors that say nothing about the explorer, as regular expressions matched
# against "message @ url". None show up with JupyterLab 4.6 and chromium 156 (news and update checks are
# switched off in the settings below); add one here, with the reason, if a new JupyterLab brings some.
ALLOWED_CONSOLE_ERRORS: tuple[str, ...] = ()
TIMEOUT_MS = 60_000  # per wait; a 2-core CI machine shared with other work can be slow


def _missing(reason: str):
    """Skip with the reason here; in CI (which installs the browser) fail instead."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI installs it: see .ci/run)")
    pytest.skip(reason)


def _chromium() -> str:
    for name in (os.environ.get("VLLMINI_CHROMIUM"), "chromium", "chromium-browser"):
        path = name and shutil.which(name)
        if path:
            return path
    _missing("no Chromium found (Debian: apt-get install chromium; or set VLLMINI_CHROMIUM)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server of our own on a temporary copy of notebook 03; always stopped afterwards."""
    pytest.importorskip("jupyterlab", reason="JupyterLab is not installed (the `course` extra)")
    work = tmp_path_factory.mktemp("lab")
    (work / "notebooks").mkdir()
    shutil.copy(NOTEBOOK, work / "notebooks" / NOTEBOOK.name)
    shutil.copytree(NOTEBOOK.parent / "images", work / "notebooks" / "images")  # the notebook's pictures
    for plugin, values in (
        ("apputils-extension/notification", {"fetchNews": "false", "checkForUpdates": False}),  # no network
        ("notebook-extension/tracker", {"windowingMode": "none"}),  # every cell in the page, run or not
    ):
        path = work / "settings" / "@jupyterlab" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for var in ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR", "IPYTHONDIR"):
        env[var] = str(work / var.lower())
    cmd = [
        sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
        f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work / 'notebooks'}",
        f"--LabApp.user_settings_dir={work / 'settings'}", f"--LabApp.workspaces_dir={work / 'workspaces'}",
        "--LabApp.news_url=None", "--ServerApp.port_retries=0",
    ]  # fmt: skip
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(work / "server.log", "w")  # noqa: SIM115 (closed in the finalizer)
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"JupyterLab did not start:\n{(work / 'server.log').read_text()[-3000:]}")
            time.sleep(0.3)
        yield {"url": url, "token": token, "dir": work}
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and the kernels it started
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


@pytest.fixture(scope="module")
def browser():
    executable = _chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("Playwright for Python is not installed (the `test` extra)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, headless=True, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


class Explorer:
    """One explorer on the page, found by the CSS classes its widget gives its parts."""

    def __init__(self, page, index: int = 0):
        self.page = page
        self.root = page.locator(".vllmini-explorer").nth(index)
        self.tokens = self.root.locator(".vllmini-tokens input")
        self.samples = self.root.locator(".vllmini-samples input")
        self.seq = self.root.locator(".vllmini-seq select")
        self.status = self.root.locator(".vllmini-status")
        self.image = self.root.locator(".vllmini-image")
        self.clicks = 0  # clicks sent; the widget's data-applied says how many the kernel applied

    def button(self, name: str):
        return self.root.locator(f"button.vllmini-{name}")

    def select(self, name: str, label: str) -> None:
        """Pick `label` in the dropdown `name` ("seq" or "prefix")."""
        self.root.locator(f".vllmini-{name} select").select_option(label=label)

    def src(self) -> str:
        return self.image.inner_html()

    def status_text(self) -> str:
        return self.status.inner_text()

    def free_blocks(self) -> int:
        m = re.search(r"(\d+) of (\d+) blocks free", self.status_text())
        assert m, self.status_text()
        return int(m.group(1))

    def seq_lengths(self) -> dict[int, int]:
        """The kernel's sequences and their lengths, as the sequence dropdown lists them."""
        labels = self.seq.locator("option").all_inner_texts()
        return {int(m[1]): int(m[2]) for m in (re.match(r"seq (\d+) · (\d+) tokens?", t) for t in labels)}

    def type_tokens(self, n, delay: float = 0) -> None:
        """Click into the tokens box, select what is there and type `n`, key by key."""
        self.tokens.click()
        self.tokens.press("Control+a")
        self.tokens.press_sequentially(str(n), delay=delay)

    def click(self, name: str) -> None:
        self.button(name).click()
        self.clicks += 1

    def wait_applied(self) -> None:
        """Wait until the kernel has applied every click sent (and the status shows it)."""
        try:
            self.page.wait_for_function(
                "([el, n]) => Number(el.dataset.applied) >= n",
                arg=[self.root.element_handle(), self.clicks],
                timeout=30_000,
            )
        except Exception:
            pytest.fail(f"{self.clicks} clicks sent, applied: {self.root.get_attribute('data-applied')}")

    def wait_status(self, text: str) -> str:
        """Wait until the status line contains `text`; fail with what it says instead."""
        try:
            self.page.wait_for_function(
                "([el, t]) => el.innerText.includes(t)",
                arg=[self.status.element_handle(), text],
                timeout=20_000,
            )
        except Exception:
            pytest.fail(f"status never said {text!r}; it says {self.status_text()!r}")
        return self.status_text()

    def wait_src_change(self, old: str) -> str:
        self.page.wait_for_function(
            "([el, old]) => el.innerHTML !== old", arg=[self.image.element_handle(), old], timeout=20_000
        )
        return self.src()

    def shot(self, name: str) -> None:
        global SHOTS
        SHOTS += 1
        self.page.set_viewport_size({"width": 1280, "height": 1400})  # the whole explorer in one shot
        self.root.scroll_into_view_if_needed()
        self.root.screenshot(path=ARTIFACTS / f"{SHOTS:02d}_{name}.png")
        self.page.set_viewport_size({"width": 1280, "height": 800})

    def step(self, name: str, click: str, expect: str, free: int, changes: bool = True) -> str:
        """Click a button, wait for the status to say `expect`, check free blocks and the picture."""
        before = self.src()
        self.click(click)
        status = self.wait_status(expect)
        self.wait_applied()
        assert self.free_blocks() == free, status
        if changes:
            self.wait_src_change(before)
        else:
            self.page.wait_for_timeout(300)  # give a wrong redraw the time to arrive
            assert self.src() == before, "the picture changed although the state did not"
        self.shot(name)
        return status

    def smallest_text_px(self) -> float:
        """The smallest text on the explorer, in CSS pixels as drawn (SVG text scaled by its transform)."""
        return self.root.evaluate(
            """root => {
                let smallest = Infinity;
                for (const el of root.querySelectorAll('*')) {
                    const own = [...el.childNodes].some(n => n.nodeType === 3 && n.textContent.trim());
                    if (!own || el.getClientRects().length === 0) continue;
                    let px = parseFloat(getComputedStyle(el).fontSize);
                    if (el instanceof SVGElement) px *= el.getScreenCTM().a;
                    smallest = Math.min(smallest, px);
                }
                return smallest;
            }"""
        )


SHOTS = 0


def wait_for_kernel(page) -> None:
    """Wait until the notebook's kernel is idle; accept the kernel dialog if JupyterLab asks (it does
    when the notebook opens before the kernel list has loaded, on a slow machine)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        dialog = page.locator(".jp-Dialog .jp-mod-accept")
        if dialog.count() and dialog.first.is_visible():
            dialog.first.click()
        if page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").count() and not dialog.count():
            if "Idle" in page.locator("#jp-main-statusbar").inner_text():
                return
        page.wait_for_timeout(250)
    pytest.fail(
        "the kernel never became idle; the status bar says "
        + repr(page.locator("#jp-main-statusbar").inner_text())
    )


def run_all_cells(page) -> None:
    """Run > Run All Cells, as a learner would, and wait until every code cell has run."""
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(r"^Run All Cells$")).click()
    prompts = ".jp-Notebook .jp-CodeCell .jp-InputPrompt"
    page.wait_for_function(  # queued: the cells show [*] at once
        f"() => [...document.querySelectorAll('{prompts}')].some(c => c.innerText.includes('[*]'))"
    )
    page.wait_for_function(
        f"""() => {{
            const cells = [...document.querySelectorAll('{prompts}')];
            return cells.length > 0 && cells.every(c => /\\[\\d+\\]/.test(c.innerText));
        }}""",
        timeout=240_000,
    )


def sharing(e: Explorer, expect) -> None:
    """The sharing controls: a freed sequence's full blocks stay cached, a fork into 3 samples, a step
    that copies the shared partial block twice, and a new request that finds the cached prefix."""
    expect(e.root.locator(".vllmini-prefix select option:checked")).to_have_text("new tokens")
    e.type_tokens(8)
    e.step("add_to_cache", "add", "added seq 0 with 8 tokens", free=14)
    status = e.step("free_keeps_cached", "free", "freed seq 0; 2 blocks [0, 1] stay cached", free=16)
    assert "16 of 16 blocks free (2 of them cached but free)" in status, status
    e.type_tokens(10)
    e.step("add_new_tokens", "add", "added seq 1 with 10 tokens", free=13)
    e.samples.fill("3")
    expect(e.button("fork")).to_have_text("fork seq 1 → seqs 2–3 (3 samples)")  # says which ids it makes
    e.step("fork_samples", "fork", "forked seq 1 into seqs 2, 3 (now selected: seq 2)", free=13)
    status = e.step("step_copies", "step", "step: seqs 1, 2, 3 sampled 1 token each", free=11)
    assert re.search(r"copy-on-write: block (\d+) → \d+; copy-on-write: block \1 → \d+", status), status
    e.select("prefix", "seq 0's 8 tokens (freed)")
    e.type_tokens(9)
    expect(e.button("add")).to_have_text("add 9 tokens: seq 0's first 8 + 1 new")
    e.step("prefix_hit", "add", "prefix cache hit: shares 2 blocks [0, 1]", free=8)


def bad_numbers(e: Explorer, expect) -> None:
    """Every entry that is not a whole number in range is refused beside the box and changes nothing."""
    error = e.root.locator(".vllmini-tokens .vllmini-input-error")
    for text in ("", "2.5", "1e3", "-5", "abc", "0", "65"):
        before = e.seq_lengths()
        e.tokens.fill(text)
        expect(error).to_have_text(f"tokens takes a whole number from 1 to 64, got '{text}'")
        e.click("append")
        e.wait_applied()
        e.wait_status("error: append refused: tokens takes a whole number")
        assert e.seq_lengths() == before, text
    e.shot("refused_number")
    e.type_tokens(2)
    expect(error).to_be_hidden()


def bursts(e: Explorer, page) -> None:
    """Type-and-click rounds with no waiting (keys 15 ms apart, and at human speed), then rapid clicks
    on step: after each burst the kernel holds exactly what the clicks asked for."""
    e.click("reset")
    e.wait_applied()
    for n in (3, 7, 2, 5, 1, 4):
        e.type_tokens(n, delay=15)
        e.click("add")
    e.wait_applied()
    assert e.seq_lengths() == {0: 3, 1: 7, 2: 2, 3: 5, 4: 1, 5: 4}, e.seq_lengths()
    for n in (6, 2, 3):
        e.type_tokens(n, delay=150)
        e.click("add")
    e.wait_applied()
    assert e.seq_lengths() == {0: 3, 1: 7, 2: 2, 3: 5, 4: 1, 5: 4, 6: 6, 7: 2, 8: 3}, e.seq_lengths()
    e.click("reset")
    e.type_tokens(1)
    e.click("add")
    for _ in range(7):  # 7 clicks on step, 15 ms apart
        e.button("step").click(delay=0)
        e.clicks += 1
        page.wait_for_timeout(15)
    e.wait_applied()
    assert e.seq_lengths() == {0: 8}, e.seq_lengths()
    e.wait_status("step: seq 0 sampled 1 token each")
    e.shot("bursts")


def big_pool(page, expect) -> None:
    """The 1000-block explorer: readable, with the whole pool in its overview."""
    b = Explorer(page, 1)
    b.root.scroll_into_view_if_needed()
    for n in (300, 200, 300):
        b.type_tokens(n)
        b.click("add")
    b.samples.fill("4")
    expect(b.button("fork")).to_have_text("fork seq 2 → seqs 3–5 (4 samples)")
    b.click("fork")
    b.click("step")
    b.wait_applied()
    b.wait_status("step: seqs 0, 1, 2, 3, 4, 5 sampled 1 token each")
    assert b.image.locator("svg rect").count() >= 1000  # one cell per block in the overview
    assert b.smallest_text_px() >= 10
    b.shot("big_pool")


@pytest.mark.slow
def test_explorer_in_jupyterlab(browser, lab):  # browser first: without one, skip before starting a server
    from playwright.sync_api import expect

    if ARTIFACTS.exists():
        shutil.rmtree(ARTIFACTS)
    ARTIFACTS.mkdir(parents=True)
    page = browser.new_page(viewport={"width": 1280, "height": 800}, device_scale_factor=1)
    page.set_default_timeout(TIMEOUT_MS)
    errors = []
    page.on("console", lambda m: m.type == "error" and errors.append(f"{m.text} @ {m.location.get('url')}"))
    page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
    try:
        page.goto(f"{lab['url']}/lab/tree/{NOTEBOOK.name}?token={lab['token']}")
        page.locator(".jp-Notebook .jp-Cell").first.wait_for()
        wait_for_kernel(page)
        run_all_cells(page)
        assert not page.locator(
            ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
        ).count()
        assert not page.locator(".jp-RenderedText[data-mime-type='application/vnd.jupyter.error']").count()

        e = Explorer(page)
        e.root.scroll_into_view_if_needed()
        e.image.locator("svg").wait_for()
        assert "empty pool" in e.status_text() and e.free_blocks() == 16
        assert "error" not in e.status_text()  # Run All drove no error into the learner's explorer
        expect(e.button("append")).to_be_disabled()  # nothing to append to yet
        assert e.smallest_text_px() >= 10  # at 1280 x 800, 100% zoom
        e.shot("empty")

        e.type_tokens(6)
        expect(e.button("add")).to_have_text("add a sequence of 6 tokens")  # the button says what it does
        e.step("add", "add", "added seq 0 with 6 tokens", free=14)
        expect(e.seq.locator("option:checked")).to_have_text("seq 0 · 6 tokens")
        e.type_tokens(3)  # 6 + 3 = 9 tokens: crosses into a third block
        expect(e.button("append")).to_have_text("append 3 tokens to seq 0")
        e.step("append_across_boundary", "append", "appended 3 tokens to seq 0", free=13)
        e.step("fork", "fork", "forked seq 0 into seq 1 (now selected)", free=13)
        expect(e.seq.locator("option:checked")).to_have_text("seq 1 · 9 tokens")
        e.type_tokens(1)  # seq 1's last block is shared and partly full: copy-on-write
        status = e.step("copy_on_write", "append", "appended 1 token to seq 1", free=12)
        assert re.search(r"copy-on-write: block 2 → \d+", status), status
        e.select("seq", "seq 0 · 9 tokens")
        e.step("free", "free", "freed seq 0", free=13)
        e.type_tokens(64)  # 16 blocks: more than the pool has free
        before = e.status_text()
        status = e.step("out_of_blocks", "add", "error: OutOfBlocksError", free=13, changes=False)
        assert "needs 16 new blocks, but 13 of 16 blocks free" in status, status
        assert before.splitlines()[1:] == status.splitlines()[1:]  # free list and counts unchanged
        bad_numbers(e, expect)
        bursts(e, page)
        e.step("reset", "reset", "reset: empty pool", free=16)
        expect(e.button("fork")).to_be_disabled()
        sharing(e, expect)
        assert e.smallest_text_px() >= 10
        big_pool(page, expect)
    except BaseException:
        page.screenshot(path=ARTIFACTS / "failure_page.png")  # what the page showed when it failed
        raise
    finally:
        page.close()
    unexpected = [m for m in errors if not any(re.search(p, m) for p in ALLOWED_CONSOLE_ERRORS)]
    assert not unexpected, f"JavaScript console errors: {unexpected}"
