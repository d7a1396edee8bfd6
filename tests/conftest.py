import hypothesis

# Deterministic property tests: the same examples on every run and machine, no deadline (the
# first example of each shape pays for a JIT compile).
hypothesis.settings.register_profile(
    "deterministic", derandomize=True, deadline=None, max_examples=20, print_blob=True)
hypothesis.settings.load_profile("deterministic")
