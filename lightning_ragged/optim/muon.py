"""Muon on ragged shards: ``torch.optim.Muon``'s algorithm, Newton–Schulz on whole matrices.

The matrices are the 2-D weights, each expert of a fused ``[E, a, b]`` stack and, opt-in
(``qkv_heads``), each head of a fused QKV weight (``optim/muon_matrices.py``); each is treated as
``torch.optim.Muon`` treats a separate parameter of its shape. Per step, for every parameter
with a gradient (all element-wise work on the local flat shard, exactly as ``torch.optim.Muon``
does it on the full tensor):

1. ``buf.lerp_(grad, 1 - momentum)``; ``update = grad.lerp(buf, momentum)`` (nesterov) or ``buf``.
2. Newton–Schulz (``torch.optim._muon._zeropower_via_newtonschulz``: 5 steps in bf16 with
   coefficients (3.4445, −4.7750, 2.0315)) on the *whole* matrix:

   * a matrix that lies whole in one rank's segment (``shard_granularity="muon"`` or
     ``"matrix"``; ``"muon"`` for expert stacks; ``"block"`` with ``block_rows=d`` for heads; or a
     plan that happens to keep it whole) is orthogonalized by its owner — no collective;
     the new values reach the other ranks through the next all-gather;
   * a matrix split across ranks is sent to a root rank chosen by load balancing
     (``optim/owners.py``: greedy, largest first, experts and heads as units, on Newton–Schulz FLOPs
     ≈ 5·(4a²b + 2a³) for a ≤ b, counting the owned matrices' work too), orthogonalized there and its pieces sent back. All
     split matrices of a shard group travel in **one** asynchronous ``all_to_all_single``
     each way (uneven splits; works on gloo and NCCL; ``optim/tile_exchange.py``, shared with Shampoo
     and SOAP), in bf16 — Newton–Schulz casts to
     bf16 first, so sending bf16 is exact. The owners' Newton–Schulz runs while the gather
     is in flight, and the roots apply their own pieces while the scatter is in flight.
3. ``param.mul_(1 - lr·weight_decay)``; ``param.add_(O, alpha=-adjusted_lr)`` with
   ``adjusted_lr`` from ``adjust_lr_fn`` on the matrix's ``[A, B]`` ("original": √max(1, A/B);
   "match_rms_adamw": 0.2·√max(A, B)).

Roots and split sizes follow from the parameters and the layout alone, never from which
parameters have gradients, so every rank issues the exchange whatever its gradients (the
exchange is reused while they stay the same).

**The matrix (expert, head) is the unit of a step**: it *steps* — its momentum takes the
gradient, its elements get weight decay and the update — or it is left *untouched*, as
``torch.optim.Muon`` leaves a parameter whose ``grad`` is None (momentum included). A whole
matrix steps when its owner has a gradient. A split matrix steps when every rank holding a
piece of it has one (Newton–Schulz needs the whole update): each piece travels to the root
with a "has a gradient" mark (zeros when not), and comes back with a "stepped" mark; a rank
that moved its piece's momentum before knowing puts the old values back (kept as a copy of its
split pieces for the step). So a rank that sets a split parameter's ``grad`` to None (a manual
edit, skipping a non-finite gradient, freezing on one rank) hangs nobody: the matrices it holds
a piece of are untouched on every rank, the others step. Under ``fully_shard`` ranks agree on
which parameters have gradients (a reduced group sets every shard's ``.grad``, possibly empty),
so all of a parameter's matrices step or none do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from lightning_ragged.optim.muon_matrices import HeadSpec, Ranges, matrix_layout, matrix_pieces
from lightning_ragged.optim.named_state import RaggedOptimizer
from lightning_ragged.optim.owners import Item, OwnerPlan
from lightning_ragged.optim.shards import local_flat, shard_group_key
from lightning_ragged.optim.tile_exchange import SplitExchange
from lightning_ragged.layout.granularity import NON_MUON_NAME_PARTS, is_muon_matrix
from lightning_ragged.layout.ragged_shard import RaggedShard, shard_of


def ns_flops(shape: Iterable[int], ns_steps: int = DEFAULT_NS_STEPS) -> int:
    """Multiply-add FLOPs of Newton–Schulz on a matrix: per step X·Xᵀ (2a²b), B·B (2a³), B·X (2a²b)."""
    a, b = sorted(int(d) for d in shape)
    return ns_steps * (4 * a * a * b + 2 * a**3)


def split_muon_params(
    named_params: Iterable[tuple[str, torch.Tensor]] | torch.nn.Module,
    non_muon: Iterable[str] = NON_MUON_NAME_PARTS,
) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """Split parameters into (Muon: hidden matrices and expert stacks, AdamW: everything else).

    A parameter goes to Muon when its *global* shape is 2-D, or 3-D (a fused ``[E, a, b]``
    expert stack: one matrix per expert) — sharded parameters are 1-D views; their
    ``ragged_shard.global_shape`` is used — and its name contains none of ``non_muon``
    (embeddings, positional tables, the output head): ``is_muon_matrix``, the rule
    ``shard_granularity="muon"`` shards by. Given a module, the weights of its
    ``nn.Embedding`` layers (and anything tied to them) and of its convolutions (a Conv1d
    weight is 3-D but no expert stack) also go to AdamW.
    """
    embedding_ids: set[int] = set()
    if isinstance(named_params, torch.nn.Module):
        not_matrices = (torch.nn.Embedding, torch.nn.modules.conv._ConvNd)
        embedding_ids = {id(p) for m in named_params.modules() if isinstance(m, not_matrices) for p in m.parameters()}
        named_params = named_params.named_parameters()
    parts = tuple(non_muon)
    muon, other = [], []
    for item in named_params:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(  # model.parameters() gave "too many values to unpack (expected 2)"
                f"named_params holds {type(item).__name__} items: pass the model or model.named_parameters() "
                "((name, parameter) pairs: the names decide embeddings and heads)"
            )
        name, param = item
        hidden = id(param) not in embedding_ids and is_muon_matrix(name, shard_of(param, name).global_shape, parts)
        (muon if hidden else other).append((name, param))
    return muon, other


@dataclass
class _Job(Item):
    """One matrix in this step: a whole 2-D parameter, one expert or one head."""

    param: torch.Tensor
    group: dict[str, Any]
    shard: RaggedShard  # the parameter's
    shape: tuple[int, int]
    pieces: Ranges  # every rank's piece of this matrix, relative to the matrix
    update: torch.Tensor | None  # this rank's piece of the momentum update (fp32); None: no gradient here
    local_start: int  # where that piece starts in this rank's flat shard of the parameter
    root: int = -1  # rank (in its shard group) that runs Newton–Schulz: its owner
    old_momentum: torch.Tensor | None = None  # a split piece's momentum before this step (put back if it does not step)

    def piece(self, rank: int) -> tuple[int, int]:
        return self.pieces[rank]

    def local(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the matrix in ``flat``, a tensor laid out as the parameter's local flat shard."""
        return flat[self.local_start : self.local_start + self.piece_numel(self.shard.rank)]

    def local_param(self) -> torch.Tensor:
        """This rank's piece of the matrix in the parameter's local flat shard."""
        return self.local(local_flat(self.param))

    def holds_split_piece(self) -> bool:
        """Whether this rank holds part, not all, of the matrix (so it is split)."""
        return 0 < self.piece_numel(self.shard.rank) < self.numel


