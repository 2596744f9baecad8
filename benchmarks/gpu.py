"""The GPU check, one prepared script: parity, step time and memory, copies and collectives on CUDA.

``python benchmarks/gpu.py [--budget-s 420] [--out DIR]`` from the repository root, on a
machine with at least one CUDA device; it plans to finish in under 8 minutes on one H200:

(a) **parity** (fp32, TF32 off): 5 AdamW steps of ragged ``fully_shard`` (both reduce modes)
    against the same model trained in one process on the global batch, at world 1 (NCCL)
    and world 2 (NCCL when there are two GPUs; on one GPU NCCL is tried and, when it refuses
    two ranks on one device, gloo on CUDA tensors); pass: max |difference| <= 1e-5. In bf16
    (``MixedPrecisionPolicy``) ragged's and FSDP2's distances to the fp32 reference, side by side.
    At world 1 the engine issues no collective (its single-rank path), so only world 2 runs the
    comm streams (``engine/streams.py``).
(a') **the comm streams under torch's CUDA sanitizer** (``TORCH_CUDA_SANITIZER=1``, which flags
    kernels of different streams touching one tensor without an event between them), once more at
    world 2 on the backend (a) used there, three cases of ``SANITIZED_STEPS`` AdamW steps:
    ``bf16+keep`` (``keep_cast_shard=True``: the kept cast made on compute, read by the all-gather
    stream, dropped at the optimizer step) against the same sharded run with it off: pass when
    bitwise equal; ``fp32+fp8`` (``fp8_all_gather``: quantize on the all-gather stream, the full
    buffer allocated and dequantized on compute at the wait) against one process whose Linear weights
    are fake-quantized per tile before each forward (``tests/test_fp8_gather.py``'s oracle): pass when
    every weight gathered before training equals the oracle bit for bit and the parameters after
    training are within ``FP8_TOLERANCE``; ``fp32+hook`` (``set_all_reduce_hook`` on a stream of its own,
    a hook doubling and halving each reduced segment in place: exact) against one process at
    ``PARITY_TOLERANCE``; ``fp32+meta`` (FSDP2's meta-device flow: built on the meta device, sharded in FSDP2's
    order with a list ``[ln_f, head]`` and a mesh but no ``device=``, ``to_empty``, the reference's weights
    written inside ``summon_full_params``) against one process: the shards must land on the CUDA device, equal
    the reference bitwise before training and within ``PARITY_TOLERANCE`` after it. A sanitizer report fails its case (its error is the
    verdict, with the sanitizer's first reports). The sanitizer sees a collective read its inputs and write
    the tensors it returns (the c10d ops return their outputs), on the stream it was issued on, so it checks
    the kernels around the collectives (casts, quantize, dequantize, the optimizer, gradients) and a read of
    a gathered buffer before its wait (keyed by storage, not by ``data_ptr()``: a parameter is a view at an
    offset of its DBuffer's buffer, which torch's keys would not match; ``_sanitize_whole_storages``); ``tests/test_streams.py`` checks the same order on CPU. Both cases run
    with ``torch.use_deterministic_algorithms(True, warn_only=True)`` and ``CUBLAS_WORKSPACE_CONFIG=:4096:8``
    (the bitwise verdict must not depend on a non-deterministic kernel). On CPU (``--dry-run``) the cases
    run without the sanitizer.
(b) **step time and memory**: ragged vs FSDP2 vs DDP on a ~1.1B-parameter Llama built from a
    transformers ``LlamaConfig`` (random init, nothing downloaded), bf16 compute with fp32
    master weights (DDP: fp32 weights under bf16 autocast), fused AdamW, one process per GPU.
    One variant is alive at a time (built fresh each round, so its memory is its own; the memory
    allocated before each build is reported); rounds rotate the order. On one GPU this is world 1:
    ragged takes its single-rank path and FSDP2 skips its collectives too, DDP still all-reduces, so
    the comparison is each framework's overhead on one device, not sharding or overlap. Reported: median
    step time with the spread, ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` over the
    timed steps.
(c) **copies and collectives** of one forward+backward of each variant (and of the plain model):
    bytes written by copy-like operators (``CopyCounter``) and collectives (``CollectiveCounter``: what
    ``CommDebugMode`` counts and point-to-point sends, without its module tracker, which fails on
    transformers' hub-kernel layers).

It writes the ``gpu`` section of ``benchmarks/RESULTS.md`` (``report.write_section``) and,
with ``--out DIR``, ``gpu.md`` and ``gpu.json`` there, rewritten after every phase; every rank
saves its results after every case and variant, so a phase killed at its limit, or a variant that
raised, still leaves what finished (a case that failed on any rank is reported as that rank's error).
Without a CUDA device it stops at once (exit 2). ``--dry-run`` runs the same code on CPU with gloo
and tiny models, end to end, and writes nowhere but ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from models import GPTConfig, lm_loss, make_batches, make_gpt  # noqa: E402
from report import write_section  # noqa: E402

VARIANTS = ("ragged", "fsdp2", "ddp")
PARITY_STEPS = 5
PARITY_TOLERANCE = 1e-5
PARITY_CASES = ("ragged/fp32/reduce_scatter", "ragged/fp32/all_reduce", "ragged/bf16/reduce_scatter", "fsdp2/bf16/-",
                "ragged/fp16/reduce_scatter", "fsdp2/fp16/-")
"""fp16: fp16 gathers and compute with torch's ShardedGradScaler (what ``precision="16-mixed"`` runs)."""
SANITIZED_CASES = ("ragged/bf16+keep/reduce_scatter", "ragged/fp32+fp8/reduce_scatter",
                   "ragged/fp32+hook/reduce_scatter", "ragged/fp32+meta/reduce_scatter")
