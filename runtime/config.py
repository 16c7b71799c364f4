"""Every setting of a training run, checked before anything loads: ``TrainConfig`` (pact-train's
options, one field each; pipelines/common.py makes the CLI options from the fields' metadata)."""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path

from pact.formats import PactError
from pact.formats.peft import ALL_TARGETS, LoraConfig

from .autorecipe import auto_spec, parse_auto
from .data import looks_like_hub_id
from .graphs import GRAPH_WORK
from .ops import (
    BACKWARD_WEIGHTS,
    COMPUTE,
    FP8_WEIGHTS,
    KERNELS,
    check_dgrad_flags,
    resolve_backward_weights,
    resolve_fp8_weights,
)
from .recipe import HELP as RECIPE_HELP
from .recipe import parse_recipe
from .reporting import parse_report_to

SCHEDULERS = ("cosine", "linear", "constant", "constant_with_warmup", "polynomial", "inverse_sqrt")


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
    backward_weights: str = _opt(
        "auto", "What the input-gradient GEMMs (dX = dY W) multiply: layout (the artifact's backward layout, W^T "
                "rounded along the other dimension) or forward (the forward layout's own weights, transposed: the "
                "exact gradient of the model's forward, a bf16 GEMM on either backend; the backward layouts are not "
                "loaded, about half the frozen weights' memory; bf16-decode and fp8 only; not with --activations "
                "...,dgrad=fp8). auto = layout.",
        choices=BACKWARD_WEIGHTS)
    activations: str | None = _opt(None, RECIPE_HELP, metavar="RECIPE")
    checkpoint: bool = _opt(False, "Recompute each decoder layer in backward (less memory, ~1/3 more compute).",
                            aliases=("--gradient-checkpointing",))
    cuda_graphs: str = _opt("auto", "Replay each training step's decoder layers as CUDA graphs (one capture per "
                                    "batch shape; sequence lengths padded to powers of two up to --max-len): "
                                    "shorter steps where kernel launches set the pace. auto: on where they can "
                                    "run (CUDA, no --lora-dropout) and a micro-batch's work per layer is small "
                                    "(--batch-size x --max-len x a layer's frozen weights <= "
                                    f"{GRAPH_WORK:.0e}: SmolLM2-135M always, 1B shapes up to ~6K tokens, 3B "
                                    "~4K, 8B ~1.8K); larger ones gain little and the captures hold more memory.",
                            choices=("auto", "on", "off"))
    device: str | None = _opt(None, "cuda, cuda:1, cpu (default: cuda if available).")

    def __post_init__(self) -> None:
        self.targets = tuple(self.targets)
        for name in ("max_len", "batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise PactError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.steps is not None and self.steps < 1:
            raise PactError(f"--steps must be >= 1, got {self.steps}")
        if not (math.isfinite(self.epochs) and self.epochs > 0):
            raise PactError(f"--epochs must be a finite number > 0, got {self.epochs}")
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
        if self.eval_split is not None and not self.eval_data:
            raise PactError("--eval-split needs --eval-data (the datasets folder or hub id it picks a split of)")
        if self.eval_every and not self.eval_data:
            raise PactError("--eval-every needs --eval-data (the held-out file it evaluates)")
        if self.early_stopping_patience and not self.eval_every:
            raise PactError("--early-stopping-patience needs --eval-every N (how often to evaluate)")
        if self.metric_for_best not in ("auto", "eval_loss", "eval_accuracy"):
            raise PactError(f"--metric-for-best must be auto, eval_loss or eval_accuracy, got {self.metric_for_best!r}")
        if self.metric_for_best != "auto" and not self.eval_data:
            raise PactError(f"--metric-for-best {self.metric_for_best} needs --eval-data (the held-out file it is "
                            "measured on)")
        if self.overlong not in ("truncate", "refuse"):
            raise PactError(f"--overlong must be truncate or refuse, got {self.overlong!r}")
        parse_report_to(self.report_to)
        # flag combinations the model would refuse, refused before anything loads (an explicit --compute; auto is
        # bf16-decode on every device)
        compute = "bf16-decode" if self.compute in (None, "auto") else self.compute
        if compute in COMPUTE:
            resolve_fp8_weights(self.fp8_weights, compute)
            resolve_backward_weights(self.backward_weights, compute)
        factor = parse_auto(self.activations)  # canonical spellings: resume compares them
        recipe = None if factor is not None else parse_recipe(self.activations)
        self.activations = auto_spec(factor) if recipe is None else recipe.spec()
        if compute in COMPUTE and recipe is not None:
            check_dgrad_flags(recipe.dgrad, compute, self.backward_weights)
        self.lora()  # --targets, --lora-r, --lora-dropout and --lora-layers' syntax
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
    if path is None or "://" in str(path) or not Path(path).expanduser().exists() and looks_like_hub_id(str(path)):
        return path  # a missing "org/name" stays as typed: the data reader names it as a hub id
    return str(Path(path).expanduser().resolve())
