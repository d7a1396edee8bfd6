#!/usr/bin/env bash
# HyTopK Pallas kernel: where do the 83 ms go at T=S=32K, and does the phased schedule fix it?
# ONE device call (< 8 minutes), run from the repo root:
#     OUT=/some/dir bash experiments/gpu_runs/gpu_hytopk_diagnose.sh
# 1. exactness on the GPU (TestCompiledGPU: default schedule + the phased schedule's
#    all-equal/NaN case), 2. the variant table at T=S=32768 (all variants), 3. at T=S=8192 (a
#    subset). Variants, predictions and how to read the table: experiments/hytopk_notes.md.
# Every step has its own timeout; the variant JSON is rewritten after every record, and the
# tables are printed again at the end from the JSON, so a timeout loses only the tail.
set -uo pipefail
OUT=${OUT:-experiments/results/diagnose}
mkdir -p "$OUT" "$OUT/32k" "$OUT/8k"
export PYTHONPATH=.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }

{
  date
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
} 2>&1 | tee "$OUT/env.log"

# 1. Exactness (117 s for 8 tests last time; now 9).
stamp "pytest TestCompiledGPU"
timeout 150 python3 -m pytest tests/test_hytopk_pallas.py -k TestCompiledGPU -q -rs \
  --durations=10 -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/pytest_compiled_gpu.log"
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT/pytest_compiled_gpu.log"

# 2. T = S = 32768, every variant, most informative first (~13 s each: compile + verify + time).
stamp "variants at 32K"
timeout 215 python3 experiments/bench_selection.py --sizes 32768 --reps 5 --out-dir "$OUT/32k" \
  --variants default,score_only,append_nested,append_only,phased,phased_c8k,stats,phased_stats,phased_c8k_stats,phased_bk256_c8k,phased_ns1,phased_w8,fused_bk256 \
  2>&1 | grep -v DeprecationWarning | tee "$OUT/bench_32k.log"
echo "bench 32K exit: ${PIPESTATUS[0]}"

# 3. T = S = 8192, the attribution subset plus the phased candidates.
stamp "variants at 8K"
timeout 95 python3 experiments/bench_selection.py --sizes 8192 --reps 10 --out-dir "$OUT/8k" \
  --variants default,score_only,append_nested,phased,phased_c8k,phased_stats \
  2>&1 | grep -v DeprecationWarning | tee "$OUT/bench_8k.log"
echo "bench 8K exit: ${PIPESTATUS[0]}"

# 4. The tables again (also after a timeout), from the JSON records.
stamp "tables"
python3 - "$OUT" <<'PY' 2>&1 | tee "$OUT/summary.txt"
import json, os, sys
sys.path.insert(0, "experiments")
from bench_selection import variants_table
out = sys.argv[1]
for sub in ("32k", "8k"):
    p = os.path.join(out, sub, "bench_selection_variants.json")
    if not os.path.exists(p):
        print(f"{sub}: no records"); continue
    recs = json.load(open(p))["records"]
    variants_table(recs)
    for r in recs:
        if "stats_mean" in r:
            print(f"  {r['variant']:<18} mean " + " ".join(f"{k}={v:.0f}" for k, v in r["stats_mean"].items()))
            print(f"  {r['variant']:<18} max  " + " ".join(f"{k}={v}" for k, v in r["stats_max"].items()))
PY
grep -E "passed|failed|error" "$OUT/pytest_compiled_gpu.log" | tail -2

# 5. Issue 6: the sharded path on a 1-device mesh against the single-device op, T = 32K.
stamp "1-device mesh overhead"
timeout 150 python3 experiments/bench_parallel_overhead.py --out-dir "$OUT" 2>&1 \
  | grep -v DeprecationWarning | tee -a "$OUT/summary.txt"
stamp "done"
