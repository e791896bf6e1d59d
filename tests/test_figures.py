"""One number per fact: every figure the README's "What it measures" section quotes, and the course model's
sizes, is read here from a recorded file under `benchmarks/recorded/`, and the notebooks' printed GPU
figures agree with the files they name.

Each README figure is a row of FIGURES: the README's words with `{}` where the figures go, the recorded file,
and a function that reads the figures from the file and rounds them as the README does. The row passes only
when the README shows exactly that text, so changing a figure in the README or in the file fails it. A
number in the section that no row covers fails `test_every_number_in_the_section_is_accounted_for`.
"""

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import torch

from vllmini import cuda_kernels

ROOT = Path(__file__).resolve().parents[1]
GUARD, TC = cuda_kernels.IDEAS["guard"], cuda_kernels.TENSOR_CORES  # rows "v9 kernel", "v10 splits=n"
HALF = [v.number for v in cuda_kernels.VERSIONS if torch.float16 in v.dtypes]  # notebook 07's rows
RECORDED = ROOT / "benchmarks" / "recorded"
PUBLIC_CALL = "h200_public_call_2026-12-03_1922.txt"
TENSOR_CORES = "h200_tensor_cores_2026-12-03_1922.txt"
DTYPES = ("float16", "bfloat16", "float32")
HALVES = DTYPES[:2]  # the public call and tensor-core runs: 16-bit only


def _flat(text: str) -> str:
    return " ".join(text.split())  # the README wraps lines anywhere


@cache
def readme_measures() -> str:
    """The section "What it measures", its heading included, on one line."""
    text = (ROOT / "README.md").read_text()
    start = text.index("## What it measures")
    return _flat(text[start : text.index("\n## ", start + 1)])


@cache
def readme_course_model() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("**The course model.**")
    return _flat(text[start : text.index("\n\n", start)])


@cache
def recorded(name: str) -> dict:
    return json.loads((RECORDED / name).read_text())


def _table_lines(name: str) -> list[list[str]]:
    """The whitespace-split rows of a recorded text table: the lines that name a dtype."""
    rows = []
    for line in (RECORDED / name).read_text().splitlines():
        tokens = line.split()
        if any(t in DTYPES for t in tokens) and not line.startswith(("shape", "#", "v6 case")):
            rows.append(tokens)
    return rows


@dataclass(frozen=True)
class CallRow:
    """One row of bench_public_call.py's table: ours (the public call) against cuDNN SDPA."""

    shape: str
    dtype: str
    version: int
    ratio: float  # GPU time, ours / cuDNN's
    host_us: float  # ours, per call
    eager_ratio: float  # nan where not measured (batch > 1)


@cache
def public_call() -> list[CallRow]:
    rows = []
    for t in _table_lines(PUBLIC_CALL):
        i = next(k for k, tok in enumerate(t) if tok in DTYPES)
        n = t[i + 1 :]
        rows.append(CallRow(" ".join(t[:i]), t[i], int(n[0]), float(n[3]), float(n[5]), float(n[8])))
    assert len(rows) == 16, f"{PUBLIC_CALL}: expected 16 rows (8 shapes x 2 dtypes), found {len(rows)}"
    return rows


def call_row(label: str, dtype: str) -> CallRow:
    (row,) = [r for r in call_rows(label) if r.dtype == dtype]
    return row


def call_rows(*labels: str) -> list[CallRow]:
    """The rows whose shape starts with one of `labels` ("(a)", "GQA 32/4"), both dtypes."""
    rows = [r for r in public_call() if r.shape.startswith(labels)]
    assert len(rows) == 2 * len(labels), f"{labels}: {len(rows)} rows in {PUBLIC_CALL}"
    return rows


@cache
def tensor_cores() -> dict[tuple[str, str, str], float]:
    """(shape, dtype, row) -> time over cuDNN's, from bench_tensor_cores.py's table."""
    out = {}
    for t in _table_lines(TENSOR_CORES):
        i = next(k for k, tok in enumerate(t) if tok in DTYPES)
        out[" ".join(t[:i]), t[i], " ".join(t[i + 1 : -4])] = float(t[-2])
    return out


