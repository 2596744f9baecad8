"""FSDP2's meta-device flow (build on meta, ``fully_shard``, ``to_empty``, initialize) and ``summon_full_params``.

torchtitan builds its model on the meta device, shards it with no device, calls ``model.to_empty(device=...)``
and then ``init_weights()``. ``to_empty`` used to replace every sharded parameter by a new tensor, unlinked
from its DBuffer: the model trained on zeros without a word. The oracles: the same model built and
initialized eagerly on one process (bit for bit: every rank draws the same whole tensors under one seed),
and one-process training.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import lightning_ragged as lr
from tests.models import lm_loss, make_batches
from tests.test_fully_shard import BATCH, _local, _max_diff
from tests.test_module_lists import ListModel, train_beside


def init_weights(module: nn.Module) -> None:
    """torchtitan-style: truncated normal matrices, zero biases, norms reset; a fan-based init for the blocks."""
    for sub in module.modules():
        if isinstance(sub, nn.Embedding):
            nn.init.trunc_normal_(sub.weight, std=0.02)
        elif isinstance(sub, nn.Linear):
            nn.init.kaiming_uniform_(sub.weight, a=5**0.5)  # reads the fan-in: needs the 2-D weight
            if sub.bias is not None:
                nn.init.zeros_(sub.bias)
        elif isinstance(sub, nn.LayerNorm):
            sub.reset_parameters()


def _storages_linked(model: nn.Module) -> bool:
    """Every parameter the optimizer sees is still a view into its DBuffer's sharded segment."""
    dbuffers = {id(p): b for b in lr.get_state(model).dbuffers() for p in b.sharded_params.values()}
    return all(
        id(p) in dbuffers and p.untyped_storage().data_ptr() == dbuffers[id(p)].sharded.untyped_storage().data_ptr()
        for p in model.parameters()
    )


def check_meta_flow() -> dict:
    torch.manual_seed(0)
    reference = ListModel()
    torch.manual_seed(7)
    init_weights(reference)
    with torch.device("meta"):
        model = ListModel()
    for layer in model.layers:  # FSDP2's order, no device: the shards get storage on the backend's (CPU for gloo)
        lr.fully_shard(layer)
    lr.fully_shard([model.norm, model.output])
    lr.fully_shard(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.to_empty(device="cpu")
    linked = _storages_linked(model)
    torch.manual_seed(7)
    for module in [model.tok_embeddings, model.pos_embeddings, *model.layers, model.norm, model.output]:
        with lr.summon_full_params(module):  # one group at a time, in the eager init's order
            init_weights(module)
    init_diff = _max_diff(lr.full_state_dict(model), reference)
    return {"linked": linked, "init_diff": init_diff, "train_diff": train_beside(model, reference),
            "device": str(next(model.parameters()).device), "warned": [str(w.message) for w in caught]}


@pytest.mark.parametrize("world_size", [2, 3])
def test_meta_flow_initializes_as_eager_and_trains_as_one_process(dist_pool, world_size):
    for result in dist_pool(world_size).run(check_meta_flow):
        assert result["linked"] and result["device"] == "cpu"
        assert len(result["warned"]) == 1 and "summon_full_params" in result["warned"][0]  # once, by the root
        assert result["init_diff"] == 0.0, result  # the same draws into the same whole tensors
        assert result["train_diff"] <= 1e-5, result


def check_to_empty_keeps_shards() -> dict:
    """``to_empty`` on the DBuffers' device keeps the parameters in them (and their values here); another device
    is refused."""
    torch.manual_seed(0)
    reference = ListModel()
    torch.manual_seed(0)
    model = lr.fully_shard(ListModel())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.to("cpu")  # its own device: nothing new, nothing to warn of
        model.float()
    model.to_empty(device="cpu")
    try:
        model.to_empty(device="meta")
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    return {"linked": _storages_linked(model), "train_diff": train_beside(model, reference), "refused": refused,
            "warned_on_to": len(caught)}


def test_to_empty_keeps_the_parameters_in_their_dbuffers(dist_pool):
    for result in dist_pool(2).run(check_to_empty_keeps_shards):
        assert result["linked"]
        assert result["train_diff"] <= 1e-5, result  # unlinked, the DBuffers' zeros trained instead
        assert "would unlink its parameters from their DBuffers" in result["refused"]
        assert result["warned_on_to"] == 0


def check_summon_semantics() -> dict:
    torch.manual_seed(0)
    reference = ListModel()
    torch.manual_seed(0)
    model = lr.fully_shard(ListModel())
    with lr.summon_full_params(model.layers[0]), torch.no_grad():
        inside = {"layer0": tuple(model.layers[0].qkv.weight.shape), "layer1": model.layers[1].qkv.weight.dim()}
        model.layers[0].qkv.weight.mul_(2)
    with lr.summon_full_params(model, writeback=False), torch.no_grad():
        model.output.weight.zero_()
    try:
        with lr.summon_full_params(model.norm), torch.no_grad():
            model.norm.weight.add_(1)
            raise KeyError("user code failed")
    except KeyError:
        pass
    with torch.no_grad():
        reference.layers[0].qkv.weight.mul_(2)
    outside = model.layers[0].qkv.weight.dim()
    refused = ""

    def summon_in_forward(_module, _args):
        with lr.summon_full_params(model):
            pass

    handle = model.layers[1].register_forward_pre_hook(summon_in_forward)
    try:
        lm_loss(model, _local(make_batches(1, BATCH)[0]))
    except RuntimeError as error:
        refused = str(error)
    handle.remove()
    lr.get_state(model).recover()
    return {"inside": inside, "outside": outside, "diff": _max_diff(lr.full_state_dict(model), reference),
            "refused": refused}


def test_summon_full_params_writes_back_only_what_it_should(dist_pool):
    for result in dist_pool(2).run(check_summon_semantics):
        assert result["inside"] == {"layer0": (39, 13), "layer1": 1}  # only the summoned module's group is whole
        assert result["outside"] == 1
        assert result["diff"] == 0.0, result  # doubled kept; writeback=False and a raising block left nothing
        assert "inside a forward or backward" in result["refused"]


def check_summon_with_grads() -> dict:
    """``summon_full_params(with_grads=True)``: whole gradients equal to one process's on the global batch (a
    frozen layer's stay None), read-only: the shards' gradients are unchanged after it."""
    torch.manual_seed(0)
    reference = ListModel()
    torch.manual_seed(0)
    model = lr.fully_shard(ListModel())
    for m in (reference, model):
        m.layers[1].requires_grad_(False)
    batch = make_batches(1, BATCH)[0]
    lm_loss(reference, batch).backward()
    lm_loss(model, _local(batch)).backward()
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    expected = dict(reference.named_parameters())
    with lr.summon_full_params(model, with_grads=True):
        grads = {name: None if p.grad is None else (tuple(p.grad.shape), (p.grad - expected[name].grad).abs().max().item())
                 for name, p in model.named_parameters()}
    after = [p.grad for p in model.parameters() if p.grad is not None]
    return {"grads": grads, "frozen": sorted(n for n, p in reference.named_parameters() if p.grad is None),
            "shapes": {n: tuple(p.shape) for n, p in reference.named_parameters()},
            "unchanged": len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))}


