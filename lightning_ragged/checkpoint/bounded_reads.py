"""Decompressed checkpoint items bounded by what they can hold (no decompression bombs).

DCP's reader inflates a compressed item (``_StorageInfo.transform_descriptors``, e.g.
``stream.zstd``) with ``read(-1)``: a 131 KB Zstandard frame can claim 4 GiB, and it is all
taken into memory before anything looks at it. Untrusted, each compressed item is read here
through a stream that refuses to produce more than the item can hold: a tensor chunk, twice
its bytes (the chunk's elements times the dtype's size) plus 1 MiB of ``torch.save`` framing;
a pickled object, ``BYTES_RATIO`` times its compressed size or ``BYTES_FLOOR``, whichever is
more. Uncompressed items need no bound: their length is checked against the file.
"""

from __future__ import annotations

import io
import math
from typing import IO, Any, Sequence

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

BYTES_FLOOR = 64 << 20
BYTES_RATIO = 64
_FRAMING = 1 << 20
_BLOCK = 1 << 20


class InflationError(ValueError):
    """A compressed item produced more bytes than it can hold."""


class BoundedTransforms:
    """Wraps a ``FileSystemReader``'s ``transforms``: compressed items come out through ``_BoundedStream``."""

    def __init__(self, inner: Any, storage_data: dict[Any, Any], metadata: Metadata) -> None:
        self.inner = inner
        self.storage_data = storage_data
        self.metadata = metadata

    def transform_load_stream(self, read_item: ReadItem, descriptors: Sequence[str], raw_stream: IO[bytes]) -> IO[bytes]:
        stream = self.inner.transform_load_stream(read_item, descriptors, raw_stream)
        if not descriptors:
            return stream
        limit, why = self._limit(read_item)
        return _BoundedStream(stream, limit, f"item {read_item.storage_index.fqn!r} ({why})")

    def _limit(self, read_item: ReadItem) -> tuple[int, str]:
        index = read_item.storage_index
        if read_item.type == LoadItemType.BYTE_IO:
            compressed = self.storage_data[index].length
            return max(BYTES_FLOOR, BYTES_RATIO * compressed), f"a pickled object of {compressed} compressed bytes"
        item = self.metadata.state_dict_metadata[index.fqn]
        assert isinstance(item, TensorStorageMetadata)
        (chunk,) = [c for c in item.chunks if tuple(c.offsets) == tuple(index.offset)]
        nbytes = math.prod(chunk.sizes) * item.properties.dtype.itemsize
        return 2 * nbytes + _FRAMING, f"a tensor chunk of {nbytes} bytes"


class _BoundedStream(io.RawIOBase):
    """Reads ``inner`` and raises ``InflationError`` once it has produced more than ``limit`` bytes."""

    def __init__(self, inner: IO[bytes], limit: int, what: str) -> None:
        super().__init__()
        self.inner = inner
        self.limit = limit
        self.what = what
        self.count = 0

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            blocks = []
            while block := self.read(_BLOCK):
                blocks.append(block)
            return b"".join(blocks)
        data = self.inner.read(size)
        self.count += len(data)
        if self.count > self.limit:
            raise InflationError(
                f"{self.what} decompresses to more than {self.limit} bytes, more than it can hold: refused "
                "(damaged or hostile compressed bytes; a trusted checkpoint is read unbounded)"
            )
        return data
