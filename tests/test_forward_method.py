"""``lr.register_fsdp_forward_method``: FSDP2's way to run a method other than ``forward`` on a sharded model.

A method that reads the root's parameters itself before calling any module that owns one (a
learned positional table, as here) sees this rank's 1-D shard without it. Oracle:
single-process training of the same model through the same method.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._composable import checkpoint

import lightning_ragged as lr
from tests.models import TinyBlock, TinyLM, lm_loss, make_batches


class Scorer(TinyLM):
    """TinyLM with methods that are not ``forward``: one reads ``self.pos`` first, one calls ``self(x)`` twice."""

    def score(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.pos[: tokens.shape[1]] * 2.0 + self.embed(tokens)  # the root's parameter, read directly
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)).logsumexp(-1).mean()

    def twice(self, tokens: torch.Tensor) -> torch.Tensor:  # like generate: forward inside, more than once
        return self(tokens).logsumexp(-1).mean() + self(tokens.flip(1)).logsumexp(-1).mean()


def _make(seed: int = 0) -> Scorer:
    torch.manual_seed(seed)
    return Scorer()


def _shard(model: Scorer) -> Scorer:
    for block in model.blocks:
        lr.fully_shard(block)
    return lr.fully_shard(model)


def _unregistered_score() -> str:
    model = _shard(_make())
    try:
        with torch.no_grad():
            model.score(make_batches(1, 2)[0][:, :-1])
    except RuntimeError as error:
        return str(error)
    return "no error"


def _train_through_methods() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    reference, sharded = _make(), _shard(_make())
    lr.register_fsdp_forward_method(sharded, "score")
    lr.register_fsdp_forward_method(sharded, "twice")
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, sharded)]
    loss_diff = 0.0
    for step, batch in enumerate(make_batches(4, 2 * world)):
        tokens = batch[:, :-1]
        method = "score" if step % 2 == 0 else "twice"
        with torch.no_grad():  # evaluation through the method first: gathered, then released
            loss_diff = max(loss_diff, abs(getattr(sharded, method)(tokens).item()
                                           - getattr(reference, method)(tokens).item()))
        getattr(reference, method)(tokens).backward()
        local = getattr(sharded, method)(tokens[2 * rank : 2 * rank + 2])
        local.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    full = lr.full_state_dict(sharded)
    param_diff = max((full[name] - value).abs().max().item() for name, value in reference.state_dict().items())
    plain = _make()
    lr.register_fsdp_forward_method(plain, "score")  # never sharded: the method as it is
    tokens = make_batches(1, 2)[0][:, :-1]
    plain_same = torch.equal(plain.score(tokens), _make().score(tokens))
    refused = []
    for name in ("no_such_method", "embed", "pos"):  # a missing name, a submodule, a parameter
        try:
            lr.register_fsdp_forward_method(sharded, name)
            refused.append("no error")
        except ValueError as error:
            refused.append(str(error))
    return {"loss_diff": loss_diff, "param_diff": param_diff, "refused": refused, "plain_same": plain_same}


def test_a_method_reading_root_parameters_needs_registering(dist_pool) -> None:
    for message in dist_pool(2).run(_unregistered_score):
        assert "size of tensor" in message, message  # the 1-D shard met the 2-D activations


@pytest.mark.parametrize("world_size", [2, 3])
def test_registered_methods_train_as_single_process(dist_pool, world_size: int) -> None:
    for result in dist_pool(world_size).run(_train_through_methods):
        # fp32, 4 AdamW steps at lr 1e-2, the batch split over ranks: the usual 1e-5 of this suite
        assert result["loss_diff"] <= 1e-5 and result["param_diff"] <= 1e-5, result
        assert "does not have a method 'no_such_method'" in result["refused"][0], result
        assert "embed is a Embedding, not a method" in result["refused"][1], result
        assert "pos is a Parameter, not a method" in result["refused"][2], result
        assert result["plain_same"], result


class ReluBlock(TinyBlock):
    def relu_forward(self, x: torch.Tensor) -> torch.Tensor:  # the block's forward with relu: its own parameters
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.down(F.relu(self.up(self.norm2(x))))


class ReluLM(TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ReluBlock() for _ in range(2))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block.relu_forward(x)
        return self.head(self.norm(x))


def _checkpointed_blocks_with_a_method() -> float:
    """Blocks under torch's composable checkpoint, a block method registered before sharding."""
    torch.manual_seed(0)
    reference = ReluLM()
    torch.manual_seed(0)
    sharded = ReluLM()
    for block in sharded.blocks:
        checkpoint(block)  # recomputes block(...) in backward: it must not stand in for the method
        lr.register_fsdp_forward_method(block, "relu_forward")
        lr.fully_shard(block)
    lr.fully_shard(sharded)
    return _train_beside(reference, sharded, steps=2)


