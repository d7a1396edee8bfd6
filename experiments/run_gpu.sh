#!/usr/bin/env bash
# Run the GPU test subset and/or the headline benchmarks on one NVIDIA GPU, from the repo root,
# with logs and records under OUTDIR. Nothing is installed: the machine needs jax with CUDA,
# flax, optax, orbax, matplotlib, tqdm and pytest.
#
#   bash experiments/run_gpu.sh OUTDIR [tests] [bench] [mla] [mosaic] [parts] [fp8]
#                                      [layer_parts] [layers] [profile] [locality] [reproduce]
#                                      [learn] [offload]
#   (default: tests bench)
#
#   tests      the compiled kernels' tests, the layer, MLA model and poisoned-row tests, in $JOBS
#              pytest-xdist processes (default 16); log in OUTDIR/tests.log.
#   bench      bench_selection at T = 8K-32K (reference, xla, pallas, and the hytopk BlockSizes
#              in $SEL_SIZES as extra columns; default: none) and bench_attention at T = 32K,
#              H = 64 (pallas, xla, cuDNN), each in its own process.
#   fp8        bench_selection at T = 32K, bf16 and FP8 inputs, HI = 32 and 64 (reference, pallas,
#              and pallas in index order).
#   mla        bench_attention --mla at T = 32K, H = 64 and 128 (pallas, the portable xla path,
#              cuDNN dense in MLA's non-absorbed form), with the BlockSizes in $MLA_SIZES as extra
#              variants (default: none; MLA_SIZES=forward_kernel=triton times the Triton forward
#              beside the default); $MLA_IMPLS replaces the list (e.g. "pallas cudnn"; the mosaic
#              part's default is that).
#   mosaic     the Mosaic GPU kernels (Hopper): their compiled tests (the MLA forward and dQ
#              kernels against the Triton ones, and the CPU tests), then bench_attention --mla at
#              T = 32K, H = 64 and 128 with the Triton dQ kernel (BlockSizes dq_kernel=triton)
#              beside the default (the Mosaic one).
#   parts      experiments/lab/attention_parts.py at T = 32K, H = 64: each MLA kernel timed alone
#              (forward, delta, dQ, key gradients), with the BlockSizes in $PARTS_SIZES as
#              variants (default: none).
#   layer_parts  bench_layer_parts.py for GLM-5.1's layer at 32K (selection, attention, indexer
#              loss and the whole block, each timed alone).
#   layers     reproduce.py --only layer for the paper's models in $LAYER_PRESETS (default:
#              glm-5.1 deepseek-v3.2) at the lengths in $LAYER_SIZES (default 8K-128K), each
#              within $LAYER_BUDGET seconds (default 280): time and memory of hyscale/replay,
#              materialized/full and dense/full (cuDNN), or of the modes in $LAYER_MODES (e.g.
#              "hyscale/replay hyscale/replay+target+index dense/full": reproduce.py's remat
#              options +offload, +target, +index), every mode's SwiGLU in chunks of
#              $MLP_CHUNK tokens (default 16384, so that 128K fits an 80 GB card; 0: unchunked).
#              A point takes 10-75 s with its compile (one H100): one preset's five lengths
#              take ~5-10 minutes; LAYER_PRESETS, LAYER_SIZES and LAYER_MODES run less.
#   profile    experiments/lab/layer_profile.py: one layer of $PROFILE_PRESET (default glm-5.1)
#              at T = $PROFILE_T (default 32768), hyscale/replay and dense/full (or the modes in
#              $PROFILE_MODES, e.g. "hyscale/replay hyscale/replay+target dense/full"), the
#              SwiGLU in 16K-token chunks: the GPU's kernel time per step by group, from a
#              profiler trace.
#   locality   experiments/lab/index_locality.py at T = $LOCALITY_T (default 32768): the sparse
#              attention's and the indexer loss's forward+backward over five index patterns
#              (random, GLM-5.1's own selection in score order, index order, shuffled, and its
#              query rows in a stride order), with how the rows share keys.
#   reproduce  reproduce.py --preset h200 at T = 8K-32K (layer and end to end).
#   learn      train.py --preset h200-retrieval into runs/train/h200-retrieval$LEARN_TAG, with
#              the flags in $LEARN_ARGS (e.g. LEARN_ARGS="--attention dense --remat full"
#              LEARN_TAG=-dense; default: none), resumed when a checkpoint is there, stopped
#              with a checkpoint after $TRAIN_S seconds (default 400; repeat the part on the same
#              machine to continue: the checkpoint, ~120 MB with the optimizer state, stays in
#              runs/), its metrics copied to OUTDIR/train$LEARN_TAG; then replay_fidelity.py on
#              that run if its attention is hyscale (bf16: the entries the backward's recomputed
#              selection changes under plain jax.checkpoint, against selection replay).
#              experiments/compare_runs.py OUTDIR/train OUTDIR/train-TAG ... compares runs.
#   offload    reproduce.py --preset h200 --only e2e --offload-indices at T = 512K and 1M (or the
#              lengths in $OFFLOAD_SIZES, comma-separated): the training step with the saved
#              indices in pinned host memory, against replay alone, both with the SwiGLU run in
#              chunks of $MLP_CHUNK tokens (default 65536; 0: unchunked), JAX's memory pool at
#              95% of the card and XLA's xla_gpu_enable_host_memory_offloading on, as the 1M step
#              ran on an 80 GB card (XLA_PYTHON_CLIENT_MEM_FRACTION and XLA_FLAGS override them);
#              NO_WARMUP=1 times each point's first step (no warm-up step: steps of minutes).
set -uo pipefail
out=${1:?usage: bash experiments/run_gpu.sh OUTDIR [tests] [bench] [mla] [mosaic] [parts] [fp8] [layer_parts] [layers] [profile] [locality] [reproduce] [learn] [offload]}
shift
if [ $# -eq 0 ]; then parts=(tests bench); else parts=("$@"); fi
export PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p "$out"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee "$out/env.txt"

mlp_chunk_args() {
    # chunk=(--mlp-chunk N) from $MLP_CHUNK, or the default $1 where it is unset or empty;
    # 0 (or no default): unchunked.
    local n=${MLP_CHUNK:-$1}
    chunk=()
    if [ -n "$n" ] && [ "$n" != 0 ]; then chunk=(--mlp-chunk "$n"); fi
}

run_tests() {
    # The compiled kernels' tests (the interpret-mode ones are CPU tests), in $JOBS processes
    # (pytest-xdist: Triton compiles on one CPU core per process), none of which preallocates
    # the GPU's memory. $TESTS overrides the list of files / node ids.
    local tests=(${TESTS:-tests/test_sparse_attention_pallas.py::TestCompiledGPU
        tests/test_mla_attention.py::TestCompiledGPU tests/test_sparse_attention_mosaic.py
        tests/test_indexer_loss_pallas.py::TestCompiledGPU
        tests/test_relaxed_atomics.py tests/test_poisoned_rows.py tests/test_hytopk_pallas.py
        tests/test_fp8_selection.py tests/test_layer.py tests/test_mla_model.py})
    XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -v -n "${JOBS:-16}" -p no:cacheprovider \
        -p no:benchmark --durations=20 -k "not interpret" "${tests[@]}" 2>&1 | tee "$out/tests.log"
}

run_bench() {
    # shellcheck disable=SC2086  # SEL_SIZES is a list of specs
    python3 experiments/bench_selection.py --seq 8192 16384 32768 --impls reference xla pallas \
        --sizes ${SEL_SIZES:-} --reps 5 --out "$out/bench_selection" \
        2>&1 | tee "$out/bench_selection.log"
    python3 experiments/bench_attention.py --seq 32768 --heads 64 --impls pallas xla cudnn \
        --reps 6 --out "$out/bench_attention" 2>&1 | tee "$out/bench_attention.log"
}

run_fp8() {
    python3 experiments/bench_selection.py --seq 32768 --impls reference pallas --reps 5 \
        --index-order --dtype bfloat16 float8_e4m3fn --index-heads 32 64 \
        --out "$out/bench_selection_fp8" 2>&1 | tee "$out/bench_selection_fp8.log"
}

run_mla() {
    # shellcheck disable=SC2086  # MLA_IMPLS and MLA_SIZES are lists
    python3 experiments/bench_attention.py --mla --seq 32768 --heads 64 128 \
        --impls ${MLA_IMPLS:-pallas xla cudnn} --reps 5 --sizes ${MLA_SIZES:-} \
        --out "$out/bench_attention_mla" 2>&1 | tee "$out/bench_attention_mla.log"
}

run_mosaic() {
    TESTS="tests/test_mla_attention.py::TestCompiledGPU tests/test_sparse_attention_mosaic.py" \
        JOBS=${JOBS:-8} run_tests
    MLA_IMPLS=${MLA_IMPLS:-pallas cudnn} MLA_SIZES="dq_kernel=triton ${MLA_SIZES:-}" run_mla
}

run_parts() {
    # shellcheck disable=SC2086  # PARTS_SIZES is a list of specs
    python3 experiments/lab/attention_parts.py --seq 32768 --heads 64 --sizes ${PARTS_SIZES:-} \
        --out "$out/parts" 2>&1 | tee "$out/parts.log"
}

run_layer_parts() {
    python3 experiments/bench_layer_parts.py --preset glm-5.1 --T 32768 --reps 3 \
        --out "$out/layer_parts" 2>&1 | tee "$out/layer_parts.log"
}

run_layers() {
    local chunk preset modes=()
    mlp_chunk_args 16384
    # shellcheck disable=SC2206  # LAYER_MODES is a list of modes
    if [ -n "${LAYER_MODES:-}" ]; then modes=(--modes $LAYER_MODES); fi
    for preset in ${LAYER_PRESETS:-glm-5.1 deepseek-v3.2}; do
        python3 experiments/reproduce.py --preset "$preset" --only layer \
            --sizes "${LAYER_SIZES:-8192,16384,32768,65536,131072}" --reps 2 \
            --budget-s "${LAYER_BUDGET:-280}" ${chunk[@]+"${chunk[@]}"} ${modes[@]+"${modes[@]}"} \
            --out "$out/layers_$preset" 2>&1 | tee "$out/layers_$preset.log"
    done
}

run_profile() {
    local modes=()
    # shellcheck disable=SC2206  # PROFILE_MODES is a list of modes
    if [ -n "${PROFILE_MODES:-}" ]; then modes=(--modes $PROFILE_MODES); fi
    python3 experiments/lab/layer_profile.py --preset "${PROFILE_PRESET:-glm-5.1}" \
        --T "${PROFILE_T:-32768}" ${modes[@]+"${modes[@]}"} --out "$out/profile" 2>&1 |
        tee "$out/profile.log"
}

run_locality() {
    python3 experiments/lab/index_locality.py --T "${LOCALITY_T:-32768}" --out "$out/locality" \
        2>&1 | tee "$out/locality.log"
}

run_reproduce() {
    python3 experiments/reproduce.py --preset h200 --sizes 8192,16384,32768 --reps 3 \
        --out "$out/reproduce" 2>&1 | tee "$out/reproduce.log"
}

run_learn() {
    local tag=${LEARN_TAG:-} resume=() extra=()
    local run=runs/train/h200-retrieval$tag
    # shellcheck disable=SC2206  # LEARN_ARGS is a list of flags
    extra=(${LEARN_ARGS:-})
    # A resumed run keeps its saved configuration: LEARN_ARGS applies to a new run.
    if [ -d "$run/ckpt" ]; then resume=(--resume); extra=(); fi
    # SIGTERM makes train.py save a checkpoint and stop; --resume continues from it exactly.
    timeout -s TERM -k 60 "${TRAIN_S:-400}" python3 experiments/train.py --preset h200-retrieval \
        --no-progress --out "$run" ${resume[@]+"${resume[@]}"} ${extra[@]+"${extra[@]}"} \
        2>&1 | tee "$out/train$tag.log"
    mkdir -p "$out/train$tag"
    cp "$run"/config.json "$run"/metrics.jsonl "$run"/metrics.png "$out/train$tag/" 2>/dev/null
    # Replay fidelity observes HyScale's selection: only for runs whose attention is hyscale.
    python3 -c "import json, sys; sys.exit(json.load(open('$run/config.json'))['model']['attention'] != 'hyscale')" &&
        python3 experiments/replay_fidelity.py --run "$run" --dtypes bfloat16 --batches 1 \
            --batch-size 1 --out "$out/replay_fidelity$tag" 2>&1 | tee "$out/replay_fidelity$tag.log"
}

run_offload() {
    local chunk flags=${XLA_FLAGS:-} warm=()
    mlp_chunk_args 65536
    if [ "${NO_WARMUP:-0}" != 0 ]; then warm=(--no-warmup); fi
    if [[ $flags != *xla_gpu_enable_host_memory_offloading* ]]; then
        flags="${flags:+$flags }--xla_gpu_enable_host_memory_offloading=true"
    fi
    XLA_FLAGS=$flags XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95} \
        python3 experiments/reproduce.py --preset h200 --only e2e --offload-indices ${chunk[@]+"${chunk[@]}"} \
        ${warm[@]+"${warm[@]}"} --sizes "${OFFLOAD_SIZES:-524288,1048576}" --reps 1 --out "$out/offload" 2>&1 | tee "$out/offload.log"
}

for part in "${parts[@]}"; do
    case "$part" in
    tests) run_tests ;;
    bench) run_bench ;;
    mla) run_mla ;;
    mosaic) run_mosaic ;;
    parts) run_parts ;;
    fp8) run_fp8 ;;
    layer_parts) run_layer_parts ;;
    layers) run_layers ;;
    profile) run_profile ;;
    locality) run_locality ;;
    reproduce) run_reproduce ;;
    learn) run_learn ;;
    offload) run_offload ;;
    *) echo "unknown part '$part': choose from tests, bench, mla, mosaic, parts, fp8, layer_parts, layers, profile, locality, reproduce, learn, offload" >&2; exit 2 ;;
    esac
done
