"""A tiny GPT LightningModule for the Trainer tests (fast on 2 CPU cores).

Every parameter comes from a module that initializes itself in ``reset_parameters``
(``nn.Embedding``, ``nn.Linear``, ``nn.LayerNorm``) and nothing is tied, so a meta-device
build materialized with the same seed equals an eager build.
"""

from __future__ import annotations

import lightning.pytorch as L
import torch
from lightning.pytorch.utilities import grad_norm
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.models import TinyBlock

VOCAB = 37  # divisible by neither 2 nor 4: ragged shards
WIDTH = 12
HIDDEN = 20
SEQ = 8


class Block(TinyBlock):
    """``tests.models.TinyBlock`` at this file's sizes, with a bias on the attention output projection."""

    def __init__(self) -> None:
        super().__init__(WIDTH, HIDDEN, proj_bias=True)


class TinyGPT(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def cpu_trainer(strategy, devices: int, max_steps: int, **kwargs) -> L.Trainer:
    """A quiet CPU Trainer for the tests: no logger, progress bar, model summary or sanity validation."""
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


class LitTinyGPT(L.LightningModule):
    """Records its per-step training losses (rank-local) in ``self.losses``."""

    def __init__(self, lr: float = 0.5, layers: int = 2) -> None:
        super().__init__()
        self.lr = lr
        self.model = TinyGPT(layers)
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def _loss(self, batch: tuple[torch.Tensor]) -> torch.Tensor:
        (tokens,) = batch
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.losses.append(loss.item())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> None:
        loss = self._loss(batch)
        self.val_losses.append(loss.item())
        self.log("val_loss", loss, sync_dist=True)

    def test_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0][:, :-1]).argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def token_loader(samples: int, batch_size: int, seed: int = 1) -> DataLoader:
    """``samples`` sequences of a learnable pattern (next = previous + 1 mod VOCAB) with random starts.

    ``batch_size`` is per rank (the Trainer injects a ``DistributedSampler``).
    """
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (samples, 1), generator=generator)
    tokens = (starts + torch.arange(SEQ + 1)) % VOCAB
    return DataLoader(TensorDataset(tokens), batch_size=batch_size, shuffle=False)


class LitManualGPT(LitTinyGPT):
    """Manual optimization, Lightning's GAN pattern: AdamW on everything but ``blocks.1`` (accumulated over 2
    batches, clipped by norm), SGD on ``blocks.1`` every batch, each behind ``toggle_optimizer``, each with a
    StepLR stepped by hand."""

    def __init__(self, lr: float = 0.5, layers: int = 2) -> None:
        super().__init__(lr, layers)
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> None:
        (opt_a, opt_b), (sched_a, sched_b) = self.optimizers(), self.lr_schedulers()
        self.toggle_optimizer(opt_a)
        loss = self._loss(batch)
        self.manual_backward(loss / 2)
        if batch_idx % 2 == 1:
            self.clip_gradients(opt_a, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
            opt_a.step()
            opt_a.zero_grad()
            sched_a.step()
        self.untoggle_optimizer(opt_a)
        self.toggle_optimizer(opt_b)
        self.manual_backward(self._loss(batch) * 0.5)
        opt_b.step()
        opt_b.zero_grad()
        sched_b.step()
        self.untoggle_optimizer(opt_b)
        self.losses.append(loss.item())

    def configure_optimizers(self) -> tuple[list, list]:
        second = {id(p) for p in self.model.blocks[1].parameters()}
        opt_a = torch.optim.AdamW([p for p in self.parameters() if id(p) not in second], lr=1e-2)
        opt_b = torch.optim.SGD(self.model.blocks[1].parameters(), lr=0.1, momentum=0.9)
        schedulers = [torch.optim.lr_scheduler.StepLR(opt_a, 2, 0.5), torch.optim.lr_scheduler.StepLR(opt_b, 3, 0.5)]
        return [opt_a, opt_b], schedulers


class LitListGPT(LitTinyGPT):
    """Shards its own modules in ``configure_model`` under ``ragged_fsdp`` as torchtitan does (the embedding, each
    block, then ``[norm, head]`` as one group kept for backward); the strategy's call on it adopts them."""

    def configure_model(self) -> None:
        from lightning_ragged import RaggedFSDPStrategy, fully_shard

        if isinstance(self.trainer.strategy, RaggedFSDPStrategy):
            fully_shard(self.model.tok)
            for block in self.model.blocks:
                fully_shard(block)
            fully_shard([self.model.norm, self.model.head], reshard_after_forward=False)


class LitGradNorm(LitTinyGPT):
    """Logs Lightning's ``grad_norm`` (2-norm and inf-norm) before every optimizer step, imported by name at the top
    of the file as Lightning's docs write it; records them in ``self.grad_norms``."""

    def __init__(self, lr: float = 0.5, layers: int = 2) -> None:
        super().__init__(lr, layers)
        self.grad_norms: list[dict[str, float]] = []

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        norms = {**grad_norm(self, norm_type=2), **grad_norm(self, norm_type="inf")}
        self.log_dict(norms)
        self.grad_norms.append({key: float(value) for key, value in norms.items()})


class LitRegression(L.LightningModule):
    """Float features and float targets (a regression); records the dtypes ``training_step`` receives."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        self.batch_dtypes: list[tuple[str, str]] = []
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.batch_dtypes.append((str(x.dtype), str(y.dtype)))
        loss = F.mse_loss(self.model(x).float(), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def regression_loader(samples: int, batch_size: int, seed: int = 1) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 4, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=batch_size, shuffle=False)