@cache
def tensor_core_times() -> dict[tuple[str, str, str], float]:
    """(shape, dtype, row) -> GPU time in us, from bench_tensor_cores.py's table."""
    out = {}
    for t in _table_lines(TENSOR_CORES):
        i = next(k for k, tok in enumerate(t) if tok in DTYPES)
        out[" ".join(t[:i]), t[i], " ".join(t[i + 1 : -4])] = float(t[-4])
    return out


def _tensor_core_line(shape: str, dtype: str) -> tuple:
    """Notebook 07's line for a GQA shape: cuDNN's time, the guard version's and the fastest tensor-core row's
    ratios, its pieces."""
    times = tensor_core_times()
    best = min((r for s, d, r in times if (s, d) == (shape, dtype) and r.startswith(f"v{TC} splits=")),
             key=lambda r: times[shape, dtype, r])  # fmt: skip
    ratios = tensor_cores()
    return (
        times[shape, dtype, "cuDNN sdpa"],
        ratios[shape, dtype, f"v{GUARD} kernel"],
        ratios[shape, dtype, best],
        int(best.split("=")[1]),
    )


def text_date(name: str) -> str:
    """The date of a recorded text table's run ("2026-12-02 14:13 UTC, NVIDIA H200")."""
    m = re.search(r"^(\d{4}-\d\d-\d\d) \d\d:\d\d UTC, NVIDIA H200", (RECORDED / name).read_text(), re.M)
    assert m, f"{name} names no dated H200 run"
    return m.group(1)


def date_of(name: str) -> str:
    return recorded(name)["date"] if name.endswith(".json") else text_date(name)


def span(values, decimals: int = 2) -> str:
    """'1.01–1.03' for the range of `values` rounded as the README rounds them; one figure when they agree."""
    shown = sorted({round(v, decimals) for v in values})
    lo, hi = (f"{v:.{decimals}f}" for v in (shown[0], shown[-1]))
    return lo if lo == hi else f"{lo}–{hi}"


def decode_rows() -> list[dict]:
    return recorded("h200_decode_table.json")["decode_table"]


def decode_row(batch: int) -> dict:
    (row,) = [r for r in decode_rows() if r["batch"] == batch]
    return row


def sharegpt_cpu(policy: str) -> dict:
    return recorded("engine_cpu.json")["queued_at_step_0"]["sharegpt"][policy]


def no_sharing(flag: str) -> list[tuple[float, float]]:
    """(tokens/s with `flag`, tokens/s of the graphs run of the same round), per paired round."""
    tps = recorded("h200_prefix_caching.json")["no_sharing"]["tokens_per_s"]
    return list(zip(tps[flag], tps["graphs"], strict=True))


def no_sharing_costs_pct() -> list[float]:
    """What prefix caching cost with nothing shared, per paired round, in percent of the graphs run."""
    return [100 * (1 - pc / g) for pc, g in no_sharing("prefix_caching")]


def system_prompt() -> dict:
    return recorded("h200_prefix_caching.json")["shared_system_prompt"]


def cached_share() -> float:
    """The share of prompt tokens found cached, with a shared system prompt and prefix caching."""
    w = system_prompt()["with_prefix_caching"]
    return w["prompt_tokens_cached"] / (w["prompt_tokens_cached"] + w["prompt_tokens_computed"])


def prefix_caching_gain_pct() -> float:
    with_, without = (
        system_prompt()[k]["tokens_per_s"] for k in ("with_prefix_caching", "without_prefix_caching")
    )
    return 100 * (with_ / without - 1)


def serving(*keys):
    rec = recorded("h200_serving.json")
    for k in keys:
        rec = rec[k]
    return rec


def common_threshold_ratio(baseline: str) -> float:
    return serving("sustained_rate_common_threshold", "paged") / serving(
        "sustained_rate_common_threshold", baseline
    )


