"""FSDP2's ``fully_shard([module, ...])``: one group of several modules, adopted by the model's call.

torchtitan shards ``[model.norm, model.output]`` together, and torch's own FSDP2 tests group
``[tok_embeddings, pos_embeddings]``, two blocks, and a tied ``[tok_embeddings, output]`` this way.
The oracles: the same model trained on one process (5 AdamW steps), and torch's FSDP2 given the very
same calls (its losses, and the all-gathers it issues per step, counted by one dispatch mode for both).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode

import lightning_ragged as lr
from lightning_ragged.observability.collective_counter import CollectiveCounter
from tests.models import SEQ, VOCAB, WIDTH, TinyBlock, lm_loss, make_batches
from tests.test_fully_shard import BATCH, STEPS, _local, _max_diff


class ListModel(nn.Module):
    """The shape of torch's FSDP2 test Transformer: token and position embeddings, blocks, norm, output."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, WIDTH)
        self.pos_embeddings = nn.Embedding(SEQ, WIDTH)
        self.layers = nn.ModuleList(TinyBlock() for _ in range(3))
        self.norm = nn.LayerNorm(WIDTH)
        self.output = nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(tokens.shape[1]))
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def _shard(model: ListModel, grouping: str, shard, **kwargs) -> None:
    """``grouping``'s calls with ``shard`` (ours or torch's ``fully_shard``), the model's call last."""
    if grouping == "torchtitan":  # torchtitan's apply_fsdp
        shard(model.tok_embeddings, **kwargs)
        for layer in model.layers:
            shard(layer, **kwargs)
        shard([model.norm, model.output], **kwargs, reshard_after_forward=False)
    elif grouping == "mem_eff":  # torch's test_fully_shard_training; lists not in the order they run
        shard(model.layers[0], **kwargs)
        shard([model.layers[1], model.layers[2]], **kwargs)
        shard([model.pos_embeddings, model.tok_embeddings], **kwargs)
        shard([model.output, model.norm], **kwargs)
    elif grouping == "tied":  # torch's "mem_eff_weight_tied": the shared weight's two users in one group
        shard([model.tok_embeddings, model.output], **kwargs)
        for layer in model.layers:
            shard(layer, **kwargs)
    shard(model, **kwargs)


GROUPINGS = ("torchtitan", "mem_eff", "tied")


def train_beside(model: nn.Module, reference: nn.Module) -> float:
    """5 AdamW steps of the sharded ``model`` (each rank its part of the batch) and of ``reference`` on one process
    (the global batch); the largest parameter difference after them."""
    data = make_batches(STEPS, BATCH)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, model)]
    for step in range(STEPS):
        lm_loss(model, _local(data[step])).backward()
        lm_loss(reference, data[step]).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return _max_diff(lr.full_state_dict(model), reference)


