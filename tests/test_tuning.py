"""dbuffer_size recommended from monitoring data (issue 13, item 3): the rules, the file, the strategy.

The rules run on synthetic numbers (one test per branch, with its reason); the file makes a
round trip; ``RaggedFSDPStrategy(dbuffer_size="recommended")`` reads it at setup, unit-level
and in a 2-process ``Trainer.fit`` (``tests/tuning_fit.py``) whose layout must equal a fit
given the same value explicitly.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_ragged.engine.api import DEFAULT_DBUFFER_SIZE
from lightning_ragged.observability.metrics import PREFIX
from lightning_ragged.observability.tuning import (
    ROUND_BYTES,
    TUNING_FILE,
    GroupSize,
    Recommendation,
    TuningInput,
    read_recommendation,
    recommend,
    tuning_input,
    write_recommendation,
)

MiB, GiB = 2**20, 2**30

BLOCK = GroupSize("layers.0", (100 * MiB, 100 * MiB, 40 * MiB), unsharded_bytes=240 * MiB, largest_param_bytes=30 * MiB)
WHOLE = GroupSize("layers.1", (90 * MiB,), unsharded_bytes=90 * MiB, largest_param_bytes=30 * MiB)


def _input(**changes) -> TuningInput:
    base = TuningInput(
        all_gather_seconds=0.10, blocked_seconds=0.05, comm_hidden_ratio=0.5,
        unsharded_peak_bytes=480 * MiB, grad_peak_bytes=240 * MiB,
        memory_peak_bytes=40 * GiB, memory_limit_bytes=80 * GiB,
        dbuffer_size=100 * MiB, groups=(BLOCK, WHOLE), max_inflight_all_gathers=1,
    )
    return replace(base, **changes)


# ------------------------------------------------------------------- the rules, one branch each
def test_exposed_with_headroom_and_split_groups_grows_to_the_largest_split_group() -> None:
    found = recommend(_input())
    assert found.action == "grow"
    assert found.dbuffer_size == 240 * MiB  # layers.0 is 240 MiB in 3 DBuffers (already a multiple of 4 KiB)
    assert found.max_inflight_all_gathers == 1
    assert "comm_hidden_ratio 0.50 < 0.9" in found.reason
    assert "splits 1 group(s) into 3 DBuffers" in found.reason and "fewer, larger all-gathers" in found.reason


def test_grow_rounds_up_to_whole_pages() -> None:
    odd = GroupSize("odd", (5000, 5000), unsharded_bytes=10_000, largest_param_bytes=5000)
    found = recommend(_input(groups=(odd,), dbuffer_size=5000))
    assert found.dbuffer_size == math.ceil(10_000 / ROUND_BYTES) * ROUND_BYTES == 12_288


def test_exposed_with_every_group_whole_prefetches_one_more() -> None:
    found = recommend(_input(dbuffer_size=256 * MiB))  # 240 MiB fits: no group is split by size
    assert (found.action, found.dbuffer_size, found.max_inflight_all_gathers) == ("prefetch_more", 256 * MiB, 2)
    assert "every group is one all-gather already" in found.reason and "240.0 MiB" in found.reason


def test_exposed_without_room_for_one_more_group_keeps() -> None:
    # headroom 8.2 GiB of 80 is above 10 %, but one more 240 MiB group would bring it under
    found = recommend(_input(dbuffer_size=256 * MiB, memory_peak_bytes=80 * GiB - 8.1 * GiB))
    assert (found.action, found.max_inflight_all_gathers) == ("keep", 1)
    assert "would bring memory near the limit" in found.reason


def test_near_the_limit_with_deeper_prefetch_prefetches_one_less() -> None:
    found = recommend(_input(memory_peak_bytes=76 * GiB, max_inflight_all_gathers=3))
    assert (found.action, found.dbuffer_size, found.max_inflight_all_gathers) == ("prefetch_less", 100 * MiB, 2)
    assert "memory near the limit (headroom 4.0 GiB of 80.0 GiB, under 10%)" in found.reason
    assert "frees up to 240.0 MiB ('layers.0')" in found.reason


def test_near_the_limit_halves_dbuffer_size_and_names_groups_that_stay_whole() -> None:
    found = recommend(_input(memory_peak_bytes=76 * GiB))
    assert found.action == "shrink"
    assert found.dbuffer_size == 50 * MiB  # half the largest DBuffer (100 MiB in layers.0)
    found = recommend(_input(memory_peak_bytes=76 * GiB, dbuffer_size=256 * MiB))
    assert found.dbuffer_size == 50 * MiB
    assert "dbuffer_size 256.0 MiB -> 50.0 MiB" in found.reason
    assert "2 group(s) such as 'layers.0' (240.0 MiB) are only split" in found.reason
    assert "group_modules" in found.reason


def test_near_the_limit_halves_below_the_largest_parameter() -> None:
    """A parameter larger than dbuffer_size gets a DBuffer of its own (it was refused, so the rule stopped at the
    largest parameter: with Llama-3-8B's 2 GiB embedding and the 256 MiB default it could never shrink)."""
    big = GroupSize("embed", (300 * MiB,), unsharded_bytes=300 * MiB, largest_param_bytes=250 * MiB)
    found = recommend(_input(groups=(big,), dbuffer_size=512 * MiB, memory_peak_bytes=79 * GiB))
    assert (found.action, found.dbuffer_size) == ("shrink", 150 * MiB)
    assert "the largest: 250.0 MiB) keeps a DBuffer of its own" in found.reason
    found = recommend(_input(groups=(big,), dbuffer_size=ROUND_BYTES, memory_peak_bytes=79 * GiB))
    assert found.action == "keep" and "is as small as it goes" in found.reason


def test_memory_comes_before_exposure() -> None:
    assert recommend(_input(comm_hidden_ratio=0.0, memory_peak_bytes=79 * GiB)).action == "shrink"


def test_well_hidden_and_comfortable_keeps() -> None:
    found = recommend(_input(comm_hidden_ratio=0.95, blocked_seconds=0.005))
    assert (found.action, found.dbuffer_size, found.max_inflight_all_gathers) == ("keep", 100 * MiB, 1)
    assert "well hidden (comm_hidden_ratio 0.95 >= 0.9)" in found.reason


def test_nothing_measured_keeps() -> None:
    assert recommend(_input(all_gather_seconds=0.0)).action == "keep"
    assert recommend(_input(groups=())).reason == "no DBuffers to size"


def test_tuning_input_reads_the_metrics_keys() -> None:
    values = {PREFIX + k: v for k, v in {
        "all_gather_seconds": 0.2, "comm_blocked_seconds": 0.1, "comm_hidden_ratio": 0.6,
        "dbuffer_unsharded_peak_bytes": 10.0, "dbuffer_grad_peak_bytes": 5.0,
    }.items()}
    built = tuning_input(values, [BLOCK], 64 * MiB, (1.0, 2.0), 2)
    assert built == TuningInput(0.2, 0.1, 0.6, 10.0, 5.0, 1.0, 2.0, 64 * MiB, (BLOCK,), 2)
    assert built.headroom_bytes == 1.0


# ------------------------------------------------------------------- the file
def test_file_round_trip_and_refusals(tmp_path) -> None:
    assert read_recommendation(tmp_path) is None
    written = Recommendation(64 * MiB, 2, "grow", "because")
    path = write_recommendation(tmp_path / "run", written, step=50)
    assert path == tmp_path / "run" / TUNING_FILE
    assert json.loads(path.read_text())["step"] == 50
    assert read_recommendation(tmp_path / "run") == written
    path.write_text("{not json")
    with pytest.raises(ValueError, match=f"{TUNING_FILE} is not a tuning file.*delete"):
        read_recommendation(tmp_path / "run")
    path.write_text(json.dumps({"version": 1, "dbuffer_size": -5, "max_inflight_all_gathers": 1,
                                "action": "keep", "reason": ""}))
    with pytest.raises(ValueError, match="dbuffer_size -5 .*a positive int.*dbuffer_size=<bytes>"):
        read_recommendation(tmp_path / "run")


# ------------------------------------------------------------------- the strategy
def test_strategy_resolves_recommended_at_setup(tmp_path) -> None:
    from lightning_ragged import RaggedFSDPStrategy

    strategy = RaggedFSDPStrategy(dbuffer_size="recommended")
    assert strategy.dbuffer_size == "recommended" and strategy.applied_dbuffer_size is None
    assert RaggedFSDPStrategy(dbuffer_size=MiB).applied_dbuffer_size == MiB
    strategy._lightning_module = SimpleNamespace(_trainer=SimpleNamespace(default_root_dir=str(tmp_path)))
    with pytest.warns(UserWarning, match=f"no .*{TUNING_FILE} yet.*using the default {DEFAULT_DBUFFER_SIZE}"):
        strategy._apply_recommendation()
    assert strategy.applied_dbuffer_size == DEFAULT_DBUFFER_SIZE
    write_recommendation(tmp_path, Recommendation(12 * MiB, 2, "prefetch_more", "why"), step=3)
    strategy._apply_recommendation()
    assert strategy.applied_dbuffer_size == 12 * MiB
    assert strategy._engine_kwargs["max_inflight_all_gathers"] == 2  # the prefetch advice applies too
    given = RaggedFSDPStrategy(dbuffer_size="recommended", max_inflight_all_gathers=0)
    given._lightning_module = strategy._lightning_module
    given._apply_recommendation()
    assert given._engine_kwargs["max_inflight_all_gathers"] == 0  # ... unless the user chose it
    (tmp_path / TUNING_FILE).write_text("[]")
    with pytest.raises(ValueError, match="is not a tuning file"):
        strategy._apply_recommendation()


@pytest.fixture(scope="module")
def fits(metrics_fits) -> dict:
    """Three 2-process fits (``tests/metrics_fits.py``): measured, recommended, explicit oracle."""
    return json.loads((metrics_fits / "tuning.json").read_text())


def test_callback_logs_and_writes_the_recommendation(fits) -> None:
    measured, file = fits["measured"], fits["file"]
    assert measured["applied_dbuffer_size"] == fits["small"]
    assert file["dbuffer_size"] == measured["recommendation"]["dbuffer_size"]
    assert file["step"] == 4 and file["reason"] == measured["recommendation"]["reason"]
    assert measured["logged"][PREFIX + "recommended_dbuffer_size"] == file["dbuffer_size"]
    # gloo blocks in every collective, so communication is exposed; memory is far from 1 TiB:
    # the rule that applies is "grow" to the largest group split by dbuffer_size (oracle: the model's sizes)
    from tests.lightning_models import LitTinyGPT

    model = LitTinyGPT()
    block = sum(p.numel() * p.element_size() for p in model.model.blocks[0].parameters())
    root = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".blocks." not in n)
    assert file["action"] == "grow"
    assert file["dbuffer_size"] == math.ceil(max(block, root) / ROUND_BYTES) * ROUND_BYTES


def test_recommended_is_applied_at_the_next_start(fits) -> None:
    recommended, explicit = fits["recommended"], fits["explicit"]
    assert recommended["applied_dbuffer_size"] == fits["file"]["dbuffer_size"]
    assert recommended["layout"] == explicit["layout"]  # the same DBuffers as passing the value by hand
    assert recommended["layout"] != fits["measured"]["layout"]
    blocks = [label for label, _ in recommended["layout"] if ".blocks." in label]
    assert blocks == ["model.blocks.0#0", "model.blocks.1#0"]  # one all-gather per block now
