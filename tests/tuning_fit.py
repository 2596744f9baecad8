"""2-process CPU fits for ``tests/test_tuning.py`` (``tests/metrics_fits.py`` runs them, in one start-up):

1. ``dbuffer_size=SMALL`` (every block split into several DBuffers) with the metrics
   callback: it logs the recommendation and writes ``ragged_fsdp_tuning.json`` at fit end;
2. ``dbuffer_size="recommended"`` in that directory: the strategy reads the file;
3. the oracle: ``dbuffer_size=<the file's value>`` passed explicitly.

Rank 0 writes what each fit logged and built (DBuffer labels and segment sizes).
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


import lightning_ragged  # noqa: E402,F401  (registers "ragged_fsdp")
from lightning_ragged import RaggedFSDPStrategy, get_state  # noqa: E402
from lightning_ragged.lightning.callbacks import RaggedFSDPMetrics  # noqa: E402
from lightning_ragged.observability.tuning import TUNING_FILE  # noqa: E402
from tests.lightning_models import LitTinyGPT, cpu_trainer, token_loader  # noqa: E402

warnings.filterwarnings("ignore")
STEPS, LOG_EVERY, BATCH = 4, 2, 4
SMALL = max(p.numel() * p.element_size() for p in LitTinyGPT().parameters())
"""The largest parameter's bytes: a dbuffer_size that splits the blocks into several DBuffers."""


def fit(directory: str, dbuffer_size) -> dict:
    callback = RaggedFSDPMetrics(log_every_n_steps=LOG_EVERY, memory_budget_bytes=2**40)
    strategy = RaggedFSDPStrategy(dbuffer_size=dbuffer_size)
    trainer = cpu_trainer(strategy, 2, STEPS, callbacks=[callback], default_root_dir=directory,
                          enable_checkpointing=False)
    model = LitTinyGPT()
    trainer.fit(model, token_loader(STEPS * 2 * BATCH, BATCH))
    layout = [(label, dbuffer.layout.segment_size) for label, dbuffer in _labelled(model)]
    recommendation = callback.recommendation
    return {
        "applied_dbuffer_size": strategy.applied_dbuffer_size,
        "layout": layout,
        "logged": {k: v for k, v in callback.last_logged.items() if "recommended" in k or "hidden" in k},
        "recommendation": None if recommendation is None else recommendation.__dict__,
        "rank": trainer.global_rank,
    }


def _labelled(model):
    for group in get_state(model).all_groups:
        for index, dbuffer in enumerate(group.dbuffers):
            yield f"{group.name}#{index}", dbuffer


def main(out: Path) -> None:
    first, second = (str(out.parent / f"tuning{i}") for i in range(2))  # the same on every rank
    results = {"small": SMALL, "measured": fit(first, SMALL)}
    file = Path(first) / TUNING_FILE
    for _ in range(600):  # rank 0 writes it at its fit end, maybe after rank 1 got here
        if file.is_file():
            break
        time.sleep(0.1)
    written = json.loads(file.read_text())
    results["file"] = written
    results["recommended"] = fit(first, "recommended")
    results["explicit"] = fit(second, written["dbuffer_size"])
    if results["measured"]["rank"] == 0:
        out.write_text(json.dumps(results))

