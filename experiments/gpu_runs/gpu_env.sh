# Shared preamble of the gpu_*.sh bundles, sourced as `. experiments/gpu_runs/gpu_env.sh NAME`
# from the repo root: strict mode, $OUT (default experiments/results), PYTHONPATH, per-run device memory
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
NAME=$1
LOG="$OUT/$NAME.log"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$LOG"
# step TITLE: a stamped line on the console and in $LOG.
step() { stamp "$*" | tee -a "$LOG"; }
# timed_script SECONDS SCRIPT ARGS...: python3 SCRIPT ARGS under a time limit, its output
# (deprecation warnings dropped) appended to $LOG, its last 40 lines on the console.
timed_script() {
  local limit=$1; shift
  timeout "$limit" python3 "$@" 2>&1 | grep -v -i deprecat | tee -a "$LOG" | tail -40
}
# timed_bench SECONDS ARGS...: timed_script on experiments/bench_selection.py.
timed_bench() {
  local limit=$1; shift
  timed_script "$limit" experiments/bench_selection.py "$@"
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
# parallel_pytest SECONDS WORKERS ARGS...: the tests that pytest ARGS select, run WORKERS
# pytest processes at a time on the one GPU, three tests per process. The compiled tests spend
# most of their time compiling Triton kernels on one CPU core each, so a 16-core host runs
# them several times faster side by side; each process gets 1/WORKERS of the device memory.
# No process starts after SECONDS, and each is cut at SECONDS, so none outlives the call.
# All processes' output lands in $OUT/NAME_tests/pytest_output.log (one file: a call brings
# back a limited number); $LOG gets every test's result line, the unfinished ones, the counts.
parallel_pytest() {
  local limit=$1 workers=$2; shift 2
  local dir="$OUT/${NAME}_tests"
  mkdir -p "$dir"
  python3 -m pytest --collect-only -q -p no:cacheprovider "$@" 2>/dev/null | grep '::' \
    > "$dir/ids.txt"
  step "pytest: $(wc -l < "$dir/ids.txt") tests, $workers processes at a time"
  XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(0.9 / $workers, 3))") \
  DEADLINE=$(( $(date +%s) + limit )) xargs -d '\n' -P "$workers" -n 3 sh -c '
    left=$(( DEADLINE - $(date +%s) )); [ "$left" -gt 10 ] || exit 0
    timeout "$left" python3 -m pytest -v -rs -p no:cacheprovider "$@" > "$0/run_$$.log" 2>&1
    exit 0' "$dir" < "$dir/ids.txt"
  grep -hE "^tests/.* (PASSED|FAILED|ERROR|SKIPPED) +\[" "$dir"/run_*.log \
    | sed -E 's/ +\[ *[0-9]+%\]$//' | sort > "$dir/results.txt"
  cat "$dir"/run_*.log > "$dir/pytest_output.log" && rm "$dir"/run_*.log  # one file comes back
  sed -E 's/ (PASSED|FAILED|ERROR|SKIPPED)$//' "$dir/results.txt" | sort > "$dir/ran.txt"
  sort "$dir/ids.txt" | comm -23 - "$dir/ran.txt" > "$dir/not_run.txt"
  tee -a "$LOG" < "$dir/results.txt" | grep -vE " PASSED$"
  sed 's/$/ NOT FINISHED (time limit: never started, or cut)/' "$dir/not_run.txt" | tee -a "$LOG"
  step "$(grep -c ' PASSED$' "$dir/results.txt") passed, $(grep -cE ' (FAILED|ERROR)$' \
    "$dir/results.txt") failed, $(grep -c ' SKIPPED$' "$dir/results.txt") skipped, \
$(wc -l < "$dir/not_run.txt") not finished"
}
