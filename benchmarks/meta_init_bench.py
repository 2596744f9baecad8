"""Meta-device initialization: the recorded replay vs the structural one, against an eager build.

``python benchmarks/meta_init_bench.py`` runs 2 gloo ranks (1 thread each). For each model, each rank:

* builds it eagerly after ``torch.manual_seed(0)`` (the reference values, and the eager build's time);
* builds it on the meta device inside ``init_record.recording()`` (what ``Trainer.init_module(empty_init=True)``
  does), shards it with ``fully_shard`` and materializes it replaying the recording ("recorded");
* builds it on the meta device by hand and materializes it with the structural replay ("structural").

Reported per rank 0: max |materialized - eager| over the state dict, the peak bytes of whole tensors the
materialization held at once (``MaterializeReport.peak_full_bytes``, counted, not sampled) beside the
largest group's full bytes and the model's, the calls replayed, the writes sent to scratch, and the median
of 3 wall times (build on meta, materialize). Models: ``benchmarks/models.py``'s GPT (17.0M, its
``__init__`` re-initializes every Linear and Embedding after building them, nanoGPT's pattern) and
``transformers``' Llama built from a config (2 layers of width 256) with LoRA adapters injected after the
build (``B`` zero-initialized). The table goes to ``benchmarks/RESULTS.md`` ("meta-init").
"""

from __future__ import annotations

import statistics
from contextlib import nullcontext
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORLD = 2
REPEATS = 3
MIB = 2**20


def build(kind: str) -> nn.Module:
    if kind == "gpt":
        from benchmarks.models import GPT

        return GPT()
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.start_models import add_lora

    return add_lora(LlamaForCausalLM(LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=1024,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)))


def _materialize(kind: str, recorded: bool) -> tuple[dict, float, float, object]:
    import lightning_ragged as lr
    from lightning_ragged.engine.init_record import bind_recordings, recording
    from lightning_ragged.engine.meta_init import materialize_meta_module

    start = time.perf_counter()
    with torch.device("meta"), (recording() if recorded else nullcontext()) as record:
        model = build(kind)
    built = time.perf_counter() - start
    program = bind_recordings(model, [record]) if recorded else None
    lr.fully_shard(model, device="cpu")
    start = time.perf_counter()
    report = materialize_meta_module(model, "cpu", seed=0, program=program)
    materialized = time.perf_counter() - start
    return lr.full_state_dict(model), built, materialized, report


def _worker(rank: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    rows = []
    for kind in ("gpt", "llama_lora"):
        eager_times = []
        for _ in range(REPEATS):
            torch.manual_seed(0)
            start = time.perf_counter()
            eager = build(kind)
            eager_times.append(time.perf_counter() - start)
        expected = {k: v.detach().clone() for k, v in eager.state_dict().items()}
        model_bytes = sum(p.numel() * p.element_size() for p in eager.parameters())
        for recorded in (True, False):
            runs = [_materialize(kind, recorded) for _ in range(REPEATS)]
            full, _, _, report = runs[-1]
            rows.append({
                "model": kind, "path": "recorded" if recorded else "structural",
                "diff": max((full[k].float() - expected[k].float()).abs().max().item() for k in expected),
                "peak": report.peak_full_bytes, "largest_group": report.largest_group_bytes, "model_bytes": model_bytes,
                "calls": report.events, "dead": report.dead_writes, "recorded": report.recorded,
                "build": statistics.median(r[1] for r in runs), "materialize": statistics.median(r[2] for r in runs),
                "eager": statistics.median(eager_times),
            })
    if rank == 0:
        torch.save(rows, out)
    dist.destroy_process_group()


def main() -> None:
    from benchmarks.report import write_section

    out = tempfile.mktemp(suffix=".pt")
    mp.spawn(_worker, args=(tempfile.mktemp(), out), nprocs=WORLD)
    rows = torch.load(out)
    lines = [
        "## Meta-device init: recorded replay vs structural replay vs an eager build",
        "",
        "Written by `benchmarks/meta_init_bench.py` (2 gloo ranks, rank 0's numbers; times: median of "
        f"{REPEATS}). `max diff` is against `torch.manual_seed(0)` + an eager build. `peak whole` is the most bytes "
        "of whole tensors the materialization held at once (counted by `MaterializeReport`), beside the largest "
        "group's full buffer and the whole model.",
        "",
        "| model | replay | max diff vs eager | peak whole | largest group | model | calls | to scratch | build on meta | "
        "materialize | eager build |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['path']} | {r['diff']:.3g} | {r['peak'] / MIB:.2f} MiB | {r['largest_group'] / MIB:.2f} "
            f"MiB | {r['model_bytes'] / MIB:.1f} MiB | {r['calls']} | {r['dead']} | {r['build'] * 1e3:.0f} ms | "
            f"{r['materialize'] * 1e3:.0f} ms | {r['eager'] * 1e3:.0f} ms |"
        )
    lines += [
        "",
        "The structural replay runs `reset_parameters()` and Hugging Face's `_init_weights` as the finished model "
        "suggests: it cannot see the GPT's re-initialization loop or the LoRA injection (the adapters' draws come "
        "in module order, not after the base model's; `B` is not zero), hence its difference from eager. The "
        "recorded replay runs the construction's own calls, so it draws what the eager build drew, in its order, "
        "and each tensor is whole only from its first to its last live call.",
    ]
    write_section("meta-init", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
