"""Refuse bad ``RaggedFSDPStrategy`` arguments in its constructor, before any process starts.

Without this a bad knob surfaced seconds later, after the processes were launched, inside
``fit`` (or never: ``async_checkpoint="no"`` is truthy). :func:`check_strategy_knobs` checks
every keyword-only knob of ``RaggedFSDPStrategy.__init__`` (type and range) and every
``**kwargs`` key (only parameters of :func:`lightning_ragged.fully_shard` that the strategy
does not set itself; a typo gets the closest name). Each refusal is one ``TypeError`` (wrong
type) or ``ValueError`` (wrong value) that names the parameter, the value and what to pass
instead, e.g.::

    RaggedFSDPStrategy(monitor_port='8080'): a port must be an int, not a str; pass monitor_port=8080

Checks that need the world size or the model (``replicate_degree`` dividing the world,
``reshard_after_forward`` dividing the shard group, class names in ``group_modules``) stay
in ``setup``. The choices come from the engine (``granularity.POLICIES``,
``layout.planner.ALGORITHMS``, ``collectives.REDUCE_MODES``, ``GATHER_MODES``) and its own checks are reused.
"""

from __future__ import annotations

import collections.abc
import difflib
import inspect
import math
import reprlib
from datetime import timedelta
from typing import Any, Callable, Mapping, NoReturn, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_ragged.engine.collectives import GATHER_MODES, REDUCE_MODES
from lightning_ragged.engine.api import fully_shard
from lightning_ragged.engine.fsdp2_args import UNSUPPORTED
from lightning_ragged.engine.fp8_gather import check_fp8_all_gather
from lightning_ragged.layout.granularity import POLICIES, check_block_rows, check_policy
from lightning_ragged.engine.grouping import _check_dbuffer_size
from lightning_ragged.layout.planner import ALGORITHMS

SET_BY_STRATEGY = {
    "module": "the strategy shards the LightningModule given to Trainer.fit",
    "process_group": "the strategy builds the process groups: use replicate_degree=... for HSDP",
    "replicate_group": "the strategy builds the process groups: use replicate_degree=... for HSDP",
    "mp_policy": "the strategy takes it from the precision: pass L.Trainer(precision='bf16-mixed') (or 'bf16-true')",
    "device": "the strategy places the shards on the Trainer's devices: pass L.Trainer(accelerator=..., devices=...)",
    "mesh": "the strategy builds the process groups from the Trainer's devices and nodes: use replicate_degree=... "
            "for HSDP",
    **UNSUPPORTED,
}
"""Parameters of ``fully_shard`` the strategy passes itself (``**kwargs`` must not repeat them), with the fix."""

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80
_TRUE_WORDS = ("true", "yes", "on", "1", "y", "t")


class _Refused(Exception):
    def __init__(self, error: type[Exception], problem: str, fix: str) -> None:
        super().__init__(problem)
        self.error, self.problem, self.fix = error, problem, fix


def _refuse(problem: str, fix: str, error: type[Exception] = ValueError) -> NoReturn:
    raise _Refused(error, problem, fix)


def _engine_check(check: Callable[[Any], None], value: Any) -> None:
    """Run one of the engine's own validators; its message already names the value and the fix."""
    try:
        check(value)
    except ValueError as error:
        _refuse(str(error), "")


