"""Reading a Llama checkpoint: a Hugging Face directory (config.json + safetensors, single file or
sharded; tokenizer.json and generation_config.json when present) or an in-memory `transformers` model,
into the tensors of a `vllmini.LlamaModel`. Nothing is downloaded. Every missing or damaged file is a
CheckpointError (CheckpointNotFoundError when absent) that names it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from vllmini.errors import CheckpointError, CheckpointNotFoundError, InvalidTypeError


class Checkpoint(NamedTuple):
    """What a checkpoint holds, read but not yet placed in a model."""

    config: Any  # what parse_config made of the config dict (a LlamaConfig)
    state: dict  # Hugging Face tensor name -> tensor
    tokenizer: Any  # a tokenizers.Tokenizer, or None
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


def read_checkpoint(path_or_hf_model, parse_config: Callable[[dict], Any]) -> Checkpoint:
    """Read a checkpoint directory or an in-memory transformers model; parse_config(config dict) makes
    the model's config (a parse error in config.json names that file)."""
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
    """A checkpoint directory's chat template (Jinja text): chat_template.jinja, else tokenizer_config.json's
    "chat_template"; None without one (or for an in-memory model)."""
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
    state = {}
    for shard in sorted(set(weight_map.values())):
        state.update(read_checkpoint_file(root / shard, load_file))
    return state


def load_hf_state_dict(
    model: torch.nn.Module, state: dict, dtype: torch.dtype, device: torch.device, where: str
) -> None:
    """Place Hugging Face-named tensors (`model.` prefix optional) into `model`, cast to dtype on device;
    every weight must be there with its shape (a tied lm_head may be absent)."""
    expected = {n: p.shape for n, p in model.named_parameters()}  # a tied lm_head appears once
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
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"{where} lacks weights {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    model.load_state_dict(tensors, strict=False, assign=True)
    if model.config.tie_word_embeddings:  # assign=True replaced the parameter: tie again
        model.lm_head.weight = model.embed_tokens.weight
