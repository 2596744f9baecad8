"""Block-diagonal Shampoo on ragged shards vs a plain single-process reference (world sizes 1, 2, 3).

Layouts (``tests/tiled_runs.py``): every tile whole on one rank ("block4": no collective) and
three that cut tiles ("block6", "row", "element": split tiles gathered to their owner, one
all-to-all each way per step). Both sides run the same fp32 formulas on the same gradients and
differ only in how float operations are ordered (a root inverse as Q·diag(λ)·Qᵀ vs (Q·λ)·Qᵀ,
``p·(1−lr·wd) − lr·D`` as one expression or two in-place ops), so the results agree to rounding:
measured max |diff| 6.9e-7 (AdaGrad grafting) and 1.2e-6 (Adam grafting) after 10 steps on this
machine (the same as before the per-tile step counts; CPU kernels round differently, 2.6e-7 and
4.9e-7 were measured elsewhere), the same under every layout and world size, asserted <= 1e-5
(issue 14's bound), while the parameters move > 1e-2.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

from lightning_ragged.layout.ragged_shard import RaggedShard
from lightning_ragged.optim import Shampoo
from tests.tiled_runs import (
    ADD_AT,
    LAYOUTS,
    added_group_against_reference,
    eigh_failure,
    gradients,
    missing_gradients_against_reference,
    resume_matches_uninterrupted,
    train_sharded,
)

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
    # 12x8, 8x12 and 5x8 weights (a 1-row tile band), vectors of 12, 8, 5: cut by every layout but "block4"
    return nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 5))


def reference_shampoo(params: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]], grafting: str = "adagrad",
                      untouched=None, lrs=None):
    """Textbook block-diagonal Shampoo on full tensors, tile by tile, written from the formulas (not the package).

    ``untouched(t, name, i, j)``: tile (i, j) of ``name`` does not step at step t — torch's rule for a
    parameter without gradient, per tile: its state, its step count and its elements stay as they
    are. ``lrs``: learning rates by name (default ``HYPER["lr"]``).
    """
    h = HYPER
    beta1, beta2 = h["betas"]
    start, beta_g = h["start_preconditioning_step"], h["grafting_beta2"]
    params = {name: p.detach().clone() for name, p in params.items()}
    state = {}
    for t, step_grads in enumerate(grads, start=1):
        for name, p in params.items():
            G = step_grads[name].reshape(p.shape[0], -1) if p.dim() > 1 else step_grads[name].reshape(-1, 1)
            P = p.view(G.shape)
            lr = (lrs or {}).get(name, h["lr"])
            rows, cols = G.shape
            for i in range(math.ceil(rows / DIM)):
                for j in range(math.ceil(cols / DIM)):
                    if untouched is not None and untouched(t, name, i, j):
                        continue
                    r, c = slice(i * DIM, (i + 1) * DIM), slice(j * DIM, (j + 1) * DIM)
                    g = G[r, c]
                    s = state.setdefault((name, i, j), {"k": 0, "M": torch.zeros_like(g), "A": torch.zeros_like(g)})
                    s["k"] += 1
                    k = s["k"]
                    s["M"] = beta1 * s["M"] + (1 - beta1) * g
                    if grafting == "adagrad":
                        s["A"] = s["A"] + g * g
                        A_hat = s["A"]
                    else:
                        s["A"] = beta_g * s["A"] + (1 - beta_g) * g * g
                        A_hat = s["A"] / (1 - beta_g**k)
                    graft = s["M"] / (A_hat.sqrt() + h["grafting_epsilon"])
                    factors = [("L", g @ g.T)] + ([("R", g.T @ g)] if cols > 1 else [])
                    for key, outer in factors:
                        s[key] = beta2 * s.get(key, torch.zeros_like(outer)) + (1 - beta2) * outer
                    root = 4 if cols > 1 else 2
                    if k >= start and (k - start) % h["precondition_frequency"] == 0:
                        for key, _ in factors:
                            X = s[key].double() + h["epsilon"] * torch.eye(s[key].shape[0], dtype=torch.float64)
                            lam, Q = torch.linalg.eigh(X)
                            s[key + "^-1/p"] = (Q @ torch.diag(lam.clamp(min=h["epsilon"]) ** (-1 / root)) @ Q.T).float()
                    D = graft
                    if k >= start:
                        pre = s["L^-1/p"] @ s["M"]
                        if cols > 1:
                            pre = pre @ s["R^-1/p"]
                        D = pre * (graft.norm() / pre.norm())
                    P[r, c] = P[r, c] * (1 - lr * h["weight_decay"]) - lr * D
    return params


def make_shampoo(named_params, grafting: str = "adagrad") -> Shampoo:
    return Shampoo(named_params, grafting=grafting, **HYPER)


def make_first_layer_shampoo(named_params) -> Shampoo:
    return Shampoo([p for n, p in named_params if n.startswith("0.")], **HYPER)  # unnamed, as Lightning modules pass them


def shampoo_against_reference() -> dict:
    """Per (layout, grafting): max |sharded − reference|, how far it moved, counts per step, the plan."""
    full_params = dict(make_mlp().named_parameters())
    grads = gradients(make_mlp(), STEPS)
    results = {}
    for grafting in ("adagrad", "adam"):
        expected = reference_shampoo(full_params, grads, grafting)
        for layout in LAYOUTS:
            count = grafting == "adam"  # the exchange does not depend on the grafting: count once per layout
            run = train_sharded(make_mlp, functools.partial(make_shampoo, grafting=grafting), layout, STEPS, count)
            full = run.pop("params")
            run["diff"] = max((full[n] - expected[n]).abs().max().item() for n in expected)
            run["moved"] = max((full[n] - full_params[n]).abs().max().item() for n in expected)
            results[layout, grafting] = run
    return results


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_shampoo_matches_reference_on_any_layout(dist_pool, world_size):
    per_rank = dist_pool(world_size).run(shampoo_against_reference)
    for key, result in per_rank[0].items():
        assert result["moved"] > 1e-2, key
        assert result["diff"] <= 1e-5, (key, result)
        if key[1] == "adam":  # counted: one all-to-all gathers every split tile's gradient, one scatters back
            counts = [r[key]["counts"] for r in per_rank]
            assert all(c == [2 if result["split"] else 0] * STEPS for c in counts), (key, counts)
        # every tile's state is on exactly one rank: (12x8 → 3x2) + (8x12 → 2x3) + (5x8 → 2x2) + biases 3 + 2 + 2
        assert sum(r[key]["tiles"] for r in per_rank) == 6 + 6 + 4 + 3 + 2 + 2 == result["owned"] + result["split"]
    assert per_rank[0]["block4", "adam"]["split"] == 0  # 4-row blocks never cut a 4-row tile band
    if world_size > 1:  # the gather path really ran under every tile-cutting layout
        assert all(per_rank[0][layout, "adam"]["split"] > 0 for layout in ("block6", "row", "element"))


@pytest.mark.parametrize("world_size", [2, 3])
def test_shampoo_split_tiles_resume_bit_identical(dist_pool, tmp_path, world_size):
    for layout in ("element", "block6"):
        for result in dist_pool(world_size).run(resume_matches_uninterrupted, make_mlp, make_shampoo, layout, STEPS,
                                                str(tmp_path / str(world_size))):
            assert result["split"] > 0 and result["same_keys"] and result["unequal"] == [], (layout, result)


def _sharded_param(shape, rank_ranges, rank):
    """A stand-in for a sharded parameter: this rank's flat piece carrying its RaggedShard."""
    start, end = rank_ranges[rank]
    param = torch.nn.Parameter(torch.zeros(end - start))
    param.ragged_shard = RaggedShard("w", torch.Size(shape), 1, tuple(rank_ranges), rank)
    return param


