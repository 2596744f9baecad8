"""Tiny models with awkward shapes for the distributed tests (fast on 2 CPU cores)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 37  # divisible by neither 2 nor 3
WIDTH = 13
HIDDEN = 7  # the MLP's up-projection is a 7x13 matrix
SEQ = 6


class TinyBlock(nn.Module):
    """Pre-norm transformer block: single-head causal attention and a 13->7->13 MLP (by default).

    Only torch here: ``tests/lightning_models.py`` builds its block from this one, and the model
    of ``tests/test_checkpoint_lightning.py`` must load where lightning_ragged is never imported.
    """

    def __init__(self, width: int = WIDTH, hidden: int = HIDDEN, proj_bias: bool = False) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        # No qkv bias: the key bias has an exactly-zero gradient (softmax shift invariance),
        # which Adam would turn rounding noise into visible updates on.
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=proj_bias)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    """Embedding tied to the output head, positional table, two blocks, final norm."""

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.1)
        self.blocks = nn.ModuleList(TinyBlock() for _ in range(layers))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, mean over positions."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def make_model(seed: int = 0, layers: int = 2) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(layers)


def make_batches(steps: int, batch: int, seed: int = 1) -> torch.Tensor:
    """``steps`` global batches of token sequences: shape (steps, batch, SEQ + 1)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (steps, batch, SEQ + 1), generator=generator)


def shard_grad_diff(sharded: nn.Module, reference: nn.Module) -> float:
    """The largest difference between a shard's gradient and its range of the reference's full gradient."""
    reference_grads = dict(reference.named_parameters())
    worst = 0.0
    for name, param in sharded.named_parameters():
        start, end = param.ragged_shard.local_range
        local = reference_grads[name].grad.reshape(-1)[start:end]
        worst = max(worst, (param.grad - local).abs().max().item() if end > start else 0.0)
    return worst