def check_lists_train_as_one_process(grouping: str) -> dict:
    torch.manual_seed(0)
    reference = ListModel(tied=grouping == "tied")
    torch.manual_seed(0)
    model = ListModel(tied=grouping == "tied")
    _shard(model, grouping, lr.fully_shard)
    max_diff = train_beside(model, reference)
    state = lr.get_state(model)
    return {
        "max_diff": max_diff,
        "state_dict_keys": sorted(model.state_dict()) == sorted(reference.state_dict()),
        "groups": {g.name: [type(m)._ragged_original.__name__ for m in g.members] for g in state.all_groups if g.dbuffers},
        "one_group_each": all(
            len(m._ragged_own_groups()) == 1 and m._ragged_own_groups()[0] in state.all_groups
            for g in state.groups for m in g.members
        ),
        "fsdp_modules": all(isinstance(m, lr.FSDPModule) for g in state.groups for m in g.members),
        "members_settled": all(not g.members_to_run for g in state.all_groups),
    }


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("grouping", GROUPINGS)
def test_lists_train_as_one_process(dist_pool, world_size, grouping):
    expected = {
        "torchtitan": {"tok_embeddings": ["Embedding"], "layers.0": ["TinyBlock"], "layers.1": ["TinyBlock"],
                       "layers.2": ["TinyBlock"], "norm+output": ["LayerNorm", "Linear"],
                       "root": ["ListModel"]},  # the position table: no call of its own
        "mem_eff": {"layers.0": ["TinyBlock"], "layers.1-2": ["TinyBlock", "TinyBlock"],
                    "pos_embeddings+tok_embeddings": ["Embedding", "Embedding"],
                    "output+norm": ["Linear", "LayerNorm"]},
        "tied": {"tok_embeddings+output": ["Embedding", "Linear"], "layers.0": ["TinyBlock"],
                 "layers.1": ["TinyBlock"], "layers.2": ["TinyBlock"], "root": ["ListModel"]},  # norm, positions
    }[grouping]
    for result in dist_pool(world_size).run(check_lists_train_as_one_process, grouping):
        assert result["max_diff"] <= 1e-5, result
        assert result["groups"] == expected  # one group per call, the model's own call holding what is left
        assert result["one_group_each"] and result["fsdp_modules"] and result["members_settled"]
        assert result["state_dict_keys"]


POINT_TO_POINT = ("c10d.send", "c10d.recv_")
"""Our pairwise reduction's and all-gather's sends and receives: counted by ``CollectiveCounter``, not by
``CommDebugMode``."""


def _step_with_counts(model: nn.Module, tokens: torch.Tensor) -> tuple[float, int, bool]:
    """The step's loss (mean over ranks), its all-gathers, and whether our counter agrees with torch's
    ``CommDebugMode`` on every collective (it can here: no forward of this model is replaced)."""
    with CollectiveCounter() as counted, CommDebugMode() as torch_counted:
        loss = lm_loss(model, tokens)
        loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    collectives = {op: n for op, n in counted.by_op.items() if op not in POINT_TO_POINT}  # CommDebugMode skips these
    agrees = collectives == {str(op): n for op, n in torch_counted.get_comm_counts().items() if n}
    gathers = sum(n for op, n in counted.by_op.items() if "allgather" in op.replace("_", ""))
    return total.item() / dist.get_world_size(), gathers, agrees


def check_lists_as_fsdp2(grouping: str) -> dict:
    """Ours and torch's FSDP2 with the same calls: losses and all-gathers of each of 3 steps."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    data = make_batches(3, BATCH)
    results = {}
    for name, shard in (("ragged", lr.fully_shard), ("fsdp2", torch_fully_shard)):
        torch.manual_seed(0)
        model = ListModel(tied=grouping == "tied")
        _shard(model, grouping, shard)
        if name == "fsdp2":  # an embedding's group is never re-gathered for its backward here (decided by itself)
            for module in {"torchtitan": [model.tok_embeddings], "mem_eff": [model.pos_embeddings]}.get(grouping, []):
                module.set_unshard_in_backward(False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        steps = []
        for step in range(3):
            issued = lr.get_state(model).stats.all_gathers if name == "ragged" else 0
            loss, gathers, agrees = _step_with_counts(model, _local(data[step]))
            if name == "ragged":  # gloo: our all-gathers are point-to-point sends; the engine counts each once
                assert gathers == 0
                gathers = lr.get_state(model).stats.all_gathers - issued
            steps.append((loss, gathers, agrees))
            opt.step()
            opt.zero_grad()
        results[name] = steps
        if name == "ragged":  # one all-gather per DBuffer: the root's parameters before and after the blocks
            results["extra"] = max(len(lr.get_state(model).root_group.dbuffers) - 1, 0)  # are two: FSDP2 gathers one
    return results


@pytest.mark.parametrize("grouping", GROUPINGS)
def test_lists_match_fsdp2_losses_and_all_gathers(dist_pool, grouping):
    for result in dist_pool(2).run(check_lists_as_fsdp2, grouping):
        for (ours, ours_gathers, agrees), (theirs, their_gathers, their_agrees) in zip(result["ragged"], result["fsdp2"]):
            assert agrees and their_agrees, result  # CollectiveCounter counts what CommDebugMode counts
            assert abs(ours - theirs) <= 1e-5 * abs(theirs), result
            assert ours_gathers == their_gathers + result["extra"], result  # the root: once a step


def check_hf_llama_lists() -> dict:
    """transformers' Llama, tied: ``[model.embed_tokens, lm_head]`` are not siblings; ``[model.norm]`` alone."""
    from tests.hf_models import make_llama, make_tokens

    data = make_tokens(STEPS, BATCH)
    models = []
    for _ in range(2):
        model = make_llama(seed=0)
        model.config.tie_word_embeddings = True
        model.tie_weights()
        models.append(model)
    reference, model = models
    lr.fully_shard([model.model.embed_tokens, model.lm_head])
    for layer in model.model.layers:
        lr.fully_shard(layer)
    lr.fully_shard([model.model.norm])
    lr.fully_shard(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, model)]
    for step in range(STEPS):
        model(input_ids=_local(data[step]), labels=_local(data[step])).loss.backward()
        reference(input_ids=data[step], labels=data[step]).loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    full = lr.full_state_dict(model)
    expected = reference.state_dict()
    return {
        "max_diff": max((full[k] - expected[k]).abs().max().item() for k in expected),
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "groups": sorted(g.name for g in lr.get_state(model).all_groups if g.dbuffers),
    }


