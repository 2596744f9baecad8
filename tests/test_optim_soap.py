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
eigenvalues are distinct and both sides agree to rounding: measured max |diff| 8.9e-8 after 10
steps (3 eigenbasis refreshes), asserted <= 1e-5 (issue 14's bound), while parameters move > 1e-2.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_ragged.optim import SOAP
from tests.tiled_runs import LAYOUTS, gradients, resume_matches_uninterrupted, train_sharded

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


def reference_soap(params: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]], **overrides):
    """Textbook blocked SOAP on full tensors (loops over tiles), Adam for 1-D parameters."""
    h = {**HYPER, **overrides}
    beta1, beta2 = h["betas"]
    beta_s = h["shampoo_beta"] if h["shampoo_beta"] >= 0 else beta2
    params = {name: p.detach().clone() for name, p in params.items()}
    tiles, moments = {}, {}
    for t, step_grads in enumerate(grads, start=1):
        k = t - 1
        if k and h.get("correct_bias", True):
            eta = h["lr"] * math.sqrt(1 - beta2**k) / (1 - beta1**k)
        else:
            eta = h["lr"]
        for name, p in params.items():
            if p.dim() < 2:
                m, v = moments.get(name, (torch.zeros_like(p), torch.zeros_like(p)))
                if k:
                    g = step_grads[name]
                    m, v = beta1 * m + (1 - beta1) * g, beta2 * v + (1 - beta2) * g * g
                    params[name] = p * (1 - h["lr"] * h["weight_decay"]) - eta * m / (v.sqrt() + h["eps"])
                moments[name] = (m, v)
                continue
            G = step_grads[name].reshape(p.shape[0], -1)
            D = torch.zeros_like(G)
            for i in range(math.ceil(G.shape[0] / DIM)):
                for j in range(math.ceil(G.shape[1] / DIM)):
                    r, c = slice(i * DIM, (i + 1) * DIM), slice(j * DIM, (j + 1) * DIM)
                    g = G[r, c]
                    s = tiles.setdefault((name, i, j), {})
                    if k == 0:
                        s["L"], s["R"] = (1 - beta_s) * g @ g.T, (1 - beta_s) * g.T @ g
                        s["QL"] = torch.flip(torch.linalg.eigh(s["L"]).eigenvectors, dims=[1])
                        s["QR"] = torch.flip(torch.linalg.eigh(s["R"]).eigenvectors, dims=[1])
                        s["M"], s["V"] = torch.zeros_like(g), torch.zeros_like(g)
                        continue
                    QL, QR = s["QL"], s["QR"]
                    rotated = QL.T @ g @ QR
                    s["M"] = beta1 * s["M"] + (1 - beta1) * g
                    s["V"] = beta2 * s["V"] + (1 - beta2) * rotated**2
                    D[r, c] = QL @ ((QL.T @ s["M"] @ QR) / (s["V"].sqrt() + h["eps"])) @ QR.T
                    s["L"] = beta_s * s["L"] + (1 - beta_s) * g @ g.T
                    s["R"] = beta_s * s["R"] + (1 - beta_s) * g.T @ g
                    if k % h["precondition_frequency"] == 0:
                        for side, (X, Q) in enumerate(((s["L"], QL), (s["R"], QR))):
                            order = torch.argsort(torch.diagonal(Q.T @ X @ Q), descending=True, stable=True)
                            new_q = torch.linalg.qr(X @ Q[:, order]).Q
                            s["V"] = s["V"][order, :] if side == 0 else s["V"][:, order]
                            s["QL" if side == 0 else "QR"] = new_q
            if k:
                params[name] = p * (1 - h["lr"] * h["weight_decay"]) - eta * D.reshape(p.shape)
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
        # split tiles: the gather every step, the scatter from step 2 (step 1 only gathers statistics)
        expected = [1] + [2] * (STEPS - 1) if result["split"] else [0] * STEPS
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
    """Plain tensors (one rank), shampoo_beta < 0 (use betas[1]) and correct_bias=False."""
    overrides = dict(shampoo_beta=-1.0, correct_bias=False)
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
    assert state["ragged"]["0.weight"]["state_layout"] == {"step": "scalar", "tiles": "tiles"}
    assert state["ragged"]["0.bias"]["state_layout"] == {"step": "scalar", "exp_avg": "flat", "exp_avg_sq": "flat"}
    assert set(state["state"]["0.weight"]["tiles"]["2,1"]) == {"L", "R", "Q_L", "Q_R", "exp_avg", "exp_avg_sq"}


def test_soap_vectors_are_torch_adamw_after_the_first_step():
    """A 1-D parameter: SOAP's first step only records state, then it is ``torch.optim.AdamW``.

    AdamW adds eps to √v / √(1−β2ᵏ), SOAP (as its reference) to √v before the same bias
    correction: the updates differ by a relative ~eps·(√(1−β2ᵏ) − 1)/√v ≈ 1e-8 here.
    """
    start = torch.randn(7)
    ours, theirs = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    soap = SOAP([ours], **{**HYPER, "max_preconditioner_dim": 1024})
    adamw = torch.optim.AdamW([theirs], lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"],
                              weight_decay=HYPER["weight_decay"])
    generator = torch.Generator().manual_seed(3)
    for step in range(STEPS):
        ours.grad = torch.randn(7, generator=generator)
        theirs.grad = ours.grad.clone()
        soap.step()
        if step:
            adamw.step()
    assert (ours - theirs).abs().max().item() <= 1e-6  # measured 3.7e-9
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
