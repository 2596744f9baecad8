"""Fine-tuning patterns under fully_shard at 2 and 3 gloo ranks (issue 9).

LoRA (frozen base weights next to trainable adapters in one block), a frozen trunk, freezing
and unfreezing between steps, parameters that forward does not use (always, or on some ranks
only), an exception in backward or forward, and no_sync accumulation under bf16 compute.

Every ``check_*`` function runs on all ranks of the shared worker pool and returns plain
data; the assertions run in the test. The oracles are independent of the engine: the same
model trained on one process on the concatenated global batch, or torch DDP
(``find_unused_parameters=True``) on the same per-rank batches, or a bf16 copy of the model
whose per-micro-batch gradients are summed in fp32 by hand.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lightning_ragged as lr
from tests.finetune_models import (
    make_faulty_model,
    make_frozen_trunk_model,
    make_lora_model,
    make_routed_model,
    make_unused_param_model,
    uses_expert,
)
from tests.models import lm_loss, make_batches, make_model
from tests.test_fully_shard import _local, _max_diff

STEPS = 5
BATCH = 6  # global batch: divisible by 2 and 3 ranks
LR = 1e-2
TOLERANCE = 1e-5  # fp32 parity: sharded vs oracle differ only by summation order
WORLD_SIZES = [2, 3]


# ------------------------------------------------------------------------- helpers
def _step(optimizers: list[torch.optim.Optimizer]) -> None:
    """One step of every optimizer (the sharded model's and its oracle's), then their gradients cleared."""
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _counts(state) -> tuple[int, int, int]:
    stats = state.stats
    return stats.all_gathers, stats.reduces, stats.reduce_bytes


def _delta(after: tuple, before: tuple) -> tuple:
    return tuple(a - b for a, b in zip(after, before))


def _expected_reductions(state) -> tuple[int, int]:
    """One reduction of the whole flat buffer for every DBuffer holding a trainable parameter; none otherwise."""
    count = nbytes = 0
    for dbuffer in state.dbuffers():
        params = list(dbuffer.sharded_params.values())
        if any(p.requires_grad for p in params):
            count += 1
            nbytes += dbuffer.layout.buffer_numel * params[0].element_size()  # fp32 master = reduce dtype
    return count, nbytes


def _buffers(state) -> list[tuple[bool, bool]]:
    """(unsharded parameters allocated, unsharded gradient allocated) for every DBuffer."""
    return [(dbuffer.is_unsharded, dbuffer.has_unsharded_grad) for dbuffer in state.dbuffers()]


def _frozen_with_grad(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if not p.requires_grad and p.grad is not None]


def _trainable_without_grad(model: nn.Module) -> list[str]:
    """Trainable shards that hold elements on this rank but got no gradient."""
    return [name for name, p in model.named_parameters() if p.requires_grad and p.numel() > 0 and p.grad is None]


def _split_diff(full: dict, reference: nn.Module, initial: dict) -> dict:
    """Max |sharded - oracle| over trainable keys; frozen keys that are not bit-identical to their init."""
    trainable = {key for key, p in reference.named_parameters(remove_duplicate=False) if p.requires_grad}
    expected = reference.state_dict()
    assert full.keys() == expected.keys()
    return {
        "trainable_diff": max(((full[k] - expected[k]).abs().max().item() for k in trainable), default=0.0),
        "frozen_changed": sorted(k for k in expected if k not in trainable and not torch.equal(full[k], initial[k])),
        "oracle_moved": max(((expected[k] - initial[k]).abs().max().item() for k in trainable), default=0.0),
    }


def _initial_state(make) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in make().state_dict().items()}


# ------------------------------------------------------------------------ 1. LoRA
def check_lora(shard_kwargs: dict) -> dict:
    """Frozen base Linear + trainable A/B in the same block; embeddings, head and norms frozen."""
    data = make_batches(STEPS, BATCH)
    initial = _initial_state(make_lora_model)
    reference = make_lora_model()
    reference_opt = torch.optim.AdamW(_trainable(reference), lr=LR)
    model = lr.fully_shard(make_lora_model(), **shard_kwargs)
    opt = torch.optim.AdamW(_trainable(model), lr=LR)
    state = lr.get_state(model)
    frozen_with_grad, reductions, expected = set(), [], []
    for step in range(STEPS):
        before = _counts(state)
        lm_loss(model, _local(data[step])).backward()
        reductions.append(_delta(_counts(state), before)[1:])
        expected.append(_expected_reductions(state))
        frozen_with_grad.update(_frozen_with_grad(model))
        opt.step()
        opt.zero_grad()
        lm_loss(reference, data[step]).backward()
        reference_opt.step()
        reference_opt.zero_grad()
    result = _split_diff(lr.full_state_dict(model), reference, initial)
    result.update(frozen_with_grad=sorted(frozen_with_grad), reductions=reductions, expected=expected)
    return result


LORA_SHARDINGS = {"element": dict(shard_granularity="element"), "row": dict(shard_granularity="row")}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("sharding", list(LORA_SHARDINGS))
def test_lora_matches_single_process(dist_pool, world_size, sharding):
    results = dist_pool(world_size).run(check_lora, LORA_SHARDINGS[sharding])
    for rank, result in enumerate(results):
        assert result["oracle_moved"] > 1e-3, result  # the adapters really trained
        assert result["trainable_diff"] <= TOLERANCE, (rank, result)
        assert result["frozen_changed"] == [], (rank, result)
        assert result["frozen_with_grad"] == [], (rank, result)
        assert result["reductions"] == result["expected"], (rank, result)  # the all-frozen root is never reduced


# ----------------------------------------------------------------- 2. frozen trunk
def check_frozen_trunk() -> dict:
    """Blocks 0-2 and the embeddings frozen; block 3, final norm and (untied) head trainable."""
    data = make_batches(STEPS, BATCH)
    initial = _initial_state(make_frozen_trunk_model)
    reference = make_frozen_trunk_model()
    reference_opt = torch.optim.AdamW(_trainable(reference), lr=LR)
    model = lr.fully_shard(make_frozen_trunk_model(), shard_granularity="row")
    opt = torch.optim.AdamW(_trainable(model), lr=LR)
    state = lr.get_state(model)
    expected = _expected_reductions(state)
    reductions, frozen_with_grad, buffers = [], set(), []
    for step in range(STEPS):
        before = _counts(state)
        lm_loss(model, _local(data[step])).backward()
        reductions.append(_delta(_counts(state), before)[1:])
        frozen_with_grad.update(_frozen_with_grad(model))
        buffers.append(_buffers(state))
        opt.step()
        opt.zero_grad()
        lm_loss(reference, data[step]).backward()
        reference_opt.step()
        reference_opt.zero_grad()
    result = _split_diff(lr.full_state_dict(model), reference, initial)
    frozen_buckets = sum(not any(p.requires_grad for p in b.sharded_params.values()) for b in state.dbuffers())
    result.update(
        expected=expected,
        reductions=reductions,
        frozen_with_grad=sorted(frozen_with_grad),
        buffers=buffers,
        frozen_buckets=frozen_buckets,
    )
    return result


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_frozen_trunk_matches_single_process_and_reduces_only_trainable_buffers(dist_pool, world_size):
    results = dist_pool(world_size).run(check_frozen_trunk)
    for rank, result in enumerate(results):
        assert result["frozen_buckets"] >= 4, result  # blocks 0-2 and the root's embeddings
        assert result["oracle_moved"] > 1e-3, result
        assert result["trainable_diff"] <= TOLERANCE, (rank, result)
        assert result["frozen_changed"] == [] and result["frozen_with_grad"] == [], (rank, result)
        # exactly one flat reduction per DBuffer with a trainable parameter, every step
        assert result["reductions"] == [result["expected"]] * STEPS, (rank, result)
        assert all(not any(a or b for a, b in step) for step in result["buffers"]), (rank, result)


# ------------------------------------------------------- 3. freeze / unfreeze between steps
SWITCH_STEP = 2


def check_freeze_change(unfreeze: bool) -> dict:
    """``unfreeze``: block 0 frozen for 2 steps, then trainable (added to the optimizer) for 3.
    Otherwise: everything trains for 2 steps, then block 1 is frozen (its grads must stay None)."""
    block = 0 if unfreeze else 1

    def build() -> nn.Module:
        built = make_model()
        if unfreeze:
            built.blocks[block].requires_grad_(False)
        return built

    data = make_batches(STEPS, BATCH)
    reference = build()
    reference_opt = torch.optim.AdamW(_trainable(reference), lr=LR)
    model = lr.fully_shard(build(), shard_granularity="row")
    opt = torch.optim.AdamW(_trainable(model), lr=LR)
    state = lr.get_state(model)
    prefix = f"blocks.{block}."
    frozen_with_grad, trainable_without_grad, reductions, expected = [], [], [], []
    at_switch = None
    for step in range(STEPS):
        if step == SWITCH_STEP:
            for net, optimizer in ((model, opt), (reference, reference_opt)):
                params = list(net.blocks[block].parameters())  # the 1-D shards on the sharded model
                for param in params:
                    param.requires_grad_(unfreeze)
                if unfreeze:
                    optimizer.add_param_group({"params": params})
            at_switch = {k: v.clone() for k, v in lr.full_state_dict(model).items() if k.startswith(prefix)}
        before = _counts(state)
        lm_loss(model, _local(data[step])).backward()
        reductions.append(_delta(_counts(state), before)[1:])
        expected.append(_expected_reductions(state))
        frozen_with_grad.append(_frozen_with_grad(model))
        trainable_without_grad.append(_trainable_without_grad(model))
        opt.step()
        opt.zero_grad()
        lm_loss(reference, data[step]).backward()
        reference_opt.step()
        reference_opt.zero_grad()
    full = lr.full_state_dict(model)
    return {
        "max_diff": _max_diff(full, reference),
        "block_moved_after_switch": max((full[k] - v).abs().max().item() for k, v in at_switch.items()),
        "frozen_with_grad": frozen_with_grad,
        "trainable_without_grad": trainable_without_grad,
        "reductions": reductions,
        "expected": expected,
    }


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("direction", ["unfreeze", "freeze"])
def test_freeze_change_between_steps_matches_single_process(dist_pool, world_size, direction):
    results = dist_pool(world_size).run(check_freeze_change, direction == "unfreeze")
    for rank, result in enumerate(results):
        assert result["max_diff"] <= TOLERANCE, (rank, result)
        assert all(names == [] for names in result["frozen_with_grad"]), (rank, result)
        assert all(names == [] for names in result["trainable_without_grad"]), (rank, result)
        assert result["reductions"] == result["expected"], (rank, result)
        if direction == "unfreeze":
            assert result["block_moved_after_switch"] > 1e-3, result  # the unfrozen block trained
        else:
            assert result["block_moved_after_switch"] == 0.0, (rank, result)  # the frozen block did not move


def _inside_root_forward(net: nn.Module, step) -> None:
    """Run ``step`` as Lightning runs a ``training_step``: inside one call of the root's forward (its forward
    redirection), where the model's own calls are nested root forwards."""
    original = net.forward

    def redirected() -> None:
        net.forward = original  # as Lightning: nested calls run the real forward
        step()

    net.forward = redirected
    try:
        net()
    finally:
        net.__dict__.pop("forward", None)


