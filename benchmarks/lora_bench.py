"""LoRA fine-tuning with lightning_ragged, FSDP2 and DDP on 2 CPU ranks, side by side.

Run from the repository root::

    python benchmarks/lora_bench.py                       # full run, rewrites the "lora" section of RESULTS.md
    python benchmarks/lora_bench.py --quick --no-write    # short smoke run, prints the table only

The model is engine_bench's 17M GPT (``benchmarks/models.py``, ``GPTConfig()``) with every
base parameter frozen (``requires_grad=False``) and rank-8 LoRA adapters on every attention
and MLP ``Linear`` of every block (``qkv``, ``proj``, ``fc``, ``out``): ``y = base(x) +
(x A^T) B^T * alpha / r`` with A ``r x in`` (Kaiming-uniform, PEFT's init), B ``out x r``
(zeros) and ``alpha / r = 2``. AdamW updates the adapters only.

The harness is engine_bench's, imported, not copied: the same three frameworks (``build``:
lightning_ragged ``fully_shard`` defaults, FSDP2 ``fully_shard`` per block then the root,
DDP), the same launcher (2 gloo ranks, one thread each, load sampled every 5 s), the same
schedule (``timed_rounds``: warm-up, then rounds of timed steps in an order rotated per
round), the same count pass (``c10d::`` collectives and copy bytes seen by a
``TorchDispatchMode`` over one forward+backward) and memory pass (profiler allocation
events: live tensor bytes at rest and at the peak of a step). On top, after the timed
rounds, every framework's full parameters are gathered and checked: the base must be
bit-identical to the untrained model's, the adapters must have moved, and the adapters of
the three frameworks must agree.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from engine_bench import (  # noqa: E402
    FRAMEWORKS,
    LR,
    WORLD_SIZE,
    build,
    count_pass,
    launch,
    machine_line,
    memory_pass,
    mib,
    timed_rounds,
)
from models import GPT, GPTConfig, count_params, make_batches, make_gpt  # noqa: E402
from report import write_section  # noqa: E402

LORA_RANK = 8
LORA_ALPHA = 16.0  # scale alpha / r = 2
LORA_TARGETS = ("qkv", "proj", "fc", "out")  # every attention and MLP Linear of a block
ADAPTER_SEED_OFFSET = 1000  # adapters draw from their own generator: the base is exactly make_gpt(cfg, seed)
LABELS = {"ragged": "lightning_ragged `fully_shard`", "fsdp2": "FSDP2 `fully_shard`", "ddp": "DDP"}


# --------------------------------------------------------------------------- model
class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update: ``base(x) + (x A^T) B^T * alpha / r``."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator) -> None:
        super().__init__()
        self.base = base
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5), generator=generator)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scale


def make_lora_gpt(cfg: GPTConfig = GPTConfig(), seed: int = 0) -> GPT:
    """``make_gpt(cfg, seed)`` with every parameter frozen and LoRA adapters on every block Linear."""
    model = make_gpt(cfg, seed)
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed + ADAPTER_SEED_OFFSET)
    for block in model.blocks:
        for target in LORA_TARGETS:
            setattr(block, target, LoRALinear(getattr(block, target), LORA_RANK, LORA_ALPHA, generator))
    return model


def is_adapter(name: str) -> bool:
    return ".lora_" in name


# --------------------------------------------------------------------------- checks
def full_params(name: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter at full shape under its original name, on every rank (collective)."""
    if name == "ragged":
        import lightning_ragged

        return dict(lightning_ragged.full_state_dict(model))
    if name == "fsdp2":
        return {n: p.full_tensor() for n, p in model.named_parameters()}
    return {n.removeprefix("module."): p.detach() for n, p in model.named_parameters()}


def local_numel(param: torch.Tensor) -> int:
    """Elements this rank holds (a DTensor's local shard, a ragged shard, or the whole tensor)."""
    return param.to_local().numel() if hasattr(param, "to_local") else param.numel()


