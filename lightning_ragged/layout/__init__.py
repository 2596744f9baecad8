"""Layout: tensor specs, the structure-aware planner, granularity policies and RaggedShard.

Pure: no torch.distributed. ``spec`` (TensorSpec, Layout), ``packing`` (earliest offsets, lower
bound), ``search`` (the algorithms), ``planner`` (``plan``), ``granularity``, ``ragged_shard``, ``errors``.
"""
