"""What the Trainer's and Fabric's ragged strategies answer alike: devices, ranks, data-parallel sampling, collectives,
and how they start the default process group.

Lightning has two ``ParallelStrategy`` bases (``lightning.pytorch`` and ``lightning.fabric``);
both strategies put this mixin first, as Lightning's own DDP strategies write these members twice.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized, _get_default_process_group_backend_for_device, _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning_utilities.core.rank_zero import rank_zero_only
from torch import Tensor

from lightning_ragged.observability.flight_recorder import configure_flight_recorder


class RaggedParallel:
    """Devices and ranks from ``parallel_devices`` and the cluster environment; gloo/NCCL collectives."""

    _num_nodes: int = 1
    _process_group_backend: Optional[str] = None

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None  # type: ignore[attr-defined]
        return self.parallel_devices[self.local_rank]  # type: ignore[attr-defined]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        devices = self.parallel_devices  # type: ignore[attr-defined]
        return len(devices) if devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Shard and replicate groups are both data parallel: every rank reads its own data.
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}  # type: ignore

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    def set_world_ranks(self) -> None:
        environment = self.cluster_environment  # type: ignore[attr-defined]
        if environment is not None:
            environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)  # type: ignore
            environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def _init_process_group(self, flight_recorder_dir: Path) -> None:
        """``setup_environment``'s common part: seeds, ranks, the backend (by device unless given), NCCL's flight
        recorder, then the default process group with the strategy's timeout."""
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        configure_flight_recorder(self._process_group_backend, flight_recorder_dir)
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend,  # type: ignore[attr-defined]
            timeout=self._timeout, device_id=device_id,  # type: ignore[attr-defined]
        )

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @staticmethod
    def _all_reduce(tensor: Any, group: Optional[Any], reduce_op: Optional[Union[ReduceOp, str]]) -> Any:
        """Reduce a tensor over ``group`` (default: the world); anything else comes back as it is."""
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor
