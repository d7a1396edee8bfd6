"""experiments/bench_selection.py --merge: how runs combine into the headline record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _record_file(path, records):
    """A benchmark record file at path (the merge names each record's run by its folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(meta={}, records=records)))
    return str(path)


def _rec(T, impl, ms, status="ok"):
    return dict(T=T, impl=impl, median_ms=ms, tflops=1.0, status=status, speedup_vs_reference=None)


def test_later_run_replaces_only_the_columns_it_timed(tmp_path):
    """A later run replaces pallas and pallas_kernel together at a size where it timed them,
    keeps the earlier run's other columns there, and a failed record never displaces an
    earlier measured one."""
    old = _record_file(
        tmp_path / "old" / "bench_selection.json",
        [
            _rec(8192, "reference", 14.0),
            _rec(8192, "xla", 15.0),
            _rec(8192, "pallas", 3.4),
            _rec(8192, "pallas_kernel", 2.4),
            _rec(65536, "pallas", 96.0),
        ],
    )
    new = _record_file(
        tmp_path / "new" / "bench_selection.json",
        [
            _rec(8192, "reference", 15.2),
            _rec(8192, "pallas", 3.37),
            _rec(65536, "pallas", None, status="failed: OOM"),
        ],
    )
    out = tmp_path / "merged"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "experiments" / "bench_selection.py"),
            "--merge",
            old,
            new,
            "--out-dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    got = {
        (r["T"], r["impl"]): (r["median_ms"], r["source"]["file"])
        for r in json.loads((out / "bench_selection.json").read_text())["records"]
    }
    assert got == {
        (8192, "reference"): (15.2, "new/bench_selection.json"),
        (8192, "xla"): (15.0, "old/bench_selection.json"),
        (8192, "pallas"): (3.37, "new/bench_selection.json"),
        (65536, "pallas"): (96.0, "old/bench_selection.json"),
    }
    assert (out / "bench_selection.png").exists()
