"""A group of several modules whose forward runs only some of them, then the others alone (torchtitan's chunked loss).

``fully_shard([model.norm, model.head])`` (the grouping the README recommends) with a forward that returns the
hidden states (``skip_head=True``) and a loss computed chunk by chunk, each ``model.head(chunk)`` with its own
backward, then ``h.backward`` (torch's ``test_partial_group_forward_*`` tests). Before: the group waited for the
head that never ran, so a later ``head(chunk)`` saw its 1-D shard ("size mismatch"), or the norm's gradients were
wrong (1.1 relative), or accumulation read freed memory (gradients of 1e19), or two such forwards before one
backward crashed autograd. Now a forward finishes the members that did not run (as FSDP2's root does) and a member
called outside the model's forward is a use of the group on its own. Also: every member casts its inputs under
``cast_forward_inputs`` (not only the first), and one tensor passed as several inputs (``MultiheadAttention(x, x,
x)``) stays one object, so self-attention's recomputation under activation checkpointing matches its forward.
The oracle: the same steps on one process over every rank's batch, fp32, bound 1e-5 (measured ~5e-7).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

import lightning_ragged as lr

DIM, VOCAB, STEPS, MICRO = 32, 128, 3, 3


class ChunkedHeadModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.body = nn.Linear(DIM, DIM, bias=False)
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        h = self.norm(self.body(self.embed(tokens)))
        return h if skip_head else self.head(h)


def _chunked_step(model: ChunkedHeadModel, tokens: torch.Tensor, scale: float) -> None:
    h = model(tokens, skip_head=True)
    grads = []
    for chunk in torch.chunk(h.detach(), 2, dim=1):
        chunk = chunk.contiguous().requires_grad_(True)
        (model.head(chunk).pow(2).mean() * scale).backward()
        grads.append(chunk.grad)
    h.backward(torch.cat(grads, dim=1))


def _step(model: ChunkedHeadModel, mode: str, tokens: list[torch.Tensor], scale: float) -> None:
    if mode == "double":  # two partial forwards, one backward
        h1, h2 = model(tokens[0], skip_head=True), model(tokens[1], skip_head=True)
        ((h1.mean() + h2.pow(2).mean()) * scale).backward()
    elif mode == "chunked":
        _chunked_step(model, tokens[0], scale)
    else:  # chunked micro-batches without reduction until the last
        for index, micro in enumerate(tokens):
            if isinstance(model, lr.FSDPModule):
                model.set_requires_gradient_sync(index == len(tokens) - 1)
            _chunked_step(model, micro, scale)


def check_partial_group(mode: str) -> float:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference, model = ChunkedHeadModel(), ChunkedHeadModel()
    model.load_state_dict(reference.state_dict())
    lr.fully_shard(model.embed)
    lr.fully_shard(model.body)
    lr.fully_shard([model.norm, model.head])
    lr.fully_shard(model)
    # SGD: Adam's normalization turns fp32 summation-order noise on gradients that are ~0 into whole lr-sized steps
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    tokens = torch.randint(0, VOCAB, (STEPS, world, MICRO, 2, 16), generator=torch.Generator().manual_seed(1))
    for step in range(STEPS):
        for r in range(world):  # one process: every rank's batch, each weighted 1/world (the ranks' mean)
            _step(reference, mode, list(tokens[step, r]), 1.0 / world)
        _step(model, mode, list(tokens[step, rank]), 1.0)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    full = lr.full_state_dict(model)
    return max((full[name] - value).abs().max().item() for name, value in reference.state_dict().items())


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("mode", ["chunked", "chunked_accum", "double"])
def test_a_group_whose_forward_skips_a_member_trains_as_one_process(dist_pool, world_size, mode):
    assert max(dist_pool(world_size).run(check_partial_group, mode)) <= 1e-5


class _Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.layers = nn.ModuleList(nn.TransformerDecoderLayer(16, 2, 8, dropout=0.0, batch_first=True)
                                    for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        for layer in self.layers:
            h = layer(h, x)
        return h


def check_decoder_layers_under_checkpointing() -> float:
    """FSDP2's per-block calls on ``nn.TransformerDecoderLayer`` under composable activation checkpointing (the
    calls split each layer at its attention modules: warned). Before: ``CheckpointError`` at the first backward
    (the attention's q, k, v were three objects in forward and one in the recomputation)."""
    from torch.distributed._composable import checkpoint

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference, model = _Decoder(), _Decoder()
    model.load_state_dict(reference.state_dict())
    for layer in model.layers:
        checkpoint(layer)
        lr.fully_shard(layer)
    with pytest.warns(UserWarning):
        lr.fully_shard(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    data = torch.randn(STEPS, 2 * world, 5, 16, generator=torch.Generator().manual_seed(1))
    for step in range(STEPS):
        reference(data[step]).pow(2).mean().backward()
        model(data[step].chunk(world)[rank]).pow(2).mean().backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    full = lr.full_state_dict(model)
    return max((full[name] - value).abs().max().item() for name, value in reference.state_dict().items())


def test_self_attention_blocks_under_activation_checkpointing_train_as_one_process(dist_pool):
    assert max(dist_pool(2).run(check_decoder_layers_under_checkpointing)) <= 1e-5


def check_every_member_casts_its_inputs() -> str:
    """``cast_forward_inputs`` on a group of two modules: the second gets an fp32 tensor (before: "expected m1 and
    m2 to have the same dtype"; FSDP2 casts every member's inputs)."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x).float())

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=True)
    model = Model()
    lr.fully_shard([model.a, model.b], mp_policy=policy)
    lr.fully_shard(model, mp_policy=policy)
    out = model(torch.randn(2, 8))
    out.sum().backward()
    return str(out.dtype)


def test_every_member_of_a_group_casts_its_inputs(dist_pool):
    assert dist_pool(2).run(check_every_member_casts_its_inputs) == ["torch.bfloat16"] * 2
