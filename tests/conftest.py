from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import warnings


def _cpu_only() -> bool:
    """Whether jax can only run on the CPU here: JAX_PLATFORMS says so, or no accelerator
    plugin is installed (the CUDA and ROCm plugins live in the jax_plugins namespace, TPUs
    need libtpu)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms == "cpu"
    return (
        importlib.util.find_spec("jax_plugins") is None
        and not importlib.metadata.entry_points(group="jax_plugins")
        and importlib.util.find_spec("libtpu") is None
    )


def _add_xla_flag(name: str, value) -> None:
    """Appends --name=value to XLA_FLAGS unless XLA_FLAGS sets name already."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    if not any(f.lstrip("-").split("=")[0] == name for f in flags):
        os.environ["XLA_FLAGS"] = " ".join(flags + [f"--{name}={value}"])


def _xla_accepts_flag(name: str, value) -> bool:
    """Whether this jaxlib's XLA parses --name=value: XLA aborts the process on an unknown flag
    in XLA_FLAGS, so a flag that a later jaxlib may drop is tried in a short-lived interpreter
    first (about a second, once, in the controlling process). A probe that fails or stalls
    leaves the flag out, with a warning: the tests then run as before, only slower."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --{name}={value}".strip()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", "import jax; jax.devices()"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        warnings.warn(f"--{name}={value} left out: probing it took over 60 s", stacklevel=2)
        return False
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        warnings.warn(f"--{name}={value} left out: this XLA rejects it ({last})", stacklevel=2)
    return proc.returncode == 0


# XLA reads XLA_FLAGS once, when jax creates its first backend: set them before any test runs.
# The subprocesses that tests start inherit them.
if _cpu_only():
    # On the CPU, compiling is most of the suite's time (the interpret-mode kernels compile
    # into large programs that run in milliseconds), and LLVM's optimization of the generated
    # code is a third of each compile. Level 0 compiles the same HLO (XLA's own passes, and so
    # its fusion and rounding decisions, are unchanged) into slower machine code.
    _add_xla_flag("xla_backend_optimization_level", 0)
    # Eight simulated CPU devices, so the sharded checks (tests/parallel_checks.py, the MLA
    # mesh check) run in this process rather than in a fresh interpreter each. Arrays and
    # computations stay on device 0 unless a test builds a mesh.
    _add_xla_flag("xla_force_host_platform_device_count", 8)
    # XLA's MLIR fusion emitters for the CPU off: XLA's CPU backend then emits fusions as it
    # did before them (its elemental emitters) and expands every scatter into a while loop.
    # The whole suite (pytest -n 2 on 2 cores, jax 0.10.2, the same 593 tests passing, one run
    # each way at babbbd5): 1216 s of summed test time with the emitters, 758 s without (wall
    # 10 min 32 s -> 6 min 38 s), so compiling with them was most of what the interpret-mode
    # kernels cost (inferred from those times; compile time was not measured alone). Unlike
    # level 0 this changes XLA's CPU HLO pipeline (scatter expansion, gather simplification,
    # fusion choices), so a CPU program's float results may differ in their last bits from a
    # default jax's; the tests compare programs compiled under the same flags, or against
    # tolerances, and pass both ways. Set only where XLA knows the flag, by the process that
    # loads this file first (pytest's controlling process under xdist): the workers and the
    # subprocesses that tests start inherit it through XLA_FLAGS.
    _EMITTERS = "xla_cpu_use_fusion_emitters"
    if (
        "PYTEST_XDIST_WORKER" not in os.environ
        and f"--{_EMITTERS}=" not in os.environ.get("XLA_FLAGS", "")
        and _xla_accepts_flag(_EMITTERS, "false")
    ):
        _add_xla_flag(_EMITTERS, "false")

import hypothesis  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402

# Deterministic property tests: the same examples on every run and machine, no deadline (the
# first example of each shape pays for a JIT compile).
hypothesis.settings.register_profile(
    "deterministic", derandomize=True, deadline=None, max_examples=20, print_blob=True
)
hypothesis.settings.load_profile("deterministic")

# One compilation cache on disk for the whole run: the xdist workers and the subprocesses that
# tests start share it, so a program compiled once is loaded, not recompiled, wherever it
# comes again (in the other worker, after `jax.clear_caches`, in a subprocess). The controlling
# process makes a fresh folder and removes it at the end; a folder given in the environment is
# used as it is and kept.
_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
_MIN_COMPILE_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
_owned_cache_dir: str | None = None


def pytest_configure(config):
    global _owned_cache_dir
    if _CACHE_ENV not in os.environ and "PYTEST_XDIST_WORKER" not in os.environ:
        _owned_cache_dir = tempfile.mkdtemp(prefix="hyscale-jax-test-cache-")
        os.environ[_CACHE_ENV] = _owned_cache_dir
    # Programs that compile in under 50 ms are not worth storing.
    os.environ.setdefault(_MIN_COMPILE_ENV, "0.05")
    if _CACHE_ENV in os.environ:
        jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
        jax.config.update(
            "jax_persistent_cache_min_compile_time_secs", float(os.environ[_MIN_COMPILE_ENV])
        )


def pytest_unconfigure(config):
    if _owned_cache_dir is not None:
        shutil.rmtree(_owned_cache_dir, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Tests marked run_first (the longest ones that share no fixture with other tests) start
    before all others, so that with pytest -n no worker is left running one of them alone at
    the end while the others wait."""
    items.sort(key=lambda item: item.get_closest_marker("run_first") is None)


# Linux's default vm.max_map_count is 65530; clear well below it.
_MAP_LIMIT = 30000


def _memory_mappings() -> int | None:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: no count to watch
        return None


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """Drop jax's compiled programs once they hold too many memory mappings. Every XLA CPU
    executable holds its own mappings, and the interpret-mode kernels compile to many large
    ones: a whole-suite run that kept them all alive passed the kernel's limit of 65530
    mappings per process (~48600 at 40% of the suite, measured) and crashed inside XLA's
    compiler, a segfault in test_layer.py in two fresh CI runs, never with the modules run
    alone. Clearing after every test also fixed it but recompiled what later tests share; this
    clears only past _MAP_LIMIT mappings (after every test where the count is unavailable)."""
    yield
    count = _memory_mappings()
    if count is None or count > _MAP_LIMIT:
        jax.clear_caches()
