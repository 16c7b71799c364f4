#!/usr/bin/env bash
# A short device call: GPU tests, then the 1B step at the 16 GiB cap's best batches (pact-fp8 bs 24,
# PEFT + Liger bs 6) in the same call, and pact with the other row-kernel chunk choice.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/pact
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 OUT=${OUT:-/tmp/out}
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py tests/test_model.py 2>&1 | tail -4 | tee $OUT/gpu_tests.txt
cd benchmarks
run() { timeout $1 python3 bench_train.py --model llama-1b --warmup 1 --iters 3 "${@:2}" 2>&1 | grep -v Warn | tail -2; }
PACT_ROW_CHUNK=2048 PACT_ROW_WARPS=8 run 110 --batch 24 --methods pact-fp8 --csv-out $OUT/pact_chunk2048.csv
run 60 --batch 6 --methods liger --csv-out $OUT/liger.csv
PACT_ROW_CHUNK=4096 PACT_ROW_WARPS=8 run 50 --batch 24 --methods pact-fp8 --csv-out $OUT/pact_chunk4096.csv
