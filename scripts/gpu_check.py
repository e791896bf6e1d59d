"""Run vllmini's GPU checks on a CUDA machine, in tiers that each fit one 10-minute command.

    PYTHONPATH=. python scripts/gpu_check.py quick     # GPU tests, attention/kernel tests, GPU notebooks
    PYTHONPATH=. python scripts/gpu_check.py sanitize  # compute-sanitizer memcheck and racecheck
    PYTHONPATH=. python scripts/gpu_check.py bench     # bench_attention.py --preset h200, bench_engine.py
    PYTHONPATH=. python scripts/gpu_check.py serve     # bench_serving.py: latency against request rate
    PYTHONPATH=. python scripts/gpu_check.py engine    # bench_engine.py: CUDA graphs, prefix caching, chunks
    PYTHONPATH=. python scripts/gpu_check.py decode    # the decode step: tables, split rule, SmolLM2 shape
    PYTHONPATH=. python scripts/gpu_check.py all       # all four (longer than 10 minutes)
    python scripts/gpu_check.py pack                   # beforehand, with pip access: wheels into .whl/

The GPU machine lacks hypothesis (the tests' conftest imports it). `pack` downloads pure-Python wheels of
PACKED into .whl/ (git-ignored: carry it along); every command here puts .whl/*.whl on PYTHONPATH, and
Python imports a pure-Python wheel straight from the zip.

Run from the repository root. Needs torch with CUDA, CuPy, pytest and matplotlib; NOT jupyter, nbval or
IPython: notebooks are executed by a small runner here (code cells in order, in one namespace, matplotlib
Agg, stdout captured and compared with the stored stream outputs after notebooks/nbval_sanitize.cfg; cells
marked NBVAL_IGNORE_OUTPUT run but are not compared, raises-exception cells must raise, NBVAL_SKIP
cells are skipped). Like nbval it compares text, not images; unlike nbval it does not compare display_data.
Logs go to $OUT (default ./.gpu_out); a summary table (tier, item, status, seconds) ends the output and is
saved as $OUT/summary.txt and $OUT/summary.json.
"""

from __future__ import annotations

import argparse
import ast
import configparser
import contextlib
import importlib.abc
import importlib.util
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(os.environ.get("OUT", ROOT / ".gpu_out")).resolve()
TIER_BUDGET_S = 570  # each tier must finish inside one 10-minute command
GPU_NOTEBOOKS = ("04", "05a", "05b")  # notebooks that use a GPU when there is one
# 06 uses the GPU too, but also the course model, which set-up fetches from PyPI: the GPU machine has no
# network, so 06 runs under `make test` only (on a CPU, where strict nbval checks it).
NO_NETWORK = {"06": "needs the course model (make test fetches it from PyPI; the GPU machine has no network)"}
STUB_MODULES = ("ipywidgets", "IPython", "jupyter")  # not on the GPU machine
# test dependencies the GPU machine lacks; hypothesis >= 6.150 ships a compiled module, 6.149 is pure Python
PACKED = ("hypothesis>=6.100,<6.150", "sortedcontainers")
WHEELS = ROOT / ".whl"

results: list[dict] = []


# ----------------------------------------------------------------------------- running items


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ, **(extra or {}))
    packed = [str(p) for p in sorted(WHEELS.glob("*.whl"))]
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *packed, *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("MPLBACKEND", "Agg")
    return env


def run_item(tier: str, item: str, cmd: list[str], timeout: float, deadline: float, ok_text=None, env=None):
    """Run cmd with a timeout, log stdout+stderr to $OUT/<tier>_<item>.log, record pass/fail/timeout."""
    timeout = min(timeout, deadline - time.time())
    log = OUT / f"{tier}_{re.sub(r'[^A-Za-z0-9_.-]+', '_', item)}.log"
    if timeout < 5:
        results.append(dict(tier=tier, item=item, status="skipped (tier budget spent)", seconds=0.0, log=""))
        return
    start = time.time()
    print(f"[{tier}] {item}: {' '.join(cmd)}", flush=True)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_env(env), capture_output=True, text=True, timeout=timeout)
        output, code = proc.stdout + proc.stderr, proc.returncode
        status = "pass" if code == 0 and (ok_text is None or ok_text in output) else f"FAIL (exit {code})"
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        status = f"TIMEOUT ({timeout:.0f} s)"
    log.write_text(f"$ {' '.join(cmd)}\n{output}")
    tail = [line for line in output.strip().splitlines() if line.strip()][-1:] or [""]
    results.append(
        dict(
            tier=tier,
            item=item,
            status=status,
            seconds=round(time.time() - start, 1),
            log=log.name,
            last_line=tail[0][:200],
        )
    )
    print(f"    -> {status} in {time.time() - start:.1f} s ({tail[0][:150]})", flush=True)


