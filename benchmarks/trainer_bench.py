"""The Lightning Trainer path on 2 CPU ranks: ``ragged_fsdp`` vs ModelParallelStrategy (FSDP2) vs DDP.

Run from the repository root::

    python benchmarks/trainer_bench.py            # full run, rewrites the "trainer" section of RESULTS.md
    python benchmarks/trainer_bench.py --quick    # short smoke run (still writes unless --no-write)

Every fit is one ``Trainer(accelerator="cpu", devices=2).fit`` in a fresh process: this
script (the orchestrator) starts ``python benchmarks/trainer_bench.py --worker --strategy X``
and Lightning's subprocess launcher re-runs that command line for rank 1, so each fit has
its own clean processes, process group and memory high-water mark. The three strategies
see the same model (``benchmarks/models.py``'s GPT, seed 0, built in ``configure_model``),
the same batches (``make_batches``; the global batch of step ``s`` split over the ranks by
Lightning's ``DistributedSampler``) and AdamW(lr=1e-3), so their losses must agree.

* ``ragged_fsdp``: ``Trainer(strategy="ragged_fsdp")`` with its defaults (one group per
  block, the token embedding's, the root; row granularity, optimal planner, its metrics callback on).
* ``fsdp2``: ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)``;
  ``configure_model`` applies ``torch.distributed.fsdp.fully_shard`` to each block then
  the GPT root (defaults) on the data-parallel mesh.
* ``ddp``: ``Trainer(strategy="ddp")``.

The orchestrator runs ``rounds`` rounds of the three fits, rotating the order each round,
and reports medians. Each rank measures, with a Callback: wall time of every step
(``on_train_batch_start`` -> ``on_train_batch_end``: forward, backward, optimizer step and
Lightning's own per-step work; warm-up steps skipped), the local loss, and peak RSS delta
(``getrusage`` high-water mark at the end of training minus the RSS in ``Callback.setup``,
i.e. before ``configure_model`` builds the model).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

STRATEGIES = ("ragged_fsdp", "fsdp2", "ddp")
LABELS = {
    "ragged_fsdp": '`strategy="ragged_fsdp"`',
    "fsdp2": "ModelParallelStrategy + FSDP2 `fully_shard`",
    "ddp": '`strategy="ddp"`',
}
WORLD_SIZE = 2
LR = 1e-3
SEED = 0


# --------------------------------------------------------------------------- worker (one fit)
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def run_fit(args: argparse.Namespace) -> None:
    import warnings

    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*number of training batches.*")

    import lightning.pytorch as L
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, Dataset

    import lightning_ragged  # noqa: F401  (registers strategy="ragged_fsdp")
    from models import GPTConfig, lm_loss, make_batches, make_gpt

    cfg = GPTConfig()
    total = args.warmup + args.steps
    name = args.strategy

    class Sequences(Dataset):
        def __init__(self) -> None:
            # Step-major: the global batch of step s is rows [s*2B, (s+1)*2B); the unshuffled
            # DistributedSampler gives rank r rows r, r+2, ... so each step sees exactly that batch.
            self.rows = make_batches(total, WORLD_SIZE * args.batch, cfg).reshape(-1, cfg.seq + 1)

        def __len__(self) -> int:
            return self.rows.shape[0]

        def __getitem__(self, index: int) -> torch.Tensor:
            return self.rows[index]

    class BenchGPT(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = None

        def configure_model(self) -> None:
            if self.model is not None:
                return
            self.model = make_gpt(cfg, SEED)
            if name == "fsdp2":
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                for block in self.model.blocks:
                    fully_shard(block, mesh=mesh)
                fully_shard(self.model, mesh=mesh)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return lm_loss(self.model, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=LR)

    class Probe(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []
            self.rss_before = 0
            self.peak_after = 0
            self._t0 = 0.0

        def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
            self.rss_before = _rss_bytes()  # before configure_model: imports, process group, data

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
            self.times.append(time.perf_counter() - self._t0)
            self.losses.append(float(outputs["loss"]))

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.peak_after = _peak_rss_bytes()

    if name == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy: Any = ModelParallelStrategy(data_parallel_size=WORLD_SIZE, tensor_parallel_size=1)
    else:
        strategy = name
    L.seed_everything(SEED, verbose=False)
    probe = Probe()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD_SIZE,
        strategy=strategy,
        max_steps=total,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[probe],
    )
    loader = DataLoader(Sequences(), batch_size=args.batch, shuffle=False)
    trainer.fit(BenchGPT(), loader)
    rank = trainer.global_rank
    result = {
        "strategy": name,
        "rank": rank,
        "world_size": trainer.world_size,
        "times": probe.times[args.warmup :],
        "warmup_times": probe.times[: args.warmup],
        "losses": probe.losses,
        "rss_before": probe.rss_before,
        "peak_rss": probe.peak_after,
        "strategy_class": type(trainer.strategy).__name__,
        "callbacks": [type(c).__name__ for c in trainer.callbacks],
        "threads": torch.get_num_threads(),
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(result))


# --------------------------------------------------------------------------- orchestrator
def fit_in_subprocess(name: str, args: argparse.Namespace, out: Path, timeout: int) -> tuple[list[dict[str, Any]], float]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GLOBAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--strategy", name,
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch), "--out", str(out)]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-6000:])
        raise RuntimeError(f"fit {name} failed with exit {done.returncode}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    return ranks, wall


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.0f}"


def render(fits: dict[str, list[list[dict[str, Any]]]], walls: dict[str, list[float]], opts: dict[str, Any],
           load: tuple[float, ...], load_end: float, wall: float) -> str:
    import torch

    from models import GPTConfig, count_params, make_gpt

    cfg = GPTConfig()
    params = count_params(make_gpt(cfg))
    times0 = {n: [t for fit in fits[n] for t in fit[0]["times"]] for n in STRATEGIES}
    times1 = {n: [t for fit in fits[n] for t in fit[1]["times"]] for n in STRATEGIES}
    # A step is as slow as its slower rank: the per-step maximum over the two ranks.
    times_max = {n: [max(a, b) for fit in fits[n] for a, b in zip(fit[0]["times"], fit[1]["times"])] for n in STRATEGIES}
    med = {n: statistics.median(times_max[n]) * 1e3 for n in STRATEGIES}
    med0 = {n: statistics.median(times0[n]) * 1e3 for n in STRATEGIES}
    med1 = {n: statistics.median(times1[n]) * 1e3 for n in STRATEGIES}
    rounds = opts["rounds"]
    round_med = {n: [statistics.median([max(a, b) for a, b in zip(fit[0]["times"], fit[1]["times"])]) * 1e3
                     for fit in fits[n]] for n in STRATEGIES}
    round_ratio = {n: statistics.median(round_med[n][i] / round_med["fsdp2"][i] for i in range(rounds))
                   for n in STRATEGIES}
    best = {n: min(times_max[n]) * 1e3 for n in STRATEGIES}
    peak = {n: [statistics.median(fit[r]["peak_rss"] - fit[r]["rss_before"] for fit in fits[n]) for r in range(2)]
            for n in STRATEGIES}
    peak_abs = {n: max(fit[r]["peak_rss"] for fit in fits[n] for r in range(2)) for n in STRATEGIES}
    # Global loss per step = mean of the two ranks' local losses (equal local batch sizes).
    losses = {n: [[(a + b) / 2 for a, b in zip(fit[0]["losses"], fit[1]["losses"])] for fit in fits[n]]
              for n in STRATEGIES}
    final = {n: losses[n][0][-1] for n in STRATEGIES}
    spread = {n: max(abs(fl[-1] - final[n]) for fl in losses[n]) for n in STRATEGIES}
    diff = {n: max(abs(a - b) for fl, fd in zip(losses[n], losses["ddp"]) for a, b in zip(fl, fd)) for n in STRATEGIES}
    ratio = med["ragged_fsdp"] / med["fsdp2"]
    met = ratio < 1.0
    total = opts["warmup"] + opts["steps"]
    extra_cb = sorted({c for fit in fits["ragged_fsdp"] for c in fit[0]["callbacks"]} - {"Probe"})
    lines = [
        "## Trainer: `ragged_fsdp` vs ModelParallelStrategy (FSDP2) vs DDP (Lightning, 2 CPU ranks, gloo)",
        "",
        "Written by `benchmarks/trainer_bench.py`"
        + (" (`--quick` smoke run: too few steps to trust)" if opts["quick"] else "")
        + ".",
        f"Machine: {platform.platform()}, {platform.machine()}, {os.cpu_count()} CPUs (shared with other jobs), "
        f"Python {platform.python_version()}, torch {torch.__version__}, lightning {_version('lightning')}. "
        f"1-minute load average {load[0]:.2f} at the start, {load_end:.2f} at the end; sampled every 5 s during the run: "
        f"min {load[1]:.2f}, mean {load[2]:.2f}, max {load[3]:.2f} (the benchmark itself contributes ~2); "
        f"wall time {wall:.0f} s.",
        f"Model: `benchmarks/models.py` GPT (as the engine section), vocab {cfg.vocab}, width {cfg.width}, "
        f"{cfg.layers} blocks, {cfg.heads} heads, seq {cfg.seq}, {params / 1e6:.1f}M parameters (fp32), built in "
        f"`configure_model` from seed {SEED}. Batch {opts['batch']} sequences per rank (`make_batches`, the same "
        f"global batches for all three), AdamW(lr={LR}), `torch.set_num_threads(1)` per rank, "
        "`Trainer(accelerator=\"cpu\", devices=2, logger=False, enable_checkpointing=False, "
        "enable_progress_bar=False, enable_model_summary=False)`.",
        f"Schedule: {rounds} rounds x [ragged_fsdp, fsdp2, ddp] (order rotated every round); every entry is one "
        f"`Trainer.fit` of {total} steps in fresh processes (`python benchmarks/trainer_bench.py --worker "
        f"--strategy X`, rank 1 started by Lightning's subprocess launcher), the first {opts['warmup']} steps "
        f"untimed; {rounds * opts['steps']} timed steps per strategy.",
        "Strategies: `strategy=\"ragged_fsdp\"` with its defaults (one group per block, the token embedding's, the root; row granularity, "
        f"optimal planner; its Trainer callbacks besides the probe: {', '.join(extra_cb) or 'none'}); "
        "`ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)` with `fully_shard` (FSDP2 defaults) "
        "on each block then the GPT root in `configure_model`; `strategy=\"ddp\"` defaults.",
        "",
        "| strategy | median step ms (slower rank) | rank 0 | rank 1 | vs FSDP2 | vs FSDP2, per round | best step ms | "
        "peak RSS delta MiB (rank 0 / 1) | peak RSS MiB (max) | fit wall s (median, incl. start-up) | "
        f"loss after {total} steps | max abs loss diff vs DDP |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in STRATEGIES:
        lines.append(
            f"| {LABELS[n]} | {med[n]:,.0f} | {med0[n]:,.0f} | {med1[n]:,.0f} | {med[n] / med['fsdp2']:.2f}x | "
            f"{round_ratio[n]:.2f}x | {best[n]:,.0f} | {mib(peak[n][0])} / {mib(peak[n][1])} | {mib(peak_abs[n])} | "
            f"{statistics.median(walls[n]):.0f} | {final[n]:.4f} | {diff[n]:.1e} |"
        )
    lines += [
        "",
        f"**Goal: `ragged_fsdp` faster than the FSDP2 path in the same run. Measured (median step vs median step) "
        f"{ratio:.2f}x: " + ("met" if met else "not met") + f"** (median of per-round ratios "
        f"{round_ratio['ragged_fsdp']:.2f}x; best step vs best step {best['ragged_fsdp'] / best['fsdp2']:.2f}x). "
        "On this shared 2-core machine treat differences under ~10% as noise.",
        "",
        "How each column is measured:",
        "- step: on each rank, wall time from `on_train_batch_start` to `on_train_batch_end` of a Callback "
        "(training_step forward, backward, `optimizer.step()`, zero_grad, and Lightning's per-step hooks); per step "
        "the slower of the two ranks is taken, then the median over all timed steps; rank 0 / rank 1 columns are "
        "each rank's own median. \"per round\": median over rounds of (this strategy's median step in the round / "
        "FSDP2's in the same round). Per-round medians (ms): "
        + "; ".join(f"{n}: " + ", ".join(f"{x:,.0f}" for x in round_med[n]) for n in STRATEGIES)
        + ".",
        "- peak RSS delta: resident-set high-water mark of the rank's process (`getrusage` `ru_maxrss`, read in "
        "`on_train_end`) minus its RSS in `Callback.setup` (before `configure_model` builds the model; after imports, "
        "process-group set-up and the data), median over the fits. It covers every allocation of the process "
        "(the full model built before sharding, parameters, gradients, AdamW state, activations, communication "
        "buffers, gloo threads, allocator caching); with glibc malloc freed memory may stay resident, so it is an "
        "upper bound on live tensor bytes, not the profiler-based live-tensor count of the engine section. "
        "Peak RSS (max) is the absolute high-water mark (imports included), max over ranks and fits.",
        f"- loss: mean of the two ranks' local losses at the last step of the first fit (the fits of one strategy "
        f"agree to {max(spread.values()):.1e}); max abs diff over all {total} steps and fits vs DDP "
        "(same seed, same batches).",
    ]
    return "\n".join(lines)


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "not installed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short smoke run (1 round, 1 warm-up + 2 timed steps)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per fit")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each fit")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--fit-timeout", type=int, default=600, help="seconds per fit")
    parser.add_argument("--no-write", action="store_true", help="print the table, leave RESULTS.md alone")
    parser.add_argument("--json", help="also dump the raw per-fit results to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", choices=STRATEGIES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_fit(args)
        return
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 2, 1
    opts = {"rounds": args.rounds, "steps": args.steps, "warmup": args.warmup, "batch": args.batch, "quick": args.quick}

    load_samples = [os.getloadavg()[0]]
    done = threading.Event()

    def sample_load() -> None:  # the machine is shared: record how busy it was during the run
        while not done.wait(5.0):
            load_samples.append(os.getloadavg()[0])

    threading.Thread(target=sample_load, daemon=True).start()
    started = time.perf_counter()
    fits: dict[str, list[list[dict[str, Any]]]] = {n: [] for n in STRATEGIES}
    walls: dict[str, list[float]] = {n: [] for n in STRATEGIES}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index in range(args.rounds):
            shift = round_index % len(STRATEGIES)
            for name in STRATEGIES[shift:] + STRATEGIES[:shift]:
                ranks, fit_wall = fit_in_subprocess(name, args, Path(tmp) / f"r{round_index}_{name}", args.fit_timeout)
                fits[name].append(ranks)
                walls[name].append(fit_wall)
                step = statistics.median(max(a, b) for a, b in zip(ranks[0]["times"], ranks[1]["times"]))
                print(f"[trainer] round {round_index + 1}/{args.rounds} {name}: median step {step * 1e3:,.0f} ms, "
                      f"final loss {ranks[0]['losses'][-1]:.4f}/{ranks[1]['losses'][-1]:.4f}, fit {fit_wall:.0f} s",
                      flush=True)
    wall = time.perf_counter() - started
    done.set()
    load = (load_samples[0], min(load_samples), statistics.mean(load_samples), max(load_samples))
    markdown = render(fits, walls, opts, load, os.getloadavg()[0], wall)
    print(markdown)
    if args.json:
        Path(args.json).write_text(json.dumps({"fits": fits, "walls": walls, "opts": opts}, indent=1))
    if not args.no_write:
        from report import write_section

        write_section("trainer", markdown, ROOT / "benchmarks" / "RESULTS.md")


if __name__ == "__main__":
    main()
