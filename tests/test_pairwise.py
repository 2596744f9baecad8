"""``reduce_mode="pairwise"`` and ``gather_mode="pairwise"`` (gloo's defaults): the reduce-scatter and the
all-gather built from point-to-point sends.

Oracles: DDP's averaged gradients (each rank's sharded gradient is their slice), the backend's
collectives on the same model and batch, and the bytes counted on the c10d ops it issues.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_ragged as lr
from lightning_ragged.engine.collectives import resolve_gather_mode, resolve_reduce_mode
from lightning_ragged.engine.pairwise import PairwiseGather, PairwiseReduce
from tests.models import lm_loss, make_batches, make_model
from tests.test_fully_shard import BATCH, _local

MODES = ("pairwise", "all_reduce", "reduce_scatter")


class _IssuedBytes(TorchDispatchMode):
    """Bytes of the first tensor argument of every c10d op, summed by op name."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name.startswith("c10d."):
            first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
            self.bytes[name] = self.bytes.get(name, 0) + first.numel() * first.element_size()
        return func(*args, **(kwargs or {}))


def check_modes_vs_ddp() -> dict:
    """One backward per mode on the same batch; each rank's sharded gradients vs its slice of DDP's."""
    tokens = _local(make_batches(1, BATCH)[0])
    ddp = DistributedDataParallel(make_model())
    lm_loss(ddp, tokens).backward()
    reference = {name: p.grad.reshape(-1) for name, p in ddp.module.named_parameters()}
    result: dict = {"diff": {}, "sent": {}, "modes": {}, "grads": {}}
    for mode in MODES:
        kwargs = {} if mode == "pairwise" else {"reduce_mode": mode}  # pairwise: the default on gloo
        # the backend's all-gather: every point-to-point byte counted below is the reduction's
        model = lr.fully_shard(make_model(), shard_granularity="row", gather_mode="all_gather", **kwargs)
        state = lr.get_state(model)
        with _IssuedBytes() as issued:
            lm_loss(model, tokens).backward()
        diff = 0.0
        for name, param in model.named_parameters():
            start, end = param.ragged_shard.local_range
            if end > start:
                diff = max(diff, (param.grad - reference[name][start:end]).abs().max().item())
        result["diff"][mode] = diff
        result["grads"][mode] = torch.cat([p.grad for p in model.parameters() if p.grad is not None])
        result["modes"][mode] = sorted({b.reduce_mode for b in state.dbuffers()})
        result["sent"][mode] = issued.bytes
        result["full_bytes"] = sum(b.layout.buffer_numel * b.unsharded_grad.element_size() for b in state.dbuffers())
    return result


@pytest.mark.parametrize("world_size", [2, 3])
def test_pairwise_reduction_matches_ddp_and_sends_half_an_all_reduce(dist_pool, world_size):
    for result in dist_pool(world_size).run(check_modes_vs_ddp):
        assert result["modes"] == {mode: [mode] for mode in MODES}  # gloo's default is pairwise
        # float32 sums of world_size terms in another order than DDP's ring: a few ulps of gradients ~1e-2
        assert max(result["diff"].values()) <= 1e-6, result["diff"]
        if world_size == 2:  # a + b either way round: the three modes agree bit for bit
            assert torch.equal(result["grads"]["pairwise"], result["grads"]["all_reduce"])
            assert torch.equal(result["grads"]["pairwise"], result["grads"]["reduce_scatter"])
        full, share = result["full_bytes"], (world_size - 1) / world_size
        sent = result["sent"]["pairwise"]
        assert sent["c10d.send"] == pytest.approx(share * full)  # each peer its segment: (W-1)/W of every buffer
        assert sent["c10d.recv_"] == pytest.approx(share * full)
        flags = sent.get("c10d.allreduce_", 0)
        assert flags < 1024  # only the used-gradient flags go through an all-reduce
        assert result["sent"]["all_reduce"]["c10d.allreduce_"] - flags == full  # what a ring sends 2(W-1)/W of


def test_pairwise_is_refused_off_the_cpu_and_unknown_modes_are_named():
    with pytest.raises(ValueError, match=r"reduce_mode='pairwise' is for CPU tensors \(gloo\) only.*'reduce_scatter'"):
        resolve_reduce_mode("pairwise", None, torch.device("cuda"))
    with pytest.raises(ValueError, match=r"gather_mode='pairwise' is for CPU tensors \(gloo\) only.*'all_gather'"):
        resolve_gather_mode("pairwise", None, torch.device("cuda"))
    with pytest.raises(ValueError, match=r"gather_mode='ring' is not supported; use one of \('all_gather'"):
        resolve_gather_mode("ring", None, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"reduce_mode='ring' is not supported; use one of \('all_reduce'"):
        resolve_reduce_mode("ring", None, torch.device("cpu"))
    assert resolve_reduce_mode("all_reduce", None, torch.device("cuda")) == "all_reduce"


