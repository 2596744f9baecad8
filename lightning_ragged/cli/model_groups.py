"""The FSDP groups of a Hugging Face model, from its ``config.json`` alone.

The model is built on the meta device by ``transformers`` (no weights, nothing
downloaded) and grouped by :func:`lightning_ragged.engine.grouping.plan_groups`, the
grouping ``fully_shard`` uses, so the plan report sees the engine's groups, runs (one
DBuffer each) and tensors in module order. Identical groups are described once, with
their count. Presets are the public ``config.json`` fields that shape the parameters of
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
    config = json.loads(path.read_text())
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
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields))


def describe_model(config: dict[str, Any], name: str = "model", experts: Optional[str] = None) -> ModelDescription:
    """The distinct FSDP groups ``fully_shard`` would form on this model: its blocks, then the root group.

    ``experts="separate"`` describes every expert matrix as its own tensor, as checkpoints
    store them (see :func:`one_tensor_per_expert`); the default is the model's fused modules.
    """
    model = build_meta_model(config)
    kinds: dict[tuple, GroupKind] = {}
    members: dict[tuple, list[str]] = {}
    for group in plan_groups(model, None, DEFAULT_DBUFFER_SIZE):
        prefix = "" if group.module is None else f"{group.name}."
        runs = [[(param_name.removeprefix(prefix), param) for param_name, param in run] for run in group.runs]
        signature = tuple(tuple((n, tuple(p.shape), p.dtype) for n, p in run) for run in runs)
        key = (_stack_of(group.name), signature)
        if key not in kinds:
            if experts == "separate":
                runs = [one_tensor_per_expert(model, prefix, run) for run in runs]
            kinds[key] = GroupKind(key[0], 0, [[(n, tuple(p.shape)) for n, p in run] for run in runs])
            members[key] = []
        kinds[key].count += 1
        members[key].append(group.name)
    return ModelDescription(name, [_label(kind, members[key], kinds, experts) for key, kind in kinds.items()])


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


def _stack_of(group_name: str) -> str:
    """"model.layers.7" -> "layers": the stack a block belongs to ("root" stays "root")."""
    return re.sub(r"\.\d+$", "", group_name).rpartition(".")[2]


def _label(kind: GroupKind, names: list[str], kinds: dict[tuple, GroupKind], experts: Optional[str]) -> GroupKind:
    """Name a group kind by its stack, with its block indices where the stack has several kinds."""
    label = kind.name
    if sum(other.name == kind.name for other in kinds.values()) > 1:
        ends = [name.rpartition(".")[2] for name in names]
        first, last = ends[0], ends[-1]
        contiguous = all(e.isdigit() for e in ends) and ends == [str(i) for i in range(int(first), int(last) + 1)]
        label += f" {first}-{last}" if contiguous and len(ends) > 1 else f" {','.join(ends)}"
    if any(".experts." in f".{name}" for name, _ in kind.shapes):
        label += f" (MoE, experts {experts or 'fused'})"
    return GroupKind(label, kind.count, kind.runs, list(names))
