"""``lr.load_full_state_dict``: everything a full state dict holds, checked before anything is loaded.

Oracle: torch's ``load_state_dict`` on the unsharded model (what loads, which keys it reports missing or
unexpected, which shapes it refuses), and ``full_state_dict`` of the sharded model afterwards.
Before: buffers were never loaded (BatchNorm statistics kept their old values, silently), and a
wrong-shaped tensor loaded sliced or broadcast (a transposed weight, a larger one, a 0-d bias), or under
``broadcast_from_rank0`` failed on rank 0 with torch's bare "size of tensor" while the others waited in the
broadcast.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lightning_ragged as lr
from tests.models import make_model


def _with_buffers(model: nn.Module, fill: int) -> nn.Module:
    """Buffers beside the parameters: a float one, an int16 one (gloo broadcasts no int16: sent as bytes) and a
    counter, as BatchNorm's statistics and ``num_batches_tracked``."""
    model.register_buffer("scale", torch.full((3,), float(fill)))
    model.register_buffer("codes", torch.arange(5, dtype=torch.int16) * fill)
    model.blocks[0].register_buffer("count", torch.tensor(fill, dtype=torch.int64))
    return model


def _equal_to(model: nn.Module, reference: dict[str, torch.Tensor]) -> list[str]:
    """The keys whose full tensor differs from ``reference``'s (dtype included)."""
    full = lr.full_state_dict(model)
    return sorted(k for k, v in reference.items() if full[k].dtype != v.dtype or not torch.equal(full[k], v))


def _error(call) -> str | None:
    try:
        call()
    except RuntimeError as error:
        return str(error)
    return None


def check_load_full_state_dict() -> dict:
    model = lr.fully_shard(_with_buffers(make_model(), 0), shard_granularity="row")
    first, second = _with_buffers(make_model(seed=5), 7).state_dict(), _with_buffers(make_model(seed=6), 3).state_dict()
    results = {"returned": tuple(lr.load_full_state_dict(model, first)), "differ": _equal_to(model, first)}
    on_rank0 = second if dist.get_rank() == 0 else {}
    results["broadcast_returned"] = tuple(lr.load_full_state_dict(model, on_rank0, broadcast_from_rank0=True))
    results["broadcast_differ"] = _equal_to(model, second)
    # wrong shapes: refused with the key and both shapes, before anything is loaded (torch: "size mismatch")
    reference = _with_buffers(make_model(), 0)
    bad = {
        "transposed": {**first, "blocks.0.up.weight": first["blocks.0.up.weight"].T.contiguous()},
        "larger": {**first, "blocks.0.up.weight": torch.zeros(9, 13)},
        "0-d bias": {**first, "blocks.0.up.bias": torch.tensor(1.0)},
        "buffer": {**first, "scale": torch.zeros(4)},
    }
    results["refused"] = {}
    for case, state in bad.items():
        torch_error = _error(lambda: reference.load_state_dict(state))
        ours = _error(lambda: lr.load_full_state_dict(model, state))
        ours_broadcast = _error(lambda: lr.load_full_state_dict(model, state if dist.get_rank() == 0 else {},
                                                                broadcast_from_rank0=True))
        results["refused"][case] = (torch_error, ours, ours_broadcast)
    results["untouched"] = _equal_to(model, second)  # nothing of the refused loads reached the model
    # strict=False: the missing and unexpected keys are reported as torch reports them, the rest loads
    partial = {k: v for k, v in first.items() if k not in ("scale", "blocks.1.up.weight")}
    partial["extra.weight"] = torch.zeros(2)
    expected = reference.load_state_dict(partial, strict=False)
    results["strict_false"] = (sorted(map(sorted, expected)),
                               sorted(map(sorted, lr.load_full_state_dict(model, partial, strict=False))))
    kept = {**first, "scale": second["scale"], "blocks.1.up.weight": second["blocks.1.up.weight"]}
    results["strict_false_differ"] = _equal_to(model, kept)
    results["strict_error"] = _error(lambda: lr.load_full_state_dict(model, partial))
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_load_full_state_dict_loads_buffers_and_checks_shapes(dist_pool, world_size):
    for result in dist_pool(world_size).run(check_load_full_state_dict):
        assert result["returned"] == ([], []) and result["broadcast_returned"] == ([], []), result
        assert result["differ"] == [] and result["broadcast_differ"] == [], result  # buffers too
        for case, (torch_error, ours, ours_broadcast) in result["refused"].items():
            assert torch_error and "size mismatch" in torch_error, (case, torch_error)
            key = "scale" if case == "buffer" else "blocks.0.up"
            for error in (ours, ours_broadcast):  # every rank raises, none is left in a broadcast
                assert error and "shape mismatch" in error and key in error, (case, error)
        assert result["untouched"] == [], result
        torch_keys, our_keys = result["strict_false"]
        assert our_keys == torch_keys == [["blocks.1.up.weight", "scale"], ["extra.weight"]], result
        assert result["strict_false_differ"] == [], result
        error = result["strict_error"]
        assert error and "missing keys" in error and "unexpected keys" in error and "scale" in error, error


class _Extra(nn.Module):
    """A module with an extra state (``get_extra_state``: a dict, not a tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.note = {"version": 1}

    def get_extra_state(self) -> dict:
        return dict(self.note)

    def set_extra_state(self, state: dict) -> None:
        self.note = dict(state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def check_meta_models_and_extra_states() -> dict:
    """A model built on meta and sharded without ``to_empty`` gets its buffers from the load (they stayed on meta
    and the next forward failed, after a load that reported success); an extra state goes through
    ``full_state_dict(cpu_offload=True)`` (an AttributeError on its dict) and back."""
    results = {}
    source = _with_buffers(make_model(seed=5), 7).state_dict()
    for broadcast in (False, True):
        with torch.device("meta"):
            model = _with_buffers(make_model(), 0)
        lr.fully_shard(model, shard_granularity="row")
        given = source if not broadcast or dist.get_rank() == 0 else {}
        lr.load_full_state_dict(model, given, broadcast_from_rank0=broadcast)
        results[f"differ broadcast={broadcast}"] = _equal_to(model, source)
        results[f"forward broadcast={broadcast}"] = tuple(model(torch.zeros(2, 5, dtype=torch.long)).shape)
    model = lr.fully_shard(nn.Sequential(_Extra(), nn.Linear(4, 2)))
    model[0].note = {"version": 3}
    offloaded = lr.full_state_dict(model, cpu_offload=True)
    model[0].note = {"version": 0}
    lr.load_full_state_dict(model, offloaded)
    results["extra"] = (offloaded["0._extra_state"], model[0].note)
    return results


def test_meta_built_models_and_extra_states_load(dist_pool):
    for result in dist_pool(2).run(check_meta_models_and_extra_states):
        for broadcast in (False, True):
            assert result[f"differ broadcast={broadcast}"] == [], result
            assert result[f"forward broadcast={broadcast}"] == (2, 5, 37), result
        assert result["extra"] == ({"version": 3}, {"version": 3}), result
