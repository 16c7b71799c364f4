"""pact-train's calibration (its default; `--calibrate` insists): GPTQ on the run's own training
texts before it trains, into RUN/calibrated/ (the artifact the run then trains on, and that its
train_config.json names).

Measured downstream (BENCHMARKS.md "Calibration downstream"), calibrating on the task's own
training texts is what brings LoRA on NVFP4 weights level with BF16 LoRA; so pact-train does it
unless it cannot (`auto_calibrate` says why)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from pact.formats import Artifact, PactError, check_apart, default_cache, open_artifact
from pact.formats.files import recover_aside, sha256_file, sweep_leftovers
from pact.formats.layout import is_artifact
from pact.runtime.data import parse_record, read_records
from pact.runtime.distributed import env_world
from pact.runtime.evaluate import run_record, trained_on_own_calibrated
from pact.runtime.runfolder import CALIBRATED, _is_new, _prepare_run, made_for_run, run_lock

from .calibrate import calibrate

log = logging.getLogger(__name__)

SAMPLES, SEQ_LEN = 128, 512  # the first 128 training records, at most 512 tokens each (or --max-len)
# the default calibrates only on at least this many records: its gain was measured with 128, and GPTQ
# fitted to a handful of texts moves weights for those alone (texts from elsewhere trained worse than none)
MIN_RECORDS = 32


def texts_sha256(body: str) -> str:
    """What a run's calibration records as its prompts' sha256 (of calibration_texts' body)."""
    return hashlib.sha256(body.encode()).hexdigest()


def check_samples(samples: int) -> None:
    """--calibrate-samples: at least one record (pact-train checks it before deciding to calibrate)."""
    if samples < 1:
        raise PactError(f"--calibrate-samples must be >= 1, got {samples}")


def calibration_texts(data: str, split: str | None, samples: int) -> tuple[str, int]:
    """The first ``samples`` records of the training data as JSON lines (and how many), in the forms
    pact-train reads (pact-calibrate joins prompt and completion, renders messages), so any --data
    works; a record in none of those forms is refused here, naming --data's file and line (pact-train
    tokenizes every record before calling this, which also checks types and empty completions)."""
    records = read_records(data, "--data", split, limit=samples)
    for r in records:
        parse_record(r, text=True)  # (raw {text} records train on every token: calibrate on them as they are)
    body = "".join(json.dumps({k: v for k, v in r.items() if k != "_where"}, sort_keys=True, default=str) + "\n"
                   for r in records)
    return body, len(records)


def calibrate_for_run(artifact: str, data: str, run: str | os.PathLike, *, split: str | None = None,
                      samples: int = SAMPLES, seq_len: int = SEQ_LEN, resume: bool = False,
                      device: str | None = None, progress: bool = True,
                      announce: Callable[[], None] | None = None, correct_rank: int | None = None) -> Path:
    """RUN/calibrated/: ``artifact`` calibrated with GPTQ on the first ``samples`` records of ``data``
    (``announce``: called when GPTQ starts, not on a reuse)
    (reused as it is when it was made from the same artifact's weights, texts and settings and is
    intact). With ``resume``, a run that has trained keeps its calibrated/ or is refused.
    ``correct_rank``: the rank of the frozen correction fitted beside GPTQ (pact-calibrate --correct-rank);
    None keeps the artifact's own (0 when it has none)."""
    check_samples(samples)
    if env_world() > 1:
        flag, extra = (("--calibrate-correct-rank", f" --correct-rank {correct_rank}") if correct_rank is not None
                       else ("--calibrate", ""))
        raise PactError(f"{flag} under torchrun: calibrate once first (pact-calibrate ARTIFACT --prompts "
                        f"TRAIN.jsonl{extra} --out CALIBRATED/), then torchrun pact-train CALIBRATED/ without {flag}")
    run = Path(run)
    out, art = run / CALIBRATED, open_artifact(artifact)  # a URL: its cached folder
    if art.path.resolve() == out.resolve():
        raise PactError(f"{artifact} is this run's own calibrated artifact: give the artifact it was made from, "
                        "or drop --calibrate")
    check_apart(run, {"artifact": art.path}, "pact-train")
    body, n = calibration_texts(data, split, samples)
    digest = texts_sha256(body)
    want = {"artifact_fingerprint": art.fingerprint(), "records": n, "seq_len": seq_len}
    # an artifact with a low-rank correction is calibrated again with one of the same rank, unless asked otherwise
    own = (art.meta["provenance"].get("calibration") or {}).get("correct_rank", 0)
    rank = own if correct_rank is None else correct_rank
    if rank != own:  # (recorded only then: runs calibrated before the option existed are still reused)
        want["correct_rank"] = rank
    _check_source(art, artifact, data)
    recover_aside(out, "the run's calibrated artifact", is_artifact)  # (before overwrite= is decided from it)
    _check_ours(out)
    created = not run.exists()
    _prepare_run(run, resume)  # a finished run is refused before a minute of GPTQ, not after
    with run_lock(run):  # (another pact-train in this --out: refused here, and nothing of its removed)
        try:
            _check_ours(out)  # again under the lock
            existing = _opened(out)
            done = _recorded(existing)
            same = done.get("for_run") == want and done.get("prompts_sha256") == digest
            if resume and not _is_new(run):  # its checkpoints learned on the weights it trained on
                had = done.get("correct_rank", 0)
                _check_resume(run, out, same, f"a rank-{had} correction where these settings ask for rank {rank} "
                              f"(--calibrate-correct-rank; default: the artifact's own, {own})" if had != rank else "")
            if same and _intact(existing):
                sweep_leftovers(out)  # what a killed recalibration left beside it
                log.info("calibration: reusing %s (same artifact, texts and settings)", out)
                return out
            if announce is not None:  # said when GPTQ really starts, not before a reuse
                announce()
            with tempfile.TemporaryDirectory(prefix="pact-calibration-texts-") as tmp:
                texts = Path(tmp) / "train-texts.jsonl"
                texts.write_text(body, encoding="utf-8")
                calibrate(artifact, texts, out, max_samples=n, seq_len=seq_len, device=device, correct_rank=rank,
                          overwrite=out.exists(), progress=progress, record={"for_run": want},
                          prompts_label=f"pact-train: the first {n} records of --data {data}"
                                        f"{f' (split {split})' if split else ''}, <= {seq_len} tokens each")
        except BaseException:
            if created and not any(p.name != ".lock" for p in run.iterdir()):
                shutil.rmtree(run, ignore_errors=True)  # nothing made: no empty --out left behind (the lock is ours)
            raise
    meta = open_artifact(out).meta["provenance"]["calibration"]
    log.info("calibration: %d texts, %.0f s -> %s", meta["samples"], meta["seconds"]["total"], out)
    return out


def auto_calibrate(artifact: str, data: str, run: str | os.PathLike, resume: bool = False,
                   split: str | None = None) -> tuple[bool, str | None]:
    """pact-train's default (neither --calibrate nor --no-calibrate): whether to calibrate ``artifact``
    on the run's --data first, and if not, a note saying why (None when there is nothing to say: the
    artifact was calibrated on this data, or the run resumes on the weights it trained on).
    Calibrated when the artifact is not calibrated, or was calibrated on other texts than --data's
    (measured: the task's own texts train better), and its source model is a local path that is
    there, one process trains, --data has at least MIN_RECORDS records, and (resuming) the run
    trained on its own calibrated/."""
    try:
        art = open_artifact(artifact)  # (a URL: its cached folder, as training opens it)
        prov = art.meta["provenance"]
    except (PactError, OSError, KeyError, ValueError, TypeError):
        return False, None  # training says what is wrong with it
    if "source_quantization" in prov:
        return False, None  # an imported GPTQ checkpoint: trained as it is
    if resume:
        record = run_record(str(run))
        if record:  # a run to continue: on what it trained on, never recalibrated under its checkpoints
            own = trained_on_own_calibrated(record)
            if own and art.path.resolve() == (Path(run) / CALIBRATED).resolve():
                return False, None  # given its calibrated/ (pact-train swaps it in): resumed as it is
            return own, None  # (its calibrated/ gone or other: calibrate_for_run says so)
    other = None
    if "calibration" in prov:
        other = _other_texts(artifact, prov["calibration"], data, split)
        if other is None:
            return False, None  # calibrated on --data's texts already
    why = _cannot_calibrate(artifact, prov, data, split)
    if why is None:
        return True, None
    if other is not None:
        return False, f"{other} ({why})"
    return False, (f"training on {artifact} uncalibrated: {why}. Calibrating on the training texts trained 1.2-2.1 "
                   "points better on the mean of 9 tasks (BENCHMARKS.md \"Calibration downstream\")")


def _cannot_calibrate(artifact: str, prov: dict, data: str, split: str | None) -> str | None:
    """Why the default cannot calibrate ``artifact`` on --data here (None: it can)."""
    src = prov.get("source")
    if env_world() > 1:
        return ("under torchrun each process would calibrate: calibrate once first (pact-calibrate ARTIFACT "
                "--prompts TRAIN.jsonl --out CALIBRATED/) and train on CALIBRATED/")
    if not isinstance(src, str) or not src:
        return "its provenance names no source model to calibrate from (pact-calibrate --source MODEL)"
    if not Path(src).is_absolute():
        return (f"its source model is {src}, not a local path: --calibrate fetches it, or pact-calibrate "
                f"{artifact} --source LOCAL_COPY --prompts TRAIN.jsonl --out CALIBRATED/")
    if _source_gone(prov):
        return (f"its source model {src} is not on this machine: put it back, or pact-calibrate {artifact} "
                "--source MODEL --prompts TRAIN.jsonl --out CALIBRATED/ and train on CALIBRATED/")
    try:
        _, n = calibration_texts(data, split, MIN_RECORDS)
    except (PactError, OSError, ValueError, TypeError):
        return None  # (--data's error is said by the checks before calibration)
    if n < MIN_RECORDS:
        return (f"--data has {n} record{'s' if n != 1 else ''}, fewer than the {MIN_RECORDS} the default "
                "calibrates on (--calibrate calibrates on them anyway)")
    return None


def _other_texts(artifact: str, cal: dict, data: str, split: str | None) -> str | None:
    """A note when a calibrated artifact was calibrated on texts other than --data's: on the tasks
    measured, calibration on the task's own texts trained better than on generic or model-sampled
    ones, and calibration on a handful of texts (fewer than MIN_RECORDS) is not what was measured.
    None when the texts are --data's (its file, or the records pact-train calibrated a run on, at
    least MIN_RECORDS of them) or cannot be compared (--data unreadable here: training says why)."""
    n = cal.get("samples")
    if isinstance(n, int) and n < MIN_RECORDS:
        return (f"{artifact} was calibrated on {n} texts only ({cal.get('prompts', 'other texts')}); the default "
                f"calibrates on up to 128 records of --data (at least {MIN_RECORDS}), and pact-train calibrates it "
                "again on --data where its source model is here")
    if "for_run" in cal:  # another run's calibrated/: its first N records of its --data
        try:
            body, _ = calibration_texts(data, split, int(cal["for_run"]["records"]))
        except (PactError, OSError, KeyError, ValueError, TypeError):
            return None  # (training says what is wrong with --data)
        if texts_sha256(body) == cal.get("prompts_sha256"):
            return None
    elif Path(data).is_file() and cal.get("prompts_sha256") == sha256_file(Path(data)):
        return None  # (pact-calibrate reads files: a datasets folder or hub id was not its --prompts)
    return (f"{artifact} was calibrated on {cal.get('prompts', 'other texts')}, not on --data: on 9 tasks, "
            "calibration on the task's own texts trained 2.1 points better on the mean than on generic text and "
            "0.7 better than on model-sampled text (BENCHMARKS.md \"Calibration downstream\"); with its source "
            "model, pact-train calibrates it again on --data")


def _check_ours(out: Path) -> None:
    """An existing RUN/calibrated/ is replaced only when pact-train's calibration made it."""
    if out.exists() and not _recorded(_opened(out)):
        raise PactError(f"{out} is not a readable artifact (damaged, or not made by pact-train): "
                        "remove it and run again")
    if out.exists() and not made_for_run(out):
        raise PactError(f"{out} holds an artifact pact-train did not make (pact-calibrate's?): it is never "
                        "replaced; choose another --out (or train on it: pact-train OUT/calibrated --out ELSEWHERE)")


def _source_gone(prov: dict) -> bool:
    """The artifact's source is a local path that is not there (an imported checkpoint: calibrate says
    why it cannot; a hub id: fetched or refused there)."""
    src = prov.get("source")
    return ("source_quantization" not in prov and isinstance(src, str) and Path(src).is_absolute()
            and not Path(src).exists())


def _check_source(art, artifact: str, data: str) -> None:
    """GPTQ reads the original weights again: a local source that is gone is said before anything."""
    prov = art.meta["provenance"]
    if not _source_gone(prov):
        return
    raise PactError(f"--calibrate needs the model {artifact} was converted from, recorded as {prov['source']}, "
                    f"which is not there: put it back, or calibrate with pact-calibrate {artifact} --source MODEL "
                    f"--prompts {data} --out CALIBRATED/ and train on CALIBRATED/ without --calibrate")


def _check_resume(run: Path, out: Path, same: bool, differs: str = "") -> None:
    """--resume of a run that has trained, with calibration: only on the calibrated/ it trained on
    (``differs``: what of it these settings would change, when it is known)."""
    record = run_record(run)
    trained_on = record.get("artifact")  # (a run folder moved since names its old calibrated/)
    if trained_on is not None and trained_on != str(out.resolve()) and not trained_on_own_calibrated(record):
        raise PactError(f"--resume --calibrate: {run} trained on {trained_on}, uncalibrated: drop --calibrate "
                        "to resume it")
    if not out.exists():
        raise PactError(f"--resume: {out} (the run's calibrated weights) is gone, and its checkpoints learned on "
                        "them: put it back to resume, or start a new --out")
    if not same:
        what = differs or ("was made from another artifact, other texts or another --calibrate-samples / --max-len "
                           "than these")
        raise PactError(f"--resume: {out} (the run's calibrated weights) {'holds ' * bool(differs)}{what}, and the "
                        "run's checkpoints learned on "
                        "it: resume with the run's own settings (pact-train --config RUN/train_config.json --resume), "
                        "or start a new --out")


def _opened(out: Path) -> Artifact | None:
    """An existing RUN/calibrated/, opened (its containment checked), or None: absent or unreadable."""
    try:
        return open_artifact(out)
    except (PactError, OSError, KeyError, ValueError, TypeError):
        return None


def _recorded(art: Artifact | None) -> dict:
    """The calibration an existing RUN/calibrated/ records ({} if none, or unreadable)."""
    try:
        return dict(art.meta["provenance"]["calibration"]) if art is not None else {}
    except (KeyError, ValueError, TypeError):
        return {}


def _intact(art: Artifact | None) -> bool:
    """Every byte of RUN/calibrated/ matches its manifest (a damaged one is made again, not reused)."""
    if art is None:
        return False
    try:
        art.verify_cached(default_cache())  # the training session's check, done once
        return True
    except (PactError, OSError, ValueError):
        log.warning("calibration: %s is damaged; calibrating again", art.path)
        return False
