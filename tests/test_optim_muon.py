"""Muon on ragged shards matches single-process ``torch.optim.Muon`` (world sizes 1, 2, 3)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode
from torch.optim._muon import _zeropower_via_newtonschulz

from lightning_ragged import full_state_dict, fully_shard
from lightning_ragged.optim import Muon, MuonWithAuxAdamW, split_muon_params
from tests.models import lm_loss, make_batches, make_model

STEPS = 5
GRANULARITIES = ("matrix", "row", "element")
MUON = dict(lr=0.02, momentum=0.95, weight_decay=0.1)
ADAMW = dict(lr=3e-3, weight_decay=0.01)


def _optimizers(named_params, muon_cls):
    muon_named, other_named = split_muon_params(named_params)
    muon = muon_cls([p for _, p in muon_named], **MUON)
    adamw = torch.optim.AdamW([p for _, p in other_named], **ADAMW)
    return muon, adamw, [name for name, _ in muon_named]


def _sharded_and_reference(granularity):
    """A sharded model and its unsharded twin, each with (Muon, AdamW, Muon names), and both named-parameter dicts."""
    model = fully_shard(make_model(), shard_granularity=granularity)
    reference = make_model()
    ours = _optimizers(model.named_parameters(), Muon)
    theirs = _optimizers(reference.named_parameters(), torch.optim.Muon)
    return model, reference, ours, theirs, dict(model.named_parameters()), dict(reference.named_parameters())


def _full_grad(param):
    """The full gradient of a sharded parameter on every rank (pieces are disjoint: the sum is exact)."""
    shard = param.ragged_shard
    full = torch.zeros(shard.numel)
    start, end = shard.local_range
    full[start:end] = param.grad
    dist.all_reduce(full)
    return full.view(shard.global_shape)


def train_against_torch_muon(granularities=GRANULARITIES, steps=STEPS, adjust_lr_fn=None, shared_grads=True):
    """Per granularity: max |sharded − reference| over Muon / all params, collectives per Muon step, plan.

    The reference trains the full model in one process with ``torch.optim.Muon`` + AdamW on
    the same global batches, accumulating its gradient over the same micro-batches as the
    ranks (mathematically the full-batch mean); ``grad_diff`` is its gap to the engine's
    reduced gradient. With ``shared_grads`` the reference then steps on the engine's
    gradient, isolating the optimizer; without, it steps on its own. Newton–Schulz runs in
    bf16, so a last-bit gradient difference (gloo's sum order and 1/world scale at world 3)
    can flip a bf16 rounding inside Newton–Schulz: one flip changes an update element by up to
    one bf16 ulp of it (2^-8 relative), i.e. ~lr·2^-8 ≈ 1e-4 per step and matrix element at
    lr 0.02; 5 steps with momentum stay well under 5e-3. Whether a flip happens at all depends
    on the CPU's bf16 kernels (AVX-512 BF16/AMX round differently), so no test asserts it.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = make_batches(steps, batch=6)
    initial = make_model().state_dict()
    results = {}
    for granularity in granularities:
        model, reference, (muon, adamw, muon_names), (ref_muon, ref_adamw, _), sharded, full_params = (
            _sharded_and_reference(granularity)
        )
        for opt in (muon, ref_muon):
            opt.param_groups[0]["adjust_lr_fn"] = adjust_lr_fn
        counts, grad_diff = [], 0.0
        for step in range(steps):
            lm_loss(model, batches[step].chunk(world)[rank]).backward()
            for chunk in batches[step].chunk(world):
                (lm_loss(reference, chunk) / world).backward()
            for name, param in sharded.items():
                engine_grad = _full_grad(param)
                grad_diff = max(grad_diff, (engine_grad - full_params[name].grad).abs().max().item())
                if shared_grads:
                    full_params[name].grad.copy_(engine_grad)
            with CommDebugMode() as comm:
                muon.step()
            counts.append(comm.get_total_counts())
            adamw.step()
            muon.zero_grad()
            adamw.zero_grad()
            ref_muon.step()
            ref_adamw.step()
            ref_muon.zero_grad()
            ref_adamw.zero_grad()
        full = full_state_dict(model)
        expected = reference.state_dict()
        diffs = {key: (full[key] - expected[key]).abs().max().item() for key in expected}
        results[granularity] = dict(
            muon_diff=max(diffs[name] for name in muon_names),
            all_diff=max(diffs.values()),
            grad_diff=grad_diff,
            counts=counts,
            split=muon.last_plan.split,
            owned=muon.last_plan.owned,
            moved=max((full[n] - initial[n]).abs().max().item() for n in muon_names),
        )
    return results


def _fp32_newton_schulz(*args):
    """torch's Newton–Schulz with its bf16 result handed back in fp32, as a custom ``newton_schulz`` may."""
    return _zeropower_via_newtonschulz(*args).float()


def same_gradients_against_torch_muon(granularities=GRANULARITIES, steps=STEPS, newton_schulz=None):
    """Identical full gradients on both sides: the optimizer alone, so the match is bit-for-bit."""
    results = {}
    for granularity in granularities:
        model, _, (muon, _, names), (ref_muon, _, _), sharded, full_params = _sharded_and_reference(granularity)
        if newton_schulz is not None:
            muon.newton_schulz = newton_schulz
        generator = torch.Generator().manual_seed(3)
        for _ in range(steps):
            for name in names:
                grad = torch.randn(full_params[name].shape, generator=generator)
                start, end = sharded[name].ragged_shard.local_range
                sharded[name].grad = grad.view(-1)[start:end].clone()
                full_params[name].grad = grad
            muon.step()
            ref_muon.step()
        full = full_state_dict(model)
        results[granularity] = max((full[n] - full_params[n].detach()).abs().max().item() for n in names)
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_muon_bit_exact_with_same_gradients(dist_pool, world_size):
    for rank_result in dist_pool(world_size).run(same_gradients_against_torch_muon):
        assert rank_result == {g: 0.0 for g in GRANULARITIES}


def test_muon_sends_results_in_the_wire_dtype_whatever_newton_schulz_returns(dist_pool):
    """A ``newton_schulz`` returning fp32 under "element" (split matrices, bf16 wire): results are cast for
    the scatter (they used to reach the bf16 all-to-all as fp32) and, being bf16 values, arrive exactly."""
    for rank_result in dist_pool(2).run(same_gradients_against_torch_muon, ("element",), 2, _fp32_newton_schulz):
        assert rank_result == {"element": 0.0}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_muon_matches_torch_muon(dist_pool, world_size):
    per_rank = dist_pool(world_size).run(train_against_torch_muon)
    for granularity in GRANULARITIES:
        result = per_rank[0][granularity]
        assert result["moved"] > 1e-2  # the matrices really trained
        assert result["grad_diff"] <= 1e-6, (granularity, result)  # the engine's gradient is the full-batch one
        assert result["muon_diff"] <= 1e-6, (granularity, result)  # measured: 0.0 (bit-exact)
        assert result["all_diff"] <= 1e-6, (granularity, result)
        counts = [r[granularity]["counts"] for r in per_rank]
        if granularity == "matrix" or world_size == 1:
            assert all(c == 0 for rank_counts in counts for c in rank_counts), (granularity, counts)
            assert result["split"] == 0
        elif result["split"]:
            # one all-to-all to gather every split matrix, one to scatter the updates back
            assert all(c == 2 for rank_counts in counts for c in rank_counts), (granularity, counts)
    if world_size > 1:
        assert per_rank[0]["element"]["split"] > 0  # the gather path really ran


@pytest.mark.parametrize("world_size", [2, 3])
def test_muon_end_to_end_within_bf16_tolerance(dist_pool, world_size):
    """Reference on its own gradients (no sharing), "row" granularity, Moonshot's lr adjustment."""
    per_rank = dist_pool(world_size).run(train_against_torch_muon, ("row",), STEPS, "match_rms_adamw", False)
    result = per_rank[0]["row"]
    assert result["split"] > 0
    # world 2: gloo's 2-way sum is exact, so no bf16 rounding can flip (measured 0.0).
    # world 3: the bf16 flip bound of ``train_against_torch_muon``'s docstring (measured 0 to 2.6e-3,
    # by CPU), far below how far the matrices move (``moved`` > 1e-2).
    assert result["muon_diff"] <= (1e-6 if world_size == 2 else 5e-3), result
    assert result["moved"] > 1e-2


@pytest.mark.parametrize("options", [{}, {"amsgrad": True}, {"maximize": True}], ids=["plain", "amsgrad", "maximize"])
def test_aux_adamw_groups_match_torch_adamw_bit_for_bit(options):
    # amsgrad and maximize were kept in the group but ignored (maximize descended: 0.66 apart)
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(7, 5)), torch.nn.Parameter(torch.randn(3))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    optimizer = MuonWithAuxAdamW([dict(params=ours, use_muon=False, **ADAMW, **options)])
    reference = torch.optim.AdamW(theirs, **ADAMW, **options)
    for _ in range(STEPS):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        optimizer.step()
        reference.step()
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs))


