"""fully_shard on 2 and 3 gloo ranks against single-process training and FSDP2.

Every ``check_*`` function runs on all ranks of a shared worker pool; the single-
process oracle is the same model trained on the concatenated global batch.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

import lightning_ragged as lr
from lightning_ragged.observability.copy_counter import CopyCounter
from tests.models import TinyBlock, lm_loss, make_batches, make_model

STEPS = 5
BATCH = 6  # global batch: divisible by 2 and 3 ranks


def _local(batch: torch.Tensor) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    per = batch.shape[0] // world
    return batch[rank * per : (rank + 1) * per]


def _max_diff(full: dict[str, torch.Tensor], reference: nn.Module) -> float:
    expected = reference.state_dict()
    assert full.keys() == expected.keys()
    return max((full[key] - expected[key]).abs().max().item() for key in expected if expected[key].numel())


def block_of_two_rows(name: str, param: torch.Tensor) -> int:
    """A per-parameter policy: 2-row blocks for matrices, elements for the rest."""
    return 2 * param.shape[1] if param.dim() == 2 else 1


def check_training_matches_single_process(
    shard_kwargs: dict, accumulate: bool = False, batch: int = BATCH, forwards: str = "one",
) -> dict:
    """5 AdamW steps sharded vs the same model on one process; returns the max abs difference.

    ``forwards="two"``: each step's loss sums two forwards (the local batch's halves) before one
    backward; ``"discarded"``: a forward with gradients enabled whose graph is dropped precedes it;
    ``"raised-first"``: a forward that raises in the second block comes before the optimizer is built;
    ``"eval-before-step"``: a no-grad forward between backward and the optimizer step (``"...-fused"``: with
    ``AdamW(fused=True)``, whose kernel moves no version counter); ``"kept-after-backward"``:
    ``set_reshard_after_backward(False)`` for the whole run (full parameters kept across every step).
    """
    data = make_batches(STEPS, batch)
    reference = make_model()
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    model = lr.fully_shard(make_model(), **shard_kwargs)
    if forwards == "raised-first":  # e.g. a batch-size finder's out-of-memory, caught
        blocks = [m for m in model.modules() if isinstance(m, TinyBlock)]
        handle = blocks[1].register_forward_pre_hook(lambda module, args: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            lm_loss(model, _local(data[0]))
        handle.remove()
        shards = [hasattr(p, "ragged_shard") for p in model.parameters()]  # before: full views of two groups
        assert all(shards), shards
    if forwards == "kept-after-backward":
        model.set_reshard_after_backward(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=forwards.endswith("fused") or None)
    state = lr.get_state(model)
    reduces_per_step = []
    for step in range(STEPS):
        before = state.stats.reduces
        local = _local(data[step])
        if accumulate:
            first, second = local.chunk(2)  # uneven at 2 ranks: weight each by its share
            with lr.no_sync(model):
                (lm_loss(model, first) * len(first) / len(local)).backward()
            reduces_after_first = state.stats.reduces
            (lm_loss(model, second) * len(second) / len(local)).backward()
            assert reduces_after_first == before, "no_sync micro-batch issued a reduction"
        elif forwards in ("two", "two-eval-between", "two-backwards"):  # two views of a batch, a siamese loss
            first, second = local.chunk(2)
            losses = [lm_loss(model, first) * len(first) / len(local)]
            if forwards == "two-eval-between":
                with torch.no_grad():
                    model(local[:, :-1])  # e.g. pseudo-labels: no graph, no backward
            losses.append(lm_loss(model, second) * len(second) / len(local))
            if forwards == "two-backwards":
                losses[0].backward()
                losses[1].backward()
            else:
                (losses[0] + losses[1]).backward()
        else:
            if forwards == "discarded":
                lm_loss(model, local[:1])  # its graph dies unused; the next forward must not wait for its backward
            lm_loss(model, local).backward()
        reduces_per_step.append(state.stats.reduces - before)
        if forwards.startswith("eval-before-step"):
            with torch.no_grad():
                model(local[:, :-1])  # e.g. a metric on the batch before stepping
        opt.step()
        opt.zero_grad()
        reference_loss = lm_loss(reference, data[step])
        reference_loss.backward()
        reference_opt.step()
        reference_opt.zero_grad()
    dbuffers = sum(len(group.dbuffers) for group in state.all_groups)
    return {
        "max_diff": _max_diff(lr.full_state_dict(model), reference),
        "reduces_per_step": reduces_per_step,
        "dbuffers": dbuffers,
    }


WORLD_SIZES = [2, 3]
SHARDINGS = {
    "element": dict(shard_granularity="element"),
    "row": dict(shard_granularity="row"),
    "block": dict(shard_granularity="block", block_rows=2),
    "matrix": dict(shard_granularity="matrix"),
    "callable": dict(shard_granularity=block_of_two_rows),
    "row-greedy": dict(shard_granularity="row", planning_algorithm="greedy"),
    "row-reduce-scatter": dict(shard_granularity="row", reduce_mode="reduce_scatter"),
    "row-all-reduce": dict(shard_granularity="row", reduce_mode="all_reduce"),  # gloo's default is "pairwise"
    "row-small-dbuffers": dict(shard_granularity="row", dbuffer_size=1000),  # embed, qkv (~2 KB): one each
    "row-keep-unsharded": dict(shard_granularity="row", reshard_after_forward=False),
    "row-explicit-groups": dict(shard_granularity="row", group_modules=[TinyBlock]),
}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("sharding", list(SHARDINGS))
def test_training_matches_single_process(dist_pool, world_size, sharding):
    results = dist_pool(world_size).run(check_training_matches_single_process, SHARDINGS[sharding])
    assert max(r["max_diff"] for r in results) <= 1e-5, results[0]
    assert all(count == results[0]["dbuffers"] for count in results[0]["reduces_per_step"])
    if sharding == "row-small-dbuffers":
        assert results[0]["dbuffers"] > 3  # the small dbuffer_size really split groups into several buffers


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("forwards", ["two", "two-eval-between", "two-backwards", "discarded", "raised-first"])
def test_forwards_without_their_own_backward_match_single_process(dist_pool, world_size, forwards):
    """Two forwards summed into one loss (each block reduced once, after its last call's backward; also with a
    no-grad forward between them), two forwards each with its own backward (each backward reduces what it ran),
    and a forward whose graph was dropped before the next one (released, not waited for)."""
    results = dist_pool(world_size).run(
        check_training_matches_single_process, dict(shard_granularity="row"), False, BATCH, forwards
    )
    assert max(r["max_diff"] for r in results) <= 1e-5, results[0]
    per_step = results[0]["dbuffers"] * (2 if forwards == "two-backwards" else 1)
    assert all(count == per_step for count in results[0]["reduces_per_step"]), results[0]


class _AuxHead(nn.Module):
    """Two blocks and a head in the root; an auxiliary head (also in the root) that only some batches use."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 6)) for _ in range(2))
        self.out = nn.Linear(6, 3)
        self.aux = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, use_aux: bool) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h) + self.aux(h) if use_aux else self.out(h)