def _train_beside(reference: nn.Module, sharded: nn.Module, steps: int) -> float:
    """AdamW steps of one process on the global batch and of the sharded model on this rank's part: the largest
    parameter difference after them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, sharded)]
    for tokens in make_batches(steps, 2 * world):
        lm_loss(reference, tokens).backward()
        lm_loss(sharded, tokens[2 * rank : 2 * rank + 2]).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    full = lr.full_state_dict(sharded)
    return max((full[name] - value).abs().max().item() for name, value in reference.state_dict().items())


def test_only_the_engine_hooks_run_around_a_method(dist_pool) -> None:
    # With the method run through module(...), checkpoint's hook recomputed forward (gelu) for it (relu):
    # wrong gradients, no error. fp32, 2 AdamW steps: 1e-5 as above.
    for param_diff in dist_pool(2).run(_checkpointed_blocks_with_a_method):
        assert param_diff <= 1e-5, param_diff


class SubmoduleCheckpointLM(TinyLM):
    """Checkpoints a function of each block's MLP submodules from the model's forward, never calling the block."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = x + torch.utils.checkpoint.checkpoint(
                lambda t, b=block: b.down(F.gelu(b.up(b.norm2(t)))), x, use_reentrant=False)
        return self.head(self.norm(x))


def _submodules_called_without_their_block() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = make_batches(1, 2 * world)[0]
    torch.manual_seed(0)
    per_block = lr.fully_shard(SubmoduleCheckpointLM())  # the default: a group per block, gathered by the block
    try:
        lm_loss(per_block, tokens[2 * rank : 2 * rank + 2])
        refused = "no error"
    except RuntimeError as error:
        refused = str(error)
    # The fix the error names: one group for the whole model (gathered by the root's forward), vs one process.
    torch.manual_seed(0)
    reference = SubmoduleCheckpointLM()
    torch.manual_seed(0)
    whole = lr.fully_shard(SubmoduleCheckpointLM(), group_modules=())
    param_diff = _train_beside(reference, whole, steps=3)
    # The checks run through the first training step only: the second training forward removes them.
    model = _shard(_make())
    hooks = []
    for tokens in make_batches(2, 2):
        hooks.append(len(model.blocks[0].up._forward_pre_hooks))
        lm_loss(model, tokens).backward()
    hooks.append(len(model.blocks[0].up._forward_pre_hooks))
    return {"refused": refused, "param_diff": param_diff, "hooks": hooks}


def test_a_submodule_called_without_its_block_is_named(dist_pool) -> None:
    # Before, torch's bare errors, different per rank ("mat2 must be a matrix", "Expected weight to be of same
    # shape as normalized_shape"); now every rank names the module, its group and the fixes.
    for result in dist_pool(2).run(_submodules_called_without_their_block):
        refused = result["refused"]
        assert "module 'blocks.0.norm2' was called while its FSDP group 'blocks.0' is sharded" in refused, refused
        assert "register_fsdp_forward_method" in refused and "group_modules=()" in refused, refused
        assert result["param_diff"] <= 1e-5, result  # fp32, 3 AdamW steps at lr 1e-2: this suite's 1e-5
        assert result["hooks"] == [1, 1, 0], result