@dataclass(frozen=True)
class Figure:
    """README words with `{}` for the figures; `read` takes them from `file` as the README rounds them."""

    words: str
    file: str
    read: Callable[[], tuple]

    def text(self) -> str:
        return self.words.format(*self.read())


MEASURES_FILES = [
    PUBLIC_CALL,
    TENSOR_CORES,
    "h200_decode_table.json",
    "engine_cpu.json",
    "h200_serving.json",
    "h200_prefix_caching.json",
]

FIGURES = [
    # the heading: the first and last dates of the runs the section quotes
    Figure(
        "(one NVIDIA H200, {} to {}; paging's batch sizes from a full-size CPU run, {})",
        "(every file the section reads)",
        lambda: (
            min(date_of(f) for f in MEASURES_FILES if f != "engine_cpu.json"),
            max(date_of(f) for f in MEASURES_FILES if f != "engine_cpu.json"),
            date_of("engine_cpu.json"),
        ),
    ),
    # the kernels: bench_public_call.py's one side-by-side run; ratio = the table's GPU-time ratio column
    Figure("side by side in one run, {})", PUBLIC_CALL, lambda: (text_date(PUBLIC_CALL),)),
    Figure(
        "multi-head shapes at {}x cuDNN (version {};",
        PUBLIC_CALL,
        lambda: (
            span(r.ratio for r in call_rows("(a)", "(b)", "(c)")),
            *{r.version for r in call_rows("(a)", "(b)", "(c)")},
        ),
    ),
    # paging's own cost: the multi-head shapes (a)-(c), both dtypes
    Figure(
        "paging costs at most {}%)",
        PUBLIC_CALL,
        lambda: (f"{max(100 * (r.ratio - 1) for r in call_rows('(a)', '(b)', '(c)')):.0f}",),
    ),
    Figure(  # the eager columns, both dtypes
        "one 4k sequence called eagerly at {}–{}x",
        PUBLIC_CALL,
        lambda: tuple(f"{f(call_row('(f)', d).eager_ratio for d in HALVES):.2f}" for f in (min, max)),
    ),
    Figure(
        "one 32k sequence at {}–{}x",
        PUBLIC_CALL,
        lambda: tuple(f"{f(call_row('(d)', d).ratio for d in HALVES):.2f}" for f in (min, max)),
    ),
    Figure(
        "grouped-query attention on tensor cores (version {},",
        PUBLIC_CALL,
        lambda: tuple({r.version for r in call_rows("(e)", "GQA 32/4", "GQA 64/8")}),
    ),
    # 1.05-1.07x: shape (e) (GQA 32/8) and GQA 32/4, both dtypes
    Figure(
        "at {}x for GQA 32/8 and 32/4",
        PUBLIC_CALL,
        lambda: (span(r.ratio for r in call_rows("(e)", "GQA 32/4")),),
    ),
    Figure("{}x for 64/8", PUBLIC_CALL, lambda: (span(r.ratio for r in call_rows("GQA 64/8")),)),
    # version 9 on the same GQA 32/8 shape, bench_tensor_cores.py's "x cuDNN" column, both dtypes
    Figure(
        "(version 9 on CUDA cores: {}x)",
        TENSOR_CORES,
        lambda: (
            span(
                (tensor_cores()["B64 L4096 32/8", d, f"v{GUARD} kernel"] for d in ("float16", "bfloat16")), 1
            ),
        ),
    ),
    # the public call's host time per call on the shapes over the 15 us target, rounded to tens
    Figure(
        "about {}–{} µs of host time per call on some shapes (target 15)",
        PUBLIC_CALL,
        lambda: tuple(
            int(round(f(r.host_us for r in public_call() if r.host_us > 15), -1)) for f in (min, max)
        ),
    ),
    # the engine: bench_engine.py --decode-table, one row per batch size
    Figure(
        "(a random {}-parameter Llama in bfloat16)",
        "h200_decode_table.json",
        lambda: (
            re.match(r"random (\d\.\d+B)-parameter Llama", recorded("h200_decode_table.json")["model"])[1],
        ),
    ),
    Figure(
        "decode steps replayed from CUDA graphs run {} / {} / {} tokens/s at batch {} / {} / {}",
        "h200_decode_table.json",
        lambda: (*(f"{r['graph_tok_s']:,.0f}" for r in decode_rows()), *(r["batch"] for r in decode_rows())),
    ),
    Figure(
        "that is {}x / {}x / {}x transformers' `generate`",
        "h200_decode_table.json",
        lambda: tuple(f"{r['graph_tok_s'] / r['hf_tok_s']:.0f}" for r in decode_rows()),
    ),
    Figure(
        "and {}x / {}x / {}x the engine without graphs",
        "h200_decode_table.json",
        lambda: tuple(f"{r['graph_tok_s'] / r['eager_tok_s']:.1f}" for r in decode_rows()),
    ),
    Figure(
        "At batch 64 the GPU forward ({} ms) is still {}x the time to read the weights",
        "h200_decode_table.json",
        lambda: (
            f"{decode_row(64)['gpu_ms']:.1f}",
            f"{decode_row(64)['gpu_ms'] / decode_row(64)['read_ms']:.1f}",
        ),
    ),
    Figure(
        "KV cache once: {} kernel launches",
        "h200_decode_table.json",
        lambda: (recorded("h200_decode_table.json")["profile_decode"]["kernels_per_forward"],),
    ),
    Figure(
        "the engine's own Python adds {} ms a step",
        "h200_decode_table.json",
        lambda: (f"{decode_row(64)['graph_host_ms']:.1f}",),
    ),
    Figure(
        "With `num_scheduler_steps={}` (multi-step: a greedy decode batch runs {} forwards",
        "h200_decode_table.json",
        lambda: (
            (8, 8) if "num_scheduler_steps=8" in recorded("h200_decode_table.json")["what"] else ("?", "?")
        ),
    ),
    Figure(
        "the same run makes {} / {} / {} tokens/s, {}x / {}x / {}x `generate`, a step {}x / {}x / {}x the",
        "h200_decode_table.json",
        lambda: (
            *(f"{r['multi_tok_s']:,.0f}" for r in decode_rows()),
            *(f"{r['multi_tok_s'] / r['hf_tok_s']:.0f}" for r in decode_rows()),
            *(f"{r['multi_step_ms'] / r['read_ms']:.1f}" for r in decode_rows()),
        ),
    ),
    # paging: the batch and memory of bench_engine.py's full-size run (they do not depend on the model)
    Figure("max_model_len {};", "engine_cpu.json", lambda: (recorded("engine_cpu.json")["max_model_len"],)),
    Figure(
        "{}x the batch of static max-length reservation on ShareGPT-like requests",
        "engine_cpu.json",
        lambda: (f"{sharegpt_cpu('paged')['mean_batch'] / sharegpt_cpu('static')['mean_batch']:.1f}",),
    ),
    Figure(
        "with {} of the KV budget holding real tokens (static: {})",
        "engine_cpu.json",
        lambda: tuple(f"{sharegpt_cpu(p)['kv_holding_tokens']:.0%}" for p in ("paged", "static")),
    ),
    # serving on the wall clock: the rates as bench_serving.py reported them, and its ratio
    Figure(
        "paging sustains {} requests/s against {} for static reservation ({}x; {}x measured against one "
        "common latency threshold) and {} for an oracle",
        "h200_serving.json",
        lambda: (
            serving("sustained_rate", "paged"),
            serving("sustained_rate", "static"),
            f"{serving('sustained_rate_ratio', 'paged_over_static'):.2f}",
            f"{common_threshold_ratio('static'):.1f}",
            serving("sustained_rate", "oracle"),
        ),
    ),
    # sharing: scripts/gpu_check.py engine
    Figure(
        "with a {}-token system prompt shared by every request, prefix caching finds {} of prompt tokens "
        "cached and raises throughput by {}%",
        "h200_prefix_caching.json",
        lambda: (
            system_prompt()["system_prompt_tokens"],
            f"{cached_share():.0%}",
            f"{prefix_caching_gain_pct():.0f}",
        ),
    ),
    Figure(
        "with nothing shared it costs {}%, so it is off by default",
        "h200_prefix_caching.json",
        lambda: (span(no_sharing_costs_pct(), 0),),
    ),
]


