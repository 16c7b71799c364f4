"""The demo task: Rotten Tomatoes sentiment on SmolLM2-135M-Instruct, both from PyPI wheels
(packaged.py). Deterministic splits, the cache folders' names, and the loss plots; `pact demo`
(pipelines/demo.py) and the accuracy / fidelity benchmarks use these."""

from __future__ import annotations

import bz2
import csv
import io
import json
import random
from pathlib import Path
from typing import Callable

from pact.formats import ArtifactError, open_artifact
from pact.runtime.recipe import parse_recipe

PROMPT = "Review: {text}\nSentiment:"
# 40 steps is one short pass: at 2e-4 the adapter learned the answer format but not the
# sentiment (51.5% held-out, below zero-shot); at 1e-3 it reached 67% (BENCHMARKS.md)
LR = 1e-3
TRAIN_SIZE, STEPS = 640, 80  # one pass over the training snippets at batch 8
ARTIFACT_VARIANT = "1d-mse"  # the converter's defaults (--scaling 1d --block-scales mse): names the cache folder


def cached_artifact(path: Path, make: Callable[[Path], Path], echo: Callable[[str], None] = print) -> Path:
    """``path`` when it holds an artifact that verifies, else ``make(path)`` (which writes it)."""
    try:
        open_artifact(path).verify()
        echo(f"reusing {path} (verified)")
        return path
    except ArtifactError:
        return make(path)


def splits(csv_bz2: Path, folder: Path, n_train: int, n_test: int, n_calib: int, seed: int = 0) -> tuple[Path, ...]:
    """Deterministic disjoint train / test / calibration files from the labelled snippets: test is
    the first n_test of one shuffle, train the next n_train, calibration the next n_calib. A
    file's name says where it starts (train and calibration move with the splits before them),
    so a cached file is only reused for the same content."""
    paths = (folder / f"rt-train-{n_train}-at{n_test}.jsonl", folder / f"rt-test-{n_test}.jsonl",
             folder / f"rt-calib-{n_calib}-at{n_test + n_train}.jsonl")
    if all(p.is_file() for p in paths):
        return paths
    folder.mkdir(parents=True, exist_ok=True)
    with io.TextIOWrapper(bz2.open(csv_bz2), encoding="utf-8") as f:
        rows = [r for r in csv.DictReader(f) if r["category"] in ("fresh", "rotten")]
    random.Random(seed).shuffle(rows)
    test, train_rows = rows[:n_test], rows[n_test : n_test + n_train]
    calib = rows[n_test + n_train : n_test + n_train + n_calib]

    def write(path: Path, recs: list[dict]) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in recs))
        tmp.replace(path)

    labelled = [[{"prompt": PROMPT.format(text=r["text"]), "completion": " " + r["category"]} for r in part]
                for part in (train_rows, test)]
    write(paths[0], labelled[0])
    write(paths[1], labelled[1])
    write(paths[2], [{"text": PROMPT.format(text=r["text"]) + " " + r["category"]} for r in calib])
    return paths


def gptq_dir(workdir: Path, calib_f: Path) -> Path:
    """The calibrated artifact's cache folder, keyed by its calibration file (count and start)."""
    # and by the recipe calibration ran (its Hessians see the GEMM inputs that recipe feeds)
    return workdir / (f"smollm2-135m-nvfp4-{ARTIFACT_VARIANT}-gptq{calib_f.stem.removeprefix('rt-calib-')}"
                      f"-{parse_recipe(None).spec()}")


def sparkline(values: list[float], width: int = 40) -> str:
    if not values:
        return ""
    step = max(1, len(values) // width)
    pts = [sum(values[i : i + step]) / len(values[i : i + step]) for i in range(0, len(values), step)]
    lo, hi = min(pts), max(pts)
    bars = "▁▂▃▄▅▆▇█"
    return "".join(bars[int((p - lo) / (hi - lo + 1e-12) * (len(bars) - 1))] for p in pts)


def loss_png(losses: list[float], path: Path) -> Path | None:
    """The training loss as a PNG (written to a temp name, then renamed); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, lw=1.5)
    ax.set(xlabel="step", ylabel="training loss (completion tokens)", title="pact demo: LoRA on NVFP4 SmolLM2-135M")
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path


def majority(test_f: Path) -> float:
    labels = [json.loads(line)["completion"] for line in test_f.read_text().splitlines()]
    return max(labels.count(c) for c in set(labels)) / len(labels)


def cached_score(folder: Path, artifact: Path, data: Path, adapter: Path | None, compute, echo) -> dict:
    """``compute()``'s scores, kept in ``folder`` under the sha256 of what decides them: the
    artifact's fingerprint, the data file, the adapter's files and pact's default recipe; a second
    demo reuses them."""
    import hashlib

    from pact.formats.files import sha256_file

    parts = [open_artifact(artifact).fingerprint(), sha256_file(data), parse_recipe(None).spec(), "score-1"]
    if adapter is not None:
        parts += [sha256_file(adapter / f) for f in ("adapter_model.safetensors", "adapter_config.json")]
    path = folder / (hashlib.sha256("\n".join(parts).encode()).hexdigest() + ".json")
    if path.is_file():
        echo(f"reusing scores {path}")
        return json.loads(path.read_text())
    result = compute()
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)
    return result