def record_skip(tier: str, item: str, why: str):
    results.append(dict(tier=tier, item=item, status=f"skipped ({why})", seconds=0.0, log=""))
    print(f"[{tier}] {item}: skipped ({why})", flush=True)


# ----------------------------------------------------------------------------- tiers


def tier_quick():
    deadline = time.time() + TIER_BUDGET_S
    py = sys.executable
    run_item(
        "quick",
        "pytest -m gpu tests/",
        [py, "-m", "pytest", "-m", "gpu", "tests", "-q", "-rs", "-p", "no:cacheprovider"],
        300,
        deadline,
    )
    cpu_tests = [t for t in ("tests/test_attention.py", "tests/test_kernels.py") if (ROOT / t).exists()]
    run_item(
        "quick",
        "pytest (CPU) attention+kernels",
        [py, "-m", "pytest", *cpu_tests, "-m", "not gpu", "-q", "-p", "no:cacheprovider"],
        300,  # a fresh machine compiles every kernel version for the emulator first
        deadline,
    )
    for prefix, why in NO_NETWORK.items():
        record_skip("quick", f"notebook {prefix}_*", why)
    for prefix in GPU_NOTEBOOKS:
        found = sorted((ROOT / "notebooks").glob(f"{prefix}_*.ipynb"))
        if not found:
            record_skip("quick", f"notebook {prefix}_*", "not present")
        for nb in found:
            run_item(
                "quick",
                f"notebook {nb.name}",
                [py, str(Path(__file__).resolve()), "_notebook", str(nb)],
                150,
                deadline,
                ok_text="NOTEBOOK OK",
            )


