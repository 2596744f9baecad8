"""The fp16 scaler's state crosses strategies in a checkpoint, as between Lightning's own strategies.

Lightning files a precision plugin's state under the plugin's class name and restores only that name:
ours (``RaggedMixedPrecision``) also writes and reads Lightning's ``MixedPrecision`` key, so a consolidated
checkpoint resumed under DDP, or a DDP checkpoint resumed under ``ragged_fsdp``, keeps the loss scale (before:
silently back to the initial scale, 16384 instead of the saved 32768).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

from lightning_ragged.lightning.precision import RaggedMixedPrecision


def _plugin(cls: type, scale: float, tracker: int = 0) -> MixedPrecision:
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    scaler._growth_tracker.fill_(tracker)
    return cls("16-mixed", "cpu", scaler=scaler)


def _saved(plugin: MixedPrecision) -> dict:
    """What Lightning's checkpoint connector writes for a precision plugin (``dump_checkpoint``)."""
    checkpoint: dict = {"state_dict": {}}
    state = plugin.state_dict()
    if state:
        checkpoint[type(plugin).__qualname__] = state
    plugin.on_save_checkpoint(checkpoint)
    return checkpoint


def _restored(plugin: MixedPrecision, checkpoint: dict) -> dict:
    """Lightning's own restore (``restore_precision_plugin_state``) into ``plugin``; its scaler's state after."""
    connector = _CheckpointConnector(SimpleNamespace(precision_plugin=plugin))
    connector._loaded_checkpoint = checkpoint
    connector.restore_precision_plugin_state()
    return plugin.state_dict()


def test_our_scaler_state_resumes_under_lightnings_mixed_precision() -> None:
    saved = _saved(_plugin(RaggedMixedPrecision, 32768.0, tracker=1))
    state = _restored(_plugin(MixedPrecision, 16384.0), saved)
    assert state["scale"] == 32768.0 and state["_growth_tracker"] == 1, state


def test_a_ddp_scaler_state_resumes_under_ours() -> None:
    saved = _saved(_plugin(MixedPrecision, 32768.0, tracker=1))
    state = _restored(_plugin(RaggedMixedPrecision, 16384.0), saved)
    assert state["scale"] == 32768.0 and state["_growth_tracker"] == 1, state


def test_our_own_key_wins_over_the_alias() -> None:
    saved = _saved(_plugin(RaggedMixedPrecision, 32768.0))
    saved["MixedPrecision"] = {**saved["MixedPrecision"], "scale": 2.0}  # an alias edited by hand: ours is loaded
    assert _restored(_plugin(RaggedMixedPrecision, 16384.0), saved)["scale"] == 32768.0