SANITIZED_STEPS = 3  # the sanitizer records a stack at each kernel: short, to stay inside the phase limit
FP8_TOLERANCE = 1e-5  # as fp32 parity: the oracle quantizes the same masters, rounding order aside
# TinyLlama-1.1B's shape: 1,100,048,384 parameters (untied head).
LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)
LLAMA_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False)
GPT_PARITY = dict(vocab=4096, width=256, layers=4, heads=4, seq=128)
GPT_TINY = dict(vocab=1024, width=32, layers=2, heads=2, seq=16)  # make_batches uses 512 of the tokens
NO_CUDA = ("benchmarks/gpu.py: no CUDA device (torch.cuda.is_available() is False); run it on a GPU machine, "
           "or pass --dry-run to run the same code on CPU with tiny models")


# --------------------------------------------------------------------------- processes
def _launch(
    fn: Callable, world: int, payload: dict, limit_s: float, env: dict[str, str] | None = None
) -> tuple[dict | None, str | None]:
    """Run ``fn(rank, world, init_file, payload, out)`` on ``world`` fresh processes; (each rank's result, error).

    A result is what that rank saved last (:func:`_save`), None where it saved nothing; the error says why
    the processes ended early (killed at ``limit_s``, raised, exited), None when they finished.

    ``env``: variables the processes start with (read when they import torch), this process's restored after.
    """
    handle, out = tempfile.mkstemp(prefix="ragged_gpu_out_")
    os.close(handle)
    init_file = out + ".init"
    args = (world, init_file, payload, out)
    saved = {name: os.environ.get(name) for name in env or {}}
    os.environ.update(env or {})
    try:
        context = mp.start_processes(fn, args=args, nprocs=world, join=False, start_method="spawn")
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value
    deadline = time.monotonic() + limit_s
    error = None
    try:
        while not context.join(timeout=2):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                error = f"killed after {limit_s:.0f} s"
                break
    except mp.ProcessRaisedException as raised:
        lines = [line for line in str(raised).splitlines() if line.strip()]
        error = lines[-1][:300] if lines else "raised"
    except mp.ProcessExitedException as exited:
        error = str(exited)[:300]
    try:
        return [_load_partial(f"{out}.{rank}") for rank in range(world)], error
    finally:
        for path in (out, init_file, *(f"{out}.{rank}{tmp}" for rank in range(world) for tmp in ("", ".tmp"))):
            if os.path.exists(path):
                os.remove(path)


def _load_partial(path: str) -> dict | None:
    """What a rank saved last (:func:`_save`), or None: nothing saved."""
    try:
        return torch.load(path, weights_only=False)
    except Exception:  # noqa: BLE001 - a partial result is optional
        return None


def _save(obj: Any, out: str, rank: int) -> None:
    """This rank's results so far, replaced in one rename (a kill leaves the previous save whole)."""
    torch.save(obj, f"{out}.{rank}.tmp")
    os.replace(f"{out}.{rank}.tmp", f"{out}.{rank}")


def _init(rank: int, world: int, init_file: str, payload: dict) -> torch.device:
    if payload["device"] == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    bind = {"device_id": device} if payload["backend"] == "nccl" else {}
    # shorter than the phase's limit: a rank left waiting by a peer's failed case raises before the kill
    dist.init_process_group(payload["backend"], init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=payload.get("pg_timeout_s", 120)), **bind)
    return device