def check_freeze_between_backwards(nested: bool, no_sync: bool = False) -> dict:
    """Lightning's ``toggle_optimizer`` pattern: in every step a backward with everything trainable, then block 1
    and the embedding (a root parameter) frozen for a second forward and backward, unfrozen, one step; against
    one process doing the same on the global batches. The frozen parameters get only the first loss's gradient.
    ``nested``: the sharded model's step runs inside its root forward, as under Lightning. ``no_sync``: the first
    backward accumulates (a GAN's ``block_backward_sync`` micro-batch), so the synchronized one reduces the frozen
    parameters' gradients: they were dropped (a WGAN-GP's generator moved 6.7e-3 off DDP)."""
    first, second = make_batches(3, BATCH, seed=1), make_batches(3, BATCH, seed=2)
    reference = make_model()
    model = lr.fully_shard(make_model(), shard_granularity="row")
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, reference)]
    stats = lr.get_state(model).stats
    reads = stats.flag_reads
    for step in range(3):
        for net, local in ((model, _local), (reference, lambda batch: batch)):
            def run(net=net, local=local) -> None:
                with lr.no_sync(net) if no_sync and net is model else contextlib.nullcontext():
                    lm_loss(net, local(first[step])).backward()
                toggled = [*net.blocks[1].parameters(), net.embed.weight]
                for param in toggled:
                    param.requires_grad_(False)
                lm_loss(net, local(second[step])).backward()
                for param in toggled:
                    param.requires_grad_(True)

            _inside_root_forward(net, run) if nested and net is model else run()
        _step(optimizers)
    return {"max_diff": _max_diff(lr.full_state_dict(model), reference), "flag_reads": stats.flag_reads - reads}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("nested, no_sync", [(False, False), (True, False), (True, True)],
                         ids=["steps", "inside-root-forward", "inside-root-forward-no-sync-first"])
