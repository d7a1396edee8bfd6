#!/usr/bin/env bash
# Run the GPU test subset and/or the headline benchmarks on one NVIDIA GPU, from the repo root,
# with logs and records under OUTDIR. Nothing is installed: the machine needs jax with CUDA,
# flax, optax, orbax, matplotlib, tqdm and pytest.
#
#   bash experiments/run_gpu.sh OUTDIR [tests] [bench] [reproduce]   (default: tests bench)
#
#   tests      the compiled kernels' tests, the layer, model and poisoned-row tests, split over
#              $JOBS pytest processes (default 8: Triton compiles on one CPU core per process),
#              each allowed 1/$JOBS of the GPU's memory; OUTDIR/tests/ holds each process's
#              log and summary.txt the result line of each.
#   bench      bench_selection at T = 8K-32K (reference, xla, pallas) and bench_attention at
#              T = 32K, H = 64 (pallas, xla, cuDNN), each in its own process.
#   reproduce  reproduce.py --preset h200 at T = 8K-32K (layer and end to end).
set -uo pipefail
out=${1:?usage: bash experiments/run_gpu.sh OUTDIR [tests] [bench] [reproduce]}
shift
if [ $# -eq 0 ]; then parts=(tests bench); else parts=("$@"); fi
export PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p "$out"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee "$out/env.txt"

run_tests() {
    local jobs=${JOBS:-8} dir="$out/tests"
    mkdir -p "$dir"
    python3 -m pytest -q --co tests/test_hytopk_pallas.py tests/test_sparse_attention_pallas.py \
        tests/test_indexer_loss_pallas.py tests/test_poisoned_rows.py tests/test_layer.py \
        tests/test_nn.py 2>/dev/null | grep "::" >"$dir/ids.txt"
    echo "tests: $(wc -l <"$dir/ids.txt") in $jobs processes"
    for ((i = 0; i < jobs; i++)); do
        awk -v n="$jobs" -v i="$i" 'NR % n == i' "$dir/ids.txt" >"$dir/ids_$i.txt"
        XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(0.9 / $jobs)") \
            python3 -m pytest -q -p no:cacheprovider $(cat "$dir/ids_$i.txt") >"$dir/pytest_$i.log" 2>&1 &
    done
    wait
    tail -n 1 "$dir"/pytest_*.log | tee "$dir/summary.txt"
}

run_bench() {
    python3 experiments/bench_selection.py --sizes 8192,16384,32768 --impls reference,xla,pallas \
        --reps 5 --out "$out/bench_selection" 2>&1 | tee "$out/bench_selection.log"
    python3 experiments/bench_attention.py --seq 32768 --heads 64 --impls pallas xla cudnn \
        --reps 6 --out "$out/bench_attention" 2>&1 | tee "$out/bench_attention.log"
}

run_reproduce() {
    python3 experiments/reproduce.py --preset h200 --sizes 8192,16384,32768 --reps 3 \
        --out "$out/reproduce" 2>&1 | tee "$out/reproduce.log"
}

for part in "${parts[@]}"; do
    case "$part" in
    tests) run_tests ;;
    bench) run_bench ;;
    reproduce) run_reproduce ;;
    *) echo "unknown part '$part': choose from tests, bench, reproduce" >&2; exit 2 ;;
    esac
done
