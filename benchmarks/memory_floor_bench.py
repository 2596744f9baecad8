"""Where the peak-memory floor is: the embedding's full buffer is the only framework-held tensor at the peak.

``python benchmarks/memory_floor_bench.py`` (~2 min) measures, with ``memory_bench``'s storage
tracker and model (the 20.5M GPT, 4 sequences per rank, step 2 of AdamW), the peak live bytes per
rank at W=2 in fp32 and bf16 and at W=4 in bf16 for these wrappings: lightning_ragged's defaults
(every block a group, the token embedding a group of its own, the root the rest) and FSDP2 as
``memory_bench`` wraps it (every block, then the root), each also the other way
(``group_modules=[Block]``: the embedding in the root; ``fully_shard(model.embed)`` first, as
torchtitan wraps it), so the effect of freeing the embedding's full buffer after its forward
instead of keeping it through the loss's backward shows in both, lightning_ragged with the
in-place all-reduce, and both with FSDP2's list call ``[ln_f, head]`` resharded after forward. At each peak it also
reads what the framework itself holds there (full parameters, full gradients, reduction
buffers in flight) from the framework's own objects. It writes the "memory-floor" section of
``benchmarks/RESULTS.md``. Counts, not times: the result does not depend on machine load.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import memory_bench  # noqa: E402
from models import make_batches  # noqa: E402
from report import write_section  # noqa: E402

CONFIGS = ((2, "fp32"), (2, "bf16"), (4, "bf16"))
HELD = ("params", "grads", "reduction")
"""(world size, precision) per process tree."""
VARIANTS = {
    "ragged": "lightning_ragged defaults (blocks + embedding + root)",
    "ragged-blocks": "lightning_ragged, blocks + root (`group_modules=[Block]`)",
    "ragged-allreduce": "lightning_ragged defaults, `reduce_mode=\"all_reduce\"`",
    "fsdp2": "FSDP2, blocks + root (memory_bench's wrapping)",
    "fsdp2-embed": "FSDP2, blocks + embedding + root (as torchtitan)",
    "ragged-head": "lightning_ragged, blocks + embedding + `[ln_f, head]` + root (FSDP2's calls, the list resharded)",
    "fsdp2-head": "FSDP2, blocks + embedding + `[ln_f, head]` + root (the same calls)",
}


def build(name: str, precision: str, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``memory_bench.build`` for its frameworks; ``ragged-blocks`` leaves the embedding in the root,
    ``fsdp2-embed`` gives it a group."""
    if not name.endswith(("-embed", "-allreduce", "-blocks", "-head")):
        return memory_bench.default_build(name, precision, seed)
    model = memory_bench.make_gpt(memory_bench.CFG, seed)
    bf16 = memory_bench.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    policy = bf16 if precision == "bf16" else None
    if name == "ragged-allreduce":
        import lightning_ragged

        lightning_ragged.fully_shard(model, mp_policy=policy, reduce_mode="all_reduce")
    elif name == "ragged-blocks":
        import lightning_ragged

        lightning_ragged.fully_shard(model, mp_policy=policy, group_modules=[type(model.blocks[0])])
    elif name.endswith("-head"):  # FSDP2's calls, one of them a list: the final norm and head resharded after forward
        if name.startswith("ragged"):
            from lightning_ragged import fully_shard
        else:
            from torch.distributed.fsdp import fully_shard

            policy = policy or memory_bench.MixedPrecisionPolicy()
        for module in [model.embed, *model.blocks, [model.ln_f, model.head], model]:
            fully_shard(module, mp_policy=policy)
    else:
        from torch.distributed.fsdp import fully_shard

        for module in [*model.blocks, model.embed]:
            fully_shard(module, mp_policy=policy or memory_bench.MixedPrecisionPolicy())
        fully_shard(model, mp_policy=policy or memory_bench.MixedPrecisionPolicy())
    return model, torch.optim.AdamW(model.parameters(), lr=memory_bench.LR)


def ragged_held(model: torch.nn.Module) -> dict[str, Any]:
    """Bytes lightning_ragged holds now: its DBuffers' full parameters and gradients (``grads_of``: by group), the
    pairwise scratch in flight."""
    import lightning_ragged
    from lightning_ragged.engine.pairwise import PairwiseReduce

    held: dict[str, Any] = dict(params=0, grads=0, reduction=0, grads_of={})
    for group in lightning_ragged.get_state(model).all_groups:
        for dbuffer in group.dbuffers:
            held["params"] += dbuffer.unsharded.untyped_storage().nbytes()
            grads = dbuffer.unsharded_grad.untyped_storage().nbytes()
            held["grads"] += grads
            if grads:
                held["grads_of"][group.name] = held["grads_of"].get(group.name, 0) + grads
            pending = dbuffer._pending_reduce
            if pending is not None and isinstance(pending.work, PairwiseReduce):
                held["reduction"] += pending.work.received.untyped_storage().nbytes()
    return held


