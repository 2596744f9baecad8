"""FSDP2's ``fully_shard`` arguments, as lightning_ragged takes them.

Code written for torch's FSDP2 passes ``mesh=`` (a 1-D mesh: shard over it; 2-D: HSDP, replicate over
dimension 0 and shard over dimension 1, FSDP2's convention; the shards live at ``device=``, else where
the parameters are, except that a meta or CPU model moves to the mesh's accelerator as under FSDP2,
:func:`shard_device`) and ``reshard_after_forward=None`` (FSDP2's
default: reshard every module but the root; lightning_ragged's root group is kept for its backward under any
value, and under ``None`` also across no-grad forwards, with the embedding group split off it). The
arguments FSDP2 has and lightning_ragged does not implement are refused by name, with what to use
instead, rather than failing as an unexpected keyword or being ignored.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import OffloadPolicy


def groups_of_mesh(
    mesh: Any, process_group: dist.ProcessGroup | None, replicate_group: dist.ProcessGroup | None
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """``(process_group, replicate_group)`` from FSDP2's ``mesh`` (or the ones given, without a mesh)."""
    if mesh is None:
        return process_group, replicate_group
    if process_group is not None or replicate_group is not None:
        raise ValueError("pass either mesh= (FSDP2's) or process_group= / replicate_group=, not both")
    ndim = getattr(mesh, "ndim", None)
    if ndim == 1:
        return mesh.get_group(0), None
    if ndim == 2:  # FSDP2's HSDP mesh: ("replicate", "shard"); one replica is plain sharding
        replicate = mesh.get_group(0)
        return mesh.get_group(1), replicate if dist.get_world_size(replicate) > 1 else None
    raise ValueError(
        f"mesh={mesh!r}: pass a 1-D DeviceMesh (shard over it) or a 2-D one (replicate over dim 0, shard over "
        "dim 1, as FSDP2's HSDP); for other parallelisms slice the data-parallel dimensions (mesh['dp'])"
    )


def meta_shard_device(mesh: Any, process_group: dist.ProcessGroup | None) -> torch.device:
    """Where the shards of a model built on the meta device go when ``device=`` is not given.

    FSDP2 keeps such shards on the meta device until ``to_empty(device=...)``; here they get storage at
    once (uninitialized, as after ``to_empty``), on the mesh's device type, else the backend's: CPU for
    gloo, the current accelerator for the others. ``to_empty`` on that device then leaves them in place.
    """
    device_type = getattr(mesh, "device_type", None)
    if device_type is None:
        backends = {part.split(":")[-1] for part in dist.get_backend(process_group).split(",")}
        accelerator = torch.accelerator.current_accelerator()
        device_type = "cpu" if backends == {"gloo"} or accelerator is None else accelerator.type
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


def shard_device(
    target: Any, mesh: Any, process_group: dist.ProcessGroup | None, device: torch.device | str | None
) -> torch.device | None:
    """Where ``fully_shard`` puts the shards and the buffers of ``target`` (``None``: where the parameters are).

    ``device`` if given; a model on the meta device: :func:`meta_shard_device`; a CPU model whose mesh (or
    backend: NCCL) is an accelerator's: that accelerator's current device, as FSDP2 moves the module there
    (NCCL takes no CPU tensors). Parameters already on an accelerator stay (gloo on CUDA tensors).
    """
    if device is not None:
        return torch.device(device)
    params = [p for p in target.parameters() if not hasattr(p, "ragged_shard")]  # not a sharded child's (FSDP2's order)
    if any(p.is_meta for p in params):
        return meta_shard_device(mesh, process_group)
    if any(p.device.type != "cpu" for p in params):
        return None  # placed by the user
    buffers = [b for b in target.buffers() if not b.is_meta]
    if params or any(b.device.type == "cpu" for b in buffers):  # a root that owns only buffers (rotary tables) too
        found = meta_shard_device(mesh, process_group)
        return found if found.type != "cpu" else None
    return None


def move_buffers(target: Any, device: torch.device | None) -> None:
    """Every real buffer of ``target`` onto ``device`` (FSDP2 moves them with the parameters): a rotary table or
    BatchNorm statistics left on the CPU would meet device activations in forward, and NCCL in the broadcast."""
    if device is None:
        return
    for sub in target.modules():
        for attr, buffer in list(sub._buffers.items()):
            if buffer is not None and not buffer.is_meta and buffer.device != device:
                sub._buffers[attr] = buffer.to(device)


def check_reshard_after_forward(value: Any, world_size: int) -> bool | int | None:
    """A bool, or an int dividing the world (1 means False: keep all; the world size means True); None is
    FSDP2's default: True, except that the groups of the root (its own and its split-off embedding) are kept
    across no-grad forwards, as FSDP2 keeps its root (the root group is kept for its backward either way)."""
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int) or value < 1 or world_size % value:
        raise ValueError(
            f"reshard_after_forward={value!r} must be a bool, None (FSDP2's default) or an int that divides "
            f"the shard group's {world_size} ranks (e.g. the GPUs of one node)"
        )
    return False if value == 1 else True if value == world_size else value


UNSUPPORTED = {
    "offload_policy": "CPU offloading is not supported: the shards and optimizer state stay on the device (shard "
                      "over more ranks, or lightning_ragged.optim.AdamW8bit for smaller optimizer state)",
    "ignored_params": "every parameter is sharded: freeze parameters instead (requires_grad=False: sharded, never "
                      "reduced), or keep them in a module outside the one you shard",
    "shard_placement_fn": "shards follow shard_granularity (FSDP2's Shard(dim) placements are not taken): pass "
                          "shard_granularity='row'/'block'/'matrix' or a callable (name, param) -> elements",
}
"""FSDP2's arguments lightning_ragged does not implement, each with what to use instead (also the strategy's)."""


def check_unsupported(offload_policy: Any, ignored_params: Any, shard_placement_fn: Any) -> None:
    """Refuse FSDP2's arguments that lightning_ragged does not implement (their no-op values pass)."""
    if offload_policy is not None and type(offload_policy) is not OffloadPolicy:
        raise ValueError(f"offload_policy={offload_policy!r}: {UNSUPPORTED['offload_policy']}")
    if ignored_params:
        raise ValueError(f"ignored_params ({len(ignored_params)} parameters): {UNSUPPORTED['ignored_params']}")
    if shard_placement_fn is not None:
        raise ValueError(f"shard_placement_fn={shard_placement_fn!r}: {UNSUPPORTED['shard_placement_fn']}")