def test_split_tiles_go_to_the_least_loaded_rank():
    """A 10x8 matrix in 4x4 tiles cut at rows 5 and 7 of 3 ranks: band 1 is split, both its tiles to rank 1."""
    rows, cols = 10, 8
    param = _sharded_param((rows, cols), ((0, 5 * cols), (5 * cols, 7 * cols), (7 * cols, rows * cols)), 0)
    optimizer = Shampoo([("w", param)], max_preconditioner_dim=4)
    tiles = {t.tile_id: t for t in optimizer.tiles(param)}
    assert [tiles[f"0,{j}"].root for j in range(2)] == [0, 0]  # rows 0-3 whole on rank 0
    assert [tiles[f"2,{j}"].root for j in range(2)] == [2, 2]  # rows 8-9 whole on rank 2
    # rows 4-7 span ranks 0 (row 4), 1 (rows 5-6) and 2 (row 7): pieces in tile order
    assert tiles["1,0"].pieces == ((0, 4), (4, 12), (12, 16))
    # loads before: rank 0 2·(64+64), rank 1 0, rank 2 2·(8+64); each split tile costs 128
    assert (tiles["1,0"].root, tiles["1,1"].root) == (1, 1)  # rank 1 stays below rank 2 after the first (128 < 144)
    assert optimizer.tile_plan.cost_per_rank[0] == [256, 256, 144]
    assert (optimizer.tile_plan.owned, optimizer.tile_plan.split) == (4, 2)


