#!/usr/bin/env bash
# One device call on the lent H200: kernel + model tests natively on the GPU, then the GEMM
# benchmark, the training step of every method at one batch (no cap) and a profile of pact's
# step. Needs .whl/ (zarr and its deps, liger-kernel, bitsandbytes; see ../shared/DESIGN.md).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/pact
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py tests/test_model.py 2>&1 | tail -15 | tee $OUT/gpu_tests.txt
python3 benchmarks/bench_gemm.py --tokens 8192 --csv-out $OUT/gemm_1b.csv 2>&1 | tee $OUT/gemm.txt
(cd benchmarks && python3 bench_train.py --model ${MODEL:-llama-1b} --batch ${BATCH:-16} \
  --methods ${METHODS:-pact-fp8,pact-bf16,peft,qlora,liger} --profile \
  --json-out $OUT/train.json --csv-out $OUT/train.csv) 2>&1 | tee $OUT/train.txt
