"""Groups of several consecutive blocks, and ``planning="auto"``, on 2 and 3 gloo ranks.

The oracle is the same benchmark GPT trained on one process over the global batch; the
auto-planner's choice is checked against ``auto_plan`` called on a description of the
model written out here by hand.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import lightning_ragged as lr
from benchmarks.models import GPTConfig, lm_loss, make_batches, make_gpt
from lightning_ragged.layout.auto import GroupKind, auto_plan

CFG = GPTConfig(vocab=64, width=32, layers=5, heads=2, seq=16)
STEPS = 4
BATCH = 6
BUDGET = 10**6
LR = 1e-3


class Checkpointed(nn.Module):
    """A block whose activations are recomputed in backward (non-reentrant activation checkpointing)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def _model(checkpointed: bool = False) -> nn.Module:
    model = make_gpt(CFG)
    if checkpointed:
        model.blocks = nn.ModuleList(Checkpointed(block) for block in model.blocks)
    return model


def _local(batch: torch.Tensor) -> torch.Tensor:
    per = batch.shape[0] // dist.get_world_size()
    return batch[dist.get_rank() * per : (dist.get_rank() + 1) * per]


def check_training(kwargs: dict, lists: list[list[int]] | None = None, accumulate: bool = False,
                   checkpointed: bool = False) -> dict:
    """AdamW steps sharded vs one process; collectives per step, groups and their sizes."""
    data = make_batches(STEPS, BATCH, CFG, used_vocab=32)
    reference = _model(checkpointed)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    model = _model(checkpointed)
    if lists is not None:
        kwargs = dict(kwargs, group_modules=[[model.blocks[i] for i in entry] for entry in lists])
    lr.fully_shard(model, **kwargs)
    state = lr.get_state(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    gathers, reduces = [], []
    for step in range(STEPS):
        before = (state.stats.all_gathers, state.stats.reduces)
        local = _local(data[step])
        if accumulate:
            first, second = local.chunk(2)
            with lr.no_sync(model):
                (lm_loss(model, first) * len(first) / len(local)).backward()
            assert state.stats.reduces == before[1], "no_sync micro-batch issued a reduction"
            (lm_loss(model, second) * len(second) / len(local)).backward()
        else:
            lm_loss(model, local).backward()
        gathers.append(state.stats.all_gathers - before[0])
        reduces.append(state.stats.reduces - before[1])
        opt.step()
        opt.zero_grad()
        lm_loss(reference, data[step]).backward()
        reference_opt.step()
        reference_opt.zero_grad()
    full, expected = lr.full_state_dict(model), reference.state_dict()
    block_groups = [g for g in state.groups if g.name != "embed"]  # the token embedding's group of its own
    return {
        "max_diff": max((full[k] - expected[k]).abs().max().item() for k in expected),
        "gathers": gathers,
        "reduces": reduces,
        "sizes": [len(g.members) for g in block_groups],
        "block_dbuffers": sum(len(g.dbuffers) for g in block_groups),
        "root_dbuffers": len(state.root_group.dbuffers),
        "embed_dbuffers": sum(len(g.dbuffers) for g in state.groups if g.name == "embed"),
        "dbuffers": sum(len(g.dbuffers) for g in state.all_groups),
        "names": [g.name for g in block_groups],
    }


VARIANTS = {
    "k2": (dict(blocks_per_group=2), None, False, False),
    "k3-keep-unsharded": (dict(blocks_per_group=3, reshard_after_forward=False), None, False, False),
    "lists": (dict(), [[0, 1], [2], [3, 4]], False, False),
    "k2-no-sync": (dict(blocks_per_group=2), None, True, False),
    "k2-checkpointed": (dict(blocks_per_group=2), None, False, True),
    "k4-matrix": (dict(blocks_per_group=4, shard_granularity="matrix"), None, False, False),
}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_block_groups_train_like_single_process(dist_pool, world_size, variant):
    kwargs, lists, accumulate, checkpointed = VARIANTS[variant]
    result = dist_pool(world_size).run(check_training, kwargs, lists, accumulate, checkpointed)[0]
    assert result["max_diff"] <= 1e-5, result
    k = kwargs.get("blocks_per_group")
    expected = [len(entry) for entry in lists] if lists else [min(k, CFG.layers - i) for i in range(0, CFG.layers, k)]
    assert result["sizes"] == expected and len(expected) == (len(lists) if lists else math.ceil(CFG.layers / k))
    if variant == "lists":
        assert result["names"] == ["blocks.0-1", "blocks.2", "blocks.3-4"]
    # one reduction per DBuffer; all-gathers: twice per block DBuffer (once kept), once per root DBuffer and
    # once for the embedding's (its backward reads no weight)
    assert result["embed_dbuffers"] == (0 if lists else 1), result  # explicit group_modules: only those
    assert result["reduces"] == [result["dbuffers"]] * STEPS, result
    per_block = 1 if kwargs.get("reshard_after_forward") is False else 2
    once = result["root_dbuffers"] + result["embed_dbuffers"]
    expected_gathers = (per_block * result["block_dbuffers"] + once) * (2 if accumulate else 1)
    assert result["gathers"] == [expected_gathers] * STEPS, result


def _description() -> list[GroupKind]:
    """The benchmark GPT's groups, written out by hand: the token embedding, 5 identical blocks, the root's two runs."""
    w, v = CFG.width, CFG.vocab
    block = [("ln1.weight", (w,)), ("ln1.bias", (w,)), ("qkv.weight", (3 * w, w)), ("qkv.bias", (3 * w,)),
             ("proj.weight", (w, w)), ("proj.bias", (w,)), ("ln2.weight", (w,)), ("ln2.bias", (w,)),
             ("fc.weight", (4 * w, w)), ("fc.bias", (4 * w,)), ("out.weight", (w, 4 * w)), ("out.bias", (w,))]
    root = [[("pos.weight", (CFG.seq, w))], [("ln_f.weight", (w,)), ("ln_f.bias", (w,)), ("head.weight", (v, w))]]
    members = [f"blocks.{i}" for i in range(CFG.layers)]
    return [GroupKind("embed", 1, [[("weight", (v, w))]], ["embed"]), GroupKind("blocks", CFG.layers, [block], members),
            GroupKind("root", 1, root, ["root"])]


def check_auto(granularity: str) -> dict:
    data = make_batches(STEPS, BATCH, CFG, used_vocab=32)
    model = lr.fully_shard(_model(), shard_granularity=granularity, planning="auto", memory_budget_bytes=BUDGET)
    state = lr.get_state(model)
    reference = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    for step in range(STEPS):
        lm_loss(model, _local(data[step])).backward()
        opt.step()
        opt.zero_grad()
        lm_loss(reference, data[step]).backward()
        reference_opt.step()
        reference_opt.zero_grad()
    full, expected = lr.full_state_dict(model), reference.state_dict()
    oracle = auto_plan(_description(), dist.get_world_size(), granularity, BUDGET, alignment=4, master_bytes=4,
                       param_bytes=4, replicate_degree=1)
    return {
        "max_diff": max((full[k] - expected[k]).abs().max().item() for k in expected),
        "members": _applied(model, state),
        "planned": [list(m) for g in oracle.groups if g.kind != "root" for m in g.members],
        "segments": [b.layout.segment_size for g in state.all_groups for b in g.dbuffers],
        "planned_segments": [s for g in oracle.groups for _ in range(g.count) for s in g.segment_sizes],
        "dbuffer_size": state.auto_plan.dbuffer_size,
        "oracle_dbuffer_size": oracle.dbuffer_size,
        "same_plan": state.auto_plan.to_dict()["groups"] == oracle.to_dict()["groups"],
    }


def _applied(model: nn.Module, state) -> list[list[str]]:
    names = {id(m): n for n, m in model.named_modules()}
    return [[names[id(m)] for m in g.members] for g in state.groups]


@pytest.mark.parametrize("world_size", [2, 3])
def test_planning_auto_applies_the_plan(dist_pool, world_size):
    result = dist_pool(world_size).run(check_auto, "matrix")[0]
    assert result["max_diff"] <= 1e-5, result
    assert result["members"] == result["planned"], result
    assert any(len(m) > 1 for m in result["members"]), result  # the small budget and matrix shards merge blocks
    assert sorted(result["segments"]) == sorted(result["planned_segments"]), result
    assert result["dbuffer_size"] == result["oracle_dbuffer_size"] and result["same_plan"], result


def check_bad_inputs() -> list[str]:
    model = _model()
    blocks = model.blocks
    cases = [
        dict(group_modules=[[blocks[0], blocks[2]]]),
        dict(group_modules=[[blocks[0], model.ln_f]]),
        dict(group_modules=[[blocks[0], nn.Linear(2, 2)]]),
        dict(group_modules=[[blocks[1], blocks[0]]]),
        dict(group_modules=[[blocks[0], blocks[1]]], blocks_per_group=2),
        dict(group_modules=[[blocks[0], blocks[1]], blocks[1]]),
        dict(blocks_per_group=0),
        dict(blocks_per_group=True),
        dict(planning="bogus", memory_budget_bytes=BUDGET),
        dict(memory_budget_bytes=BUDGET),
        dict(planning="auto"),
        dict(planning="auto", memory_budget_bytes=BUDGET, blocks_per_group=2),
        # before: dropped, the whole model in the root's group without a word
        dict(group_modules=["Block"]),
        dict(group_modules="Block"),
        dict(group_modules=[3]),
        dict(group_modules=[nn.Conv2d]),
    ]
    messages = []
    for kwargs in cases:
        try:
            lr.fully_shard(_model() if "group_modules" not in kwargs else model, **kwargs)
        except (ValueError, TypeError) as error:
            messages.append(str(error))
        else:
            messages.append("accepted")
    return messages


def test_bad_inputs_get_named_errors(dist_pool):
    messages = dist_pool(2).run(check_bad_inputs)[0]
    assert "accepted" not in messages, messages
    expected = ["not consecutive", "not siblings", "must be a submodule", "not consecutive", "blocks_per_group=2",
                "in several groups",
                "blocks_per_group=0", "blocks_per_group=True", "planning='bogus'", "planning=None",
                "memory_budget_bytes=None", "blocks_per_group=2",
                "entry 'Block' is not a module class, a module or a list of modules (class names are resolved",
                "group_modules='Block' must be a list", "entry 3 is not a module class",
                "group_modules=['Conv2d'] matches no module of GPT"]
    assert len(messages) == len(expected), messages
    for message, words in zip(messages, expected):
        assert words in message, (words, message)


class Scaled(nn.Module):
    """No stack of blocks (groups are formed by size) and per-channel scales in an ``nn.ParameterList``, which
    has no forward: the parent reads them. Before, a small ``dbuffer_size`` made the list a group of its own that
    nothing gathered, and the forward multiplied by 1-D shards (torch's shape error, on some ranks only)."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(13, 12, bias=False)
        self.scales = nn.ParameterList(nn.Parameter(torch.rand(1) + 0.5) for _ in range(12))
        self.out = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.big(x) * torch.cat(list(self.scales))))


def check_size_groups_skip_forwardless_containers() -> dict:
    torch.manual_seed(0)
    data = torch.randn(STEPS, BATCH, 13)
    reference = Scaled()
    model = Scaled()
    model.load_state_dict(reference.state_dict())
    lr.fully_shard(model, dbuffer_size=64)  # 'out' (156 bytes of parameters) is too big: every module is tried
    for net, batches in ((model, [_local(batch) for batch in data]), (reference, list(data))):
        opt = torch.optim.AdamW(net.parameters(), lr=LR)
        for batch in batches:
            net(batch).square().mean().backward()
            opt.step()
            opt.zero_grad()
    full = lr.full_state_dict(model)
    return {
        "groups": [group.name for group in lr.get_state(model).groups],
        "diff": max((full[name] - value).abs().max().item() for name, value in reference.state_dict().items()),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_size_groups_skip_containers_without_a_forward(dist_pool, world_size):
    result = dist_pool(world_size).run(check_size_groups_skip_forwardless_containers)[0]
    assert not any(name.startswith("scales") for name in result["groups"]), result["groups"]
    assert result["diff"] <= 1e-5, result


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


class _Containers(nn.Module):
    """Modules with no forward of their own holding what forward calls: two sibling lists of layers (a GNN's
    ``convs`` and ``norms``), a list of stages of blocks, a block holding two dicts of heads."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.convs = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.norms = nn.ModuleList(nn.LayerNorm(8) for _ in range(2))
        self.stages = nn.ModuleList([nn.ModuleList([_Block(), _Block()]), nn.ModuleList([_Block()])])
        self.heads = nn.ModuleDict({"x": nn.Linear(8, 4)})
        self.more = nn.ModuleDict({"y": nn.Linear(8, 4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv, norm in zip(self.convs, self.norms):
            x = norm(torch.relu(conv(x)))
        for stage in self.stages:
            for block in stage:
                x = block(x)
        return self.heads["x"](x) + self.more["y"](x)


def check_default_groups_skip_containers() -> dict:
    """Before: the default grouping made ``convs``, ``norms``, ``stages.0``... groups of their own, which nothing
    calls: "module 'convs.0' was called while its FSDP group 'convs' is sharded" at the first forward."""
    torch.manual_seed(1)
    data = torch.randn(2, BATCH, 8)
    results = {}
    for pattern in ("one call", "FSDP2's calls"):
        reference, model = _Containers(), _Containers()
        if pattern == "FSDP2's calls":
            for stage in model.stages:
                for block in stage:
                    lr.fully_shard(block)
        lr.fully_shard(model)
        for net, batches in ((model, [_local(batch) for batch in data]), (reference, list(data))):
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            for batch in batches:
                net(batch).square().mean().backward()
                opt.step()
                opt.zero_grad()
        full = lr.full_state_dict(model)
        results[pattern] = {
            "groups": [group.name for group in lr.get_state(model).all_groups],
            "diff": max((full[name] - value).abs().max().item() for name, value in reference.state_dict().items()),
        }
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_default_groups_skip_containers_without_a_forward(dist_pool, world_size):
    for pattern, result in dist_pool(world_size).run(check_default_groups_skip_containers)[0].items():
        assert not {"convs", "norms", "stages.0", "stages.1", "heads", "more"} & set(result["groups"]), result
        assert "stages.0.0" in result["groups"], (pattern, result)  # the blocks inside the stages are groups
        assert result["diff"] <= 1e-6, (pattern, result)
