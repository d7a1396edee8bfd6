#!/usr/bin/env bash
# HyTopK on the GPU (issue 3): the Pallas kernel's tests, then a quick selection benchmark.
#   run from the repo root:  OUT=/some/dir bash experiments/gpu_hytopk.sh
# Logs and results land in $OUT (default experiments/results). Worst case ~7.5 minutes.
set -uo pipefail
OUT=${OUT:-experiments/results}
mkdir -p "$OUT"
export PYTHONPATH=.
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # so device memory stats show what each run uses

{
  date
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
} 2>&1 | tee "$OUT/gpu_hytopk_env.log"

# 1. Exactness on the GPU: tests/test_hytopk_pallas.py, production-shape class first (so a
#    timeout cannot starve it), then the small-tile cases compiled for the GPU.
{
  timeout 180 python3 -m pytest tests/test_hytopk_pallas.py -k TestCompiledGPU -q -rs \
    --durations=10 -p no:cacheprovider
  echo "pytest (TestCompiledGPU) exit: $?"
  timeout 100 python3 -m pytest tests/test_hytopk_pallas.py -k "not TestCompiledGPU" -q -rs \
    --durations=10 -p no:cacheprovider
  echo "pytest (rest) exit: $?"
} 2>&1 | tee "$OUT/gpu_hytopk_pytest.log"

# 2. Quick benchmark: T = S in {8K, 32K}: reference, xla, pallas, kernel alone (phase split);
#    then the pallas path alone at 128K and 256K, where the reference cannot run.
{
  timeout 120 python3 experiments/bench_selection.py --quick --out-dir "$OUT"
  echo "bench exit: $?"
  mkdir -p "$OUT/big"
  timeout 60 python3 experiments/bench_selection.py --sizes 131072,262144 \
    --impls pallas,pallas_kernel --reps 3 --out-dir "$OUT/big"
  echo "bench (128K, 256K) exit: $?"
} 2>&1 | tee "$OUT/gpu_hytopk_bench.log"
