"""Small models for ``tests/test_start.py`` and ``tests/start_runs.py`` (fast on 2 CPU cores).

* ``ConvBNNet``: conv stem + two residual conv/BatchNorm blocks + linear head, so it has
  buffers (BatchNorm running statistics) and several groups.
* ``tiny_llama``: a ``transformers`` Llama from a tiny config (random init, nothing downloaded);
  ``add_lora`` injects PEFT-style adapters into a built one.
"""

from __future__ import annotations

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

CHANNELS = 6
CLASSES = 5
IMAGE = 6


class ConvBlock(nn.Module):
    def __init__(self, channels: int = CHANNELS) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.bn(self.conv(x)))


class ConvBNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, CHANNELS, 3, padding=1), nn.BatchNorm2d(CHANNELS), nn.ReLU())
        self.blocks = nn.ModuleList(ConvBlock() for _ in range(2))
        self.head = nn.Linear(CHANNELS, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def batch_norms(model: nn.Module) -> list[nn.BatchNorm2d]:
    return [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]


def running_stats(model: nn.Module) -> torch.Tensor:
    """Every BatchNorm's running mean and variance, concatenated."""
    return torch.cat([torch.cat([bn.running_mean, bn.running_var]) for bn in batch_norms(model)]).clone()


def image_batch(seed: int, batch: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Images whose statistics depend on ``seed`` (different ranks see different means)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, IMAGE, IMAGE, generator=generator) * (1 + seed % 3) + seed % 5
    return x, torch.randint(0, CLASSES, (batch,), generator=generator)


def image_loader(samples: int, batch_size: int, seed: int = 1) -> DataLoader:
    """``samples`` images; with a ``DistributedSampler`` each rank reads different ones.

    Every image has its own mean and scale, so the BatchNorm statistics of two ranks' batches differ."""
    generator = torch.Generator().manual_seed(seed)
    scale = torch.rand(samples, 1, 1, 1, generator=generator) * 3
    shift = torch.randn(samples, 1, 1, 1, generator=generator) * 2
    x = torch.randn(samples, 3, IMAGE, IMAGE, generator=generator) * scale + shift
    y = torch.randint(0, CLASSES, (samples,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


class LitConvBN(L.LightningModule):
    def __init__(self, lr: float = 0.1, freeze_head_bias: bool = False) -> None:
        super().__init__()
        self.lr = lr
        self.net = ConvBNNet()
        if freeze_head_bias:
            self.net.head.bias.requires_grad_(False)
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr, momentum=0.9)


def llama_config(tie: bool = False):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       initializer_range=0.1, tie_word_embeddings=tie)


def tiny_llama(tie: bool = False) -> nn.Module:
    """LlamaForCausalLM, 2 layers, hidden 32, vocab 128; no seed set here (the caller seeds)."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config(tie))


class LoRALinear(nn.Module):
    """PEFT's recipe: a frozen base plus ``B @ A`` with ``B`` zero-initialized, so training starts at the base."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x))


def add_lora(llama: nn.Module) -> nn.Module:
    """Freeze ``llama`` and wrap every layer's ``q_proj`` in ``LoRALinear`` (after the model was built)."""
    llama.requires_grad_(False)
    for layer in llama.model.layers:
        layer.self_attn.q_proj = LoRALinear(layer.self_attn.q_proj)
    return llama


class LitLlama(L.LightningModule):
    def __init__(self, tie: bool = False, lora: bool = False) -> None:
        super().__init__()
        self.model = add_lora(tiny_llama(tie)) if lora else tiny_llama(tie)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens).logits

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def validation_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> None:
        (tokens,) = batch
        self.log("val_loss", self.model(input_ids=tokens, labels=tokens).loss, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class LitLlamaShardedByUser(LitLlama):
    """FSDP2's pattern in ``configure_model``: the user shards each decoder layer (on the meta device when built
    under ``init_module(empty_init=True)``), the strategy then shards the rest."""

    def configure_model(self) -> None:
        import lightning_ragged as lr

        for layer in self.model.model.layers:
            lr.fully_shard(layer)


def llama_tokens(samples: int, batch_size: int, seq: int = 8) -> DataLoader:
    generator = torch.Generator().manual_seed(3)
    return DataLoader(TensorDataset(torch.randint(0, 128, (samples, seq), generator=generator)),
                      batch_size=batch_size, shuffle=False)
