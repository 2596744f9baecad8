"""Plan report: what sharding a model with ``fully_shard`` would cost, before any GPU is rented.

``python -m lightning_ragged.plan --config <config.json | llama3-70b | deepseek-v3 | gpt-oss-120b>
--world-size N [--granularity row] [--replicate-degree R] [--plot padding.png] [--json]
[--auto --memory-budget 80GB]``

For every distinct FSDP group of the model (the groups ``fully_shard`` forms: one
transformer block per group, identical blocks counted once; embeddings, final norm and
head form the root group, one DBuffer before the blocks and one after) it runs the
same planner ``fully_shard`` runs (:func:`lightning_ragged.layout.planner.plan`, granularity
from :func:`lightning_ragged.layout.granularity.resolve_granularity`) and prints the segment
size S, the padding, the block cuts avoided and the plan time, then the per-rank memory
estimate. "Block cuts avoided" counts the rank boundaries of an even flat split of the
same group (FSDP1/ZeRO style: segments of ``ceil(total / ranks)``) that would fall
inside a block of the chosen granularity; the ragged plan has none by construction.

With ``--auto`` it instead chooses how many consecutive blocks form one group and the
replicate degree within ``--memory-budget`` (:func:`lightning_ragged.layout.auto.auto_plan`)
and reports the choice and why, per group.

The model is built on the meta device by ``transformers`` from a Hugging Face
``config.json`` or a named preset (:mod:`lightning_ragged.cli.model_groups`); no weights
are needed and nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from lightning_ragged.cli.model_groups import PRESETS, ModelDescription, describe_model, load_config
from lightning_ragged.engine.api import DEFAULT_DBUFFER_SIZE
from lightning_ragged.layout.granularity import POLICIES
from lightning_ragged.layout.auto import DEFAULT_PADDING_TARGET, DTYPE_OF_BYTES, AutoPlan, auto_plan, shape_granularity
from lightning_ragged.layout.memory import DTYPE_BYTES, OPTIMIZER_STATE_BYTES, format_bytes, memory_estimate, parse_bytes



# ------------------------------------------------------------------------- planning
def block_cuts(specs: Sequence[Any], world_size: int) -> int:
    """Rank boundaries of an even flat split (segments of ``ceil(total/world)``) that fall inside a block."""
    total = sum(spec.numel for spec in specs)
    if total == 0 or world_size <= 1:
        return 0
    segment = -(-total // world_size)
    cuts, offset = 0, 0
    for spec in specs:
        start, end = offset, offset + spec.numel
        first = start // segment + 1
        for k in range(first, -(-end // segment)):
            if (k * segment - start) % spec.granularity:
                cuts += 1
        offset = end
    return cuts


def plan_model(
    description: ModelDescription,
    shard_world: int,
    granularity: str = "row",
    block_rows: int = 128,
    algorithm: str = "optimal",
    alignment: int = 1,
    dbuffer_size: Optional[int] = None,
    master_bytes: int = 4,
) -> list[dict[str, Any]]:
    """Plan every distinct group; one dict per group kind with one entry per DBuffer (per run, split by size)."""
    import torch
    from torch import nn

    from lightning_ragged.engine.grouping import split_into_dbuffers
    from lightning_ragged.layout.planner import plan
    from lightning_ragged.layout.spec import TensorSpec

    master = DTYPE_OF_BYTES[master_bytes]
    results = []
    for kind in description.groups:
        dbuffers = []
        for run in kind.runs:
            params = [(kind.full_name(name), nn.Parameter(torch.empty(shape, device="meta", dtype=master)))
                      for name, shape in run]
            dbuffers += split_into_dbuffers(params, dbuffer_size) if dbuffer_size else [params]
        planned = []
        for dbuffer in dbuffers:
            specs = [
                TensorSpec(name, param.numel(), shape_granularity(granularity, name, tuple(param.shape), block_rows))
                for name, param in dbuffer
            ]
            started = time.perf_counter()
            layout = plan(specs, shard_world, algorithm=algorithm, alignment=alignment)
            seconds = time.perf_counter() - started
            planned.append(
                dict(
                    tensors=len(specs),
                    numel=layout.total_numel,
                    segment_size=layout.segment_size,
                    padding=layout.padding,
                    padding_ratio=layout.padding_ratio,
                    block_cuts_avoided=block_cuts(specs, shard_world),
                    plan_seconds=seconds,
                )
            )
        results.append(dict(group=kind.name, count=kind.count, dbuffers=planned))
    return results


# ------------------------------------------------------------------------- output
def render_table(report: dict[str, Any]) -> str:
    lines = [
        f"{report['model']}: {report['total_params']:,} parameters; world size {report['world_size']:,}, "
        f"replicate degree {report['replicate_degree']} -> sharded over {report['shard_world_size']:,} ranks; "
        f"granularity {report['granularity']!r}"
        + (f" ({report['block_rows']} rows)" if report["granularity"] == "block" else "")
        + f"; planner {report['algorithm']!r}, alignment {report['alignment']}",
        "",
        "| group | count | DBuffer | tensors | parameters | segment S | padding | padding % | block cuts avoided "
        "| plan s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for group in report["groups"]:
        for index, dbuffer in enumerate(group["dbuffers"]):
            lines.append(
                f"| {group['group']} | {group['count']} | {index} | {dbuffer['tensors']} | {dbuffer['numel']:,} "
                f"| {dbuffer['segment_size']:,} | {dbuffer['padding']:,} | {dbuffer['padding_ratio']:.2%} "
                f"| {dbuffer['block_cuts_avoided']:,} | {dbuffer['plan_seconds']:.3f} |"
            )
    lines += [
        "",
        f"Whole model: padding {report['padding_ratio']:.2%} of the parameters; "
        f"{report['root_fraction']:.2%} of them in the root group (never resharded after forward); "
        f"{report['block_cuts_avoided']:,} block cuts avoided per step's layout; planning {report['plan_seconds']:.3f} s.",
        "",
    ]
    return "\n".join(lines + memory_lines(report))


def memory_lines(report: dict[str, Any]) -> list[str]:
    """The per-rank memory estimate, one line per part."""
    memory = report["memory"]
    return [
        f"Per-rank memory estimate (master {report['master_dtype']}, compute {report['param_dtype']}, "
        f"reduce {report['reduce_dtype']}, optimizer {report['optimizer']}; activations not included):",
        f"  parameters (sharded)        {format_bytes(memory['params'], 2)}",
        f"  gradients (sharded)         {format_bytes(memory['grads'], 2)}",
        f"  optimizer states            {format_bytes(memory['optimizer_states'], 2)}",
        f"  largest unsharded group     {format_bytes(memory['largest_unsharded_group'], 2)}",
        f"  transient peak              {format_bytes(memory['transient_peak'], 2)}"
        "  (2 full groups: computing + prefetched, and 1 full gradient buffer in the reduce dtype)",
        f"  total                       {format_bytes(memory['total'], 2)}",
    ]


def render_auto(report: dict[str, Any]) -> str:
    """The ``--auto`` report: the choice per group and why, the totals, the memory estimate."""
    lines = [
        f"{report['model']}: {report['total_params']:,} parameters; world size {report['world_size']:,}; "
        f"auto plan within {report['memory_budget_bytes']:,} bytes ({format_bytes(report['memory_budget_bytes'], 2)}) per rank, "
        f"padding target "
        f"{report['padding_target']:.0%}; granularity {report['granularity']!r}"
        + (f" ({report['block_rows']} rows)" if report["granularity"] == "block" else "")
        + f"; planner {report['algorithm']!r}, alignment {report['alignment']}",
        "",
        "| group | blocks per group | groups | segment S per DBuffer | padding % | lower bound % | unsharded "
        "| sharded per rank | why |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for g in report["groups"]:
        lines.append(
            f"| {g['group']} | {g['blocks']} | {g['count']} | {', '.join(f'{s:,}' for s in g['segment_sizes'])} "
            f"| {g['padding_ratio']:.2%} | {g['lower_bound_padding_ratio']:.2%} | {format_bytes(g['unsharded_bytes'], 2)} "
            f"| {format_bytes(g['sharded_bytes_per_rank'], 2)} | {g['why']} |"
        )
    lines += [
        "",
        f"Choice: replicate degree {report['replicate_degree']} (shard over {report['shard_world_size']:,} ranks), "
        f"dbuffer_size={report['dbuffer_size']:,} (one DBuffer per run of a group). Padding "
        f"{report['padding_ratio']:.2%} (lower bound of this choice {report['lower_bound_padding_ratio']:.2%}; "
        f"lowest bound of any choice within the budget {report['best_bound_padding_ratio']:.2%}).",
        f"Why: {report['why']}.",
        f"Per step and rank: {report['collectives_per_step']:,} collectives, {format_bytes(report['bytes_sent_per_step'], 2)} "
        "sent (ring algorithms; blocks gathered twice, the root once).",
        f"Searched {report['choices']:,} choices with {report['plans']:,} exact plans in {report['seconds']:.3f} s.",
        "",
    ]
    return "\n".join(lines + memory_lines(report))


def describe(args: argparse.Namespace) -> tuple[str, ModelDescription]:
    name, config = load_config(args.config)
    try:
        return name, describe_model(config, name, args.experts)
    except ValueError as error:  # a model_type or architecture transformers does not know
        raise SystemExit(f"--config {args.config!r}: {error}") from None


def build_auto_report(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--auto`` report as data: the model and settings, then :meth:`AutoPlan.to_dict`."""
    name, description = describe(args)
    try:
        chosen: AutoPlan = auto_plan(
            description,
            args.world_size,
            args.granularity,
            parse_bytes(args.memory_budget, "--memory-budget"),
            block_rows=args.block_rows,
            alignment=args.alignment,
            algorithm=args.algorithm,
            master_bytes=DTYPE_BYTES[args.master_dtype],
            param_bytes=DTYPE_BYTES[args.param_dtype],
            optimizer=args.optimizer,
            padding_target=args.padding_target,
            replicate_degree=args.replicate_degree,
            reduce_bytes=DTYPE_BYTES[args.reduce_dtype],
        )
    except ValueError as error:
        raise SystemExit(f"cannot auto-plan {name}: {error}") from None
    settings = dict(
        model=name, total_params=description.total_params, granularity=args.granularity, block_rows=args.block_rows,
        algorithm=args.algorithm, alignment=args.alignment, master_dtype=args.master_dtype,
        param_dtype=args.param_dtype, reduce_dtype=args.reduce_dtype, optimizer=args.optimizer,
    )
    return dict(settings, **chosen.to_dict())