def _first_line(error: BaseException) -> str:
    """The error's type and first line; a CUDA sanitizer report (``str`` says only how many) with its first two."""
    text = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:240]}"
    reports = getattr(error, "errors", None)
    if isinstance(reports, list):
        text += "".join(" | " + " ".join(str(report).split())[:600] for report in reports[:2])
    return text


# --------------------------------------------------------------------------- (a) parity
def _sanitize_whole_storages() -> None:
    """Make torch's CUDA sanitizer key every access by its storage's start, not the tensor's ``data_ptr()``.

    It records a collective's write of the full buffer at the buffer's start, and a kernel reading a
    parameter view at offset k under another key: a read of any view but the first before the wait for
    the all-gather (or a gradient view written after the reduction was issued) went unseen. Keyed by
    storage, every view of a DBuffer's buffer is one tensor to it. Stricter than torch's own keys: two
    streams touching disjoint parts of one storage would be reported too; the engine has no such access
    (``engine/streams.py``, rule 3), so a report is a real ordering question.
    """
    from torch.cuda import _sanitizer

    def by_storage(self: Any, value: Any, is_write: bool, metadata_only: bool, name: str | None = None,
                   is_output: bool = False) -> None:
        if not (isinstance(value, torch.Tensor) and value.is_cuda):
            return
        start = value.untyped_storage().data_ptr()
        key = start if start else id(value)  # empty tensors: never one key for two of them
        if is_write:
            self.dataptrs_written.add(key)
        elif not metadata_only:
            self.dataptrs_read.add(key)
        self.tensor_aliases.setdefault(key, [])
        if name is not None:
            self.tensor_aliases[key].append(name)
        if is_output:
            self.outputs.add(key)

    _sanitizer.ArgumentHandler._handle_argument = by_storage


def parity_worker(rank: int, world: int, init_file: str, payload: dict, out: str) -> None:
    device = _init(rank, world, init_file, payload)
    if os.environ.get("TORCH_CUDA_SANITIZER"):
        _sanitize_whole_storages()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if payload.get("deterministic"):
        torch.use_deterministic_algorithms(True, warn_only=True)
    cfg = GPTConfig(**payload["gpt"])
    data = make_batches(payload["steps"], payload["batch"] * world, cfg).to(device)
    cases = {}
    for case in payload["cases"]:
        try:
            cases[case] = _parity_case(case, cfg, data, rank, world, device, payload["fp8_tile"])
        except Exception as error:  # noqa: BLE001 - per case (a collective gloo lacks, a sanitizer report)
            cases[case] = {"error": _first_line(error)}
        _save({"cases": cases}, out, rank)  # every rank: a case can fail on one rank only (a sanitizer report)
        if "error" in cases[case]:
            break  # its peers may be inside a collective it left: the next case would not pair up
    dist.destroy_process_group()


