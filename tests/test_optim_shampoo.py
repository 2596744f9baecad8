"""Block-diagonal Shampoo on ragged shards vs a plain single-process reference (world sizes 1, 2, 3)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

from lightning_ragged import RaggedShardBoundaryViolation, full_state_dict, fully_shard
from lightning_ragged.optim import Shampoo

DIM = 4
STEPS = 10
HYPER = dict(
    lr=0.01,
    betas=(0.9, 0.99),
    epsilon=1e-6,
    weight_decay=0.01,
    max_preconditioner_dim=DIM,
    precondition_frequency=3,
    start_preconditioning_step=2,  # root inverses at steps 2, 5, 8
    grafting_beta2=0.99,
    grafting_epsilon=1e-8,
)


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 13), nn.Tanh(), nn.Linear(13, 9), nn.Tanh(), nn.Linear(9, 3))


def gradients(shapes: dict[str, torch.Size], steps: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [{name: torch.randn(shape, generator=generator) for name, shape in shapes.items()} for _ in range(steps)]


def reference_shampoo(params: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]], grafting: str):
    """Textbook block-diagonal Shampoo on full tensors, written from the formulas (not the package)."""
    h = HYPER
    beta1, beta2 = h["betas"]
    params = {name: p.detach().clone() for name, p in params.items()}
    state = {}
    for t, step_grads in enumerate(grads, start=1):
        for name, p in params.items():
            G = step_grads[name].reshape(p.shape[0], -1) if p.dim() > 1 else step_grads[name].reshape(-1, 1)
            rows, cols = G.shape
            s = state.setdefault(name, {"M": torch.zeros_like(G), "A": torch.zeros_like(G), "tiles": {}})
            s["M"] = beta1 * s["M"] + (1 - beta1) * G
            if grafting == "adagrad":
                s["A"] = s["A"] + G * G
                A_hat = s["A"]
            else:
                s["A"] = h["grafting_beta2"] * s["A"] + (1 - h["grafting_beta2"]) * G * G
                A_hat = s["A"] / (1 - h["grafting_beta2"] ** t)
            graft = s["M"] / (A_hat.sqrt() + h["grafting_epsilon"])
            D = graft.clone()
            for i in range(math.ceil(rows / DIM)):
                for j in range(math.ceil(cols / DIM)):
                    r, c = slice(i * DIM, (i + 1) * DIM), slice(j * DIM, (j + 1) * DIM)
                    g = G[r, c]
                    tile = s["tiles"].setdefault((i, j), {})
                    factors = [("L", g @ g.T)] + ([("R", g.T @ g)] if cols > 1 else [])
                    for key, outer in factors:
                        tile[key] = beta2 * tile.get(key, torch.zeros_like(outer)) + (1 - beta2) * outer
                    root = 4 if cols > 1 else 2
                    if t >= h["start_preconditioning_step"] and (t - h["start_preconditioning_step"]) % h["precondition_frequency"] == 0:
                        for key, _ in factors:
                            X = tile[key].double() + h["epsilon"] * torch.eye(tile[key].shape[0], dtype=torch.float64)
                            lam, Q = torch.linalg.eigh(X)
                            tile[key + "^-1/p"] = (Q @ torch.diag(lam.clamp(min=h["epsilon"]) ** (-1 / root)) @ Q.T).float()
                    if t >= h["start_preconditioning_step"]:
                        P = tile["L^-1/p"] @ s["M"][r, c]
                        if cols > 1:
                            P = P @ tile["R^-1/p"]
                        D[r, c] = P * (graft[r, c].norm() / P.norm())
            p.mul_(1 - h["lr"] * h["weight_decay"]).sub_(h["lr"] * D.reshape(p.shape))
    return params


def sharded_shampoo(grafting: str, steps: int = STEPS):
    """Max |sharded − reference| after ``steps`` and the collectives each step issued."""
    model = fully_shard(make_mlp(), shard_granularity="block", block_rows=DIM)
    optimizer = Shampoo(model.parameters(), grafting=grafting, **HYPER)
    params = dict(model.named_parameters())
    full_params = dict(make_mlp().named_parameters())
    grads = gradients({name: p.shape for name, p in full_params.items()}, steps)
    counts = []
    for step_grads in grads:
        for name, param in params.items():
            start, end = param.ragged_shard.local_range
            param.grad = step_grads[name].reshape(-1)[start:end].clone()
        with CommDebugMode() as comm:
            optimizer.step()
        counts.append(comm.get_total_counts())
    expected = reference_shampoo(full_params, grads, grafting)
    full = full_state_dict(model)
    initial = make_mlp().state_dict()
    return dict(
        diff=max((full[n] - expected[n]).abs().max().item() for n in expected),
        moved=max((full[n] - initial[n]).abs().max().item() for n in expected),
        counts=counts,
        tiles=sum(len(s["tiles"]) for s in optimizer.state.values()),
    )


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_shampoo_matches_reference(dist_pool, world_size):
    for grafting in ("adagrad", "adam"):
        per_rank = dist_pool(world_size).run(sharded_shampoo, grafting)
        for result in per_rank:
            assert result["moved"] > 1e-2
            assert result["diff"] <= 1e-5, (grafting, result)
            assert result["counts"] == [0] * STEPS
        # every tile is held by exactly one rank: (13x10 → 4x3) + (9x13 → 3x4) + (3x9 → 1x3) + biases 4 + 3 + 1
        assert sum(r["tiles"] for r in per_rank) == 12 + 12 + 3 + 4 + 3 + 1


def shampoo_on_element_shards():
    model = fully_shard(make_mlp(), shard_granularity="element")
    try:
        Shampoo(model.parameters(), max_preconditioner_dim=DIM)
    except RaggedShardBoundaryViolation as error:
        return str(error)
    return None


def test_split_tile_raises_boundary_violation(dist_pool):
    messages = dist_pool(2).run(shampoo_on_element_shards)
    assert messages[0] is not None and messages[0] == messages[1]
    assert messages[0].startswith("RaggedShard boundary violation:")
    assert "block_rows=4" in messages[0] and "parameter '" in messages[0]


def test_shampoo_state_dict_keys_tiles_globally():
    model = make_mlp()
    optimizer = Shampoo(model.named_parameters(), **HYPER)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    state = optimizer.state_dict()
    assert set(state["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"}
    assert set(state["state"]["0.weight"]["tiles"]) == {f"{i},{j}" for i in range(4) for j in range(3)}
    assert state["ragged"]["0.weight"]["state_layout"]["tiles"] == "tiles"
    again = Shampoo(model.named_parameters(), **HYPER)
    again.load_state_dict(state)
    torch.testing.assert_close(again.state[model[0].weight]["tiles"]["1,2"]["L"], optimizer.state[model[0].weight]["tiles"]["1,2"]["L"])
