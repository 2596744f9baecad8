"""The auto-planner (``lightning_ragged.layout.auto``): within the budget, never worse than one block per group.

Oracles: the plan report's own path (``cli.plan.plan_model``: the engine's DBuffer split and
granularity, then ``memory_estimate``) for the three presets, and an exhaustive search over
every replicate degree and grouping written here for random small models.
"""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lightning_ragged as lr
from lightning_ragged.layout.auto import AutoPlan, GroupKind, auto_plan
from lightning_ragged.layout.granularity import resolve_granularity
from lightning_ragged.layout.memory import memory_estimate, parse_bytes

BUDGET = 80 * 10**9
WORLDS = (1024, 10_000)


def expert_rows(rows_per_block: int):
    """``rows_per_block`` rows whole; a row of a fused expert tensor [E, a, b] is b elements (one expert's row)."""

    def granularity(name: str, param: torch.Tensor) -> int:
        row = param.shape[-1] if param.dim() > 1 else 1
        return math.gcd(rows_per_block, param.numel() // row) * row

    return granularity


POLICIES = {"row": "row", "1x rows": expert_rows(1), "16x rows": expert_rows(16)}


@pytest.fixture(scope="module")
def presets():
    from lightning_ragged.cli.model_groups import PRESETS, describe_model

    return {name: describe_model(config, name) for name, config in PRESETS.items()}


def _cli_groups(description, shard_world, policy, dbuffer_size=None):
    from lightning_ragged.cli.plan import plan_model

    return plan_model(description, shard_world, policy, alignment=16, dbuffer_size=dbuffer_size)


def _padding(groups, shard_world):
    numel = sum(g["count"] * b["numel"] for g in groups for b in g["dbuffers"])
    padded = sum(g["count"] * b["segment_size"] * shard_world for g in groups for b in g["dbuffers"])
    return (padded - numel) / numel


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("preset", ["llama3-70b", "deepseek-v3", "gpt-oss-120b"])
def test_presets_fit_the_budget_and_never_pad_more_than_one_block_per_group(presets, preset, world, policy):
    from lightning_ragged.cli.model_groups import ModelDescription

    description, granularity = presets[preset], POLICIES[policy]
    baseline = _cli_groups(description, world, granularity)
    baseline_memory = memory_estimate(baseline, world, 4, 2, "adamw")["total"]
    try:
        chosen = auto_plan(description, world, granularity, BUDGET, alignment=16)
    except ValueError as error:
        assert "memory_budget_bytes" in str(error)
        # Not even one block per group fits at any replicate degree (the cheapest groups there are).
        for replicate in (r for r in range(1, world + 1) if world % r == 0):
            groups = _cli_groups(description, world // replicate, granularity)
            assert memory_estimate(groups, world // replicate, 4, 2, "adamw")["total"] > BUDGET
        return
    assert chosen.memory["total"] <= BUDGET
    if baseline_memory <= BUDGET:
        assert chosen.padding_ratio <= _padding(baseline, world) + 1e-12
    # The plan report, given the same choice, plans the same segments and estimates the same memory.
    merged = ModelDescription(preset, chosen.group_kinds())
    report = _cli_groups(merged, chosen.shard_world_size, granularity, chosen.dbuffer_size)
    assert [tuple(b["segment_size"] for b in g["dbuffers"]) for g in report] == [g.segment_sizes for g in chosen.groups]
    assert memory_estimate(report, chosen.shard_world_size, 4, 2, "adamw") == chosen.memory
    assert _padding(report, chosen.shard_world_size) == pytest.approx(chosen.padding_ratio, abs=1e-12)
    assert sum(g.count * g.blocks for g in chosen.groups if g.kind != "root") == sum(
        k.count for k in description.groups if k.name != "root"
    )


def test_merged_groups_are_consecutive_blocks_in_module_order(presets):
    chosen = auto_plan(presets["llama3-70b"], 10_000, expert_rows(16), BUDGET, alignment=16)
    blocks = [name for members in chosen.block_groups() for name in members]
    assert blocks == [f"model.layers.{i}" for i in range(80)]
    assert all(len(members) > 1 for members in chosen.block_groups())
    assert chosen.padding_ratio <= 0.03 < chosen.baseline["padding_ratio"]


# ----------------------------------------------------------------------------------- random models
def _specs(kind, policy, block_rows, copies):
    """The runs of ``copies`` consecutive copies of ``kind`` (each copy has one run here, so runs stay apart)."""
    def spec(copy, name, shape):
        granularity = resolve_granularity(policy, name, torch.empty(shape, device="meta"), block_rows)
        return lr.TensorSpec(f"{copy}.{name}", math.prod(shape), granularity)

    if len(kind.runs) == 1:
        return [[spec(c, n, s) for c in range(copies) for n, s in kind.runs[0]]]
    assert copies == 1, "only the root has several runs, and it is never merged"
    return [[spec(0, n, s) for n, s in run] for run in kind.runs]


def _exhaustive(kinds, world, policy, block_rows, alignment, optimizer, target):
    """Every replicate degree and every number of balanced groups per kind, planned exactly: (key, padded) each."""
    total = sum(k.count * sum(math.prod(s) for _, s in k.shapes) for k in kinds)
    results = []
    for replicate in (r for r in range(1, world + 1) if world % r == 0):
        shard = world // replicate
        for counts in itertools.product(*[range(1, k.count + 1) if k.name != "root" else [1] for k in kinds]):
            groups = []
            for kind, m in zip(kinds, counts):
                small, larger = divmod(kind.count, m)
                for blocks, count in ((small + 1, larger), (small, m - larger)):
                    if count:
                        runs = _specs(kind, policy, block_rows, blocks)
                        segments = [lr.plan(run, shard, alignment=alignment).segment_size for run in runs]
                        groups.append(dict(count=count, dbuffers=[dict(segment_size=s) for s in segments]))
            memory = memory_estimate(groups, shard, 4, 2, optimizer)["total"]
            padded = sum(g["count"] * b["segment_size"] * shard for g in groups for b in g["dbuffers"])
            padding = (padded - total) / total
            key = (padding > target, padding if padding > target else 0.0, memory)
            results.append((replicate, counts, key, padded, memory))
    return results


shape = st.one_of(st.tuples(st.integers(1, 24)), st.tuples(st.integers(1, 12), st.integers(1, 12)))
block = st.lists(shape, min_size=1, max_size=3)


@st.composite
def models(draw):
    kinds = [
        GroupKind(f"stack{i}", draw(st.integers(1, 4)), [[(f"w{j}", s) for j, s in enumerate(draw(block))]])
        for i in range(draw(st.integers(1, 2)))
    ]
    root_runs = [[(f"r{i}.{j}", s) for j, s in enumerate(draw(block))] for i in range(draw(st.integers(1, 2)))]
    return kinds + [GroupKind("root", 1, root_runs)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kinds=models(),
    world=st.sampled_from([1, 2, 3, 4, 6, 8, 12]),
    policy=st.sampled_from(["element", "row", "block", "matrix"]),
    block_rows=st.integers(1, 4),
    alignment=st.sampled_from([1, 2, 4]),
    optimizer=st.sampled_from(["adamw", "none"]),
    scale=st.floats(0.7, 4.0),
    target=st.sampled_from([0.0, 0.03, 0.5]),
)
def test_random_models_match_an_exhaustive_search(kinds, world, policy, block_rows, alignment, optimizer, scale,
                                                  target):
    everything = _exhaustive(kinds, world, policy, block_rows, alignment, optimizer, target)
    one_block = tuple(k.count for k in kinds)
    baseline = next(r for r in everything if r[0] == 1 and r[1] == one_block)
    budget = max(1, int(baseline[4] * scale))
    fitting = [r for r in everything if r[4] <= budget]
    if baseline[4] <= budget:
        fitting = [r for r in fitting if r[3] <= baseline[3]]
    kwargs = dict(block_rows=block_rows, alignment=alignment, optimizer=optimizer, padding_target=target)
    if not fitting:
        with pytest.raises(ValueError, match="memory_budget_bytes"):
            auto_plan(kinds, world, policy, budget, **kwargs)
        return
    chosen = auto_plan(kinds, world, policy, budget, **kwargs)
    assert chosen.memory["total"] <= budget
    counts = tuple(sum(g.count for g in chosen.groups if g.kind == k.name) for k in kinds)
    same = next(r for r in everything if r[:2] == (chosen.replicate_degree, counts))
    assert same[4] == chosen.memory["total"]  # the same choice, planned here, costs the same
    assert sum(g.count * (sum(g.segment_sizes) * g.shard_world) for g in chosen.groups) == same[3]
    best = min(r[2] for r in fitting)
    over = chosen.padding_ratio > target
    assert (over, chosen.padding_ratio if over else 0.0, chosen.memory["total"]) == pytest.approx(best, rel=1e-12)
    if baseline[4] <= budget:
        assert chosen.baseline["fits"]
        numel = sum(k.count * sum(math.prod(s) for _, s in k.shapes) for k in kinds)
        assert chosen.padding_ratio <= (baseline[3] - numel) / numel + 1e-12


def test_kinds_whose_copies_are_not_consecutive_stay_one_per_group():
    interleaved = GroupKind("layers", 2, [[("w", (64, 8))]], members=["layers.0", "layers.2"])
    other = GroupKind("layers odd", 2, [[("v", (8,))]], members=["layers.1", "layers.3"])
    root = GroupKind("root", 1, [[("embed", (100, 8))]])
    chosen = auto_plan([interleaved, other, root], 48, "row", 10**9, padding_target=0.0)
    assert [g.blocks for g in chosen.groups] == [1, 1, 1]
    assert "not consecutive" in chosen.groups[0].why


# ----------------------------------------------------------------------------------- inputs and the CLI
@pytest.mark.parametrize(
    "value, expected", [("80GB", 80 * 10**9), ("80GiB", 80 * 2**30), ("1.5e3", 1500), (4096, 4096), ("512 mib", 2**29),
                        ("4.1GB", 4_100_000_000), ("70.3GiB", 75_484_050_227)]  # exact (floats refused 4.1GB), rounded down
)
def test_parse_bytes(value, expected):
    assert parse_bytes(value) == expected


@pytest.mark.parametrize("value", ["80XB", "", "-1GB", 0, True, "GB", "1.5", 1.5, "-1"])  # 1.5 bytes was taken as 1
def test_parse_bytes_refuses_what_is_not_a_size(value):
    with pytest.raises(ValueError, match="memory_budget_bytes="):
        parse_bytes(value)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(world_size=0), "world_size=0"),
        (dict(memory_budget_bytes=0), "memory_budget_bytes=0"),
        (dict(replicate_degree=5), "replicate_degree=5 must be a positive int dividing world_size=8"),
        (dict(padding_target=-0.1), "padding_target=-0.1"),
        (dict(optimizer="lion"), "optimizer='lion'"),
        (dict(granularity="diagonal"), "shard_granularity='diagonal'"),
        (dict(groups=[]), "groups="),
    ],
)
def test_auto_plan_refuses_bad_arguments(kwargs, match):
    arguments = dict(groups=[GroupKind("root", 1, [[("w", (4, 4))]])], world_size=8, memory_budget_bytes=10**9)
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=match):
        auto_plan(**arguments)