def test_muon_refuses_non_matrix_params():
    with pytest.raises(ValueError, match="Muon only supports 2-D parameters.*'bias'.*AdamW"):
        Muon([("bias", torch.nn.Parameter(torch.zeros(4)))])


def test_aux_adamw_group_added_later_steps_as_torch_adamw_with_its_defaults():
    """Lightning's ``BaseFinetuning.unfreeze_and_add_param_group`` adds ``{"params", "lr"}``, no
    ``use_muon``: the group steps as ``torch.optim.AdamW`` with AdamW's defaults (before: KeyError
    'use_muon' at step; with ``use_muon=False``, Muon's weight decay and KeyError 'betas')."""
    from lightning.pytorch.callbacks import BaseFinetuning

    torch.manual_seed(0)
    head, backbone = torch.nn.Linear(8, 6, bias=False), torch.nn.Linear(8, 8)
    reference = [torch.nn.Parameter(p.detach().clone()) for p in backbone.parameters()]
    optimizer = MuonWithAuxAdamW([dict(params=[head.weight], use_muon=True, lr=0.02)])
    BaseFinetuning.unfreeze_and_add_param_group(backbone, optimizer, lr=0.01, initial_denom_lr=1.0)
    optimizer.add_param_group(dict(params=[extra := torch.nn.Parameter(torch.randn(5))], use_muon=False))
    theirs = torch.optim.AdamW(reference, lr=0.01)
    extra_reference = torch.nn.Parameter(extra.detach().clone())
    theirs_extra = torch.optim.AdamW([extra_reference])
    for _ in range(STEPS):
        for p, q in zip([*backbone.parameters(), extra, head.weight], [*reference, extra_reference, None]):
            p.grad = torch.randn_like(p)
            if q is not None:
                q.grad = p.grad.clone()
        optimizer.step()
        theirs.step()
        theirs_extra.step()
    assert all(torch.equal(p, q) for p, q in zip(backbone.parameters(), reference))
    assert torch.equal(extra, extra_reference)


