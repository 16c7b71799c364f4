"""The run folder: one writer at a time (``run_lock``), never another run's results overwritten
(``_prepare_run``), and the data's fingerprint that --resume compares."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
from contextlib import contextmanager
from pathlib import Path

from pact.formats import PactError, open_artifact
from pact.formats.files import check_plain_tree, pid_alive, sha256_file

from .checkpoints import CALIBRATED, _usable_checkpoints

log = logging.getLogger(__name__)


def data_fingerprint(path: str | os.PathLike, records: list[dict] | None = None) -> str:
    """sha256 of a data file, or of a datasets folder's files (names and contents); of a hub dataset
    (no local path), of its ``records``."""
    p = Path(path)
    if p.is_file():
        return sha256_file(p)
    if not p.exists() and records is not None:
        rows = [{k: v for k, v in r.items() if k != "_where"} for r in records]
        return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()
    h = hashlib.sha256()
    for f in sorted(q for q in p.rglob("*") if q.is_file()):
        h.update(f"{f.relative_to(p)}\0{sha256_file(f)}\n".encode())
    return h.hexdigest()


@contextmanager
def run_lock(run: Path):
    """One writer per run folder: ``.lock`` holds the owner's host and pid; a lock whose process is
    gone (same host) is taken over, a live one is refused."""
    lock = run / ".lock"
    me = f"{socket.gethostname()} {os.getpid()}\n"
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                host, pid = lock.read_text().split()
                alive = host != socket.gethostname() or pid_alive(int(pid))
            except (OSError, ValueError):
                host, pid, alive = "?", "?", False
            if alive:
                raise PactError(f"--out {run} is in use by another pact-train (host {host}, pid {pid}): wait for it, "
                                f"or choose another --out (if that process is gone, delete {lock})") from None
            log.warning("removing a stale lock %s (pid %s has exited)", lock, pid)
            lock.unlink(missing_ok=True)
            continue
        except OSError as e:
            raise PactError(f"--out {run}: cannot write there ({e.strerror}): choose a writable folder") from None
        with os.fdopen(fd, "w") as f:
            f.write(me)
        break
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def made_for_run(path: Path) -> bool:
    """``path`` is an artifact pact-train's calibration wrote (its calibration records ``for_run``), not
    one a user put there (pact-calibrate's, say), which no run may count as its own or replace."""
    try:
        return "for_run" in open_artifact(path).meta["provenance"]["calibration"]
    except (PactError, OSError, KeyError, ValueError, TypeError):
        return False


def _not_a_result(p: Path) -> bool:
    """The lock, and pact-train's calibration's artifact (or its writer's temp folders, named by its
    process): a run folder holding only these is still new."""
    return p.name == ".lock" or p.name.startswith(f".{CALIBRATED}.") or (p.name == CALIBRATED and made_for_run(p))


def _is_new(run: Path) -> bool:
    """No run's results in ``run`` (absent, empty, or only the lock and pact-train's calibration's artifact)."""
    return not run.is_dir() or all(_not_a_result(p) for p in run.iterdir())


def _clear_new_run(run: Path) -> None:
    """What a run that failed before its first step wrote into a folder that held no results (its
    calibrated/ stays, for the rerun)."""
    for p in run.iterdir():
        if not _not_a_result(p):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)


def _prepare_run(run: Path, resume: bool) -> None:
    """The run folder is new, or (``resume``) an unfinished run with a checkpoint; never one whose
    results would be overwritten (check_run), and made."""
    check_run(run, resume)
    try:
        run.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PactError(f"--out {run}: cannot create it ({e.strerror}): choose a writable folder") from None


def check_run(run: Path, resume: bool, *, calibrated_aside: bool = False) -> None:
    """What _prepare_run refuses, without making anything: pact-train says it before any note or minute of
    calibration (``calibrated_aside``: a calibrated/ folder left to calibration's own checks, which say
    what is wrong with one that pact-train did not make)."""
    # a run folder from someone else (--resume) may hold links under the names pact writes or reads
    check_plain_tree(run, f"--out {run}", "a run folder holds only the files pact-train writes; remove the entry, "
                     "or start a new --out", opaque=("wandb",))  # (W&B's own folder, with its own links)
    files = [p for p in run.iterdir() if not _not_a_result(p) and not (calibrated_aside and p.name == CALIBRATED)
             ] if run.is_dir() else []
    if files and not resume:
        raise PactError(f"--out {run} is not empty: pass --resume to continue that run, or choose another folder")
    if resume and files and not _usable_checkpoints(run, warn=False):
        if (run / "adapter_model.safetensors").is_file():
            raise PactError(f"--resume: {run} is a finished run (its adapter is saved) with no checkpoint to resume "
                            "from (a run extends with --resume and more --steps when it saved checkpoints: "
                            "--save-every N); train more in a new --out (its adapter stays as it is)")
        raise PactError(f"--resume: {run} has no usable checkpoint (train with --save-every N); "
                        "start again in an empty --out")


def _trained(run: Path) -> bool:
    """The run took at least one step (its metrics or checkpoints exist), or finished."""
    metrics = run / "metrics.jsonl"
    return ((metrics.is_file() and metrics.stat().st_size > 0) or (run / "checkpoints").is_dir()
            or (run / "adapter_model.safetensors").is_file())
