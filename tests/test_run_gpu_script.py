"""experiments/run_gpu.sh composes its commands from its environment as documented: a fake
`python3` on PATH echoes each command instead of running it (no GPU, nothing imported)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _commands(tmp_path, parts, script="reproduce.py", **env):
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "python3").write_text(
        '#!/usr/bin/env bash\necho "python3 $* [XLA_FLAGS=${XLA_FLAGS:-}'
        ' pool=${XLA_PYTHON_CLIENT_MEM_FRACTION:-}]"\n'
    )
    (fake / "python3").chmod(0o755)
    environ = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "MLP_CHUNK",
            "LAYER_SIZES",
            "LAYER_PRESETS",
            "LAYER_MODES",
            "MLA_IMPLS",
            "MLA_SIZES",
            "OFFLOAD_SIZES",
            "NO_WARMUP",
            "PROFILE_PRESET",
            "PROFILE_T",
            "LOCALITY_T",
            "XLA_FLAGS",
            "XLA_PYTHON_CLIENT_MEM_FRACTION",
        )
    }
    environ.update(env, PATH=f"{fake}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(
        ["bash", "experiments/run_gpu.sh", str(tmp_path / "out"), *parts],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = [line for line in proc.stdout.splitlines() if script in line]
    return proc.returncode, lines


def test_layers_default_chunks_at_the_documented_lengths(tmp_path):
    rc, lines = _commands(tmp_path, ["layers"])
    assert rc == 0 and len(lines) == 2  # glm-5.1, then deepseek-v3.2
    for line, preset in zip(lines, ("glm-5.1", "deepseek-v3.2")):
        assert f"--preset {preset} --only layer" in line
        assert "--sizes 8192,16384,32768,65536,131072" in line
        assert "--mlp-chunk 16384" in line


@pytest.mark.parametrize("chunk, expected", [("8192", "--mlp-chunk 8192"), ("0", None)])
def test_layers_take_their_lengths_and_chunk_from_the_environment(tmp_path, chunk, expected):
    rc, lines = _commands(tmp_path, ["layers"], MLP_CHUNK=chunk, LAYER_SIZES="131072")
    assert rc == 0 and len(lines) == 2
    for line in lines:
        assert "--sizes 131072" in line
        assert (expected in line) if expected else ("--mlp-chunk" not in line)


def test_layers_run_the_presets_and_modes_asked_for(tmp_path):
    rc, lines = _commands(tmp_path, ["layers"], LAYER_PRESETS="deepseek-v3.2")
    assert rc == 0 and len(lines) == 1 and "--preset deepseek-v3.2" in lines[0], lines
    assert "--modes" not in lines[0]
    rc, lines = _commands(tmp_path, ["layers"], LAYER_MODES="hyscale/replay dense/full")
    assert rc == 0 and len(lines) == 2
    assert all("--modes hyscale/replay dense/full --out" in line for line in lines), lines


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, "--mlp-chunk 65536 --sizes 524288,1048576"),
        ({"MLP_CHUNK": "0", "OFFLOAD_SIZES": "1048576"}, "--offload-indices --sizes 1048576"),
        ({"NO_WARMUP": "1"}, "--mlp-chunk 65536 --no-warmup --sizes 524288,1048576"),
    ],
)
def test_offload_chunks_by_default(tmp_path, env, expected):
    rc, lines = _commands(tmp_path, ["offload"], **env)
    assert rc == 0 and len(lines) == 1 and expected in lines[0], lines


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, "[XLA_FLAGS=--xla_gpu_enable_host_memory_offloading=true pool=0.95]"),
        (
            {"XLA_FLAGS": "--xla_dump_to=d", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"},
            "[XLA_FLAGS=--xla_dump_to=d --xla_gpu_enable_host_memory_offloading=true pool=0.9]",
        ),
        (
            {"XLA_FLAGS": "--xla_gpu_enable_host_memory_offloading=false"},
            "[XLA_FLAGS=--xla_gpu_enable_host_memory_offloading=false pool=0.95]",
        ),
    ],
)
def test_offload_defaults_to_the_pool_and_flag_of_the_1m_run(tmp_path, env, expected):
    rc, lines = _commands(tmp_path, ["offload"], **env)
    assert rc == 0 and len(lines) == 1 and lines[0].endswith(expected), lines


def test_an_unknown_part_is_refused(tmp_path):
    rc, _ = _commands(tmp_path, ["benchmark"])
    assert rc == 2


def test_mla_times_the_portable_path_beside_the_kernels_and_cudnn(tmp_path):
    rc, lines = _commands(tmp_path, ["mla"], script="bench_attention.py")
    assert rc == 0 and len(lines) == 1 and "--impls pallas xla cudnn" in lines[0], lines
    rc, lines = _commands(tmp_path, ["mla"], script="bench_attention.py", MLA_IMPLS="pallas")
    assert rc == 0 and "--impls pallas --reps" in lines[0], lines


def test_profile_and_locality_run_their_probes_at_the_documented_defaults(tmp_path):
    rc, lines = _commands(tmp_path, ["profile", "locality"], script="experiments/lab/")
    assert rc == 0 and len(lines) == 2, lines
    assert "layer_profile.py --preset glm-5.1 --T 32768 --out" in lines[0]
    assert "index_locality.py --T 32768 --out" in lines[1]


def test_profile_and_locality_take_their_preset_and_length_from_the_environment(tmp_path):
    env = dict(PROFILE_PRESET="deepseek-v3.2", PROFILE_T="8192", LOCALITY_T="16384")
    env["PROFILE_MODES"] = "hyscale/replay hyscale/replay+target"
    rc, lines = _commands(tmp_path, ["profile", "locality"], script="experiments/lab/", **env)
    assert rc == 0 and len(lines) == 2, lines
    assert (
        "--preset deepseek-v3.2 --T 8192 --modes hyscale/replay hyscale/replay+target" in lines[0]
    )
    assert "index_locality.py --T 16384" in lines[1]
