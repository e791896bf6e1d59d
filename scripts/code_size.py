"""How big vllmini's Python is, and how much of it the first landing's features take today.

    python scripts/code_size.py                  # f4320b2 (the first landing) against the working tree
    python scripts/code_size.py --old REV --new REV
    python scripts/code_size.py --blame          # also: each line by the commit that wrote it (git blame)

The first landing (f4320b2) had the allocator, page tables, the paged KV cache, attention in PyTorch, one
CUDA kernel, the Llama model, the scheduler with three policies and the engine. Later issues added kernel
versions 2-5 and the in-kernel guard (8), the CUDA chapter (9), sharing pages (10), the learner's path (11),
the engine under load (13), the explorer in a browser (14) and surviving errors and Ctrl-C (15). LATER
names the code each of them added, as whole modules or as functions, classes and methods; everything else
counts as first-landing code, including what later issues added inside first-landing functions and module
docstrings (so the first-landing figure is an upper bound). Lines are physical lines (as `wc -l`); "code"
leaves out blank, comment and docstring lines. The emulator's Python (vllmini/emulator/) is counted apart.

--blame is the finer count, line by line. `git blame -w -M -C -C` names the commit that wrote each line
(following code moved or copied between files), and COMMITS says whose work each commit since the first
landing was. Issue 12's commits are passed to git blame as revisions to ignore (--ignore-revs-file), so a
line they rewrote is blamed on whoever wrote the line before: a rewrite of first-landing code stays
first-landing code, a rewrite of a later issue's code stays that issue's. What is left on an issue-12
commit is what it added outright (checks, error classes, module headers of split files), which counts as
first-landing code. A few issue-12 commits also added a later feature ("mixed" in COMMITS); their
outright additions count as first-landing too, so that figure errs high.
"""

from __future__ import annotations

import argparse
import ast
import functools
import re
import subprocess
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIRST_LANDING = "f4320b2"

