"""The training loop: AdamW on fp32 adapters, warmup + cosine (or --lr-scheduler), accumulation,
clipping, checkpoints that resume the same run bit for bit, PEFT-format output.

Run folder: adapter_config.json + adapter_model.safetensors (PEFT names), metrics.jsonl
(one object per optimizer step), train_config.json (with the artifact's and data's
fingerprints, which --resume compares), eval.json, checkpoints/step-NNNNNNN/, and .lock while
a process trains into it. Nothing is pickled: checkpoints are safetensors + JSON.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import resource
import shutil
import socket
import time
from contextlib import contextmanager
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import load_file
from tqdm.auto import tqdm

from pact.formats import PactError
from pact.formats.errors import write_error
from pact.formats.files import atomic_folder, pid_alive, save_safetensors, sha256_file

from .data import HUB_ID, batches, collate, collate_packed, pack, pad_id, read_records, tokenize
from .distributed import Dist, from_env, leave
from .evaluate import evaluate, label_candidates
from .lora import ALL_TARGETS, LoraConfig, load_peft_adapter, parse_layers, reserve_peft_adapter, save_peft_adapter
from .model import PactModel
from .ops import COMPUTE, FP8_WEIGHTS, KERNELS
from .recipe import HELP as RECIPE_HELP
from .recipe import parse_recipe
from .reporting import Reporter, check_available, parse_report_to
from .session import open_session

log = logging.getLogger(__name__)
KEEP_CHECKPOINTS = 3


SCHEDULERS = ("cosine", "linear", "constant", "constant_with_warmup", "polynomial", "inverse_sqrt")
POLYNOMIAL_END, POLYNOMIAL_POWER, INVERSE_SQRT_TIMESCALE = 1e-7, 1.0, 10_000  # transformers' get_scheduler defaults


def lr_at(step: int, total: int, base: float, warmup_ratio: float, schedule: str = "cosine") -> float:
    """The learning rate of the step after ``step`` completed optimizer steps: a linear warmup over
    int(total * warmup_ratio) steps, then ``schedule`` (transformers' get_scheduler names and
    formulas; ``constant`` has no warmup). One difference, on purpose: warmup step s uses
    base * (s + 1) / warm where transformers' uses base * s / warm, so the first step learns."""
    if schedule == "constant":
        return base
    warm = int(total * warmup_ratio)
    if step < warm:
        return base * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    if schedule == "cosine":
        return base * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    if schedule == "linear":
        return base * max(0.0, 1.0 - progress)
    if schedule == "constant_with_warmup":
        return base
    if schedule == "polynomial":
        end = min(POLYNOMIAL_END, base)
        return (base - end) * (1.0 - min(1.0, progress)) ** POLYNOMIAL_POWER + end
    if schedule == "inverse_sqrt":
        timescale = warm or INVERSE_SQRT_TIMESCALE
        return base / math.sqrt((step - warm + timescale) / timescale)
    raise PactError(f"--lr-scheduler must be one of {', '.join(SCHEDULERS)}, got {schedule!r}")


def _opt(default=MISSING, help: str | None = None, **cli):
    """A TrainConfig field: its default, its help, and how pact-train spells it (pipelines/common.py
    makes the options from these): ``choices``, ``metavar``, ``argument`` (positional),
    ``cli_default`` (the CLI's default where it differs, e.g. "auto"), ``show_default``, ``aliases``
    (other spellings, e.g. transformers' TrainingArguments names: ``("--learning-rate",)``)."""
    kw = {"default_factory": default} if callable(default) else {"default": default}
    return field(**kw, metadata={"help": help, **cli})


