"""experiments/scale_parallel.py (issue 7's scaling run) end to end on simulated CPU devices."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_scale_parallel_check_and_weak_on_two_simulated_devices(tmp_path):
    """One sharded-vs-unsharded check (mesh data=1, seq=2) and a two-point weak-scaling run:
    the record, its ratios and the plot are written, and the first layer's selection (on
    identical embeddings) is bit-identical between the sharded and unsharded model."""
    cmd = [sys.executable, str(ROOT / "experiments" / "scale_parallel.py"), "--only",
           "check,weak", "--devices", "1,2", "--check-T", "128", "--check-steps", "2",
           "--weak-T", "128", "--reps", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads((tmp_path / "scale_parallel_cpu.json").read_text())
    assert (tmp_path / "scale_parallel_cpu.png").exists()
    (check,) = record["check"]
    assert check["status"] == "ok", check
    assert check["N"] == 2 and check["layer0_identical"]
    assert len(check["sharded"]) == len(check["unsharded"]) == 2
    # bf16 activations, another f32 summation order across shards: close, not equal
    assert max(check["max_rel_diff"].values()) < 5e-2, check["max_rel_diff"]
    assert [p["status"] for p in record["weak"]] == ["ok", "ok"]
    assert [p["T"] for p in record["weak"]] == [128, 256]
    assert record["weak"][0]["efficiency"] == 1.0
    assert "efficiency" in record["weak"][1]
