"""A large untied input embedding is a group of its own, freed after its lookup and never re-gathered for
backward (its backward reads only the indices), and FSDP2's ``set_unshard_in_backward``.

Oracles: single-process training (parity), the DBuffers' own events (which all-gathers ran, when the full
buffers were alive), and the same training with the re-gather forced back on (``set_unshard_in_backward(True)``:
bitwise the same weights, one more all-gather of the table per step).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import lightning_ragged as lr
from lightning_ragged.engine.events import EventKind
from tests.models import SEQ, VOCAB, WIDTH, TinyBlock, make_batches
from tests.test_fully_shard import BATCH, _local, _max_diff

STEPS = 3


class UntiedLM(nn.Module):
    """Token embedding (untied: its own group), positional embedding (too small for one), two blocks, head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(TinyBlock() for _ in range(2))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _model() -> UntiedLM:
    torch.manual_seed(0)
    return UntiedLM()


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


class Gathers:
    """Counts each DBuffer's all-gathers and notes whether the embedding's full buffer is alive at a point."""

    def __init__(self, model: nn.Module) -> None:
        self.counts: dict[str, int] = {}
        for group in lr.get_state(model).groups:
            for index, dbuffer in enumerate(group.dbuffers):
                dbuffer.observers.append(self._observer(f"{group.name}.{index}"))

    def _observer(self, name: str):
        counts = self.counts

        class Observer:
            def on_event(self, event) -> None:
                if event.kind is EventKind.UNSHARD_ISSUED:
                    counts[name] = counts.get(name, 0) + 1

        return Observer()


def check_embedding_group(force_regather: bool) -> dict:
    batches = make_batches(STEPS, BATCH)
    reference = _model()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for batch in batches:
        _loss(reference, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    model = lr.fully_shard(_model())
    state = lr.get_state(model)
    embed = next(group for group in state.groups if group.name == "embed")
    if force_regather:
        model.embed.set_unshard_in_backward(True)
    gathers = Gathers(model)
    alive_in_backward = []
    head_hook = model.head.register_full_backward_pre_hook(
        lambda module, grad: alive_in_backward.append(embed.is_unsharded))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    alive_after_forward = []
    for batch in batches:
        loss = _loss(model, _local(batch))
        alive_after_forward.append(embed.is_unsharded)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    head_hook.remove()
    return {
        "groups": [group.name for group in state.groups],
        "root_params": sorted(name for dbuffer in state.root_group.dbuffers for name in dbuffer.sharded_params),
        "unshard_in_backward": embed.unshard_in_backward,
        "embed_gathers_per_step": gathers.counts["embed.0"] / STEPS,
        "alive_after_forward": any(alive_after_forward),
        "alive_in_backward": any(alive_in_backward),
        "diff": _max_diff(lr.full_state_dict(model), reference),
        "full": {k: v.tolist() for k, v in lr.full_state_dict(model).items()},
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_large_embedding_is_a_group_never_regathered_for_backward(dist_pool, world_size):
    pool = dist_pool(world_size)
    for result in pool.run(check_embedding_group, False):
        assert "embed" in result["groups"] and "pos" not in result["groups"], result["groups"]
        assert "pos.weight" in result["root_params"] and "embed.weight" not in result["root_params"], result
        assert result["unshard_in_backward"] is False
        assert result["embed_gathers_per_step"] == 1.0, result["embed_gathers_per_step"]  # the forward's only
        assert not result["alive_after_forward"] and not result["alive_in_backward"]
        assert result["diff"] <= 1e-5, result["diff"]
    forced = pool.run(check_embedding_group, True)
    for result, default in zip(forced, pool.run(check_embedding_group, False)):
        assert result["unshard_in_backward"] is True and result["embed_gathers_per_step"] == 2.0, result
        assert result["full"] == default["full"]  # the re-gather changes nothing but bytes


class ScaledEmbedding(nn.Embedding):
    """An embedding with a forward of its own (as transformers' scaled word embeddings): its backward is not
    known to skip the table, so it is not made a group that would be gathered twice."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens) * 2.0


def check_tied_and_explicit_groups() -> dict:
    """A tied table stays in the root (its other use is the head); explicit group_modules add none."""
    from tests.models import make_model

    tied = lr.get_state(lr.fully_shard(make_model()))
    explicit = lr.get_state(lr.fully_shard(_model(), group_modules=[TinyBlock]))
    scaled = _model()
    scaled.embed = ScaledEmbedding(VOCAB, WIDTH)
    subclassed = lr.get_state(lr.fully_shard(scaled))
    return {"tied": [g.name for g in tied.groups], "explicit": [g.name for g in explicit.groups],
            "subclassed": [g.name for g in subclassed.groups]}


def test_tied_subclassed_or_explicitly_grouped_embeddings_stay_in_the_root(dist_pool):
    result = dist_pool(2).run(check_tied_and_explicit_groups)[0]
    assert result["tied"] == ["blocks.0", "blocks.1"], result
    assert result["explicit"] == ["blocks.0", "blocks.1"], result
    assert result["subclassed"] == ["blocks.0", "blocks.1"], result


class ReadsTableLM(UntiedLM):
    """A head that reads the token table itself (DeBERTa-v2's MLM head), only when asked for logits."""

    def forward(self, tokens: torch.Tensor, hidden_only: bool = False, fail: bool = False) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1]))
        if fail:
            raise ValueError("a forward that raises before the head (a batch-size finder's out-of-memory)")
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return x if hidden_only else F.linear(x, self.embed.weight)


def check_reads_found_after_first_forwards(first: str) -> dict:
    """``first``: "eval_hidden" (a no-grad forward that never reaches the head, Lightning's sanity check of a
    validation_step on hidden states) or "raises" (a training forward that raises before the head); then
    ``STEPS`` AdamW steps, against one process."""
    torch.manual_seed(0)
    reference = ReadsTableLM()
    model = ReadsTableLM()
    model.load_state_dict(reference.state_dict())
    lr.fully_shard(model)
    batches = make_batches(STEPS, BATCH)
    if first == "compiled":  # no probe under torch.compile: the group is held, as if read outside
        model = torch.compile(model, backend="aot_eager")
    elif first == "eval_hidden":
        with torch.no_grad():
            model(_local(batches[0])[:, :-1], hidden_only=True)
    else:
        try:
            model(_local(batches[0])[:, :-1], fail=True)
        except ValueError:
            pass
    ours, theirs = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for batch in batches:
        for net, tokens, optimizer in ((model, _local(batch), ours), (reference, batch, theirs)):
            _loss(net, tokens).backward()
            optimizer.step()
            optimizer.zero_grad()
    group = next(g for g in lr.get_state(getattr(model, "_orig_mod", model)).groups if g.name == "embed")
    full = lr.full_state_dict(getattr(model, "_orig_mod", model))
    return {"diff": _max_diff(full, reference), "read_outside": group.read_outside_forward}


@pytest.mark.parametrize("first", ["eval_hidden", "raises", "compiled"])
def test_a_table_read_is_found_by_the_first_completed_training_forward(dist_pool, first):
    """Probing goes on until a training forward completes (before: only the first forward was probed, and a
    head reading the table later got the 1-D shard: 'mat2 must be a matrix, got 1-D tensor')."""
    for result in dist_pool(2).run(check_reads_found_after_first_forwards, first):
        assert result["read_outside"] and result["diff"] <= 1e-5, result
