#!/usr/bin/env bash
# One device call: every method's best tokens/s under a 16 GiB cap.
#   MODEL=llama-3b METHODS=pact-fp8,liger-ckpt CAP_BATCHES=1,2,4,8,16,24 bash benchmarks/run_h200_cap.sh
# Needs .whl/ with zarr's wheels, liger-kernel and bitsandbytes.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/pact
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 OUT=${OUT:-/tmp/out}
M=${MODEL:-llama-1b}
cd benchmarks && python3 bench_train.py --model $M --memory-cap-gib 16 --warmup 1 --iters 3 \
  --methods ${METHODS:-pact-fp8,pact-fp8-ckpt,pact-bf16,peft,peft-ckpt,qlora,qlora-ckpt,liger,liger-ckpt} \
  ${CAP_BATCHES:+--cap-batches $CAP_BATCHES} --json-out $OUT/cap16_$M.json --csv-out $OUT/cap16_$M.csv 2>&1 | tee $OUT/cap16_$M.txt