def check_pass(
    frameworks: dict[str, tuple[nn.Module, torch.optim.Optimizer]], cfg: GPTConfig
) -> dict[str, dict[str, Any]]:
    """After training: base bit-identical to the untrained model, adapters moved, frameworks agree."""
    reference = dict(make_lora_gpt(cfg).named_parameters())
    full = {name: full_params(name, model) for name, (model, _) in frameworks.items()}
    result = {}
    for name, (model, optimizer) in frameworks.items():
        params = full[name]
        base = [n for n in reference if not is_adapter(n)]
        adapters = [n for n in reference if is_adapter(n)]
        trained = [p for p in model.parameters() if p.requires_grad]
        frozen = [p for p in model.parameters() if not p.requires_grad]
        result[name] = {
            "names_match": sorted(params) == sorted(reference),
            "base_tensors": len(base),
            "base_changed": sum(not torch.equal(params[n], reference[n].detach()) for n in base),
            "adapters": len(adapters),
            "adapter_elements": sum(reference[n].numel() for n in adapters),
            "b_nonzero": sum(bool(params[n].count_nonzero()) for n in adapters if n.endswith("lora_B")),
            "b_tensors": sum(n.endswith("lora_B") for n in adapters),
            "a_moved": sum(not torch.equal(params[n], reference[n].detach()) for n in adapters if n.endswith("lora_A")),
            "adapter_diff_vs_ddp": max((params[n] - full["ddp"][n]).abs().max().item() for n in adapters),
            "optimizer_elements": sum(local_numel(p) for group in optimizer.param_groups for p in group["params"]),
            "trainable_local_elements": sum(local_numel(p) for p in trained),
            "frozen_local_elements": sum(local_numel(p) for p in frozen),
            "frozen_with_grad": sum(p.grad is not None for p in frozen),
        }
    return result


# --------------------------------------------------------------------------- ranks
def lora_rank(rank: int, cfg: GPTConfig, opts: dict[str, Any]) -> dict[str, Any]:
    total_steps = opts["warmup"] + opts["rounds"] * opts["steps"]
    batches = make_batches(total_steps + 3, WORLD_SIZE * opts["batch"], cfg)
    frameworks = {name: build(name, cfg, make_model=make_lora_gpt) for name in FRAMEWORKS}
    timed = timed_rounds(frameworks, batches, rank, opts)
    checks = check_pass(frameworks, cfg)
    del frameworks

    names = (*FRAMEWORKS, "local")
    counts = {name: count_pass(name, cfg, batches, rank, make_model=make_lora_gpt) for name in names}
    memory = {name: memory_pass(name, cfg, batches, rank, make_model=make_lora_gpt) for name in names}

    gathered: list[Any] = [None] * WORLD_SIZE
    dist.all_gather_object(gathered, {"losses": timed["losses"], "times": timed["times"], "memory": memory,
                                      "checks": checks, "counts": counts})
    mean_losses = {name: [sum(g["losses"][name][i] for g in gathered) / WORLD_SIZE for i in range(total_steps)]
                   for name in FRAMEWORKS}
    model = make_lora_gpt(cfg)
    return {
        "params": count_params(model),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "losses": mean_losses,
        "times": timed["times"],
        "times_rank1": gathered[1]["times"],
        "fwd_bwd": timed["fwd_bwd"],
        "opt": timed["opt"],
        "counts": counts,
        "counts_rank1": gathered[1]["counts"],
        "memory": memory,
        "memory_rank1": gathered[1]["memory"],
        "checks": checks,
        "checks_rank1": gathered[1]["checks"],
    }


# --------------------------------------------------------------------------- report
def collective_kinds(count: dict[str, Any]) -> dict[str, list[int]]:
    """[number, bytes] of the reductions, all-gathers and other collectives of one forward+backward."""
    kinds = {"reduce": [0, 0], "all_gather": [0, 0], "other": [0, 0]}
    for op, (number, nbytes) in count["collectives_by_op"].items():
        point_to_point = op in ("c10d::send", "c10d::recv_")  # reduce_mode="pairwise" (gloo's default)
        kind = ("reduce" if "reduce" in op or point_to_point else "all_gather" if "allgather" in op else "other")
        kinds[kind][0] += number
        kinds[kind][1] += nbytes
    return kinds


