"""Register ``"ragged_fsdp"`` in Lightning's strategy registries (Trainer and Fabric) without importing Lightning.

Lightning 2.6 has no entry point for third-party strategies, so ``import lightning_ragged``
must register the name. Importing ``lightning.pytorch`` costs seconds per process, which
plain ``fully_shard`` users (and every test worker) should not pay. So, for each of
``lightning.pytorch.strategies`` (``StrategyRegistry``) and ``lightning.fabric.strategies``
(``STRATEGY_REGISTRY``):

* if the module is already imported, register now;
* otherwise a one-shot import hook registers right after that module has run.

Each entry is a factory that imports its strategy on first use, so ``Trainer(strategy="ragged_fsdp")``
builds a ``RaggedFSDPStrategy`` and ``Fabric(strategy="ragged_fsdp")`` a ``RaggedFSDPFabricStrategy``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Any

STRATEGY_NAME = "ragged_fsdp"
_DESCRIPTION = "ragged, structure-aware FSDP (veScale-FSDP) from lightning_ragged"


def _make_strategy(**kwargs: Any) -> Any:
    from lightning_ragged.lightning.strategy import RaggedFSDPStrategy

    return RaggedFSDPStrategy(**kwargs)


def _make_fabric_strategy(**kwargs: Any) -> Any:
    from lightning_ragged.lightning.fabric_strategy import RaggedFSDPFabricStrategy

    return RaggedFSDPFabricStrategy(**kwargs)


_TARGETS = {  # module -> (its registry's name, the factory)
    "lightning.pytorch.strategies": ("StrategyRegistry", _make_strategy),
    "lightning.fabric.strategies": ("STRATEGY_REGISTRY", _make_fabric_strategy),
}


def _register_into(module: ModuleType) -> None:
    registry_name, factory = _TARGETS[module.__name__]
    registry = getattr(module, registry_name, None)
    if registry is not None and STRATEGY_NAME not in registry:
        registry.register(STRATEGY_NAME, factory, description=_DESCRIPTION)


class _PostImportLoader(importlib.abc.Loader):
    """Runs the real loader, then registers."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _register_into(module)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, target: str) -> None:
        self.target = target

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.target:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from finding us again
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _PostImportLoader(spec.loader)
        return spec


def register_ragged_fsdp() -> None:
    """Make ``Trainer(strategy="ragged_fsdp")`` and ``Fabric(strategy="ragged_fsdp")`` work (idempotent)."""
    for target, (registry_name, _) in _TARGETS.items():
        module = sys.modules.get(target)
        if module is not None and hasattr(module, registry_name):
            _register_into(module)
        elif not any(isinstance(finder, _RegisterOnImport) and finder.target == target for finder in sys.meta_path):
            sys.meta_path.insert(0, _RegisterOnImport(target))
