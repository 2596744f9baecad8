"""SOAP on ragged shards vs a textbook single-process reference (world sizes 1, 2, 3, any layout).

The reference below is written from the paper's Algorithm 3 and the reference implementation's
choices that docs/optimizers.md lists (first step: statistics and eigenbases only; eigenbasis
refresh by one power iteration + QR with V permuted; bias-corrected step size), per tile on full
tensors, and Adam for 1-D parameters; that Adam is also checked against ``torch.optim.AdamW``
itself, fed from the second step on.

Every weight's dimensions are multiples of the 4x4 tiles: a non-square tile has a rank-deficient
first statistic, whose null-space eigenvectors any eigensolver may rotate at will, and SOAP's
per-coordinate Adam then legitimately depends on that rotation — two correct implementations
would differ at O(1), so such a tile cannot be compared to a reference. With square tiles the
eigenvalues are distinct and both sides agree to rounding: measured max |diff| 1.8e-7 after 10
steps (3 eigenbasis refreshes), asserted <= 1e-5 (issue 14's bound), while parameters move > 1e-2.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_ragged.optim import SOAP
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
    betas=(0.9, 0.95),
    shampoo_beta=0.8,
    eps=1e-8,
    weight_decay=0.01,
    precondition_frequency=3,  # refreshes after Adam steps 3, 6, 9
    max_preconditioner_dim=DIM,
)


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    # 12x8, 8x12, 4x8 weights: 6 + 6 + 2 square tiles; biases 12, 8, 4 (Adam)
    return nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 4))


def make_soap(named_params, **overrides) -> SOAP:
    return SOAP(named_params, **{**HYPER, **overrides})


def make_first_layer_soap(named_params) -> SOAP:
    return SOAP([p for n, p in named_params if n.startswith("0.")], **HYPER)  # unnamed, as Lightning modules pass them


def reference_soap(params: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]], untouched=None, lrs=None,
                   **overrides):
    """Textbook blocked SOAP on full tensors (loops over tiles), Adam for 1-D parameters.

    Weight decay in the reference implementation's order: ``p -= η·N``, then ``p -= lr·wd·p``.
    ``untouched(t, name, i, j)``: tile (i, j) of ``name`` (a vector: (0, 0), the whole vector) does
    not step at step t — state, Adam step count and elements stay; ``lrs``: learning rates by name.
    """
    h = {**HYPER, **overrides}
    beta1, beta2 = h["betas"]
    beta_s = h["shampoo_beta"] if h["shampoo_beta"] >= 0 else beta2
    params = {name: p.detach().clone() for name, p in params.items()}
    state = {}

    def step_size(lr, k):
        return lr * math.sqrt(1 - beta2**k) / (1 - beta1**k) if h.get("correct_bias", True) else lr

    for t, step_grads in enumerate(grads, start=1):
        for name, p in params.items():
            lr, wd = (lrs or {}).get(name, h["lr"]), h["weight_decay"]
            if p.dim() < 2:
                if untouched is not None and untouched(t, name, 0, 0):
                    continue
                if name not in state:  # the first gradient only starts the moments
                    state[name] = {"k": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p)}
                    continue
                s, g = state[name], step_grads[name]
                s["k"] += 1
                s["m"] = beta1 * s["m"] + (1 - beta1) * g
                s["v"] = beta2 * s["v"] + (1 - beta2) * g * g
                p -= step_size(lr, s["k"]) * s["m"] / (s["v"].sqrt() + h["eps"])
                p -= lr * wd * p
                continue
            G = step_grads[name].reshape(p.shape[0], -1)
            P = p.view(G.shape)
            for i in range(math.ceil(G.shape[0] / DIM)):
                for j in range(math.ceil(G.shape[1] / DIM)):
                    if untouched is not None and untouched(t, name, i, j):
                        continue
                    r, c = slice(i * DIM, (i + 1) * DIM), slice(j * DIM, (j + 1) * DIM)
                    g = G[r, c]
                    if (name, i, j) not in state:  # statistics and eigenbases only
                        s = state[name, i, j] = {"k": 0, "L": (1 - beta_s) * g @ g.T, "R": (1 - beta_s) * g.T @ g}
                        s["QL"] = torch.flip(torch.linalg.eigh(s["L"]).eigenvectors, dims=[1])
                        s["QR"] = torch.flip(torch.linalg.eigh(s["R"]).eigenvectors, dims=[1])
                        s["M"], s["V"] = torch.zeros_like(g), torch.zeros_like(g)
                        continue
                    s = state[name, i, j]
                    s["k"] += 1
                    k, QL, QR = s["k"], s["QL"], s["QR"]
                    rotated = QL.T @ g @ QR
                    s["M"] = beta1 * s["M"] + (1 - beta1) * g
                    s["V"] = beta2 * s["V"] + (1 - beta2) * rotated**2
                    N = QL @ ((QL.T @ s["M"] @ QR) / (s["V"].sqrt() + h["eps"])) @ QR.T
                    P[r, c] -= step_size(lr, k) * N
                    P[r, c] -= lr * wd * P[r, c]
                    s["L"] = beta_s * s["L"] + (1 - beta_s) * g @ g.T
                    s["R"] = beta_s * s["R"] + (1 - beta_s) * g.T @ g
                    if k % h["precondition_frequency"] == 0:
                        for side, (X, Q) in enumerate(((s["L"], QL), (s["R"], QR))):
                            order = torch.argsort(torch.diagonal(Q.T @ X @ Q), descending=True, stable=True)
                            new_q = torch.linalg.qr(X @ Q[:, order]).Q
                            s["V"] = s["V"][order, :] if side == 0 else s["V"][:, order]
                            s["QL" if side == 0 else "QR"] = new_q
    return params


def soap_against_reference() -> dict:
    """Per layout: max |sharded − reference|, how far it moved, collectives per step, the plan."""
    full_params = dict(make_mlp().named_parameters())
    expected = reference_soap(full_params, gradients(make_mlp(), STEPS))
    results = {}
    for layout in LAYOUTS:
        run = train_sharded(make_mlp, make_soap, layout, STEPS)
        full = run.pop("params")
        run["diff"] = max((full[n] - expected[n]).abs().max().item() for n in expected)
        run["moved"] = max((full[n] - full_params[n]).abs().max().item() for n in expected)
        results[layout] = run
    return results


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_soap_matches_reference_on_any_layout(dist_pool, world_size):
    per_rank = dist_pool(world_size).run(soap_against_reference)
    for layout, result in per_rank[0].items():
        assert result["moved"] > 1e-2, layout
        assert result["diff"] <= 1e-5, (layout, result)
        counts = [r[layout]["counts"] for r in per_rank]
        # split tiles: the gather and the scatter every step (step 1 moves nothing, but its statuses travel)
        expected = [2 if result["split"] else 0] * STEPS
        assert all(c == expected for c in counts), (layout, counts)
        assert sum(r[layout]["tiles"] for r in per_rank) == 6 + 6 + 2 == result["owned"] + result["split"]
    assert per_rank[0]["block4"]["split"] == 0
    if world_size > 1:  # the gather path really ran under every tile-cutting layout
        assert all(per_rank[0][layout]["split"] > 0 for layout in ("block6", "row", "element")), per_rank[0]


@pytest.mark.parametrize("world_size", [2, 3])
def test_soap_split_tiles_resume_bit_identical(dist_pool, tmp_path, world_size):
    for layout in ("element", "block6"):
        for result in dist_pool(world_size).run(resume_matches_uninterrupted, make_mlp, make_soap, layout, STEPS,
                                                str(tmp_path / str(world_size))):
            assert result["split"] > 0 and result["same_keys"] and result["unequal"] == [], (layout, result)


def test_soap_unsharded_without_bias_correction_and_default_shampoo_beta():
    """Plain tensors (one rank), shampoo_beta < 0 (use betas[1]), correct_bias=False and a strong weight decay.

    lr·wd = 0.05: decaying before the update instead of after (the reference's order) moves the
    result by ~lr·wd·η·|N| ≈ 5e-4 per step, far beyond the 1e-5 bound (measured: 3.4e-3 after 10
    steps, against 6.7e-8 in the reference's order).
    """
    overrides = dict(shampoo_beta=-1.0, correct_bias=False, weight_decay=5.0)
    model = make_mlp()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = make_soap(model.named_parameters(), **overrides)
    grads = gradients(model, STEPS)
    for step_grads in grads:
        for name, param in model.named_parameters():
            param.grad = step_grads[name].clone()
        optimizer.step()
    expected = reference_soap(start, grads, **overrides)
    assert max((p.detach() - expected[n]).abs().max().item() for n, p in model.named_parameters()) <= 1e-5
    state = optimizer.state_dict()
    assert state["ragged"]["0.weight"]["state_layout"] == {"tiles": "tiles"}
    assert state["ragged"]["0.bias"]["state_layout"] == {"step": "scalar", "exp_avg": "flat", "exp_avg_sq": "flat"}
    tile = state["state"]["0.weight"]["tiles"]["2,1"]
    assert set(tile) == {"step", "L", "R", "Q_L", "Q_R", "exp_avg", "exp_avg_sq"} and tile["step"] == STEPS - 1
    assert state["state"]["0.bias"]["step"] == STEPS - 1  # Adam steps: the first gradient only starts the state


def test_soap_vectors_are_torch_adamw_after_the_first_step():
    """A 1-D parameter: SOAP's first step only records state, then it is ``torch.optim.AdamW``'s Adam.

    AdamW adds eps to √v / √(1−β2ᵏ), SOAP (as its reference) to √v before the same bias
    correction: the updates differ by a relative ~eps·(√(1−β2ᵏ) − 1)/√v ≈ 1e-8 here. SOAP decays
    after the update (the reference's order), AdamW before: the oracle is AdamW without weight
    decay, then ``p ← p·(1 − lr·wd)``.
    """
    start = torch.randn(7)
    ours, theirs = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    soap = SOAP([ours], **{**HYPER, "max_preconditioner_dim": 1024})
    adamw = torch.optim.AdamW([theirs], lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"], weight_decay=0.0)
    generator = torch.Generator().manual_seed(3)
    for step in range(STEPS):
        ours.grad = torch.randn(7, generator=generator)
        theirs.grad = ours.grad.clone()
        soap.step()
        if step:
            adamw.step()
            with torch.no_grad():
                theirs.mul_(1 - HYPER["lr"] * HYPER["weight_decay"])
    assert (ours - theirs).abs().max().item() <= 1e-6  # measured 0 to 3e-8 (over 5 start seeds)
    assert (ours - start).abs().max().item() > 1e-2  # it trained
    assert soap.tile_plan.owned == soap.tile_plan.split == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(betas=(0.9, 1.0)), r"betas=\(0.9, 1.0\) is not supported; pass two values in \[0, 1\)"),
        (dict(shampoo_beta=1.0), r"shampoo_beta=1.0 is not supported"),
        (dict(precondition_frequency=0), r"precondition_frequency=0 is not supported; pass an int >= 1"),
        (dict(max_preconditioner_dim=2.5), r"max_preconditioner_dim=2.5 is not supported"),
        (dict(lr=-1.0), r"lr=-1.0 is not supported"),
    ],
)
def test_soap_refuses_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SOAP(make_mlp().parameters(), **kwargs)


def test_a_rank_without_a_gradient_leaves_the_tiles_it_holds_untouched(dist_pool):
    """As Shampoo's test, on 0.weight (12x8; "row" at 2 ranks: rows 0-2 on rank 0, 3-11 on rank 1, so band 0 is
    cut): tiles with a piece on the rank without the gradient are untouched, Adam step counts included."""
    drops = {4: (0, "0.weight"), 6: (1, "0.weight")}
    per_rank = dist_pool(2).run(missing_gradients_against_reference, make_mlp, make_soap, reference_soap, "row",
                                STEPS, DIM, drops)
    result = per_rank[0]
    assert result["kinds"] == {4: dict(split_untouched=2, whole_untouched=0, stepped=4),
                               6: dict(split_untouched=2, whole_untouched=4, stepped=0)}, result["kinds"]
    assert result["diff"] <= 1e-5 and result["undisturbed_diff"] > 1e-3, result
    assert all(r["counts"] == [2] * STEPS for r in per_rank), [r["counts"] for r in per_rank]


def test_first_eigenbases_fall_back_to_fp64_or_raise_on_every_rank(dist_pool):
    """Rank 1's eigh fails at step 1 (every tile's first eigenbases), 2 ranks, "row".

    Failing in fp32 only: the fp64 retry gives the same bases, the run equals the reference.
    Failing always: both ranks finish the step and raise; the tiles start at step 2 instead and
    training goes on with paired collectives.
    """
    fp32, always = (dist_pool(2).run(eigh_failure, make_mlp, make_soap, "row", 4, 1, failing) for failing in ("fp32", "always"))
    expected = reference_soap(dict(make_mlp().named_parameters()), gradients(make_mlp(), 4))
    for rank in range(2):
        assert fp32[rank]["outcomes"] == [("ok", 2)] * 4
        assert max((fp32[rank]["params"][n] - expected[n]).abs().max().item() for n in expected) <= 1e-5
        outcomes = always[rank]["outcomes"]
        assert outcomes[0][0] == "raised" and outcomes[1:] == [("ok", 2)] * 3, outcomes
        assert outcomes[0][1].startswith("SOAP.step: ") and "such a tile did not start" in outcomes[0][1]
        assert ("this rank (1) could not" if rank else "rank 1 could not") in outcomes[0][1], outcomes[0][1]
    # the tiles rank 1 owns started a step late, as the reference does with them untouched at step 1
    failed = set(always[0]["failed"])
    assert failed
    late = reference_soap(dict(make_mlp().named_parameters()), gradients(make_mlp(), 4),
                          untouched=lambda t, name, i, j: t == 1 and (name, f"{i},{j}") in failed)
    for rank in range(2):
        assert max((always[rank]["params"][n] - late[n]).abs().max().item() for n in late) <= 1e-5
        assert max((always[rank]["params"][n] - expected[n]).abs().max().item() for n in expected) > 1e-4


def test_finetuning_adds_layers_with_tiles_and_owners_of_their_own(dist_pool):
    """Lightning's ``BaseFinetuning.unfreeze_and_add_param_group`` at step 4 (2 ranks, "element": layer 0 whole on
    rank 0, 2.weight cut): the added 2-D layers get tiles and owners, the biases Adam state (it used to fail
    with KeyError 'exp_avg')."""
    per_rank = dist_pool(2).run(added_group_against_reference, make_mlp, make_first_layer_soap, reference_soap,
                                "element", STEPS, HYPER["lr"])
    for result in per_rank:
        assert result["added"] == ["2.weight", "2.bias", "4.weight", "4.bias"], result
        assert result["diff"] <= 1e-5 and result["moved"] > 1e-3, result
        assert result["counts"] == [0] * (ADD_AT - 1) + [2] * (STEPS - ADD_AT + 1), result["counts"]


def test_loading_soap_state_of_another_tile_size_is_refused():
    model = make_mlp()
    optimizer = make_soap(model.named_parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    with pytest.raises(ValueError, match=r"saved with max_preconditioner_dim=4, this optimizer has max_preconditioner_dim=8"):
        make_soap(model.named_parameters(), max_preconditioner_dim=8).load_state_dict(optimizer.state_dict())
