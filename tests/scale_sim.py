"""``fully_shard`` at 1,024–10,000 ranks, simulated: one process per sampled rank, no hardware.

Each sampled rank runs in its own process (``simulate``, or ``python -m tests.scale_sim``): torch's fake
process group (``FakeStore`` + ``init_process_group("fake", ...)``, collectives that move
nothing) gives it its rank in a world of any size, the model is built from a
``transformers`` config on the meta device with a few layers of the real shapes, and
``fully_shard`` runs on it unchanged under ``FakeTensorMode`` with ``device="cpu"``: the
grouping, the planner, the DBuffers and every collective are the engine's own, but the
buffers are fake tensors (sizes, no memory), so a 30 GB expert tensor costs nothing. One
forward and backward then runs on fake tensors, outside the mode (see ``simulate_model``),
and a dispatch mode counts every ``c10d`` call and its bytes.

The parent side (``predict``, ``sample_ranks``, ``simulate``) takes the expected numbers from
the plan CLI (``lightning_ragged.cli.plan``: ``plan_model`` and ``memory_estimate``, the one
definition of the estimate) on the same config and world size, and picks the ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import time
from typing import Any, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MODELS: dict[str, dict[str, Any]] = {
    # a plan CLI preset (the real config.json shape fields) and the fields made small
    "llama3-70b": dict(num_hidden_layers=3),
    "deepseek-v3": dict(num_hidden_layers=3, first_k_dense_replace=1),  # one dense block, two MoE blocks
}
GRANULARITY = "row"  # fully_shard's default
DBUFFER_SIZE = 256 * 2**20  # engine.api.DEFAULT_DBUFFER_SIZE (imported late here, as the rest of the package)
"""fully_shard's default (256 MiB, the plan CLI's too): blocks split into several DBuffers, each tensor larger
than it (a Llama-3-70B MLP matrix, 940 MB in fp32; a DeepSeek-V3 fused expert tensor, 30 GB) in one of its own."""
MASTER, COMPUTE = torch.float32, torch.bfloat16
SEQUENCE = 16


def config_of(preset: str) -> dict[str, Any]:
    """The preset's ``config.json`` fields with few layers: what both the engine and the CLI are given."""
    from lightning_ragged.cli.model_groups import PRESETS

    return {**PRESETS[preset], **MODELS[preset]}


def view_alignment() -> int:
    """fully_shard's default alignment in elements: 16 bytes of the smallest dtype (bf16 compute)."""
    from lightning_ragged.engine.api import VIEW_ALIGNMENT_BYTES

    return VIEW_ALIGNMENT_BYTES // torch.empty((), dtype=COMPUTE).element_size()


# ------------------------------------------------------------------ parent: predictions
def predict(preset: str, world: int, alignment: int | None = None) -> dict[str, Any]:
    """What the plan CLI predicts for ``preset`` at ``world`` ranks, and the step it implies.

    Per step with ``reshard_after_forward=True``: each block DBuffer is all-gathered twice
    (forward, and again in backward), each root DBuffer once (the root stays unsharded
    for its backward), the token embedding's group once (its backward reads no weight); every DBuffer is reduce-scattered once; plus one all-reduce of the
    "got a gradient" flags and one broadcast of the buffers. Bytes are the full buffer
    (world * S elements) in the compute dtype, as every rank receives (all-gather) or sends
    (reduce-scatter) it.
    """
    from lightning_ragged.cli.model_groups import describe_model
    from lightning_ragged.cli.plan import memory_estimate, plan_model

    master_bytes, compute_bytes = MASTER.itemsize, COMPUTE.itemsize
    description = describe_model(config_of(preset), preset)
    groups = plan_model(
        description,
        world,
        GRANULARITY,
        alignment=view_alignment() if alignment is None else alignment,
        dbuffer_size=DBUFFER_SIZE,
        master_bytes=master_bytes,
    )
    segments = sorted(
        (g["group"] == "root", b["segment_size"]) for g in groups for _ in range(g["count"]) for b in g["dbuffers"]
    )
    once = ("root", "embed_tokens")  # the plan CLI's kind names: the root, the untied token embedding's group
    gathers = [(1 if g["group"] in once else 2, b["segment_size"])
               for g in groups for _ in range(g["count"]) for b in g["dbuffers"]]
    weighted = [(g["count"], b) for g in groups for b in g["dbuffers"]]
    return dict(
        segments=segments,
        memory=memory_estimate(groups, world, master_bytes, compute_bytes, "adamw"),
        all_gathers=sum(n for n, _ in gathers),
        all_gather_bytes=sum(n * world * size * compute_bytes for n, size in gathers),
        reduces=len(segments),
        reduce_bytes=sum(world * size * compute_bytes for _, size in segments),
        padding_ratio=sum(c * b["padding"] for c, b in weighted) / sum(c * b["numel"] for c, b in weighted),
    )


