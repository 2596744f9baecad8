"""Inductor inside a test rank: compiled kernels in the test's tmp dir, compiled in the rank's own process."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch


@contextlib.contextmanager
def inductor_in_process(cache_dir: str) -> Iterator[None]:
    """Compile into ``cache_dir`` with no compile workers (on 2 cores the ranks already use every core,
    and a worker pool per rank only adds processes and their torch imports); dynamo state reset around it."""
    import torch._inductor.config
    from torch._dynamo.utils import counters

    previous_cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    torch._dynamo.reset()
    counters.clear()
    try:
        with torch._inductor.config.patch(compile_threads=1):
            yield
    finally:
        torch._dynamo.reset()
        if previous_cache is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous_cache