def test_plan_cli_auto_json_and_table(capsys):
    from lightning_ragged.cli.plan import main

    argv = ["--config", "gpt-oss-120b", "--world-size", "10000", "--auto", "--memory-budget", "80GB"]
    assert main(argv + ["--json", "--alignment", "16"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "gpt-oss-120b" and report["memory_budget_bytes"] == 80 * 10**9
    assert report["memory"]["total"] <= 80 * 10**9
    assert report["world_size"] == report["replicate_degree"] * report["shard_world_size"]
    for group in report["groups"]:
        assert {"blocks", "segment_sizes", "padding_ratio", "replicate_degree", "sharded_bytes_per_rank"} <= set(group)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| blocks per group |" in out and "Why:" in out and "dbuffer_size=" in out and "transient peak" in out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--auto"], "--auto needs --memory-budget"),
        (["--memory-budget", "80GB"], "--memory-budget only applies with --auto"),
        (["--auto", "--memory-budget", "80XB"], "--memory-budget='80XB' is not a size"),
        (["--auto", "--memory-budget", "80GB", "--dbuffer-size", "1000"], "--dbuffer-size cannot be combined"),
        (["--auto", "--memory-budget", "1MB"], "too small for every choice"),
    ],
)
def test_plan_cli_auto_refuses_bad_options(extra, message):
    from lightning_ragged.cli.plan import main

    with pytest.raises(SystemExit, match=message):
        main(["--config", "gpt-oss-120b", "--world-size", "64"] + extra)