def empty_ranks(preset: str, world: int) -> list[int]:
    """Ranks whose segment of some DBuffer is all padding, from the planner's layouts (plan CLI inputs)."""
    from lightning_ragged.cli.model_groups import describe_model
    from lightning_ragged.layout.auto import shape_granularity
    from lightning_ragged.layout.planner import plan
    from lightning_ragged.layout.spec import TensorSpec

    from lightning_ragged.engine.grouping import split_into_dbuffers

    empty: set[int] = set()
    for kind in describe_model(config_of(preset), preset).groups:
        for run in kind.runs:
            params = [(name, torch.nn.Parameter(torch.empty(shape, device="meta", dtype=MASTER))) for name, shape in run]
            for dbuffer in split_into_dbuffers(params, DBUFFER_SIZE):  # as fully_shard splits the run
                specs = [
                    TensorSpec(name, p.numel(), shape_granularity(GRANULARITY, name, tuple(p.shape), 128))
                    for name, p in dbuffer
                ]
                layout = plan(specs, world, alignment=view_alignment())
                empty.update(k for k in range(world) if not layout.local_pieces(k))
    return sorted(empty)


def sample_ranks(world: int, presets: Sequence[str]) -> dict[str, int]:
    """First, last, middle, and an empty-shard rank (the first one that is neither first nor last)."""
    sample = {"first": 0, "last": world - 1, "middle": world // 2}
    empty = sorted({k for preset in presets for k in empty_ranks(preset, world)} - {0, world - 1})
    if not empty:
        raise ValueError(f"no rank of {list(presets)} at {world} ranks has an all-padding segment")
    sample["empty shard"] = empty[0]
    return sample


def simulate(world: int, ranks: Sequence[int], presets: Sequence[str], workers: int | None = None) -> dict[int, Any]:
    """Run each rank in a process of its own (``init_process_group`` is per process); rank -> its report.

    The processes fork from a forkserver that imported torch, transformers and the engine
    once (``PRELOAD``), and each runs one rank only (``maxtasksperchild=1``, ``chunksize=1``).
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    with context.Pool(workers or os.cpu_count() or 1, maxtasksperchild=1) as pool:
        reports = pool.starmap(run_rank, [(world, rank, tuple(presets)) for rank in ranks], chunksize=1)
    return dict(zip(ranks, reports))


PRELOAD = [
    "tests.scale_sim",
    "lightning_ragged.engine.api",
    "transformers.models.llama.modeling_llama",
    "transformers.models.deepseek_v3.modeling_deepseek_v3",
]


# ------------------------------------------------------------------ child: one rank
class CollectiveCounter(TorchDispatchMode):
    """Counts every ``c10d`` call and its full-buffer bytes, below the engine (independent of ``CommStats``)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, list[int]] = {}
        """op name -> [calls, bytes]"""
        self.sequence: list[tuple[str, int]] = []
        """(op name, bytes) in issue order: every rank must issue the same, or a real run hangs."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.namespace == "c10d":
            name = func._overloadpacket.__name__
            if name == "_reduce_scatter_base_":
                tensors = [args[1]]  # (output, input, ...): the input is the full buffer
            elif isinstance(args[0], torch.Tensor):
                tensors = [args[0]]  # _allgather_base_(output, input, ...): the output is the full buffer
            else:
                tensors = list(args[0])  # allreduce_, broadcast_: a list of tensors
            size = sum(_nbytes(t) for t in tensors)
            entry = self.calls.setdefault(name, [0, 0])
            entry[0] += 1
            entry[1] += size
            self.sequence.append((name, size))
        return func(*args, **(kwargs or {}))


class FullBufferPeak:
    """A DBuffer observer: the most bytes of full parameters and full gradients held at once, and what they were."""

    def __init__(self, groups: list[Any]) -> None:
        self.buffers = [(group.name, b) for group in groups for b in group.dbuffers]
        self.peak = 0
        self.held: dict[str, int] = {}
        """At the peak: "<group> params" / "<group> grads" -> bytes."""

    def on_event(self, event: Any) -> None:
        held: dict[str, int] = {}
        for name, b in self.buffers:
            for kind, tensor in (("params", b.unsharded), ("grads", b.unsharded_grad)):
                size = tensor.untyped_storage().nbytes()
                if size:
                    held[f"{name} {kind}"] = held.get(f"{name} {kind}", 0) + size
        if sum(held.values()) > self.peak:
            self.peak, self.held = sum(held.values()), held


def build_meta_model(preset: str) -> torch.nn.Module:
    """The causal LM of ``config_of(preset)`` on the meta device, in the master dtype."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config, LlamaConfig

    fields = dict(config_of(preset))
    config_class = {"llama": LlamaConfig, "deepseek_v3": DeepseekV3Config}[fields.pop("model_type")]
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config_class(**fields), dtype=MASTER)


