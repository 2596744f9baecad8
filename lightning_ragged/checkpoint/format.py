"""The on-disk format of a checkpoint: its file names, top-level keys and version.

A checkpoint is a directory that ``torch.distributed.checkpoint`` (DCP) and Lightning
both recognise::

    ckpt/                 the final name appears only once the save is complete
      .metadata           DCP: every tensor's global shape and the chunks each rank wrote
      __0_0.distcp ...    DCP: one file per rank, only that rank's shards
      meta.pt             Lightning's non-tensor parts (loops, callbacks, schedulers, hparams)
                          plus {"ragged_checkpoint": {"format_version": ...}}; written last
      checksums.json      a CRC-32 of every item and file (``checksums.py``)

The model lives under ``"model"`` and optimizer ``i`` under ``"optimizer_{i}"`` (the
layout Lightning's ``consolidate_checkpoint`` expects). A second state of the same model
(``WeightAveraging`` keeps the average under ``"state_dict"`` and the trained weights under
``"current_model_state"``) goes to DCP under its own key (``MODEL_STATE_KEYS``), named in
the format record's ``"model_states"``. Each parameter's ragged flat range
is written as at most 2·ndim − 1 N-D boxes (``dcp.py``), so a checkpoint loads at any
world size, granularity or planner. ``state_dict_type="full"`` writes one ordinary
``torch.save`` file instead (``consolidation.py``).
"""

from __future__ import annotations

FORMAT_VERSION = 1
"""Bumped when the layout of a checkpoint changes in a way older readers cannot follow."""

FORMAT_KEY = "ragged_checkpoint"
"""The key of meta.pt (and of a single file) holding the format record."""
META_FILENAME = "meta.pt"  # Lightning's `_METADATA_FILENAME`: its consolidation merges this file
MODEL_KEY = "model"
MODEL_STATE_KEYS = ("current_model_state",)
"""Top-level checkpoint keys holding another state of the model (sharded: written by DCP, not to meta.pt)."""
USER_KEYS = "fabric_state"
"""meta.pt's record of a ``fabric.save`` state's own keys: ``{"module": key, "optimizers": [key, ...]}`` (optimizer
``i`` is the i-th); a single file made from such a checkpoint keeps those keys, as Fabric's own files do."""
MODEL_STATES_KEY = "model_states"
"""The format record's list of the extra top-level keys holding a model state in DCP."""