def test_auto_plan_accepts_a_plain_list_and_reports_its_types():
    kinds = [GroupKind("layers", 4, [[("w", (16, 4))]]), GroupKind("root", 1, [[("e", (10, 4))]])]
    chosen = auto_plan(kinds, 16, "row", 10**9)
    assert isinstance(chosen, AutoPlan) and chosen.dbuffer_size >= 4 * 16 * 4
    json.dumps(chosen.to_dict())


# ----------------------------------------------------------------------------------- the engine as oracle
class _ReductionBytes:
    """At each reduction issued: the bytes of the distinct buffers it keeps alive but this rank's summed segment
    (the gradient buffer and, for a wider reduce dtype, its cast)."""

    def __init__(self) -> None:
        self.largest = 0

    def on_event(self, event) -> None:
        from lightning_ragged.engine.events import EventKind

        if event.kind is EventKind.REDUCE_ISSUED:
            full, own, *rest = event.dbuffer._pending_reduce.keep_alive
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (full, *rest)}
            storages.pop(own.untyped_storage().data_ptr(), None)
            self.largest = max(self.largest, sum(storages.values()))


def _engine_full_bytes(reduce_dtype: torch.dtype | None) -> tuple[int, int, int]:
    """On a rank, in ``fully_shard``'s own buffers: the largest group's full parameter bytes, full gradient
    bytes while ``no_sync`` accumulates, and gradient bytes alive at a reduction (the backend's reduce-scatter)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from tests.models import lm_loss, make_batches, make_model

    model = make_model()
    lr.fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype),
                   reduce_mode="reduce_scatter")
    state = lr.get_state(model)
    reductions = _ReductionBytes()
    for dbuffer in state.dbuffers():
        dbuffer.observers.append(reductions)
    with lr.no_sync(model):  # the full gradient buffers stay allocated, accumulating
        lm_loss(model, make_batches(1, 2)[0]).backward()
    params, grads = [], []
    for group in state.all_groups:
        grads.append(sum(b.unsharded_grad.untyped_storage().nbytes() for b in group.dbuffers))
        group.module.unshard()
        params.append(sum(b.unsharded.untyped_storage().nbytes() for b in group.dbuffers))
        group.module.reshard()
    for group in state.all_groups:
        for dbuffer in group.dbuffers:
            dbuffer.free_unsharded_grad()  # forget the accumulated micro-batch: the next backward lands fresh
    lm_loss(model, make_batches(1, 2)[0]).backward()
    return max(params), max(grads), reductions.largest


@pytest.mark.parametrize("reduce_dtype", [None, torch.float32])
def test_estimate_counts_the_gradient_buffers_as_the_engine_allocates_them(dist_pool, reduce_dtype):
    from lightning_ragged.cli.model_groups import ModelDescription
    from lightning_ragged.cli.plan import plan_model
    from lightning_ragged.engine.api import VIEW_ALIGNMENT_BYTES
    from lightning_ragged.engine.auto_grouping import describe_groups
    from lightning_ragged.engine.grouping import plan_groups
    from tests.models import make_model

    world = 2
    (params, accumulating, reducing), *others = dist_pool(world).run(_engine_full_bytes, reduce_dtype)
    assert all(other == (params, accumulating, reducing) for other in others)
    description = ModelDescription("tiny", describe_groups(plan_groups(make_model(), None, 2**40)))
    groups = plan_model(description, world, alignment=VIEW_ALIGNMENT_BYTES // 2)  # 16 bytes of bf16, as fully_shard
    reduce_bytes = None if reduce_dtype is None else reduce_dtype.itemsize
    memory = memory_estimate(groups, world, 4, 2, "adamw", reduce_bytes)
    assert memory["largest_unsharded_group"] == params
    # computing + prefetched, and the larger of: one gradient buffer accumulating, one at its reduction
    assert memory["transient_peak"] == 2 * params + max(accumulating, reducing)
    assert accumulating == params * (2 if reduce_dtype == torch.float32 else 1)  # no_sync: in the reduce dtype
    # a reduction: the bf16 buffer, plus its fp32 cast for the reduce-scatter when the reduce dtype is fp32
    assert reducing == params * (3 if reduce_dtype == torch.float32 else 1)


def test_plan_cli_reduce_dtype_sizes_the_gradient_buffer(capsys):
    from lightning_ragged.cli.plan import main

    memory = {}
    for dtype in ("bf16", "fp32"):
        assert main(["--config", "llama3-70b", "--world-size", "64", "--json", "--reduce-dtype", dtype]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["reduce_dtype"] == dtype
        memory[dtype] = report["memory"]
    # bf16: 2 bytes an element. A bf16 reduction holds one bf16 gradient buffer; an fp32 one holds the bf16 buffer
    # and its fp32 cast for the reduce-scatter: 4 more bytes an element, twice the largest group's full parameters
    largest = memory["fp32"]["largest_unsharded_group"]
    assert memory["fp32"]["transient_peak"] - memory["bf16"]["transient_peak"] == 2 * largest
    assert main(["--config", "llama3-70b", "--world-size", "64"]) == 0  # the default is fp32, as precision="bf16-mixed"
    assert "reduce fp32" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--dbuffer-size", "0"], r"--dbuffer-size='0' must be a positive whole number of bytes"),  # was taken as "none"
        (["--dbuffer-size", "10XB"], r"--dbuffer-size='10XB' is not a size"),
        (["--plot", "/nonexistent/padding.png"], r"--plot '/nonexistent/padding.png': the folder '/nonexistent' does"),
    ],
)
def test_plan_cli_refuses_bad_options(extra, message):
    from lightning_ragged.cli.plan import main

    with pytest.raises(SystemExit, match=message):
        main(["--config", "gpt-oss-120b", "--world-size", "64"] + extra)


@pytest.mark.parametrize("text, message", [
    ("{bad", "is not a readable JSON file"), ("[1, 2]", "holds a JSON list"),
    # before: transformers' 13-frame traceback (StrictDataclassClassValidationError)
    ('{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 5, "num_hidden_layers": 2, '
     '"intermediate_size": 128, "vocab_size": 100}',
     r"--config '.*': transformers refuses this llama config: .*not a multiple of the number of attention heads"),
])
def test_plan_cli_names_a_config_file_it_cannot_read(tmp_path, text, message):
    # Before: json's traceback, or AttributeError: 'list' object has no attribute 'get'
    from lightning_ragged.cli.plan import main

    (tmp_path / "config.json").write_text(text)
    with pytest.raises(SystemExit, match=message):
        main(["--config", str(tmp_path), "--world-size", "2"])


def test_plan_cli_dbuffer_size_takes_units():
    from lightning_ragged.cli.plan import build_report, check_args, parser

    reports = []
    for size in ("5000000000", "5GB"):  # 5GB = 5 * 10**9 bytes, as --memory-budget counts
        args = parser().parse_args(["--config", "llama3-70b", "--world-size", "64", "--dbuffer-size", size])
        check_args(args)
        assert args.dbuffer_size == 5_000_000_000
        report = build_report(args)
        reports.append([[{k: v for k, v in d.items() if "seconds" not in k} for d in g["dbuffers"]]
                        for g in report["groups"]])
    assert reports[0] == reports[1]


def _engine_segments(policy):
    from tests.hf_models import make_llama

    model = make_llama()
    lr.fully_shard(model, shard_granularity=policy)
    return {group.name: [d.layout.segment_size for d in group.dbuffers] for group in lr.get_state(model).all_groups}


def test_plan_report_resolves_name_rules_as_the_engine_does(dist_pool):
    # Before: the report (and the auto-planner) resolved "muon" on names relative to the group, so the
    # embedding group's 'weight' was kept whole (S 4,096, 100% padding at W=2) where the engine cuts
    # 'model.embed_tokens.weight' into rows (S 2,048)
    from lightning_ragged.cli.model_groups import ModelDescription
    from lightning_ragged.cli.plan import plan_model
    from lightning_ragged.engine.api import VIEW_ALIGNMENT_BYTES
    from lightning_ragged.engine.auto_grouping import describe_groups
    from lightning_ragged.engine.grouping import plan_groups
    from tests.hf_models import make_llama

    world = 2
    engine, *others = dist_pool(world).run(_engine_segments, "muon")
    assert all(other == engine for other in others)
    description = ModelDescription("llama", describe_groups(plan_groups(make_llama(), None, 2**40)))
    groups = plan_model(description, world, "muon", alignment=VIEW_ALIGNMENT_BYTES // 4)  # fp32, as fully_shard
    report = {member: [b["segment_size"] for b in group["dbuffers"]]
              for group, kind in zip(groups, description.groups) for member in kind.members}
    assert report == engine
    assert engine["model.embed_tokens"] == [128 * 32 // world]  # rows: the name rule saw the full name
    split = plan_model(description, world, "muon", dbuffer_size=1000)  # the embedding (16,384 bytes): its own DBuffer
    (embed,) = [g for g, kind in zip(split, description.groups) if "model.embed_tokens" in kind.members]
    assert [b["tensors"] for b in embed["dbuffers"]] == [1]
