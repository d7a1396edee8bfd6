# Shared preamble of the gpu_*.sh bundles, sourced as `. experiments/gpu_env.sh NAME` from the
# repo root: strict mode, $OUT (default experiments/results), PYTHONPATH, per-run device memory
# (no preallocation, so memory stats show each run's own), `stamp` for elapsed-time lines, and
# $LOG = $OUT/NAME.log, opened with the jax version and devices.
set -uo pipefail
OUT=${OUT:-experiments/results}
mkdir -p "$OUT"
export PYTHONPATH=.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
LOG="$OUT/$1.log"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$LOG"