def check_root_parameter_used_on_some_ranks() -> float:
    """3 SGD steps; step s uses the auxiliary head on rank s % world only. DDP (find_unused_parameters) is the oracle."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(_AuxHead(), find_unused_parameters=True)
    torch.manual_seed(0)
    model = lr.fully_shard(_AuxHead(), group_modules=[nn.Sequential])
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ddp, model)]
    generator = torch.Generator().manual_seed(rank)
    for step in range(3):
        x, y = torch.randn(4, 4, generator=generator), torch.randn(4, 3, generator=generator)
        for net, optimizer in zip((ddp, model), optimizers):
            nn.functional.mse_loss(net(x, rank == step % world), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    return _max_diff(lr.full_state_dict(model), ddp.module)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_root_parameter_used_on_some_ranks_only_matches_ddp(dist_pool, world_size):
    """The root reduces at the end of backward on every rank, in the same order (a rank-local trigger reordered the
    ranks' collectives: gloo aborted on the size mismatch)."""
    assert max(dist_pool(world_size).run(check_root_parameter_used_on_some_ranks)) <= 1e-6


def check_weight_tied_across_separate_calls() -> list[str]:
    """FSDP2's call pattern (each block, then the root) on blocks that share a weight: refused, not untied."""
    from tests.models import TinyLM

    torch.manual_seed(0)
    model = TinyLM(layers=3)
    model.blocks[2].up.weight = model.blocks[0].up.weight
    lr.fully_shard(model.blocks[0])
    messages = []
    for target in (model.blocks[2], model):  # the other user of the weight, and the parent holding it
        try:
            lr.fully_shard(target)
            messages.append("accepted")
        except ValueError as error:
            messages.append(str(error))
    return messages


def check_module_shared_by_separately_sharded_blocks() -> str:
    """One submodule inside two blocks sharded by separate calls: the second call would shard the first's shards."""
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    first, second = nn.Sequential(shared, nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4), shared)
    lr.fully_shard(first)
    try:
        lr.fully_shard(second)
    except ValueError as error:
        return str(error)
    return "accepted"


def test_module_shared_by_separately_sharded_blocks_is_refused(dist_pool):
    message = dist_pool(2).run(check_module_shared_by_separately_sharded_blocks)[0]
    assert "is shared with a parameter already sharded by another fully_shard call" in message, message


def test_weight_tied_across_separately_sharded_blocks_is_refused(dist_pool):
    block, parent = dist_pool(2).run(check_weight_tied_across_separate_calls)[0]
    assert "parameter 'up.weight' of TinyBlock is shared with a parameter already sharded" in block, block
    assert "parameter 'blocks.2.up.weight' of TinyLM is shared" in parent, parent


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_no_sync_accumulation_matches_single_process(dist_pool, world_size):
    results = dist_pool(world_size).run(check_training_matches_single_process, dict(shard_granularity="row"), True)
    assert max(r["max_diff"] for r in results) <= 1e-5, results[0]


def check_layout_views_and_names() -> dict:
    """Names, shapes and storage: shards are views into the DBuffer and carry their RaggedShard."""
    original = make_model()
    names = [name for name, _ in original.named_parameters()]
    shapes = {name: p.shape for name, p in original.named_parameters()}
    model = lr.fully_shard(make_model(), shard_granularity="row")
    state = lr.get_state(model)
    sharded = dict(model.named_parameters())
    assert list(sharded) == names
    storages = {dbuffer.sharded.untyped_storage().data_ptr() for dbuffer in state.dbuffers()}
    total_local = 0
    for name, param in sharded.items():
        shard = param.ragged_shard
        assert shard.global_shape == shapes[name] and shard.name == name
        assert param.dim() == 1 and param.numel() == shard.local_numel
        assert param.untyped_storage().data_ptr() in storages
        ranges = shard.rank_ranges
        assert ranges[0][0] == 0 and ranges[-1][1] == shard.numel
        row = shard.numel // shapes[name][0]
        assert all(cut % row == 0 for cut in shard.cut_offsets()), f"{name} cut inside a row"
        total_local += param.numel()
    assert model.head.weight is model.embed.weight
    return {"local": total_local, "segments": sum(b.layout.segment_size for b in state.dbuffers())}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_layout_views_and_names(dist_pool, world_size):
    results = dist_pool(world_size).run(check_layout_views_and_names)
    total = sum(p.numel() for p in make_model().parameters())
    assert sum(r["local"] for r in results) == total  # every element held by exactly one rank
    assert all(r["segments"] == results[0]["segments"] for r in results)  # equal per-rank segments