def build_report(args: argparse.Namespace) -> dict[str, Any]:
    name, description = describe(args)
    replicate = args.replicate_degree or 1
    shard_world = args.world_size // replicate
    master_bytes, param_bytes = DTYPE_BYTES[args.master_dtype], DTYPE_BYTES[args.param_dtype]
    try:
        groups = plan_model(
            description,
            shard_world,
            args.granularity,
            args.block_rows,
            args.algorithm,
            args.alignment,
            args.dbuffer_size,
            master_bytes,
        )
    except ValueError as error:  # e.g. a parameter larger than --dbuffer-size
        raise SystemExit(f"cannot plan {name}: {error}") from None
    weighted = [(g["count"], b) for g in groups for b in g["dbuffers"]]
    numel = sum(count * b["numel"] for count, b in weighted)
    return dict(
        model=name,
        total_params=description.total_params,
        world_size=args.world_size,
        replicate_degree=replicate,
        shard_world_size=shard_world,
        granularity=args.granularity,
        block_rows=args.block_rows,
        algorithm=args.algorithm,
        alignment=args.alignment,
        master_dtype=args.master_dtype,
        param_dtype=args.param_dtype,
        reduce_dtype=args.reduce_dtype,
        optimizer=args.optimizer,
        groups=groups,
        padding_ratio=sum(count * b["padding"] for count, b in weighted) / numel,
        root_fraction=sum(g["count"] * b["numel"] for g in groups if g["group"] == "root" for b in g["dbuffers"]) / numel,
        block_cuts_avoided=sum(count * b["block_cuts_avoided"] for count, b in weighted),
        plan_seconds=sum(b["plan_seconds"] for _, b in weighted),
        memory=memory_estimate(groups, shard_world, master_bytes, param_bytes, args.optimizer,
                               DTYPE_BYTES[args.reduce_dtype]),
    )