@dataclass
class TrainConfig:
    """Every setting of a training run: pact-train's options, one field each (pipelines/train.py)."""

    artifact: str = _opt(help="Artifact folder from pact-convert / pact-calibrate.", argument=True)
    data: str = _opt(help="Train .jsonl (prompt/completion, messages, Alpaca or ShareGPT records) or datasets folder.")
    out: str = _opt(help="Run folder (adapter, metrics, checkpoints).", path=True)
    eval_data: str | None = _opt(None, "Held-out .jsonl: loss, and accuracy when completions are labels.")
    data_split: str | None = _opt(None, "The split of a datasets folder (DatasetDict) given as --data "
                                        "(default: train).", aliases=("--dataset-train-split",))
    eval_split: str | None = _opt(None, "The split of a datasets folder given as --eval-data (default: test, else "
                                        "validation).", aliases=("--dataset-test-split",))
    max_len: int = _opt(1024, aliases=("--max-seq-length",))
    overlong: str = _opt("truncate", "What to do with sequences over --max-len.", choices=("truncate", "refuse"))
    batch_size: int = _opt(8, aliases=("--per-device-train-batch-size",))
    grad_accum: int = _opt(1, aliases=("--gradient-accumulation-steps",))
    steps: int | None = _opt(None, "Optimizer steps (default: --epochs).", aliases=("--max-steps",))
    epochs: float = _opt(1.0, aliases=("--num-train-epochs",))
    lr: float = _opt(2e-4, aliases=("--learning-rate",))
    weight_decay: float = _opt(0.0)
    warmup_ratio: float = _opt(0.03)
    lr_scheduler: str = _opt("cosine", "After the warmup: transformers' get_scheduler names (constant: no warmup).",
                             choices=SCHEDULERS, aliases=("--lr-scheduler-type",))
    max_grad_norm: float = _opt(1.0)
    seed: int = _opt(0)
    lora_r: int = _opt(16)
    lora_alpha: float = _opt(32.0)
    lora_dropout: float = _opt(0.0)
    targets: tuple[str, ...] = _opt(ALL_TARGETS, "Comma-separated projections.")
    lora_layers: str = _opt("all", "Decoder blocks that get adapters: all, top:N (the N last), A-B (0-based, "
                                   "inclusive) or a comma list. Backward stops below the lowest one.")
    save_every: int = _opt(0, "Checkpoint every N steps (0: none).")
    eval_every: int = _opt(0, "Evaluate --eval-data every N steps (0: at the end only); the best adapter so far is "
                              "kept in OUT/best/.", aliases=("--eval-steps",))
    metric_for_best: str = _opt("auto", "What --eval-every ranks by: eval_loss (lower is better), eval_accuracy "
                                        "(label data) or auto (accuracy when the data has labels, else loss).",
                                choices=("auto", "eval_loss", "eval_accuracy"), aliases=("--metric-for-best-model",))
    early_stopping_patience: int = _opt(0, "With --eval-every: stop after N evaluations without improvement "
                                           "(0: never).")
    report_to: str = _opt("none", "Also log metrics to: tensorboard (RUN/tensorboard/), wandb (W&B; "
                                  "WANDB_MODE=offline needs no network), both comma-separated, or none.")
    packing: bool = _opt(False, "Several examples per --max-len row, each attending only to itself, positions "
                                "from 0 (fewer padding tokens; the same loss).")
    kernels: str | None = _opt(None, "Default: triton on GPU, torch on CPU.", choices=KERNELS)
    compute: str | None = _opt(
        None, "Frozen-GEMM backend. auto = bf16-decode (exact NVFP4 products: learns as BF16 LoRA does). "
              "fp8 (Ada/Hopper) ~11% shorter steps, nvfp4-native (Blackwell, unverified on hardware): "
              "faster, at a measured accuracy cost (BENCHMARKS.md).", choices=("auto", *COMPUTE), cli_default="auto")
    fp8_weights: str = _opt(
        "per-call", "With --compute fp8: resident keeps E4M3 copies of the frozen weights on the GPU (+2 bytes per "
                    "parameter) instead of re-encoding them from NVFP4 at every GEMM; same numbers, faster steps.",
        choices=FP8_WEIGHTS)
    activations: str | None = _opt(None, RECIPE_HELP, metavar="RECIPE")
    checkpoint: bool = _opt(False, "Recompute each decoder layer in backward (less memory, ~1/3 more compute).",
                            aliases=("--gradient-checkpointing",))
    device: str | None = _opt(None, "cuda, cuda:1, cpu (default: cuda if available).")

    def __post_init__(self) -> None:
        self.targets = tuple(self.targets)
        for name in ("max_len", "batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise PactError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.steps is not None and self.steps < 1:
            raise PactError(f"--steps must be >= 1, got {self.steps}")
        if self.epochs <= 0:
            raise PactError(f"--epochs must be > 0, got {self.epochs}")
        if not 0 <= self.warmup_ratio < 1:
            raise PactError(f"--warmup-ratio must be in [0, 1), got {self.warmup_ratio}")
        # every number checked before anything loads: a bad one fails here, not after the model
        checks = (
            ("lr", self.lr, math.isfinite(self.lr) and self.lr > 0, "a finite number > 0 (e.g. 2e-4)"),
            ("weight-decay", self.weight_decay, math.isfinite(self.weight_decay) and self.weight_decay >= 0,
             "a finite number >= 0"),
            ("max-grad-norm", self.max_grad_norm, math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0,
             "> 0 (the clipping threshold; a huge value effectively disables clipping)"),
            ("lora-r", self.lora_r, self.lora_r >= 1, "an integer >= 1"),
            ("lora-alpha", self.lora_alpha, math.isfinite(self.lora_alpha) and self.lora_alpha > 0,
             "> 0 (the adapter's scale is alpha / r; 0 trains nothing)"),
            ("lora-dropout", self.lora_dropout, 0 <= self.lora_dropout < 1, "in [0, 1)"),
            ("save-every", self.save_every, self.save_every >= 0, ">= 0 (0: no checkpoints)"),
            ("eval-every", self.eval_every, self.eval_every >= 0, ">= 0 (0: evaluate at the end only)"),
            ("early-stopping-patience", self.early_stopping_patience, self.early_stopping_patience >= 0,
             ">= 0 (0: never stop early)"),
            ("max-len", self.max_len, self.max_len >= 2, ">= 2 (a prompt token and a completion token)"),
        )
        for flag, value, ok, want in checks:
            if not ok:
                raise PactError(f"--{flag} must be {want}, got {value}")
        if self.lr_scheduler not in SCHEDULERS:
            raise PactError(f"--lr-scheduler must be one of {', '.join(SCHEDULERS)}, got {self.lr_scheduler!r}")
        if self.eval_every and not self.eval_data:
            raise PactError("--eval-every needs --eval-data (the held-out file it evaluates)")
        if self.early_stopping_patience and not self.eval_every:
            raise PactError("--early-stopping-patience needs --eval-every N (how often to evaluate)")
        if self.metric_for_best not in ("auto", "eval_loss", "eval_accuracy"):
            raise PactError(f"--metric-for-best must be auto, eval_loss or eval_accuracy, got {self.metric_for_best!r}")
        if self.overlong not in ("truncate", "refuse"):
            raise PactError(f"--overlong must be truncate or refuse, got {self.overlong!r}")
        parse_report_to(self.report_to)
        self.activations = parse_recipe(self.activations).spec()  # canonical: resume compares it
        parse_layers(self.lora_layers, None)
        for name in PATH_FIELDS:  # absolute: --out ./run/ and --out run are the same run
            setattr(self, name, _absolute(getattr(self, name)))

    def lora(self) -> LoraConfig:
        return LoraConfig(r=self.lora_r, alpha=self.lora_alpha, dropout=self.lora_dropout, targets=self.targets,
                          layers=self.lora_layers)

    def as_json(self) -> dict:
        d = asdict(self)
        d["targets"] = list(d["targets"])
        return d


PATH_FIELDS = ("artifact", "data", "out", "eval_data")


def _absolute(path: str | None) -> str | None:
    """A local path made absolute (symlinks resolved); URLs and None as given."""
    if path is None or "://" in str(path) or not Path(path).expanduser().exists() and HUB_ID.fullmatch(str(path)):
        return path  # a missing "org/name" stays as typed: the data reader names it as a hub id
    return str(Path(path).expanduser().resolve())



def _micro_batches(examples, cfg: TrainConfig, epoch: int, pos: int, world: int = 1
                   ) -> Iterator[tuple[int, int, list[int]]]:
    """(epoch, position after this batch, indices of the global micro-batch: batch size x ``world``)
    forever, starting at (epoch, pos). Every rank draws the same; each takes its share."""
    while True:
        order = batches(examples, cfg.batch_size * world, seed=cfg.seed, epoch=epoch)
        for i in range(pos, len(order)):
            yield epoch, i + 1, order[i]
        epoch, pos = epoch + 1, 0


def _peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# ------------------------------------------------------------------------- checkpoints


CHECKPOINT_FILES = ("adapter_config.json", "adapter_model.safetensors", "optimizer.safetensors", "rng.safetensors",
                    "state.json")


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
    tmp = final.with_name(final.name + ".tmp")
    for stale in (run / "checkpoints").glob("step-*.tmp"):  # left by a killed or full-disk save (the lock is ours)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        _write_checkpoint(tmp, model, opt, state, cfg)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _disk_error(e, tmp) from None
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
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


def _config_diff(saved: dict, now: dict, saved_world: int = 1, world: int = 1) -> list[str]:
    # a setting newer than the checkpoint counts as its default there (the run used that behaviour)
    saved = {**{f.name: f.default for f in fields(TrainConfig) if f.name not in saved
                and f.default is not MISSING}, **saved}
    saved.update({k: _absolute(saved[k]) for k in PATH_FIELDS if isinstance(saved.get(k), str)})  # older: as typed
    if saved.get("batch_size", 0) * saved_world == now.get("batch_size", 0) * world:
        saved["batch_size"] = now.get("batch_size")  # the same global batch on another number of ranks
    return [f"  {k}: checkpoint {saved.get(k)!r} -> now {now.get(k)!r}" for k in sorted(set(saved) | set(now))
            if saved.get(k) != now.get(k) and k not in RESUME_MAY_CHANGE]


MAX_STEP = 10**9


def _sane_state(state) -> bool:
    """A checkpoint's state.json as this trainer writes it: counters are integers in range."""
    return isinstance(state, dict) and isinstance(state.get("config"), dict) and all(
        isinstance(state.get(k), int) and not isinstance(state.get(k), bool) and 0 <= state[k] <= MAX_STEP * 10**6
        for k in ("step", "epoch", "pos", "tokens")) and state["step"] <= MAX_STEP


def _usable_checkpoints(run: Path) -> list[Path]:
    """Complete checkpoints, newest first; an emptied or half-copied one is skipped with a warning."""
    good = []
    for ck in sorted((run / "checkpoints").glob("step-???????"), reverse=True):
        try:
            ok = all((ck / f).is_file() and (ck / f).stat().st_size > 0 for f in CHECKPOINT_FILES)
            ok = ok and _sane_state(json.loads((ck / "state.json").read_text()))
        except (OSError, ValueError):
            ok = False
        if ok:
            good.append(ck)
        else:
            log.warning("skipping checkpoint %s: incomplete or damaged", ck)
    return good


def _load_checkpoint(run: Path, ck: Path, model: PactModel, opt: torch.optim.Optimizer, cfg: TrainConfig,
                     inputs: dict, world: int = 1) -> dict:
    state = json.loads((ck / "state.json").read_text())
    saved_inputs = state.pop("inputs", None)
    if saved_inputs is not None and saved_inputs != inputs:
        changed = [k for k in inputs if saved_inputs.get(k) != inputs[k]]
        raise PactError(f"--resume: the {' and the '.join(changed)} changed since {ck} was saved (fingerprint "
                        "differs): resuming would silently mix two trainings; restore the originals or start a "
                        "new run in another --out")
    diff = _config_diff(state.pop("config"), cfg.as_json(), state.pop("world_size", 1), world)
    if diff:
        raise PactError(f"--resume: {ck} was made with other settings; resume with the same flags or start a new run:\n"
                        + "\n".join(diff))
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
    log.info("resumed from %s (step %d)", ck, state["step"])
    return state


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
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


# ------------------------------------------------------------------------- run folder


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


def _prepare_run(run: Path, resume: bool) -> None:
    """The run folder is new, or (``resume``) an unfinished run with a checkpoint; never one whose
    results would be overwritten."""
    files = [p for p in run.iterdir() if p.name != ".lock"] if run.is_dir() else []
    if files and not resume:
        raise PactError(f"--out {run} is not empty: pass --resume to continue that run, or choose another folder")
    if resume and files and not _usable_checkpoints(run):
        if (run / "adapter_model.safetensors").is_file():
            raise PactError(f"--resume: {run} is a finished run (its adapter is saved) with no checkpoint to resume "
                            "from (a run extends with --resume and more --steps when it saved checkpoints: "
                            "--save-every N); train more in a new --out (its adapter stays as it is)")
        raise PactError(f"--resume: {run} has no usable checkpoint (train with --save-every N); "
                        "start again in an empty --out")
    try:
        run.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PactError(f"--out {run}: cannot create it ({e.strerror}): choose a writable folder") from None


# ------------------------------------------------------------------------------ loop


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True, stop_after: int | None = None) -> dict:
    """Train, save the adapter in PEFT format into ``cfg.out`` and return the final metrics.

    Under torchrun (WORLD_SIZE > 1) every rank runs this; rank 0 alone owns the run folder
    (runtime/distributed.py). ``stop_after`` ends the process-equivalent of a kill right after
    that step (tests).
    """
    dist, device = from_env(cfg.device)
    run = Path(cfg.out)
    for path, flag, split in ((cfg.data, "--data", cfg.data_split), (cfg.eval_data, "--eval-data", cfg.eval_split)):
        if path is not None:
            read_records(path, flag, split)  # a missing or malformed file fails now, before any model loads
    check_available(parse_report_to(cfg.report_to))
    lock, error, created, owned = contextlib.ExitStack(), None, dist.main and not run.exists(), False
    try:
        try:
            if dist.main:
                _prepare_run(run, resume)
                lock.enter_context(run_lock(run))
                owned = True
                _prepare_run(run, resume)  # again under the lock: a run that finished meanwhile is not overwritten
        except PactError as e:
            error = e
        dist.check(error, device)  # every rank stops when rank 0 cannot own the folder
        return _train(cfg, run, resume, progress and dist.main, stop_after, dist, device)
    finally:
        # a run that failed before its first step leaves no folder: only the lock holder removes it (a
        # concurrent pact-train that made the same --out first keeps it), and before releasing the lock
        if created and owned and run.is_dir() and not _trained(run):
            shutil.rmtree(run, ignore_errors=True)
        lock.close()
        leave(dist)