def _parity_case(
    case: str, cfg: GPTConfig, data: torch.Tensor, rank: int, world: int, device: torch.device, tile: int
) -> dict:
    """Max |difference| of all parameters after ``len(data)`` AdamW steps between the sharded model and its
    oracle: one process on the global batch (fp32+fp8: its Linear weights fake-quantized for each forward),
    or, for bf16+keep, the same sharding with ``keep_cast_shard`` off. fp8: are the weights gathered before
    training the oracle's, bit for bit."""
    import lightning_ragged as lr
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    variant, precision, mode = case.split("/")
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision.split("+")[0])
    policy = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32) if half is not None else None
    scaler = ShardedGradScaler(device.type) if precision == "fp16" else None
    knobs = {"bf16+keep": dict(keep_cast_shard=True), "fp32+fp8": dict(fp8_all_gather=lr.Float8AllGather(tile=tile))}
    reference = make_gpt(cfg).to(device)
    outcome: dict[str, Any] = {}
    if precision == "fp32+meta":
        model = _meta_flow(cfg, device, world, mode, reference, outcome)
    else:
        model = make_gpt(cfg).to(device)
        if variant == "ragged":
            lr.fully_shard(model, mp_policy=policy, reduce_mode=mode, device=device, **knobs.get(precision, {}))
        else:
            for block in model.blocks:
                fsdp2_shard(block, mp_policy=policy)
            fsdp2_shard(model, mp_policy=policy)
    if precision == "fp32+hook":  # the hook's kernels on a stream of its own, between the reduction and its use
        stream = torch.Stream(device=device) if device.type == "cuda" else None
        for module in (m for m in model.modules() if isinstance(m, lr.FSDPModule)):
            module.set_all_reduce_hook(lambda reduced: reduced.mul_(2.0).div_(2.0), stream=stream)
    sharded_reference = precision == "bf16+keep"
    if sharded_reference:
        lr.fully_shard(reference, mp_policy=policy, reduce_mode=mode, device=device)
    fp8_names = set()
    if precision == "fp32+fp8":
        fp8_names = {n for b in lr.get_state(model).dbuffers() if b.fp8_gather is not None for n in b.sharded_params}
        outcome["gathered_exact"] = _gathered_exact(model, reference, fp8_names, tile)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    per_rank = data.shape[1] // world
    for step in range(data.shape[0]):
        local = data[step, rank * per_rank : (rank + 1) * per_rank]
        loss = lm_loss(model, local)
        (loss if scaler is None else scaler.scale(loss)).backward()
        if sharded_reference:
            lm_loss(reference, local).backward()
        else:
            with _fake_quantized(reference, fp8_names, tile):
                # the global batch's mean loss as the ranks' equal shares (same value, closer rounding order)
                sum(lm_loss(reference, share) for share in data[step].chunk(world)).div(world).backward()
        for optimizer in optimizers:
            if scaler is not None and optimizer is optimizers[0]:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    if scaler is not None:
        outcome["final_scale"] = scaler.get_scale()
    if variant == "ragged":
        full = lr.full_state_dict(model)
    else:
        full = {key: value.full_tensor() for key, value in model.state_dict().items()}
    expected = lr.full_state_dict(reference) if sharded_reference else reference.state_dict()
    outcome["max_diff"] = max((full[key].float() - expected[key].float()).abs().max().item() for key in expected)
    return outcome


def _meta_flow(cfg: GPTConfig, device: torch.device, world: int, mode: str, reference: nn.Module,
               outcome: dict) -> nn.Module:
    """FSDP2's meta-device flow: built on meta, sharded in FSDP2's order (a list among the calls) over a mesh with
    no ``device=``, ``to_empty``, then ``reference``'s weights written inside ``summon_full_params``."""
    import lightning_ragged as lr
    from torch.distributed.device_mesh import init_device_mesh

    with torch.device("meta"):
        model = make_gpt(cfg)
    mesh = init_device_mesh(device.type, (world,))
    for module in [*model.blocks, [model.ln_f, model.head], model]:
        lr.fully_shard(module, mesh=mesh, reduce_mode=mode)
    model.to_empty(device=device)
    outcome["shard_device"] = str(next(model.parameters()).device)
    with lr.summon_full_params(model), torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(reference.get_parameter(name))
    initial = lr.full_state_dict(model)
    outcome["init_exact"] = all(torch.equal(initial[key], value) for key, value in reference.state_dict().items())
    return model


@contextmanager
def _fake_quantized(model: nn.Module, names: set[str], tile: int) -> Iterator[None]:
    """For a forward and backward, the weights ``names`` (of the unsharded ``model``) as their per-tile fp8
    quantize-dequantize; the masters restored after, the gradients kept (straight-through)."""
    if not names:
        yield
        return
    from tests.test_fp8_gather import reference_fake_quant

    params = dict(model.named_parameters())
    masters = {name: params[name].detach().clone() for name in names}
    with torch.no_grad():
        for name in names:
            params[name].copy_(reference_fake_quant(masters[name], tile, torch.float8_e4m3fn, torch.float32)[0])
    try:
        yield
    finally:
        with torch.no_grad():
            for name in names:
                params[name].copy_(masters[name])


def _gathered_exact(model: nn.Module, reference: nn.Module, names: set[str], tile: int) -> bool:
    """Every fp8 weight as the sharded model's all-gather writes it, against the oracle on the same masters."""
    from tests.test_fp8_gather import reference_fake_quant

    import lightning_ragged as lr

    masters = dict(reference.named_parameters())
    exact = bool(names)
    for dbuffer in lr.get_state(model).dbuffers():
        if dbuffer.fp8_gather is None:
            continue
        dbuffer.unshard()
        for name, full in dbuffer.unsharded_params.items():
            expected = reference_fake_quant(masters[name].detach(), tile, torch.float8_e4m3fn, torch.float32)[0]
            exact = exact and torch.equal(full.detach(), expected)
        dbuffer.reshard()
    return exact


