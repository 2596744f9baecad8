"""torch's own checkpoint recipe on a ragged model, as FSDP2 users write it (torchtitan's pattern).

``dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)})``,
then ``dcp.load`` + ``set_model_state_dict`` / ``set_optimizer_state_dict`` at another world
size, or into torch's FSDP2: training resumes where the uninterrupted run went. Oracles: the
uninterrupted ragged run, and FSDP2 resuming from the ragged checkpoint.
"""

from __future__ import annotations

import collections
import copy
import io

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import lightning_ragged as lr
from tests.models import TinyLM, lm_loss, make_batches, make_model

BATCH = 6  # global batch: divisible by 2 and 3 ranks
STEPS = 6


class ScaledLM(TinyLM):
    """TinyLM with a 0-D parameter (a learned logit scale): it lives whole on one rank."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(1.25))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens) * self.scale


def _make(scalar: bool, seed: int):
    torch.manual_seed(seed)
    return ScaledLM() if scalar else make_model(seed)


def _step(model, optimizer, batch: torch.Tensor) -> float:
    """One AdamW step on this rank's slice of the global batch; returns the global mean loss."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per = batch.shape[0] // world
    loss = lm_loss(model, batch[rank * per : (rank + 1) * per])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / world


def _ragged(scalar: bool, seed: int = 3):
    model = lr.fully_shard(_make(scalar, seed), shard_granularity="element")  # cuts inside rows
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _fsdp2(seed: int = 3):
    from torch.distributed.fsdp import fully_shard

    model = make_model(seed)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _resume(framework: str, root: str, scalar: bool) -> list[float]:
    """Load ``root`` with torch's APIs only, then train the remaining steps."""
    model, optimizer = _ragged(scalar) if framework == "ragged" else _fsdp2()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=root)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    data = make_batches(STEPS, BATCH)
    return [_step(model, optimizer, data[step]) for step in range(STEPS // 2, STEPS)]


def check_save_with_torch_apis(root: str, scalar: bool, framework: str = "ragged", background: bool = False) -> list:
    """Train, save half-way with torch's APIs (``background``: ``dcp.async_save``), and go on: the losses."""
    model, optimizer = _ragged(scalar, seed=0) if framework == "ragged" else _fsdp2(seed=0)
    data = make_batches(STEPS, BATCH)
    trace = [_step(model, optimizer, data[step]) for step in range(STEPS // 2)]
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    if background:  # staged copies: the steps below may change the shards while it writes
        # Its own group, as torch advises: the save's collectives run beside the training's.
        pending = dcp.async_save(state, checkpoint_id=root, process_group=dist.new_group(backend="gloo"))
        trace.append(_step(model, optimizer, data[STEPS // 2]))
        pending.result()
        return trace + [_step(model, optimizer, data[step]) for step in range(STEPS // 2 + 1, STEPS)]
    dcp.save(state, checkpoint_id=root)
    return trace + [_step(model, optimizer, data[step]) for step in range(STEPS // 2, STEPS)]


@pytest.mark.parametrize(
    "scalar,background", [(False, False), (True, True)], ids=["tinylm-save", "with-0d-param-async_save"]
)
def test_torch_checkpoint_apis_save_and_resume_at_any_world_size_and_in_fsdp2(dist_pool, tmp_path, scalar, background):
    root = str(tmp_path / "torch_dcp")
    trace = dist_pool(2).run(check_save_with_torch_apis, root, scalar, "ragged", background)[0]
    # FSDP2 shards dim 0 and refuses a 0-D parameter: it resumes the model without one.
    runs = ((3, "ragged"), (2, "ragged")) + (() if scalar else ((2, "fsdp2"),))
    for world, framework in runs:
        resumed = dist_pool(world).run(_resume, framework, root, scalar)[0]
        worst = max(abs(a - b) for a, b in zip(resumed, trace[STEPS // 2 :]))
        assert worst < 1e-5, (world, framework, resumed, trace)


def test_fsdp2_checkpoint_of_torch_apis_resumes_a_ragged_model(dist_pool, tmp_path) -> None:
    root = str(tmp_path / "fsdp2_dcp")
    trace = dist_pool(2).run(check_save_with_torch_apis, root, False, "fsdp2")[0]
    resumed = dist_pool(3).run(_resume, "ragged", root, False)[0]
    assert max(abs(a - b) for a, b in zip(resumed, trace[STEPS // 2 :])) < 1e-5, (resumed, trace)


def test_dcp_to_torch_save_gives_the_full_tensors_fsdp2_gives(dist_pool, tmp_path) -> None:
    """torch's offline converter turns a ragged directory into one torch.save file of full tensors.

    Oracle: FSDP2 trained the same steps on the same batches and saved with the same calls.
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    converted = {}
    for framework in ("ragged", "fsdp2"):
        root = str(tmp_path / framework)
        dist_pool(2).run(check_save_with_torch_apis, root, False, framework)
        dcp_to_torch_save(root, root + ".pt")
        converted[framework] = torch.load(root + ".pt", weights_only=True)
    ragged, fsdp2 = converted["ragged"], converted["fsdp2"]
    assert ragged["model"].keys() == fsdp2["model"].keys()
    for name, value in fsdp2["model"].items():
        assert ragged["model"][name].shape == value.shape and torch.allclose(ragged["model"][name], value, atol=1e-5)
    for name, states in fsdp2["optim"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(ragged["optim"]["state"][name][key], states[key], atol=1e-6), (name, key)


def check_state_dict_protocol() -> dict:
    """``state_dict()``'s StateShards, ``load_state_dict`` of full tensors, and the refusals, on every rank."""
    from lightning_ragged.engine.state_shard import StateShard

    plain = make_model(seed=5)
    model = lr.fully_shard(make_model(), shard_granularity="element")
    state = model.state_dict()
    sharded = sorted(k for k, v in state.items() if isinstance(v, StateShard))
    shapes_ok = all(tuple(v.shape) == tuple(plain.state_dict()[k].shape) for k, v in state.items())
    # A copy, changed elementwise, is still this layout's: it loads back (an in-memory snapshot).
    snapshot = {k: v.detach().clone() for k, v in state.items()}
    before = {k: v.clone() for k, v in lr.full_state_dict(model).items()}
    for value in model.parameters():
        value.data.add_(1.0)
    model.load_state_dict(snapshot)
    restored = max((lr.full_state_dict(model)[k] - v).abs().max().item() for k, v in before.items())
    equal = (torch.equal(snapshot["blocks.0.up.weight"], state["blocks.0.up.weight"]),
             torch.equal(snapshot["blocks.0.up.weight"] * 2, state["blocks.0.up.weight"]))
    # Elementwise results keep the layout: lerp(v, 3v, 0.5) = 2v, loaded back.
    model.load_state_dict({k: v.lerp(v * 3, 0.5) for k, v in snapshot.items()})
    doubled = max((lr.full_state_dict(model)[k] - 2 * v).abs().max().item() for k, v in before.items())
    # Full tensors of another model load into the shards (sliced to this rank's range), also
    # through torch's full_state_dict loading, from rank 0 alone.
    model.load_state_dict(plain.state_dict())
    full = lr.full_state_dict(model)
    loaded = max((full[k] - v).abs().max().item() for k, v in plain.state_dict().items())
    other = make_model(seed=9).state_dict()
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, other if dist.get_rank() == 0 else {}, options=options)
    full = lr.full_state_dict(model)
    broadcast = max((full[k] - v).abs().max().item() for k, v in other.items())
    kept = model.state_dict(keep_vars=True)
    identity = all(kept[name] is param for name, param in model.named_parameters())
    errors = {}
    for what, call in {
        "sum": lambda: state["blocks.0.up.weight"].sum(),
        "pickle": lambda: torch.save(state, io.BytesIO()),
        "into_full": lambda: plain.load_state_dict(model.state_dict()),
        "assign": lambda: model.load_state_dict(plain.state_dict(), assign=True),
    }.items():
        try:
            call()
            errors[what] = None
        except Exception as error:  # noqa: BLE001 - the message is what is checked
            errors[what] = str(error)
    dist.barrier()  # every rank refused before any collective: the group still works
    return {"sharded": sharded, "shapes_ok": shapes_ok, "loaded": loaded, "restored": restored, "equal": equal,
            "doubled": doubled, "broadcast": broadcast, "errors": errors, "identity": identity,
            "keys": sorted(state) == sorted(plain.state_dict())}


def test_state_dict_gives_state_shards_and_load_state_dict_takes_them_and_full_tensors(dist_pool) -> None:
    for result in dist_pool(2).run(check_state_dict_protocol):
        assert result["keys"] and result["shapes_ok"], result
        assert "blocks.0.up.weight" in result["sharded"] and "embed.weight" in result["sharded"], result
        assert result["loaded"] == result["restored"] == result["broadcast"] == 0.0, result
        assert result["doubled"] < 1e-6, result  # lerp's rounding on values ~0.1
        assert result["equal"] == (True, False) and result["identity"], result
        for what in ("sum", "pickle", "into_full"):
            assert "lightning_ragged.full_state_dict(model)" in result["errors"][what], (what, result)
        assert "assign=False" in result["errors"]["assign"], result


def check_full_state_dicts_through_torch(framework: str) -> dict:
    """Train, then torch's full-state-dict options: the full tensors, on every rank or on rank 0's CPU only."""
    model, optimizer = _ragged(False, seed=0) if framework == "ragged" else _fsdp2(seed=0)
    data = make_batches(STEPS // 2, BATCH)
    for batch in data:
        _step(model, optimizer, batch)
    everywhere = StateDictOptions(full_state_dict=True)
    rank0_cpu = StateDictOptions(full_state_dict=True, cpu_offload=True)
    result = {
        "model": get_model_state_dict(model, options=everywhere),
        "optim": get_optimizer_state_dict(model, optimizer, options=everywhere),
        "model_cpu": get_model_state_dict(model, options=rank0_cpu),
        "optim_cpu": get_optimizer_state_dict(model, optimizer, options=rank0_cpu),
        # DTensor's own call on each value, as FSDP2 scripts write it
        "full_tensor": {k: v.full_tensor() for k, v in model.state_dict().items()},
    }
    torch.save(result["model"], io.BytesIO())  # full tensors: no StateShard left to refuse pickling
    return result


def test_full_state_dicts_through_torch_apis_are_fsdp2s(dist_pool) -> None:
    """Oracle: FSDP2 trained the same steps on the same batches, asked the same way."""
    ragged = dist_pool(2).run(check_full_state_dicts_through_torch, "ragged")
    fsdp2 = dist_pool(2).run(check_full_state_dicts_through_torch, "fsdp2")
    for rank in range(2):
        ours, theirs = ragged[rank], fsdp2[rank]
        for key in ("model", "full_tensor") + (("model_cpu",) if rank == 0 else ()):
            assert ours[key].keys() == theirs["model"].keys(), key
            for name, value in theirs["model"].items():
                mine = ours[key][name]
                assert type(mine) is torch.Tensor and mine.shape == value.shape, (key, name, type(mine))
                assert torch.allclose(mine, value, atol=1e-5), (key, name)
        assert all(v.device.type == "cpu" for v in ours["model_cpu"].values())
        for key in ("optim",) + (("optim_cpu",) if rank == 0 else ()):
            assert ours[key]["param_groups"] == theirs["optim"]["param_groups"], key
            for name, states in theirs["optim"]["state"].items():
                for state_key in ("exp_avg", "exp_avg_sq"):
                    mine = ours[key]["state"][name][state_key]
                    assert type(mine) is torch.Tensor, (key, name, type(mine))
                    assert torch.allclose(mine, states[state_key], atol=1e-6), (key, name, state_key)
        if rank == 1:  # cpu_offload keeps rank 0's only, as torch does
            assert ours["model_cpu"] == {} and ours["optim_cpu"] == {} and theirs["model_cpu"] == {}


class GainSGD(torch.optim.SGD):
    """SGD with momentum that also keeps a one-element state per parameter (a custom optimizer's gain)."""

    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                self.state[param].setdefault("gain", torch.ones(1))
        return super().step(closure)


class Tagged(torch.nn.Module):
    """A module whose extra state is a namedtuple (torch's state dicts carry it as it is)."""

    Meta = collections.namedtuple("Meta", "version scale")

    def get_extra_state(self):
        return self.Meta(2, 0.5)

    def set_extra_state(self, state) -> None:
        pass


def check_full_state_dicts_of_odd_states() -> dict:
    """Element granularity at 3 ranks gives one-element parts: a gain of one element looks per-element there."""
    model, _ = _ragged(True, seed=0)
    optimizer = GainSGD(model.parameters(), lr=1e-2, momentum=0.9)
    reference = _make(True, 0)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=1e-2, momentum=0.9)
    one_element_parts = sum(p.numel() == 1 for p in model.parameters())
    for batch in make_batches(2, BATCH):
        _step(model, optimizer, batch)
        lm_loss(reference, batch).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    full = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    by_name = dict(reference.named_parameters())
    momentum = max((full["state"][name]["momentum_buffer"] - reference_optimizer.state[param]["momentum_buffer"])
                   .abs().max().item() for name, param in by_name.items())
    gains = all(torch.equal(full["state"][name]["gain"], torch.ones(1)) for name in by_name)
    tagged = get_model_state_dict(Tagged(), options=StateDictOptions(full_state_dict=True))
    return {"momentum": momentum, "gains": gains, "tagged": tagged, "one_element_parts": one_element_parts}


def test_full_state_dicts_of_one_element_states_and_namedtuples(dist_pool) -> None:
    results = dist_pool(3).run(check_full_state_dicts_of_odd_states)
    assert sum(r["one_element_parts"] for r in results) > 0, results  # the case that made ranks disagree
    for result in results:
        assert result["momentum"] <= 1e-6 and result["gains"], result  # vs single-process SGD, 2 steps
        assert result["tagged"]["_extra_state"] == Tagged.Meta(2, 0.5), result


def check_full_parameters_kept_between_steps() -> dict:
    """With ``reshard_after_backward=False`` the modules hold full parameters between steps: ``state_dict()`` gives
    the master shards (not the stale full copies), and ``load_state_dict`` lands in them (the group is resharded)."""
    model = lr.fully_shard(make_model(), shard_granularity="element")
    model.set_reshard_after_backward(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optimizer, make_batches(1, BATCH)[0])
    kept = lr.get_state(model).all_groups[0].is_unsharded
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}  # the shards, after the step
    masters = lr.full_state_dict(model)
    model.load_state_dict(snapshot)  # reshards: a round trip of the masters
    round_trip = max((lr.full_state_dict(model)[k] - v).abs().max().item() for k, v in masters.items())
    zeros = {k: torch.zeros_like(v) for k, v in make_model().state_dict().items()}
    model.set_reshard_after_backward(False)
    _step(model, optimizer, make_batches(2, BATCH)[1])
    model.load_state_dict(zeros)
    loaded = max(v.abs().max().item() for v in lr.full_state_dict(model).values())
    with torch.no_grad():
        logits = model(make_batches(1, BATCH)[0][:1, :-1])  # the next forward gathers the loaded (zero) weights
    return {"kept": kept, "round_trip": round_trip, "loaded": loaded, "logits": logits.abs().max().item()}


def test_state_dict_reads_the_masters_and_load_lands_in_them_while_full_parameters_are_kept(dist_pool) -> None:
    for result in dist_pool(2).run(check_full_parameters_kept_between_steps):
        assert result["kept"], result  # the case is real: a group held its full parameters
        assert result["round_trip"] == 0.0 and result["loaded"] == 0.0 and result["logits"] == 0.0, result


def check_layout_mismatch() -> str:
    """A StateShard of another layout is refused on every rank, even where this rank's boxes happen to agree."""
    element = lr.fully_shard(make_model(), shard_granularity="element").state_dict()
    row = lr.fully_shard(make_model(seed=2), shard_granularity="row")
    # A key whose boxes agree on some ranks and not on others: the case a per-rank comparison gets wrong.
    agrees = {k: v._boxes == row.state_dict()[k]._boxes for k, v in element.items() if hasattr(v, "_boxes")}
    return _load_where_ranks_differ(row, element, agrees)


def _load_where_ranks_differ(model, values: dict, agrees: dict) -> str:
    """Load the first key of ``values`` that ``agrees`` on some ranks and not on others; what this rank saw."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, agrees)
    key = next(k for k in sorted(agrees) if len({flags[k] for flags in everyone}) == 2)
    try:
        model.load_state_dict({key: values[key]}, strict=False)
        outcome = "loaded"
    except ValueError as error:
        outcome = str(error)
    dist.barrier()  # no rank went on into a collective while the others raised
    return outcome


def test_another_layouts_state_shards_are_refused_on_every_rank(dist_pool) -> None:
    for outcome in dist_pool(3).run(check_layout_mismatch):
        assert "another layout" in outcome and "dcp.load" in outcome, outcome


def check_optimizer_loaded_before_its_first_step() -> dict:
    """A fresh optimizer loads a state dict (of StateShards) before it ever stepped, as resuming does; and one that
    gets the sharded parameters by ``add_param_group`` after its first step gives StateShards too."""
    from lightning_ragged.engine.state_shard import StateShard

    data = make_batches(4, BATCH)
    model = lr.fully_shard(make_model(), shard_granularity="element")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optimizer, data[0])
    saved = copy.deepcopy(optimizer.state_dict())
    params = copy.deepcopy(model.state_dict())
    reference = [_step(model, optimizer, data[step]) for step in (1, 2)]
    resumed_model = lr.fully_shard(make_model(seed=4), shard_granularity="element")
    resumed_model.load_state_dict(params)
    resumed = torch.optim.AdamW(resumed_model.parameters(), lr=1e-2)
    resumed.load_state_dict(saved)  # before any step: the step's pre-hook makes them this rank's parts
    trace = [_step(resumed_model, resumed, data[step]) for step in (1, 2)]
    later = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1, momentum=0.9)
    later.step()
    later.add_param_group({"params": list(resumed_model.parameters())})
    _step(resumed_model, later, data[3])
    kinds = {type(v).__name__ for entries in later.state_dict()["state"].values() for v in entries.values()
             if isinstance(v, torch.Tensor) and v.dim()}
    return {"worst": max(abs(a - b) for a, b in zip(trace, reference)), "kinds": kinds,
            "state_shard": StateShard.__name__}


def test_optimizer_loaded_before_its_first_step_and_grown_later(dist_pool) -> None:
    for result in dist_pool(2).run(check_optimizer_loaded_before_its_first_step):
        assert result["worst"] == 0.0, result  # the same shards, states and batches: the same steps
        assert result["state_shard"] in result["kinds"], result


def check_one_rank_holds_everything() -> dict:
    """On one rank the state-dict values are the plain tensors (the local part is the whole): torch.save works."""
    model = lr.fully_shard(make_model(), shard_granularity="element")
    state = model.state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    other = lr.fully_shard(make_model(seed=6), shard_granularity="element")
    other.load_state_dict(torch.load(buffer))
    plain = make_model().state_dict()
    return {"types": {type(v).__name__ for v in state.values()},
            "worst": max((lr.full_state_dict(other)[k] - v).abs().max().item() for k, v in plain.items())}


def test_on_one_rank_state_dict_values_are_plain_tensors(dist_pool) -> None:
    (result,) = dist_pool(1).run(check_one_rank_holds_everything)
    assert result["types"] == {"Tensor"} and result["worst"] == 0.0, result


def check_loaded_optimizer_saved_before_its_first_step(root: str) -> dict:
    """An optimizer that holds states before its first step gives StateShards to torch's save too: one loaded by
    lightning_ragged.checkpoint.load (a conversion to torch's format), and an Adagrad (its sums exist from
    ``__init__``) hooked by ``lr.hook_optimizer``."""
    from lightning_ragged import checkpoint as ck
    from lightning_ragged.engine.state_shard import StateShard

    data = make_batches(3, BATCH)
    source, source_opt = _ragged(False, seed=0)
    _step(source, source_opt, data[0])
    ck.save(f"{root}/ragged", source, [source_opt])
    converted, converted_opt = _ragged(False, seed=5)
    ck.load(f"{root}/ragged", converted, [converted_opt])
    dcp.save({"model": get_model_state_dict(converted), "optim": get_optimizer_state_dict(converted, converted_opt)},
             checkpoint_id=f"{root}/torch")
    resumed, resumed_opt = _ragged(False, seed=6)
    state = {"model": get_model_state_dict(resumed), "optim": get_optimizer_state_dict(resumed, resumed_opt)}
    dcp.load(state, checkpoint_id=f"{root}/torch")
    set_model_state_dict(resumed, state["model"])
    set_optimizer_state_dict(resumed, resumed_opt, state["optim"])
    trace = [_step(resumed, resumed_opt, data[step]) for step in (1, 2)]
    reference = [_step(source, source_opt, data[step]) for step in (1, 2)]
    adagrad = torch.optim.Adagrad(resumed.parameters(), lr=0.1, initial_accumulator_value=0.5)
    lr.hook_optimizer(adagrad)
    kinds = {type(v).__name__ for entries in get_optimizer_state_dict(resumed, adagrad)["state"].values()
             for v in entries.values() if isinstance(v, torch.Tensor) and v.dim()}
    worst = max(abs(a - b) for a, b in zip(trace, reference))
    return {"worst": worst, "kinds": kinds, "expected": {StateShard.__name__}}


def test_an_optimizer_holding_states_before_its_first_step_saves_every_ranks_part(dist_pool, tmp_path) -> None:
    for result in dist_pool(2).run(check_loaded_optimizer_saved_before_its_first_step, str(tmp_path)):
        assert result["worst"] < 1e-6 and result["kinds"] == result["expected"], result


def check_local_parts_refused_everywhere() -> str:
    """1-D local parts (of another layout here) are refused on every rank, even where a rank's sizes happen to agree."""
    element = lr.fully_shard(make_model(), shard_granularity="element")
    parts = {name: param.detach().clone() for name, param in element.named_parameters()}
    row = lr.fully_shard(make_model(seed=2), shard_granularity="row")
    # A matrix whose local sizes agree on some ranks and not on others: the case a per-rank size check gets wrong.
    # (A vector's part that is all of it on a rank is the full tensor there, and loads as one.)
    sizes = dict(row.named_parameters())
    matrices = [k for k in parts if len(sizes[k].ragged_shard.global_shape) == 2]
    agrees = {k: parts[k].numel() == sizes[k].numel() for k in matrices}
    return _load_where_ranks_differ(row, parts, agrees)


def test_local_parts_are_refused_on_every_rank(dist_pool) -> None:
    for outcome in dist_pool(3).run(check_local_parts_refused_everywhere):
        assert "1-D local part is not taken" in outcome, outcome


def check_full_optimizer_state_of_a_0d_parameter() -> float:
    """torch's full-state-dict loading of an optimizer (a 0-D parameter's states are 0-D too) resumes exactly
    where a single-process run of the same global batches goes (the oracle, on every rank)."""
    data = make_batches(4, BATCH)
    plain = _make(True, seed=0)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for step in (0, 1):
        lm_loss(plain, data[step]).backward()
        plain_opt.step()
        plain_opt.zero_grad()
    options = StateDictOptions(full_state_dict=True)
    # Copies: torch would hand AdamW's 0-D "step" tensors over as they are, shared by both optimizers.
    model_sd, optim_sd = get_model_state_dict(plain), copy.deepcopy(get_optimizer_state_dict(plain, plain_opt))
    model, optimizer = _ragged(True, seed=4)
    set_model_state_dict(model, model_sd, options=options)
    set_optimizer_state_dict(model, optimizer, optim_sd, options=options)
    trace = [_step(model, optimizer, data[step]) for step in (2, 3)]
    reference = []
    for step in (2, 3):
        loss = lm_loss(plain, data[step])
        loss.backward()
        plain_opt.step()
        plain_opt.zero_grad()
        reference.append(loss.item())
    return max(abs(a - b) for a, b in zip(trace, reference))


def test_full_optimizer_state_with_a_0d_parameter_loads_through_torch(dist_pool) -> None:
    for worst in dist_pool(2).run(check_full_optimizer_state_of_a_0d_parameter):
        assert worst < 1e-5, worst  # the ranks' mean of half-batch losses vs one full-batch loss: rounding only


def check_full_optimizer_state_after_a_load(root: str) -> dict:
    """Whole-matrix shards (a rank holds none of some parameters), trained, saved, loaded into a fresh pair."""
    from datetime import timedelta

    from lightning_ragged import checkpoint as ck
    from lightning_ragged.checkpoint.timeout import group_timeout

    model = lr.fully_shard(make_model(0), shard_granularity="matrix")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for batch in make_batches(2, BATCH):
        _step(model, optimizer, batch)
    everywhere = StateDictOptions(full_state_dict=True)
    before = get_optimizer_state_dict(model, optimizer, options=everywhere)
    ck.save(f"{root}/ckpt", model, [optimizer])
    restored = lr.fully_shard(make_model(5), shard_granularity="matrix")
    restored_optimizer = torch.optim.AdamW(restored.parameters(), lr=1e-2)
    ck.load(f"{root}/ckpt", restored, [restored_optimizer])
    timeout = group_timeout()
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=30), None)  # a regression fails, not hangs
    try:
        after = get_optimizer_state_dict(restored, restored_optimizer, options=everywhere)
    finally:
        dist.distributed_c10d._set_pg_timeout(timeout, None)
    same = before["state"].keys() == after["state"].keys() and all(
        before["state"][name].keys() == after["state"][name].keys()
        and all(torch.equal(value, after["state"][name][key]) for key, value in before["state"][name].items())
        for name in before["state"]
    )
    orders = {name: list(restored_optimizer.state[param]) for name, param in restored.named_parameters()}
    return {"same": same, "orders": orders}


def test_full_optimizer_state_dict_after_a_checkpoint_load(dist_pool, tmp_path) -> None:
    # Before: a rank holding none of a parameter listed its loaded states in another order ('step' first),
    # and torch's full optimizer state dict gathered them in each rank's order: the ranks hung in different
    # collectives (found by the checkpoint sweep; the same after fit(ckpt_path=...))
    results = dist_pool(2).run(check_full_optimizer_state_after_a_load, str(tmp_path))
    assert all(result["same"] for result in results), results
    assert results[0]["orders"] == results[1]["orders"]
