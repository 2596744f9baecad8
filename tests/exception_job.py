"""One rank raises in ``training_step`` at step 3 while the other trains on: ``python tests/exception_job.py OUT``.

``python tests/exception_job.py OUT sigterm``: rank 1 alone gets SIGTERM between the forward and
the backward of step 3 (``scancel``, preemption), while rank 0 is in the step's collectives.
``... OUT out-of-step``: rank 1 alone enters a barrier at step 3; both ranks time out, in different collectives.
``... OUT no-saver``: as the first, with no ``on_exception`` hook that saves (``ModelCheckpoint``'s default).

Run by ``tests/test_exception_agreement.py`` (Lightning's launcher, 2 gloo ranks). ``OnExceptionCheckpoint``
would start a collective save on the failing rank alone; ``ModelCheckpoint`` saved after every step before.
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint  # noqa: E402

from lightning_ragged import RaggedFSDPStrategy  # noqa: E402
from tests.lightning_models import LitTinyGPT, cpu_trainer, token_loader  # noqa: E402

AGREEMENT_S = 20  # the strategy's process-group timeout bounds the agreement's wait (60 s by default)


class FailsOnOneRank(LitTinyGPT):
    def training_step(self, batch, batch_idx):
        if self.global_step == 2 and self.global_rank == 1:
            raise RuntimeError("boom: a failure on rank 1 only")
        return super().training_step(batch, batch_idx)


class TerminatedOnOneRank(LitTinyGPT):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step == 2 and self.global_rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # the backward's collectives are still to come
        return loss


class OutOfStepOnOneRank(LitTinyGPT):
    def training_step(self, batch, batch_idx):
        if self.global_step == 2 and self.global_rank == 1:
            torch.distributed.barrier()  # a collective rank 0 never enters: both time out, in different ones
        return super().training_step(batch, batch_idx)


MODELS = {"raise": FailsOnOneRank, "sigterm": TerminatedOnOneRank, "out-of-step": OutOfStepOnOneRank,
          "no-saver": FailsOnOneRank}


def main() -> None:
    out = Path(sys.argv[1])
    mode = sys.argv[2] if len(sys.argv) > 2 else "raise"
    model = MODELS[mode]()
    L.seed_everything(0, verbose=False)
    periodic = ModelCheckpoint(dirpath=str(out / "periodic"), every_n_train_steps=1, save_top_k=-1)
    saver = [] if mode == "no-saver" else [OnExceptionCheckpoint(str(out / "on_exception"))]
    trainer = cpu_trainer(RaggedFSDPStrategy(timeout=timedelta(seconds=AGREEMENT_S)), 2, 6, callbacks=[*saver, periodic])
    try:
        trainer.fit(model, token_loader(6 * 2 * 4, 4))
    except BaseException as exception:
        print(f"[rank {trainer.global_rank}] stopped at step {trainer.global_step}: {type(exception).__name__}",
              flush=True)
        raise


if __name__ == "__main__":
    main()
