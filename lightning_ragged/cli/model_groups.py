"""The FSDP groups of a Hugging Face model, from its ``config.json`` alone.

The model is built on the meta device by ``transformers`` (no weights, nothing
downloaded) and grouped by :func:`lightning_ragged.engine.grouping.plan_groups`, the
grouping ``fully_shard`` uses, so the plan report sees the engine's groups, runs (one
DBuffer each) and tensors in module order. Identical groups are described once, with
their count (:func:`lightning_ragged.engine.auto_grouping.describe_groups`, which
``fully_shard(planning="auto")`` uses too). Presets are the public ``config.json`` fields that shape the parameters of
a few models, stored as data in ``presets.json``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from lightning_ragged.engine.api import DEFAULT_DBUFFER_SIZE
from lightning_ragged.engine.auto_grouping import describe_groups
from lightning_ragged.engine.grouping import plan_groups
from lightning_ragged.layout.auto import GroupKind, Shapes  # the auto-planner's input types, defined there

_EXPERT = re.compile(r"experts\.(\d+)\.")

PRESETS: dict[str, dict[str, Any]] = json.loads(Path(__file__).with_name("presets.json").read_text())
"""meta-llama/Llama-3-70B, deepseek-ai/DeepSeek-V3 and openai/gpt-oss-120b: their config.json's shape fields."""


@dataclass
class ModelDescription:
    """A model's distinct FSDP groups, blocks first and the root group last."""

    name: str
    groups: list[GroupKind] = field(default_factory=list)

    @property
    def total_params(self) -> int:
        return sum(kind.count * sum(torch.Size(shape).numel() for _, shape in kind.shapes) for kind in self.groups)


def load_config(source: str) -> tuple[str, dict[str, Any]]:
    """(name, config) of a preset name or a path to a ``config.json`` (or its folder)."""
    key = source.lower()
    if key in PRESETS:
        return key, dict(PRESETS[key])
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise SystemExit(f"--config {source!r}: neither a preset ({', '.join(PRESETS)}) nor a config.json file")
    try:
        config = json.loads(path.read_text())
    except (ValueError, OSError) as error:  # not JSON (JSONDecodeError, UnicodeDecodeError), unreadable
        raise SystemExit(f"--config {source!r}: {path} is not a readable JSON file ({error})") from None
    if not isinstance(config, dict):
        raise SystemExit(f"--config {source!r}: {path} holds a JSON {type(config).__name__}, not a config object")
    config = config.get("text_config", config)  # multimodal configs nest the language model
    return path.parent.name or path.stem, config


def build_meta_model(config: dict[str, Any]) -> nn.Module:
    """The causal LM of a ``config.json`` dict, built on the meta device (``ValueError`` if transformers lacks it)."""
    try:
        import transformers
        from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise SystemExit(
            "the plan report builds the model from its config.json with transformers: pip install 'transformers>=5.23'"
        ) from None
    fields = dict(config)
    model_type = fields.pop("model_type", None)
    if model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"model_type {model_type!r} is not a model transformers {transformers.__version__} knows "
            "(a trust_remote_code model, or a newer transformers)"
        )
    from huggingface_hub.errors import StrictDataclassError

    try:
        built = AutoConfig.for_model(model_type, **fields)
    except StrictDataclassError as error:  # transformers' validation (a width no multiple of the heads): a traceback
        raise ValueError(f"transformers refuses this {model_type} config: {error.__cause__ or error}") from None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(built)


def describe_model(config: dict[str, Any], name: str = "model", experts: Optional[str] = None) -> ModelDescription:
    """The distinct FSDP groups ``fully_shard`` would form on this model: its blocks, then the root group.

    ``experts="separate"`` describes every expert matrix as its own tensor, as checkpoints
    store them (see :func:`one_tensor_per_expert`); the default is the model's fused modules.
    """
    model = build_meta_model(config)
    split = (lambda prefix, run: one_tensor_per_expert(model, prefix, run)) if experts == "separate" else None
    return ModelDescription(name, describe_groups(plan_groups(model, None, DEFAULT_DBUFFER_SIZE), split, experts))


def one_tensor_per_expert(model: nn.Module, prefix: str, run: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """``run`` with each fused expert tensor split into one tensor per expert, expert by expert.

    transformers' own reverse weight conversion (what ``save_pretrained`` writes) splits
    them, so a gate and up projection fused for the forward come apart as in the
    checkpoint; a tensor it keeps fused (GPT-OSS checkpoints are fused too) is split along
    its expert dimension. Consecutive expert tensors are interleaved expert by expert, the
    order of an ``nn.ModuleList`` of experts.
    """
    from transformers.core_model_loading import revert_weight_conversion

    result: list[tuple[str, Any]] = []
    pending: dict[int, list[tuple[str, Any]]] = {}
    for name, param in run:
        module, _, attr = name.rpartition(".")
        if module.rpartition(".")[2] != "experts":
            result += [entry for index in sorted(pending) for entry in pending[index]] + [(name, param)]
            pending.clear()
            continue
        split = revert_weight_conversion(model, {prefix + name: param})
        if not all(_EXPERT.search(key) for key in split):  # kept fused (or only renamed)
            split = {f"{prefix}{module}.{index}.{attr}": t for index, t in enumerate(param.unbind(0))}
        for key, tensor in split.items():
            index = int(_EXPERT.search(key).group(1))
            pending.setdefault(index, []).append((key.removeprefix(prefix), tensor))
    return result + [entry for index in sorted(pending) for entry in pending[index]]
