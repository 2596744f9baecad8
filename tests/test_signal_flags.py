"""The signal flags (SIGTERM, the SLURM requeue signal) agreed in one all-reduce per batch end, on CPU.

Before, each flag had its own all-reduce of a tensor on the strategy's root device followed by ``.item()``:
under SLURM auto-requeue two collectives per training batch, and on NCCL a host-device sync at every batch
end. Oracles: the flags set by hand on each rank, and a count of the reductions.
"""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import torch.distributed as dist

from lightning_ragged.lightning import side_groups
from lightning_ragged.lightning.signal_handlers import flags, flag_group, install


class _Handler:
    def __init__(self) -> None:
        self.flag = False
        self._trainer = None

    def handle_signal(self, signum, frame) -> None:
        self.flag = True


class _Sigterm(_Handler):
    pass


class _Requeue(_Handler):
    pass


def check_one_reduction_for_both_flags() -> dict:
    rank = dist.get_rank()
    trainer = SimpleNamespace(callbacks=[], _signal_connector=SimpleNamespace(
        _sigterm_notifier_fn=None, _slurm_sigusr_handler_fn=None))
    requeue = install(trainer, "_slurm_sigusr_handler_fn", _Requeue, lambda cb: cb.flag, "")
    sigterm = install(trainer, "_sigterm_notifier_fn", _Sigterm, lambda cb: cb.flag, "")
    agreement = flags(trainer)
    results = {"callbacks": [type(cb).__name__ for cb in trainer.callbacks]}
    agreement.on_train_batch_start(trainer, None, None, 0)
    results["nothing"] = (agreement.agreed("_sigterm_notifier_fn"), agreement.agreed("_slurm_sigusr_handler_fn"))
    if rank == 1:
        trainer._signal_connector._sigterm_notifier_fn(15, None)  # the installed handler: only the flag
    agreement.on_train_batch_start(trainer, None, None, 1)
    results["sigterm"] = (agreement.agreed("_slurm_sigusr_handler_fn"), agreement.agreed("_sigterm_notifier_fn"))
    if rank == 0:
        requeue.flag = True
    results["same_batch"] = agreement.agreed("_slurm_sigusr_handler_fn")  # agreed already at this batch end
    agreement.on_validation_batch_start(trainer, None, None, 0)
    results["next_batch"] = (agreement.agreed("_sigterm_notifier_fn"), agreement.agreed("_slurm_sigusr_handler_fn"))
    results["reductions"] = agreement.reductions
    results["flags"] = (sigterm.flag, requeue.flag)
    return results


def test_both_flags_are_agreed_in_one_reduction_per_batch_end(dist_pool) -> None:
    for rank, result in enumerate(dist_pool(2).run(check_one_reduction_for_both_flags)):
        assert result["callbacks"] == ["_Requeue", "SignalFlags", "_Sigterm"], result
        assert result["nothing"] == (False, False), result
        assert result["sigterm"] == (False, True), result  # rank 1's signal, on both ranks
        assert result["same_batch"] is False, result  # rank 0's requeue flag waits for the next batch end
        assert result["next_batch"] == (True, True), result
        assert result["reductions"] == 3, result  # one per batch end, however many flags are read
        assert result["flags"] == (rank == 1, rank == 0), result


def check_flag_group(backend: str) -> dict:
    made = []
    real_backend, real_new_group = dist.get_backend, dist.new_group
    side_groups._GROUPS.clear()
    dist.get_backend = lambda *args: backend
    dist.new_group = lambda **kwargs: made.append(kwargs) or "gloo group"
    try:
        group = flag_group()
        again = flag_group()
    finally:
        dist.get_backend, dist.new_group = real_backend, real_new_group
        side_groups._GROUPS.clear()
    return {"group": group, "again": again, "made": made}


def test_the_flags_travel_on_a_gloo_group_also_when_the_default_group_is_nccl(dist_pool) -> None:
    for result in dist_pool(2).run(check_flag_group, "nccl"):
        assert result["group"] == result["again"] == "gloo group", result
        assert len(result["made"]) == 1 and result["made"][0]["backend"] == "gloo", result
        assert isinstance(result["made"][0]["timeout"], timedelta), result  # the default group's
    for backend in ("gloo", "cpu:gloo,cuda:nccl"):  # the default group takes CPU tensors: no group of its own
        for result in dist_pool(2).run(check_flag_group, backend):
            assert result == {"group": None, "again": None, "made": []}, result
