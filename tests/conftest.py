from __future__ import annotations

import hypothesis
import jax
import pytest

# Deterministic property tests: the same examples on every run and machine, no deadline (the
# first example of each shape pays for a JIT compile).
hypothesis.settings.register_profile(
    "deterministic", derandomize=True, deadline=None, max_examples=20, print_blob=True
)
hypothesis.settings.load_profile("deterministic")


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
