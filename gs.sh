#!/usr/bin/env bash
# usage: bash gs.sh PART  (writes $OUT)
set -o pipefail; export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
O=/tmp/o; mkdir -p $O
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/env.txt
git log -1 --format=%h | tee -a $OUT/env.txt
case "$1" in
A)
  TESTS="tests/test_mla_attention.py::TestCompiledGPU tests/test_indexer_loss_pallas.py::TestCompiledGPU tests/test_sparse_attention_pallas.py::TestCompiledGPU" \
    timeout 180 bash experiments/run_gpu.sh $O/t tests >/dev/null 2>&1; cp $O/t/tests.log $OUT/
  grep -E "PASSED|FAILED|ERROR|passed|failed" $OUT/tests.log | tail -40
  unset XLA_PYTHON_CLIENT_PREALLOCATE
  timeout 200 python3 experiments/bench_attention.py --mla --seq 32768 --heads 64 --impls pallas cudnn --reps 5 \
    --sizes block_h=16,num_warps=4,num_stages=2 block_h_dkv=64,block_h_dkv_chunk=32 block_h_dkv=32,block_h_dkv_chunk=16 \
    --out $O/bam 2>&1 | tee $OUT/bench_attention_mla.log | grep -v "^ *check"
  timeout 185 python3 experiments/reproduce.py --preset glm-5.1 --only layer --sizes 8192,16384,32768 --reps 3 \
    --budget-s 140 --out $O/rep 2>&1 | tee $OUT/reproduce_glm.log | tail -20
  ;;
B)
  unset XLA_PYTHON_CLIENT_PREALLOCATE
  timeout 200 python3 experiments/reproduce.py --preset deepseek-v3.2 --only layer --sizes 8192,16384,32768 --reps 3 \
    --budget-s 150 --out $O/rep 2>&1 | tee $OUT/reproduce_dsv.log | tail -20
  timeout 230 python3 experiments/reproduce.py --preset glm-5.1 --only layer --sizes 65536,131072 --reps 2 \
    --budget-s 170 --out $O/rep2 2>&1 | tee $OUT/reproduce_glm_long.log | tail -20
  timeout 120 python3 experiments/lab/mla_forward.py --seq 32768 --heads 64 128 \
    --variants lib:block_h=16,num_warps=4,num_stages=2 lib:block_k=64,num_stages=2 lib:block_k=16,num_stages=5 \
    --out $O/mf 2>&1 | tee $OUT/mla_forward.log | tail -12
  ;;
C)
  unset XLA_PYTHON_CLIENT_PREALLOCATE
  timeout 420 python3 experiments/reproduce.py --preset h200 --only e2e --offload-indices --sizes 1048576 --reps 1 \
    --out $O/off 2>&1 | tee $OUT/reproduce_1m.log | tail -20
  timeout 150 python3 experiments/bench_selection.py --seq 32768 --impls reference pallas --reps 5 \
    --dtype bfloat16 float8_e4m3fn --index-heads 32 64 --out $O/fp8 2>&1 | tee $OUT/fp8.log | tail -12
  ;;
esac
tar czf $OUT/o.tgz -C /tmp o
