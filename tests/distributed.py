"""A reusable pool of gloo worker processes, so many checks share one process group.

``DistributedPool(n).run(fn, *args)`` calls the module-level function ``fn`` on every
rank and returns the per-rank results; an exception on any rank is re-raised here with
that rank's traceback. Workers use one thread each, like the benchmarks.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

TASK_TIMEOUT_S = 240
FAILURE_GRACE_S = 15


def _worker(rank: int, world_size: int, init_file: str, tasks: mp.Queue, results: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("LOCAL_RANK", str(rank))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            fn, args, kwargs = task
            try:
                results.put((rank, True, fn(*args, **kwargs)))
            except BaseException:  # report every failure to the parent, whatever it is
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()
    # Every result was sent and read: skip the interpreter's teardown of torch (~1 s a rank, 10 ranks at the end).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class DistributedPool:
    """``world_size`` spawned processes joined in one gloo process group."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        context = mp.get_context("spawn")
        self._init_file = tempfile.mktemp(prefix="ragged_pg_")
        self._tasks = [context.Queue() for _ in range(world_size)]
        self._results = context.Queue()
        self._processes = [
            context.Process(
                target=_worker, args=(rank, world_size, self._init_file, self._tasks[rank], self._results), daemon=True
            )
            for rank in range(world_size)
        ]
        for process in self._processes:
            process.start()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        for task_queue in self._tasks:
            task_queue.put((fn, args, kwargs))
        outcomes: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + TASK_TIMEOUT_S
        try:
            while len(outcomes) < self.world_size:
                # once a rank failed, its peers are likely stuck in a collective: wait briefly, not the full timeout
                rank, ok, value = self._results.get(timeout=max(0.0, deadline - time.monotonic()))
                outcomes[rank] = (ok, value)
                if not ok:
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        except queue.Empty:
            self.close()
            reported = "".join(
                f"\n--- rank {rank} {'returned' if ok else 'failed'} ---\n{value if not ok else ''}"
                for rank, (ok, value) in sorted(outcomes.items())
            )
            raise TimeoutError(
                f"{fn.__name__} did not finish on all ranks within {TASK_TIMEOUT_S}s "
                f"(or {FAILURE_GRACE_S}s after a rank failed){reported}"
            ) from None
        failures = [f"--- rank {rank} ---\n{value}" for rank, (ok, value) in sorted(outcomes.items()) if not ok]
        if failures:
            self.close()
            raise AssertionError(f"{fn.__name__} failed:\n" + "\n".join(failures))
        return [outcomes[rank][1] for rank in range(self.world_size)]

    @property
    def alive(self) -> bool:
        return all(process.is_alive() for process in self._processes)

    def stop(self) -> None:
        """Ask every live worker to leave (without waiting: pools stopped together exit in parallel)."""
        for process, task_queue in zip(self._processes, self._tasks):
            if process.is_alive():
                task_queue.put(None)

    def close(self) -> None:
        self.stop()
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
        if os.path.exists(self._init_file):
            os.remove(self._init_file)
