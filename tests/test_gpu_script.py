"""``benchmarks/gpu.py --dry-run``: the GPU check's own code, on CPU with gloo and tiny models.

The script runs only where a GPU is lent, rarely and with minutes to spare; a part of it that broke
here (transformers 5.25's hub-kernel layers made ``CommDebugMode``'s module tracker fail in (b) and
(c)) would fail there too and waste the loan. Its verdicts are checked, not only its exit code.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_script_dry_run_passes_every_part(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--dry-run", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu.json").read_text())
    markdown = (tmp_path / "gpu.md").read_text()
    for phase in result["parity"]:
        assert phase["error"] is None, phase
        assert set(phase["cases"]) == set(phase["expected"]), phase
        for case, outcome in phase["cases"].items():
            assert "error" not in outcome, (case, outcome)
    assert "FAIL" not in markdown and "failed" not in markdown, markdown
    assert markdown.count("| pass") >= 8  # fp32 at worlds 1 and 2 (both reduce modes), keep, fp8, hook, meta
    assert result["bench_error"] is None
    for variant, row in result["bench"]["rows"].items():
        assert "error" not in row and row["times"], (variant, row)
    counts = result["bench"]["counts"]
    assert set(counts) == {"ragged", "fsdp2", "ddp", "local"}
    assert counts["ddp"]["collectives_by_op"].get("c10d.allreduce_", 0) >= 1  # world 1: DDP still all-reduces
    assert counts["ragged"]["collectives"] == 0  # its single-rank path issues none