def test_freeze_between_two_backwards_of_a_step_matches_single_process(dist_pool, world_size, nested, no_sync):
    for result in dist_pool(world_size).run(check_freeze_between_backwards, nested, no_sync):
        assert result["max_diff"] <= TOLERANCE, result
        if not no_sync:  # frozen shards join the used flags only after a no_sync backward: no read-back (a host sync)
            assert result["flag_reads"] == 0, result


# ------------------------------------------------------------ 4. unused parameters vs DDP
def _routed_ranks(step: int, world: int) -> set[int]:
    """Ranks whose batch takes the expert branch at ``step``: one rank, none, all, the last, all but rank 0."""
    return [{0}, set(), set(range(world)), {world - 1}, set(range(1, world))][step]


def _batch_for(kind: str, data: torch.Tensor, step: int) -> torch.Tensor:
    local = _local(data[step]).clone()
    if kind == "routed":
        local[0, 0] = 2 if dist.get_rank() in _routed_ranks(step, dist.get_world_size()) else 3
        assert uses_expert(local) == (dist.get_rank() in _routed_ranks(step, dist.get_world_size()))
    return local


def _grads_vs_ddp(model: nn.Module, ddp_module: nn.Module) -> tuple[float, list[str]]:
    """Max |sharded grad - DDP grad's slice| and the names whose grad is None on one side only.

    A sharded grad for a parameter DDP left without one is always wrong (even an empty shard);
    a missing sharded grad is wrong only where the shard holds elements on this rank.
    """
    references = dict(ddp_module.named_parameters())
    diff, mismatched = 0.0, []
    for name, param in model.named_parameters():
        reference = references[name].grad
        if reference is None or param.grad is None:
            if (reference is None) != (param.grad is None) and (param.grad is not None or param.numel() > 0):
                sharded_state = "None" if param.grad is None else "set"
                mismatched.append(f"{name}: sharded {sharded_state}, DDP {'None' if reference is None else 'set'}")
            continue
        start, end = param.ragged_shard.local_range
        if end > start:
            diff = max(diff, (param.grad - reference.reshape(-1)[start:end]).abs().max().item())
    return diff, mismatched


