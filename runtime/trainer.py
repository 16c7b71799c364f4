"""The training loop: AdamW on fp32 adapters, warmup + cosine, accumulation, clipping,
checkpoints that resume the same run bit for bit, PEFT-format output.

Run folder: adapter_config.json + adapter_model.safetensors (PEFT names), metrics.jsonl
(one object per optimizer step), train_config.json, eval.json, checkpoints/step-NNNNNNN/.
Nothing is pickled: checkpoints are safetensors + JSON.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import shutil
import time
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from pact.formats import PactError, open_artifact

from .data import batches, collate, pad_id, read_records, tokenize
from .backends import resolve_device
from .evaluate import evaluate
from .lora import LoraConfig, load_peft_adapter, save_peft_adapter
from .model import PactModel
from .recipe import parse_recipe

log = logging.getLogger(__name__)
KEEP_CHECKPOINTS = 3


@dataclass
class TrainConfig:
    artifact: str = field(metadata={"help": "artifact folder from pact-convert / pact-calibrate"})
    data: str = field(metadata={"help": "train .jsonl (prompt/completion or messages) or datasets folder"})
    out: str = field(metadata={"help": "run folder"})
    eval_data: str | None = field(default=None, metadata={"help": "held-out .jsonl, evaluated at the end"})
    max_len: int = 1024
    overlong: str = field(default="truncate", metadata={"help": "truncate | refuse sequences over max_len"})
    batch_size: int = 8
    grad_accum: int = 1
    steps: int | None = field(default=None, metadata={"help": "optimizer steps (overrides epochs)"})
    epochs: float = 1.0
    lr: float = 2e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.03
    max_grad_norm: float = 1.0
    seed: int = 0
    lora_r: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    save_every: int = 0
    kernels: str | None = None
    compute: str | None = field(default=None, metadata={"help": "auto (= bf16-decode) | bf16-decode | fp8 | nvfp4-native"})
    activations: str | None = field(default=None, metadata={
        "help": "precision recipe: a preset (runtime/recipe.py) with optional SITE.FIELD=VALUE overrides"})
    checkpoint: bool = field(default=False, metadata={"help": "recompute each decoder layer in backward"})
    fp8_weights: str = field(default="per-call", metadata={
        "help": "per-call | resident: --compute fp8 keeps E4M3 weight copies on the GPU (+2 bytes/param, faster)"})
    device: str | None = None

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
        self.activations = parse_recipe(self.activations).spec()  # canonical: resume compares it

    def lora(self) -> LoraConfig:
        return LoraConfig(r=self.lora_r, alpha=self.lora_alpha, dropout=self.lora_dropout, targets=self.targets)

    def as_json(self) -> dict:
        d = asdict(self)
        d["targets"] = list(d["targets"])
        return d


def lr_at(step: int, total: int, base: float, warmup_ratio: float) -> float:
    """Linear warmup, then cosine to zero. ``step`` counts completed optimizer steps."""
    warm = int(total * warmup_ratio)
    if step < warm:
        return base * (step + 1) / warm
    progress = (step - warm) / max(1, total - warm)
    return base * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def _micro_batches(examples, cfg: TrainConfig, epoch: int, pos: int) -> Iterator[tuple[int, int, list[int]]]:
    """(epoch, position after this batch, indices) forever, starting at (epoch, pos)."""
    while True:
        order = batches(examples, cfg.batch_size, seed=cfg.seed, epoch=epoch)
        for i in range(pos, len(order)):
            yield epoch, i + 1, order[i]
        epoch, pos = epoch + 1, 0


def _peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# ------------------------------------------------------------------------- checkpoints


def _save_checkpoint(run: Path, model: PactModel, opt: torch.optim.Optimizer, state: dict, cfg: TrainConfig) -> Path:
    final = run / "checkpoints" / f"step-{state['step']:07d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_peft_adapter(tmp, model.adapter_state(), cfg.lora(), cfg.artifact)
    params = list(model.lora_params.values())
    tensors = {}
    for i, p in enumerate(params):
        for k, v in opt.state.get(p, {}).items():
            tensors[f"{i}.{k}"] = v.detach().cpu().reshape(-1) if v.dim() == 0 else v.detach().cpu()
    save_file(tensors, tmp / "optimizer.safetensors")
    rng = {"cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    save_file(rng, tmp / "rng.safetensors")
    (tmp / "state.json").write_text(json.dumps({**state, "config": cfg.as_json()}, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    done = sorted((run / "checkpoints").glob("step-???????"))
    for old in done[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _config_diff(saved: dict, now: dict) -> list[str]:
    # a setting newer than the checkpoint counts as its default there (the run used that behaviour)
    saved = {**{f.name: f.default for f in fields(TrainConfig) if f.name not in saved
                and f.default is not MISSING}, **saved}
    return [f"  {k}: checkpoint {saved.get(k)!r} -> now {now.get(k)!r}" for k in sorted(set(saved) | set(now))
            if saved.get(k) != now.get(k)]


def _load_checkpoint(run: Path, model: PactModel, opt: torch.optim.Optimizer, cfg: TrainConfig) -> dict:
    done = sorted((run / "checkpoints").glob("step-???????"))
    if not done:
        raise PactError(f"--resume: {run}/checkpoints has no checkpoint (train with --save-every N)")
    ck = done[-1]
    state = json.loads((ck / "state.json").read_text())
    diff = _config_diff(state.pop("config"), cfg.as_json())
    if diff:
        raise PactError(f"--resume: {ck} was made with other settings; resume with the same flags or start a new run:\n"
                        + "\n".join(diff))
    _, adapters = load_peft_adapter(ck)
    model.load_adapter_state(adapters)
    saved = load_file(ck / "optimizer.safetensors")
    params = list(model.lora_params.values())
    for i, p in enumerate(params):
        st = {k.split(".", 1)[1]: v for k, v in saved.items() if k.split(".", 1)[0] == str(i)}
        if st:
            st["step"] = st["step"].reshape(())
            opt.state[p] = {k: v.to(p.device) if k != "step" else v for k, v in st.items()}
    rng = load_file(ck / "rng.safetensors")
    torch.random.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    log.info("resumed from %s (step %d)", ck, state["step"])
    return state


def _truncate_metrics(path: Path, step: int) -> None:
    if path.exists():
        keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in keep))


# ------------------------------------------------------------------------------ loop


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True, stop_after: int | None = None) -> dict:
    """Train, save the adapter in PEFT format into ``cfg.out`` and return the final metrics.

    ``stop_after`` ends the process-equivalent of a kill right after that step (tests).
    """
    run = Path(cfg.out)
    if run.exists() and any(run.iterdir()) and not resume:
        raise PactError(f"--out {run} is not empty: pass --resume to continue that run, or choose another folder")
    run.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    if device.type == "cpu":
        log.warning("no GPU: training on the CPU (correct, slow; fine for tiny models and tests)")
    art = open_artifact(cfg.artifact)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(art.hf_dir, trust_remote_code=False)
    model = PactModel(art, cfg.lora(), device=device, kernels=cfg.kernels, compute=cfg.compute, activations=cfg.activations,
                      checkpoint=cfg.checkpoint, seed=cfg.seed, fp8_weights=cfg.fp8_weights)
    vocab = model.embed.shape[0]
    if len(tokenizer) > vocab:
        raise PactError(f"{art.hf_dir}: tokenizer has {len(tokenizer)} tokens but the embedding has {vocab} rows: "
                        "artifact and tokenizer do not match; re-run pact-convert on the model folder")
    pad = pad_id(tokenizer)
    examples = tokenize(read_records(cfg.data), tokenizer, max_len=cfg.max_len, overlong=cfg.overlong, vocab_size=vocab)
    per_epoch = math.ceil(math.ceil(len(examples) / cfg.batch_size) / cfg.grad_accum)
    total = cfg.steps or max(1, math.ceil(cfg.epochs * per_epoch))
    params = list(model.lora_params.values())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=device.type == "cuda")
    state = {"step": 0, "epoch": 0, "pos": 0, "tokens": 0}
    if resume and (run / "checkpoints").exists():
        state = _load_checkpoint(run, model, opt, cfg)
        _truncate_metrics(run / "metrics.jsonl", state["step"])  # steps after the checkpoint are redone
    (run / "train_config.json").write_text(json.dumps({**cfg.as_json(), "recipe": model.recipe.as_json()}, indent=2) + "\n")
    stream = _micro_batches(examples, cfg, state["epoch"], state["pos"])
    metrics_f = open(run / "metrics.jsonl", "a")
    bar = tqdm(total=total, initial=state["step"], desc="train", unit="step", disable=not progress)
    t_start = time.perf_counter()
    last = {}
    try:
        while state["step"] < total:
            t0 = time.perf_counter()
            micro = [next(stream) for _ in range(cfg.grad_accum)]
            loaded = [collate(examples, idx, pad, device) for _, _, idx in micro]
            n_targets = sum(int((lab[:, 1:] != -100).sum()) for _, lab in loaded)
            loss_sum = 0.0
            for ids, labels in loaded:
                loss, _ = model(ids, labels)
                (loss / max(n_targets, 1)).backward()
                loss_sum += float(loss.detach())
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
            lr = lr_at(state["step"], total, cfg.lr, cfg.warmup_ratio)
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
            opt.zero_grad(set_to_none=True)
            tokens = sum(int(ids.numel()) for ids, _ in loaded)
            state.update(step=state["step"] + 1, epoch=micro[-1][0], pos=micro[-1][1], tokens=state["tokens"] + tokens)
            dt = time.perf_counter() - t0
            last = {"step": state["step"], "loss": loss_sum / max(n_targets, 1), "lr": lr, "grad_norm": grad_norm,
                    "targets": n_targets, "tokens": tokens, "tokens_per_s": tokens / dt, "epoch": state["epoch"],
                    "peak_mem_gb": round(_peak_memory_gb(device), 3), "elapsed_s": round(time.perf_counter() - t_start, 3)}
            metrics_f.write(json.dumps(last) + "\n")
            metrics_f.flush()
            bar.update(1)
            bar.set_postfix(loss=f"{last['loss']:.4f}", tok_s=f"{last['tokens_per_s']:.0f}", mem=f"{last['peak_mem_gb']:.2f}G")
            if cfg.save_every and state["step"] % cfg.save_every == 0:
                _save_checkpoint(run, model, opt, state, cfg)
            if stop_after is not None and state["step"] >= stop_after:
                return last
    except torch.cuda.OutOfMemoryError:
        raise PactError(f"out of GPU memory at --batch-size {cfg.batch_size} and --max-len {cfg.max_len}: lower "
                        "--batch-size (raise --grad-accum to keep the effective batch) or --max-len, or add --checkpoint") from None
    finally:
        bar.close()
        metrics_f.close()
    save_peft_adapter(run, model.adapter_state(), cfg.lora(), cfg.artifact)
    result = dict(last)
    if cfg.eval_data:
        held = tokenize(read_records(cfg.eval_data), tokenizer, max_len=cfg.max_len, overlong=cfg.overlong, vocab_size=vocab)
        result.update(evaluate(model, held, batch_size=cfg.batch_size, pad_id=pad))
        (run / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