def tier_sanitize():
    deadline = time.time() + TIER_BUDGET_S
    candidates = [*Path("/usr/local").glob("cuda*/bin/compute-sanitizer")]
    for site in sys.path:  # the nvidia-cuda-sanitizer-api wheel ships the binary too
        candidates += Path(site).glob("nvidia/cuda_sanitizer_api/compute-sanitizer/compute-sanitizer")
    sanitizer = shutil.which("compute-sanitizer") or next((str(p) for p in candidates if p.is_file()), None)
    if sanitizer is None:
        record_skip(
            "sanitize", "compute-sanitizer", "compute-sanitizer not found on PATH or in /usr/local/cuda*"
        )
        return
    driver = [sys.executable, str(Path(__file__).resolve()), "_kernel_driver"]
    for tool in ("memcheck", "racecheck"):
        cmd = [sanitizer, "--tool", tool, "--error-exitcode", "99", *driver]
        if tool == "memcheck":
            cmd[1:1] = ["--leak-check", "no"]
        # without torch's caching allocator each tensor is its own cudaMalloc, so memcheck sees its end
        env = {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
        run_item("sanitize", f"{tool} every kernel", cmd, 270, deadline, "KERNEL DRIVER OK", env)


def tier_bench():
    deadline = time.time() + TIER_BUDGET_S
    py = sys.executable
    bench = ROOT / "benchmarks" / "bench_attention.py"
    if bench.exists():
        OUT.mkdir(parents=True, exist_ok=True)
        files = ["--json", str(OUT / "h200_attention.json"), "--plot", str(OUT / "h200_attention.png")]
        cmd = [py, str(bench), "--preset", "h200", "--dtype", "float16", "bfloat16", "float32",
               "--block-sizes", "8", "32", "64", "128", "--graphs", *files]  # fmt: skip
        run_item("bench", "bench_attention --preset h200", cmd, 420, deadline)
    else:
        record_skip("bench", "bench_attention", "benchmarks/bench_attention.py not present")
    engine = ROOT / "benchmarks" / "bench_engine.py"
    if engine.exists():
        run_item("bench", "bench_engine", [py, str(engine), "--device", "cuda"], 300, deadline)
    else:
        record_skip("bench", "bench_engine", "benchmarks/bench_engine.py not present")


def tier_serve():
    deadline = time.time() + TIER_BUDGET_S
    OUT.mkdir(parents=True, exist_ok=True)
    files = ["--plot", str(OUT / "serving_sharegpt.png"), "--record-steps", str(OUT / "serving_steps.json")]
    budget = ["--time-budget", "470"]  # + the warm-up (~30 s) and the last run (up to 36 s): within 565 s
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_serving.py"), "--device", "cuda", *budget, *files]
    run_item("serve", "bench_serving --device cuda", cmd, 565, deadline)


ENGINE_VARIANTS = (  # (item, bench_engine.py flags): paged ShareGPT-like runs, side by side, alternating
    ("graphs", ["--cuda-graphs"]),
    ("graphs + prefix caching", ["--cuda-graphs", "--prefix-caching"]),
    ("graphs + chunked prefill", ["--cuda-graphs", "--chunked-prefill"]),
    ("graphs (again)", ["--cuda-graphs"]),
    ("graphs + prefix caching (again)", ["--cuda-graphs", "--prefix-caching"]),
    ("graphs + chunked prefill (again)", ["--cuda-graphs", "--chunked-prefill"]),
    ("graphs + system prompt 512", ["--cuda-graphs", "--system-prompt", "512"]),
    (
        "graphs + system prompt 512 + prefix caching",
        ["--cuda-graphs", "--system-prompt", "512", "--prefix-caching"],
    ),
    ("eager", ["--no-cuda-graphs"]),
)


def tier_engine(debug: bool = False):
    """bench_engine.py on the GPU: the decode table (tokens/s with and without CUDA graphs against
    transformers' generate, step times against the read time), then the paged ShareGPT-like run under
    each of ENGINE_VARIANTS. Every log is concatenated into $OUT/engine_logs.txt (few files come back)."""
    deadline = time.time() + TIER_BUDGET_S
    py, bench = sys.executable, str(ROOT / "benchmarks" / "bench_engine.py")
    OUT.mkdir(parents=True, exist_ok=True)
    if debug:  # the first batch size alone, every launch synchronous: an error names its op
        cmd = [py, bench, "--device", "cuda", "--decode-table", "--batch-sizes", "1", "--no-hf"]
        run_item(
            "engine", "decode table batch 1 (blocking)", cmd, 120, deadline, env={"CUDA_LAUNCH_BLOCKING": "1"}
        )
    cmd = [py, bench, "--device", "cuda", "--decode-table", "--json", str(OUT / "decode_table.json")]
    run_item("engine", "decode table", cmd, 240, deadline)
    for name, flags in ENGINE_VARIANTS:
        cmd = [py, bench, "--device", "cuda", "--no-hf", "--policies", "paged", "--workloads", "sharegpt",
               "--steps", "400", *flags]  # fmt: skip
        run_item("engine", f"paged sharegpt {name}", cmd, 90, deadline)
    with open(OUT / "engine_logs.txt", "w") as joined:
        for log in sorted(OUT.glob("engine_*.log")):
            joined.write(f"==== {log.name}\n{log.read_text()}\n")
            log.unlink()


def tier_decode():
    """The decode step (issue 25): the 0.85B decode table, the same with context pieces down to 64 tokens
    (does splitting a short context pay inside the forward?), the course model's shape, and version 10 alone
    on short contexts at 1-8 pieces. JSON records in $OUT."""
    deadline = time.time() + TIER_BUDGET_S
    py, bench = sys.executable, str(ROOT / "benchmarks" / "bench_engine.py")
    OUT.mkdir(parents=True, exist_ok=True)
    table = [py, bench, "--device", "cuda", "--decode-table", "--batch-sizes", "1", "8", "64",
             "--new-tokens", "64"]  # fmt: skip
    for item, flags in (
        ("decode table 0.85B", ["--json", str(OUT / "decode_table.json")]),
        ("decode table 0.85B, pieces >= 64 tokens", ["--min-split-tokens", "64", "--no-hf"]),
        ("decode table SmolLM2-135M shape", ["--shape", "smollm2-135m", "--json", str(OUT / "smollm2.json")]),
    ):
        run_item("decode", item, table + flags, 150, deadline)
    shapes = ["1x255x32x8", "8x255x32x8", "64x255x32x8", "64x511x32x8", "64x1023x32x8"]
    cmd = [py, str(ROOT / "benchmarks" / "bench_tensor_cores.py"), "--shapes", *shapes, "--splits", "1,2,4,8"]
    run_item("decode", "version 10 on short contexts", cmd, 120, deadline)


# ----------------------------------------------------------------------------- the kernel driver


def kernel_driver(runtime: str = "cupy", only: str | None = None) -> int:
    """A few small launches of every kernel version through CuPy, each checked against float64
    (sanitizers), versions 7-10 also split, 9-10 with their guard catching a bad id. runtime "emulator" runs
    the same on the CPU (to try the driver without a GPU); then kernels/layer_ops.cu. `only`: one version
    number, or "layer_ops"."""
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from attention_cases import assert_close, make_decode_case, reference_decode

    from vllmini import cuda_kernels

    cases = [  # (num_seqs, num_heads, num_kv_heads, head_size, block_size, seq_lens)
        (3, 4, 4, 128, 16, (1, 17, 100)),
        (2, 8, 2, 80, 8, (9, 33)),
        (1, 4, 1, 256, 1, (5,)),
    ]
    # version 10 (16-bit, head sizes 64 and 128): a GQA group of 4 in 8 rows, a group of 16 in 16 rows
    cases_tc = [(3, 8, 2, 128, 16, (1, 17, 100)), (2, 16, 1, 64, 8, (9, 33))]
    device = "cuda" if runtime == "cupy" else "cpu"
    keys = ("query", "key_cache", "value_cache", "block_tables", "seq_lens")
    for n, version in sorted(cuda_kernels.kernel_versions().items()):
        if only is not None and str(n) != only:
            continue
        tc = version.has("tensor_cores")
        dtypes = (torch.float16, torch.bfloat16) if tc else (torch.float32, torch.float16, torch.bfloat16)
        for i, (params, dtype) in enumerate(zip(cases_tc if tc else cases, dtypes, strict=False)):
            if dtype not in version.dtypes:
                continue
            for splits in (None, 2) if version.has("split_context") else (None,):
                case = make_decode_case(100 + i, *params, dtype=dtype, device=device)
                out = torch.empty_like(case["query"])
                args = [case[k] for k in keys]
                error = torch.zeros(5, dtype=torch.int32, device=device) if version.guard else None
                cuda_kernels.paged_attention_kernel(
                    *args, case["scale"], out, runtime=runtime, version=n, error=error, num_splits=splits
                )
                if runtime == "cupy":
                    torch.cuda.synchronize()
                assert_close(out, reference_decode(case))
                print(f"v{n} case {params} {dtype} splits={splits}: ok", flush=True)
        if version.guard:  # a bad id in use: never read (memcheck would see it), NaN rows, recorded
            case = make_decode_case(110, *(cases_tc if tc else cases)[0], device=device,
                                    dtype=version.dtypes[0])  # fmt: skip
            case["block_tables"][2, 3] = 10**8
            out = torch.empty_like(case["query"])
            error = torch.zeros(5, dtype=torch.int32, device=device)
            cuda_kernels.paged_attention_kernel(*[case[k] for k in keys], case["scale"], out, runtime=runtime,
                                                version=n, error=error)  # fmt: skip
            assert out[2].isnan().all() and error.tolist()[:4] == [1, 2, 3, 10**8], error.tolist()
            print(f"v{n} guard: ok", flush=True)
    if only in (None, "layer_ops"):  # kernels/layer_ops.cu: its tests on this runtime's device, in-process
        import pytest

        path, marks = str(ROOT / "tests" / "test_layer_ops.py"), "gpu" if device == "cuda" else "not gpu"
        code = pytest.main(["-q", "-p", "no:cacheprovider", "-m", marks, "-k", "not a_model_on", path])
        assert code == 0, f"tests/test_layer_ops.py: pytest exit status {code}"
        print("layer ops: ok", flush=True)
    print("KERNEL DRIVER OK")
    return 0


# ----------------------------------------------------------------------------- the notebook runner


def _sanitizers() -> list[tuple[re.Pattern, str]]:
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ROOT / "notebooks" / "nbval_sanitize.cfg")
    return [(re.compile(cfg[s]["regex"]), cfg[s].get("replace", "")) for s in cfg.sections()]