def check_unused_vs_ddp(kind: str) -> dict:
    """``unused``: a Linear forward never calls; ``routed``: an expert taken on some ranks' batches only."""
    from torch.nn.parallel import DistributedDataParallel

    make = make_unused_param_model if kind == "unused" else make_routed_model
    watched = "spare" if kind == "unused" else "expert"
    data = make_batches(STEPS, BATCH)
    initial = _initial_state(make)
    ddp = DistributedDataParallel(make(), find_unused_parameters=True)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=0.1)
    model = lr.fully_shard(make(), shard_granularity="row")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    grad_diffs, mismatched, ddp_watched_none, sharded_watched_grads, flag_reads = [], [], [], [], []
    stats = lr.get_state(model).stats
    for step in range(STEPS):
        local = _batch_for(kind, data, step)
        reads = stats.flag_reads
        lm_loss(model, local).backward()
        flag_reads.append(stats.flag_reads - reads)
        lm_loss(ddp, local).backward()
        diff, names = _grads_vs_ddp(model, ddp.module)
        grad_diffs.append(diff)
        mismatched += [f"step {step}: {name}" for name in names]
        ddp_watched_none.append(all(p.grad is None for n, p in ddp.module.named_parameters() if watched in n))
        sharded_watched_grads.append(
            sorted(n for n, p in model.named_parameters() if watched in n and p.grad is not None)
        )
        opt.step()
        opt.zero_grad()
        ddp_opt.step()
        ddp_opt.zero_grad()
    full = lr.full_state_dict(model)
    ddp_state = ddp.module.state_dict()

    def changed(tensors: dict) -> list[str]:
        return sorted(k for k in tensors if watched in k and not torch.equal(tensors[k], initial[k]))

    return {
        "max_diff": max((full[k] - ddp_state[k]).abs().max().item() for k in ddp_state),
        "grad_diffs": grad_diffs,
        "mismatched": mismatched,
        "ddp_watched_none": ddp_watched_none,
        "sharded_watched_grads": sharded_watched_grads,
        "sharded_watched_changed": changed(full),
        "flag_reads": flag_reads,
        "ddp_watched_changed": changed(ddp_state),
    }


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_unused_parameter_gets_no_grad_and_does_not_move(dist_pool, world_size):
    results = dist_pool(world_size).run(check_unused_vs_ddp, "unused")
    for rank, result in enumerate(results):
        assert result["ddp_watched_none"] == [True] * STEPS and result["ddp_watched_changed"] == [], result  # oracle
        assert result["flag_reads"] == [1] * STEPS, (rank, result)  # every rank misses "spare": each reads the sums
        assert all(names == [] for names in result["sharded_watched_grads"]), (rank, result)
        assert result["sharded_watched_changed"] == [], (rank, result)  # weight decay never touched it
        assert result["mismatched"] == [], (rank, result)
        assert max(result["grad_diffs"]) <= TOLERANCE and result["max_diff"] <= TOLERANCE, (rank, result)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_parameter_used_on_some_ranks_only_gets_the_global_grad(dist_pool, world_size):
    results = dist_pool(world_size).run(check_unused_vs_ddp, "routed")
    for rank, result in enumerate(results):
        # the oracle: DDP gives the expert a gradient on every rank unless no rank used it (step 1)
        assert result["ddp_watched_none"] == [False, True, False, False, False], result
        # only a rank whose own batch skipped the expert reads the summed flags back (a device sync on NCCL)
        missed = [int(rank not in _routed_ranks(step, world_size)) for step in range(STEPS)]
        assert result["flag_reads"] == missed, (rank, result)
        assert result["mismatched"] == [], (rank, result)
        assert max(result["grad_diffs"]) <= TOLERANCE, (rank, result)
        assert result["max_diff"] <= TOLERANCE, (rank, result)


