"""The planner at scale: one block per group vs the auto-planner, at 1,024 and 10,000 ranks.

For the plan CLI's presets (built on the meta device by ``transformers`` and grouped as
``fully_shard`` groups them) it compares one transformer block per group, sharded over
the whole world (the plan report's default), with :func:`lightning_ragged.layout.auto.auto_plan`
(blocks per group and HSDP replicate degree chosen within a per-rank memory budget). Rows
are as in ``planner_table.py`` (a row of a fused expert tensor is one row of one expert);
alignment 16 elements; master fp32, compute bf16, AdamW. Run from the repository root:
``python benchmarks/scale_table.py``; it prints the table, rewrites the "scale" section of
``benchmarks/RESULTS.md`` and draws ``scale_padding.png`` (padding vs world size) in
``$RAGGED_BENCH_PLOT_DIR`` (default ``benchmarks/plots``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from planner_table import row_block_specs  # noqa: E402
from report import write_section  # noqa: E402

from lightning_ragged.cli.model_groups import PRESETS, ModelDescription, describe_model  # noqa: E402
from lightning_ragged.cli.plan import plan_model  # noqa: E402
from lightning_ragged.layout.auto import DEFAULT_PADDING_TARGET, AutoPlan, BudgetTooSmall, auto_plan  # noqa: E402
from lightning_ragged.layout.memory import memory_estimate  # noqa: E402

MODELS = {
    "Llama-3-70B": ("llama3-70b", None),
    "DeepSeek-V3 (experts fused)": ("deepseek-v3", "fused"),
    "DeepSeek-V3 (experts separate)": ("deepseek-v3", "separate"),
    "GPT-OSS-120B (experts fused)": ("gpt-oss-120b", "fused"),
}
PLOTTED = ("Llama-3-70B", "DeepSeek-V3 (experts fused)", "GPT-OSS-120B (experts fused)")
WORLD_SIZES = (1024, 10_000)
PLOT_WORLD_SIZES = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 10_000, 16_384)
ROW_MULTIPLES = (1, 16)
ALIGNMENT = 16
BUDGET = 80 * 10**9  # "80 GB"
LARGER_BUDGET = 141 * 10**9  # an H200's 141 GB, tried where nothing fits in 80 GB
GB = 10**9


def rows_policy(rows_per_block: int):
    """``shard_granularity`` callable keeping ``rows_per_block`` rows whole (rows as in ``planner_table``)."""
    return lambda name, param: row_block_specs([(name, tuple(param.shape))], rows_per_block)[0].granularity


def one_block_per_group(description: ModelDescription, world: int, rows: int) -> dict:
    """The plan report's default: every block its own group, sharded over all ``world`` ranks."""
    groups = plan_model(description, world, rows_policy(rows), alignment=ALIGNMENT)
    numel = sum(g["count"] * b["numel"] for g in groups for b in g["dbuffers"])
    padding = sum(g["count"] * b["padding"] for g in groups for b in g["dbuffers"]) / numel
    return dict(padding=padding, memory=memory_estimate(groups, world, 4, 2, "adamw")["total"])


def auto(description: ModelDescription, world: int, rows: int, budget: int) -> tuple[AutoPlan | None, float, float]:
    """The auto-planner's choice (None where nothing fits), the least bytes per rank any choice needs, its seconds."""
    began = time.perf_counter()
    try:
        chosen = auto_plan(description, world, rows_policy(rows), budget, alignment=ALIGNMENT)
    except BudgetTooSmall as error:
        return None, error.least_bytes, time.perf_counter() - began
    return chosen, chosen.memory["total"], time.perf_counter() - began


def blocks_per_group(chosen: AutoPlan) -> str:
    """Blocks per group of every kind of block, e.g. ``3 (26), 2 (1)``: blocks (number of such groups)."""
    parts = [f"{g.blocks} ({g.count})" for g in chosen.groups if g.kind != "root"]
    return ", ".join(parts)


def measure() -> list[dict]:
    results = []
    descriptions = {model: describe_model(PRESETS[p], p, experts) for model, (p, experts) in MODELS.items()}
    for model, description in descriptions.items():
        for rows in ROW_MULTIPLES:
            for world in WORLD_SIZES:
                base = one_block_per_group(description, world, rows)
                for budget in (BUDGET, LARGER_BUDGET):
                    chosen, least, seconds = auto(description, world, rows, budget)
                    results.append(dict(model=model, rows=rows, world=world, budget=budget, base=base, chosen=chosen,
                                        least=least, seconds=seconds))
                    if chosen is not None:
                        break
    return results


