#!/usr/bin/env bash
# One device call: the GPU tests on this tree, then the training step of this tree against an
# earlier one (BASE, default .before/: `git archive <commit> | tar -x -C .before`, carried), the
# two interleaved (base, new, base, new, ...) so drift hits both; median step ms per method.
#   carry: .whl .before      env: ROUNDS (2) METHODS (pact-bf16,pact-fp8) BATCH (16)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
BASE=${BASE:-.before}
mkdir -p /tmp/pkg /tmp/pkgb && ln -sfn "$PWD" /tmp/pkg/pact && ln -sfn "$PWD/$BASE" /tmp/pkgb/pact
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
PYTHONPATH=/tmp/pkg:/tmp/site python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels.py tests/test_model.py 2>&1 \
  | tail -15 | tee $OUT/gpu_tests.txt
for round in $(seq 1 ${ROUNDS:-2}); do
  for tree in base new; do
    if [ $tree = base ]; then dir=$BASE pp=/tmp/pkgb; else dir=. pp=/tmp/pkg; fi
    (cd $dir/benchmarks && PYTHONPATH=$pp:/tmp/site python3 bench_train.py --model llama-1b --batch ${BATCH:-16} \
      --methods ${METHODS:-pact-bf16,pact-fp8} --warmup 3 --iters 20 --json-out $OUT/ab-$tree-$round.json) 2>&1 \
      | grep -v '^{' | tail -4
  done
done
python3 - <<'PY'
import glob, json, os, statistics
out = os.environ["OUT"]
rows = {}
for f in sorted(glob.glob(f"{out}/ab-*.json")):
    tree = os.path.basename(f).split("-")[1]
    for r in json.load(open(f)):
        if "step_ms" in r:
            rows.setdefault((r["method"], r["bs"]), {}).setdefault(tree, []).append(r["step_ms"])
print(f"\n{'method':<12}{'bs':>4}{'base ms':>10}{'new ms':>10}{'new/base':>10}   (median over rounds; each a median of 20 steps)")
for (m, bs), t in sorted(rows.items()):
    b, n = statistics.median(t.get("base", [float("nan")])), statistics.median(t.get("new", [float("nan")]))
    print(f"{m:<12}{bs:>4}{b:>10.1f}{n:>10.1f}{n / b:>10.3f}   base {t.get('base')} new {t.get('new')}")
PY
