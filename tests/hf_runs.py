"""Real Trainer runs on ``transformers`` models for ``tests/test_hf_models.py``.

``tests/lightning_runs.py``'s main mode calls ``run_kind`` for every kind in its two processes
(one start-up for the Trainer checks of several files): each model is fit under ``strategy="ddp"``
and ``strategy="ragged_fsdp"``. Each rank computes its own numbers; the
worst value over ranks is all-reduced and rank 0 writes the JSON the test reads. A failure of
one model's ragged fit is recorded (``<kind>_error``) instead of ending the run, so the
other models still report.

Models are built from tiny configs with random init: nothing is downloaded.
"""

from __future__ import annotations

import sys
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import lightning_ragged  # noqa: E402  (registers "ragged_fsdp")
from tests.comparisons import max_diff, worst  # noqa: E402
from tests.hf_models import BLOCK_CLASS_NAMES, VOCAB, make_seq2seq  # noqa: E402
from tests.lightning_models import cpu_trainer  # noqa: E402

warnings.filterwarnings("ignore")
BATCH = 2  # per rank
STEPS = 4
SOURCE_LEN, TARGET_LEN = 8, 6
KINDS = ("t5", "bart")


class LitSeq2Seq(L.LightningModule):
    """A transformers encoder-decoder trained with AdamW; records its rank-local losses."""

    def __init__(self, kind: str, lr: float = 1e-3) -> None:
        super().__init__()
        self.lr = lr
        self.model = make_seq2seq(kind)
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        input_ids, labels = batch
        loss = self.model(input_ids=input_ids, labels=labels).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # eps=1e-6: BART's key-projection biases have a gradient that is exactly 0 in exact
        # arithmetic, so what is computed is rounding noise (~1e-10); with the default 1e-8 AdamW
        # normalizes that noise into lr-sized steps of random sign, and rounding may differ from
        # DDP's (parameters are views into flat buffers, so kernels see other alignments).
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01, eps=1e-6)


def seq2seq_loader(samples: int) -> DataLoader:
    """Random source sequences; the target is the source reversed (tokens 1.., no padding)."""
    generator = torch.Generator().manual_seed(1)
    source = torch.randint(1, VOCAB, (samples, SOURCE_LEN), generator=generator)
    target = source.flip(1)[:, :TARGET_LEN].contiguous()
    return DataLoader(TensorDataset(source, target), batch_size=BATCH, shuffle=False)


def fit(kind: str, strategy) -> LitSeq2Seq:
    L.seed_everything(0, verbose=False)
    trainer = cpu_trainer(strategy, 2, STEPS, enable_checkpointing=False)
    model = LitSeq2Seq(kind)
    trainer.fit(model, seq2seq_loader(STEPS * 2 * BATCH))
    return model


def counted_root_fraction(state) -> float:
    """Fraction of the model's (unique) parameter elements that live in the root group's DBuffers."""

    def numel(dbuffers) -> int:
        return sum(p.ragged_shard.numel for dbuffer in dbuffers for p in dbuffer.sharded_params.values())

    everything = [dbuffer for group in state.all_groups for dbuffer in group.dbuffers] if hasattr(
        state, "all_groups") else [dbuffer for dbuffer in state.dbuffers()]
    return numel(state.root_group.dbuffers) / numel(everything)


def run_kind(results: dict, kind: str) -> None:
    L.seed_everything(0, verbose=False)
    initial = {k: v.detach().clone() for k, v in LitSeq2Seq(kind).state_dict().items()}
    ddp = fit(kind, "ddp")
    reference = {k: v.detach().clone() for k, v in ddp.state_dict().items()}
    results[f"{kind}_params_moved"] = worst(max_diff(initial, reference))
    try:
        ragged = fit(kind, "ragged_fsdp")
        results[f"{kind}_steps"] = len(ragged.losses)
        results[f"{kind}_loss_diff"] = worst(max(abs(a - b) for a, b in zip(ddp.losses, ragged.losses)))
        results[f"{kind}_param_diff"] = worst(max_diff(reference, lightning_ragged.full_state_dict(ragged)))
        state = lightning_ragged.get_state(ragged)
        classes = BLOCK_CLASS_NAMES[kind]  # (sharded modules may get a subclass, so look along the MRO)
        results[f"{kind}_blocks"] = [name for name, m in ragged.named_modules()
                                     if any(c.__name__ in classes for c in type(m).__mro__)]
        results[f"{kind}_group_names"] = [g.name for g in state.groups]
        results[f"{kind}_root_name"] = state.root_group.name
        results[f"{kind}_counted_root_fraction"] = counted_root_fraction(state)
        fraction = getattr(state, "root_fraction", None)
        results[f"{kind}_root_fraction"] = None if fraction is None else float(fraction)
    except Exception:  # recorded for the test to report; the DDP oracle ran, so the run goes on
        results[f"{kind}_error"] = traceback.format_exc()[-4000:]