def engine_default(option: str):
    from vllmini.engine import EngineConfig

    return EngineConfig.__dataclass_fields__[option].default


# statements of the section that are claims about the recorded runs rather than figures: (words, check)
CLAIMS = [
    ("so it is off by default", lambda: engine_default("enable_prefix_caching") is False),
    (
        ", and (e) at 1.05x",  # the target of 1.05x, missed by every (e) row
        lambda: all(r.ratio > 1.05 for r in call_rows("(e)")),
    ),
    (
        "Chunked prefill costs nothing measurable and is on by default",
        lambda: (
            all(chunked >= graphs for chunked, graphs in no_sharing("chunked_prefill"))
            and engine_default("enable_chunked_prefill") is True
        ),
    ),
]

# numbers in the section that are not measurements: shapes, versions, targets and the paper's figures
NOT_MEASURED = [
    "(head size 128,",
    "float64",
    "`mma.sync`",
    "(the paper: 4.3x)",
    "(the paper: 2.7–8x and 1.7–2.7x)",
    "see RESULTS.md",
]

# figures the README states that no recorded file holds yet: README words -> where the figure comes from
NOT_YET_RECORDED: dict[str, str] = {}  # none today

COURSE_MODEL = [
    Figure(
        "(Apache-2.0; {} MB, no other download",
        "course_model.json",
        lambda: (f"{recorded('course_model.json')['wheel_bytes'] / 1e6:.0f}",),
    ),
    Figure(
        "(`$VLLMINI_CACHE_DIR` to move it; about {} MB,",
        "course_model.json",
        lambda: (f"{round(recorded('course_model.json')['folder_bytes'] / 1e6, -1):.0f}",),
    ),
]
TOKENS = "course_model_tokens_2026-12-02.json"
COURSE_MODEL += [
    Figure(
        "On an H200 vllmini makes {}x, {}x and {}x `generate`'s tokens/s with it at batch 1, 8 and 64",
        TOKENS,
        lambda: tuple(f"{r['ratio']:.1f}" for r in recorded(TOKENS)["runs"][0]["rows"]),
    ),
    Figure(
        "on 2 CPU cores {}x and {}x at batch 1 and 8",
        TOKENS,
        lambda: tuple(
            f"{r['ratio']:.2f}" for r in recorded(TOKENS)["runs"][2]["rows"] if r["tree"] == "after"
        ),
    ),
]
COURSE_MODEL_NOT_YET_RECORDED: dict[str, str] = {}  # none today