# --------------------------------------------------------- 5. exceptions in backward / forward
FAIL_STEP = 2


def check_exception(where: str) -> dict:
    """Step 2 raises (in block 1's forward, or in its backward after the MLP's grads accumulated);
    the loop catches it, zeroes grads and goes on. The oracle skips step 2 altogether."""
    data = make_batches(STEPS, BATCH)
    reference = make_faulty_model()
    reference_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    model = lr.fully_shard(make_faulty_model(), shard_granularity="row")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    state = lr.get_state(model)
    fault = model.blocks[1].fault
    counts, after_forward, after_backward, raised = {}, {}, {}, []
    right_after_failure = None
    for step in range(STEPS):
        before = _counts(state)
        setattr(fault, f"fail_{where}", step == FAIL_STEP)
        try:
            loss = lm_loss(model, _local(data[step]))
            after_forward[step] = _buffers(state)
            loss.backward()
        except RuntimeError as error:
            raised.append((step, str(error)))
            opt.zero_grad(set_to_none=True)
            right_after_failure = _buffers(state)
            setattr(fault, f"fail_{where}", False)
            continue
        counts[step] = _delta(_counts(state), before)
        after_backward[step] = _buffers(state)
        opt.step()
        opt.zero_grad()
        lm_loss(reference, data[step]).backward()
        reference_opt.step()
        reference_opt.zero_grad()
    return {
        "max_diff": _max_diff(lr.full_state_dict(model), reference),
        "raised": raised,
        "counts": counts,
        "after_forward": after_forward,
        "after_backward": after_backward,
        "right_after_failure": right_after_failure,  # reported, not asserted: no engine code runs in between
    }


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("where", ["backward", "forward"])
def test_exception_step_contributes_nothing(dist_pool, world_size, where):
    results = dist_pool(world_size).run(check_exception, where)
    for rank, result in enumerate(results):
        assert result["raised"] == [(FAIL_STEP, f"injected {where} failure")], result
        assert result["max_diff"] <= TOLERANCE, (rank, result)
        counts = result["counts"]
        assert counts[3] == counts[1] and counts[4] == counts[1], (rank, counts)  # a normal step's collectives
        # the next forward leaves the buffers as a normal forward does, and every backward frees them all
        assert result["after_forward"][3] == result["after_forward"][1], (rank, result)
        assert all(not any(a or b for a, b in buffers) for buffers in result["after_backward"].values()), (rank, result)


