"""``MuonWithAuxAdamW``: the usual recipe — Muon on hidden matrices, AdamW on the rest — as ONE optimizer.

Lightning's automatic optimization takes one optimizer, so ``configure_optimizers`` returns
this with two param groups (``muon_param_groups(self)`` builds them)::

    muon, adamw = split_muon_params(self)  # embeddings, head, norms, biases -> AdamW
    return MuonWithAuxAdamW([
        dict(params=[p for _, p in muon], use_muon=True, lr=0.02, weight_decay=0.1),
        dict(params=[p for _, p in adamw], use_muon=False, lr=3e-3, weight_decay=0.01),
    ])

Groups with ``use_muon=True`` follow ``Muon`` (same keys and defaults; keyword arguments such as
``qkv_heads`` go to ``Muon``); the others follow
``torch.optim.AdamW`` (``lr``, ``betas``, ``eps``, ``weight_decay``, ``amsgrad``, ``maximize``), stepped by torch's own
functional ``torch.optim.adamw.adamw`` with AdamW's defaults, element-wise on the local
shards, so any granularity works.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch.optim.adamw import adamw

from lightning_ragged.optim.muon import Muon, split_muon_params
from lightning_ragged.optim.shards import local_flat

ADAMW_DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, maximize=False)


def muon_param_groups(
    named_params: Iterable[tuple[str, torch.Tensor]] | torch.nn.Module,
    muon: dict[str, Any] | None = None,
    adamw: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Two named param groups (Muon for hidden matrices and 3-D expert stacks, AdamW for the rest;
    see ``split_muon_params``). Per-head QKV is a ``MuonWithAuxAdamW(groups, qkv_heads=...)`` argument."""
    muon_named, adamw_named = split_muon_params(named_params)
    groups = []
    for named, use_muon, extra in ((muon_named, True, muon), (adamw_named, False, adamw)):
        if named:
            groups.append(
                dict(params=[p for _, p in named], param_names=[n for n, _ in named], use_muon=use_muon, **(extra or {}))
            )
    return groups


class MuonWithAuxAdamW(Muon):
    """Muon for groups with ``use_muon=True``, AdamW for the others, in one ``step()``."""

    def __init__(self, param_groups: list[dict[str, Any]], **muon_defaults: Any) -> None:
        param_groups = list(param_groups)
        for group in param_groups:
            if not isinstance(group, dict):  # model.parameters(): "Tensor.__contains__ only supports Tensor ..."
                raise TypeError(
                    f"MuonWithAuxAdamW takes param groups, not {type(group).__name__}s: pass "
                    "muon_param_groups(model) (Muon for the hidden matrices, AdamW for the rest)"
                )
            if "use_muon" not in group:
                raise ValueError("every param group of MuonWithAuxAdamW needs use_muon=True or use_muon=False")
        super().__init__(param_groups, **muon_defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``; a group without ``use_muon`` (Lightning's ``BaseFinetuning`` adds
        ``{"params", "lr"}``) steps with AdamW, which fits any shape; missing AdamW keys get AdamW's defaults."""
        group = dict(param_group)
        group.setdefault("use_muon", False)
        if not group["use_muon"]:
            for key, value in ADAMW_DEFAULTS.items():
                group.setdefault(key, value)
        super().add_param_group(group)

    def _muon_params(self, group: dict[str, Any]) -> list[torch.Tensor]:
        return group["params"] if group["use_muon"] else []

    def state_layout(self, param: torch.Tensor) -> dict[str, str]:
        return {"momentum_buffer": "flat", "step": "scalar", "exp_avg": "flat", "exp_avg_sq": "flat",
                "max_exp_avg_sq": "flat"}

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self.evaluate_closure(closure)
        self._muon_step([g for g in self.param_groups if g["use_muon"]])
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adamw_group(group)
        return loss

    def _adamw_group(self, group: dict[str, Any]) -> None:
        """``torch.optim.AdamW``'s step (its functional, its defaults) on the local flat shards."""
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
        for param in group["params"]:
            if param.grad is None:
                continue
            flat = local_flat(param)
            state = self.state[param]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(flat)
                state["exp_avg_sq"] = torch.zeros_like(flat)
            if group["amsgrad"] and "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = torch.zeros_like(flat)
            params.append(flat)
            grads.append(local_flat(param.grad))
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            if group["amsgrad"]:
                max_exp_avg_sqs.append(state["max_exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        adamw(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, amsgrad=group["amsgrad"], beta1=beta1,
            beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
            maximize=group["maximize"],
        )