def _sanitize(text: str, rules) -> str:
    for pattern, replace in rules:
        text = pattern.sub(replace, text)
    return text


def _ipython_stub(name: str) -> types.ModuleType:
    """A stand-in for IPython (a package: get_ipython() is None, as in a plain Python shell; a version
    new enough that matplotlib asks nothing more) or IPython.display (display() does nothing)."""
    module = types.ModuleType(name)
    if name == "IPython":
        module.__path__ = []  # a package, so that `import IPython.display` works
        module.get_ipython = lambda: None
        module.version_info = (8, 24, 0, "")
        module.__version__ = "8.24.0 (gpu_check stub)"
    else:
        module.display = module.clear_output = lambda *a, **k: None
        module.HTML = module.Markdown = module.Image = lambda *a, **k: None
    return module


class _IPythonStubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on sys.meta_path: answers an import of IPython / IPython.display only when nothing else can.
    Nothing is put into sys.modules up front, so libraries that look for IPython there (matplotlib,
    tqdm) see a plain Python shell until a cell itself imports IPython -- and then a stub they can use.
    ipywidgets is not stubbed: a cell that needs it is skipped (see STUB_MODULES)."""

    names = ("IPython", "IPython.display")

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in self.names else None

    def create_module(self, spec):
        return _ipython_stub(spec.name)

    def exec_module(self, module):
        pass


def _install_stubs() -> None:
    """Let `from IPython.display import display` work without IPython (where a real one exists, it wins)."""
    if not any(isinstance(f, _IPythonStubFinder) for f in sys.meta_path):
        sys.meta_path.append(_IPythonStubFinder())


def _run_cell(source: str, ns: dict) -> tuple[str, str, object]:
    """exec a cell like Jupyter: the last expression's value is returned (the execute_result)."""
    lines = [ln for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!"))]
    tree = ast.parse("\n".join(lines))
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    out, err = io.StringIO(), io.StringIO()
    value = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        exec(compile(tree, "<cell>", "exec"), ns)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), ns)
    return out.getvalue(), err.getvalue(), value


