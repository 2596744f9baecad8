"""``RaggedFSDPStrategy``: ragged, structure-aware FSDP as a Lightning strategy.

``Trainer(strategy="ragged_fsdp")`` (the name is registered on ``import lightning_ragged``)
or ``Trainer(strategy=RaggedFSDPStrategy(...))``. Thin glue over the engine:

* ``setup`` shards the LightningModule in place with ``fully_shard`` (parameter names
  unchanged, so ``configure_optimizers`` can build parameter groups by name), after
  optional composable activation checkpointing; a model built on the meta device
  (``Trainer.init_module(empty_init=True)``) is materialized tensor by tensor
  (``meta_init.py``).
* ``training_step``/``validation_step``/... run through the module's ``forward`` hooks,
  so the root group (embeddings, head, parameters owned by the LightningModule itself)
  is unsharded for the whole step.
* accumulation: ``block_backward_sync`` uses the engine's ``no_sync`` (no collective on
  the non-final micro-batches) unless ``sync_grads_each_micro_batch=True``.
* clipping and precision: ``precision.py``; HSDP: ``replicate_degree``.

Checkpoints (``checkpoint.py``): sharded DCP directories by default (every rank writes only
its own shards, atomically; any world size/granularity/planner loads them), or one
ordinary file with ``state_dict_type="full"``; optional Zstandard compression and
asynchronous saving. See docs/checkpoints.md.
"""

from __future__ import annotations

import dataclasses
import math
import os
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Generator, Literal, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.optim import Optimizer

import lightning.pytorch as pl
from lightning_ragged.engine.api import DEFAULT_DBUFFER_SIZE, auto_plan_for, get_state, no_sync
from lightning_ragged.engine.init_record import Recording, recording
from lightning_ragged.layout.granularity import GranularityPolicy
from lightning_ragged.lightning.callbacks import add_metrics_callback, checkpoint_saved
from lightning_ragged.lightning.checkpoint_io import LightningCheckpointIO
from lightning_ragged.lightning.exception_agreement import add_exception_agreement
from lightning_ragged.lightning.knobs import check_strategy_knobs, without_fsdp2_defaults
from lightning_ragged.engine.torch_state_dict import hook_optimizer
from lightning_ragged.lightning.preemption import attach as attach_slurm_requeue
from lightning_ragged.lightning.sigterm import attach as attach_sigterm
from lightning_ragged.lightning.elastic import resume_from_rank_zero
from lightning_ragged.lightning.batch_counts import check_same_batch_counts
from lightning_ragged.lightning.finetuning import compare_shards_by_identity, restore_finetuning_groups
from lightning_ragged.lightning.model_summary import use_global_parameter_counts
from lightning_ragged.lightning.parallel import RaggedParallel
from lightning_ragged.lightning.precision import to_ragged_precision
from lightning_ragged.lightning.grad_norm import route_lightning_grad_norm
from lightning_ragged.lightning.sharding import (
    ModuleSpec, hsdp_groups, replicate_degree_for, resolve_classes, shard_module,
)
from lightning_ragged.lightning.weight_averaging import average_shards, defer_full_copies
from lightning_ragged.lightning.run_checks import (
    apply_sync_batchnorm, check_reused_module, describe, refuse_unsupported_callbacks, remember_settings,
)
from lightning_ragged.observability.tuning import TUNING_FILE, read_recommendation


