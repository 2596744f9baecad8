"""One rank of the lost-peer diagnostics test (``tests/test_diagnostics.py``).

``python tests/diagnostics_job.py RANK WORLD PORT VICTIM OUT_DIR``: joins a gloo process
group through a TCPStore hosted by rank 0 (``tcp://127.0.0.1:PORT``), shards the tiny model,
runs one step on every rank (all connections up), then the victim writes
``victim.ready`` and sleeps (the test SIGKILLs it) while every other rank writes
``entering.<rank>`` and runs the next step, blocking in its first all-gather until the
victim dies. A survivor writes what it caught to ``result.<rank>.json`` and leaves with
``os._exit`` (its process group cannot be torn down cleanly with a peer gone).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import lightning_ragged as lr  # noqa: E402
from lightning_ragged.observability.probes import probe  # noqa: E402
from tests.models import lm_loss, make_batches, make_model  # noqa: E402

TIMEOUT_S = 60.0
"""The process group's timeout: far longer than the test waits, so a timeout message would be wrong."""
VICTIM_SLEEP_S = 90.0


def main() -> None:
    rank, world, port, victim = (int(value) for value in sys.argv[1:5])
    out = Path(sys.argv[5])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    model = lr.fully_shard(make_model())
    engine = probe(model)
    engine.collective_timeout = TIMEOUT_S
    batches = make_batches(2, 2 * world)
    local = lambda step: batches[step][2 * rank : 2 * rank + 2]  # noqa: E731
    lm_loss(model, local(0)).backward()  # every pair of ranks has talked
    engine.step = 1
    if rank == victim:
        (out / "victim.ready").write_text(str(os.getpid()))
        time.sleep(VICTIM_SLEEP_S)  # killed long before
        os._exit(3)
    (out / f"entering.{rank}").write_text(str(time.time()))
    started = time.time()
    result: dict = {"rank": rank}
    try:
        lm_loss(model, local(1)).backward()
        result.update(type="no error")
    except BaseException as error:  # noqa: BLE001 - reported to the test
        result.update(
            type=type(error).__name__,
            message=str(error),
            lost_ranks=getattr(error, "lost_ranks", None),
            arrived_ranks=getattr(error, "arrived_ranks", None),
            store_lost=getattr(error, "store_lost", None),
            failed_at=getattr(error, "failed_at", None),
            collective=getattr(error, "collective", None),
            step=getattr(error, "step", None),
            traceback=traceback.format_exc()[-3000:],
        )
    result["raised_at"] = time.time()
    result["seconds"] = result["raised_at"] - started
    part = out / f"result.{rank}.json.part"
    part.write_text(json.dumps(result))
    os.replace(part, out / f"result.{rank}.json")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
