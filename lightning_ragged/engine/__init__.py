"""The engine: fully_shard, FSDPModule, grouping, DBuffers, the per-group unit and the step scheduler."""