class TwoBranchLM(nn.Module):
    """Embedding, two blocks of which each forward runs one (a task or a route), head."""

    def __init__(self) -> None:
        super().__init__()
        base = make_model()
        self.embed, self.head = base.embed, base.head
        self.blocks = nn.ModuleList(base.blocks[:2])

    def forward(self, tokens: torch.Tensor, branch: int) -> torch.Tensor:
        return self.head(self.blocks[branch](self.embed(tokens)))


def _branch_loss(model: nn.Module, tokens: torch.Tensor, branch: int) -> torch.Tensor:
    logits = model(tokens[:, :-1], branch)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def check_block_only_in_no_sync_micro_batch() -> dict:
    """Gradient accumulation where the ``no_sync`` micro-batch runs block 0 and the synchronized one block 1:
    block 0's accumulated gradient is reduced at the synchronized backward (DDP reduces every bucket there),
    not dropped, nor left in its buffer for the next step. 3 SGD steps vs one process on the global batches."""
    first, second = make_batches(3, BATCH, seed=1), make_batches(3, BATCH, seed=2)
    torch.manual_seed(0)
    reference = TwoBranchLM()
    model = TwoBranchLM()
    model.load_state_dict(reference.state_dict())
    lr.fully_shard(model, group_modules=[type(model.blocks[0])])
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, reference)]
    for step in range(3):
        with lr.no_sync(model):
            _branch_loss(model, _local(first[step]), 0).backward()
        _branch_loss(model, _local(second[step]), 1).backward()
        _branch_loss(reference, first[step], 0).backward()
        _branch_loss(reference, second[step], 1).backward()
        _step(optimizers)
    return {"max_diff": _max_diff(lr.full_state_dict(model), reference)}


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        return x + self.linear(x) if use else x * 1.0  # its weights get a gradient only where used


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        return x + self.linear(x)


