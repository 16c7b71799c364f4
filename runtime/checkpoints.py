"""Checkpoints of a run (PEFT adapter + optimizer moments + RNG as safetensors, state as JSON; the
last KEEP_CHECKPOINTS kept) and resuming from them: refused when the settings, the artifact or
the data changed, except what RESUME_MAY_CHANGE names; a damaged checkpoint is skipped."""

from __future__ import annotations

import json
import logging
import math
import shutil
from dataclasses import MISSING, fields
from pathlib import Path

import torch
from safetensors.torch import load_file

from pact.formats import PactError
from pact.formats.errors import write_error
from pact.formats.files import atomic_folder, replace_text, save_safetensors
from pact.formats.peft import load_peft_adapter, save_peft_adapter

from .config import PATH_FIELDS, TrainConfig, _absolute
from .model import PactModel

log = logging.getLogger(__name__)


KEEP_CHECKPOINTS = 3


CHECKPOINT_FILES = ("adapter_config.json", "adapter_model.safetensors", "optimizer.safetensors", "rng.safetensors",
                    "state.json")


CALIBRATED = "calibrated"  # RUN/calibrated/: pact-train's calibration's artifact, made before the run starts


def base_model(art) -> str:
    """What an adapter's ``base_model_name_or_path`` names: the model the artifact was converted from
    (a hub id or a folder transformers loads; PEFT's AutoPeftModel reads it), not the artifact. For a
    .gguf source, the file's folder: transformers loads it given ``gguf_file=<the file's name>``,
    which AutoPeftModelForCausalLM.from_pretrained(run, gguf_file=...) passes through."""
    source = str(art.meta["provenance"].get("source") or art.path)
    return str(Path(source).parent) if source.endswith(".gguf") else source


def _disk_error(e: OSError, what: Path) -> PactError:
    return write_error(e, what, "the run's earlier checkpoints are kept")