def _trained(run: Path) -> bool:
    """The run took at least one step (its metrics or checkpoints exist), or finished."""
    metrics = run / "metrics.jsonl"
    return ((metrics.is_file() and metrics.stat().st_size > 0) or (run / "checkpoints").is_dir()
            or (run / "adapter_model.safetensors").is_file())


@dataclass
class _Run:
    """What the loop needs, made once by _setup: model, data, optimizer and the resumable state."""

    model: PactModel
    tokenizer: object
    examples: list
    pad: int
    total: int
    params: list
    opt: torch.optim.Optimizer
    state: dict
    last_good: Path | None
    dist: Dist = field(default_factory=Dist)
    held: list | None = None  # --eval-data, tokenized


def _setup(cfg: TrainConfig, run: Path, resume: bool, dist: Dist, device: str | None) -> _Run:
    """Device, verified artifact, tokenizer and model (runtime/session.py), the tokenized data, the
    optimizer, and the state of the newest usable checkpoint when resuming; records the run's
    config, recipe and input fingerprints in train_config.json (rank 0)."""
    torch.manual_seed(cfg.seed)
    ses = open_session(cfg.artifact, device=device, flag="--artifact")  # from_env's: cfg.device, or this rank's
    records = read_records(cfg.data, "--data", cfg.data_split)
    inputs = {"artifact": ses.artifact.fingerprint(), "data": data_fingerprint(cfg.data, records)}
    model = ses.model(cfg.lora(), kernels=cfg.kernels, compute=cfg.compute, activations=cfg.activations,
                      checkpoint=cfg.checkpoint, seed=cfg.seed, fp8_weights=cfg.fp8_weights)
    vocab = model.embed.shape[0]
    examples = tokenize(records, ses.tokenizer, max_len=cfg.max_len,
                        overlong=cfg.overlong, vocab_size=vocab)
    if cfg.packing:
        n = len(examples)
        examples = pack(examples, cfg.max_len)
        log.info("--packing: %d examples in %d rows of <= %d tokens", n, len(examples), cfg.max_len)
    per_epoch = math.ceil(math.ceil(len(examples) / (cfg.batch_size * dist.world)) / cfg.grad_accum)
    total = cfg.steps or max(1, math.ceil(cfg.epochs * per_epoch))
    params = list(model.lora_params.values())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=ses.device.type == "cuda")
    state = {"step": 0, "epoch": 0, "pos": 0, "tokens": 0}
    last_good = None
    if resume and (good := _usable_checkpoints(run)):
        last_good = good[0]
        state = _load_checkpoint(run, last_good, model, opt, cfg, inputs, dist.world)
        best = state.get("best")
        if best is not None and not (isinstance(best, dict) and isinstance(best.get("step"), int)
                                     and best.get("metric") in ("eval_loss", "eval_accuracy")
                                     and isinstance(best.get("value"), float) and math.isfinite(best["value"])):
            log.warning("%s: its best-evaluation record is damaged: the best adapter is tracked anew", last_good)
            state.pop("best")
        if not isinstance(state.get("bad_evals", 0), int):
            state["bad_evals"] = 0
        if dist.main:
            _truncate_metrics(run / "metrics.jsonl", state["step"])  # steps after the checkpoint are redone
        if state["step"] > total:
            raise PactError(f"--resume: {last_good} is at step {state['step']}, beyond this run's {total} steps: "
                            f"pass --steps above {state['step']} to train further")
        if state["step"] == total:
            log.info("%s: the checkpoint is at the last step (%d); writing the adapter", last_good, total)
    state["inputs"] = inputs
    state["world_size"] = dist.world
    if dist.main:
        try:  # the final adapter's disk space, claimed now: a full disk fails here, not after training
            reserve_peft_adapter(run, model.adapter_state(), cfg.lora(), base_model(model.artifact))
        except OSError as e:
            raise _disk_error(e, run / "adapter_model.safetensors") from None
        (run / "train_config.json").write_text(json.dumps({
            **cfg.as_json(), "recipe": model.recipe.as_json(), "world_size": dist.world,
            "global_batch": cfg.batch_size * dist.world * cfg.grad_accum, "inputs_sha256": inputs}, indent=2) + "\n")
    held = None
    if cfg.eval_data:
        held = tokenize(read_records(cfg.eval_data, "--eval-data", cfg.eval_split), ses.tokenizer,
                        max_len=cfg.max_len, overlong=cfg.overlong,
                        vocab_size=vocab)
        if cfg.metric_for_best == "eval_accuracy" and label_candidates(held) is None:
            raise PactError(f"--metric-for-best eval_accuracy: {cfg.eval_data} is not label data (its completions are "
                            "not a small set of answers); use eval_loss")
    return _Run(model, ses.tokenizer, examples, pad_id(ses.tokenizer), total, params, opt, state, last_good, dist,
                held)