def fsdp2_held(model: torch.nn.Module) -> dict[str, Any]:
    """Bytes FSDP2 holds now: all-gather outputs, unsharded gradients, the reduce-scatter inputs it keeps.

    Read from torch's private FSDP2 objects (a benchmark's view, not an API)."""
    from torch.distributed.fsdp import FSDPModule

    kinds: dict[str, dict[int, int]] = dict(params={}, grads={}, reduction={})

    def add(kind: str, tensor: torch.Tensor | None) -> None:
        if tensor is not None:
            storage = tensor.untyped_storage()
            kinds[kind][storage._cdata] = storage.nbytes()

    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        if group is None:
            continue
        for fsdp_param in group.fsdp_params:
            for output in fsdp_param.all_gather_outputs:
                add("params", output)
            add("grads", getattr(getattr(fsdp_param, "_unsharded_param", None), "grad", None))
        for state in group.comm_ctx.reduce_scatter_states:
            add("reduction", state.reduce_scatter_input)
    return {kind: sum(sizes.values()) for kind, sizes in kinds.items()}


def worker(rank: int, world: int, precision: str, init_file: str, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    memory_bench.default_build, memory_bench.build = memory_bench.build, build
    batches = make_batches(memory_bench.MEASURED_STEP + 1, world * 4, memory_bench.CFG)
    result = {
        name: memory_bench.memory_pass(name, rank, world, precision, batches,
                                       ragged_held if name.startswith("ragged") else fsdp2_held)
        for name in VARIANTS
    }
    gathered: list = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out_path).write_text(json.dumps(gathered))
    dist.destroy_process_group()
    os._exit(0)  # the result is written; skip interpreter teardown, where gloo's threads can abort (pytorch#190489)


