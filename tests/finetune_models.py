"""Tiny fine-tuning models for tests/test_finetune.py: LoRA, frozen trunks, unused and routed
parameters, injected faults. Shapes follow tests/models.py (awkward on purpose, fast on 2 cores).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tests.models import HIDDEN, SEQ, VOCAB, WIDTH, TinyBlock

LORA_RANK = 2
LORA_ALPHA = 4.0


class FinetuneLM(nn.Module):
    """TinyLM's shape (embedding, positional table, blocks, final norm, head) with a choice of block.

    ``tied=False`` gives the head its own weight (a copy of the embedding at init) so that the
    head can be trainable while the embedding is frozen.
    """

    def __init__(self, block: Callable[[], nn.Module], layers: int = 2, tied: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.1)
        self.blocks = nn.ModuleList(block() for _ in range(layers))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        nn.init.normal_(self.embed.weight, std=0.1)
        if tied:
            self.head.weight = self.embed.weight
        else:
            with torch.no_grad():
                self.head.weight.copy_(self.embed.weight)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens) + self.pos[: tokens.shape[1]]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# --------------------------------------------------------------------------- LoRA
class LoRALinear(nn.Module):
    """PEFT's pattern: ``y = base(x) + B(A(x)) * alpha / r`` with a frozen ``base``.

    A is ``r x in``, B is ``out x r``. PEFT zero-initialises B; here B starts small and nonzero
    so that A has a gradient from the first step (a zero gradient would hide a wrong one).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, rank: int = LORA_RANK) -> None:
        super().__init__()
        self.base = nn.Linear(in_features, out_features, bias=bias)
        self.lora_A = nn.Linear(in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, out_features, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.05)
        self.scale = LORA_ALPHA / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scale


class LoRABlock(nn.Module):
    """TinyBlock with LoRA on qkv, up and down; the norms and the output projection stay plain.

    Every frozen weight here (norms, base weights, proj) is needed for the input gradient in
    backward, after some of the block's trainable gradients are already done.
    """

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(WIDTH)
        self.qkv = LoRALinear(WIDTH, 3 * WIDTH, bias=False)
        self.proj = nn.Linear(WIDTH, WIDTH, bias=False)
        self.norm2 = nn.LayerNorm(WIDTH)
        self.up = LoRALinear(WIDTH, HIDDEN)
        self.down = LoRALinear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def make_lora_model(seed: int = 0) -> FinetuneLM:
    """Two LoRA blocks; only the ``lora_A``/``lora_B`` weights train (embeddings, head, norms frozen)."""
    torch.manual_seed(seed)
    model = FinetuneLM(LoRABlock, layers=2, tied=True)
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)
    return model


# --------------------------------------------------------------------- frozen trunk
FROZEN_TRUNK_LAYERS = 4


def make_frozen_trunk_model(seed: int = 0) -> FinetuneLM:
    """Four TinyBlocks; embeddings and the first three blocks frozen, last block, final norm and head trainable."""
    torch.manual_seed(seed)
    model = FinetuneLM(TinyBlock, layers=FROZEN_TRUNK_LAYERS, tied=False)
    model.embed.requires_grad_(False)
    model.pos.requires_grad_(False)
    for block in model.blocks[:-1]:
        block.requires_grad_(False)
    return model


# ------------------------------------------------------------- unused / routed params
class UnusedParamBlock(TinyBlock):
    """TinyBlock plus ``spare``, a Linear that forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Linear(WIDTH, WIDTH)


def make_unused_param_model(seed: int = 0) -> FinetuneLM:
    torch.manual_seed(seed)
    return FinetuneLM(UnusedParamBlock, layers=2, tied=True)


class RoutedBlock(TinyBlock):
    """TinyBlock plus ``expert``, applied only when the caller routes the batch to it (MoE-like)."""

    def __init__(self) -> None:
        super().__init__()
        self.expert = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, use_expert: bool = False) -> torch.Tensor:
        x = super().forward(x)
        return x + self.expert(x) if use_expert else x


def uses_expert(tokens: torch.Tensor) -> bool:
    """The routing rule: a batch whose first token is even goes through the experts."""
    return int(tokens[0, 0]) % 2 == 0


class RoutedLM(FinetuneLM):
    def __init__(self, layers: int = 2) -> None:
        super().__init__(RoutedBlock, layers=layers, tied=True)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        use = uses_expert(tokens)
        x = self.embed_tokens(tokens)
        for block in self.blocks:
            x = block(x, use_expert=use)
        return self.head(self.norm(x))


def make_routed_model(seed: int = 0) -> RoutedLM:
    torch.manual_seed(seed)
    return RoutedLM()


# ----------------------------------------------------------------------- faults
class _FailInBackward(torch.autograd.Function):
    """Identity whose backward raises while ``fault.fail_backward`` is set."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fault: "Fault") -> torch.Tensor:
        ctx.fault = fault
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.fault.fail_backward:
            raise RuntimeError("injected backward failure")
        return grad, None


class Fault(nn.Module):
    """Parameter-free identity that raises in forward or in backward when told to."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_forward = False
        self.fail_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail_forward:
            raise RuntimeError("injected forward failure")
        return _FailInBackward.apply(x, self)


class FaultyBlock(TinyBlock):
    """TinyBlock with a Fault between attention and MLP.

    In backward the MLP's gradients are already accumulated when the fault raises, so the
    block's DBuffer is left with a partial gradient; in forward the block is already unsharded.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fault = Fault()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        x = self.fault(x)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def make_faulty_model(seed: int = 0) -> FinetuneLM:
    torch.manual_seed(seed)
    return FinetuneLM(FaultyBlock, layers=2, tied=True)