def _save_checkpoint(run: Path, model: PactModel, opt: torch.optim.Optimizer, state: dict, cfg: TrainConfig) -> Path:
    final = run / "checkpoints" / f"step-{state['step']:07d}"
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(".step-*"):  # temp folders of a killed or full-disk save (the lock is ours)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        with atomic_folder(final) as tmp:  # filled beside, then renamed in: never a half-written checkpoint
            _write_checkpoint(tmp, model, opt, state, cfg)
    except OSError as e:
        raise _disk_error(e, final) from None
    done = sorted((run / "checkpoints").glob("step-???????"))
    for old in done[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _write_checkpoint(tmp: Path, model: PactModel, opt: torch.optim.Optimizer, state: dict, cfg: TrainConfig) -> None:
    save_peft_adapter(tmp, model.adapter_state(), cfg.lora(), base_model(model.artifact))
    params = list(model.lora_params.values())
    tensors = {}
    for i, p in enumerate(params):
        for k, v in opt.state.get(p, {}).items():
            tensors[f"{i}.{k}"] = v.detach().cpu().reshape(-1) if v.dim() == 0 else v.detach().cpu()
    save_safetensors(tensors, tmp / "optimizer.safetensors")
    rng = {"cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    save_safetensors(rng, tmp / "rng.safetensors")
    (tmp / "state.json").write_text(json.dumps({**state, "config": cfg.as_json()}, indent=2))


# settings a resumed run may change: how long it trains (a finished run with checkpoints is extended by
# --resume with more --steps / --epochs; the schedule is recomputed for the new length), when it saves and evaluates
RESUME_MAY_CHANGE = ("steps", "epochs", "save_every", "eval_every", "early_stopping_patience", "metric_for_best",
                     "report_to")


def _config_diff(saved: dict, now: dict, saved_world: int = 1, world: int = 1, may_move: tuple = ()) -> list[str]:
    """The settings that differ and may not (``may_move``: paths that may, the files being the same)."""
    # a setting newer than the checkpoint counts as its default there (the run used that behaviour)
    saved = {**{f.name: f.default for f in fields(TrainConfig) if f.name not in saved
                and f.default is not MISSING}, **saved}
    saved.update({k: _absolute(saved[k]) for k in PATH_FIELDS if isinstance(saved.get(k), str)})  # older: as typed
    if saved.get("batch_size", 0) * saved_world == now.get("batch_size", 0) * world:
        saved["batch_size"] = now.get("batch_size")  # the same global batch on another number of ranks
    return [f"  {k}: checkpoint {saved.get(k)!r} -> now {now.get(k)!r}" for k in sorted(set(saved) | set(now))
            if saved.get(k) != now.get(k) and k not in RESUME_MAY_CHANGE + may_move]


MAX_STEP = 10**9


def _sane_state(state) -> bool:
    """A checkpoint's state.json as this trainer writes it: counters are integers in range."""
    return isinstance(state, dict) and isinstance(state.get("config"), dict) and all(
        isinstance(state.get(k), int) and not isinstance(state.get(k), bool) and 0 <= state[k] <= MAX_STEP * 10**6
        for k in ("step", "epoch", "pos", "tokens")) and state["step"] <= MAX_STEP


def _usable_checkpoints(run: Path, warn: bool = True) -> list[Path]:
    """Complete checkpoints, newest first; an emptied or half-copied one is skipped (with ``warn``, said:
    once a run, where it resumes)."""
    good = []
    for ck in sorted((run / "checkpoints").glob("step-???????"), reverse=True):
        try:
            ok = all((ck / f).is_file() and (ck / f).stat().st_size > 0 for f in CHECKPOINT_FILES)
            ok = ok and _sane_state(json.loads((ck / "state.json").read_text()))
        except (OSError, ValueError):
            ok = False
        if ok:
            good.append(ck)
        elif warn:
            log.warning("skipping checkpoint %s: incomplete or damaged", ck)
    return good


def _load_checkpoint(run: Path, ck: Path, model: PactModel, opt: torch.optim.Optimizer, cfg: TrainConfig,
                     inputs: dict, world: int = 1) -> dict:
    state = json.loads((ck / "state.json").read_text())
    saved_inputs = state.pop("inputs", None)
    # compared where both record them (a checkpoint older than the eval_data fingerprint: its path is compared)
    changed = [k for k in inputs if k in (saved_inputs or {}) and saved_inputs[k] != inputs[k]]
    if changed:
        ours = run / CALIBRATED
        if "artifact" in changed and ours.is_dir() and Path(cfg.artifact).resolve() != ours.resolve():
            raise PactError(f"--resume: {run} trained on {ours}, its own calibration: resume without --no-calibrate "
                            f"(with the same --data), or with {ours} as the artifact")
        raise PactError(f"--resume: the {' and the '.join(changed)} changed since {ck} was saved (fingerprint "
                        "differs): resuming would silently mix two trainings; restore the originals or start a "
                        "new run in another --out")
    # a run folder moved (or its inputs moved, their fingerprints the same) resumes where it is now
    may_move = ("out",) + tuple(k for k in inputs if k in (saved_inputs or {}))
    saved_cfg, now = state.pop("config"), cfg.as_json()
    diff = _config_diff(saved_cfg, now, state.pop("world_size", 1), world, may_move)
    if diff:
        was = saved_cfg.get("activations")
        hint = (f"\n  (the precision recipe it trained with: pass --activations {was}; the default may have changed "
                "since)" if was != now.get("activations") and isinstance(was, str) else "")
        raise PactError(f"--resume: {ck} was made with other settings; resume with the same flags or start a new run:\n"
                        + "\n".join(diff) + hint)
    was = {k: _absolute(saved_cfg[k]) for k in may_move if isinstance(saved_cfg.get(k), str)}
    moved = [k for k in was if was[k] != now.get(k)]
    if moved:
        log.info("--resume: %s moved since %s was saved (%s): resuming where they are now", ", ".join(moved), ck,
                 "; ".join(f"{k}: {was[k]} -> {now.get(k)}" for k in moved))
    _, adapters = load_peft_adapter(ck)
    model.load_adapter_state(adapters)
    try:
        saved = load_file(ck / "optimizer.safetensors")
    except Exception as e:  # safetensors' own error types
        raise PactError(f"{ck}/optimizer.safetensors: unreadable ({e}): remove {ck} to resume from the one "
                        "before it") from None
    params = list(model.lora_params.values())
    for i, p in enumerate(params):
        st = {k.split(".", 1)[1]: v for k, v in saved.items() if k.split(".", 1)[0] == str(i)}
        if st:
            st["step"] = st["step"].reshape(())
            opt.state[p] = {k: v.to(p.device) if k != "step" else v for k, v in st.items()}
    try:
        rng = load_file(ck / "rng.safetensors")
        torch.random.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    except Exception as e:  # safetensors' errors, a missing key, a state of the wrong size or dtype
        raise PactError(f"{ck}/rng.safetensors: unreadable ({type(e).__name__}: {str(e)[:120]}): remove {ck} to "
                        "resume from the checkpoint before it") from None
    best = state.get("best")  # --eval-every's record: checked as the counters are (a damaged one is dropped)
    if best is not None and not (isinstance(best, dict) and isinstance(best.get("step"), int)
                                 and best.get("metric") in ("eval_loss", "eval_accuracy")
                                 and isinstance(best.get("value"), float) and math.isfinite(best["value"])):
        log.warning("%s: its best-evaluation record is damaged: the best adapter is tracked anew", ck)
        state.pop("best")
    if not isinstance(state.get("bad_evals", 0), int):
        state["bad_evals"] = 0
    return state  # (the trainer says where it continues from)


def _truncate_metrics(path: Path, step: int) -> None:
    """metrics.jsonl up to ``step``: later steps are redone; a line a kill tore, or any line that is
    not a step's metrics, is dropped (the file is a log, rewritten through a temp file)."""
    if not path.exists():
        return

    def step_of(line: str):
        try:
            rec = json.loads(line)
        except ValueError:
            return None
        return rec.get("step") if isinstance(rec, dict) and isinstance(rec.get("step"), int) else None

    raw = path.read_bytes().decode("utf-8", errors="replace")
    keep = [line for line in raw.splitlines() if (n := step_of(line)) is not None and n <= step]
    replace_text(path, "".join(line + "\n" for line in keep))