class RaggedFSDPStrategy(RaggedParallel, ParallelStrategy):
    """Fully sharded data parallel with ragged, structure-aware shards (veScale-FSDP) for Lightning.

    Args:
        shard_granularity: where a parameter may be cut: ``"element"``, ``"row"`` (default),
            ``"block"`` (``block_rows`` rows), ``"matrix"`` (never split), ``"muon"`` (hidden
            matrices whole for Muon, rows for the rest), or a callable ``(name, param) -> elements``.
        block_rows: rows per block for ``shard_granularity="block"``.
        dbuffer_size: the largest flat buffer (bytes) of one group; bigger groups are split.
            ``"recommended"``: the value the metrics callback wrote to
            ``<default_root_dir>/ragged_fsdp_tuning.json`` at the last fit's end (read at start-up;
            256 MiB with a warning when there is none). See docs/operations.md.
        planning_algorithm: the layout planner (``"optimal"`` by default; see ``layout/planner.py``).
        reshard_after_forward: free each group's full parameters after its forward (ZeRO-3)
            or keep them until backward (ZeRO-2-like, more memory, one all-gather less); ``None`` (FSDP2's
            default, ours): ``True``, and the root's groups are kept across validation/prediction forwards.
        group_modules: module classes (or names) whose instances each form one FSDP group;
            default: the children of the model's largest ``nn.ModuleList``.
        activation_checkpointing: module classes (or names) to wrap with the composable
            activation checkpoint (parameter names do not change).
        replicate_degree: HSDP. ``r`` shards inside groups of ``world/r`` consecutive ranks
            and replicates across the ``r`` groups; ``"node"`` shards inside one node;
            ``"auto"`` lets the auto-planner choose it (with ``planning="auto"`` and
            ``memory_budget_bytes``; the choice is kept in ``auto_replicate_degree``).
            ``1`` (default) shards over all ranks.
        state_dict_type: ``"sharded"`` (default): a checkpoint directory in which every rank
            writes only its own shards (torch.distributed.checkpoint), loadable at any world
            size; ``"full"``: one ordinary ``.ckpt`` file written by rank 0, streamed tensor by
            tensor (never the whole model in memory).
        checkpoint_compression: compress the shards with Zstandard (needs ``zstandard``).
        async_checkpoint: write checkpoints in the background (training continues once the
            shards are copied; the next save waits for the previous one).
        sync_grads_each_micro_batch: with ``accumulate_grad_batches > 1``, reduce the
            gradients after every micro-batch (less memory: no full-size gradient buffer
            kept between micro-batches) instead of only after the last one (less traffic).
        metrics: log the engine's metrics (communication time and bytes, memory, padding)
            through the Trainer's loggers every ``log_every_n_steps`` (``RaggedFSDPMetrics``).
        monitor_port: serve ``/health`` and ``/metrics`` (Prometheus) from rank 0 on this port
            while the Trainer runs; off by default.
        monitor_address: the address the endpoint binds to (loopback by default).
        process_group_backend: ``"gloo"``, ``"nccl"``...; default by device.
        timeout: process-group timeout, a ``datetime.timedelta`` (an int/float is refused:
            pass ``timedelta(seconds=30)``).
        sync_module_states: every rank starts from rank 0's parameters and buffers (as DDP;
            one flat scatter per DBuffer), so no ``seed_everything`` is needed for a common start.
        broadcast_buffers: broadcast buffers (BatchNorm running statistics) from rank 0 before
            each training forward, as DDP's knob of that name; no cost for a model without buffers.
        trust_checkpoint: load checkpoints with full unpickling (code in them can run); only for
            files you wrote with an older version. Off: ``UntrustedCheckpointError`` instead.
        verify_checksums: check every data file's CRC-32 recorded at save (``ChecksumMismatchError``).
        **kwargs: forwarded to :func:`lightning_ragged.fully_shard` (e.g. ``reduce_mode``,
            ``alignment``); other names are refused.

    Every argument is validated here, before any process starts (``knobs.py``): a bad type
    is a ``TypeError``, a bad value a ``ValueError``, each naming the knob, the value and the fix.
    """

    strategy_name = "ragged_fsdp"

    out_of_step = False
    """Set while the ranks cannot run a collective together: this rank handles an exception the others do
    not, or a collective failed (``exception_agreement.py``). Saves and barriers are then skipped."""

    averages_shards = True
    """``WeightAveraging`` callbacks average this strategy's shards (``weight_averaging.py``)."""

    def __init__(
        self,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        *,
        shard_granularity: GranularityPolicy = "row",
        block_rows: int = 128,
        dbuffer_size: Union[int, Literal["recommended"]] = DEFAULT_DBUFFER_SIZE,
        planning_algorithm: str = "optimal",
        reshard_after_forward: Union[bool, int, None] = None,
        group_modules: Optional[Sequence[ModuleSpec]] = None,
        activation_checkpointing: Optional[Sequence[ModuleSpec]] = None,
        replicate_degree: Union[int, Literal["node", "auto"]] = 1,
        state_dict_type: Literal["sharded", "full"] = "sharded",
        checkpoint_compression: bool = False,
        async_checkpoint: bool = False,
        sync_grads_each_micro_batch: bool = False,
        metrics: bool = True,
        monitor_port: Optional[int] = None,
        monitor_address: str = "127.0.0.1",
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        sync_module_states: bool = True,
        broadcast_buffers: bool = True,
        trust_checkpoint: bool = False,
        verify_checksums: bool = True,
        **kwargs: Any,
    ) -> None:
        # Every knob and **kwargs key is checked here, before any process starts (knobs.py).
        kwargs = without_fsdp2_defaults(kwargs)
        check_strategy_knobs(
            dict(
                shard_granularity=shard_granularity, block_rows=block_rows, dbuffer_size=dbuffer_size,
                planning_algorithm=planning_algorithm, reshard_after_forward=reshard_after_forward,
                group_modules=group_modules, activation_checkpointing=activation_checkpointing,
                replicate_degree=replicate_degree, state_dict_type=state_dict_type,
                checkpoint_compression=checkpoint_compression, async_checkpoint=async_checkpoint,
                sync_grads_each_micro_batch=sync_grads_each_micro_batch, metrics=metrics,
                monitor_port=monitor_port, monitor_address=monitor_address,
                process_group_backend=process_group_backend, timeout=timeout,
                sync_module_states=sync_module_states, broadcast_buffers=broadcast_buffers,
                trust_checkpoint=trust_checkpoint, verify_checksums=verify_checksums,
            ),
            kwargs,
            owner=type(self).__name__,
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.shard_granularity = shard_granularity
        self.block_rows = block_rows
        self.dbuffer_size = dbuffer_size
        self.applied_dbuffer_size: Optional[int] = dbuffer_size if isinstance(dbuffer_size, int) else None
        """The bytes ``fully_shard`` gets (``"recommended"`` is resolved once the process group exists)."""
        self.auto_replicate_degree: Optional[int] = None
        """The HSDP degree ``replicate_degree="auto"`` chose (set when the process groups are built)."""
        self.planning_algorithm = planning_algorithm
        self.reshard_after_forward = reshard_after_forward
        self.group_modules = list(group_modules) if group_modules is not None else None
        self.activation_checkpointing = list(activation_checkpointing) if activation_checkpointing else []
        self.replicate_degree = replicate_degree
        self.state_dict_type = state_dict_type
        self.ragged_checkpoints = LightningCheckpointIO(
            state_dict_type, checkpoint_compression, async_checkpoint,
            trust_checkpoint=trust_checkpoint, verify_checksums=verify_checksums,
        )
        self.ragged_checkpoints.adopt(checkpoint_io, type(self).__name__)
        self.sync_grads_each_micro_batch = sync_grads_each_micro_batch
        self.metrics = metrics
        self.monitor_port = monitor_port
        self.monitor_address = monitor_address
        self._engine_kwargs = kwargs
        self._given_engine_kwargs = dict(kwargs)  # as the user passed them ("recommended" may add to the above)
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._num_nodes = 1
        self._shard_group: Optional[dist.ProcessGroup] = None
        self._replicate_group: Optional[dist.ProcessGroup] = None
        self._warned_sharded_checkpoint = False
        self._init_recordings: list[Recording] = []
        """What ``tensor_init_context`` built (``init_record.py``), replayed to materialize a meta model."""
        self.sync_module_states = sync_module_states
        self.broadcast_buffers = broadcast_buffers

    # ------------------------------------------------------------- properties
    @property
    def is_distributed(self) -> bool:
        """Lightning injects a ``DistributedSampler`` only for strategies that say so."""
        return True

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        """The optimizer states are loaded (resharded) in ``load_checkpoint``."""
        return False

    @property
    def shard_process_group(self) -> Optional[dist.ProcessGroup]:
        """The group parameters are sharded over (``None``: the whole world)."""
        return self._shard_group

    @property
    def replicate_process_group(self) -> Optional[dist.ProcessGroup]:
        """The HSDP replica group (``None`` without HSDP)."""
        return self._replicate_group

    @ParallelStrategy.checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        """A plugin from ``Trainer(plugins=[...])``: see ``LightningCheckpointIO.adopt``."""
        self.ragged_checkpoints.adopt(io, type(self).__name__)
        self._checkpoint_io = io

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else to_ragged_precision(Precision())

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        self._precision_plugin = to_ragged_precision(precision_plugin, type(self).__name__)

    # --------------------------------------------------------------- launching
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._validate_cluster_settings()
        if self.replicate_degree != "auto":  # the world is known here (Trainer construction): before any launch
            replicate_degree_for(self.replicate_degree, self.num_nodes, self.num_nodes * self.num_processes)
        # Always a launcher (as DDP): it also validates SLURM/torchrun settings when the
        # cluster creates the processes, which Lightning skips for strategies without one.
        self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def _validate_cluster_settings(self) -> None:
        assert self.cluster_environment is not None
        try:
            self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        except ValueError as error:
            raise ValueError(
                f"{type(self).__name__}: the Trainer settings do not match the cluster allocation "
                f"({type(self.cluster_environment).__name__}): {error}"
            ) from None
        local = os.environ.get("LOCAL_WORLD_SIZE")  # torchrun's processes on this node (Lightning checks the product)
        if isinstance(self.cluster_environment, TorchElasticEnvironment) and local and int(local) != self.num_processes:
            raise ValueError(
                f"{type(self).__name__}: the Trainer settings do not match the cluster allocation "
                f"(TorchElasticEnvironment): devices={self.num_processes} per node, but torchrun started {local} "
                f"processes on this node (--nproc-per-node). Set Trainer(devices={local}, "
                f"num_nodes={self.cluster_environment.world_size() // int(local)}), or pass "
                "**lightning_ragged.lightning.elastic.torchrun_world()"
            )

    def setup_environment(self) -> None:
        super().setup_environment()
        defer_full_copies(self.lightning_module.trainer)  # before the callbacks' setup: see average_shards
        self._init_process_group(self._flight_recorder_dir())
        if self.dbuffer_size == "recommended" and self.applied_dbuffer_size is None:
            self._apply_recommendation()  # before replicate_degree="auto" plans with it
        self._build_process_groups()

    def _default_root_dir(self) -> str:
        """The Trainer's ``default_root_dir`` (the current directory before a Trainer is attached)."""
        trainer = getattr(self._lightning_module, "_trainer", None)
        return trainer.default_root_dir if trainer is not None else os.getcwd()

    def _flight_recorder_dir(self) -> Path:
        """Where NCCL's flight recorder dumps on a timeout: ``<default_root_dir>/flight_recorder`` (docs/operations.md)."""
        return Path(self._default_root_dir()) / "flight_recorder"

    def _resolved_replicate_degree(self) -> int:
        if self.replicate_degree == "auto":
            return self._auto_replicate_degree()
        return replicate_degree_for(self.replicate_degree, self.num_nodes, self.world_size)

    def _auto_replicate_degree(self) -> int:
        """``replicate_degree="auto"``: the HSDP degree the auto-planner chooses for this model and world.

        Every rank plans the same model with the same inputs (a pure function), so all agree
        without a collective; ``fully_shard(planning="auto")`` then plans the groups again at
        that degree and finds the same choice.
        """
        model = self.lightning_module
        group_modules = resolve_classes(model, self.group_modules, "group_modules") if self.group_modules else None
        policy = self.precision_plugin.mp_policy()
        chosen, _ = auto_plan_for(
            model, self.world_size, None, self._engine_kwargs.get("memory_budget_bytes"),
            granularity=self.shard_granularity, block_rows=self.block_rows,
            alignment=self._engine_kwargs.get("alignment"), algorithm=self.planning_algorithm,
            param_dtype=policy.param_dtype if policy is not None else None,
            dbuffer_size=self.applied_dbuffer_size or DEFAULT_DBUFFER_SIZE,
            group_modules=group_modules, reduce_dtype=policy.reduce_dtype if policy is not None else None,
        )
        self.auto_replicate_degree = chosen.replicate_degree
        return chosen.replicate_degree

    def _build_process_groups(self) -> None:
        """HSDP: shard groups of ``world/r`` consecutive ranks, replicate groups across them (``sharding.py``)."""
        self._shard_group, self._replicate_group = hsdp_groups(self._resolved_replicate_degree(), self._timeout)

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: "pl.Trainer") -> None:
        add_metrics_callback(
            trainer, metrics=self.metrics, monitor_port=self.monitor_port, monitor_address=self.monitor_address
        )
        # SLURM auto-requeue: Lightning registers its signal handlers right after `setup`; the requeue
        # signal then only sets a flag that all ranks agree on at a batch end (preemption.py, issue 10).
        attach_slurm_requeue(trainer, self.cluster_environment)
        attach_sigterm(trainer)  # SIGTERM, too, only sets a flag that all ranks agree on at a batch end
        resume_from_rank_zero(trainer, self.broadcast)  # a rank that saw no checkpoint loads rank 0's too
        self.out_of_step = False
        add_exception_agreement(trainer, self._timeout)  # no collective save while one rank raised alone
        use_global_parameter_counts(trainer)  # ModelSummary counts unsharded parameters, not this rank's shards
        compare_shards_by_identity()  # BaseFinetuning: "already in the optimizer?" by identity, not shard values
        refuse_unsupported_callbacks(trainer)
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        if getattr(self.model, "_ragged_fsdp_state", None) is None:
            self.model = self._shard(apply_sync_batchnorm(self._layer_sync, self.model, self.root_device))
            remember_settings(self.model, self._sharding_settings())
        else:  # a second fit/validate/test with the same module: the same settings, rebound to this run's groups
            check_reused_module(self.model, self._sharding_settings())
            self._rebind_process_groups(self.model)
        route_lightning_grad_norm()  # Lightning's grad_norm: whole gradients' norms, not this rank's parts
        self.precision_plugin.sharded_module = self.model
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            average_shards(trainer, self.model)  # WeightAveraging callbacks: an average of the shards, not of a full copy
            self._reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
            for optimizer in self.optimizers:  # torch's state-dict APIs see StateShards before the first step too
                hook_optimizer(optimizer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _sharding_settings(self) -> dict[str, str]:
        """Everything that fixes how ``_shard`` shards a module, as text (checked when a later run reuses it)."""
        settings = dict(
            precision=self.precision_plugin.precision, mp_policy=self.precision_plugin.mp_policy(),
            shard_granularity=self.shard_granularity, block_rows=self.block_rows, dbuffer_size=self.dbuffer_size,
            planning_algorithm=self.planning_algorithm, reshard_after_forward=self.reshard_after_forward,
            group_modules=self.group_modules, activation_checkpointing=self.activation_checkpointing,
            replicate_degree=self.replicate_degree, sync_module_states=self.sync_module_states,
            broadcast_buffers=self.broadcast_buffers, sync_batchnorm=self._layer_sync is not None,
            **self._given_engine_kwargs,
        )
        return {key: describe(value) for key, value in settings.items()}

    def _shard(self, model: nn.Module) -> nn.Module:
        model = self.precision_plugin.convert_module(model)  # bf16-true/16-true/64-true cast; no-op otherwise
        # The root is the LightningModule: its forward's inputs are the whole batch, targets included, which DDP
        # (and FSDP2 on the inner model) leave in fp32. The modules owning root parameters and the groups inside
        # still cast theirs, as FSDP2's sharded modules do (also outside Lightning's autocast, e.g. in callbacks).
        return shard_module(
            model,
            device=self.root_device,
            activation_checkpointing=self.activation_checkpointing,
            group_modules=self.group_modules,
            cast_root_inputs=False,
            recordings=self._init_recordings,
            process_group=self._shard_group,
            replicate_group=self._replicate_group,
            shard_granularity=self.shard_granularity,
            block_rows=self.block_rows,
            dbuffer_size=self.applied_dbuffer_size,
            planning_algorithm=self.planning_algorithm,
            reshard_after_forward=self.reshard_after_forward,
            mp_policy=self.precision_plugin.mp_policy(),
            sync_module_states=self.sync_module_states,
            broadcast_buffers=self.broadcast_buffers,
            **self._engine_kwargs,
        )

    def _apply_recommendation(self) -> None:
        """``dbuffer_size="recommended"``: take the metrics callback's last recommendation.

        Rank 0 reads the tuning file and every rank takes its value (the same layout on every
        rank); its prefetch depth applies too unless ``max_inflight_all_gathers`` was given.
        """
        directory = self._default_root_dir()
        found: Any = None
        if self.global_rank == 0:
            try:
                found = read_recommendation(directory)
            except ValueError as error:
                found = str(error)
        found = self.broadcast(found)
        if isinstance(found, str):
            raise ValueError(found)
        if found is None:
            rank_zero_warn(
                f"dbuffer_size='recommended': no {Path(directory) / TUNING_FILE} yet (a fit with the metrics callback "
                f"writes it at its end); using the default {DEFAULT_DBUFFER_SIZE} bytes (256 MiB)"
            )
            self.applied_dbuffer_size = DEFAULT_DBUFFER_SIZE
            return
        self.applied_dbuffer_size = found.dbuffer_size
        self._engine_kwargs.setdefault("max_inflight_all_gathers", found.max_inflight_all_gathers)
        rank_zero_info(
            f"dbuffer_size='recommended': {found.dbuffer_size} bytes, max_inflight_all_gathers="
            f"{self._engine_kwargs['max_inflight_all_gathers']} from {directory} ({found.reason})"
        )

    def _rebind_process_groups(self, model: nn.Module) -> None:
        """Point every collective of a reused module at this run's groups (the last run's are destroyed at setup)."""
        state = get_state(model)
        if state.buffer_sync is not None:
            state.buffer_sync.rebind(self._shard_group, self._replicate_group)
        for dbuffer in state.dbuffers():
            dbuffer.process_group = self._shard_group
            dbuffer.replicate_group = self._replicate_group
            for param in dbuffer.sharded_params.values():
                param.ragged_shard = dataclasses.replace(param.ragged_shard, process_group=self._shard_group)

    def model_to_device(self) -> None:
        pass  # the shards are allocated on the root device by `fully_shard`

    @contextmanager
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        # Meta tensors are materialized tensor by tensor in `setup()`, replaying the calls recorded here.
        device_context = torch.device("meta") if empty_init else self.root_device
        recorder = recording() if empty_init else nullcontext(None)
        with device_context, self.precision_plugin.tensor_init_context(), recorder as record:
            yield
        if record is not None:
            self._init_recordings.append(record)

    # ---------------------------------------------------------------- steps
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._run_through_forward("training_step", *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._run_through_forward("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._run_through_forward("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._run_through_forward("predict_step", *args, **kwargs)

    def _run_through_forward(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``LightningModule.<method>`` through ``forward`` so the root group's hooks fire."""
        assert self.lightning_module is not None and self.model is not None
        return self._forward_redirection(self.model, self.lightning_module, method, *args, **kwargs)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Non-final micro-batches accumulate into the full gradient buffers with no collective."""
        model = self.model
        if self.sync_grads_each_micro_batch or model is None or getattr(model, "_ragged_fsdp_state", None) is None:
            yield None
            return
        with no_sync(model):
            yield None

    # ---------------------------------------------------------- collectives
    def reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Union[Tensor, Any]:
        return self._all_reduce(tensor, group, reduce_op)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not self.out_of_step:  # the others are not coming (exception_agreement.py)
            super().barrier(*args, **kwargs)

    # ---------------------------------------------------------- checkpoints
    # All checkpoint behaviour lives in `lightning/checkpoint_io.py`, over `lightning_ragged/checkpoint/` (issue 5).
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """DTensor views of this rank's shards (no gather); every rank calls it and writes its own part."""
        assert self.model is not None
        if self.out_of_step:
            return {}
        return self.ragged_checkpoints.state_dict(self.model)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state keyed by parameter names, per-parameter states as DTensors of the shards."""
        assert self.model is not None
        if self.out_of_step:
            return {}
        return self.ragged_checkpoints.optimizer_state(self.model, optimizer)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None
    ) -> None:
        """Collective: a sharded directory (or, with ``state_dict_type="full"``, one file), written atomically."""
        if self.out_of_step:  # nothing is written (exception_agreement.py)
            return
        self.ragged_checkpoints.state_dict_type = self.state_dict_type
        try:
            self.ragged_checkpoints.save(checkpoint, filepath, storage_options)  # every rank writes to rank 0's path
        finally:
            checkpoint_saved(self.lightning_module._trainer if self.lightning_module is not None else None)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Validate, load model and optimizer states in place (any saved layout); return the rest for Lightning.

        The Trainer drops ``weights_only`` on this path (``restore_checkpoint_after_setup``).
        Files load weights-only (no code runs) unless the strategy has ``trust_checkpoint=True``;
        an untrusted pickle raises ``UntrustedCheckpointError``, never a silent fallback.
        """
        assert self.model is not None and self.lightning_module is not None
        path = self.broadcast(checkpoint_path)
        trainer = self.lightning_module._trainer
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        # a weight averaging callback holding its average (fitting, or validate/test/predict(ckpt_path=...) after a
        # fit) restores it and the current weights from the checkpoint
        averaging = trainer is not None and any(getattr(c, "_average_model", None) is not None for c in trainer.callbacks)
        return self.ragged_checkpoints.load(
            self.model,
            self.optimizers,
            path,
            fitting=fitting,
            with_model_states=averaging,
            strict=self.lightning_module.strict_loading,
            weights_only=weights_only,
            before_optimizers=lambda rest: restore_finetuning_groups(trainer, self.lightning_module, rest),
        )

    # ---------------------------------------------------------------- loops
    def on_train_start(self) -> None:
        trainer = self.lightning_module.trainer  # max_steps within an epoch stops every rank at the same batch
        left = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
        check_same_batch_counts("training", [min(trainer.num_training_batches, left if left >= 0 else math.inf)])

    def on_validation_start(self) -> None:  # evaluation gathers inside the shard group only (HSDP: not the replicas)
        trainer = self.lightning_module.trainer
        if trainer.sanity_checking:
            check_same_batch_counts("sanity-check", trainer.num_sanity_val_batches, self._shard_group)
        else:
            check_same_batch_counts("validation", trainer.num_val_batches, self._shard_group)

    def on_test_start(self) -> None:
        check_same_batch_counts("test", self.lightning_module.trainer.num_test_batches, self._shard_group)

    def on_predict_start(self) -> None:
        check_same_batch_counts("prediction", self.lightning_module.trainer.num_predict_batches, self._shard_group)

    def on_validation_end(self) -> None:
        """Free what the evaluation's no-grad forwards kept (the root's groups, under ``reshard_after_forward=None``):
        callbacks write the weights through ``.data``, which no version counter sees (``EMAWeightAveraging`` swaps
        the averages out after validation), so a kept full buffer would feed them to the next training forward."""
        if self.model is not None and getattr(self.model, "_ragged_fsdp_state", None) is not None:
            get_state(self.model).reshard()

    on_test_end = on_predict_end = on_validation_end

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """A no-op after ``load_checkpoint`` (it loaded the shards); else a full state dict is sliced in."""
        assert self.model is not None
        if "state_dict" in checkpoint:
            from lightning_ragged.checkpoint.model_state import load_full_model_state_dict

            load_full_model_state_dict(self.model, checkpoint["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """A no-op after ``load_checkpoint``; else full (consolidated) optimizer states are sliced in."""
        from lightning_ragged.checkpoint.optimizer_state import load_full_optimizer_state_dict

        for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states") or []):
            load_full_optimizer_state_dict(self.model, optimizer, state)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Directories, files and ``save_last="link"`` symlinks (rank 0)."""
        if self.is_global_zero:
            self.ragged_checkpoints.remove(filepath)

    # -------------------------------------------------------------- teardown
    def teardown(self) -> None:
        """Free the full buffers and gradients; the shards and the HSDP groups stay usable until the next run."""
        self.ragged_checkpoints.teardown()  # an asynchronous save still in flight
        model = self.model
        if model is not None and getattr(model, "_ragged_fsdp_state", None) is not None:
            state = get_state(model)
            state.reshard()
            for dbuffer in state.dbuffers():
                dbuffer.free_unsharded_grad()
                for param in dbuffer.sharded_params.values():
                    param.grad = None
                dbuffer.sharded_grad = None
        assert self.cluster_environment is not None and self.accelerator is not None
        _optimizers_to_device(self.optimizers, torch.device("cpu"))
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
