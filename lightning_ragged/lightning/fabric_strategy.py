"""``RaggedFSDPFabricStrategy``: ragged, structure-aware FSDP for Lightning Fabric.

``Fabric(strategy="ragged_fsdp")`` (registered on ``import lightning_ragged``) or
``Fabric(strategy=RaggedFSDPFabricStrategy(...))``; the same engine and knobs as the Trainer's
``RaggedFSDPStrategy``, in Fabric's call pattern:

* ``fabric.setup_module(model)`` shards the model in place (``sharding.py``); build the optimizer
  from the returned module's parameters, then ``fabric.setup_optimizers``. ``fabric.setup(model,
  optimizer)`` also works: the (fresh) optimizer's parameters are replaced by their shards.
* ``fabric.init_module(empty_init=True)`` builds on the meta device; setup materializes it tensor by tensor.
* ``fabric.no_backward_sync(model)``: no collective on the accumulating micro-batches;
  ``fabric.clip_gradients``: the global norm over the shards (``engine/grad_clip.py``).
* ``fabric.save`` / ``fabric.load``: the Trainer's checkpoint format (``fabric_checkpoints.py``),
  sharded by default, resharding to any world size; ``state_dict_type="full"``: one file.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Sequence, Union

import torch
import torch.distributed as dist
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.types import ReduceOp
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_ragged.engine.api import DEFAULT_DBUFFER_SIZE, no_sync
from lightning_ragged.engine.init_record import Recording, recording
from lightning_ragged.engine.grad_clip import clip_grad_norm_, clip_grad_value_, clip_target
from lightning_ragged.engine.torch_state_dict import hook_optimizer
from lightning_ragged.layout.granularity import GranularityPolicy
from lightning_ragged.lightning import fabric_checkpoints
from lightning_ragged.lightning.checkpoint_io import LightningCheckpointIO
from lightning_ragged.lightning.parallel import RaggedParallel
from lightning_ragged.lightning.knobs import check_strategy_knobs, unsupported_precision, without_fsdp2_defaults
from lightning_ragged.lightning.sharding import (
    ModuleSpec, hsdp_groups, mp_policy_for, replicate_degree_for, shard_module, sharded_scaler,
)


TRAINER_ONLY = {
    "metrics": "the metrics are a Trainer callback; with Fabric read lightning_ragged.EngineMetrics(model) and log "
               "its compute() yourself (docs/operations.md)",
    "monitor_port": "the monitor endpoint is a Trainer callback; with Fabric build it yourself: "
                    "lightning_ragged.observability.monitor.Monitor(EngineMetrics(model), port=...)",
    "monitor_address": "the monitor endpoint is a Trainer callback; with Fabric build it yourself: "
                       "lightning_ragged.observability.monitor.Monitor(EngineMetrics(model), address=...)",
    "sync_grads_each_micro_batch": "Fabric's loop decides each backward's reduction: leave the accumulating backwards "
                                   "outside fabric.no_backward_sync(model) to reduce each micro-batch",
}
"""The Trainer strategy's knobs Fabric has no place for, with what to do instead."""