# issue -> what it added: "path.py" (a whole module) or "path.py:Name" / "path.py:Class.method"
LATER: dict[str, tuple[str, ...]] = {
    "8 fast kernel": (
        "vllmini/launch_plan.py",
        "vllmini/kernel_registry.py:KernelVersion",
        "vllmini/kernel_registry.py:_present_versions",
        "vllmini/kernel_registry.py:kernel_versions",
        "vllmini/kernel_registry.py:resolve_kernel_version",
        "vllmini/attention.py:guarded_by_default",
        "vllmini/attention_checks.py:_normalize_device",
        "vllmini/attention_checks.py:kernel_error_buffer",
        "vllmini/attention_checks.py:check_kernel_errors",
        "vllmini/attention_checks.py:_table_check_mode",
        "vllmini/viz/kernel_perf.py",
    ),
    "9 CUDA chapter": ("vllmini/viz/cuda.py",),
    "10 sharing": (
        "vllmini/prefix_cache.py",
        "vllmini/block_manager.py:BlockManager.num_cached_free_blocks",
        "vllmini/block_manager.py:BlockManager._check_shared",
        "vllmini/block_manager.py:BlockManager.blocks_needed",
        "vllmini/block_manager.py:BlockManager._make_room",
        "vllmini/block_manager.py:BlockManager.cached_prefix",
        "vllmini/block_manager.py:BlockManager.cache_full_blocks",
        "vllmini/block_manager.py:BlockManager._release",
        "vllmini/block_manager.py:BlockManager.sharing",
        "vllmini/model_runner.py:ModelRunner.copy_blocks",
        "vllmini/outputs.py:CompletionOutput",
        "vllmini/outputs.py:StepStats.memory_saved",
        "vllmini/outputs.py:sharing_summary",
        "vllmini/sampling.py:sample_seed",
        "vllmini/scheduler.py:Scheduler._preempt_group",
        "vllmini/scheduler.py:Scheduler._plan_admission",
        "vllmini/scheduler.py:Scheduler.mark_computed",
        "vllmini/sequence.py:SchedulerOutput.samplers",
    ),
    "11 learner's path": (
        "vllmini/exercises.py",
        "vllmini/viz/course.py",
        "vllmini/viz/blocks.py:draw_slots_read",
    ),
    "13 engine under load": (
        "vllmini/arrivals.py",
        "vllmini/latency.py",
        "vllmini/serving.py",
        "vllmini/cuda_graphs.py",
        "vllmini/viz/serving.py",
        "vllmini/viz/blocks.py:draw_pool_history",
        "vllmini/attention.py:to_device",
        "vllmini/attention.py:AttentionMetadata.check_on_host",
        "vllmini/attention.py:AttentionMetadata.to",
        "vllmini/model_runner.py:ModelRunner._capture_graphs",
        "vllmini/engine.py:LLMEngine._no_progress_error",
        "vllmini/engine.py:LLMEngine._run_until_done",
        "vllmini/outputs.py:Logprob",
        "vllmini/processing.py:OutputProcessor.finish_reason",
        "vllmini/processing.py:OutputProcessor._text",
        "vllmini/processing.py:OutputProcessor._token_text",
        "vllmini/processing.py:OutputProcessor.completion",
        "vllmini/sampling.py:sample_batch",
        "vllmini/sampling.py:_draw",
        "vllmini/sampling.py:token_logprobs",
        "vllmini/chunked_prefill.py",
        "vllmini/scheduler.py:Scheduler.stall_message",
        "vllmini/sequence.py:Sequence.is_prefilling",
        "vllmini/sequence.py:SchedulerOutput.prefill_end",
        "vllmini/sequence.py:SchedulerOutput.partial_prefills",
    ),
    "14 explorer in a browser": (
        "vllmini/viz/playground.py",
        "vllmini/viz/page_table_places.py",
        "vllmini/viz/explorer_widgets.py:in_kernel",
        "vllmini/viz/explorer_widgets.py:BackgroundPainter",
        "vllmini/viz/explorer.py:_locked",
        "vllmini/viz/explorer.py:PageTableExplorer.last_copies",
        "vllmini/viz/explorer.py:PageTableExplorer.step",
        "vllmini/viz/explorer.py:PageTableExplorer.click",
        "vllmini/viz/explorer.py:PageTableExplorer._on_msg",
        "vllmini/viz/explorer.py:PageTableExplorer.labels",
        "vllmini/viz/explorer.py:PageTableExplorer._status_html",
    ),
    "15 nothing lost, nothing hangs": (
        "vllmini/interrupts.py",
        "vllmini/emulator/_launch.py:time_limit_seconds",
        "vllmini/emulator/_launch.py:_wait",
        "vllmini/emulator/_checked.py:Region",
        "vllmini/emulator/_checked.py:regions",
        "vllmini/block_manager.py:BlockManager.snapshot",
        "vllmini/block_manager.py:BlockManager.restore",
        "vllmini/block_manager.py:BlockManager.num_pinned_blocks",
        "vllmini/engine.py:LLMEngine.abort_request",
        "vllmini/scheduler.py:Scheduler.abort",
        "vllmini/scheduler.py:Scheduler._retire",
        "vllmini/scheduler.py:Scheduler.snapshot",
        "vllmini/scheduler.py:Scheduler.restore",
    ),
}


# Whose work each commit since the first landing was that still owns lines in vllmini/*.py (7-digit
# prefixes). "12" is issue 12's own refactoring; "mixed" did issue 12's refactor and a later feature in
# one commit. A commit not listed (merges, anything newer than this table) counts as issue 12's, and so
# does work not committed yet.
_COMMITS = {
    "12": """d6b8ed4 1fbce03 01e3ebb 2d439a3 0e7cba0 aaabf37 072575c 059c855 e83aae3 f9c4f7f 8f9a5b8
        22ca2e7 202c69a 72c8440 070a5a6 6f15518 dde5560 be70dd5 ea96e36 279a455 1c197af 167752b fe8d3cc
        303eebd 19dda1b e73bef3 9e874de 8fadae7 226ad06 6d9c4bb e8e0dc2 c29918b 9070748 8eba7df bb57e2a
        1fb98e2 d68204c db0b1c8 61e272a a3e7272 2f449e6 118fffb ecbb790 cea7f09 9f214b8 11875f1 e8f197d
        469f54e 7487413 eb3a1cf""",
    "mixed": "9cb3ab7 353c476 20fc288 cfff10e",
    "8 fast kernel": "04b2201 1266bf5 547cab6 3e60b2a fb90e65 d8b05a0 f4b2fe1 4426679",
    "9 CUDA chapter": "f8a6909 3bc0f6f 7a468ba 4f31ffe bb9bd3b",
    "10 sharing": """a9595dc 814a8d5 1cd6b16 5b194da 1788f99 6dd0f82 5df3a0e c62e656 8b3736e 6d8c427
        20d3778 645dd05""",
    "11 learner's path": "caf657c 85d1cfb 829c73a 199532a ece9e18 5054829 aa97fe2 283240b 33cdfd4",
    "13 engine under load": """0cfe2d0 83a77b9 b8291e2 53d1006 5ea3a69 d98c6e4 9ab5591 b42c820 28d44e6
        3b8435c b0d8a1a e853a71 a4f2371 43478b4 b5dfb24 df54def f312512 c1c87e7 4b21641 8152cff""",
    "14 explorer in a browser": """4936022 905ecd9 56f4dfc 9991abe ba1dfe9 fdbb5f0 addd0c0 262f803 715c1f6
        29f0b2e 4073ed4 b257b4b b612e7c""",
    "15 nothing lost, nothing hangs": "3a9a1b8",
}
COMMITS = {sha: issue for issue, shas in _COMMITS.items() for sha in shas.split()}
BLAME_HEADER = re.compile(r"^([0-9a-f]{40}) \d+ \d+")


