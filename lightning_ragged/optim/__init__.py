"""Structure-aware optimizers on ragged shards: Muon, Shampoo and block-wise 8-bit AdamW.

See docs/optimizers.md for the granularity each one needs and a Lightning example.
"""

from lightning_ragged.optim.adamw8bit import AdamW8bit, block_granularity
from lightning_ragged.optim.muon import Muon, MuonPlan, ns_flops, split_muon_params
from lightning_ragged.optim.muon_adamw import MuonWithAuxAdamW, muon_param_groups
from lightning_ragged.optim.named_state import RaggedOptimizer
from lightning_ragged.optim.shampoo import Shampoo

__all__ = [
    "AdamW8bit",
    "Muon",
    "MuonPlan",
    "MuonWithAuxAdamW",
    "RaggedOptimizer",
    "Shampoo",
    "block_granularity",
    "muon_param_groups",
    "ns_flops",
    "split_muon_params",
]