def test_tile_pieces_are_read_and_updated_in_place():
    """Ranks cut a 7x10 matrix mid-row (element granularity); 3x4 tiles: every piece against the full tensor."""
    shape, dim = (7, 10), 3
    ranges = ((0, 13), (13, 13), (13, 47), (47, 70))  # an empty rank, cuts inside rows 1 and 4
    full = torch.arange(70.0).view(shape)
    seen = torch.zeros(shape)
    for rank, (start, end) in enumerate(ranges):
        param = _sharded_param(shape, ranges, rank)
        local = full.reshape(-1)[start:end].clone()
        for tile in Shampoo([("w", param)], max_preconditioner_dim=dim).tiles(param):
            block = full[tile.row0 : tile.row0 + tile.shape[0], tile.col0 : tile.col0 + tile.shape[1]]
            first, last = tile.pieces[rank]
            assert torch.equal(tile.read(local), block.reshape(-1)[first:last])  # the piece, in tile order
            tile.add_(local, torch.ones(last - first), alpha=1000.0)
        seen.view(-1)[start:end] = local
    assert torch.equal(seen, full + 1000.0)  # every element updated exactly once, in place


def _stepped_once() -> tuple[nn.Module, Shampoo, dict]:
    """The MLP, a Shampoo after one step on all-ones gradients, and its state dict."""
    model = make_mlp()
    optimizer = Shampoo(model.named_parameters(), **HYPER)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    return model, optimizer, optimizer.state_dict()