def measure(world: int, precision: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(worker, args=(world, precision, os.path.join(tmp, "pg"), out), nprocs=world, join=True)
        return json.loads(Path(out).read_text())


def mib(nbytes: float, spec: str = ".1f") -> str:
    return f"{nbytes / 2**20:{spec}}"


def peak_of(gathered: list[dict], name: str) -> dict:
    """The variant's memory pass on the rank with the highest peak."""
    return max((rank[name] for rank in gathered), key=lambda result: result["peak_bytes"])


def framework_bytes(result: dict) -> int:
    """Of a peak: the framework's full parameters, full gradients and reduction buffers, its shards and AdamW state."""
    held = result["held"]
    return sum(held[kind] for kind in HELD) + result["param_bytes"] + result["optimizer_state_bytes"]


def section(results: dict[tuple[int, str], list[dict]]) -> str:
    lines = [
        "## Peak memory floor: the embedding's full buffer, and what each framework holds at its peak (gloo)",
        "",
        "Written by `benchmarks/memory_floor_bench.py`: `memory_bench`'s model (20.5M GPT, 8 blocks, vocab 8192, "
        "width 384), tracker and step, peak live bytes per rank (the largest rank). Held at the peak, read from the "
        "framework's own objects at that operator: full parameters (lightning_ragged's DBuffers' full buffers; "
        "FSDP2's all-gather outputs), full gradients (the DBuffers' gradient buffers; FSDP2's unsharded parameters' "
        "`.grad`), reduction buffers in flight (the pairwise reduction's scratch; FSDP2's kept reduce-scatter inputs); "
        "sharded = the sharded parameters and AdamW state; the rest = the peak minus all these (activations, "
        "autograd's saved tensors, sharded gradients, temporaries, and what a framework holds in local variables: "
        "FSDP2's reduce-scatter being prepared keeps its gradients and fp32 input there, seen by no object).",
        "",
        "| W | precision | wrapping | peak live MiB/rank | vs FSDP2 (blocks + root) | peak at | full params | "
        "full grads | reduction buffers | sharded | the rest |",
        "|---:|---|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for (world, precision), gathered in results.items():
        base = peak_of(gathered, "fsdp2")["peak_bytes"]
        for name, label in VARIANTS.items():
            result = peak_of(gathered, name)
            held = result["held"]
            rest = result["peak_bytes"] - framework_bytes(result)
            lines.append(
                f"| {world} | {precision} | {label} | {mib(result['peak_bytes'])} | {result['peak_bytes'] / base:.2f}x "
                f"| `{result['peak_at']}` | {mib(held['params'])} | {mib(held['grads'])} | {mib(held['reduction'])} "
                f"| {mib(result['param_bytes'] + result['optimizer_state_bytes'])} | {mib(rest)} |"
            )
    lines += [
        "",
        "At the peak (the loss's backward, in fp32; in bf16 too, where lightning_ragged holds its gradients in "
        "bf16 until the reduction, as FSDP2 does) both FSDPs hold the same sharded parameters and AdamW state, "
        "the root's full buffers and the activations; the only framework-held tensor there that backward does "
        "not need is the token embedding's full weight (its backward reads only the indices). A group of its "
        "own frees it after the forward, in either framework alike. lightning_ragged's defaults give it one (and "
        "never re-gather it for backward, so the bytes per step stay those of the root wrapping), which puts its "
        "default peak at the floor, ~0.96x of FSDP2's default wrapping; FSDP2 wrapped as torchtitan wraps it "
        "reaches the same floor.",
        "",
        "The head's full weight is the other one held there (the root keeps it from its forward through the loss's "
        "backward, as FSDP2's root). Sharded with FSDP2's list call, `fully_shard([model.ln_f, model.head])` "
        "resharded after forward, it is freed after the head's forward and re-gathered when the gradient reaches "
        "the logits, in either framework alike, for one more all-gather of it per step:",
    ]
    for (world, precision), gathered in results.items():
        base = peak_of(gathered, "fsdp2")["peak_bytes"]
        ours, theirs = peak_of(gathered, "ragged-head"), peak_of(gathered, "fsdp2-head")
        lines.append(
            f"- W={world} {precision}: lightning_ragged {mib(ours['peak_bytes'])} MiB ({ours['peak_bytes'] / base:.2f}x "
            f"FSDP2's default wrapping), FSDP2 the same calls {mib(theirs['peak_bytes'])} MiB "
            f"({theirs['peak_bytes'] / base:.2f}x); peaks at `{ours['peak_at']}` / `{theirs['peak_at']}`."
        )
    lines += [
        "",
        "In fp32 the peak stays at the loss's backward, now holding in full only what the root keeps (the "
        "position table) in either framework: the rest is the shards, the AdamW state and the activations, the "
        "same in both. In bf16 it moves into a block's backward (`gelu_backward`), where lightning_ragged holds "
        "full parameters, bf16 gradient buffers and a pairwise reduction in flight (overlapped with that block's "
        "compute; the columns above). Issue 12's \"<= 0.9x FSDP2's peak\" (against FSDP2's default wrapping) is "
        "not met for live tensor bytes on this model: 0.92x at best, with the list; what remains "
        "between the frameworks on a GPU is the allocator (reserved memory, streams).",
        "",
    ]
    for (world, precision), gathered in results.items():
        pairwise, all_reduce = (peak_of(gathered, name) for name in ("ragged", "ragged-allreduce"))
        lines.append(
            f"- W={world} {precision}: the pairwise reduction's peak is "
            f"{mib(pairwise['peak_bytes'] - all_reduce['peak_bytes'], '+.1f')} MiB over the in-place all-reduce's "
            f"(its scratch in flight at the peak: {mib(pairwise['held']['reduction'])} MiB, (W-1)/W of the reducing "
            "DBuffer's gradient buffer, in its dtype: bf16 under bf16 compute)."
        )
    model = memory_bench.make_gpt(memory_bench.CFG)
    head = sum(p.numel() for p in [*model.head.parameters(), *model.ln_f.parameters()])
    total = sum(p.numel() for p in model.parameters())
    lines += ["", "lightning_ragged's bf16 peak (defaults) against FSDP2's (blocks + root):"]
    for (world, precision), gathered in results.items():
        if precision != "bf16":
            continue
        ours, theirs = peak_of(gathered, "ragged"), peak_of(gathered, "fsdp2")
        holders = ", ".join(f"{group} {mib(size)} MiB" for group, size in ours["held"]["grads_of"].items()) or "none"
        lines.append(
            f"- W={world}: {(ours['peak_bytes'] - theirs['peak_bytes']) / 2**10:+,.1f} KiB, at `{ours['peak_at']}` "
            f"(full gradients held there: {holders}; reduction scratch {mib(ours['held']['reduction'])} MiB) against "
            f"FSDP2's at `{theirs['peak_at']}`"
            + (" (no full parameters in backward: its root's post-backward has resharded the root, so this is the "
               "root's reduce-scatter at the end of backward, its gradients and fp32 input in local variables)."
               if theirs["held"]["params"] == 0 else ".")
        )
    lines += [
        "",
        "The gradients: under `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` each DBuffer's gradient "
        "buffer holds bf16 (the narrower dtype), the pairwise reduction sends bf16 segments and sums them into an "
        "fp32 copy of this rank's own (exact: widening loses nothing); so the root's gradients (final norm and head "
        f"here, {head / 1e6:.2f}M parameters, {head / total:.0%} of the model) take {mib(head * 2)} MiB through the "
        f"backward, not {mib(head * 4)} MiB in fp32, and the blocks' backward no longer sets the peak.",
    ]
    return "\n".join(lines)


def main() -> None:
    results = {(world, precision): measure(world, precision) for world, precision in CONFIGS}
    text = section(results)
    print(text)
    write_section("memory-floor", text)


if __name__ == "__main__":
    main()