class _GatedBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.gated, self.plain, self.out = nn.Linear(8, 8), _Gated(), _Plain(), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, branch: int, use: bool = True) -> torch.Tensor:
        return self.out((self.gated if branch == 0 else self.plain)(self.inp(x), use))


def check_gated_block_only_in_no_sync_micro_batch() -> dict:
    """As above, and the ``no_sync`` branch's weights get a gradient on rank 0 only (routed): every rank must
    still reduce that block at the synchronized backward (a buffer on rank 0 only mismatched the collectives)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = _GatedBranches()
    model = _GatedBranches()
    model.load_state_dict(reference.state_dict())
    lr.fully_shard(model, group_modules=[_Gated, _Plain])
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        first, second = (torch.randn(world, 2, 8, generator=generator) for _ in range(2))
        with lr.no_sync(model):
            model(first[rank], 0, use=rank == 0).sum().backward()
        model(second[rank], 1).sum().backward()
        loss = sum(reference(first[r], 0, use=r == 0).sum() + reference(second[r], 1).sum() for r in range(world))
        (loss / world).backward()
        _step(optimizers)
    return {"max_diff": _max_diff(lr.full_state_dict(model), reference)}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize(
    "check", [check_block_only_in_no_sync_micro_batch, check_gated_block_only_in_no_sync_micro_batch],
    ids=["every-rank", "gated-on-rank-0"],
)
def test_block_run_only_in_a_no_sync_micro_batch_is_reduced_on_every_rank(dist_pool, world_size, check):
    for result in dist_pool(world_size).run(check):
        assert result["max_diff"] <= TOLERANCE, result


def check_out_of_memory_while_the_gradient_buffer_changes_dtype() -> dict:
    """bf16 compute, fp32 reduction: a synchronized step holds bf16 gradient buffers, a ``no_sync`` micro-batch
    fp32 ones; the fp32 allocation fails once (an injected OOM), then the step is retried. The retried
    micro-batches give the gradients of a run without the failure."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lightning_ragged.engine import storage

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    data = make_batches(3, BATCH, seed=4)
    grads = {}
    for run in ("clean", "oom"):
        model = lr.fully_shard(make_model(), mp_policy=policy)
        lm_loss(model, _local(data[0])).backward()  # synchronized: bf16 buffers
        model.zero_grad(set_to_none=True)
        if run == "oom":
            allocate, failed = storage.allocate, []

            def failing(tensor: torch.Tensor, nbytes: int) -> None:
                if tensor.dtype == torch.float32 and not failed:
                    failed.append(nbytes)
                    raise torch.OutOfMemoryError("injected")
                allocate(tensor, nbytes)

            storage.allocate = failing
            try:
                with lr.no_sync(model), contextlib.suppress(torch.OutOfMemoryError):
                    lm_loss(model, _local(data[1])).backward()
            finally:
                storage.allocate = allocate
            assert failed, "the injected OOM did not fire"
            model.zero_grad(set_to_none=True)
        with lr.no_sync(model):
            lm_loss(model, _local(data[1])).backward()
        lm_loss(model, _local(data[2])).backward()
        grads[run] = {name: param.grad.clone() for name, param in model.named_parameters()
                      if param.grad is not None and param.grad.numel()}  # a rank may hold none of a parameter
    assert grads["clean"].keys() == grads["oom"].keys()
    return {"max_diff": max((grads["clean"][k] - grads["oom"][k]).abs().max().item() for k in grads["clean"])}


def test_out_of_memory_while_the_gradient_buffer_changes_dtype_is_recovered(dist_pool):
    for result in dist_pool(2).run(check_out_of_memory_while_the_gradient_buffer_changes_dtype):
        assert result["max_diff"] == 0.0, result


# ------------------------------------------------ 6. no_sync accumulates in the reduce dtype
MICRO_BATCHES = 4
UNIT_ROUNDOFF = 2.0**-24  # fp32


