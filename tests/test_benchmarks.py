"""The benchmarks' CPU paths run: each script, small, as a person would call it (a subprocess, the
repository's root as the working directory), with the lines it must print. Their numbers are not checked
here (they are measurements: benchmarks/RESULTS.md); a script that fails or prints nothing is."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(script: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"{script} {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-2000:]}"
    return proc.stdout


def test_bench_engine_host_only_prints_each_phase():
    out = run("bench_engine.py", "--host-only", "--batch-sizes", "4")
    for kind in ("greedy:", "seeded", "greedy, num_scheduler_steps=8"):
        (line,) = [line for line in out.splitlines() if "host ms per decode step" in line and kind in line]
        phases = line.split("mean per step: ")[1]
        for phase in ("schedule", "inputs", "checks", "sampling", "commit", "snapshot", "other"):
            assert f"{phase} " in phases, line


@pytest.mark.parametrize(
    "args, printed",
    [
        (["--shape", "smollm2-135m"], "134.5M parameters"),  # the course model's shape, random weights
        (["--min-split-tokens", "64"], "context pieces of at least 64 tokens"),
    ],
)
def test_bench_engine_options(args, printed):
    out = run("bench_engine.py", "--launch-count", *args)
    assert printed in out and "launches per decode forward" in out


def test_bench_serving_sweeps_every_policy():
    out = run("bench_serving.py", "--rates", "4", "40", "--duration", "1")
    assert "highest rate sustained" in out
    for policy in ("static", "oracle", "paged"):
        assert f"  {policy} " in out
