"""experiments/bench_layer_parts.py: every part is timed and checked, and no jitted part closes
over an input array (jax compiles such an array in as a constant: gigabytes at the GPU shapes)."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[1]


def test_parts_are_timed_with_no_captured_constants(tmp_path):
    sys.path.insert(0, str(ROOT / "experiments"))
    import bench_layer_parts

    # At T = 256 the inputs a part could close over are 16-64 KiB each.
    limit = jax.config.jax_captured_constants_warn_bytes
    jax.config.update("jax_captured_constants_warn_bytes", 8 * 1024)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            argv = ["--preset", "cpu", "--T", "256", "--reps", "1", "--out", str(tmp_path)]
            bench_layer_parts.main(argv)
    finally:
        jax.config.update("jax_captured_constants_warn_bytes", limit)
    captured = [str(w.message) for w in seen if "constants were captured" in str(w.message)]
    assert not captured, captured
    (row,) = json.loads((tmp_path / "bench_layer_parts.json").read_text())["rows"]
    for part in ("hytopk", "attention_fwd_bwd", "indexer_kl_fwd_bwd", "block_fwd_bwd"):
        assert row[f"{part}_ms"] > 0, part
    assert row["indexer_kl_loss_rel_err_vs_xla"] < 1e-5
    assert row["indexer_kl_loss_given_lse_rel_err_vs_xla"] < 1e-5
    assert row["indexer_kl_fwd_given_lse_ms"] > 0
    assert (tmp_path / "bench_layer_parts.png").exists()