def check_bf16_accumulation(micro_batches: int) -> dict:
    """bf16 compute, fp32 reduction; ``micro_batches`` backwards, all but the last under no_sync.

    The sharded gradient before the optimizer step must be (1/W) sum over ranks r and micro-
    batches k of fp32(g_rk), where g_rk is the bf16 gradient of a bf16 copy of the model on
    rank r's k-th micro-batch (same shapes, same kernels: bit-identical to what the sharded
    model computes per micro-batch).

    Tolerance, per element: any order of the n = W*micro_batches fp32 additions is within
    (n-1)*u*sum|terms| of the exact sum (u = 2^-24), the 1/W scaling adds u*|result|; we allow
    twice that. It is below 1e-6 here, far under the ~2^-9 relative error that summing the
    micro-batches in bf16 makes, which the test computes too and requires to be caught.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    world, per = dist.get_world_size(), BATCH // dist.get_world_size()
    data = make_batches(micro_batches, BATCH, seed=3)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = lr.fully_shard(make_model(), mp_policy=policy)
    for k in range(micro_batches):
        context = lr.no_sync(model) if k < micro_batches - 1 else contextlib.nullcontext()
        with context:
            lm_loss(model, _local(data[k])).backward()

    oracle = make_model().to(torch.bfloat16)
    exact, magnitude, bf16_summed = {}, {}, {}
    for r in range(world):
        summed_in_bf16 = {}
        for k in range(micro_batches):
            oracle.zero_grad(set_to_none=True)
            lm_loss(oracle, data[k][r * per : (r + 1) * per]).backward()
            for name, param in oracle.named_parameters():
                term = param.grad.double()
                exact[name] = exact.get(name, 0) + term
                magnitude[name] = magnitude.get(name, 0) + term.abs()
                # what accumulating in the bf16 gradient buffer gives
                previous = summed_in_bf16.get(name)
                summed_in_bf16[name] = param.grad.clone() if previous is None else previous + param.grad
        for name, value in summed_in_bf16.items():
            bf16_summed[name] = bf16_summed.get(name, 0) + value.double()

    terms = world * micro_batches
    engine_err = bf16_err = 0.0
    engine_over = bf16_over = checked = 0
    dtypes = set()
    for name, param in model.named_parameters():
        start, end = param.ragged_shard.local_range
        if end == start:
            continue
        dtypes.add(param.grad.dtype)
        truth = exact[name].reshape(-1)[start:end] / world
        magnitude_sum = magnitude[name].reshape(-1)[start:end] / world
        bound = 2 * ((terms - 1) * UNIT_ROUNDOFF * magnitude_sum + UNIT_ROUNDOFF * truth.abs())
        engine = (param.grad.double() - truth).abs()
        bf16_path = (bf16_summed[name].reshape(-1)[start:end] / world - truth).abs()
        engine_err = max(engine_err, engine.max().item())
        bf16_err = max(bf16_err, bf16_path.max().item())
        engine_over += int((engine > bound).sum())
        bf16_over += int((bf16_path > bound).sum())
        checked += end - start
    return {
        "engine_err": engine_err,
        "bf16_err": bf16_err,
        "engine_over_bound": engine_over,
        "bf16_over_bound": bf16_over,
        "checked": checked,
        "grad_dtypes": sorted(str(d) for d in dtypes),
    }


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("micro_batches", [1, MICRO_BATCHES])
def test_bf16_no_sync_accumulates_in_reduce_dtype(dist_pool, world_size, micro_batches):
    results = dist_pool(world_size).run(check_bf16_accumulation, micro_batches)
    assert sum(r["checked"] for r in results) > 0
    for rank, result in enumerate(results):
        assert result["grad_dtypes"] == ["torch.float32"], result
        assert result["engine_over_bound"] == 0 and result["engine_err"] <= TOLERANCE, (rank, result)
        if micro_batches > 1:
            # the test can fail: summing the micro-batches in bf16 is caught by the same bound
            assert result["bf16_over_bound"] > 0, (rank, result)
            assert result["engine_err"] < result["bf16_err"], (rank, result)
