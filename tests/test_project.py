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
        "print(ck.kernel_dir()); print(len(ck.read_kernel_source('paged_attention_4_half_warps')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    kernel_dir, length = out.stdout.split()
    assert Path(kernel_dir) == site / "vllmini" / "kernels"
    assert int(length) == len((ROOT / "kernels" / "paged_attention_4_half_warps.cu").read_text())


def test_code_is_ruff_clean():
    """The house style (pyproject.toml's [tool.ruff]) holds for the package, tests, benchmarks and scripts."""
    dirs = [str(ROOT / d) for d in ("vllmini", "tests", "benchmarks", "scripts")]
    check = subprocess.run([sys.executable, "-m", "ruff", "check", *dirs], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


MAX_MODULE_LINES = 600  # issue 21: one module per concept, at most 600 lines
MAX_FUNCTION_LINES = 60  # longer only with a `# long: <why>` comment on the line above the def


def test_modules_and_functions_stay_small():
    """The package's size rules: no module over 600 lines, no function over 60 lines (docstring
    included) unless a comment says why. The emulator's Python counts too."""
    import ast

    too_long = []
    for path in sorted((ROOT / "vllmini").rglob("*.py")):
        lines = path.read_text().splitlines()
        name = path.relative_to(ROOT)
        if len(lines) > MAX_MODULE_LINES:
            too_long.append(f"{name}: {len(lines)} lines")
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                explained = lines[first - 2].strip().startswith("# long:")
                if length > MAX_FUNCTION_LINES and not explained:
                    too_long.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, "over the size rules:\n" + "\n".join(too_long)


def test_code_size_table_names_only_code_that_exists(monkeypatch):
    """scripts/code_size.py counts later issues' code apart through a table of modules and symbols; every
    entry must still name something, or the table would silently count it as first-landing code."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("code_size", ROOT / "scripts" / "code_size.py")
    code_size = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(code_size)
    files = code_size.read_tree(None)
    code_size.check_later(files)  # raises SystemExit naming a stale entry
    counts = code_size.sums(code_size.count(files, later=True), lambda path, owner: owner)
    assert counts["13 engine under load"][0] > 1000 and counts[""][0] > 0
    monkeypatch.setitem(code_size.LATER, "8 fast kernel", ("vllmini/attention.py:no_such_function",))
    with pytest.raises(SystemExit, match="no_such_function"):
        code_size.check_later(files)


def test_code_size_blame_labels_every_line(tmp_path):
    """--blame owns each line by the commit that wrote it: COMMITS names only real commits and known
    issues, and every line of a file gets one owner."""
    import importlib.util
    import subprocess

    spec = importlib.util.spec_from_file_location("code_size", ROOT / "scripts" / "code_size.py")
    code_size = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(code_size)
    assert set(code_size.COMMITS.values()) <= {"12", "mixed", *code_size.LATER}
    known = subprocess.run(["git", "cat-file", "-e", f"{code_size.FIRST_LANDING}^{{commit}}"], cwd=ROOT)
    if known.returncode != 0:
        pytest.skip("this clone lacks the history back to the first landing")
    for sha in code_size.COMMITS:
        assert code_size._git("rev-parse", "--verify", f"{sha}^{{commit}}").strip().startswith(sha)
    first = set(code_size._git("rev-list", code_size.FIRST_LANDING).split())
    text = (ROOT / "vllmini" / "errors.py").read_text()
    ignore = tmp_path / "none.revs"
    ignore.write_text("")
    owners = code_size.blamed_owners("vllmini/errors.py", text, "HEAD", first, str(ignore))
    assert len(owners) == len(text.splitlines())
    assert {"first landing", "12"} <= set(owners) <= {"first landing", "12", "mixed", *code_size.LATER}
