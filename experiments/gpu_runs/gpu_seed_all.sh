#!/usr/bin/env bash
# One device call (< 10 minutes), from the repo root:
#     OUT=/some/dir bash experiments/gpu_runs/gpu_seed_all.sh
# Sixteenth session (2026-12-04): the whole GPU test subset at the seeded default
# (BlockSizes.seed_rate=16): all three kernels' compiled classes (TestCompiledGPU), the layer
# and model tests (impl="auto" takes them through the kernels) and the one-device mesh, ten
# pytest processes at a time (parallel_pytest in gpu_env.sh). It replaces gpu_seed_rest.sh's
# four serial calls, which were never run.
. experiments/gpu_runs/gpu_env.sh gpu_seed_all
parallel_pytest 540 10 tests/test_hytopk_pallas.py tests/test_sparse_attention_pallas.py \
  tests/test_indexer_loss_pallas.py tests/test_layer.py tests/test_nn.py tests/test_parallel.py \
  -k "TestCompiledGPU or test_layer or test_nn or one_device_mesh"
step "done"