# --------------------------------------------------------------------------- (b), (c) Llama
def _build(variant: str, config: Any, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A fresh, identically seeded Llama wrapped by ``variant`` ("local": unwrapped), and fused AdamW."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as fsdp2_shard
    from transformers import LlamaForCausalLM

    import lightning_ragged as lr

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if variant == "ragged":
        lr.fully_shard(model, mp_policy=policy, device=device)
    elif variant == "fsdp2":
        for layer in model.model.layers:
            fsdp2_shard(layer, mp_policy=policy)
        fsdp2_shard(model, mp_policy=policy)
    elif variant == "ddp":
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")


def _forward_backward(variant: str, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    autocast = torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=variant in ("ddp", "local"))
    with autocast:
        logits = model(input_ids=tokens[:, :-1]).logits
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach()


def _step(variant: str, model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    _forward_backward(variant, model, tokens)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _count(variant: str, model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> dict:
    """Copies and collectives of one forward+backward (after warm-up), and for ragged its engine counters."""
    from lightning_ragged.observability.collective_counter import CollectiveCounter
    from lightning_ragged.observability.copy_counter import CopyCounter

    optimizer.zero_grad(set_to_none=True)
    with CollectiveCounter() as comm, CopyCounter() as copies:
        _forward_backward(variant, model, tokens)
    result = {
        "copy_bytes": copies.total_bytes,
        "copy_by_op": dict(copies.by_op),
        "collectives": comm.total,
        "collectives_by_op": dict(comm.by_op),
    }
    optimizer.zero_grad(set_to_none=True)
    if variant == "ragged":
        import lightning_ragged as lr
        from lightning_ragged.observability.metrics import EngineMetrics

        stats = lr.get_state(model).stats
        stats.reset()
        metrics = EngineMetrics(model)
        _step(variant, model, optimizer, tokens)
        metrics.end_step()
        _sync(next(model.parameters()).device)  # the timing events are read when complete: all of them now
        names = ("all_gathers", "all_gather_bytes", "reduces", "reduce_bytes")
        result["engine_stats"] = {name: getattr(stats, name) for name in names}
        result["engine_metrics"] = {k: float(v) for k, v in metrics.compute(per_group=False).items()}
        metrics.close()
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_worker(rank: int, world: int, init_file: str, payload: dict, out: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    device = _init(rank, world, init_file, payload)
    deadline = payload["deadline"]  # wall clock, set by the launcher: this process's start-up counts against it
    config = LlamaConfig(**payload["llama"], use_cache=False)
    with torch.device("meta"):
        params = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    generator = torch.Generator().manual_seed(1 + rank)
    tokens = torch.randint(0, config.vocab_size, (payload["batch"], payload["seq"] + 1), generator=generator).to(device)
    rows = {v: {"times": [], "max_allocated": 0, "max_reserved": 0, "build_s": [], "allocated_before": []}
            for v in VARIANTS}
    counts: dict[str, Any] = {}
    notes: list[str] = []
    result = {"rows": rows, "counts": counts, "notes": notes, "params": params}
    round_s = 0.0
    for round_index in range(payload["rounds"]):
        if round_index and time.time() + round_s > deadline:
            notes.append(f"stopped after {round_index} rounds: the next would pass the time budget")
            break
        started = time.time()
        order = VARIANTS[round_index % 3 :] + VARIANTS[: round_index % 3]
        for variant in order:
            if "error" in rows[variant]:
                continue
            try:
                _bench_variant(variant, config, device, tokens, payload, rows[variant], counts, round_index == 0)
            except Exception as error:  # noqa: BLE001 - one variant's failure (OOM, an API) keeps the others' rows
                rows[variant]["error"] = _first_line(error)
            _free(device)
            _save(result, out, rank)
        round_s = time.time() - started
    if time.time() + round_s / 3 < deadline:
        model, optimizer = _build("local", config, device)
        _step("local", model, optimizer, tokens)
        counts["local"] = _count("local", model, optimizer, tokens)
        del model, optimizer
        _free(device)
    else:
        notes.append("plain-model copy count skipped: time budget")
    _save(result, out, rank)
    dist.destroy_process_group()


def _bench_variant(
    variant: str, config: Any, device: torch.device, tokens: torch.Tensor, payload: dict, row: dict,
    counts: dict, count: bool,
) -> None:
    """One round of ``variant``: build it fresh, warm up, time ``steps`` steps, its peak memory (and counts)."""
    cuda = device.type == "cuda"
    if cuda:
        row["allocated_before"].append(torch.cuda.memory_allocated(device))  # what earlier variants left behind
    built = time.perf_counter()
    model, optimizer = _build(variant, config, device)
    row["build_s"].append(time.perf_counter() - built)
    for _ in range(payload["warmup"]):
        _step(variant, model, optimizer, tokens)
    _sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()
    timed = time.perf_counter()
    for _ in range(payload["steps"]):
        _step(variant, model, optimizer, tokens)
    _sync(device)
    row["times"].append((time.perf_counter() - timed) / payload["steps"])
    if cuda:
        row["max_allocated"] = max(row["max_allocated"], torch.cuda.max_memory_allocated(device))
        row["max_reserved"] = max(row["max_reserved"], torch.cuda.max_memory_reserved(device))
    if count:
        counts[variant] = _count(variant, model, optimizer, tokens)


# --------------------------------------------------------------------------- driving and report
def run(args: argparse.Namespace, progress: Callable[[dict], None] = lambda result: None) -> dict:
    """Every phase in turn; ``progress(result)`` after each, with what is known so far."""
    started = time.monotonic()
    dry = args.dry_run
    device = "cpu" if dry else "cuda"
    gpus = 0 if dry else torch.cuda.device_count()
    gpt = GPT_TINY if dry else GPT_PARITY
    common = {"device": device, "gpt": gpt, "batch": 4, "cases": PARITY_CASES, "steps": PARITY_STEPS,
              "fp8_tile": 8 if dry else 128, "pg_timeout_s": 30}
    world = 1 if dry else max(1, gpus)
    meta = {
        "dry_run": dry, "world": world, "torch": torch.__version__, "cuda": torch.version.cuda,
        "python": platform.python_version(), "wall_s": 0.0,
        "device_name": torch.cuda.get_device_name(0) if gpus else platform.processor() or platform.machine(),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpus else None, "payload": None,
    }
    result = {"meta": meta, "parity": [], "bench": None, "bench_error": "not run yet"}
    nccl_env = {} if dry or "NCCL_DEBUG" in os.environ else {"NCCL_DEBUG": "WARN"}  # why an NCCL init failed

    def report() -> None:
        meta["wall_s"] = time.monotonic() - started
        progress(result)

    def parity_run(world: int, backend: str, why: str, limit_s: float = args.phase_limit_s, **extra: Any) -> str | None:
        env = {**nccl_env, **extra.pop("env", {})}
        payload = {**common, "backend": backend, **extra}
        ranks, error = _launch(parity_worker, world, payload, limit_s, env)
        result["parity"].append({"world": world, "backend": backend, "why": why, "error": error,
                                 "expected": list(payload["cases"]), "cases": _merge_cases(ranks)})
        report()
        return error

    parity_run(1, "gloo" if dry else "nccl", "one process")
    if dry:
        parity_run(2, "gloo", "CPU dry run")
    elif gpus >= 2:
        parity_run(2, "nccl", "two GPUs")
    elif parity_run(2, "nccl", "two ranks on one GPU", limit_s=min(45.0, args.phase_limit_s)) is not None:
        parity_run(2, "gloo", "NCCL refused two ranks on one GPU: gloo on CUDA tensors")
    sanitized = ("(a') keep_cast_shard, fp8, hook stream, meta flow: no sanitizer on CPU" if dry
                 else "(a') keep_cast_shard, fp8, hook stream, meta flow under TORCH_CUDA_SANITIZER=1")
    parity_run(2, result["parity"][-1]["backend"], sanitized, cases=SANITIZED_CASES, steps=SANITIZED_STEPS,
               deterministic=True,
               env={} if dry else {"TORCH_CUDA_SANITIZER": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    budget = max(30.0, args.budget_s - (time.monotonic() - started))
    payload = meta["payload"] = {
        "device": device, "backend": "gloo" if dry else "nccl", "world": world, "budget_s": budget,
        "deadline": time.time() + budget,
        "llama": LLAMA_TINY if dry else LLAMA_1B, "batch": 2 if dry else args.batch, "seq": 32 if dry else args.seq,
        "rounds": 2 if dry else args.rounds, "steps": 2 if dry else args.steps, "warmup": 1 if dry else 2,
    }
    # the bench's first round always runs whole; its kill keeps the script inside --hard-limit-s (8 minutes)
    limit = min(budget + 45, max(60.0, args.hard_limit_s - (time.monotonic() - started)))
    ranks, result["bench_error"] = _launch(bench_worker, world, payload, limit, nccl_env)
    result["bench"] = ranks[0]  # rank 0's timings and memory (every rank runs the same steps)
    report()
    return result


def _merge_cases(ranks: list[dict | None]) -> dict:
    """Rank 0's parity outcome per case (its difference is every rank's: the full parameters), unless ranks
    reported errors there (all of them: one rank's failure makes its peers' collectives fail too)."""
    saved = [r["cases"] for r in ranks if r is not None]
    cases: dict = {}
    for case in (saved[0] if saved else {}):
        outcomes = [(rank, r.get(case)) for rank, r in enumerate(saved)]
        failed = [(rank, o) for rank, o in outcomes if o is not None and "error" in o]
        errors = "; ".join(f"rank {rank}: {outcome['error'][:300]}" for rank, outcome in failed)
        cases[case] = {"error": errors} if failed else saved[0][case]
    return cases


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n else "n/a"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if a and b else "n/a"


def _verdict(case: str, outcome: dict, cases: dict) -> str:
    """fp32: against the tolerance; keep_cast_shard: bitwise; fp8: gathered bitwise and trained within its tolerance;
    ragged bf16 / fp16: its distance as a multiple of FSDP2's on the same run."""
    if "/fp32/" in case or "/fp32+hook/" in case:
        return "pass" if outcome["max_diff"] <= PARITY_TOLERANCE else "FAIL"
    if "/fp32+meta/" in case:
        passed = outcome["init_exact"] and outcome["max_diff"] <= PARITY_TOLERANCE
        return ("pass" if passed else "FAIL") + f" (initialized bitwise: {outcome['init_exact']}, shards on " \
            f"{outcome['shard_device']})"
    if "/bf16+keep/" in case:
        return "pass (bitwise)" if outcome["max_diff"] == 0 else "FAIL (not bitwise)"
    if "/fp32+fp8/" in case:
        passed = outcome["gathered_exact"] and outcome["max_diff"] <= FP8_TOLERANCE
        return ("pass" if passed else "FAIL") + f" (gathered bitwise: {outcome['gathered_exact']})"
    dtype = case.split("/")[1]
    fsdp2 = cases.get(f"fsdp2/{dtype}/-", {}).get("max_diff")
    if case.startswith("ragged/") and fsdp2:
        return f"{outcome['max_diff'] / fsdp2:.2f} x FSDP2's distance"
    return f"FSDP2's own {dtype} distance"


def _parity_lines(parity: list[dict]) -> list[str]:
    lines = [
        f"### (a) Parity: {PARITY_STEPS} AdamW steps vs one process on the global batch "
        f"(benchmark GPT; fp32 without TF32 passes at <= {PARITY_TOLERANCE:g}; bf16 and fp16 (ShardedGradScaler) "
        f"against the fp32 reference); "
        f"(a') {SANITIZED_STEPS} steps: bf16+keep against keep_cast_shard off, fp32+fp8 against fake-quantized weights, "
        "fp32+hook (an all-reduce hook on its own stream) against one process, fp32+meta (built on the meta "
        "device, FSDP2's calls with a list, to_empty, the reference's weights written inside summon_full_params) "
        "against one process",
        "",
        "| world | backend | why | case | max abs difference | |",
        "|---:|---|---|---|---:|---|",
    ]
    for run_ in parity:
        where = f"| {run_['world']} | {run_['backend']} | {run_['why']} |"
        if run_["error"]:
            lines.append(f"{where} (all) | - | failed: `{run_['error']}` |")
        for case, outcome in run_["cases"].items():
            if "error" in outcome:
                lines.append(f"{where} {case} | - | `{outcome['error']}` |")
            else:
                verdict = _verdict(case, outcome, run_["cases"])
                lines.append(f"{where} {case} | {outcome['max_diff']:.2e} | {verdict} |")
        for case in run_["expected"]:
            if case not in run_["cases"]:
                lines.append(f"{where} {case} | - | not run (an earlier case failed, or the phase ended first) |")
    return lines


def _bench_lines(bench: dict, payload: dict) -> list[str]:
    rows, counts = bench["rows"], bench["counts"]
    median = {v: statistics.median(rows[v]["times"]) if rows[v]["times"] else 0.0 for v in VARIANTS}
    rounds = max(len(rows[v]["times"]) for v in VARIANTS)
    left = max((n for v in VARIANTS for n in rows[v]["allocated_before"]), default=0)
    lines = [
        "",
        f"{bench['params']:,} parameters; {rounds} rounds rotating the order, each variant "
        "built fresh per round (alone in memory"
        + (f": at most {_gib(left) if left else '0 GiB'} allocated before a build"
           if payload["device"] == "cuda" else "")
        + "), "
        f"{payload['warmup']} warm-up + {payload['steps']} timed steps; memory is the peak over the timed steps."
        + (" World 1: ragged and FSDP2 skip their collectives, DDP runs its all-reduce, "
           "so this compares each framework's overhead on one device, not sharding or overlap."
           if payload["world"] == 1 else ""),
        "",
        "| variant | median step | spread | vs FSDP2 | vs DDP | max allocated | vs FSDP2 | max reserved | vs FSDP2 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    fsdp2 = rows["fsdp2"]
    for v in VARIANTS:
        r, times = rows[v], rows[v]["times"]
        spread = f"{min(times) * 1e3:.1f}-{max(times) * 1e3:.1f} ms" if times else "-"
        lines.append(
            f"| {v} | {f'{median[v] * 1e3:.1f} ms' if times else '-'} | {spread} "
            f"| {_ratio(median[v], median['fsdp2'])} "
            f"| {_ratio(median[v], median['ddp'])} | {_gib(r['max_allocated'])} "
            f"| {_ratio(r['max_allocated'], fsdp2['max_allocated'])} | {_gib(r['max_reserved'])} "
            f"| {_ratio(r['max_reserved'], fsdp2['max_reserved'])} |"
        )
    lines += [
        "",
        "### (c) One forward+backward: bytes written by copy-like operators (`CopyCounter`), "
        "collectives as `CollectiveCounter` sees them (`CommDebugMode`'s ops and point-to-point sends)",
        "",
        "| variant | copy bytes | collectives | by operator |",
        "|---|---:|---:|---|",
    ]
    for v, c in counts.items():
        ops = ", ".join(f"{op.split('.')[-1]} {n}" for op, n in sorted(c["collectives_by_op"].items())) or "-"
        name = "plain model (bf16 autocast)" if v == "local" else v
        lines.append(f"| {name} | {c['copy_bytes'] / 2**20:,.1f} MiB | {c['collectives']} | {ops} |")
    if "ragged" in counts:
        s = counts["ragged"]["engine_stats"]
        lines += [
            "",
            f"Ragged engine, one step: {s['all_gathers']} all-gathers ({s['all_gather_bytes'] / 2**20:,.1f} MiB), "
            f"{s['reduces']} reductions ({s['reduce_bytes'] / 2**20:,.1f} MiB).",
        ]
    errors = [f"{v} failed: `{rows[v]['error']}`" for v in VARIANTS if "error" in rows[v]]
    return lines + [f"- {note}" for note in bench["notes"] + errors]


def render(result: dict) -> str:
    meta, payload = result["meta"], result["meta"]["payload"]
    dry = " (CPU dry run: not GPU numbers)" if meta["dry_run"] else ""
    lines = [
        f"## GPU: ragged fully_shard vs FSDP2 vs DDP on CUDA{dry}",
        "",
        f"Written by `benchmarks/gpu.py{' --dry-run' if meta['dry_run'] else ''}` on {time.strftime('%Y-%m-%d')}: "
        f"{meta['world']} x {meta['device_name']}, torch {meta['torch']}, CUDA {meta['cuda']}, NCCL {meta['nccl']}, "
        f"Python {meta['python']}; wall {meta['wall_s']:.0f} s.",
        "",
        *_parity_lines(result["parity"]),
        "",
        "### (b) Llama from config: bf16 compute / fp32 master, fused AdamW"
        + (f", batch {payload['batch']} x seq {payload['seq']} per rank" if payload else ""),
    ]
    if result["bench"] is None:
        return "\n".join(lines + ["", f"Not measured: `{result['bench_error']}`."])
    stopped = [f"- the bench process ended early: `{result['bench_error']}`"] if result["bench_error"] else []
    return "\n".join(lines + _bench_lines(result["bench"], payload) + stopped)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="the same code on CPU, gloo, tiny models (writes only --out)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="wall-clock plan for the run (rounds stop early)")
    parser.add_argument("--phase-limit-s", type=float, default=90.0, help="a parity phase is killed after this long")
    parser.add_argument("--hard-limit-s", type=float, default=465.0,
                        help="the bench is killed so that the whole script ends by then (what it finished is kept)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=None, help="also write gpu.md and gpu.json into this folder")
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        raise SystemExit(2)
    def write_out(result: dict) -> None:  # after every phase: a run cut short still leaves its results
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "gpu.md").write_text(render(result) + "\n")
            (args.out / "gpu.json").write_text(json.dumps(result, indent=1, default=str))

    result = run(args, write_out)
    markdown = render(result)
    print(markdown)
    if not args.dry_run:
        write_section("gpu", markdown, ROOT / "benchmarks" / "RESULTS.md")


if __name__ == "__main__":
    main()