def test_muon_refuses_a_non_matrix_param_added_later_and_stays_as_it_was():
    """torch's ``add_param_group`` path gets the constructor's check (before: accepted, then IndexError
    at the first step); the refused group leaves no trace, so a corrected one can follow."""
    weight, bias = torch.nn.Parameter(torch.randn(6, 8)), torch.nn.Parameter(torch.randn(6))
    for optimizer in (Muon([weight], lr=0.02), MuonWithAuxAdamW([dict(params=[weight], use_muon=True)])):
        with pytest.raises(ValueError, match="Muon only supports 2-D parameters.*global shape \\(6,\\).*AdamW"):
            optimizer.add_param_group(dict(params=[bias], use_muon=True))
        assert len(optimizer.param_groups) == 1 and len(optimizer._param_names) == 1
    optimizer.add_param_group(dict(params=[bias], use_muon=False))
    weight.grad, bias.grad = torch.ones_like(weight), torch.ones_like(bias)
    optimizer.step()


def test_split_muon_params_recipe():
    muon, other = split_muon_params(make_model().named_parameters())
    muon_names = {name for name, _ in muon}
    assert muon_names == {f"blocks.{i}.{m}.weight" for i in range(2) for m in ("qkv", "proj", "up", "down")}
    assert {"embed.weight", "pos", "norm.weight", "blocks.0.up.bias"} <= {name for name, _ in other}


def test_muon_state_dict_is_named_and_reloads():
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(5, 3))
    muon = Muon([("layer.weight", weight)], lr=0.1)
    weight.grad = torch.randn(5, 3)
    muon.step()
    state = muon.state_dict()
    assert list(state["state"]) == ["layer.weight"]
    meta = state["ragged"]["layer.weight"]
    assert meta["global_shape"] == (5, 3) and meta["local_range"] == (0, 15)
    assert meta["state_layout"] == {"momentum_buffer": "flat"}
    fresh = Muon([("layer.weight", weight)], lr=0.5)
    fresh.load_state_dict(state)
    assert fresh.param_groups[0]["lr"] == 0.1
    torch.testing.assert_close(fresh.state[weight]["momentum_buffer"], muon.state[weight]["momentum_buffer"].view(-1))