def _step(r: _Run, cfg: TrainConfig, micro: list) -> dict:
    """One optimizer step over the global micro-batches ``micro`` (this rank computes its share of
    each); returns the step's metrics (global, without timing)."""
    device, state, dist = r.model.device, r.state, r.dist
    shares = [idx[dist.share(len(idx))] for _, _, idx in micro]
    make = collate_packed if cfg.packing else collate
    loaded = [make(r.examples, share, r.pad, device) for share in shares if share]
    local_targets = sum(int((b[1][:, 1:] != -100).sum()) for b in loaded)
    local_tokens = sum(int(b[0].numel()) for b in loaded)
    n_targets, tokens = (int(v) for v in dist.sum([local_targets, local_tokens], device))
    if n_targets == 0:
        raise PactError(f"step {state['step'] + 1}: the batch has no completion tokens within --max-len "
                        f"{cfg.max_len}: raise --max-len")
    loss_sum, error = 0.0, None
    try:
        for batch in loaded:
            loss, _ = r.model(*batch)
            (loss / n_targets).backward()
            loss_sum += float(loss.detach())
    except Exception as e:  # every rank stops with it (a failed rank never leaves the others waiting)
        error = e
    dist.check(error, device)
    dist.sum_grads(r.params)
    loss_sum = dist.sum([loss_sum], device)[0]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(r.params, cfg.max_grad_norm))
    if not (math.isfinite(loss_sum) and math.isfinite(grad_norm)):
        kept = f"the last good checkpoint is {r.last_good}" if r.last_good else "no checkpoint was saved"
        raise PactError(
            f"step {state['step'] + 1}: loss {loss_sum / n_targets:.4g}, gradient norm {grad_norm:.4g}: "
            f"not finite, training stopped and no adapter written ({kept}); lower --lr, or check the "
            "artifact and data")
    lr = lr_at(state["step"], r.total, cfg.lr, cfg.warmup_ratio, cfg.lr_scheduler)
    for group in r.opt.param_groups:
        group["lr"] = lr
    r.opt.step()
    r.opt.zero_grad(set_to_none=True)
    state.update(step=state["step"] + 1, epoch=micro[-1][0], pos=micro[-1][1], tokens=state["tokens"] + tokens)
    return {"step": state["step"], "loss": loss_sum / n_targets, "lr": lr, "grad_norm": grad_norm,
            "targets": n_targets, "tokens": tokens}