def run_notebook(path: Path) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _install_stubs()
    rules = _sanitizers()
    nb = json.loads(path.read_text())
    sys.path.insert(0, str(ROOT))
    os.chdir(path.parent)  # notebooks run from notebooks/
    ns: dict = {"__name__": "__main__", "display": lambda *a, **k: None}
    failures, skipped, n = [], 0, 0
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        n += 1
        if "NBVAL_SKIP" in source:
            continue
        tagged = "raises-exception" in cell["metadata"].get("tags", [])  # the tag JupyterLab and nbval honour
        ignore, raises = "NBVAL_IGNORE_OUTPUT" in source, tagged or "NBVAL_RAISES_EXCEPTION" in source
        start = time.time()
        try:
            stdout, stderr, value = _run_cell(source, ns)
            error = None
        except ModuleNotFoundError as e:
            if e.name and e.name.split(".")[0] in STUB_MODULES:
                print(f"cell {index}: skipped, needs {e.name} (not installed here)")
                skipped += 1
                continue
            error = e
        except BaseException as e:  # noqa: BLE001 - a notebook cell may raise anything
            error = e
        plt.close("all")
        took = time.time() - start
        if error is not None:
            if raises:
                print(f"cell {index}: raised {type(error).__name__} as expected ({took:.1f} s)")
                continue
            failures.append(f"cell {index}: {type(error).__name__}: {error}")
            print(f"cell {index}: ERROR\n{''.join(traceback.format_exception(error))}")
            continue
        if raises:
            failures.append(f"cell {index}: expected an exception (NBVAL_RAISES_EXCEPTION), none raised")
            continue
        if ignore:
            print(f"cell {index}: ran, output not compared ({took:.1f} s)")
            continue
        want_out = "".join(
            "".join(o["text"])
            for o in cell["outputs"]
            if o["output_type"] == "stream" and o["name"] == "stdout"
        )
        want_err = "".join(
            "".join(o["text"])
            for o in cell["outputs"]
            if o["output_type"] == "stream" and o["name"] == "stderr"
        )
        results_ = [o for o in cell["outputs"] if o["output_type"] == "execute_result"]
        failed_before = len(failures)
        if _sanitize(stdout, rules) != _sanitize(want_out, rules):
            failures.append(f"cell {index}: stdout differs\n--- stored\n{want_out}--- got\n{stdout}")
        if _sanitize(stderr, rules).strip() != _sanitize(want_err, rules).strip():
            print(
                f"cell {index}: WARNING stderr differs (not failed)\n--- stored\n{want_err}--- got\n{stderr}"
            )
        if results_ and value is not None:
            import pprint

            want = _sanitize("".join(results_[0]["data"].get("text/plain", "")), rules)
            got = {_sanitize(repr(value), rules), _sanitize(pprint.pformat(value, width=79), rules)}
            if want not in got:
                failures.append(f"cell {index}: result differs\n--- stored\n{want}\n--- got\n{repr(value)}")
        print(f"cell {index}: {'ok' if len(failures) == failed_before else 'DIFF'} ({took:.1f} s)")
    for f in failures:
        print("FAILED", f)
    print(f"{path.name}: {n} code cells, {len(failures)} failed, {skipped} skipped for missing modules")
    if not failures:
        print("NOTEBOOK OK")
    return 1 if failures else 0