def padding_curve(
    description: ModelDescription, world_sizes: Sequence[int], granularities: Sequence[str], **plan_kwargs: Any
) -> dict[str, list[float]]:
    """Whole-model padding ratio for every world size, per granularity."""
    curves = {}
    for granularity in granularities:
        ratios = []
        for world in world_sizes:
            groups = plan_model(description, world, granularity, **plan_kwargs)
            weighted = [(g["count"], b) for g in groups for b in g["dbuffers"]]
            numel = sum(c * b["numel"] for c, b in weighted)
            ratios.append(sum(c * b["padding"] for c, b in weighted) / numel)
        curves[granularity] = ratios
    return curves


def plot_padding(report: dict[str, Any], description: ModelDescription, path: str, args: argparse.Namespace) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--plot needs matplotlib: pip install 'lightning-ragged[plot]'"
    world_sizes = [2**k for k in range(3, 15)]
    granularities = ["element", "row", "block"]
    curves = padding_curve(
        description,
        world_sizes,
        granularities,
        block_rows=args.block_rows,
        algorithm=args.algorithm,
        alignment=args.alignment,
        dbuffer_size=args.dbuffer_size,
        master_bytes=DTYPE_BYTES[args.master_dtype],
    )
    figure, axes = plt.subplots(figsize=(7, 4.2))
    for granularity, ratios in curves.items():
        label = f"{granularity} ({args.block_rows} rows)" if granularity == "block" else granularity
        axes.plot(world_sizes, [100 * r for r in ratios], marker="o", label=label)
    axes.set_xscale("log", base=2)
    axes.set_yscale("symlog", linthresh=1.0)
    axes.set_ylim(bottom=0)
    axes.set_xlabel("ranks per shard group")
    axes.set_ylabel("padding (% of parameters)")
    axes.set_title(f"{report['model']}: planner padding vs world size (alignment {args.alignment})")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"wrote {path}"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lightning_ragged.plan",
        description="Plan report: per-group segment size, padding, block cuts avoided, plan time, memory per rank.",
    )
    p.add_argument("--config", required=True, help=f"a config.json (or its folder) or a preset: {', '.join(PRESETS)}")
    p.add_argument("--world-size", type=int, required=True, help="data-parallel ranks in the job")
    p.add_argument("--granularity", choices=POLICIES, default="row", help="shard_granularity (default: row)")
    p.add_argument("--block-rows", type=int, default=128, help="rows per block for --granularity block")
    p.add_argument(
        "--replicate-degree",
        type=int,
        default=None,
        help="HSDP replicas; shards over world/replicas ranks (default 1; with --auto: chosen)",
    )
    p.add_argument("--algorithm", choices=("optimal", "greedy"), default="optimal")
    p.add_argument("--alignment", type=int, default=1, help="segment size multiple, in elements (default 1; fully_shard aligns to 16 bytes: 4 fp32 or 8 bf16 elements)")
    p.add_argument(
        "--dbuffer-size",
        metavar="BYTES",
        default=None,
        help="split groups into DBuffers of at most this many bytes (or e.g. 256MB, 256MiB), a larger tensor "
        "into one of its own, as fully_shard(dbuffer_size=...) does (default: fully_shard's 256 MiB)",
    )
    p.add_argument(
        "--experts",
        choices=("fused", "separate"),
        default=None,
        help="MoE expert tensors: fused as the transformers modules hold them (default), or separate: one tensor "
        "per expert matrix, as checkpoints store them",
    )
    p.add_argument("--master-dtype", choices=tuple(DTYPE_BYTES), default="fp32")
    p.add_argument("--param-dtype", choices=tuple(DTYPE_BYTES), default="bf16", help="compute dtype (all-gathered)")
    p.add_argument(
        "--reduce-dtype",
        choices=tuple(DTYPE_BYTES),
        default="fp32",
        help="dtype of the gradient reduction (MixedPrecisionPolicy.reduce_dtype; default fp32, as Lightning's "
        "precision='bf16-mixed' and the README's policy; pass the --param-dtype for reduce_dtype=None)",
    )
    p.add_argument("--optimizer", choices=tuple(OPTIMIZER_STATE_BYTES), default="adamw")
    p.add_argument("--json", action="store_true", help="print the report (or the --auto report) as one JSON object")
    p.add_argument(
        "--auto",
        action="store_true",
        help="choose blocks per group, the replicate degree and dbuffer_size within --memory-budget",
    )
    p.add_argument("--memory-budget", metavar="BYTES", help="per-rank budget for --auto: bytes, or e.g. 80GB, 80GiB")
    p.add_argument(
        "--padding-target",
        type=float,
        default=DEFAULT_PADDING_TARGET,
        help=f"--auto: padding ratio good enough to then minimise memory (default {DEFAULT_PADDING_TARGET})",
    )
    p.add_argument("--plot", metavar="PNG", help="also draw padding vs world size (needs matplotlib)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    check_args(args)
    if args.auto:
        report = build_auto_report(args)
        print(json.dumps(report, indent=2) if args.json else render_auto(report))
        return 0
    report = build_report(args)
    print(json.dumps(report, indent=2) if args.json else render_table(report))
    if args.plot:
        name, config = load_config(args.config)
        message = plot_padding(report, describe_model(config, name, args.experts), args.plot, args)
        print(message, file=sys.stderr)
    return 0


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad or conflicting options before the model is built."""
    if args.world_size < 1 or (args.replicate_degree is not None and args.replicate_degree < 1):
        raise SystemExit("--world-size and --replicate-degree must be positive")
    if args.world_size % (args.replicate_degree or 1):
        raise SystemExit(f"--replicate-degree {args.replicate_degree} must divide --world-size {args.world_size}")
    if args.block_rows < 1 or args.alignment < 1:
        raise SystemExit(f"--block-rows ({args.block_rows}) and --alignment ({args.alignment}) must be positive")
    if args.plot and not Path(args.plot).resolve().parent.is_dir():
        raise SystemExit(f"--plot {args.plot!r}: the folder {str(Path(args.plot).resolve().parent)!r} does not exist")
    if not args.auto:
        if args.dbuffer_size is None:  # what fully_shard builds by default
            args.dbuffer_size = DEFAULT_DBUFFER_SIZE
        else:  # fully_shard's rule: a positive number of bytes (0 was taken as "none")
            try:
                args.dbuffer_size = parse_bytes(args.dbuffer_size, "--dbuffer-size")
            except ValueError as error:
                raise SystemExit(str(error)) from None
        for flag, value in (("--memory-budget", args.memory_budget), ("--padding-target", args.padding_target)):
            if value is not None and value != DEFAULT_PADDING_TARGET:
                raise SystemExit(f"{flag} only applies with --auto; add --auto or drop {flag}")
        return
    if args.memory_budget is None:
        raise SystemExit("--auto needs --memory-budget BYTES (the per-rank budget), e.g. --memory-budget 80GB")
    for flag, value in (("--dbuffer-size", args.dbuffer_size), ("--plot", args.plot)):
        if value is not None:
            raise SystemExit(f"{flag} cannot be combined with --auto (it chooses dbuffer_size itself); drop {flag}")
    try:
        parse_bytes(args.memory_budget, "--memory-budget")
    except ValueError as error:
        raise SystemExit(str(error)) from None
    if args.padding_target < 0:
        raise SystemExit(f"--padding-target {args.padding_target} must be >= 0, e.g. 0.03 for 3%")


if __name__ == "__main__":
    sys.exit(main())