class Muon(RaggedOptimizer):
    """``torch.optim.Muon`` for ragged-sharded (or plain) 2-D parameters and 3-D expert stacks.

    Same arguments and defaults as ``torch.optim.Muon``, plus ``qkv_heads`` (opt-in, default
    off): ``{name fragment: head matrices}`` or ``(name, global_shape) -> head matrices | None``;
    a matching 2-D weight is orthogonalized per head (``optim/muon_matrices.py``).
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
        eps: float = EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        qkv_heads: HeadSpec = None,
    ) -> None:
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= lr:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not 0.0 <= momentum:
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
        if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 1:
            raise ValueError(f"ns_steps={ns_steps!r} must be an int >= 1 (Newton-Schulz iterations; 0 or fewer "
                             f"would not orthogonalize; default {DEFAULT_NS_STEPS})")
        if adjust_lr_fn is not None and adjust_lr_fn not in ("original", "match_rms_adamw"):
            raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
        )
        if qkv_heads is not None and not callable(qkv_heads) and not isinstance(qkv_heads, Mapping):
            raise ValueError(
                f"qkv_heads={qkv_heads!r} is not supported; pass a dict {{name fragment: head matrices}} "
                "or a callable (name, global_shape) -> head matrices or None"
            )
        self.qkv_heads = qkv_heads  # before torch's __init__, whose add_param_group checks shapes against it
        super().__init__(params, defaults)
        self.last_plan: OwnerPlan | None = None
        self._exchanges: dict[tuple[int, int], tuple[tuple[Any, ...], SplitExchange]] = {}  # shard group -> (its key, exchange)
        self.newton_schulz: Callable[..., torch.Tensor] = _zeropower_via_newtonschulz

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group`` (the constructor's groups come through here too), refusing a
        parameter Muon cannot orthogonalize when it is added rather than at the first ``step()``."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            for param in self._muon_params(group):
                shape = tuple(self.shard(param).global_shape)
                if len(shape) not in (2, 3):
                    raise ValueError(
                        f"Muon only supports 2-D parameters (and 3-D [E, a, b] expert stacks, one matrix per "
                        f"expert), but {self.param_name(param)!r} has global shape {shape}; give embeddings, "
                        "norms, biases and the output head to AdamW "
                        "(lightning_ragged.optim.split_muon_params(model.named_parameters()) splits them)"
                    )
                matrix_layout(self.param_name(param), shape, self.qkv_heads)  # refuses a bad qkv_heads entry now
        except ValueError:
            self.param_groups.pop()  # a refused group leaves the optimizer as it was
            for param in group["params"]:
                self._param_names.pop(id(param), None)
            raise

    def state_layout(self, param: torch.Tensor) -> dict[str, str]:
        return {"momentum_buffer": "flat"}

    # -------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = self.evaluate_closure(closure)
        self._muon_step(self.param_groups)
        return loss

    def _muon_params(self, group: dict[str, Any]) -> list[torch.Tensor]:
        return group["params"]

    def _muon_step(self, groups: list[dict[str, Any]]) -> None:
        jobs: list[_Job] = []  # every matrix, gradient or not: the same list on every rank
        for group in groups:
            for param in group["params"]:
                jobs += self._momentum_jobs(param, group)
        self.last_plan = self._assign_roots(jobs)
        by_group: dict[int, list[_Job]] = {}
        for job in jobs:
            by_group.setdefault(shard_group_key(job.shard), []).append(job)
        for group_jobs in by_group.values():
            self._step_process_group(group_jobs)

    def _momentum_jobs(self, param: torch.Tensor, group: dict[str, Any]) -> list[_Job]:
        """``param``'s matrices, with this rank's piece of its momentum update when it has a gradient.

        As ``torch.optim.Muon``, on the local flat shard: ``buf.lerp_(grad, 1 - momentum)``, then the
        nesterov ``grad.lerp(buf, momentum)`` (or ``buf``). The momentum of a split matrix's piece is
        copied first: the matrix may not step (a holder without a gradient), and then it is put back.
        """
        if param.grad is None:
            return self._matrix_jobs(param, group, None)
        if torch.is_complex(param):
            raise RuntimeError("Muon does not support complex parameters")
        if param.grad.is_sparse:
            raise RuntimeError("Muon does not support sparse gradients")
        grad = local_flat(param.grad)
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        buf = state["momentum_buffer"]
        update = torch.empty_like(grad) if group["nesterov"] else buf  # the jobs view it before it is written
        jobs = self._matrix_jobs(param, group, update)
        for job in jobs:
            if job.holds_split_piece():
                job.old_momentum = job.local(buf).clone()
        buf.lerp_(grad, 1 - group["momentum"])
        if group["nesterov"]:
            torch.lerp(grad, buf, group["momentum"], out=update)
        return jobs

    def _matrix_jobs(self, param: torch.Tensor, group: dict[str, Any], update: torch.Tensor | None) -> list[_Job]:
        """One job per matrix of ``param`` (the same list on every rank: it follows the global shape).

        ``update``: this rank's flat momentum update of ``param`` (each job views its piece), None without a gradient.
        """
        shard = self.shard(param)
        count, shape = matrix_layout(self.param_name(param), shard.global_shape, self.qkv_heads)
        numel = shape[0] * shape[1]
        if not numel:
            return []  # nothing to orthogonalize (and nothing to decay)
        my_start = shard.local_range[0]
        jobs = []
        for offset in range(0, count * numel, numel):
            pieces = matrix_pieces(shard.rank_ranges, offset, numel)
            start, end = pieces[shard.rank]
            local = offset + start - my_start if end > start else 0
            piece = None if update is None else update[local : local + end - start]
            jobs.append(_Job(param, group, shard, shape, pieces, piece, local))
        return jobs

    def _assign_roots(self, jobs: list[_Job]) -> OwnerPlan:
        """Every matrix's owner (``root``) per shard group, balancing Newton–Schulz FLOPs (``optim/owners.py``)."""
        by_group: dict[int, list[_Job]] = {}
        for job in jobs:
            by_group.setdefault(shard_group_key(job.shard), []).append(job)
        plan = OwnerPlan()
        for key, group_jobs in enumerate(by_group.values()):
            plan.assign(key, group_jobs, lambda job: ns_flops(job.shape, job.group["ns_steps"]))
        return plan

    def _step_process_group(self, jobs: list[_Job]) -> None:
        me = jobs[0].shard.rank
        split = [job for job in jobs if job.split]

        # 1. Gather every split matrix's pieces to its root, marked "has a gradient": one async all-to-all (bf16).
        exchange = self._exchange(split) if split else None
        if exchange is not None:
            exchange.gather([job.update for job in split], [job.update is not None for job in split])

        # 2. Meanwhile: whole matrices on their owner. Weight decay once per parameter, or per piece of a
        # parameter with a split piece here (that piece's matrix may not step).
        per_piece = {id(job.param) for job in split if job.holds_split_piece() and job.update is not None}
        decayed: set[int] = set()
        for job in jobs:
            if job.update is not None and id(job.param) not in per_piece and id(job.param) not in decayed:
                decayed.add(id(job.param))
                local_flat(job.param).mul_(1 - job.group["lr"] * job.group["weight_decay"])
        for job in jobs:
            if not job.split and job.root == me and job.update is not None and job.update.numel():
                update = job.update.view(job.shape)
                if update.dtype == torch.bfloat16:
                    update = update.clone()  # Newton–Schulz normalizes a bf16 input in place
                self._apply(job, self._orthogonalize(job, update).reshape(-1), id(job.param) in per_piece)
        if exchange is None:
            return

        # 3. Roots: orthogonalize what every holder has a gradient for, send the pieces back marked "stepped"
        # (one async all-to-all), finish their own pieces meanwhile; then every rank finishes the rest.
        results: dict[int, torch.Tensor | None] = {}
        for i, full in exchange.gathered().items():
            job = split[i]
            complete = exchange.complete(i, job.update is not None)
            results[i] = self._orthogonalize(job, full.view(job.shape)).reshape(-1) if complete else None
        exchange.scatter(results, {i: result is not None for i, result in results.items()})
        for i, result in results.items():
            if split[i].piece_numel(me):
                self._finish_split(split[i], None if result is None else result[slice(*split[i].piece(me))])
        for i, piece in exchange.scattered().items():
            self._finish_split(split[i], piece if exchange.marks_out[i] else None)

    def _exchange(self, split: list[_Job]) -> SplitExchange:
        """The marked exchange of a shard group's split matrices, rebuilt only when they (or their roots) change."""
        shard = split[0].shard
        device = local_flat(split[0].param).device
        key = (device, tuple((job.pieces, job.root) for job in split))
        cached = self._exchanges.get(shard_group_key(shard))
        if cached is None or cached[0] != key:
            exchange = SplitExchange(
                [job.pieces for job in split], [job.root for job in split], shard.rank, shard.process_group,
                torch.bfloat16, device,
            )
            cached = self._exchanges[shard_group_key(shard)] = (key, exchange)
        return cached[1]

    def _apply(self, job: _Job, ortho: torch.Tensor, decay: bool) -> None:
        """This rank's piece of a matrix that steps: weight decay (unless the parameter had it) and the update."""
        piece = job.local_param()
        if decay:
            piece.mul_(1 - job.group["lr"] * job.group["weight_decay"])
        piece.add_(ortho, alpha=-self._adjusted_lr(job))

    def _finish_split(self, job: _Job, ortho: torch.Tensor | None) -> None:
        """This rank's piece of a split matrix: ``ortho`` applied if it stepped, else its momentum put back."""
        if ortho is not None:
            self._apply(job, ortho, decay=True)
        elif job.old_momentum is not None:
            job.local(self.state[job.param]["momentum_buffer"]).copy_(job.old_momentum)

    def _orthogonalize(self, job: _Job, matrix: torch.Tensor) -> torch.Tensor:
        group = job.group
        return self.newton_schulz(matrix, group["ns_coefficients"], group["ns_steps"], group["eps"])

    @staticmethod
    def _adjusted_lr(job: _Job) -> float:
        lr = job.group["lr"]
        lr = lr.item() if isinstance(lr, torch.Tensor) else lr
        return _adjust_lr(lr, job.group["adjust_lr_fn"], torch.Size(job.shape))

