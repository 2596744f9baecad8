"""One loop with a different number of batches per rank (``use_distributed_sampler=False``, 3 on rank 0, 5 on
rank 1): ``python tests/batch_counts_job.py {training,validation}``. Run by ``tests/test_batch_counts.py``
(Lightning's launcher, 2 gloo ranks)."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as L  # noqa: E402

from lightning_ragged import RaggedFSDPStrategy  # noqa: E402
from tests.lightning_models import LitTinyGPT, cpu_trainer, token_loader  # noqa: E402

BATCH = 4


class PerRankData(LitTinyGPT):
    """Each rank's own dataloader; the ``uneven`` loop's is longer on rank 1."""

    def __init__(self, uneven: str) -> None:
        super().__init__()
        self.uneven = uneven

    def _loader(self, loop: str):
        batches = 5 if loop == self.uneven and self.global_rank == 1 else 3
        return token_loader(batches * BATCH, BATCH, seed=1 + self.global_rank)

    def train_dataloader(self):
        return self._loader("training")

    def val_dataloader(self):
        return self._loader("validation")


def main() -> None:
    loop = sys.argv[1]
    L.seed_everything(0, verbose=False)
    model = PerRankData(loop)
    trainer = cpu_trainer(RaggedFSDPStrategy(timeout=timedelta(seconds=60)), 2, 6, use_distributed_sampler=False)
    try:
        trainer.fit(model) if loop == "training" else trainer.validate(model)
    except BaseException as exception:
        print(f"[rank {trainer.global_rank}] {type(exception).__name__}: {exception}", flush=True)
        raise


if __name__ == "__main__":
    main()