def per_round(times: list[float], steps: int) -> list[float]:
    return [statistics.median(times[i : i + steps]) for i in range(0, len(times), steps)]


def render(result: dict[str, Any], cfg: GPTConfig, opts: dict[str, Any], load: tuple[float, ...], wall: float) -> str:
    times, steps = result["times"], opts["steps"]
    med = {n: statistics.median(times[n]) * 1e3 for n in FRAMEWORKS}
    med1 = {n: statistics.median(result["times_rank1"][n]) * 1e3 for n in FRAMEWORKS}
    fb = {n: statistics.median(result["fwd_bwd"][n]) * 1e3 for n in FRAMEWORKS}
    op = {n: statistics.median(result["opt"][n]) * 1e3 for n in FRAMEWORKS}
    rounds = {n: per_round(times[n], steps) for n in FRAMEWORKS}
    round_ratio = {n: statistics.median(a / b for a, b in zip(rounds[n], rounds["fsdp2"])) for n in FRAMEWORKS}
    counts, counts1 = result["counts"], result["counts_rank1"]
    memory, memory1 = result["memory"], result["memory_rank1"]
    checks, checks1 = result["checks"], result["checks_rank1"]
    kinds = {n: collective_kinds(counts[n]) for n in FRAMEWORKS}
    same_counts_on_ranks = all(collective_kinds(counts1[n]) == kinds[n] for n in FRAMEWORKS)
    baseline = counts["local"]["copy_bytes"]
    losses = result["losses"]
    steps_total = len(losses["ddp"])
    final = {n: losses[n][-1] for n in FRAMEWORKS}
    diff = {n: max(abs(a - b) for a, b in zip(losses[n], losses["ddp"])) for n in FRAMEWORKS}
    max_diff = max(abs(losses[a][i] - losses[b][i]) for a in FRAMEWORKS for b in FRAMEWORKS for i in range(steps_total))
    final_spread = max(final.values()) - min(final.values())
    first, last = losses["ddp"][0], losses["ddp"][-1]
    both = (checks, checks1)
    base_ok = all(c[n]["base_changed"] == 0 and c[n]["names_match"] for c in both for n in FRAMEWORKS)
    adapters_ok = all(c[n]["b_nonzero"] == c[n]["b_tensors"] and c[n]["a_moved"] > 0 for c in both for n in FRAMEWORKS)
    trains = last < first
    any_check = checks["ddp"]
    stats = counts["ragged"].get("engine_stats", {})
    spread = max(max(times[n]) / min(times[n]) for n in FRAMEWORKS)
    verdict = "agree" if max_diff <= 1e-4 else "DISAGREE"

    lines = [
        "## LoRA fine-tuning: lightning_ragged vs FSDP2 vs DDP (2 CPU ranks, gloo)",
        "",
        "Written by `benchmarks/lora_bench.py`"
        + (" (`--quick` smoke run: too few steps to trust)" if opts["quick"] else "")
        + ".",
        machine_line(load, wall),
        f"Model: engine_bench's GPT (vocab {cfg.vocab}, width {cfg.width}, {cfg.layers} blocks, seq {cfg.seq}, "
        f"{(result['params'] - result['trainable']) / 1e6:.1f}M base parameters, all frozen) plus rank-{LORA_RANK} LoRA "
        f"adapters (A `r x in` Kaiming-uniform, B `out x r` zeros, alpha/r = {LORA_ALPHA / LORA_RANK:g}) on "
        f"{', '.join(f'`{t}`' for t in LORA_TARGETS)} of every block: {any_check['adapters']} adapter tensors, "
        f"{result['trainable']:,} trainable elements ({mib(4 * result['trainable'])} MiB fp32, "
        f"{100 * result['trainable'] / result['params']:.1f}% of the model). AdamW(lr={LR}) defaults on the adapters only; "
        f"batch {opts['batch']} sequences per rank, `torch.set_num_threads(1)` per rank.",
        f"Schedule: {opts['warmup']} warm-up steps each, then {opts['rounds']} rounds x [ragged, fsdp2, ddp] "
        f"(order rotated every round) x {steps} timed steps; all three persistent in one process per rank, same seed, "
        "same batches. Frameworks as in the engine section: lightning_ragged `fully_shard(model)` defaults (frozen "
        "parameters get DBuffers of their own, with no gradient buffer and no reduction); FSDP2 `fully_shard` on each "
        "block then the root (frozen and trainable parameters mixed in one group); DDP defaults (buckets only the "
        "trainable parameters).",
        "",
        "Counts first (collectives, bytes, elements: exact, the same in every run; memory: mostly within a few "
        "hundred KiB from run to run, but rank 0's at-rest value for lightning_ragged varies by tens of MiB between "
        "runs, with either reduction mode; likely cause: the profiler's running sum misses frees made on gloo's "
        "threads, where the last reference to a reduced buffer can die), then times (noisy on this shared machine). "
        "lightning_ragged's reductions count each point-to-point op of its pairwise reduction (a `send` and a "
        "`recv_` per peer and DBuffer):",
        "",
        "| framework | reductions/step | MiB reduced/step | all-gathers/step | MiB all-gathered/step | other collectives | "
        "engine copy MiB/step | optimizer elements (rank 0 / 1) | memory at rest MiB (rank 0 / 1) | "
        "peak memory MiB (rank 0 / 1) | frozen params with `.grad` |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in FRAMEWORKS:
        k = kinds[n]
        lines.append(
            f"| {LABELS[n]} | {k['reduce'][0]} | {mib(k['reduce'][1])} | {k['all_gather'][0]} | {mib(k['all_gather'][1])} | "
            f"{k['other'][0]} | {mib(counts[n]['copy_bytes'] - baseline)} | "
            f"{checks[n]['optimizer_elements']:,} / {checks1[n]['optimizer_elements']:,} | "
            f"{mib(memory[n]['rest_bytes'])} / {mib(memory1[n]['rest_bytes'])} | "
            f"{mib(memory[n]['peak_bytes'])} / {mib(memory1[n]['peak_bytes'])} | "
            f"{checks[n]['frozen_with_grad'] + checks1[n]['frozen_with_grad']} |"
        )
    lines.append(
        f"| single process, no framework (reference) | 0 | 0 | 0 | 0 | 0 | 0 (baseline {mib(baseline)}) | "
        f"{result['trainable']:,} | {mib(memory['local']['rest_bytes'])} | {mib(memory['local']['peak_bytes'])} | 0 |"
    )
    lines += [
        "",
        f"| framework | median step ms (rank 0) | rank 1 | vs FSDP2 | vs FSDP2, per round | best step ms | fwd+bwd ms | "
        f"optimizer ms | loss at step 1 | loss after {steps_total} steps | max abs loss diff vs DDP | "
        "base tensors changed | max abs adapter diff vs DDP |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in FRAMEWORKS:
        c = checks[n]
        lines.append(
            f"| {LABELS[n]} | {med[n]:,.0f} | {med1[n]:,.0f} | {med[n] / med['fsdp2']:.2f}x | {round_ratio[n]:.2f}x | "
            f"{min(times[n]) * 1e3:,.0f} | {fb[n]:,.0f} | {op[n]:,.0f} | {losses[n][0]:.4f} | {final[n]:.4f} | "
            f"{diff[n]:.1e} | {c['base_changed'] + checks1[n]['base_changed']} of {c['base_tensors']} | "
            f"{c['adapter_diff_vs_ddp']:.1e} |"
        )
    lines += [
        "",
        f"**Losses {verdict}**: the largest difference between any two frameworks at any of the {steps_total} steps is "
        f"{max_diff:.1e} (final losses within {final_spread:.1e}). "
        f"**Adapters train**: the loss falls from {first:.4f} to {last:.4f} ({'falls' if trains else 'DOES NOT FALL'}); "
        f"adapters moved: {'yes' if adapters_ok else 'NO'} (all {any_check['b_tensors']} zero-initialised B are "
        "nonzero and the A have changed, in every framework on both ranks). "
        f"**Base bit-identical**: {'yes' if base_ok else 'NO'}: all {any_check['base_tensors']} base tensors, gathered "
        "to full shape after training, `torch.equal` to the untrained `make_gpt` weights in every framework on both ranks.",
        "",
        *([
            f"lightning_ragged issues {kinds['ragged']['all_gather'][0]} all-gathers per step to FSDP2's "
            f"{kinds['fsdp2']['all_gather'][0]} for the same {mib(kinds['fsdp2']['all_gather'][1])} MiB: a block's "
            "trainable adapters and its frozen base are separate DBuffers, gathered one call each (forward and "
            "backward), where FSDP2 gathers a block's frozen and trainable parameters in one call.",
            "",
        ] if kinds["ragged"]["all_gather"][0] > kinds["fsdp2"]["all_gather"][0] else []),
        "How each column is measured:",
        "- collectives: `c10d::` operators dispatched during one forward+backward after a warm-up step (engine_bench's "
        "count pass), with the bytes of each one's full-size buffer (all-gather output, all-reduce/reduce-scatter "
        "input; a point-to-point op: its tensor); reductions are `allreduce_`/`reduce_scatter` ops and the "
        "`send`/`recv_` of lightning_ragged's pairwise reduction (gloo), the rest are in \"other\". By op: "
        + "; ".join(
            f"{n}: " + ", ".join(f"`{o}` {c} x, {mib(b)} MiB" for o, (c, b) in sorted(counts[n]["collectives_by_op"].items()))
            for n in FRAMEWORKS
        )
        + ". "
        + (f"lightning_ragged's own `CommStats` (another backward): {stats['all_gathers']} all-gathers "
           f"({mib(stats['all_gather_bytes'])} MiB), {stats['reduces']} gradient reductions ({mib(stats['reduce_bytes'])} "
           f"MiB) and {stats.get('flag_syncs', 0)} small all-reduce of which parameters got a gradient (DDP's `grad is "
           "None` semantics), which the reductions column includes. " if stats else "")
        + f"Rank 1 saw the same counts: {'yes' if same_counts_on_ranks else 'NO'}.",
        "- engine copy: bytes written by copy-like aten ops during the same forward+backward minus the "
        f"single-process model's own ({mib(baseline)} MiB). By op: "
        + "; ".join(
            f"{n}: " + (", ".join(f"`{o}` {mib(b - counts['local']['copy_by_op'].get(o, 0))}"
                                  for o, b in sorted(counts[n]["copy_by_op"].items())
                                  if b - counts["local"]["copy_by_op"].get(o, 0) != 0) or "none")
            for n in FRAMEWORKS
        )
        + ".",
        "- optimizer elements: elements of the parameters AdamW holds on each rank (its state is twice that); "
        "frozen params with `.grad`: frozen parameters (local shards) holding a gradient after a step, both ranks.",
        "- memory: engine_bench's memory pass (live CPU-allocator bytes from profiler allocation events, fresh model "
        "per framework): at rest = at the start of the second step; peak = maximum during it.",
        "- step: wall time of zero_grad + forward + backward + `optimizer.step()`, median over the timed steps; "
        "\"per round\": median over rounds of (median step in the round / FSDP2's in the same round). Per-round "
        "medians (ms, rank 0): "
        + "; ".join(f"{n}: " + ", ".join(f"{t * 1e3:,.0f}" for t in rounds[n]) for n in FRAMEWORKS)
        + f". Step times of one framework varied by up to {spread:.1f}x within the run.",
        f"- loss: mean of the two ranks' local losses; max abs diff over all {steps_total} steps vs DDP. Adapter diff: "
        "max abs difference of the gathered adapters after training vs DDP's.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short smoke run (1 warm-up, 2 rounds x 1 step)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per framework per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--no-write", action="store_true", help="print the table, leave RESULTS.md alone")
    parser.add_argument("--json", help="also dump the raw results (per-step times, counts, memory, checks) to this file")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup = 2, 1, 1
    cfg = GPTConfig()
    opts = {"warmup": args.warmup, "rounds": args.rounds, "steps": args.steps, "batch": args.batch, "quick": args.quick}
    result, load, wall = launch(cfg, opts, lora_rank)
    markdown = render(result, cfg, opts, load, wall)
    print(markdown)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if not args.no_write:
        write_section("lora", markdown, ROOT / "benchmarks" / "RESULTS.md")


if __name__ == "__main__":
    main()