def _figure_id(fig: Figure) -> str:
    return fig.words[:48]


@pytest.mark.parametrize("fig", FIGURES, ids=_figure_id)
def test_readme_figure_is_the_recorded_one(fig):
    expected = fig.text()
    assert expected in readme_measures(), (
        f"the README should read {expected!r} (from benchmarks/recorded/{fig.file})"
    )


@pytest.mark.parametrize("words, holds", CLAIMS, ids=[w[:48] for w, _ in CLAIMS])
def test_readme_claim_holds_in_the_recorded_runs(words, holds):
    assert words in readme_measures(), f"the README no longer says {words!r}: update CLAIMS"
    assert holds(), f"the recorded runs contradict {words!r}"


def test_every_number_in_the_section_is_accounted_for():
    """A figure added to the section without a row in FIGURES (or a listed reason) fails here."""
    rest = readme_measures()
    covered = [f.text() for f in FIGURES] + [w for w, _ in CLAIMS] + NOT_MEASURED + list(NOT_YET_RECORDED)
    stale = [words for words in covered if words not in rest]
    assert not stale, f"listed here but no longer in the README: {stale}"
    for words in sorted(covered, key=len, reverse=True):
        rest = rest.replace(words, " ")
    loose = [rest[max(0, m.start() - 30) : m.end() + 30] for m in re.finditer(r"\d+(?:[.,–]\d+)*", rest)]
    assert not loose, "numbers in README's 'What it measures' that no recorded file backs:\n" + "\n".join(
        loose
    )


