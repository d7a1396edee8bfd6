# Shared preamble of the gpu_*.sh bundles, sourced as `. experiments/gpu_env.sh NAME` from the
# repo root: strict mode, $OUT (default experiments/results), PYTHONPATH, per-run device memory
# (no preallocation, so memory stats show each run's own), `stamp` for elapsed-time lines,
# $LOG = $OUT/NAME.log, opened with the jax version and devices, and the step helpers below
# (the ninth session's and later scripts use them; earlier ones spell the same pipes out).
set -uo pipefail
OUT=${OUT:-experiments/results}
mkdir -p "$OUT"
export PYTHONPATH=.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
LOG="$OUT/$1.log"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$LOG"
# step TITLE: a stamped line on the console and in $LOG.
step() { stamp "$*" | tee -a "$LOG"; }
# timed_bench SECONDS ARGS...: experiments/bench_selection.py ARGS under a time limit, its
# output (deprecation warnings dropped) appended to $LOG.
timed_bench() {
  local limit=$1; shift
  timeout "$limit" python3 experiments/bench_selection.py "$@" 2>&1 | grep -v -i deprecat \
    | tee -a "$LOG" | tail -40
}
# timed_pytest SECONDS TESTS...: pytest -v on TESTS under a time limit, the per-test result
# lines and the summary appended to $LOG.
timed_pytest() {
  local limit=$1; shift
  timeout "$limit" python3 -m pytest -v -rs -p no:cacheprovider "$@" 2>&1 \
    | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Error" | tee -a "$LOG" | tail -40
}
# apply_patch FILE: apply an experiments/patches/ file (a kernel change not yet on main) to
# the device's copy of the tree, or stop the script.
apply_patch() {
  step "apply $1"
  git apply "$1" 2>&1 | tee -a "$LOG" || { step "patch did not apply: stopping"; exit 1; }
}
# probe_scoring SECONDS VARIANTS: experiments/probe_scoring_ir.py's instruction counts of the
# score_only kernel for VARIANTS (bench_selection.py syntax), written under $OUT.
probe_scoring() {
  step "scoring core instruction counts"
  timeout "$1" python3 experiments/probe_scoring_ir.py --out "$OUT/probe_scoring_ir" \
    --variants "$2" 2>&1 | grep -v -i deprecat | tee -a "$LOG" | tail -20
}
# compiled_tests SECONDS ARGS...: timed_pytest with every ARG that names a test ("test_...",
# optionally with its [id]) taken from tests/test_hytopk_pallas.py's TestCompiledGPU; other
# ARGs (paths, -k and its expression) pass through unchanged.
compiled_tests() {
  local limit=$1 arg; shift
  local args=()
  for arg in "$@"; do
    case "$arg" in
      test_*) args+=("tests/test_hytopk_pallas.py::TestCompiledGPU::$arg") ;;
      *) args+=("$arg") ;;
    esac
  done
  timed_pytest "$limit" "${args[@]}"
}
# epilogue_tests SECONDS STEP_TITLE K_EXPR: the compiled sort-width and all-equal/NaN tests
# (TestCompiledGPU) whose ids match K_EXPR, through compiled_tests.
epilogue_tests() {
  step "$2"
  compiled_tests "$1" test_order_and_sort_width_exact_vs_reference \
    test_sort_width_all_equal_and_nan_at_scale -k "$3"
}