def check_memory_after_forward() -> dict:
    """After forward only the root group may stay unsharded; after backward nothing does."""
    model = lr.fully_shard(make_model(), shard_granularity="row")
    state = lr.get_state(model)
    loss = lm_loss(model, _local(make_batches(1, BATCH)[0]))
    after_forward = {g.name: [b.is_unsharded for b in g.dbuffers] for g in state.groups}
    root_after_forward = state.root_group.is_unsharded
    loss.backward()
    allocated_after_backward = [
        (b.is_unsharded, b.has_unsharded_grad) for g in state.all_groups for b in g.dbuffers
    ]
    untied = make_model()
    untied.head.weight = nn.Parameter(untied.head.weight.detach().clone())  # the embedding gets its own group
    explicit = make_model()
    lr.fully_shard(untied, shard_granularity="row")
    lr.fully_shard(explicit, shard_granularity="row", reshard_after_forward=True)
    after_eval = {}
    for name, evaluated in (("tied", model), ("untied", untied), ("explicit", explicit)):
        with torch.no_grad():
            evaluated(_local(make_batches(1, BATCH)[0])[:, :-1])
        groups = lr.get_state(evaluated).all_groups
        after_eval[name] = {g.name: (g.root_part, [b.is_unsharded for b in g.dbuffers]) for g in groups}
        after_eval[f"{name}_shards_at_rest"] = all(hasattr(p, "ragged_shard") for p in evaluated.parameters())
        evaluated.reshard()  # FSDP2's root reshard() frees its whole root: ours, the embedding split off it too
        after_eval[f"{name}_after_reshard"] = [b.is_unsharded for g in groups for b in g.dbuffers]
    return {
        "after_forward": after_forward,
        "root_after_forward": root_after_forward,
        "after_backward": allocated_after_backward,
        "after_eval": after_eval,
    }


def test_unsharded_buffers_freed(dist_pool):
    result = dist_pool(2).run(check_memory_after_forward)[0]
    assert result["after_forward"] and not any(any(v) for v in result["after_forward"].values())
    assert result["root_after_forward"]  # kept for the backward that follows
    assert not any(a or b for a, b in result["after_backward"])
    # no backward follows a no-grad forward: FSDP2's default (None) keeps its root, so ours keeps the root's own
    # groups (the root group and the embedding split off it) for the next forward, the blocks are freed; an
    # explicit True frees everything. Between forwards the modules hold the shards either way.
    after_eval = result["after_eval"]
    for name, root_groups in (("tied", {"root"}), ("untied", {"embed", "root"}), ("explicit", set())):
        groups = after_eval[name]
        assert {g for g, (root_part, _) in groups.items() if root_part} == ({"embed", "root"} & set(groups)), groups
        assert {g for g, (_, kept) in groups.items() if all(kept)} == root_groups, (name, groups)
        assert not any(any(kept) for g, (_, kept) in groups.items() if g not in root_groups), (name, groups)
        assert after_eval[f"{name}_shards_at_rest"] and not any(after_eval[f"{name}_after_reshard"]), after_eval


def _step_copy_bytes(model: nn.Module, batch: torch.Tensor) -> int:
    with CopyCounter() as counter:
        lm_loss(model, batch).backward()
    return counter.total_bytes