def test_hf_llama_tied_list_of_non_siblings_trains_as_one_process(dist_pool):
    for result in dist_pool(2).run(check_hf_llama_lists):
        assert result["max_diff"] <= 1e-5, result
        assert result["tied"]
        assert result["groups"] == ["model.embed_tokens+lm_head", "model.layers.0", "model.layers.1", "model.norm"]


def check_refusals() -> dict:
    errors = {}

    def error(key, call):
        try:
            call()
        except (TypeError, ValueError, RuntimeError) as exc:
            errors[key] = str(exc)

    model = ListModel()
    error("empty", lambda: lr.fully_shard([]))
    error("not_a_module", lambda: lr.fully_shard([model.norm, "output"]))
    error("twice", lambda: lr.fully_shard([model.norm, model.norm]))
    error("nested", lambda: lr.fully_shard([model.layers, model.layers[0]]))
    error("group_modules", lambda: lr.fully_shard([model.norm, model.output], blocks_per_group=2))
    lr.fully_shard([model.norm, model.output])
    error("forward_before_adoption", lambda: model(torch.zeros(1, SEQ, dtype=torch.long)))
    error("listed_again", lambda: lr.fully_shard([model.output]))
    lr.fully_shard(model)
    loss = lm_loss(model, _local(make_batches(1, BATCH)[0]))  # runs once adopted
    other = ListModel()
    lr.fully_shard([other.layers[0], other.norm])
    error("outside", lambda: lr.fully_shard(other.layers))  # holds layers[0] of the list, not its norm
    return {"errors": errors, "loss_finite": bool(torch.isfinite(loss))}


def test_bad_lists_are_refused_by_name(dist_pool):
    result = dist_pool(2).run(check_refusals)[0]
    errors = result["errors"]
    assert "non-empty list" in errors["empty"] and "'output'" in errors["not_a_module"]
    assert "listed twice" in errors["twice"]
    assert "TinyBlock is inside ModuleList" in errors["nested"]
    assert "a list given to fully_shard is one group already" in errors["group_modules"]
    assert "fully_shard(model) after the blocks and lists" in errors["forward_before_adoption"]
    assert "cannot be sharded" in errors["listed_again"]
    assert result["loss_finite"]
    assert "its modules ['LayerNorm'] are not inside it" in errors["outside"]