def test_shampoo_state_dict_keys_tiles_globally():
    model, optimizer, state = _stepped_once()
    assert state["ragged"]["0.weight"]["state_layout"] == {"tiles": "tiles"}
    assert set(state["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"}
    assert set(state["state"]["0.weight"]["tiles"]) == {f"{i},{j}" for i in range(3) for j in range(2)}
    assert state["state"]["0.weight"]["tiles"]["1,1"]["step"] == 1  # every tile counts its own steps
    again = Shampoo(model.named_parameters(), **HYPER)
    again.load_state_dict(state)
    torch.testing.assert_close(again.state[model[0].weight]["tiles"]["1,1"]["L"], optimizer.state[model[0].weight]["tiles"]["1,1"]["L"])


def test_a_rank_without_a_gradient_leaves_the_tiles_it_holds_untouched(dist_pool):
    """2 ranks, "row": 2.weight (8x12) is rows 0-1 on rank 0, rows 2-7 on rank 1 — its first 4-row band is cut.

    Step 4, rank 0 drops the gradient: the cut band is untouched on both ranks (its owner learns it from
    the mark), the band whole on rank 1 steps. Step 6, rank 1 drops it: every tile is untouched, rank
    0's pieces get no weight decay either. Nothing hangs (a 30 s collective timeout would raise), the
    exchange runs every step, and later steps count per tile (Adam grafting's bias correction).
    """
    drops = {4: (0, "2.weight"), 6: (1, "2.weight")}
    per_rank = dist_pool(2).run(missing_gradients_against_reference, make_mlp,
                                functools.partial(make_shampoo, grafting="adam"),
                                functools.partial(reference_shampoo, grafting="adam"), "row", STEPS, DIM, drops)
    result = per_rank[0]
    assert result["kinds"] == {4: dict(split_untouched=3, whole_untouched=0, stepped=3),
                               6: dict(split_untouched=3, whole_untouched=3, stepped=0)}, result["kinds"]
    assert result["diff"] <= 1e-5 and result["undisturbed_diff"] > 1e-3, result
    assert all(r["counts"] == [2] * STEPS for r in per_rank), [r["counts"] for r in per_rank]


@pytest.mark.parametrize("layout", ["row", "block4"])
def test_a_failed_eigendecomposition_raises_after_the_step_on_every_rank_it_concerns(dist_pool, layout):
    """Rank 1's eigh fails (every retry) at step 2, the first root inverses.

    "row" (split tiles, 2 all-to-alls): the status rides the scatter, both ranks finish the step and
    raise; training goes on in step (steps 3, 4 pair their collectives). "block4" (no collective in
    the step): only rank 1 can know; it raises, rank 0 finishes.
    """
    per_rank = dist_pool(2).run(eigh_failure, make_mlp, make_shampoo, layout, 4, 2, "always")
    collectives = 2 if layout == "row" else 0
    for rank, result in enumerate(per_rank):
        outcomes = result["outcomes"]
        assert [o for i, o in enumerate(outcomes) if i != 1] == [("ok", collectives)] * 3, outcomes
        if rank == 0 and layout == "block4":
            assert outcomes[1] == ("ok", 0)
            continue
        kind, message = outcomes[1]
        assert kind == "raised", outcomes
        assert message.startswith("Shampoo.step: ") and "took its graft direction" in message, message
        if rank == 1:
            assert "this rank (1) could not eigendecompose tile '" in message and "injected" in message, message
        else:
            assert "rank 1 could not eigendecompose tile '" in message and " of '" in message, message


def test_finetuning_adds_layers_with_tiles_and_owners_of_their_own(dist_pool):
    """Lightning's ``BaseFinetuning.unfreeze_and_add_param_group`` at step 4 (2 ranks, "row").

    Layer 0 is whole on rank 0 (no collective); the added layers bring split tiles (2 all-to-alls
    from then on) and train at Lightning's lr / 10, as the reference does from step 4.
    """
    per_rank = dist_pool(2).run(added_group_against_reference, make_mlp, make_first_layer_shampoo, reference_shampoo,
                                "row", STEPS, HYPER["lr"])
    for result in per_rank:
        assert result["added"] == ["2.weight", "2.bias", "4.weight", "4.bias"], result
        assert result["diff"] <= 1e-5 and result["moved"] > 1e-3, result
        assert result["counts"] == [0] * (ADD_AT - 1) + [2] * (STEPS - ADD_AT + 1), result["counts"]
        assert result["split"] > 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lr=-1.0), r"lr=-1.0 is not supported; pass a learning rate >= 0"),
        (dict(betas=(1.0, 1.0)), r"betas=\(1.0, 1.0\) is not supported; pass \(momentum in \[0, 1\)"),
        (dict(betas=(0.9, 1.5)), r"betas=\(0.9, 1.5\) is not supported"),
        (dict(epsilon=0.0), r"epsilon=0.0 is not supported; pass a finite value > 0"),
        (dict(grafting="adam", grafting_beta2=1.0), r"grafting_beta2=1.0 is not supported; pass a value in \[0, 1\)"),
        (dict(grafting_epsilon=-1.0), r"grafting_epsilon=-1.0 is not supported; pass a value >= 0"),
        (dict(weight_decay=-0.1), r"weight_decay=-0.1 is not supported"),
        (dict(grafting="sgd"), r"grafting='sgd' is not supported"),
        (dict(max_preconditioner_dim=0), r"max_preconditioner_dim=0 is not supported; pass an int >= 1"),
    ],
)
def test_shampoo_refuses_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Shampoo(make_mlp().parameters(), **kwargs)


