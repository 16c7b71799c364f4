"""`pact-train --calibrate`: GPTQ on the run's own training texts before it trains, into
RUN/calibrated/ (the artifact the run then trains on, and that its train_config.json names).

Measured downstream (BENCHMARKS.md "Calibration downstream"), calibrating on the task's own
training texts is what brings LoRA on NVFP4 weights level with BF16 LoRA; this makes it one flag."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

from pact.formats import PactError, open_artifact
from pact.runtime.data import read_records
from pact.runtime.runfolder import CALIBRATED, _prepare_run, run_lock

from .calibrate import calibrate

log = logging.getLogger(__name__)

SAMPLES, SEQ_LEN = 128, 512  # the first 128 training records, at most 512 tokens each (or --max-len)


def calibration_texts(data: str, split: str | None, samples: int) -> str:
    """The first ``samples`` records of the training data as JSON lines, in the forms pact-train reads
    (pact-calibrate joins prompt and completion, renders messages), so any --data works."""
    records = read_records(data, "--data", split)[:samples]
    return "".join(json.dumps({k: v for k, v in r.items() if k != "_where"}, sort_keys=True, default=str) + "\n"
                   for r in records)


def calibrate_for_run(artifact: str, data: str, run: str | os.PathLike, *, split: str | None = None,
                      samples: int = SAMPLES, seq_len: int = SEQ_LEN, resume: bool = False,
                      device: str | None = None, progress: bool = True) -> Path:
    """RUN/calibrated/: ``artifact`` calibrated with GPTQ on the first ``samples`` records of ``data``
    (reused as it is when it was made from the same artifact, texts and settings)."""
    if samples < 1:
        raise PactError(f"--calibrate-samples must be >= 1, got {samples}")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise PactError("--calibrate under torchrun: calibrate once first (pact-calibrate ARTIFACT --prompts "
                        "TRAIN.jsonl --out CALIBRATED/), then torchrun pact-train CALIBRATED/ without --calibrate")
    run = Path(run)
    out, source = run / CALIBRATED, open_artifact(artifact).path.resolve()  # a URL: its cached folder
    if source == out.resolve():
        raise PactError(f"{artifact} is this run's own calibrated artifact: give the artifact it was made from, "
                        "or drop --calibrate")
    body = calibration_texts(data, split, samples)
    digest = hashlib.sha256(body.encode()).hexdigest()
    label = f"pact-train --calibrate: the first {samples} records of --data {data}, <= {seq_len} tokens each"
    _prepare_run(run, resume)  # a finished run is refused before a minute of GPTQ, not after
    with run_lock(run):
        done = _recorded(out)
        if done.get("from_artifact") == str(source) and done.get("prompts_sha256") == digest and done.get(
                "prompts") == label:
            log.info("--calibrate: reusing %s (same artifact, texts and settings)", out)
            return out
        with tempfile.TemporaryDirectory(prefix="pact-calibration-texts-") as tmp:
            texts = Path(tmp) / "train-texts.jsonl"
            texts.write_text(body, encoding="utf-8")
            calibrate(artifact, texts, out, max_samples=samples, seq_len=seq_len, device=device,
                      overwrite=out.exists(), progress=progress, prompts_label=label)
    meta = open_artifact(out).meta["provenance"]["calibration"]
    log.info("--calibrate: %d texts, %s s -> %s", meta["samples"], meta.get("seconds"), out)
    return out


def _recorded(out: Path) -> dict:
    """The calibration an existing RUN/calibrated/ records ({} if none, or unreadable)."""
    try:
        return dict(open_artifact(out).meta["provenance"]["calibration"])
    except (PactError, OSError, KeyError, ValueError):
        return {}