def muon_policy_layout():
    """Per parameter under ``shard_granularity="muon"``: (granularity, ranks holding a piece)."""
    model = fully_shard(make_model(), shard_granularity="muon")
    return {
        name: (p.ragged_shard.granularity, sum(end > start for start, end in p.ragged_shard.rank_ranges))
        for name, p in model.named_parameters()
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_muon_policy_matches_torch_muon_without_collectives(dist_pool, world_size):
    """``shard_granularity="muon"``: Muon's matrices whole (0 collectives, bit-exact), AdamW's params cut."""
    pool = dist_pool(world_size)
    for rank_result in pool.run(same_gradients_against_torch_muon, ("muon",)):
        assert rank_result == {"muon": 0.0}
    per_rank = pool.run(train_against_torch_muon, ("muon",))
    result = per_rank[0]["muon"]
    assert result["moved"] > 1e-2
    assert result["grad_diff"] <= 1e-6 and result["muon_diff"] <= 1e-6 and result["all_diff"] <= 1e-6, result
    assert result["split"] == 0 and result["owned"] == 8, result  # 2 blocks x (qkv, proj, up, down)
    assert all(c == 0 for r in per_rank for c in r["muon"]["counts"]), [r["muon"]["counts"] for r in per_rank]
    layout = pool.run(muon_policy_layout)[0]
    muon_named, _ = split_muon_params(make_model())
    assert all(layout[name][1] == 1 for name, _ in muon_named), layout  # every Muon matrix whole on one rank
    # The AdamW side is cut at rows: the (tied) embedding, 481 of the root group's 585 elements, spans ranks.
    granularity, holders = layout["embed.weight"]
    assert granularity == 13 and holders > 1, layout["embed.weight"]


# ---------------------------------------------- expert stacks [E, a, b] and per-head QKV (issue 14)
QWEN_HEADS = {"q_proj": 4, "k_proj": 2, "v_proj": 2}  # head_dim 8: q [32, 32] is 4 heads, k and v [16, 32] 2
MOE_CASES = {
    # case: (shard_granularity, block_rows, which Muon params, qkv_heads, adjust_lr_fn, attention and
    # experts as their own groups)
    "muon-experts": ("muon", 128, "experts", None, None, False),  # each expert of a stack whole
    "row-experts": ("row", 128, "experts", None, None, False),  # a row of a stack is a row of one expert: cut inside
    "muon-all": ("muon", 128, "all", QWEN_HEADS, "match_rms_adamw", False),  # 2-D whole, experts whole
    "block-heads": ("block", 8, "attention", QWEN_HEADS, None, False),  # block_rows = head_dim: heads whole
    "element-all": ("element", 128, "all", QWEN_HEADS, "match_rms_adamw", False),  # cuts inside experts
    "element-groups": ("element", 128, "all", QWEN_HEADS, None, True),  # cuts inside k / v heads
}


def _split_kinds(named, qkv_heads):
    """Which kinds of matrix ("expert", "head", "matrix") the shards cut, from the ranks' flat ranges."""
    kinds = set()
    for name, param in named:
        shard = param.ragged_shard
        count = len(_matrices(name, torch.empty(shard.global_shape, device="meta"), qkv_heads))
        numel = shard.numel // count
        cuts = [end for _, end in shard.rank_ranges if 0 < end < shard.numel]
        if any(cut % numel for cut in cuts):
            kinds.add("expert" if len(shard.global_shape) == 3 else "head" if count > 1 else "matrix")
    return kinds


def _matrices(name, full, qkv_heads):
    """The matrices torch.optim.Muon gets as separate parameters: experts, heads, or the whole weight."""
    if full.dim() == 3:
        return list(full.unbind(0))
    heads = next((n for fragment, n in (qkv_heads or {}).items() if fragment in name), 1)
    return list(full.view(heads, -1, full.shape[1]).unbind(0))


def moe_against_torch_muon_per_matrix(cases=tuple(MOE_CASES), steps=3):
    """Per case, on a tiny Qwen3-MoE: max |sharded − torch.optim.Muon per expert/head|, counts, plan.

    The oracle is single-process ``torch.optim.Muon`` with one separate parameter per expert
    matrix / head (same hyperparameters, so momentum, nesterov, weight decay and ``adjust_lr``
    act per matrix); both sides get identical random full gradients, so the optimizer alone is
    compared.
    """
    from tests.hf_models import make_qwen3_moe

    results = {}
    for case in cases:
        granularity, block_rows, which, qkv_heads, adjust_lr_fn, groups = MOE_CASES[case]
        model = make_qwen3_moe(0)
        group_modules = [m for n, m in model.named_modules() if n.endswith(("self_attn", "experts"))] if groups else None
        model = fully_shard(model, shard_granularity=granularity, block_rows=block_rows, group_modules=group_modules)
        reference = dict(make_qwen3_moe(0).named_parameters())
        muon_named, _ = split_muon_params(model)
        if which == "experts":
            muon_named = [(n, p) for n, p in muon_named if "experts" in n]
        elif which == "attention":
            muon_named = [(n, p) for n, p in muon_named if any(f in n for f in QWEN_HEADS)]
        names = [n for n, _ in muon_named]
        ours = Muon(muon_named, **MUON, adjust_lr_fn=adjust_lr_fn, qkv_heads=qkv_heads)
        slices = {n: [torch.nn.Parameter(m.detach().clone()) for m in _matrices(n, reference[n], qkv_heads)] for n in names}
        theirs = torch.optim.Muon([p for n in names for p in slices[n]], **MUON, adjust_lr_fn=adjust_lr_fn)
        sharded = dict(muon_named)
        generator = torch.Generator().manual_seed(5)
        counts = []
        for _ in range(steps):
            for name in names:
                grad = torch.randn(reference[name].shape, generator=generator)
                start, end = sharded[name].ragged_shard.local_range
                sharded[name].grad = grad.view(-1)[start:end].clone()
                for param, piece in zip(slices[name], _matrices(name, grad, qkv_heads)):
                    param.grad = piece.clone()
            with CommDebugMode() as comm:
                ours.step()
            counts.append(comm.get_total_counts())
            theirs.step()
        full = full_state_dict(model)
        expected = {n: torch.stack([p.detach() for p in slices[n]]).view(reference[n].shape) for n in names}
        results[case] = dict(
            diff=max((full[n] - expected[n]).abs().max().item() for n in names),
            moved=max((expected[n] - reference[n].detach()).abs().max().item() for n in names),
            counts=counts,
            owned=ours.last_plan.owned,
            split=ours.last_plan.split,
            split_kinds=_split_kinds(muon_named, qkv_heads),
        )
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_muon_per_expert_and_per_head_match_torch_muon(dist_pool, world_size):
    per_rank = dist_pool(world_size).run(moe_against_torch_muon_per_matrix)
    for case in MOE_CASES:
        result = per_rank[0][case]
        counts = [r[case]["counts"] for r in per_rank]
        assert result["moved"] > 1e-2, (case, result)
        assert result["diff"] <= 1e-5, (case, result)  # measured: 0.0 (same bf16 Newton–Schulz per matrix)
        if case in ("muon-experts", "muon-all", "block-heads"):  # every expert / head / matrix whole
            assert result["split"] == 0, (case, result)
            assert all(c == 0 for rank_counts in counts for c in rank_counts), (case, counts)
        elif result["split"]:  # one all-to-all gathers every split expert / head, one scatters back
            assert all(c == 2 for rank_counts in counts for c in rank_counts), (case, counts)
    experts = 2 * 2 * 16  # 2 layers x (gate_up_proj, down_proj) x 16 experts
    assert per_rank[0]["muon-experts"]["owned"] == experts
    # muon-all: the experts, 2 layers x (8 heads of q/k/v + o_proj + router gate)
    assert per_rank[0]["muon-all"]["owned"] == experts + 2 * (8 + 2)
    # the gather path really ran, per expert and per head
    assert "expert" in per_rank[0]["element-all"]["split_kinds"], per_rank[0]["element-all"]
    assert "expert" in per_rank[0]["row-experts"]["split_kinds"], per_rank[0]["row-experts"]
    assert "head" in per_rank[0]["element-groups"]["split_kinds"], per_rank[0]["element-groups"]
    assert per_rank[0]["element-groups"]["owned"] + per_rank[0]["element-groups"]["split"] == experts + 2 * (8 + 2)
    assert per_rank[0]["block-heads"]["owned"] == 2 * 8


def _sharded_param(shape, rank_ranges, rank):
    """A stand-in for a sharded parameter: this rank's flat piece carrying its RaggedShard."""
    from lightning_ragged.layout.ragged_shard import RaggedShard

    start, end = rank_ranges[rank]
    param = torch.nn.Parameter(torch.zeros(end - start))
    param.ragged_shard = RaggedShard("experts", torch.Size(shape), 1, tuple(rank_ranges), rank)
    return param


def test_muon_load_balances_experts_as_units():
    """[4, 8, 8] cut inside expert 1: experts 0 | 2, 3 whole, expert 1 goes to the lighter rank 0."""
    from lightning_ragged.optim import ns_flops

    param = _sharded_param((4, 8, 8), [(0, 100), (100, 256)], rank=0)
    muon = Muon([("experts", param)])
    jobs = muon._matrix_jobs(param, muon.param_groups[0], torch.zeros(100))
    plan = muon._assign_roots(jobs)
    assert [job.holder() for job in jobs] == [0, None, 1, 1]
    assert [job.piece(0) for job in jobs] == [(0, 64), (0, 36), (0, 0), (0, 0)]
    assert (plan.owned, plan.split, jobs[1].root) == (3, 1, 0)
    assert plan.cost_per_rank[0] == [2 * ns_flops((8, 8)), 2 * ns_flops((8, 8))] and plan.balance() == 1.0


def test_split_muon_params_sends_expert_stacks_to_muon():
    from tests.hf_models import make_qwen3_moe

    model = make_qwen3_moe(0)
    model.conv = torch.nn.Conv1d(4, 4, 3)  # 3-D weight, but no expert stack
    muon, other = split_muon_params(model)
    muon_names = {name for name, _ in muon}
    assert {f"model.layers.{i}.mlp.experts.{m}" for i in range(2) for m in ("gate_up_proj", "down_proj")} <= muon_names
    assert "model.layers.0.self_attn.q_proj.weight" in muon_names
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", "conv.weight"} <= {n for n, _ in other}


def test_muon_policy_keeps_experts_whole_and_cuts_between_them():
    from lightning_ragged.layout.granularity import resolve_granularity

    assert resolve_granularity("muon", "mlp.experts.down_proj", torch.empty(16, 32, 16)) == 32 * 16  # one expert
    assert resolve_granularity("muon", "attn.qkv.weight", torch.empty(24, 8)) == 24 * 8  # a 2-D matrix whole


def test_muon_refuses_bad_qkv_heads():
    weight = torch.nn.Parameter(torch.zeros(39, 13))
    with pytest.raises(ValueError, match="'blocks.0.qkv.weight'.*into 4 heads.*3 \\* num_heads"):
        Muon([("blocks.0.qkv.weight", weight)], qkv_heads={"qkv": 4})
    with pytest.raises(ValueError, match="'blocks.0.qkv.weight'.*head count 0"):
        Muon([("blocks.0.qkv.weight", weight)], qkv_heads=lambda name, shape: 0)
    with pytest.raises(ValueError, match="'experts'.*global shape \\(2, 3, 4\\)"):
        Muon([("experts", torch.nn.Parameter(torch.zeros(2, 3, 4)))], qkv_heads={"experts": 2})
    with pytest.raises(ValueError, match="qkv_heads=3 is not supported"):
        Muon([("blocks.0.qkv.weight", weight)], qkv_heads=3)
    Muon([("blocks.0.qkv.weight", weight)], qkv_heads={"qkv": 3})  # 3 heads of 13 rows: fine


def test_muon_per_head_in_one_process_matches_torch_muon_per_head():
    """Plain (unsharded) fused QKV [3*H*d, in] with H=2, d=4, and a plain expert stack."""
    torch.manual_seed(0)
    qkv, experts = torch.nn.Parameter(torch.randn(24, 8)), torch.nn.Parameter(torch.randn(3, 5, 7))
    heads = [torch.nn.Parameter(h.detach().clone()) for h in qkv.view(6, 4, 8)]
    stack = [torch.nn.Parameter(e.detach().clone()) for e in experts]
    ours = Muon([("attn.qkv.weight", qkv), ("mlp.experts", experts)], qkv_heads={"qkv": 6}, **MUON)
    theirs = torch.optim.Muon(heads + stack, **MUON)
    for _ in range(STEPS):
        qkv.grad, experts.grad = torch.randn(24, 8), torch.randn(3, 5, 7)
        for param, grad in zip(heads + stack, [*qkv.grad.view(6, 4, 8), *experts.grad]):
            param.grad = grad.clone()
        ours.step()
        theirs.step()
    assert torch.equal(qkv.detach(), torch.stack([h.detach() for h in heads]).view(24, 8))
    assert torch.equal(experts.detach(), torch.stack([e.detach() for e in stack]))


def test_aux_adamw_passes_qkv_heads_to_muon():
    torch.manual_seed(0)
    ours, theirs = torch.nn.Parameter(torch.randn(24, 8)), torch.nn.Parameter(torch.randn(24, 8))
    theirs.data.copy_(ours.data)
    group = dict(params=[ours], param_names=["attn.qkv.weight"], use_muon=True, **MUON)
    optimizer = MuonWithAuxAdamW([group], qkv_heads={"qkv": 6})
    reference = Muon([("attn.qkv.weight", theirs)], qkv_heads={"qkv": 6}, **MUON)
    for _ in range(STEPS):
        ours.grad = torch.randn(24, 8)
        theirs.grad = ours.grad.clone()
        optimizer.step()
        reference.step()
    assert optimizer.last_plan.owned == 6 and torch.equal(ours, theirs)


# ---------------------------------------------- a rank without a gradient for a split matrix
MISSING_CASES = {"row": ("row", None), "element-heads": ("element", {"qkv": 3})}  # qkv: q, k, v heads of 13x13
# step: (rank that sets the parameter's grad to None, parameter). At 2 ranks both layouts cut qkv inside
# its v rows (rows 0-35 / 0-34 on rank 0): step 2 rank 1 holds only a piece of v, step 3 rank 0 holds q, k whole.
MISSING_DROPS = {2: (1, "blocks.0.qkv.weight"), 3: (0, "blocks.1.qkv.weight")}


def _holds(flat_range, lo, hi):
    return max(flat_range[0], lo) < min(flat_range[1], hi)


def missing_gradient_against_torch_muon(cases=tuple(MISSING_CASES), steps=4, drops=MISSING_DROPS):
    """Per case: max |sharded − torch.optim.Muon per matrix, told the rule| over weights and momentum, and more.

    The rule (optim/muon.py): a matrix (expert, head) with a piece on the rank without the gradient
    is untouched that step on every rank — momentum, weight decay, update — the others step. The
    oracle is single-process ``torch.optim.Muon`` with one parameter per matrix whose ``grad`` is
    None exactly then (torch leaves such a parameter untouched); both sides get the same random
    full gradients. Also: the same oracle without skipping (the drop must matter), collectives per
    step, and per drop how many matrices were split and untouched, whole and untouched, stepped.
    The model shards over ``tests.tiled_runs.timeout_group()``: a mismatched all-to-all raises in 30 s.
    """
    from tests.tiled_runs import timeout_group

    rank = dist.get_rank()
    results = {}
    for case in cases:
        granularity, qkv_heads = MISSING_CASES[case]
        model = fully_shard(make_model(), shard_granularity=granularity, process_group=timeout_group())
        muon_named, _ = split_muon_params(model)
        sharded, names = dict(muon_named), [n for n, _ in muon_named]
        initial = dict(make_model().named_parameters())
        ours = Muon(muon_named, **MUON, qkv_heads=qkv_heads)
        matrices = {  # the oracle told the rule, and one stepping every matrix every step
            side: {n: [torch.nn.Parameter(m.detach().clone()) for m in _matrices(n, initial[n], qkv_heads)]
                   for n in names}
            for side in ("told", "undisturbed")
        }
        oracles = {side: torch.optim.Muon([p for n in names for p in mats[n]], **MUON)
                   for side, mats in matrices.items()}
        generator = torch.Generator().manual_seed(11)
        counts, kinds = [], {}
        for step in range(1, steps + 1):
            dropper, dropped = drops.get(step, (None, None))
            for name in names:
                grad = torch.randn(initial[name].shape, generator=generator)
                shard = sharded[name].ragged_shard
                start, end = shard.local_range
                sharded[name].grad = None if (rank, name) == (dropper, dropped) else grad.view(-1)[start:end].clone()
                pieces = _matrices(name, grad, qkv_heads)
                numel = pieces[0].numel()
                holders = [[_holds(r, k * numel, (k + 1) * numel) for r in shard.rank_ranges]
                           for k in range(len(pieces))]  # per matrix: which ranks hold a piece of it
                skip = [name == dropped and on[dropper] for on in holders]
                for k, piece in enumerate(pieces):
                    matrices["told"][name][k].grad = None if skip[k] else piece.clone()
                    matrices["undisturbed"][name][k].grad = piece.clone()
                if name == dropped:
                    kinds[step] = dict(split_untouched=sum(s and sum(on) > 1 for s, on in zip(skip, holders)),
                                       whole_untouched=sum(s and sum(on) == 1 for s, on in zip(skip, holders)),
                                       stepped=skip.count(False))
            with CommDebugMode() as comm:
                ours.step()
            counts.append(comm.get_total_counts())
            for oracle in oracles.values():
                oracle.step()
        full = full_state_dict(model)
        momentum = {}
        for name in names:
            shard = sharded[name].ragged_shard
            buffer = torch.zeros(shard.numel)
            buffer[slice(*shard.local_range)] = ours.state[sharded[name]]["momentum_buffer"]
            dist.all_reduce(buffer)  # disjoint pieces: the sum is exact
            momentum[name] = buffer
        expected = {side: {n: torch.stack([p.detach() for p in mats[n]]).view(initial[n].shape) for n in names}
                    for side, mats in matrices.items()}
        told = matrices["told"]
        expected_momentum = {n: torch.stack([oracles["told"].state[p]["momentum_buffer"] for p in told[n]]).view(-1)
                             for n in names}
        results[case] = dict(
            diff=max((full[n] - expected["told"][n]).abs().max().item() for n in names),
            momentum_diff=max((momentum[n] - expected_momentum[n]).abs().max().item() for n in names),
            undisturbed_diff=max((full[n] - expected["undisturbed"][n]).abs().max().item() for n in names),
            counts=counts,
            kinds=kinds,
        )
    return results


def test_a_rank_without_a_gradient_leaves_the_matrices_it_holds_untouched(dist_pool):
    """2 ranks, "row" (qkv one split matrix) and "element" with qkv as 3 heads (v split, q and k whole on rank 0).

    Step 2, rank 1 drops blocks.0.qkv's gradient: the matrix (heads: v) it holds a piece of is untouched on
    both ranks, q and k step. Step 3, rank 0 drops blocks.1.qkv's: every matrix of it is untouched. Nothing
    hangs (the old step built its exchange from each rank's own gradients: a mismatched all-to-all that
    raises after 30 s), the exchange runs every step, and momentum and weights equal the told oracle.
    """
    per_rank = dist_pool(2).run(missing_gradient_against_torch_muon)
    result = per_rank[0]
    assert result["row"]["kinds"] == {2: dict(split_untouched=1, whole_untouched=0, stepped=0),
                                      3: dict(split_untouched=1, whole_untouched=0, stepped=0)}, result["row"]
    assert result["element-heads"]["kinds"] == {2: dict(split_untouched=1, whole_untouched=0, stepped=2),
                                                3: dict(split_untouched=1, whole_untouched=2, stepped=0)}, result
    for case in MISSING_CASES:
        # measured 0.0 (the same element-wise ops and bf16 Newton–Schulz per matrix); bound 1e-6
        assert result[case]["diff"] <= 1e-6 and result[case]["momentum_diff"] <= 1e-6, (case, result[case])
        assert result[case]["undisturbed_diff"] > 1e-3, (case, result[case])  # the drops matter
        assert all(r[case]["counts"] == [2] * 4 for r in per_rank), (case, [r[case]["counts"] for r in per_rank])


def test_muon_arguments_mistaken_for_others_are_named() -> None:
    # before: "Tensor.__contains__ only supports Tensor or scalar", "too many values to unpack (expected 2)",
    # and ns_steps=0 accepted (no orthogonalization at all)
    from lightning_ragged.optim import muon_param_groups

    model = make_model()
    with pytest.raises(TypeError, match="MuonWithAuxAdamW takes param groups, not Parameters: pass muon_param_groups"):
        MuonWithAuxAdamW(model.parameters())
    with pytest.raises(TypeError, match="named_params holds Parameter items: pass the model or model.named_parameters"):
        muon_param_groups(list(model.parameters()))
    for steps in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=f"ns_steps={steps!r} must be an int >= 1"):
            Muon(model.blocks[0].qkv.parameters(), ns_steps=steps)
    groups = muon_param_groups(model)
    assert MuonWithAuxAdamW(iter(groups)).param_groups[0]["use_muon"] is True  # an iterator of groups still works