def _finish(r: _Run, cfg: TrainConfig, run: Path, last: dict) -> dict:
    """The adapter in PEFT format, and the held-out evaluation when --eval-data is given (rank 0;
    the other ranks return the last step's metrics)."""
    if not r.dist.main:
        return dict(last)
    try:
        save_peft_adapter(run, r.model.adapter_state(), cfg.lora(), base_model(r.model.artifact))
    except OSError as e:
        raise _disk_error(e, run / "adapter_model.safetensors") from None
    result = dict(last)
    if r.held is not None:
        if "eval_loss" not in last:  # (an early stop has just evaluated these weights)
            result.update(evaluate(r.model, r.held, batch_size=cfg.batch_size, pad_id=r.pad))
            if cfg.eval_every:
                _keep_best(r, cfg, run, result)
        if "best" in r.state:
            result.update(best_step=r.state["best"]["step"], best_metric=r.state["best"]["metric"],
                          best_value=r.state["best"]["value"])
        (run / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _periodic_eval(r: _Run, cfg: TrainConfig, run: Path) -> tuple[dict, bool]:
    """--eval-every: evaluate on rank 0, keep OUT/best/ when the metric improves, count evaluations
    without improvement; returns (the evaluation's metrics, stop now) — the same decision on every rank."""
    out, stop, error = {}, False, None
    if r.dist.main:
        try:
            out = evaluate(r.model, r.held, batch_size=cfg.batch_size, pad_id=r.pad)
            _keep_best(r, cfg, run, out)
            stop = bool(cfg.early_stopping_patience) and r.state["bad_evals"] >= cfg.early_stopping_patience
        except PactError as e:
            error = e
    r.dist.check(error, r.model.device)
    stop = r.dist.sum([float(stop)], r.model.device)[0] > 0
    return out, stop


def _keep_best(r: _Run, cfg: TrainConfig, run: Path, out: dict) -> None:
    """The adapter into OUT/best/ (``atomic_folder``) when ``out`` improves on the best evaluation
    so far; else one more evaluation without improvement. State kept in r.state (checkpointed)."""
    metric = cfg.metric_for_best
    if metric == "auto":
        metric = "eval_accuracy" if "eval_accuracy" in out else "eval_loss"
    value, best = out[metric], r.state.get("best")
    if best is not None and not (value > best["value"] if metric == "eval_accuracy" else value < best["value"]):
        r.state["bad_evals"] = r.state.get("bad_evals", 0) + 1
        return
    r.state["best"] = {"step": r.state["step"], "metric": metric, "value": value}
    r.state["bad_evals"] = 0
    final = run / "best"
    try:
        with atomic_folder(final) as tmp:  # filled beside best/, then swapped in: never a half-written best/
            save_peft_adapter(tmp, r.model.adapter_state(), cfg.lora(), base_model(r.model.artifact))
            (tmp / "best.json").write_text(json.dumps({**r.state["best"], **out}, indent=2) + "\n")
    except OSError as e:
        raise _disk_error(e, final) from None


def _train(cfg: TrainConfig, run: Path, resume: bool, progress: bool, stop_after: int | None,
           dist: Dist, device: str | None) -> dict:
    r, error = None, None
    try:
        r = _setup(cfg, run, resume, dist, device)
    except Exception as e:
        error = e
    dist.check(error, device)
    state, device = r.state, r.model.device
    stream = _micro_batches(r.examples, cfg, state["epoch"], state["pos"], dist.world)
    metrics_f = open(run / "metrics.jsonl", "a") if dist.main else open(os.devnull, "w")
    reporter = Reporter(parse_report_to(cfg.report_to), run, cfg.as_json()) if dist.main else None
    bar = tqdm(total=r.total, initial=state["step"], desc="train", unit="step", disable=not progress)
    t_start = time.perf_counter()
    last = {}
    try:
        while state["step"] < r.total:
            t0 = time.perf_counter()
            last = _step(r, cfg, [next(stream) for _ in range(cfg.grad_accum)])
            dt = time.perf_counter() - t0
            last.update(tokens_per_s=last["tokens"] / dt, epoch=state["epoch"],
                        peak_mem_gb=round(_peak_memory_gb(device), 3),
                        elapsed_s=round(time.perf_counter() - t_start, 3))
            stop = False
            if cfg.eval_every and state["step"] % cfg.eval_every == 0 and state["step"] < r.total:
                ev, stop = _periodic_eval(r, cfg, run)
                last.update(ev)
                if stop:
                    last["stopped_early"] = True
            metrics_f.write(json.dumps(last) + "\n")
            metrics_f.flush()
            if reporter is not None:
                reporter.log(last, state["step"])
            bar.update(1)
            bar.set_postfix(loss=f"{last['loss']:.4f}", tok_s=f"{last['tokens_per_s']:.0f}",
                            mem=f"{last['peak_mem_gb']:.2f}G")
            if cfg.save_every and state["step"] % cfg.save_every == 0:
                error = None
                try:
                    if dist.main:
                        r.last_good = _save_checkpoint(run, r.model, r.opt, state, cfg)
                except PactError as e:  # (a full disk): every rank stops with it
                    error = e
                dist.check(error, device)
            if stop_after is not None and state["step"] >= stop_after:
                return last
            if stop:
                log.info("early stopping at step %d: %d evaluations without improvement of %s (best: step %d)",
                         state["step"], state["bad_evals"], state["best"]["metric"], state["best"]["step"])
                break
        result = _finish(r, cfg, run, last)
        if reporter is not None and "eval_loss" in result:
            reporter.log({k: v for k, v in result.items() if k.startswith("eval_")}, state["step"])
        return result
    except torch.cuda.OutOfMemoryError:
        raise PactError(f"out of GPU memory at --batch-size {cfg.batch_size} and --max-len {cfg.max_len}: lower "
                        "--batch-size (raise --grad-accum to keep the effective batch) or --max-len, "
                        "or add --checkpoint") from None
    finally:
        bar.close()
        metrics_f.close()
        if reporter is not None:
            reporter.close()