def read_tree(rev: str | None) -> dict[str, str]:
    """path -> text of every vllmini/*.py at `rev` (None: the working tree)."""
    if rev is None:
        return {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "vllmini").rglob("*.py"))}
    names = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", rev, "vllmini"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    show = ["git", "show"]
    return {
        n: subprocess.run([*show, f"{rev}:{n}"], cwd=ROOT, check=True, capture_output=True, text=True).stdout
        for n in names
        if n.endswith(".py")
    }


def symbols(tree: ast.Module) -> dict[str, ast.AST]:
    """Top-level functions and classes, and methods as Class.method."""
    found = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = node
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found[f"{node.name}.{item.name}"] = item
    return found


def docstring_lines(tree: ast.Module) -> set[int]:
    """Line numbers of every docstring (module, class, function)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def owners(path: str, text: str) -> list[str]:
    """For each line of `path`, the issue whose code it is ("" for first-landing code)."""
    tree = ast.parse(text)
    n = len(text.splitlines())
    owner = [""] * (n + 1)  # 1-based
    found = symbols(tree)
    for issue, entries in LATER.items():
        for entry in entries:
            file, _, name = entry.partition(":")
            if file != path:
                continue
            if not name:
                owner = [issue] * (n + 1)
                continue
            if name not in found:
                raise SystemExit(f"LATER names {entry}, which {path} does not define")
            node = found[name]
            start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
            for i in range(start, node.end_lineno + 1):
                owner[i] = issue
    return owner[1:]


def blamed_owners(path: str, text: str, rev: str | None, first_landing: set[str], ignore: str) -> list[str]:
    """For each line of `path`: its LATER issue if it has one, else "first landing" when git blame (seeing
    through the commits listed in the file `ignore`) finds it at the first landing, else whose work the
    commit that wrote it was (COMMITS)."""
    cmd = ["git", "blame", "-w", "-M", "-C", "-C", "--ignore-revs-file", ignore, "--line-porcelain"]
    out = subprocess.run(
        [*cmd, *([rev] if rev else []), "--", path], cwd=ROOT, check=True, capture_output=True
    )
    shas = [m.group(1) for m in map(BLAME_HEADER.match, out.stdout.decode().splitlines()) if m]
    return [
        issue or ("first landing" if sha in first_landing else COMMITS.get(sha[:7], "12"))
        for issue, sha in zip(owners(path, text), shas, strict=True)
    ]


def count(files: dict[str, str], later: bool, who=None) -> dict:
    """[lines, code lines] per (file, owner); owners from `who(path, text)`, else LATER (or none)."""
    totals: dict = defaultdict(lambda: [0, 0])
    for path, text in files.items():
        lines = text.splitlines()
        skip = docstring_lines(ast.parse(text))
        if who is None:
            who_of = owners(path, text) if later else [""] * len(lines)
        else:
            who_of = who(path, text)
        for i, line in enumerate(lines, 1):
            stripped = line.strip()
            totals[(path, who_of[i - 1])][0] += 1
            totals[(path, who_of[i - 1])][1] += (
                bool(stripped) and not stripped.startswith("#") and i not in skip
            )
    return totals


def where(path: str) -> str:
    return "emulator" if "/emulator/" in path else "package"


def sums(totals: dict, key) -> dict:
    """`totals` added up by key(path, owner)."""
    out: dict = defaultdict(lambda: [0, 0])
    for (path, owner), (lines, code) in totals.items():
        out[key(path, owner)][0] += lines
        out[key(path, owner)][1] += code
    return out


def row(label: str, *cells) -> str:
    return "| " + " | ".join([f"{label:52}", *(f"{c[0]} ({c[1]})" if c else "" for c in cells)]) + " |"


def check_later(files: dict[str, str]) -> None:
    """Every LATER entry names a file (and symbol) that exists, so the table cannot go stale unseen."""
    for entries in LATER.values():
        for entry in entries:
            file = entry.partition(":")[0]
            if file not in files:
                raise SystemExit(f"LATER names {entry}, but {file} does not exist")
            owners(file, files[file])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--old", default=FIRST_LANDING, help="the first landing's commit")
    parser.add_argument("--new", default=None, help="a commit (default: the working tree)")
    parser.add_argument("--by-file", action="store_true", help="also each file: first-landing and later code")
    parser.add_argument(
        "--blame", action="store_true", help="also the count by the commit that wrote each line"
    )
    args = parser.parse_args()
    old, new = read_tree(args.old), read_tree(args.new)
    check_later(new)
    before, after = count(old, later=False), count(new, later=True)
    new_name = args.new or "now"
    print(f"vllmini/ Python, {args.old} against {args.new or 'the working tree'}: lines (code lines)\n")
    print(f"| {'':52} | {args.old} | {new_name} |\n|---|---|---|")
    was, now = sums(before, lambda p, o: (where(p), o)), sums(after, lambda p, o: (where(p), o))
    for part in ("package", "emulator"):
        print(f"| **{part}** ({'outside' if part == 'package' else 'inside'} vllmini/emulator/) | | |")
        print(row("first-landing features", was[(part, "")], now[(part, "")]))
        for issue in LATER:
            if (part, issue) in now:
                print(row(f"added by issue {issue}", None, now[(part, issue)]))
        print(
            row("all", was[(part, "")], [sum(v[k] for (w, _), v in now.items() if w == part) for k in (0, 1)])
        )
    if args.by_file:
        print(f"\n| file | {args.old} | {new_name}: first landing | {new_name}: later issues |")
        print("|---|---|---|---|")
        was, now = sums(before, lambda p, o: p), sums(after, lambda p, o: (p, bool(o)))
        for path in sorted(set(was) | {p for p, _ in now}):
            print(row(path, was.get(path), now.get((path, False)), now.get((path, True))))

    if args.blame:
        print_blame(args, before)


def print_blame(args, before: dict) -> None:
    """The table again, each line owned as git blame finds it (see the module docstring)."""
    first = set(_git("rev-list", args.old).split())
    since = _git("rev-list", f"{args.old}..{args.new or 'HEAD'}").split()
    new = read_tree(args.new)
    with tempfile.NamedTemporaryFile("w", suffix=".revs") as ignore:
        ignore.write("".join(f"{sha}\n" for sha in since if COMMITS.get(sha[:7], "12") in ("12", "mixed")))
        ignore.flush()
        owner_of = functools.partial(blamed_owners, rev=args.new, first_landing=first, ignore=ignore.name)
        after = count(new, later=True, who=owner_of)
    was = sums(before, lambda p, o: where(p))
    now = sums(after, lambda p, o: (where(p), "12" if o == "mixed" else o))
    print("\nBy git blame (-w -M -C -C, seeing through issue 12's commits): lines (code lines)\n")
    print(f"| | {args.old} | {args.new or 'now'} |\n|---|---|---|")
    for part in ("package", "emulator"):
        kept, added = now.get((part, "first landing"), [0, 0]), now.get((part, "12"), [0, 0])
        print(f"| **{part}** | | |")
        print(row("first-landing features", was[part], [kept[k] + added[k] for k in (0, 1)]))
        print(row("  as at the first landing, or rewritten from it", None, kept))
        print(row("  added outright by issue 12's commits", None, added))
        for issue in LATER:
            if (part, issue) in now:
                print(row(f"added by issue {issue}", None, now[(part, issue)]))


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


if __name__ == "__main__":
    main()