class _Work:
    """A stand-in for a gloo Work: records its wait, or raises as a lost peer's does."""

    def __init__(self, fails: bool) -> None:
        self.fails, self.waited = fails, False

    def wait(self) -> bool:
        self.waited = True
        if self.fails:
            raise RuntimeError("peer lost")
        return True


def check_defaults_and_a_failed_send() -> dict:
    defaults = {kind: (resolve_reduce_mode(None, None, torch.device(kind)), resolve_gather_mode(None, None,
                                                                                                torch.device(kind)))
                for kind in ("cpu", "cuda")}
    full = torch.arange(4.0) + dist.get_rank()
    reduction = PairwiseReduce(full, full[dist.get_rank() * 2 : dist.get_rank() * 2 + 2], None)
    failing, later = _Work(fails=True), _Work(fails=False)
    real = reduction.works
    reduction.works = [failing, later, *real]
    raised = []
    for _ in range(2):  # a later wait must not report success either
        try:
            reduction.wait()
            raised.append(None)
        except RuntimeError as error:
            raised.append(str(error))
    return {"defaults": defaults, "raised": raised, "later_waited": later.waited, "own": full.tolist(),
            "real_done": all(work.is_completed() for work in real)}


def test_gloo_defaults_by_device_and_a_failed_send_leaves_nothing_in_flight(dist_pool):
    for rank, result in enumerate(dist_pool(2).run(check_defaults_and_a_failed_send)):
        # gloo stages device tensors itself: its own collectives there
        assert result["defaults"] == {"cpu": ("pairwise", "pairwise"), "cuda": ("all_reduce", "all_gather")}
        assert result["raised"] == ["peer lost"] * 2 and result["later_waited"] and result["real_done"], result
        assert result["own"] == [float(v + rank) for v in range(4)]  # failed: nothing summed into the segment


def check_gather_modes() -> dict:
    """Three steps per all-gather mode from one init on the same batches: losses, final shards, bytes per op."""
    batches = [_local(tokens) for tokens in make_batches(3, BATCH)]
    result: dict = {"losses": {}, "params": {}, "sent": {}, "modes": {}}
    for mode in ("pairwise", "all_gather"):
        model = lr.fully_shard(make_model(), shard_granularity="row", reduce_mode="all_reduce", gather_mode=mode)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step, tokens in enumerate(batches):
            with _IssuedBytes() as issued:
                loss = lm_loss(model, tokens)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        result["losses"][mode], result["sent"][mode] = losses, issued.bytes  # the last step's
        result["params"][mode] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        result["modes"][mode] = sorted({b.gather_mode for b in lr.get_state(model).dbuffers()})
    return result


@pytest.mark.parametrize("world_size", [2, 3])
def test_pairwise_all_gather_trains_as_the_backends_and_sends_what_it_sends(dist_pool, world_size):
    for result in dist_pool(world_size).run(check_gather_modes):
        assert result["modes"] == {"pairwise": ["pairwise"], "all_gather": ["all_gather"]}
        # a gather copies bytes: the same full parameters, so the same losses and updates bit for bit
        assert result["losses"]["pairwise"] == result["losses"]["all_gather"]
        assert torch.equal(result["params"]["pairwise"], result["params"]["all_gather"])
        pairwise, backend = result["sent"]["pairwise"], result["sent"]["all_gather"]
        assert "c10d._allgather_base_" not in pairwise
        # each peer this rank's segment: (W-1)/W of every full buffer gathered (first argument: the output)
        gathered = backend["c10d._allgather_base_"]
        assert pairwise["c10d.send"] == pytest.approx((world_size - 1) / world_size * gathered)
        assert pairwise["c10d.recv_"] == pairwise["c10d.send"]


def check_gather_in_a_subgroup() -> list[float]:
    """A group of ranks {1, 2}: group ranks are mapped to global ones; rank 0 takes no part."""
    group = dist.new_group([1, 2])
    if dist.get_rank() == 0:
        return []
    mine = torch.full((3,), float(dist.get_rank()))
    target = torch.empty(6)
    gather = PairwiseGather(target, mine, group)
    gather.wait()
    return target.tolist()


def test_pairwise_all_gather_in_a_subgroup(dist_pool):
    assert dist_pool(3).run(check_gather_in_a_subgroup) == [[], [1.0] * 3 + [2.0] * 3, [1.0] * 3 + [2.0] * 3]
