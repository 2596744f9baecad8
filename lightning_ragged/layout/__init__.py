"""Layout: tensor specs, the structure-aware planner, granularity policies and RaggedShard. Pure: no torch.distributed."""