def _closest(word: str, choices: Any) -> str:
    match = difflib.get_close_matches(word.lower(), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _type_name(value: Any) -> str:
    return type(value).__name__


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _choice(name: str, value: Any, choices: tuple, default: str) -> None:
    if not isinstance(value, str):
        _refuse(f"must be one of {choices}, got {_type_name(value)}", f"pass e.g. {name}={default!r}", TypeError)
    if value not in choices:
        _refuse(f"is not supported{_closest(value, choices)}", f"use one of {choices}")


# ------------------------------------------------------------------- one check per knob
def _shard_granularity(value: Any) -> None:
    if isinstance(value, str):
        try:
            check_policy(value)  # the engine's message lists the choices
        except ValueError as error:
            _refuse(str(error), _closest(value, POLICIES).strip(" ()"))
        return
    if not callable(value):
        choices = ", ".join(repr(p) for p in POLICIES)
        _refuse(f"must be a policy name or a callable, got {_type_name(value)}",
                f"pass one of {choices} or a callable (name, param) -> elements", TypeError)
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return
    try:
        signature.bind("weight", None)
    except TypeError:
        _refuse(
            f"the callable's signature {signature} cannot take (name, param)",
            "pass a function such as lambda name, param: 256 (granularity in elements)",
            TypeError,
        )


def _block_rows(value: Any) -> None:
    if not _is_int(value):
        _refuse(f"rows per block must be an int, got {_type_name(value)}", "pass e.g. block_rows=128", TypeError)
    _engine_check(check_block_rows, value)


def _dbuffer_size(value: Any) -> None:
    if value == "recommended" and isinstance(value, str):
        return  # read from <default_root_dir>/ragged_fsdp_tuning.json at setup (observability/tuning.py)
    if isinstance(value, str):
        _refuse(
            f"must be an int (bytes) or 'recommended', got the str {value!r}{_closest(value, ('recommended',))}",
            "pass e.g. dbuffer_size=256 * 2**20 (256 MiB), or dbuffer_size='recommended' (the value the metrics "
            "callback wrote to <default_root_dir>/ragged_fsdp_tuning.json)",
            TypeError,
        )
    if not _is_int(value):
        whole = isinstance(value, float) and math.isfinite(value) and value >= 1
        fix = f"pass an int, e.g. dbuffer_size={int(value)}" if whole else ""
        _refuse(
            f"a buffer size in bytes must be an int, got {_type_name(value)}",
            fix or "pass e.g. dbuffer_size=256 * 2**20 (256 MiB)",
            TypeError,
        )
    _engine_check(_check_dbuffer_size, value)


def _planning_algorithm(value: Any) -> None:
    _choice("planning_algorithm", value, ALGORITHMS, "optimal")


def _reshard_after_forward(value: Any) -> None:
    fix = (
        "pass None (FSDP2's default), True (free after forward), False (keep until backward) or a positive int "
        "that divides the shard group's ranks, e.g. 8 (one node)"
    )
    if value is None or isinstance(value, bool):
        return
    if not _is_int(value):
        _refuse(f"must be a bool or a positive int, got {_type_name(value)}", fix, TypeError)
    if value < 1:
        _refuse("must be a bool or a positive int", fix)


def _module_specs(name: str) -> Callable[[Any], None]:
    fix = f"pass a list of module classes or class names, e.g. {name}=[Block] or {name}=['Block']"

    def check(value: Any) -> None:
        if value is None:
            return
        if isinstance(value, (str, type)):
            _refuse(f"must be a list of module classes or names, got a single {_type_name(value)}",
                    f"wrap it in a list: {name}=[{value!r}]" if isinstance(value, str) else fix, TypeError)
        collection = isinstance(value, collections.abc.Collection)
        if not collection or isinstance(value, (bytes, Mapping, nn.Module)):
            _refuse(f"must be a list of module classes or names, got {_type_name(value)}", fix, TypeError)
        for spec in value:
            if isinstance(spec, nn.Module):
                _refuse(f"holds a module instance ({_type_name(spec)})",
                        f"pass its class ({_type_name(spec)}) or its name ({_type_name(spec)!r})", TypeError)
            if isinstance(spec, type) and not issubclass(spec, nn.Module):
                _refuse(f"holds {spec.__name__}, which is not an nn.Module class", fix, TypeError)
            if isinstance(spec, str) and not spec.strip():
                _refuse("holds an empty name", fix)
            if not isinstance(spec, (str, type)):
                _refuse(f"holds {spec!r}, neither a module class nor a name", fix, TypeError)

    return check


def _replicate_degree(value: Any) -> None:
    fix = ("pass e.g. replicate_degree=2 (2 replicas), 'node' (shard inside each node), 'auto' (chosen with "
           "planning='auto') or 1 (no HSDP)")
    if value in ("node", "auto") and isinstance(value, str):
        return
    if isinstance(value, str):
        if value.strip().isdigit():
            _refuse("must be a positive int, 'node' or 'auto', not a str", f"pass replicate_degree={int(value)}",
                    TypeError)
        _refuse(f"must be a positive int, 'node' or 'auto'{_closest(value, ('node', 'auto'))}", fix)
    if not _is_int(value):
        _refuse(f"must be a positive int, 'node' or 'auto', got {_type_name(value)}", fix, TypeError)
    if value < 1:
        _refuse("must be a positive int, 'node' or 'auto'", fix)


STATE_DICT_TYPES = ("sharded", "full")
"""What ``state_dict_type`` may be: DCP directories of shards, or one consolidated file."""


def _state_dict_type(value: Any) -> None:
    _choice("state_dict_type", value, STATE_DICT_TYPES, "sharded")


def _flag(name: str) -> Callable[[Any], None]:
    def check(value: Any) -> None:
        if isinstance(value, bool):
            return
        meant = str(value).strip().lower() in _TRUE_WORDS
        truthy = " (a non-empty string is truthy)" if isinstance(value, str) else ""
        _refuse(f"must be True or False, got {_type_name(value)}{truthy}", f"pass {name}={meant}", TypeError)

    return check


def _checkpoint_compression(value: Any) -> None:
    _flag("checkpoint_compression")(value)
    if value:
        try:
            from torch.distributed.checkpoint._extension import ZStandard
        except ImportError:  # another torch: the save says it
            return
        if not ZStandard.is_available():
            _refuse("needs the 'zstandard' (or 'pyzstd') package",
                    "pip install zstandard, or pass checkpoint_compression=False")


def _monitor_port(value: Any) -> None:
    fix = "pass e.g. monitor_port=8080 (0: any free port), or None for no endpoint"
    if value is None:
        return
    if isinstance(value, str) and value.strip().isdigit():
        _refuse("a port must be an int, not a str", f"pass monitor_port={int(value)}", TypeError)
    if not _is_int(value):
        _refuse(f"a port must be an int or None, got {_type_name(value)}", fix, TypeError)
    if not 0 <= value <= 65535:
        _refuse("a TCP port is in 0..65535", fix)


def _monitor_address(value: Any) -> None:
    fix = "pass e.g. monitor_address='127.0.0.1' (loopback, the default), '::1', or '0.0.0.0' (every interface)"
    if not isinstance(value, str):
        _refuse(f"an address must be a str, got {_type_name(value)}", fix, TypeError)
    if not value.strip() or "/" in value or any(c.isspace() for c in value):
        _refuse("is not a host name or IP address (the port goes to monitor_port)", fix)


def _process_group_backend(value: Any) -> None:
    known = tuple(b for b in dist.Backend.backend_list if b != "undefined")
    fix = f"pass one of {known}, a 'device:backend,...' map such as 'cpu:gloo,cuda:nccl', or None (by device)"
    if value is None:
        return
    if not isinstance(value, str):
        _refuse(f"a backend name must be a str, got {_type_name(value)}", fix, TypeError)
    for part in value.split(","):
        if part != "".join(part.split()):  # torch refuses it after spawning: "Unknown backend type gloo "
            _refuse("holds spaces", fix)
        backend = part.rpartition(":")[2].strip().lower()
        if backend not in known:
            _refuse(f"{backend!r} is not a torch.distributed backend{_closest(backend, known)}", fix)
        if not dist.is_backend_available(backend):  # else every rank fails in init_process_group, after spawning
            _refuse(
                f"{backend!r} is not available in this torch build ({torch.__version__}; "
                f"torch.distributed.is_backend_available({backend!r}) is False)",
                "pass 'gloo' (CPU), None (by device), or install a torch build that has it",
            )


def _timeout(value: Any) -> None:
    if value is None or (isinstance(value, timedelta) and value > timedelta(0)):
        return
    if isinstance(value, timedelta):
        _refuse("the process-group timeout must be positive", "pass e.g. timeout=timedelta(minutes=30)")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        _refuse(f"must be a datetime.timedelta, got {_type_name(value)} (seconds? minutes?)",
                f"pass timeout=timedelta(seconds={value!r}) (from datetime import timedelta)", TypeError)
    _refuse(f"must be a datetime.timedelta, got {_type_name(value)}",
            "pass e.g. timeout=timedelta(minutes=30) (from datetime import timedelta)", TypeError)


KNOB_CHECKS: dict[str, Callable[[Any], None]] = {
    "shard_granularity": _shard_granularity,
    "block_rows": _block_rows,
    "dbuffer_size": _dbuffer_size,
    "planning_algorithm": _planning_algorithm,
    "reshard_after_forward": _reshard_after_forward,
    "group_modules": _module_specs("group_modules"),
    "activation_checkpointing": _module_specs("activation_checkpointing"),
    "replicate_degree": _replicate_degree,
    "state_dict_type": _state_dict_type,
    "checkpoint_compression": _checkpoint_compression,
    "async_checkpoint": _flag("async_checkpoint"),
    "sync_grads_each_micro_batch": _flag("sync_grads_each_micro_batch"),
    "metrics": _flag("metrics"),
    "monitor_port": _monitor_port,
    "monitor_address": _monitor_address,
    "process_group_backend": _process_group_backend,
    "timeout": _timeout,
    "sync_module_states": _flag("sync_module_states"),
    "broadcast_buffers": _flag("broadcast_buffers"),
    "trust_checkpoint": _flag("trust_checkpoint"),
    "verify_checksums": _flag("verify_checksums"),
}
"""One check per keyword-only knob of ``RaggedFSDPStrategy.__init__`` (a test keeps the two in step)."""


def _mode(knob: str, modes: tuple[str, ...]) -> Callable[[Any], None]:
    """A check that the value is one of ``modes`` or None (the backend's best)."""
    def check(value: Any) -> None:
        if value is not None:
            _choice(knob, value, modes, modes[0])

    return check


def _int_at_least(minimum: int, problem: str, fix: str, optional: bool = False) -> Callable[[Any], None]:
    """A check that the value is an int >= ``minimum`` (or None where ``optional``): ValueError, else TypeError."""
    def check(value: Any) -> None:
        if not ((value is None and optional) or (_is_int(value) and value >= minimum)):
            _refuse(problem, fix, ValueError if _is_int(value) else TypeError)

    return check


def _fp8_all_gather(value: Any) -> None:
    """A ``Float8AllGather`` (its constructor already refused a bad tile or dtype) or None."""
    try:
        check_fp8_all_gather(value)
    except TypeError:
        _refuse(f"must be a lightning_ragged.Float8AllGather or None, got {_type_name(value)}",
                "pass e.g. fp8_all_gather=Float8AllGather(tile=128) (from lightning_ragged import Float8AllGather)",
                TypeError)


def _planning(value: Any) -> None:
    if value is not None:
        _choice("planning", value, ("auto",), "auto")


ENGINE_KWARG_CHECKS: dict[str, Callable[[Any], None]] = {
    "blocks_per_group": _int_at_least(
        1, "must be an int >= 1 (consecutive blocks joined into one group)", "pass e.g. blocks_per_group=2"),
    "planning": _planning,
    "memory_budget_bytes": _int_at_least(
        1, "must be a positive int of bytes per rank (used with planning='auto')",
        "pass e.g. memory_budget_bytes=80 * 10**9", optional=True),
    "reduce_mode": _mode("reduce_mode", REDUCE_MODES),
    "gather_mode": _mode("gather_mode", GATHER_MODES),
    "alignment": _int_at_least(
        1, "must be a positive int (elements) or None (16 bytes)", "pass e.g. alignment=16 or None", optional=True),
    "keep_last_unsharded": _flag("keep_last_unsharded"),
    "max_inflight_all_gathers": _int_at_least(
        0, "must be an int >= 0 (0: no prefetch; 1: one all-gather ahead, as FSDP2)",
        "pass e.g. max_inflight_all_gathers=1"),
    "keep_cast_shard": _flag("keep_cast_shard"),
    "fp8_all_gather": _fp8_all_gather,
}
"""Value checks for ``**kwargs`` forwarded to ``fully_shard`` (others are only checked by name)."""


def engine_kwarg_names() -> tuple[str, ...]:
    """The ``fully_shard`` parameters a strategy's ``**kwargs`` may carry."""
    names = inspect.signature(fully_shard).parameters
    return tuple(n for n in names if n not in SET_BY_STRATEGY and n not in KNOB_CHECKS)


def _trainer_arguments() -> frozenset[str]:
    try:
        from lightning.pytorch import Trainer
    except ImportError:
        return frozenset()
    return frozenset(inspect.signature(Trainer.__init__).parameters) - {"self"}


def _message(owner: str, name: str, value: Any, refused: _Refused) -> str:
    fix = f"; {refused.fix}" if refused.fix else ""
    return f"{owner}({name}={_REPR.repr(value)}): {refused.problem}{fix}"


FSDP2_ONLY = ("mesh", "offload_policy", "ignored_params", "shard_placement_fn")
"""``fully_shard``'s FSDP2 arguments: never the strategy's (``SET_BY_STRATEGY`` says why), but LightningCLI
passes every ``fully_shard`` parameter it sees through ``**kwargs``, these at their default None."""


def without_fsdp2_defaults(engine_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``engine_kwargs`` without the FSDP2-only arguments left at None (nothing asked for)."""
    return {name: value for name, value in engine_kwargs.items() if not (name in FSDP2_ONLY and value is None)}


def check_strategy_knobs(
    knobs: Mapping[str, Any], engine_kwargs: Mapping[str, Any], owner: str = "RaggedFSDPStrategy"
) -> None:
    """Raise ``TypeError``/``ValueError`` for the first bad knob or ``**kwargs`` entry (see the module doc)."""
    for name, value in knobs.items():
        check = KNOB_CHECKS.get(name)
        if check is None:
            raise AssertionError(f"{owner}: knob {name!r} has no check in lightning_ragged.lightning.knobs.KNOB_CHECKS")
        try:
            check(value)
        except _Refused as refused:
            raise refused.error(_message(owner, name, value, refused)) from None
    accepted = engine_kwarg_names()
    for name, value in engine_kwargs.items():
        if name in SET_BY_STRATEGY:
            raise TypeError(
                f"{owner}({name}={_REPR.repr(value)}): not a strategy argument; {SET_BY_STRATEGY[name]}"
            )
        if name not in accepted:
            raise TypeError(_unknown_argument(owner, name, value, accepted))
        check = ENGINE_KWARG_CHECKS.get(name)
        if check is not None:
            try:
                check(value)
            except _Refused as refused:
                raise refused.error(_message(owner, name, value, refused)) from None
    planning, budget = engine_kwargs.get("planning"), engine_kwargs.get("memory_budget_bytes")
    if planning == "auto" and (budget is None or engine_kwargs.get("blocks_per_group", 1) != 1):
        raise ValueError(  # the engine's refusals, here before any process starts (they came ~10 s into fit)
            f"{owner}(planning='auto'): the auto-planner chooses the blocks per group for a per-device budget: "
            "pass memory_budget_bytes=... and drop blocks_per_group"
        )
    if budget is not None and planning != "auto":
        raise ValueError(f"{owner}(memory_budget_bytes={budget!r}) only applies to planning='auto': pass "
                         "planning='auto' too, or drop memory_budget_bytes")
    if knobs.get("replicate_degree") == "auto" and engine_kwargs.get("planning") != "auto":
        raise ValueError(
            f"{owner}(replicate_degree='auto'): the auto-planner chooses the HSDP degree; pass it "
            "planning='auto' and memory_budget_bytes=... too (or a fixed replicate_degree)"
        )


SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true")


def unsupported_precision(owner: str, plugin: str, precision: Optional[str]) -> ValueError:
    """The error for a precision (plugin) the strategies cannot run, with what to choose instead."""
    return ValueError(
        f"{owner} does not support the precision plugin {plugin}"
        f"{f' (precision={precision!r})' if precision else ''}. "
        f"Choose `precision=` among {', '.join(SUPPORTED_PRECISION)}."
    )


def _unknown_argument(owner: str, name: str, value: Any, accepted: tuple[str, ...]) -> str:
    shown = _REPR.repr(value)
    head = f"{owner}({name}={shown}): unknown argument {name!r}"
    match = difflib.get_close_matches(name, [*KNOB_CHECKS, *accepted], n=1, cutoff=0.6)
    if match:
        fix = f"did you mean {match[0]}={shown}?"
    elif name in _trainer_arguments():
        fix = f"{name!r} is a Trainer argument: pass L.Trainer({name}={shown})"
    else:
        fix = f"use one of the strategy's knobs ({', '.join(KNOB_CHECKS)})"
    return (
        f"{head}; {fix} (other keyword arguments go to lightning_ragged.fully_shard, which takes "
        f"{', '.join(accepted) or 'none'})"
    )