def test_unrecorded_figures_are_still_in_the_readme():
    """The list of figures without a recorded file stays true: remove an entry when its figure goes."""
    text = readme_measures() + readme_course_model()
    gone = [w for w in [*NOT_YET_RECORDED, *COURSE_MODEL_NOT_YET_RECORDED] if w not in text]
    assert not gone, f"listed as unrecorded but no longer in the README: {gone}"


@pytest.mark.parametrize("fig", COURSE_MODEL, ids=_figure_id)
def test_course_model_figure_is_the_recorded_one(fig):
    expected = fig.text()
    assert expected in readme_course_model(), f"the README should read {expected!r} (from {fig.file})"


def test_the_recorded_course_model_is_the_pinned_wheel():
    from vllmini.models import MODELS

    rec, src = recorded("course_model.json"), MODELS["SmolLM2-135M-Instruct"]
    assert rec["wheel"] == f"{src.wheel}=={src.version}" and rec["wheel_sha256"] == src.sha256


def test_every_recorded_file_names_its_source():
    """Each recorded JSON says what it is and when it ran (and, when copied, which RESULTS.md section)."""
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    headings = [line.lstrip("#").strip() for line in results.splitlines() if line.startswith("##")]
    for path in sorted(RECORDED.glob("*.json")):
        rec = json.loads(path.read_text())
        assert {"what", "date"} <= rec.keys(), f"{path.name} lacks 'what' or 'date'"
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", rec["date"]), f"{path.name}: date {rec['date']!r}"
        named = rec.get("source", "") + rec["what"]
        if "RESULTS.md" in named:
            assert any(h in named for h in headings), f"{path.name} names no section of RESULTS.md"


# --- the notebooks: their printed GPU figures against the files they read ------------------------------


def _printed(notebook: str, marker: str) -> str:
    """The stored stdout of the one code cell of `notebook` whose source contains `marker`."""
    cells = json.loads((ROOT / "notebooks" / notebook).read_text())["cells"]
    (cell,) = [c for c in cells if c["cell_type"] == "code" and marker in "".join(c["source"])]
    return "".join("".join(o["text"]) for o in cell["outputs"] if o.get("name") == "stdout")


def _agrees(shown: str, value) -> bool:
    """`shown` is `value` as printed: the same string, or the number rounded to the decimals shown."""
    if isinstance(value, str):
        return shown == value
    shown = shown.replace(",", "")
    decimals = len(shown.split(".")[1]) if "." in shown else 0
    return f"{value:.{decimals}f}" == shown


def _decode_line(r: dict) -> tuple:
    return (
        r["hf_tok_s"],
        r["eager_tok_s"],
        r["graph_tok_s"],
        r["multi_tok_s"],
        r["graph_tok_s"] / r["hf_tok_s"],
        r["multi_tok_s"] / r["hf_tok_s"],
        r["gpu_ms"] / r["read_ms"],
    )


@cache
def _attention() -> dict:
    return json.loads((ROOT / "benchmarks" / "h200_attention.json").read_text())


def _attention_rows() -> list[dict]:
    return _attention()["rows"]


def _attention_facts() -> dict:
    return _attention()["facts"]


def _attention_time(shape: str, backend: str) -> float:
    (t,) = [r["time_us"] for r in _attention_rows() if r["shape"] == shape and r["backend"] == backend]
    return t


def _attention_shapes() -> list[str]:
    rows = _attention_rows()
    return list(dict.fromkeys(r["shape"] for r in rows if r["dtype"] == "float16" and r["block_size"] == 16))


