import hypothesis
import jax
import pytest

# Deterministic property tests: the same examples on every run and machine, no deadline (the
# first example of each shape pays for a JIT compile).
hypothesis.settings.register_profile(
    "deterministic", derandomize=True, deadline=None, max_examples=20, print_blob=True)
hypothesis.settings.load_profile("deterministic")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop jax's compiled programs after each test module. The interpret-mode kernels compile
    to large XLA CPU programs, and a whole-suite run that keeps them all alive crashed inside
    XLA's compiler (a segfault in test_layer.py, reproducible in two fresh CI runs, never in
    the modules run alone); every compiled program holds its own memory mappings."""
    yield
    jax.clear_caches()