def simulate_model(preset: str) -> dict[str, Any]:
    """Shard one model on this rank and run one forward and backward; what the engine held and issued.

    ``fully_shard`` runs inside ``FakeTensorMode`` so its buffers are fake. The step runs
    outside it, on those fake tensors (their ops still go to the fake mode): the engine's
    end of backward reads its small "got a gradient" flags tensor on the host
    (``unused_grads.settle_unused``: ``counts.tolist()``), which a fake tensor cannot do;
    created outside the mode it is a real tensor, and the fake all-reduce leaves it as is.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lightning_ragged import fully_shard
    from lightning_ragged.engine.api import get_state

    started = time.perf_counter()
    model = build_meta_model(preset)
    built = time.perf_counter()
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # the meta parameters are read for their shapes only
    with mode:
        fully_shard(model, device="cpu", dbuffer_size=DBUFFER_SIZE, mp_policy=MixedPrecisionPolicy(param_dtype=COMPUTE))
        for module in model.modules():  # non-persistent buffers (rotary inv_freq): fake instead of meta
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.is_meta:
                    module._buffers[name] = torch.empty_like(buffer, device="cpu")
        input_ids = torch.zeros(1, SEQUENCE, dtype=torch.long)
    sharded = time.perf_counter()
    state = get_state(model)
    peak = FullBufferPeak(state.all_groups)
    for dbuffer in state.dbuffers():
        dbuffer.observers.append(peak)
    state.stats.reset()
    with CollectiveCounter() as counter:
        model(input_ids=input_ids, labels=input_ids).loss.backward()
    stepped = time.perf_counter()
    stats, peak_full_bytes, peak_held = dataclasses.asdict(state.stats), peak.peak, peak.held
    # Each group's full bytes, measured: the public FSDPModule.unshard() of every group after the step.
    full_bytes = []
    for group in state.all_groups:
        group.module.unshard()
        full_bytes.append(sum(b.unsharded.untyped_storage().nbytes() for b in group.dbuffers))
        group.module.reshard()
    return dict(
        dbuffers=[
            dict(
                group=group.name,
                root=group.is_root,
                segment_size=b.layout.segment_size,
                local_numel=sum(p.numel() for p in b.sharded_params.values()),
                sharded_bytes=_nbytes(b.sharded),
                sharded_grad_bytes=0 if b.sharded_grad is None else _nbytes(b.sharded_grad),
            )
            for group in state.all_groups
            for b in group.dbuffers
        ],
        largest_full_group_bytes=max(full_bytes),
        peak_full_bytes=peak_full_bytes,
        peak_held=peak_held,
        stats={k: v for k, v in stats.items() if not k.endswith("seconds")},
        calls=counter.calls,
        sequence=counter.sequence,
        seconds=dict(build=built - started, fully_shard=sharded - built, step=stepped - sharded),
    )


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def run_rank(world: int, rank: int, presets: Sequence[str]) -> dict[str, Any]:
    """This process as ``rank`` of ``world`` under the fake process group: every preset's report."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    started = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        report: dict[str, Any] = {preset: simulate_model(preset) for preset in presets}
    finally:
        dist.destroy_process_group()
    report["seconds"] = time.perf_counter() - started
    report["pid"] = os.getpid()
    return report


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one simulated rank of fully_shard under the fake process group")
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args(argv)
    print(json.dumps(run_rank(args.world, args.rank, args.models.split(","))))


if __name__ == "__main__":
    main()