def _share_line(row: str) -> tuple:
    """Notebook 07's line for one row (a kernel version, SDPA): its share of the read ceiling per shape, %."""
    shapes = _attention_shapes()
    return tuple(100 * _attention_time(s, "read ceiling") / _attention_time(s, row) for s in shapes)


def _public_call_line(letter: str) -> tuple:
    """Notebook 07's line for a shape: SDPA's time, the public call's eager and graph times and ratios."""
    shape = _attention_shapes()["abcdef".index(letter)]
    sdpa = _attention_time(shape, "sdpa (contiguous)")
    eager, graph = _attention_time(shape, "public call"), _attention_time(shape, "public call (graph)")
    return shape.split(" D=")[0], sdpa, eager, eager / sdpa, graph, graph / sdpa


N = r"([\d.,]+)"
CPU, GPU = "engine_cpu.json", "engine_h200.json"

# (notebook, a string of the cell's source, a pattern of its printed output, the values its groups show)
NOTEBOOK_FIGURES = [
    (
        "06_engine.ipynb",
        '"engine_cpu.json"',
        rf"CPU, full size, {N} steps, ShareGPT-like: mean batch static / oracle / paged {N} / {N} / {N}, "
        rf"KV holding tokens {N}% / {N}% / {N}%",
        lambda: (
            recorded(CPU)["steps"],
            *(sharegpt_cpu(p)["mean_batch"] for p in ("static", "oracle", "paged")),
            *(100 * sharegpt_cpu(p)["kv_holding_tokens"] for p in ("static", "oracle", "paged")),
        ),
    ),
    (
        "06_engine.ipynb",
        '"engine_cpu.json"',
        rf"(.+) \((\S+)\), {N} steps, ShareGPT-like: tokens/s static / oracle / paged {N} / {N} / {N}",
        lambda: (
            recorded(GPU)["gpu"],
            recorded(GPU)["date"],
            recorded(GPU)["steps"],
            *(
                recorded(GPU)["queued_at_step_0"]["sharegpt"][p]["tokens_per_s"]
                for p in ("static", "oracle", "paged")
            ),
        ),
    ),
    (
        "06_engine.ipynb",
        '"engine_cpu.json"',
        rf"64 prompts x 128 tokens: vllmini paged {N} tokens/s, static {N}, transformers generate {N}",
        lambda: tuple(
            recorded(GPU)["generate_64x128"]["tokens_per_s"][k]
            for k in ("vllmini_paged", "vllmini_static", "transformers_generate")
        ),
    ),
    (
        "06_engine.ipynb",
        '"h200_decode_table.json"',
        r"H200, (\S+) \(tokens/s\)",
        lambda: (recorded("h200_decode_table.json")["date"],),
    ),
    *(
        (
            "06_engine.ipynb",
            '"h200_decode_table.json"',
            rf"batch +{b} +{N} +{N} +{N} +{N} +{N}x +{N}x +{N}x",
            lambda b=b: _decode_line(decode_row(b)),
        )
        for b in (1, 8, 64)
    ),
    (
        "06_engine.ipynb",
        '"h200_serving.json"',
        rf"(.+) \((\S+)\), wall clock: sustained requests/s static / oracle / paged {N} / {N} / {N}:",
        lambda: (
            serving("gpu"),
            serving("date"),
            *(serving("sustained_rate", p) for p in ("static", "oracle", "paged")),
        ),
    ),
    pytest.param(
        "06_engine.ipynb",
        '"h200_serving.json"',
        rf"paged {N}x static, {N}x the oracle\n",
        lambda: (
            serving("sustained_rate_ratio", "paged_over_static"),
            serving("sustained_rate_ratio", "paged_over_oracle"),
        ),
        id="06-serving-ratio",
    ),
    (
        "06_engine.ipynb",
        '"h200_serving.json"',
        rf"one common threshold \(5x paged's lowest-rate latency\): paged {N}x static, {N}x the oracle",
        lambda: (common_threshold_ratio("static"), common_threshold_ratio("oracle")),
    ),
    (
        "06_engine.ipynb",
        '"h200_serving.json"',
        rf"a GPU step with graphs: {N} ms \+ {N} ms a token",
        lambda: (
            1e3 * serving("step_time_fit", "graphs_fixed_s"),
            1e3 * serving("step_time_fit", "graphs_per_token_s"),
        ),
    ),
    (
        "07_fast_kernel.ipynb",
        '"h200_attention.json"',
        r"recorded on (.+) UTC on an (.+), torch (\S+)",
        lambda: (_attention_facts()["date_utc"], _attention_rows()[0]["device"], _attention_facts()["torch"]),
    ),
    *(
        (
            "07_fast_kernel.ipynb",
            '"h200_attention.json"',
            rf"{re.escape(row)} +" + " +".join([rf"{N}%"] * 6),
            lambda row=row: _share_line(row),
        )
        for row in ("sdpa (contiguous)", *(f"v{n} kernel" for n in HALF))
    ),
    *(
        (
            "07_fast_kernel.ipynb",
            '"public call (graph)"',
            rf"\({letter}\) (\S+ \S+ \S+) +SDPA +{N} us \| public call +{N} us = {N}x, "
            rf"from a CUDA graph +{N} us = {N}x",
            lambda letter=letter: _public_call_line(letter),
        )
        for letter in "abcdef"
    ),
    (
        "07_fast_kernel.ipynb",
        f'"{TENSOR_CORES}"',
        r"recorded (\S+) \S+ UTC, NVIDIA H200",
        lambda: (text_date(TENSOR_CORES),),
    ),
    *(
        (
            "07_fast_kernel.ipynb",
            f'"{TENSOR_CORES}"',
            rf"{shape} {dtype} +cuDNN +{N} us +v{GUARD} {N}x +v{TC} {N}x \(splits={N}\)",
            lambda shape=shape, dtype=dtype: _tensor_core_line(shape, dtype),
        )
        for shape in ("B64 L4096 32/8", "B64 L4096 32/4", "B64 L4096 64/8")
        for dtype in ("float16", "bfloat16")
    ),
    (
        "solutions/07_fast_kernel_solutions.ipynb",
        "share = ",
        rf"version 9 on \(e\): {N} us",
        lambda: (_attention_time(_attention_shapes()[4], f"v{GUARD} kernel"),),
    ),
]