@pytest.mark.parametrize("world", [2, 3])
def test_summon_full_params_with_grads_gives_one_process_gradients(dist_pool, world):
    for result in dist_pool(world).run(check_summon_with_grads):
        assert result["frozen"] and all(result["grads"][name] is None for name in result["frozen"])
        for name, got in result["grads"].items():
            if name not in result["frozen"]:
                shape, diff = got
                assert shape == result["shapes"][name] and diff <= 1e-6, (name, got)  # fp32 means of 2-3 parts
        assert result["unchanged"]


def check_loaded_after_user_sharding_stands(how: str) -> dict:
    """FSDP2's ``configure_model`` flow on the meta device: the user shards each layer, ``to_empty``, then loads
    (torch's ``load_state_dict``, or one layer only); the strategy's setup (``shard_module``) initializes what
    nothing wrote and keeps what was loaded (before this session's fix: zeros kept; a first fix re-initialized the
    loaded layers too, found by review)."""
    from lightning_ragged.lightning.sharding import shard_module

    def build() -> nn.Module:
        return nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))

    torch.manual_seed(0)
    pretrained = {k: v + 1.0 for k, v in build().state_dict().items()}  # not what an initialization draws
    with torch.device("meta"):
        model = build()
    for layer in model[0]:
        lr.fully_shard(layer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # to_empty's "uninitialized" warning
        model.to_empty(device="cpu")
    if how == "all":
        model.load_state_dict(pretrained)
    else:  # the first layer only
        lr.load_full_state_dict(model[0][0], {k[4:]: v for k, v in pretrained.items() if k.startswith("0.0.")})
    shard_module(model, device=torch.device("cpu"))
    full = lr.full_state_dict(model)
    loaded = [k for k in pretrained if how == "all" or k.startswith("0.0.")]
    return {"loaded_kept": max((full[k] - pretrained[k]).abs().max().item() for k in loaded),
            "others_initialized": all(full[k].abs().sum() > 0 and (full[k] - pretrained[k]).abs().max() > 0.5
                                      for k in pretrained if k not in loaded)}


@pytest.mark.parametrize("how", ["all", "one-layer"])
def test_weights_loaded_after_user_sharding_on_meta_stand(dist_pool, how):
    for result in dist_pool(2).run(check_loaded_after_user_sharding_stands, how):
        assert result["loaded_kept"] == 0.0 and result["others_initialized"], result
