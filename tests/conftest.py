import hypothesis
import jax
import pytest

# Deterministic property tests: the same examples on every run and machine, no deadline (the
# first example of each shape pays for a JIT compile).
hypothesis.settings.register_profile(
    "deterministic", derandomize=True, deadline=None, max_examples=20, print_blob=True)
hypothesis.settings.load_profile("deterministic")


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """Drop jax's compiled programs after each test. Every XLA CPU executable holds its own
    memory mappings, and the interpret-mode kernels compile to many large ones: a whole-suite
    run that kept them all alive passed the kernel's limit of 65530 mappings per process
    (~48600 at 40% of the suite, measured) and crashed inside XLA's compiler, a segfault in
    test_layer.py in two fresh CI runs, never with the modules run alone."""
    yield
    jax.clear_caches()