def test_shampoo_refuses_a_bad_param_group_and_keeps_its_groups():
    model = make_mlp()
    optimizer = Shampoo(model[0].parameters(), **HYPER)
    with pytest.raises(ValueError, match=r"grafting_beta2=1.0 is not supported"):
        optimizer.add_param_group({"params": list(model[2].parameters()), "grafting": "adam", "grafting_beta2": 1.0})
    assert len(optimizer.param_groups) == 1 and optimizer.tiles(model[2].weight) == []


def test_loading_state_of_another_tile_geometry_is_refused_before_anything_changes():
    model, optimizer, state = _stepped_once()
    other = Shampoo(model.named_parameters(), **{**HYPER, "max_preconditioner_dim": 8})
    with pytest.raises(ValueError, match=r"param group 0 was saved with max_preconditioner_dim=4, this optimizer has "
                                         r"max_preconditioner_dim=8; .* build the optimizer with max_preconditioner_dim=4"):
        other.load_state_dict(state)
    assert not other.state and other.param_groups[0]["max_preconditioner_dim"] == 8
    # same names and tile size, other shapes: 0.weight 12x6 has a 4x2 tile "0,1", 8x8 no tile "2,0"
    narrower = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 5))
    with pytest.raises(ValueError, match=r"saved 'momentum' of tile '0,1' of '0.weight' has shape \(4, 4\), the tile "
                                         r"\(4x2\) needs \(4, 2\)"):
        Shampoo(narrower.named_parameters(), **HYPER).load_state_dict(state)
    shorter = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 5))
    with pytest.raises(ValueError, match=r"state of '0.weight' has tile '2,0', which its global shape \(8, 8\) in tiles "
                                         r"of max_preconditioner_dim=4 does not have"):
        Shampoo(shorter.named_parameters(), **HYPER).load_state_dict(state)


def check_plain_and_sharded_params_in_one_optimizer() -> float:
    """A plain tensor (a one-rank shard, group ``None``) beside parameters sharded over the default group (also
    named ``None``): each is its own shard group, so the plain one steps exactly as it would alone."""
    import lightning_ragged as lr

    model = lr.fully_shard(make_mlp(), shard_granularity="row")
    plain = nn.Parameter(torch.randn(5, 3, generator=torch.Generator().manual_seed(2)))
    alone = nn.Parameter(plain.detach().clone())
    together = Shampoo([plain, *model.parameters()], **HYPER)
    by_itself = Shampoo([alone], **HYPER)
    for step in range(3):
        grad = torch.randn(5, 3, generator=torch.Generator().manual_seed(10 + step))
        plain.grad, alone.grad = grad.clone(), grad.clone()
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        together.step()
        by_itself.step()
    return (plain - alone).abs().max().item()


def test_a_plain_tensor_beside_sharded_parameters_is_its_own_shard_group(dist_pool):
    assert dist_pool(2).run(check_plain_and_sharded_params_in_one_optimizer) == [0.0, 0.0]
