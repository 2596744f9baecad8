"""Errors named by the spec, so users can grep for them and catch them by type."""


class RaggedShardBoundaryViolation(ValueError):
    """A shard boundary would cut a structure (row, block, matrix) that must stay whole."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"RaggedShard boundary violation: {detail}")


class DBufferAlignmentError(ValueError):
    """A DBuffer cannot be laid out with the requested alignment or size."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"DBuffer alignment error: {detail}")
