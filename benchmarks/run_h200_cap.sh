#!/usr/bin/env bash
# One device call: every method's best tokens/s under a 16 GiB cap (Llama-3.2-1B shapes).
# Needs .whl/ with zarr's wheels and liger-kernel.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/pact
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 OUT=${OUT:-/tmp/out}
cd benchmarks && python3 bench_train.py --model ${MODEL:-llama-1b} --memory-cap-gib 16 --warmup 1 --iters 3 \
  --methods ${METHODS:-pact,pact-ckpt,peft,peft-ckpt,liger,liger-ckpt} --json-out $OUT/cap16.json 2>&1 | tee $OUT/cap16.txt