# ----------------------------------------------------------------------------- packing test dependencies


def pack() -> int:
    """Download pure-Python wheels of PACKED into .whl/ (run where pip can reach the index). A pure-Python
    wheel is a zip that Python imports from directly once it is on PYTHONPATH."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "-d", str(WHEELS), *PACKED]  # fmt: skip
    print(" ".join(cmd))
    return subprocess.run(cmd).returncode


# ----------------------------------------------------------------------------- main


def write_env() -> None:
    lines = [
        f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"python: {sys.version.split()[0]}",
        f"platform: {platform.platform()}",
    ]
    try:
        import torch

        lines.append(
            f"torch: {torch.__version__} cuda {torch.version.cuda} | available {torch.cuda.is_available()}"
        )
        if torch.cuda.is_available():
            lines.append(f"gpu: {torch.cuda.get_device_name(0)}")
    except Exception as e:  # noqa: BLE001
        lines.append(f"torch: {e!r}")
    try:
        import cupy

        lines.append(f"cupy: {cupy.__version__} | runtime {cupy.cuda.runtime.runtimeGetVersion()}")
    except Exception as e:  # noqa: BLE001
        lines.append(f"cupy: {e!r}")
    gxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    lines.append(f"c++ compiler (for vllmini.emulator): {gxx}")
    (OUT / "env.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def summary() -> int:
    rows = [("tier", "item", "status", "s")] + [
        (r["tier"], r["item"], r["status"], f"{r['seconds']:.1f}") for r in results
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    text = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)
    print("\n" + text)
    (OUT / "summary.txt").write_text(text + "\n")
    (OUT / "summary.json").write_text(json.dumps(results, indent=1) + "\n")
    failed = [r for r in results if not (r["status"] == "pass" or r["status"].startswith("skipped"))]
    print(f"\n{len(results) - len(failed)} of {len(results)} items passed or skipped; logs in {OUT}")
    return 1 if failed else 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_notebook":
        return run_notebook(Path(sys.argv[2]).resolve())
    if len(sys.argv) > 1 and sys.argv[1] == "pack":
        return pack()
    if len(sys.argv) > 1 and sys.argv[1] == "_kernel_driver":
        return kernel_driver(*sys.argv[2:4])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "tier", choices=["quick", "sanitize", "bench", "serve", "engine", "engine-debug", "decode", "all"]
    )
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    write_env()
    tiers = {"quick": tier_quick, "sanitize": tier_sanitize, "bench": tier_bench, "serve": tier_serve}
    tiers |= {"engine": tier_engine, "engine-debug": lambda: tier_engine(debug=True), "decode": tier_decode}
    for name in ("quick", "sanitize", "bench", "serve") if args.tier == "all" else [args.tier]:
        tiers[name]()
    return summary()


if __name__ == "__main__":
    sys.exit(main())
