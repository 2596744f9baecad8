"""Hugging Face export: a sharded checkpoint as ``safetensors`` that ``from_pretrained`` loads.

    python -m lightning_ragged.consolidate CKPT_DIR OUT_DIR --format hf --config config.json --prefix model.

Names are the checkpoint's minus ``prefix`` (the LightningModule attribute holding the
``transformers`` model); keys outside it are left out. With a config, the names and shapes
are checked against the model it builds (on the meta device) and tied weights are written
once, as ``save_pretrained`` does (its ``all_tied_weights_keys`` targets are dropped).
Files and index are those of ``transformers``: ``model.safetensors``, or
``model-0000i-of-0000N.safetensors`` plus ``model.safetensors.index.json`` (``weight_map``),
split by ``huggingface_hub.split_torch_state_dict_into_shards`` under ``max_shard_size``.

Memory stays at one file's tensors: each file's tensors are read from the DCP shards, written
and dropped before the next. The output is written to a hidden sibling and renamed when done.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_ragged.checkpoint.errors import CheckpointError, CheckpointMismatchError
from lightning_ragged.checkpoint.reader import CheckpointInfo, inspect_checkpoint
from lightning_ragged.layout.memory import parse_bytes

MAX_SHARD_SIZE = "5GB"
"""``save_pretrained``'s default file size bound."""


def parse_max_shard_size(value: int | str) -> int:
    """Bytes of ``max_shard_size`` ("5GB", "500MB", "2GiB", an int); a ``ValueError`` naming the parameter otherwise."""
    return parse_bytes(value, "max_shard_size")


def export_hf(
    checkpoint_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    config: str | os.PathLike | None = None,
    prefix: str = "",
    max_shard_size: int | str = MAX_SHARD_SIZE,
    weights_only: bool | None = None,
    trust_checkpoint: bool = False,
    verify_checksums: bool = True,
) -> Path:
    """Write the model of ``checkpoint_dir`` as a Hugging Face model directory ``output_dir``; return its path.

    ``config``: a ``config.json`` (or a directory holding one) copied into the output; it also
    names the tied weights and is checked against the exported names and shapes. Reading is
    as safe as ``consolidate``'s (weights-only unless trusted, checksums verified).
    """
    limit = parse_max_shard_size(max_shard_size)
    config_file = _config_file(config) if config is not None else None
    output = Path(output_dir)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise FileExistsError(f"output_dir={str(output)!r} exists and is not an empty directory; choose another path")
    info = inspect_checkpoint(
        checkpoint_dir, weights_only=weights_only, trust_checkpoint=trust_checkpoint, verify_checksums=verify_checksums
    )
    names = _hf_names(info, prefix)
    if config_file is not None:
        names = _drop_tied_and_check(names, info, config_file, prefix)
    part = output.with_name(f".{output.name}.partial")
    if part.is_symlink():  # an earlier run's leftover is removed; a link is removed, never written through
        part.unlink()
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    try:
        _write_files(info, names, part, limit)
        if config_file is not None:
            shutil.copyfile(config_file, part / "config.json")
    except BaseException:
        shutil.rmtree(part, ignore_errors=True)
        raise
    if output.exists():
        output.rmdir()
    os.replace(part, output)
    return output


def _config_file(config: str | os.PathLike) -> Path:
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"config={str(config)!r}: no such config.json (give the file or its directory)")
    return path


def _hf_names(info: CheckpointInfo, prefix: str) -> dict[str, str]:
    """Hugging Face name -> DCP key, for the model tensors under ``prefix`` (which is stripped)."""
    names: dict[str, str] = {}
    skipped = []
    for key, path in info.paths(info.model_key).items():
        name = ".".join(str(p) for p in path[1:])
        if not name.startswith(prefix):
            continue
        if not isinstance(info.metadata.state_dict_metadata[key], TensorStorageMetadata):
            skipped.append(name)
            continue
        names[name[len(prefix):]] = key
    if skipped:
        raise CheckpointError(f"{info.path}: {skipped} are not tensors; safetensors holds only tensors")
    if not names:
        sample = sorted(info.model_shapes())[:3]
        raise CheckpointError(f"{info.path}: no model tensor starts with prefix={prefix!r} (names are like {sample}); "
                              "pass --prefix with the attribute holding the Hugging Face model, e.g. 'model.'")
    return names


def _drop_tied_and_check(names: dict[str, str], info: CheckpointInfo, config_file: Path, prefix: str) -> dict[str, str]:
    """``names`` without the tied targets the config's model drops on save, after checking names and shapes against it."""
    saved = {name: tuple(info.metadata.state_dict_metadata[key].size) for name, key in names.items()}
    model = _meta_model(config_file, set(saved))
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(saved) - tied)
    unexpected = sorted(set(saved) - set(expected))
    wrong = sorted(n for n in set(saved) & set(expected) if saved[n] != expected[n])
    if missing or unexpected or wrong:
        raise CheckpointMismatchError(
            f"{info.path} (prefix={prefix!r}) does not match the {type(model).__name__} of {config_file}: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}, shapes differ {[(n, saved[n], expected[n]) for n in wrong[:5]]}; "
            "check --prefix (the LightningModule attribute holding the model, e.g. 'model.') and --config"
        )
    return {name: key for name, key in names.items() if name not in tied}


def _meta_model(config_file: Path, saved: set[str]) -> nn.Module:
    """The config's model on the meta device: its ``architectures[0]`` class, else the auto class whose names match ``saved``."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(config_file)
    named = [getattr(transformers, a) for a in config.architectures or () if hasattr(transformers, a)]
    candidates = named[:1] or [transformers.AutoModelForCausalLM, transformers.AutoModel]
    models = []
    with torch.device("meta"):
        for cls in candidates:
            try:
                model = cls.from_config(config) if cls.__name__.startswith("Auto") else cls(config)
            except ValueError:  # an auto class without a model for this config (e.g. no causal LM)
                continue
            if set(model.state_dict()) <= saved | set(getattr(model, "all_tied_weights_keys", None) or {}):
                return model
            models.append(model)
    if not models:
        raise CheckpointError(f"config={str(config_file)!r}: transformers builds no model from it ({candidates})")
    return models[0]


def _write_files(info: CheckpointInfo, names: dict[str, str], output: Path, limit: int) -> None:
    """One safetensors file at a time: its tensors read from the DCP shards, written, dropped."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    metadata = info.metadata.state_dict_metadata
    planner_data = info.metadata.planner_data or {}
    with torch.device("meta"):
        meta = {name: torch.empty(tuple(metadata[key].size), dtype=metadata[key].properties.dtype) for name, key in names.items()}
    split = split_torch_state_dict_into_shards(meta, filename_pattern="model{suffix}.safetensors", max_shard_size=limit)
    for filename, tensor_names in split.filename_to_tensors.items():
        tensors = {name: torch.empty(meta[name].shape, dtype=meta[name].dtype) for name in tensor_names}
        template: dict[str, Any] = {}
        for name, tensor in tensors.items():
            set_element(template, planner_data.get(names[name], (names[name],)), tensor)
        info.read_locally(template)  # shards verified against their checksums
        save_file(tensors, output / filename, metadata={"format": "pt"})
        del tensors, template
    if split.is_sharded:
        index = {"metadata": {"total_size": split.metadata.get("total_size", 0)}, "weight_map": split.tensor_to_filename}
        (output / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
