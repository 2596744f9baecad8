"""lightning_ragged: veScale-style FSDP with ragged, structure-aware shards for PyTorch Lightning."""

from lightning_ragged.layout.errors import DBufferAlignmentError, RaggedShardBoundaryViolation
from lightning_ragged.engine.api import fully_shard, get_state, no_sync, set_requires_gradient_sync
from lightning_ragged.engine.full_loads import load_full_state_dict
from lightning_ragged.engine.state_dict import full_state_dict
from lightning_ragged.engine.fsdp_module import FSDPModule, register_fsdp_forward_method
from lightning_ragged.engine.fp8_gather import Float8AllGather
from lightning_ragged.engine.full_params import summon_full_params
from lightning_ragged.engine.grad_clip import clip_grad_norm_, clip_grad_value_
from lightning_ragged.engine.torch_state_dict import hook_optimizer
from lightning_ragged.layout.planner import plan
from lightning_ragged.layout.ragged_shard import RaggedShard
from lightning_ragged.layout.spec import Layout, TensorSpec
from lightning_ragged.lightning.registration import register_ragged_fsdp
from lightning_ragged.engine.wrapper import FullyShardedDataParallel

__all__ = [
    "DBufferAlignmentError",
    "FSDPModule",
    "Float8AllGather",
    "FullyShardedDataParallel",
    "Layout",
    "RaggedFSDPFabricStrategy",
    "RaggedFSDPStrategy",
    "RaggedShard",
    "RaggedShardBoundaryViolation",
    "ShardAveragedModel",
    "TensorSpec",
    "clip_grad_norm_",
    "clip_grad_value_",
    "full_state_dict",
    "fully_shard",
    "get_state",
    "hook_optimizer",
    "load_full_state_dict",
    "no_sync",
    "plan",
    "register_fsdp_forward_method",
    "set_requires_gradient_sync",
    "summon_full_params",
]

# Lightning is imported only when the strategy is used (it costs seconds per process):
# "ragged_fsdp" is registered as soon as Lightning's strategies module loads, and
# `lightning_ragged.RaggedFSDPStrategy` (e.g. a LightningCLI class path) imports it on access (and
# `RaggedFSDPFabricStrategy`, its Fabric counterpart).
register_ragged_fsdp()


def __getattr__(name: str):
    if name == "RaggedFSDPStrategy":
        from lightning_ragged.lightning.strategy import RaggedFSDPStrategy

        return RaggedFSDPStrategy
    if name == "RaggedFSDPFabricStrategy":
        from lightning_ragged.lightning.fabric_strategy import RaggedFSDPFabricStrategy

        return RaggedFSDPFabricStrategy
    if name == "ShardAveragedModel":  # an EMA / weight average of a sharded module's shards
        from lightning_ragged.lightning.weight_averaging import ShardAveragedModel

        return ShardAveragedModel
    if name == "optim":  # `import lightning_ragged; lightning_ragged.optim.Muon` without a second import
        import importlib

        return importlib.import_module("lightning_ragged.optim")
    raise AttributeError(f"module 'lightning_ragged' has no attribute {name!r}")
