#!/usr/bin/env bash
# HyTopK on the GPU (issue 3), one device call (< 9 minutes), run from the repo root:
#     OUT=/some/dir bash experiments/gpu_runs/gpu_hytopk.sh
# 1. exactness of the default kernel on the GPU (TestCompiledGPU), 2. a tuning table at
# T=S=32K (variants beside the default, experiments/hytopk_notes.md), 3. the benchmark at
# T=S in {8K ... 256K} (reference and xla up to 32K) with compiled memory per impl.
# Logs and records land in $OUT (default experiments/results); every step has its own timeout.
set -uo pipefail
OUT=${OUT:-experiments/results}
mkdir -p "$OUT" "$OUT/variants"
export PYTHONPATH=.
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # so device memory stats show what each run uses
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }

{
  date
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
} 2>&1 | tee "$OUT/gpu_hytopk_env.log"

stamp "pytest TestCompiledGPU"
timeout 180 python3 -m pytest tests/test_hytopk_pallas.py -k TestCompiledGPU -q -rs \
  --durations=10 -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/gpu_hytopk_pytest.log"
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT/gpu_hytopk_pytest.log"

stamp "variants at 32K"
timeout 130 python3 experiments/bench_selection.py --sizes 32768 --reps 5 --out-dir "$OUT/variants" \
  --variants default,phased_w8_p3,phased_w8_p7,phased_w8_p7_stats,phased_w8_stats,append_only_w8 \
  2>&1 | grep -v -i deprecat | tee "$OUT/gpu_hytopk_variants.log"
echo "variants exit: ${PIPESTATUS[0]}"

stamp "benchmark 8K..256K"
timeout 250 python3 experiments/bench_selection.py --reps 5 --out-dir "$OUT" 2>&1 | grep -v -i deprecat \
  | tee "$OUT/bench_selection_h200.log"
echo "bench exit: ${PIPESTATUS[0]}"
stamp "done"
