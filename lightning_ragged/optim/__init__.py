"""Structure-aware optimizers on ragged shards: Muon, Shampoo, SOAP and block-wise 8-bit AdamW.

See docs/optimizers.md for the granularity each one needs and a Lightning example.
"""

from lightning_ragged.optim.adamw8bit import AdamW8bit, block_granularity
from lightning_ragged.optim.eigh import EigendecompositionError
from lightning_ragged.optim.muon import Muon, ns_flops, split_muon_params
from lightning_ragged.optim.muon_adamw import MuonWithAuxAdamW, muon_param_groups
from lightning_ragged.optim.named_state import RaggedOptimizer
from lightning_ragged.optim.owners import OwnerPlan
from lightning_ragged.optim.shampoo import Shampoo
from lightning_ragged.optim.soap import SOAP

__all__ = [
    "AdamW8bit",
    "EigendecompositionError",
    "Muon",
    "MuonWithAuxAdamW",
    "OwnerPlan",
    "RaggedOptimizer",
    "SOAP",
    "Shampoo",
    "block_granularity",
    "muon_param_groups",
    "ns_flops",
    "split_muon_params",
]
