#!/usr/bin/env bash
# One device call (carry .whl: zarr + deps, liger-kernel, bitsandbytes): GPU tests, the GEMMs,
# the row kernels at the default chunk, then the 1B training step (seq 1024, 3 timed steps) of
# pact fp8 with and without resident E4M3 weights and pact bf16-decode at bs 16 next to PEFT +
# Liger (the same-batch target), and at the 16 GiB cap's batches (pact bs 24 / 20, Liger bs 6).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/pact
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py tests/test_model.py 2>&1 | tail -6 | tee $OUT/gpu_tests.txt
timeout 120 python3 benchmarks/bench_gemm.py --tokens 8192 --csv-out $OUT/gemm_1b.csv > $OUT/gemm.txt 2>&1
(cd benchmarks && timeout 60 python3 bench_rows.py --tokens 16384 --chunks 4096 --warps 8) > $OUT/rows.txt 2>&1
cd benchmarks
run() { timeout $1 python3 bench_train.py --model llama-1b --warmup 1 --iters 3 "${@:2}" 2>&1 | grep --line-buffered "^{" ; }
run 150 --batch 16 --methods pact-fp8,pact-fp8res,pact-bf16 --csv-out $OUT/bs16_pact.csv
run 60 --batch 16 --methods liger --csv-out $OUT/bs16_liger.csv
run 150 --batch 20,24 --methods pact-fp8,pact-fp8res --csv-out $OUT/cap_pact.csv
run 60 --batch 6 --methods liger --csv-out $OUT/cap_liger.csv
cd ..
tail -3 $OUT/rows.txt
grep -E "^(proj|qkv|o |gate_up|down)" $OUT/gemm.txt | grep -E "proj|decode|encode|fp8|cublas_bf16|ahat"