def check_copy_bytes_vs_fsdp2() -> dict:
    """Copy-like bytes per training step beyond the model's own (unsharded baseline)."""
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    batches = make_batches(3, BATCH)
    baseline = _step_copy_bytes(make_model(), _local(batches[0]))
    ragged = lr.fully_shard(make_model(), shard_granularity="row")  # gloo: the pairwise all-gather
    ring = lr.fully_shard(make_model(), shard_granularity="row", gather_mode="all_gather")
    fsdp2 = make_model()
    for block in fsdp2.blocks:
        fsdp2_fully_shard(block)
    fsdp2_fully_shard(fsdp2)
    result = {"baseline": baseline, "ragged": [], "ring": [], "fsdp2": [], "own_segments": []}
    for batch in batches[1:]:  # after a warm-up step
        stats = lr.get_state(ragged).stats
        stats.reset()
        result["ragged"].append(_step_copy_bytes(ragged, _local(batch)) - baseline)
        result["own_segments"].append(stats.all_gather_bytes // dist.get_world_size())  # one per gather, fp32
        result["ring"].append(_step_copy_bytes(ring, _local(batch)) - baseline)
        result["fsdp2"].append(_step_copy_bytes(fsdp2, _local(batch)) - baseline)
    result["param_bytes"] = sum(p.numel() * p.element_size() for p in make_model().parameters())
    return result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_copy_bytes_are_a_small_fraction_of_fsdp2(dist_pool, world_size):
    for result in dist_pool(world_size).run(check_copy_bytes_vs_fsdp2):
        ragged, ring, fsdp2 = result["ragged"][-1], result["ring"][-1], result["fsdp2"][-1]
        assert fsdp2 >= result["param_bytes"], result  # FSDP2 copies at least P per step (sanity of the counter)
        assert ring <= 0.10 * fsdp2, result  # gloo's all-gather copies this rank's segment inside, unseen
        # the pairwise all-gather makes that copy itself (this rank's segment into its slot), and nothing else
        assert ragged - ring == result["own_segments"][-1] > 0, result


def check_collectives_per_step() -> dict:
    """One all-gather per group for forward, one per resharded group for backward, one reduction per group."""
    model = lr.fully_shard(make_model(), shard_granularity="row")
    state = lr.get_state(model)
    reduced = []
    for dbuffer in state.dbuffers():
        original = dbuffer.reduce_grad
        dbuffer.reduce_grad = lambda *a, b=dbuffer, f=original, **k: (reduced.append(list(b.unsharded_params)), f(*a, **k))[1]
    lm_loss(model, _local(make_batches(1, BATCH)[0])).backward()
    stats = state.stats
    buffers = list(state.dbuffers())
    return {
        "all_gathers": stats.all_gathers,
        "reduces": stats.reduces,
        "block_buffers": sum(len(group.dbuffers) for group in state.groups),
        "root_buffers": len(state.root_group.dbuffers),
        "buffers": len(buffers),
        "reduced": reduced,
        "all_gather_bytes": stats.all_gather_bytes,
        "buffer_bytes": sum(b.unsharded.numel() * b.unsharded.element_size() for b in buffers),
    }


def test_collectives_per_step(dist_pool):
    result = dist_pool(2).run(check_collectives_per_step)[0]
    # each block buffer twice (forward + backward), the root's once (kept for backward);
    # the root is split where blocks come between its parameters: embeddings | final norm
    assert result["root_buffers"] == 2
    assert result["all_gathers"] == 2 * result["block_buffers"] + result["root_buffers"]
    # each block is reduced at its post-backward (in reverse), the root's buffers at the end of backward in their
    # order (embeddings, then the final norm): the same points and order on every rank whatever its data
    assert [sorted(names) for names in result["reduced"]] == [
        sorted(n for n, _ in make_model().blocks[1].named_parameters(prefix="blocks.1")),
        sorted(n for n, _ in make_model().blocks[0].named_parameters(prefix="blocks.0")),
        ["embed.weight", "pos"],
        ["norm.bias", "norm.weight"],
    ], result["reduced"]
    assert result["reduces"] == result["buffers"]
    non_root_bytes = result["all_gather_bytes"] - result["buffer_bytes"]
    assert non_root_bytes > 0


def check_mixed_precision() -> dict:
    """bf16 compute and all-gather, fp32 reduction and master shards; tracks the fp32 run."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = lr.fully_shard(make_model(), mp_policy=policy)
    reference = make_model()
    state = lr.get_state(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    data = make_batches(1, BATCH).expand(STEPS, -1, -1)  # one batch, repeated: the loss must fall
    losses, reference_losses = [], []
    for step in range(STEPS):
        loss = lm_loss(model, _local(data[step]))
        loss.backward()
        losses.append(loss.item())
        dtypes = {
            "master": {b.sharded.dtype for b in state.dbuffers()},
            "unsharded": {b.unsharded.dtype for b in state.dbuffers()},
            "grads": {p.grad.dtype for p in model.parameters()},
        }
        opt.step()
        opt.zero_grad()
        reference_loss = lm_loss(reference, data[step])
        reference_loss.backward()
        reference_losses.append(reference_loss.item())
        reference_opt.step()
        reference_opt.zero_grad()
    return {"losses": losses, "reference": reference_losses, "dtypes": dtypes}


def test_mixed_precision_bf16(dist_pool):
    results = dist_pool(2).run(check_mixed_precision)
    dtypes = results[0]["dtypes"]
    assert dtypes == {"master": {torch.float32}, "unsharded": {torch.bfloat16}, "grads": {torch.float32}}
    for result in results:
        mean_loss = [sum(r["losses"][i] for r in results) / len(results) for i in range(STEPS)]
        assert max(abs(a - b) for a, b in zip(mean_loss, result["reference"])) < 0.05, (mean_loss, result)
        assert mean_loss[-1] < mean_loss[0]


def check_output_dtype_as_fsdp2() -> dict:
    """``output_dtype=fp32`` on the root's policy (bf16 compute, fp32 reduction): the model's logits come out in
    fp32 and the blocks' outputs stay bf16, as FSDP2 casts each sharded module's output by its own policy; the
    single call and FSDP2's call pattern (each block, then the root) against FSDP2's, 3 AdamW steps each."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    blocks = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    root = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    single = lr.fully_shard(make_model(), mp_policy=root, group_modules=[TinyBlock])
    pattern, theirs = make_model(), make_model()
    for block in pattern.blocks:
        lr.fully_shard(block, mp_policy=blocks)
    lr.fully_shard(pattern, mp_policy=root)
    for block in theirs.blocks:
        fully_shard(block, mp_policy=blocks)
    fully_shard(theirs, mp_policy=root)
    models = {"single": single, "pattern": pattern, "theirs": theirs}
    seen: dict[str, dict[str, set]] = {key: {"block": set(), "logits": set()} for key in models}
    losses: dict[str, list[float]] = {key: [] for key in models}
    data = make_batches(3, BATCH)
    for key, model in models.items():
        model.blocks[0].register_forward_hook(lambda _m, _a, out, key=key: seen[key]["block"].add(str(out.dtype)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(3):
            tokens = _local(data[step])
            logits = model(tokens[:, :-1])
            seen[key]["logits"].add(str(logits.dtype))
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[key].append(loss.item())
    return {"seen": seen, "losses": losses}


def test_output_dtype_casts_module_outputs_as_fsdp2(dist_pool):
    for result in dist_pool(2).run(check_output_dtype_as_fsdp2):
        for key in ("single", "pattern", "theirs"):
            assert result["seen"][key] == {"block": {"torch.bfloat16"}, "logits": {"torch.float32"}}, result
        for key in ("single", "pattern"):  # bf16 compute: FSDP2's own rounding is the yardstick, same kernels here
            assert max(abs(a - b) for a, b in zip(result["losses"][key], result["losses"]["theirs"])) <= 1e-5, result


class _RMSNorm(nn.Module):
    """transformers' ``LlamaRMSNorm``: normalizes in fp32, returns the input's dtype times the weight."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = hidden.float() * torch.rsqrt(hidden.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * normed.to(hidden.dtype)


class _Fp32Residual(nn.Module):
    """Blocks that keep the residual stream in fp32 (Mamba's ``residual_in_fp32``), then a root norm and head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.norm, self.head = _RMSNorm(16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x).float()
        for block in self.blocks:
            hidden = hidden + block(hidden).float()
        return self.head(self.norm(hidden).to(self.head.weight.dtype))


def check_root_submodules_keep_their_inputs_as_fsdp2() -> dict:
    """bf16 compute: FSDP2 casts the inputs of the modules ``fully_shard`` was called on only; the root's norm
    receives the fp32 residual (before: cast to bf16 at every module owning a root parameter, 3.9e-3 off)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    results = {}
    for key, shard in (("ours", lr.fully_shard), ("theirs", fully_shard)):
        model, seen, losses = _Fp32Residual(), set(), []
        model.norm.register_forward_pre_hook(lambda _m, args: seen.add(str(args[0].dtype)))
        for block in model.blocks:
            shard(block, mp_policy=policy)
        shard(model, mp_policy=policy)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
            loss = model(x).float().square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        results[key] = {"norm_input": seen, "losses": losses}
    return results


def test_root_submodules_keep_their_inputs_as_fsdp2(dist_pool):
    for result in dist_pool(2).run(check_root_submodules_keep_their_inputs_as_fsdp2):
        assert result["ours"]["norm_input"] == result["theirs"]["norm_input"] == {"torch.float32"}, result
        assert result["ours"]["losses"] == result["theirs"]["losses"], result  # the same kernels on the same dtypes


class _LearnedVarianceLoss(nn.Module):
    """A loss with a parameter of its own (a Gaussian NLL's learned log-variance): called with float targets."""

    def __init__(self) -> None:
        super().__init__()
        self.log_var = nn.Parameter(torch.zeros(()))
        self.seen: set[str] = set()

    def forward(self, prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.seen.add(str(target.dtype))
        return (0.5 * ((prediction.float() - target) ** 2 * torch.exp(-self.log_var) + self.log_var)).mean()


class _Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.loss = nn.Linear(4, 1), _LearnedVarianceLoss()

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss(self.net(x), target)


def check_root_owners_cast_only_outside_autocast() -> dict:
    """The strategy's root casts nothing (``cast_root_inputs=False``: the batch stays as autocast leaves it). Under
    autocast the modules holding root parameters keep their inputs, as DDP's (a loss module's float targets
    stay fp32: cast to bf16, the first loss was 2.0 against DDP's 0.777); outside it they cast, so a forward
    with fp32 inputs and bf16 weights runs."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    target = torch.full((4, 1), 1.001)  # not a bf16 number: a cast would change it
    reference, model = _Regression(), _Regression()
    lr.fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    lr.get_state(model).cast_root_inputs = False  # what the strategy sets
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, theirs = model(x, target).item(), reference(x, target).item()
    under_autocast = set(model.loss.seen)
    model.loss.seen.clear()
    with torch.no_grad():
        model(x, target)  # outside autocast: fp32 inputs, bf16 weights
    return {"autocast": under_autocast, "reference": reference.loss.seen, "outside": model.loss.seen,
            "losses": (ours, theirs)}


def test_root_owners_cast_only_outside_autocast(dist_pool):
    for result in dist_pool(2).run(check_root_owners_cast_only_outside_autocast):
        assert result["autocast"] == result["reference"] == {"torch.float32"}, result
        assert result["outside"] == {"torch.bfloat16"}, result
        ours, theirs = result["losses"]
        assert abs(ours - theirs) <= 1e-2 * abs(theirs), result  # bf16 weights vs autocast's casts: same scale


@dataclasses.dataclass
class Hidden:
    """A user's own dataclass between blocks (not registered with torch's pytree), with an ``InitVar``
    (``dataclasses.replace`` cannot rebuild it), a field ``__post_init__`` computes, one never set (a lazy
    cache), and a ``__getstate__`` that leaves ``depth`` out of pickles (``copy.copy`` would drop it too)."""

    states: torch.Tensor
    scale: torch.Tensor
    damping: dataclasses.InitVar[float]
    depth: int = 0
    next_scale: torch.Tensor = dataclasses.field(init=False)
    cache: torch.Tensor = dataclasses.field(init=False, repr=False)

    def __post_init__(self, damping: float) -> None:
        self.next_scale = self.scale * damping

    def __getstate__(self) -> dict:
        return {name: value for name, value in self.__dict__.items() if name != "depth"}


@dataclasses.dataclass
class Calls:
    """Passed to every block, which counts itself in: the caller must see the count and the list (no copy)."""

    count: int = 0
    seen: list = dataclasses.field(default_factory=list)
    shape: tuple = (12,)


class DataclassBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, hidden: Hidden, calls: Calls | None = None) -> Hidden:
        if calls is not None:
            calls.count += 1
            calls.seen.append(hidden.depth)
        return Hidden(torch.tanh(self.linear(hidden.states)) * hidden.scale, hidden.next_scale, 0.9, hidden.depth + 1)


class DataclassModel(nn.Module):
    def __init__(self, width: int = 12, depth: int = 3) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.blocks = nn.ModuleList(DataclassBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, calls = Hidden(x, self.scale, 0.9), Calls()
        for block in self.blocks:
            hidden = block(hidden, calls=calls)
        self.calls = (calls.count, calls.seen)
        return self.head(hidden.states).pow(2).mean()


def check_dataclass_inputs_and_outputs(pattern: str) -> dict:
    """Blocks that take and return a dataclass: trained 3 SGD steps vs one process on the global batch, and
    ``output_dtype`` casts the dataclass's tensors (FSDP2 enters dataclasses; torch's pytree does not)."""
    torch.manual_seed(0)
    reference = DataclassModel()
    model = DataclassModel()
    model.load_state_dict(reference.state_dict())
    if pattern == "per-block":
        for block in model.blocks:
            lr.fully_shard(block)
        lr.fully_shard(model)
    else:
        lr.fully_shard(model, group_modules=[DataclassBlock])
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    data = torch.randn(3, BATCH, 12, generator=torch.Generator().manual_seed(1))
    for step in range(3):
        model(_local(data[step])).backward()
        reference(data[step]).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    from torch.distributed.fsdp import MixedPrecisionPolicy

    cast = DataclassBlock(12)
    lr.fully_shard(cast, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32))
    out = cast(Hidden(torch.randn(2, 12), torch.ones(12), 0.9))
    return {"max_diff": _max_diff(lr.full_state_dict(model), reference), "calls": model.calls,
            "cast": (str(out.states.dtype), str(out.scale.dtype), out.depth)}


@pytest.mark.parametrize("pattern", ["per-block", "grouped"])
def test_dataclass_inputs_and_outputs_match_single_process(dist_pool, pattern):
    for result in dist_pool(2).run(check_dataclass_inputs_and_outputs, pattern):
        assert result["max_diff"] <= 1e-6, result
        assert result["cast"] == ("torch.float32", "torch.float32", 1), result
        assert result["calls"] == (3, [0, 1, 2]), result  # every block counted itself into the caller's own object


def check_parameters_without_elements() -> float:
    """Parameters of no elements, shaped (3, 0) and (0, 6), beside trained ones, at the default row granularity."""
    def build() -> nn.Module:
        torch.manual_seed(0)
        model = make_model()
        model.no_columns, model.no_rows = nn.Parameter(torch.zeros(3, 0)), nn.Parameter(torch.zeros(0, 6))
        return model

    reference, sharded = build(), lr.fully_shard(build())
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, sharded)]
    for batch in make_batches(2, BATCH):
        lm_loss(reference, batch).backward()
        lm_loss(sharded, _local(batch)).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    full = lr.full_state_dict(sharded)
    assert full["no_columns"].shape == (3, 0) and full["no_rows"].shape == (0, 6)
    return _max_diff(full, reference)


def test_parameters_without_elements_train_as_single_process(dist_pool):
    # (3, 0) at rows had granularity 0 and was refused ("granularity=0 is invalid", a knob the user never set)
    for diff in dist_pool(2).run(check_parameters_without_elements):
        assert diff <= 1e-5, diff  # fp32, 2 AdamW steps: this suite's tolerance


def check_deepcopy_refused() -> dict:
    """``copy.deepcopy`` of a sharded model or any of its modules raises a clear error (FSDP2 refuses it too;
    cloning the views of freed buffers crashed the process); a copy made before sharding trains apart."""
    import copy

    model = make_model()
    before = copy.deepcopy(model)
    lr.fully_shard(model)
    errors = {}
    embedding = nn.Embedding(8, 4)  # constructors with required arguments, each sharded by a call of its own
    stack = nn.Sequential(embedding, nn.Linear(4, 4))
    lr.fully_shard(embedding)
    lr.fully_shard(stack)
    rng = torch.get_rng_state()
    for name, target in (("model", model), ("block", model.blocks[0]), ("head", model.head),
                         ("own-call embedding", embedding), ("its parent", stack)):
        try:
            copy.deepcopy(target)
            errors[name] = None
        except TypeError as error:
            errors[name] = str(error)
    lm_loss(before, _local(make_batches(1, BATCH)[0])).backward()
    return {"errors": errors, "rng_moved": not torch.equal(rng, torch.get_rng_state()),
            "copy_has_grads": all(p.grad is not None for p in before.parameters())}


def test_deepcopy_of_a_sharded_model_is_refused_clearly(dist_pool):
    for result in dist_pool(2).run(check_deepcopy_refused):
        for name, error in result["errors"].items():  # the embedding's was "__init__() missing 2 required ..."
            assert error is not None and "deep-copy the model before sharding" in error.lower(), (name, error)
        assert result["copy_has_grads"] and not result["rng_moved"], result


def check_full_state_dict_round_trip() -> float:
    """full_state_dict returns original shapes; load_full_state_dict writes them back into the shards."""
    model = lr.fully_shard(make_model(), shard_granularity="element")
    other = make_model(seed=5)
    expected = other.state_dict()
    lr.load_full_state_dict(model, expected)
    full = lr.full_state_dict(model)
    assert {k: v.shape for k, v in full.items()} == {k: v.shape for k, v in expected.items()}
    return max((full[k] - expected[k]).abs().max().item() for k in expected)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_full_state_dict_round_trip(dist_pool, world_size):
    assert max(dist_pool(world_size).run(check_full_state_dict_round_trip)) == 0.0


def check_full_state_dict_of_checkpoint_wrapped_blocks() -> dict:
    """torchtitan's order: blocks wrapped by torch's checkpoint_wrapper, then sharded. The wrapper drops its
    attribute from ``state_dict()`` keys; the full state dict's keys were the modules' paths with it, so it
    handed back every block entry as this rank's shard and its load raised a KeyError."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = make_model()
    for index, block in enumerate(model.blocks):
        model.blocks[index] = checkpoint_wrapper(block)
    for block in model.blocks:
        lr.fully_shard(block)
    lr.fully_shard(model)
    expected = make_model(seed=5).state_dict()  # unwrapped: the keys a user's checkpoint has
    lr.load_full_state_dict(model, expected)
    full = lr.full_state_dict(model)
    offloaded = lr.full_state_dict(model, cpu_offload=True, rank0_only=True)
    return {"keys": sorted(full) == sorted(expected) == sorted(model.state_dict()),
            "plain": all(type(v) is torch.Tensor for v in [*full.values(), *offloaded.values()]),
            "diff": max((full[k] - expected[k]).abs().max().item() for k in expected),
            "rank0": sorted(offloaded) == (sorted(expected) if dist.get_rank() == 0 else [])}


def test_full_state_dict_of_checkpoint_wrapped_blocks(dist_pool):
    for result in dist_pool(2).run(check_full_state_dict_of_checkpoint_wrapped_blocks):
        assert result == {"keys": True, "plain": True, "diff": 0.0, "rank0": True}, result


class _LiveStorages(TorchDispatchMode):
    """Storages the ops inside the mode allocate (not views, not in-place outputs), and their bytes after each op
    (a storage freed with ``resize_(0)`` counts 0 even while a backend's work object still holds it).

    ``peak_except(kept)``: the most bytes alive at once among the storages not in ``kept``
    (the tensors the call returned), i.e. the call's temporaries.
    """

    def __init__(self) -> None:
        super().__init__()
        self.tokens: WeakIdKeyDictionary = WeakIdKeyDictionary()  # live storage -> token
        self.snapshots: list[list[tuple[int, int]]] = []
        self._count = itertools.count()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in inputs:
                storage = tensor.untyped_storage()
                if storage not in self.tokens:
                    self.tokens[storage] = next(self._count)
        self.snapshots.append([(token, storage.nbytes()) for storage, token in self.tokens.items()])
        return out

    def peak_except(self, kept: dict[str, torch.Tensor]) -> int:
        kept_tokens = {self.tokens[t.untyped_storage()] for t in kept.values() if t.untyped_storage() in self.tokens}
        return max((sum(n for token, n in snap if token not in kept_tokens) for snap in self.snapshots), default=0)


def _with_buffer(model: nn.Module) -> nn.Module:
    model.register_buffer("scale", torch.arange(3.0) + 0.5)  # a non-parameter key: stays as it is, or goes to CPU
    return model


def check_full_state_dict_options(gather: bool) -> dict:
    """Every cpu_offload / rank0_only combination against the single-process model's state dict.

    ``gather=False`` takes the all-gather-and-drop path that backends without ``dist.gather`` use.
    """
    from unittest import mock

    from lightning_ragged.engine import state_dict as state_dict_module

    model = lr.fully_shard(_with_buffer(make_model()), shard_granularity="row")
    reference = _with_buffer(make_model(seed=5))
    expected = reference.state_dict()
    lr.load_full_state_dict(model, expected)
    dbuffers = list(lr.get_state(model).dbuffers())
    largest = max(b.world_size * b.layout.segment_size * b.sharded.element_size() for b in dbuffers)
    today = lr.full_state_dict(model)
    rank = dist.get_rank()
    results = {"dbuffers": len(dbuffers), "largest": largest}
    with mock.patch.object(state_dict_module, "_has_gather", lambda group: gather):
        for cpu_offload in (False, True):
            for rank0_only in (False, True):
                with _LiveStorages() as live:
                    got = lr.full_state_dict(model, cpu_offload=cpu_offload, rank0_only=rank0_only)
                receives = rank == 0 or not rank0_only
                results[(cpu_offload, rank0_only)] = {
                    "empty": got == {},
                    "as_expected": receives
                    and got.keys() == expected.keys()
                    and all(torch.equal(got[k], expected[k]) and torch.equal(got[k], today[k]) for k in expected),
                    "on_cpu": all(t.device.type == "cpu" for t in got.values()),
                    "own_storage": all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in got.values()),
                    "tied": receives and got["head.weight"] is got["embed.weight"],
                    "peak_temporaries": live.peak_except(got),
                }
    # and back: only rank 0 holds the state dict, the others pass {}
    target = _with_buffer(make_model(seed=7))
    lr.load_full_state_dict(model, target.state_dict() if rank == 0 else {}, broadcast_from_rank0=True)
    back = lr.full_state_dict(model)
    results["broadcast_load"] = all(torch.equal(back[k], v) for k, v in target.state_dict().items() if k != "scale")
    return results


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("gather", [True, False], ids=["gather", "all_gather"])
def test_full_state_dict_cpu_offload_and_rank0_only(dist_pool, world_size, gather):
    results = dist_pool(world_size).run(check_full_state_dict_options, gather)
    for rank, result in enumerate(results):
        assert result["dbuffers"] >= 3, result  # the blocks and the root: one DBuffer at a time is visible
        for (cpu_offload, rank0_only), got in ((k, v) for k, v in result.items() if isinstance(k, tuple)):
            if rank0_only and rank != 0:
                assert got["empty"], (rank, cpu_offload, got)
                # nothing kept; with a gather, nothing gathered either (the others only send)
                assert got["peak_temporaries"] <= (0 if gather else result["largest"]), (rank, got, result["largest"])
                continue
            assert got["as_expected"] and got["own_storage"] and got["tied"], (rank, cpu_offload, rank0_only, got)
            assert got["on_cpu"]  # CPU-only machine: the model is on CPU too; cpu_offload keeps it there
            assert 0 < got["peak_temporaries"] <= result["largest"], (rank, cpu_offload, rank0_only, got, result["largest"])
        assert result["broadcast_load"], (rank, result)


def check_full_state_dict_bad_flags() -> list[str]:
    model = lr.fully_shard(make_model(), shard_granularity="row")
    messages = []
    for call in (
        lambda: lr.full_state_dict(model, cpu_offload="yes"),
        lambda: lr.full_state_dict(model, rank0_only=1),
        lambda: lr.load_full_state_dict(model, {}, broadcast_from_rank0=None),
    ):
        with pytest.raises(TypeError) as error:
            call()
        messages.append(str(error.value))
    with pytest.raises(RuntimeError, match="rank 0's state_dict .* missing keys"):  # every rank raises, none waits
        lr.load_full_state_dict(model, {}, broadcast_from_rank0=True)
    return messages


def test_full_state_dict_bad_flags(dist_pool):
    messages = dist_pool(2).run(check_full_state_dict_bad_flags)[0]
    assert messages == [
        "cpu_offload='yes' must be a bool: pass cpu_offload=True or cpu_offload=False",
        "rank0_only=1 must be a bool: pass rank0_only=True or rank0_only=False",
        "broadcast_from_rank0=None must be a bool: pass broadcast_from_rank0=True or broadcast_from_rank0=False",
    ]


def check_wrapper_class() -> float:
    """FullyShardedDataParallel trains like fully_shard and exposes no_sync/full_state_dict."""
    data = make_batches(2, BATCH)
    wrapped = lr.FullyShardedDataParallel(make_model(), shard_granularity="row")
    reference = make_model()
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    assert all(name.startswith("module.") for name, _ in wrapped.named_parameters())
    for step in range(2):
        with wrapped.no_sync():
            (lm_loss(wrapped, _local(data[step])[:1]) * 0).backward()  # contributes nothing, syncs nothing
        wrapped.zero_grad()
        lm_loss(wrapped, _local(data[step])).backward()
        opt.step()
        opt.zero_grad()
        lm_loss(reference, data[step]).backward()
        reference_opt.step()
        reference_opt.zero_grad()
    return _max_diff(wrapped.full_state_dict(), reference)


def test_wrapper_class(dist_pool):
    assert max(dist_pool(2).run(check_wrapper_class)) <= 1e-5


def check_bad_arguments() -> list[str]:
    messages = []
    cases = [
        dict(shard_granularity="diagonal"),
        dict(dbuffer_size=0),
        dict(planning_algorithm="fastest"),
        dict(shard_granularity="block", block_rows=0),
        dict(reduce_mode="broadcast"),
        dict(shard_granularity="row", block_rows=0),  # both were accepted: block_rows unused, alignment=0 as None
        dict(alignment=0),
        dict(mp_policy=torch.bfloat16),  # before: "'torch.dtype' object has no attribute 'param_dtype'"
    ]
    for kwargs in cases:
        try:
            lr.fully_shard(make_model(), **kwargs)
        except (ValueError, RuntimeError, TypeError) as error:
            messages.append(f"{type(error).__name__}: {error}")
        else:
            messages.append(f"no error for {kwargs}")
    model = lr.fully_shard(make_model())
    try:
        lr.fully_shard(model)
    except ValueError as error:
        messages.append(str(error))
    return messages


def test_bad_arguments_get_clear_errors(dist_pool):
    messages = dist_pool(2).run(check_bad_arguments)[0]
    unknown, zero, algorithm, block_rows, mode, unused_block_rows, alignment, policy, twice = messages
    assert "shard_granularity='diagonal'" in unknown and "'row'" in unknown
    assert zero.startswith("DBufferAlignmentError: DBuffer alignment error:") and "dbuffer_size=0" in zero
    assert "planning_algorithm='fastest' is unknown" in algorithm and "optimal" in algorithm  # it said algorithm=
    assert "block_rows=0" in block_rows
    assert "reduce_mode='broadcast'" in mode
    assert "block_rows=0" in unused_block_rows
    assert "DBuffer alignment error: alignment=0" in alignment
    assert policy.startswith("TypeError: mp_policy=torch.bfloat16 must be a torch.distributed.fsdp.MixedPrecisionPolicy")
    assert "already sharded" in twice


def test_a_parameter_larger_than_dbuffer_size_gets_a_dbuffer_of_its_own():
    """Was an error: the default 256 MiB refused any model with a larger tensor (Llama-3-8B's fp32 embedding)."""
    from lightning_ragged.engine.grouping import split_into_dbuffers

    params = [(n, torch.nn.Parameter(torch.empty(k))) for n, k in [("a", 10), ("big", 300), ("b", 10), ("c", 10), ("d", 90)]]
    runs = split_into_dbuffers(params, dbuffer_size=100 * 4)
    assert [[n for n, _ in run] for run in runs] == [["a"], ["big"], ["b", "c"], ["d"]]


class LoggingLBFGS(torch.optim.LBFGS):
    """A user's subclass (logging, a scheduler hook): refused as its base."""


class Lamb(torch.optim.SGD):
    """Another library's LAMB (timm, apex, torch_optimizer: none installed here): refused by its name, whatever
    the module; its body does not matter to the check."""


class Muon(torch.optim.SGD):
    """Another library's Muon (timm's falls back to AdamW on 1-D tensors: 0.066 from one process on shards)."""


def check_whole_tensor_optimizers_are_refused() -> dict:
    from functools import partial

    from transformers.optimization import Adafactor as HFAdafactor

    model = lr.fully_shard(make_model(), shard_granularity="row")
    messages = {}
    for name, kind in (("LBFGS", torch.optim.LBFGS), ("Adafactor", torch.optim.Adafactor),
                       ("LoggingLBFGS", LoggingLBFGS), ("SparseAdam", torch.optim.SparseAdam), ("transformers Adafactor", partial(HFAdafactor, relative_step=False)), ("Lamb", Lamb),
                       ("Muon", Muon)):
        optimizer = kind(model.parameters(), lr=0.1)
        lm_loss(model, make_batches(1, 4)[0]).backward()
        try:
            if isinstance(optimizer, torch.optim.LBFGS):
                optimizer.step(lambda: lm_loss(model, make_batches(1, 4)[0]))
            else:
                optimizer.step()
            messages[name] = None
        except ValueError as error:
            messages[name] = str(error)
        model.zero_grad()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)  # element-wise: trains
    lm_loss(model, make_batches(1, 4)[0]).backward()
    optimizer.step()
    return messages


def test_torch_optimizers_that_need_whole_tensors_are_refused_on_shards(dist_pool) -> None:
    # Before: LBFGS trained 0.2 from DDP after 3 steps, silently (each rank its own line search on its part);
    # Adafactor divided by zero on a rank's empty part
    for messages in dist_pool(2).run(check_whole_tensor_optimizers_are_refused):
        assert messages["LBFGS"].startswith("torch.optim.LBFGS cannot train parameters lightning_ragged.fully_shard")
        assert "line-search" in messages["LBFGS"] and "DDP" in messages["LBFGS"]
        assert messages["Adafactor"].startswith("torch.optim.Adafactor cannot train") and "AdamW" in messages["Adafactor"]
        # before: a subclass of LBFGS trained 0.59 from one process and transformers' Adafactor (T5's usual
        # optimizer) 2.4e-2, silently (it factors only >= 2-D gradients, and scales by each tensor's RMS)
        assert messages["LoggingLBFGS"].startswith("LoggingLBFGS (a torch.optim.LBFGS) cannot train")
        # an Embedding(sparse=True)'s gradient lands dense: torch's own error named no cause
        assert messages["SparseAdam"].startswith("torch.optim.SparseAdam cannot train") and "dense" in messages["SparseAdam"]
        assert messages["transformers Adafactor"].startswith("transformers.optimization.Adafactor cannot train")
        assert messages["Lamb"].startswith("tests.test_fully_shard.Lamb cannot train") and "trust ratio" in messages["Lamb"]
        assert messages["Muon"].startswith("tests.test_fully_shard.Muon cannot train") and "lightning_ragged.optim" in \
            messages["Muon"]
