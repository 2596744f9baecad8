"""A small GPT-style language model shared by the benchmarks (random init, fixed seed).

Pre-norm transformer blocks (multi-head causal attention + GELU MLP, biases, LayerNorms)
in an ``nn.ModuleList`` named ``blocks`` (so ``lightning_ragged.fully_shard``'s default
grouping makes one group per block), learned positional embeddings and an untied output
head. The default config has ~17M parameters: big enough for communication and copies
to matter, small enough that a step on one CPU thread takes well under two seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 8192
    width: int = 384
    layers: int = 6
    heads: int = 6
    seq: int = 128
    mlp_ratio: int = 4


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.fc = nn.Linear(cfg.width, cfg.mlp_ratio * cfg.width)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.seq, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_gpt(cfg: GPTConfig = GPTConfig(), seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over ``tokens`` of shape (batch, seq + 1)."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def make_batches(
    steps: int, global_batch: int, cfg: GPTConfig = GPTConfig(), seed: int = 1, used_vocab: int = 512
) -> torch.Tensor:
    """Deterministic, learnable token batches, shape (steps, global_batch, seq + 1).

    Sequences use ``used_vocab`` of the tokens and follow a fixed random permutation of them
    (next = perm[current]) from a random start, with 10% of positions replaced by random
    used tokens. The loss falls visibly within a few steps (first the unigram, then the
    bigram structure), a better check of "same trajectory" than pure noise.
    """
    generator = torch.Generator().manual_seed(seed)
    used = torch.randperm(cfg.vocab, generator=generator)[:used_vocab]
    successor = torch.randperm(used_vocab, generator=generator)
    index = torch.empty(steps, global_batch, cfg.seq + 1, dtype=torch.long)
    index[..., 0] = torch.randint(0, used_vocab, (steps, global_batch), generator=generator)
    for i in range(1, cfg.seq + 1):
        index[..., i] = successor[index[..., i - 1]]
    noise = torch.rand(index.shape, generator=generator) < 0.1
    index[noise] = torch.randint(0, used_vocab, (int(noise.sum()),), generator=generator)
    return used[index]


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
