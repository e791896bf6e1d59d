"""The project's set-up: packaging, the conda file, and what `import vllmini` pulls in."""

import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]

# pip name -> conda-forge name, where they differ (every other package has the same name on both)
PIP_TO_CONDA = {"torch": "pytorch", "cupy-cuda12x": "cupy", "nvidia-cuda-nvrtc-cu12": "cuda-nvrtc"}
CONDA_ONLY = {"python", "pip", "cuda-version"}  # the interpreter, the installer and the CUDA pin


def _name(requirement: str) -> str:
    return re.split(r"[ ;<>=!~\[]", requirement.strip(), maxsplit=1)[0].lower()


def test_environment_yml_names_the_same_packages_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    from_pip = {PIP_TO_CONDA.get(_name(r), _name(r)) for r in reqs}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    from_conda = {_name(d) for d in env["dependencies"] if isinstance(d, str)} - CONDA_ONLY
    assert from_pip - from_conda == set(), "in pyproject.toml but not in environment.yml"
    assert from_conda - from_pip == set(), "in environment.yml but not in pyproject.toml"
    assert "conda-forge" in env["channels"]


def test_constraints_pin_every_direct_dependency():
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt line {line!r} is not an exact pin (name==version)"
            pins[name.lower()] = version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"]) + [r for e in project["optional-dependencies"].values() for r in e]
    missing = {_name(r) for r in reqs} - set(pins)
    assert not missing, f"not pinned in constraints.txt: {sorted(missing)}"


def test_import_vllmini_stays_light():
    code = (
        "import sys, vllmini; vllmini.BlockManager; vllmini.paged_attention; "
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('matplotlib', 'ipywidgets', 'jupyter_client', 'IPython', 'cupy')); print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"import vllmini pulled in: {out}"


def test_every_public_name_resolves():
    import vllmini

    for name in vllmini.__all__:
        assert getattr(vllmini, name) is not None


def test_the_readme_package_example_runs():
    """The README's first Python example (the package without a checkpoint) runs and its comments hold."""
    import torch

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert blocks, "README.md has no python example"
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)  # noqa: S102 (our own README)
    assert scope["block_tables"].dtype == torch.int32 and tuple(scope["block_tables"].shape) == (2, 3)
    assert scope["seq_lens"].tolist() == [40, 7]
    assert tuple(scope["out"].shape) == (2, 8, 64) and torch.isfinite(scope["out"]).all()


@pytest.mark.slow
def test_wheel_ships_the_kernels(tmp_path):
    """A regular (non-editable) install must find kernels/*.cu: the wheel carries them as package data."""
    pip = [sys.executable, "-m", "pip"]
    wheel_dir, site = tmp_path / "wheel", tmp_path / "site"
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", wheel_dir, ROOT], check=True
    )
    (wheel,) = wheel_dir.glob("vllmini-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "kernels").rglob("*.cu"))
    assert sources, "no .cu files under kernels/"
    for src in sources:
        assert f"vllmini/{src}" in names, f"{src} missing from the wheel"
    assert "vllmini/emulator/cuda_emu.h" in names
    # installed from the wheel (not from this checkout), the package finds its kernels inside itself
    subprocess.run([*pip, "install", "--no-deps", "-q", "--target", site, wheel], check=True)
    code = (
        f"import sys; sys.path.insert(0, {str(site)!r}); import vllmini.cuda_kernels as ck; "
        "print(ck.kernel_dir()); print(len(ck.read_kernel_source('paged_attention_5_half_warps')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    kernel_dir, length = out.stdout.split()
    assert Path(kernel_dir) == site / "vllmini" / "kernels"
    assert int(length) == len((ROOT / "kernels" / "paged_attention_5_half_warps.cu").read_text())


def test_code_is_ruff_clean():
    """The house style (pyproject.toml's [tool.ruff]) holds for the package, tests, benchmarks and scripts."""
    dirs = [str(ROOT / d) for d in ("vllmini", "tests", "benchmarks", "scripts")]
    check = subprocess.run([sys.executable, "-m", "ruff", "check", *dirs], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