def to_markdown(results: list[dict]) -> str:
    lines = [
        "| model | rows | world | budget | one block: padding | one block: memory/rank "
        "| auto: blocks per group (groups) | auto: replicate degree | auto: padding | its lower bound "
        "| lowest bound in budget | auto: memory/rank | plan s |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        base, chosen = r["base"], r["chosen"]
        head = (f"| {r['model']} | {r['rows']}x | {r['world']:,} | {r['budget'] / GB:.0f} GB | {base['padding']:.2%} "
                f"| {base['memory'] / GB:.1f} GB{'' if base['memory'] <= r['budget'] else ' (over)'} ")
        if chosen is None:
            lines.append(head + f"| no choice fits | | | | | | {r['seconds']:.3f} |")
            continue
        lines.append(
            head + f"| {blocks_per_group(chosen)} | {chosen.replicate_degree} | {chosen.padding_ratio:.2%} "
            f"| {chosen.lower_bound_padding_ratio:.2%} | {chosen.best_bound_padding_ratio:.2%} "
            f"| {chosen.memory['total'] / GB:.1f} GB | {r['seconds']:.3f} |"
        )
    return "\n".join(lines)


def findings(results: list[dict]) -> list[str]:
    """One sentence per row that misses the target or fits no choice, with the bound that says why."""
    notes = []
    for r in results:
        where = f"{r['model']}, {r['rows']}x rows, {r['world']:,} ranks, {r['budget'] / GB:.0f} GB"
        chosen = r["chosen"]
        if chosen is None:
            notes.append(f"{where}: no choice fits: every choice needs at least {r['least'] / GB:.1f} GB per rank "
                         "(planned; or at the lower bound of its segment sizes, where that is over already).")
        elif not chosen.meets_target:
            at_bound = chosen.padding_ratio <= chosen.best_bound_padding_ratio + 1e-12
            notes.append(f"{where}: {chosen.padding_ratio:.2%}: no choice within the budget can pad "
                         f"{DEFAULT_PADDING_TARGET:.0%} or less: the lowest lower bound over them is "
                         f"{chosen.best_bound_padding_ratio:.2%}" + (" (the choice is at it)." if at_bound else "."))
    return notes


def plot(descriptions: dict[str, ModelDescription], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: needs matplotlib (pip install 'lightning-ragged[plot]')"
    figure, axes = plt.subplots(1, len(descriptions), figsize=(5 * len(descriptions), 4.2), sharey=True)
    for axis, (model, description) in zip(axes, descriptions.items()):
        for rows, color in zip(ROW_MULTIPLES, ("tab:blue", "tab:red")):
            base = [100 * one_block_per_group(description, w, rows)["padding"] for w in PLOT_WORLD_SIZES]
            axis.plot(PLOT_WORLD_SIZES, base, color=color, linestyle="--", marker="o", label=f"{rows}x rows, one block")
            for budget, style in ((BUDGET, "-"), (LARGER_BUDGET, ":")):
                chosen = [auto(description, w, rows, budget)[0] for w in PLOT_WORLD_SIZES]
                points = [(w, 100 * c.padding_ratio) for w, c in zip(PLOT_WORLD_SIZES, chosen) if c is not None]
                if points:
                    axis.plot(*zip(*points), color=color, linestyle=style, marker="s",
                              label=f"{rows}x rows, auto, {budget / GB:.0f} GB")
        axis.axhline(100 * DEFAULT_PADDING_TARGET, color="grey", linewidth=0.8)
        axis.set_xscale("log", base=2)
        axis.set_yscale("symlog", linthresh=1.0)
        axis.set_ylim(bottom=0)
        axis.set_xlabel("ranks (world size)")
        axis.set_title(model)
        axis.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("padding (% of parameters)")
    axes[-1].legend(fontsize=7)
    figure.suptitle("Padding vs world size: one block per group vs auto (missing points: no choice fits)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"wrote {path}"


def main() -> None:
    began = time.perf_counter()
    results = measure()
    plot_dir = Path(os.environ.get("RAGGED_BENCH_PLOT_DIR", "benchmarks/plots"))
    plot_dir.mkdir(parents=True, exist_ok=True)
    descriptions = {m: describe_model(PRESETS[MODELS[m][0]], MODELS[m][0], MODELS[m][1]) for m in PLOTTED}
    plotted = plot(descriptions, plot_dir / "scale_padding.png")
    met = [r for r in results if r["chosen"] is not None and r["chosen"].meets_target]
    slowest = max(r["seconds"] for r in results)
    notes = [
        "## Planner at scale: one block per group vs the auto-planner",
        "",
        "Written by `benchmarks/scale_table.py`. *One block*: every transformer block its own group, sharded over "
        "the whole world (the plan report's default). *Auto*: `auto_plan` (`python -m lightning_ragged.plan --auto "
        "--memory-budget 80GB`) chooses the blocks per group (consecutive, per kind of block) and the HSDP "
        f"replicate degree within the per-rank budget (target {DEFAULT_PADDING_TARGET:.0%} padding, then the least "
        "memory). Memory per rank is the plan report's estimate: sharded fp32 parameters, gradients and AdamW "
        "states plus the largest group gathered in bf16 three times (computing, prefetched, its gradient); "
        "activations excluded. Rows as in the planner table (a fused expert's row is one row of one expert); "
        f"alignment {ALIGNMENT} elements. A row at {LARGER_BUDGET / GB:.0f} GB (an H200) follows every row where "
        "no choice fits 80 GB. *Its lower bound*: padding at `segment_lower_bound` for the chosen groups; *lowest "
        "bound in budget*: the lowest lower bound of any choice that fits, so no choice within the budget pads less.",
        "",
        to_markdown(results),
        "",
        f"Target met in {len(met)} of {len(results)} rows; the slowest auto-plan took {slowest:.3f} s "
        f"(whole run {time.perf_counter() - began:.0f} s, plot included).",
        "",
    ]
    missed = findings(results)
    if missed:
        notes += ["Where the target is not met, and why:", ""] + [f"- {line}" for line in missed] + [""]
    notes += ["![padding vs world size](plots/scale_padding.png)" if plotted.startswith("wrote") else plotted]
    markdown = "\n".join(notes)
    print(markdown)
    write_section("scale", markdown)


if __name__ == "__main__":
    main()
