"""Data + sequence parallel HyScale (hyscale_jax/parallel.py) on simulated CPU devices.

The sharded checks (tests/parallel_checks.py) need 8 devices. tests/conftest.py asks XLA for
8 simulated CPU devices on a CPU-only machine, so there each check runs in this process as its
own test. Elsewhere (a machine with fewer accelerators) they run in one fresh interpreter with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (XLA reads its flags once, when jax
initializes), each check reported as its own test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import hyscale_jax as hs
from hyscale_jax import parallel
from tests import parallel_checks
from tests.helpers import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sharded_results():
    """Every check's record from one fresh interpreter with 8 simulated CPU devices."""
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.parallel_checks"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not records:
        pytest.fail(
            f"tests.parallel_checks failed (rc={proc.returncode}):\n"
            f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return {r["name"]: r for r in records}


@pytest.mark.parametrize("name", list(parallel_checks.CHECKS))
def test_sharded(request, name):
    if jax.device_count() >= 8:
        parallel_checks.CHECKS[name]()
        return
    record = request.getfixturevalue("sharded_results").get(name)
    assert record is not None, f"check {name} did not run"
    assert record["ok"], record["error"]


# ----------------------------------------------------------------------------- in-process


def test_one_device_mesh_equals_single_device():
    x = parallel_checks.inputs(11)
    mesh = parallel.make_mesh(data=1, seq=1, devices=jax.devices()[:1])
    out, idx = parallel.hyscale_attention(**x, topk=parallel_checks.TOPK, mesh=mesh, impl="xla")
    want_out, want_idx = hs.hyscale_attention(**x, topk=parallel_checks.TOPK, impl="xla")
    np.testing.assert_array_equal(idx, want_idx)
    np.testing.assert_allclose(out, want_out, rtol=1e-6, atol=1e-6)


def test_zigzag_round_trip_and_balance():
    x = jnp.arange(2 * 24 * 3).reshape(2, 24, 3)
    for n in (1, 2, 3, 6):
        np.testing.assert_array_equal(parallel.from_zigzag(parallel.to_zigzag(x, n), n), x)
    pos = parallel.zigzag_positions(32, 4).reshape(4, 8)  # shard r's natural positions
    work = (pos + 1).sum(axis=1)  # causal pairs scored per shard (T == S)
    assert len(set(work.tolist())) == 1, work


def test_bad_mesh_errors_without_devices():
    devices = jax.devices()[:1]
    with pytest.raises(ValueError, match="number of devices"):
        parallel.make_mesh(data=2, seq=1, devices=devices)
    with pytest.raises(ValueError, match="axes named"):
        parallel.check_mesh(Mesh(np.asarray(devices).reshape(1, 1), ("batch", "seq")))
    with pytest.raises(ValueError, match="Mesh"):
        parallel.check_mesh("data=2,seq=4")
    with pytest.raises(ValueError, match="data=N,seq=M"):
        parallel.parse_mesh("data=2,sequence=4")
    assert parallel.parse_mesh("data=2,seq=4") == {"data": 2, "seq": 4}
    x = parallel_checks.inputs(12)
    mesh = parallel.make_mesh(devices=devices)
    with pytest.raises(ValueError, match="load_balance"):
        parallel.hyscale_attention(**x, topk=4, mesh=mesh, load_balance="ring")


def test_cli_mesh_flag():
    cli = load_script("train", "train_cli")
    assert cli.parse_args(["--mesh", "data=2,seq=4"]).mesh == {"data": 2, "seq": 4}
    assert cli.parse_args([]).mesh is None
    with pytest.raises(SystemExit):
        cli.parse_args(["--mesh", "data=two"])