def _nb_id(index: int, case) -> str:
    values = getattr(case, "values", case)
    return getattr(case, "id", None) or f"{Path(values[0]).name[:2]}-{index}"


@pytest.mark.parametrize(
    "notebook, marker, pattern, values",
    NOTEBOOK_FIGURES,
    ids=[_nb_id(i, c) for i, c in enumerate(NOTEBOOK_FIGURES)],
)
def test_notebook_prints_the_recorded_figures(notebook, marker, pattern, values):
    printed = _printed(notebook, marker)
    m = re.search(pattern, printed)
    assert m, (
        f"{notebook}: no line matching {pattern!r} in the output of the cell reading {marker}:\n{printed}"
    )
    expected = values()
    assert len(expected) == len(m.groups())
    wrong = [(s, v) for s, v in zip(m.groups(), expected, strict=True) if not _agrees(s, v)]
    assert not wrong, f"{notebook} prints {m.group(0)!r}; the recorded file gives (shown, recorded) {wrong}"


def test_every_recorded_file_a_notebook_names_is_checked():
    """A notebook that starts reading another file under benchmarks/recorded/ needs rows above."""
    checked = {marker.strip('"') for _, marker, *_ in (getattr(c, "values", c) for c in NOTEBOOK_FIGURES)}
    checked |= {GPU}
    for path in sorted((ROOT / "notebooks").rglob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":
                for name in re.findall(r'RECORDED / "([^"]+)"', "".join(cell["source"])):
                    assert name in checked, f"{path.name} reads {name}: no row of NOTEBOOK_FIGURES checks it"