class RaggedFSDPFabricStrategy(RaggedParallel, ParallelStrategy):
    """Fully sharded data parallel with ragged, structure-aware shards for Lightning Fabric.

    The knobs are ``RaggedFSDPStrategy``'s (see there), checked here before any process starts,
    except those that need a Trainer: ``dbuffer_size="recommended"`` (the metrics callback's
    tuning file), ``replicate_degree="auto"`` (planned from the model before the process
    groups), the metrics callback and the monitor endpoint.
    """

    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Optional[Precision] = None,
        *,
        shard_granularity: GranularityPolicy = "row",
        block_rows: int = 128,
        dbuffer_size: int = DEFAULT_DBUFFER_SIZE,
        planning_algorithm: str = "optimal",
        reshard_after_forward: Union[bool, int, None] = None,
        group_modules: Optional[Sequence[ModuleSpec]] = None,
        activation_checkpointing: Optional[Sequence[ModuleSpec]] = None,
        replicate_degree: Union[int, Literal["node"]] = 1,
        state_dict_type: Literal["sharded", "full"] = "sharded",
        checkpoint_compression: bool = False,
        async_checkpoint: bool = False,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        sync_module_states: bool = True,
        broadcast_buffers: bool = True,
        trust_checkpoint: bool = False,
        verify_checksums: bool = True,
        **kwargs: Any,
    ) -> None:
        owner = type(self).__name__
        kwargs = without_fsdp2_defaults(kwargs)
        knobs = dict(
            shard_granularity=shard_granularity, block_rows=block_rows, dbuffer_size=dbuffer_size,
            planning_algorithm=planning_algorithm, reshard_after_forward=reshard_after_forward,
            group_modules=group_modules, activation_checkpointing=activation_checkpointing,
            replicate_degree=replicate_degree, state_dict_type=state_dict_type,
            checkpoint_compression=checkpoint_compression, async_checkpoint=async_checkpoint,
            process_group_backend=process_group_backend, timeout=timeout,
            sync_module_states=sync_module_states, broadcast_buffers=broadcast_buffers,
            trust_checkpoint=trust_checkpoint, verify_checksums=verify_checksums,
        )
        if dbuffer_size == "recommended":
            raise ValueError(
                f"{owner}(dbuffer_size='recommended'): the recommendation is written by the Trainer's metrics "
                "callback; with Fabric pass the bytes (e.g. the 'dbuffer_size' of a ragged_fsdp_tuning.json)"
            )
        if replicate_degree == "auto":
            raise ValueError(
                f"{owner}(replicate_degree='auto'): Fabric builds the process groups before the model exists; "
                "pass an int (replicas) or 'node' (shard inside each node)"
            )
        for name in TRAINER_ONLY.keys() & kwargs.keys():
            raise TypeError(f"{owner}({name}={kwargs[name]!r}): {TRAINER_ONLY[name]}")
        check_strategy_knobs(knobs, kwargs, owner=owner)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        self._knobs = knobs
        self._engine_kwargs = kwargs
        self._init_recordings: list[Recording] = []
        """What ``module_init_context`` built (``init_record.py``), replayed to materialize a meta model."""
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._shard_group: Optional[dist.ProcessGroup] = None
        self._replicate_group: Optional[dist.ProcessGroup] = None
        self._backward_sync_control = _NoSync()
        self.checkpoints = LightningCheckpointIO(
            state_dict_type, checkpoint_compression, async_checkpoint,
            trust_checkpoint=trust_checkpoint, verify_checksums=verify_checksums,
        )
        self.checkpoints.adopt(checkpoint_io, type(self).__name__)

    # ------------------------------------------------------------- properties
    @ParallelStrategy.checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        """A plugin from ``Fabric(plugins=[...])``: see ``LightningCheckpointIO.adopt``."""
        self.checkpoints.adopt(io, type(self).__name__)
        self._checkpoint_io = io

    @property
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    def precision(self, precision: Optional[Precision]) -> None:
        if precision is not None:
            _check_precision(precision, type(self).__name__)
        self._precision = precision

    # --------------------------------------------------------------- launching
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # the world is known here (Fabric's construction): refuse an HSDP degree that cannot divide it before launch
        replicate_degree_for(self._knobs["replicate_degree"], self.num_nodes, self.num_nodes * self.num_processes)
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        self._init_process_group(Path.cwd() / "flight_recorder")
        degree = replicate_degree_for(self._knobs["replicate_degree"], self.num_nodes, self.world_size)
        self._shard_group, self._replicate_group = hsdp_groups(degree, self._timeout)

    # ------------------------------------------------------------------ setup
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard ``module`` in place (Fabric has already applied the precision's module conversion)."""
        if getattr(module, "_ragged_fsdp_state", None) is not None:
            return module  # sharded by the user with fully_shard: take it as it is
        knobs = self._knobs
        return shard_module(
            module,
            device=self.root_device,
            activation_checkpointing=knobs["activation_checkpointing"] or (),
            group_modules=knobs["group_modules"],
            recordings=self._init_recordings,
            process_group=self._shard_group,
            replicate_group=self._replicate_group,
            shard_granularity=knobs["shard_granularity"],
            block_rows=knobs["block_rows"],
            dbuffer_size=knobs["dbuffer_size"],
            planning_algorithm=knobs["planning_algorithm"],
            reshard_after_forward=knobs["reshard_after_forward"],
            mp_policy=mp_policy_for(self.precision.precision),
            sync_module_states=knobs["sync_module_states"],
            broadcast_buffers=knobs["broadcast_buffers"],
            **self._engine_kwargs,
        )

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Optional[Any] = None
    ) -> tuple[nn.Module, list[Optimizer], Optional[Any]]:
        """``fabric.setup(model, *optimizers)``: shard, then point each fresh optimizer at the shards."""
        names = {id(param): name for name, param in module.named_parameters()}
        for optimizer in optimizers:
            _check_fresh(optimizer, names)
        module = self.setup_module(module)
        sharded = dict(module.named_parameters())
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [sharded[names[id(param)]] for param in group["params"]]
        return module, [self.setup_optimizer(optimizer) for optimizer in optimizers], scheduler

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        hook_optimizer(optimizer)  # torch's state-dict APIs see the shards' states, also before the first step
        return optimizer

    def module_to_device(self, module: nn.Module) -> None:
        pass  # the shards are allocated on the root device by `fully_shard`

    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        """Build on the meta device with ``empty_init=True`` (materialized tensor by tensor at setup, replaying
        the calls recorded here: ``init_record.py``)."""
        stack = ExitStack()
        stack.enter_context(torch.device("meta") if empty_init else self.root_device)
        stack.enter_context(self.precision.module_init_context())
        if empty_init:
            self._init_recordings.append(stack.enter_context(recording()))
        return stack

    # ------------------------------------------------------------- gradients
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: Union[float, int],
        norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """The global norm over every rank's shards (the same on every rank), as DDP's clipping."""
        self.precision.unscale_gradients(optimizer)  # 16-mixed: clip the true gradients (once per step)
        target = clip_target(_sharded(module), self.precision.main_params(optimizer))
        return clip_grad_norm_(target, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite)

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: Union[float, int]) -> None:
        self.precision.unscale_gradients(optimizer)
        clip_grad_value_(clip_target(_sharded(module), self.precision.main_params(optimizer)), clip_val)

    # ---------------------------------------------------------- collectives
    def all_reduce(
        self, tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Tensor:
        return self._all_reduce(tensor, group, reduce_op)

    # ---------------------------------------------------------- checkpoints
    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """Collective: a sharded directory (or one file with ``state_dict_type="full"``), written atomically."""
        if storage_options is not None:
            raise TypeError(
                "fabric.save(..., storage_options=...) is not supported by RaggedFSDPFabricStrategy: checkpoints are "
                "written with torch.distributed.checkpoint, not a CheckpointIO plugin"
            )
        fabric_checkpoints.save(self.checkpoints, path, state, filter)  # every rank writes to rank 0's path

    def load_checkpoint(
        self,
        path: Any,
        state: Optional[Union[nn.Module, Optimizer, dict[str, Any]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """Restore ``state``'s objects in place from any layout (world size, granularity); return the rest."""
        return fabric_checkpoints.load(self.checkpoints, self.broadcast(path), state, strict, weights_only)

    def teardown(self) -> None:
        self.checkpoints.teardown()  # an asynchronous save still in flight
        assert self.cluster_environment is not None
        self.cluster_environment.teardown()
        super().teardown()


class _NoSync(_BackwardSyncControl):
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        """``fabric.no_backward_sync(model)``: the gradients accumulate unreduced until a backward outside it."""
        return no_sync(_sharded(module)) if enabled else nullcontext()


def _sharded(module: nn.Module) -> nn.Module:
    if getattr(module, "_ragged_fsdp_state", None) is None:
        raise TypeError(
            f"{type(module).__name__} is not sharded by RaggedFSDPFabricStrategy: pass the module "
            "fabric.setup_module / fabric.setup returned"
        )
    return module


def _check_fresh(optimizer: Optimizer, names: dict[int, str]) -> None:
    """``fabric.setup(model, optimizer)`` can hand an optimizer the shards only before it has state."""
    fix = "create the optimizer after `model = fabric.setup_module(model)`, then `fabric.setup_optimizers(optimizer)`"
    if optimizer.state:
        raise ValueError(f"fabric.setup(model, {type(optimizer).__name__}): the optimizer already has state; {fix}")
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in names:
                raise ValueError(
                    f"fabric.setup(model, {type(optimizer).__name__}): the optimizer holds a tensor of shape "
                    f"{tuple(param.shape)} that is not a parameter of the model; {fix}"
                )


def _check_precision(precision: Precision, owner: str) -> None:
    """Refuse what the engine cannot run; ``"16-mixed"`` gets a ``ShardedGradScaler`` (``sharded_scaler``)."""
    name = getattr(precision, "precision", None)
    supported = type(precision) in (Precision, DoublePrecision, HalfPrecision)
    if not (supported or (type(precision) is MixedPrecision and name in ("bf16-mixed", "16-mixed"))):
        raise unsupported_precision(owner, type(precision).__name__, name)
    if isinstance(precision, MixedPrecision):
        precision.scaler = sharded_scaler(precision.scaler, precision.device)
