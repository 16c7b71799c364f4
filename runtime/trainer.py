"""The training loop: AdamW on fp32 adapters, warmup + cosine (or --lr-scheduler), accumulation,
clipping, checkpoints that resume the same run bit for bit, PEFT-format output.

Run folder: adapter_config.json + adapter_model.safetensors (PEFT names), metrics.jsonl
(one object per optimizer step), train_config.json (with the artifact's and data's
fingerprints, which --resume compares), eval.json, checkpoints/step-NNNNNNN/, and .lock while
a process trains into it. Nothing is pickled: checkpoints are safetensors + JSON.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from tqdm.auto import tqdm

from pact.formats import Artifact, PactError
from pact.formats.files import atomic_folder, recover_aside, replace_text
from pact.formats.peft import reserve_peft_adapter, save_peft_adapter

from .autorecipe import (
    PROBE_BATCHES,
    choose,
    chosen_recipe,
    from_codes,
    parse_auto,
    probe_rows,
    probe_step,
    saved_codes,
)
from .checkpoints import (  # noqa: F401 (pact.runtime.trainer.<name> keeps working)
    CALIBRATED,
    CHECKPOINT_FILES,
    KEEP_CHECKPOINTS,
    MAX_STEP,
    RESUME_MAY_CHANGE,
    _disk_error,
    _load_checkpoint,
    _save_checkpoint,
    _truncate_metrics,
    _usable_checkpoints,
    base_model,
)
from .config import PATH_FIELDS, SCHEDULERS, TrainConfig, _absolute  # noqa: F401
from .data import batches, collate, collate_packed, pack, pad_id, read_records, tokenize
from .distributed import Dist, from_env, leave
from .evaluate import evaluate, label_candidates
from .graphs import bucket_length, layer_weights, settings_refusal, use_graphs
from .model import PactModel
from .recipe import DEFAULT as DEFAULT_RECIPE
from .recipe import parse_recipe
from .reporting import Reporter, check_available, parse_report_to
from .runfolder import _clear_new_run, _is_new, _prepare_run, _trained, data_fingerprint, run_lock  # noqa: F401
from .session import open_session

log = logging.getLogger(__name__)


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


# ------------------------------------------------------------------------- run folder


# ------------------------------------------------------------------------------ loop


def check_inputs(cfg: TrainConfig, *, tokenize: bool = False) -> Artifact:
    """The data files and the --report-to backends, before any model loads; ``tokenize`` (pact-train
    --calibrate, before its GPTQ): every record tokenized by the artifact's tokenizer as training will.
    Returns the artifact it opened (training goes on with it: one opening, one containment walk)."""
    from pact.formats import check_apart, open_artifact
    from pact.formats.artifact import check_outside_artifacts
    from pact.formats.families import text_config

    from .data import tokenize as to_examples  # (the flag's name hides the function here)
    from .ops import resolve_device, resolve_kernels
    from .session import load_tokenizer

    if "://" not in str(cfg.artifact):  # a run inside the artifact would be deleted by pact-convert --overwrite
        o, a = Path(cfg.out).resolve(), Path(cfg.artifact).resolve()
        if a == o or not a.is_relative_to(o):  # (an --out may hold its own calibrated/ artifact)
            check_apart(o, {"artifact": a}, "pact-train")
    check_outside_artifacts(Path(cfg.out), "--out")  # (nor inside any other artifact)
    # what _setup refuses once the model is loaded, refused before it loads (and before a minute of GPTQ)
    device = resolve_device(cfg.device)  # a bad --device: its one-line error, not torch's
    resolve_kernels(cfg.kernels, device)
    art = open_artifact(cfg.artifact)
    n_layers = (text_config(art.meta["hf_config"]) or {}).get("num_hidden_layers")
    if isinstance(n_layers, int):
        cfg.lora().layer_ids(n_layers)  # --lora-layers against the model's depth
    tokenizer = load_tokenizer(art) if tokenize else None
    for path, flag, split in ((cfg.data, "--data", cfg.data_split), (cfg.eval_data, "--eval-data", cfg.eval_split)):
        if path is not None:
            records = read_records(path, flag, split)  # a missing or malformed file fails now
            if tokenizer is not None:  # types, empty completions, chat templates: what _setup would refuse
                examples = to_examples(records, tokenizer, max_len=cfg.max_len, overlong=cfg.overlong)
                if flag == "--eval-data" and cfg.metric_for_best == "eval_accuracy":
                    _check_label_data(examples, cfg)
    check_available(parse_report_to(cfg.report_to))
    why = settings_refusal(str(device), cfg.lora_dropout, cfg.kernels)
    if cfg.cuda_graphs == "on" and why:  # (the model says the same later; this is before any GPTQ)
        raise PactError(f"--cuda-graphs on: {why}; use --cuda-graphs auto (eager where graphs cannot run) or off")
    return art


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True, stop_after: int | None = None) -> dict:
    """Train, save the adapter in PEFT format into ``cfg.out`` and return the final metrics.

    Under torchrun (WORLD_SIZE > 1) every rank runs this; rank 0 alone owns the run folder
    (runtime/distributed.py). ``stop_after`` ends the process-equivalent of a kill right after
    that step (tests).
    """
    dist, device = from_env(cfg.device)
    run = Path(cfg.out)
    art = check_inputs(cfg)
    lock, error, created, owned = contextlib.ExitStack(), None, dist.main and not run.exists(), False
    fresh = dist.main and _is_new(run)  # no results yet (it may hold pact-train's calibration's calibrated/)
    if resume and fresh:
        log.warning("--resume: %s holds no run yet: starting one from step 0", run)
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
        return _train(cfg, art, run, resume, progress and dist.main, stop_after, dist, device)
    finally:
        # a run that failed before its first step leaves no folder (or, in one that held only
        # pact-train's calibration's calibrated/, nothing beside it): only the lock holder removes it (a
        # concurrent pact-train that made the same --out first keeps it), and before releasing the lock
        if owned and run.is_dir() and not _trained(run):
            if created:
                shutil.rmtree(run, ignore_errors=True)
            elif fresh and (run / CALIBRATED).is_dir():  # pact-train's calibration made it, and calibrated/ stays
                _clear_new_run(run)
        lock.close()
        leave(dist)


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


def _setup(cfg: TrainConfig, art: Artifact, run: Path, resume: bool, dist: Dist, device: str | None) -> _Run:
    """Device, verified artifact, tokenizer and model (runtime/session.py), the tokenized data, the
    optimizer, and the state of the newest usable checkpoint when resuming; records the run's
    config, recipe and input fingerprints in train_config.json (rank 0)."""
    torch.manual_seed(cfg.seed)
    ses = open_session(art, device=device, flag="--artifact")  # from_env's: cfg.device, or this rank's
    records = read_records(cfg.data, "--data", cfg.data_split)
    inputs = {"artifact": ses.artifact.fingerprint(), "data": data_fingerprint(cfg.data, records)}
    held_records = read_records(cfg.eval_data, "--eval-data", cfg.eval_split) if cfg.eval_data else None
    if held_records is not None:  # (a resumed run's best/ compares evaluations of the same examples)
        inputs["eval_data"] = data_fingerprint(cfg.eval_data, held_records)
    auto = parse_auto(cfg.activations)  # --activations auto: the default recipe until the probe picks
    tokens = cfg.batch_size * cfg.max_len  # graphed steps: no micro-batch is larger
    graphs = use_graphs(cfg.cuda_graphs, tokens, weights := layer_weights(ses.artifact))
    if cfg.cuda_graphs == "auto" and not graphs and ses.device.type == "cuda":
        log.info("--cuda-graphs auto: eager steps (%d tokens x %.0fM frozen weights a layer: the GPU's work hides "
                 "the launches)", tokens, weights / 1e6)
    model = ses.model(cfg.lora(), kernels=cfg.kernels, compute=cfg.compute,
                      activations=DEFAULT_RECIPE if auto is not None else cfg.activations,
                      checkpoint=cfg.checkpoint, seed=cfg.seed, fp8_weights=cfg.fp8_weights, cuda_graphs=graphs,
                      backward_weights=cfg.backward_weights)
    model.graph_tokens = tokens
    vocab = model.embed.shape[0]
    examples = tokenize(records, ses.tokenizer, max_len=cfg.max_len,
                        overlong=cfg.overlong, vocab_size=vocab)
    window = int(getattr(model.cfg, "max_position_embeddings", 0) or 0)
    longer = sum(len(e.ids) > window for e in examples) if window else 0
    if longer and dist.main:  # (said, not refused: a run may extend the context on purpose)
        log.warning("%d of %d examples are longer than the model's context (%d positions, max_position_embeddings; "
                    "--max-len %d lets them through): they train on positions it never saw; lower --max-len to %d "
                    "unless you mean to extend the context", longer, len(examples), window, cfg.max_len, window)
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
        at = json.loads((last_good / "state.json").read_text())["step"]  # (checked by _usable_checkpoints)
        if at > total:  # refused before anything is loaded or cut: the run stays as it is
            raise PactError(f"--resume: the newest checkpoint of {run} is at step {at}, beyond this run's {total} "
                            f"steps: pass --max-steps (--steps) of at least {at + 1} to train further; nothing "
                            "was changed")
        state = _load_checkpoint(run, last_good, model, opt, cfg, inputs, dist.world)
        if dist.main:
            log.info("--resume: continuing from step %d (%s)", state["step"], last_good)
        if auto is not None and "recipe_auto" in state:  # the probe ran before this checkpoint: its choice
            rec = state["recipe_auto"]
            model.use_recipe(chosen_recipe(model.recipe, rec.get("chosen") if isinstance(rec, dict) else None,
                                           str(last_good / "state.json")))
        if dist.main:
            _truncate_metrics(run / "metrics.jsonl", state["step"])  # steps after the checkpoint are redone
        if state["step"] == total:
            log.info("%s: the checkpoint is at the last step (%d); writing the adapter", last_good, total)
    state["inputs"] = inputs
    state["world_size"] = dist.world
    if dist.main:  # best/ as a kill between its two renames left it: put back, leftovers removed
        recover_aside(run / "best", "the best adapter", lambda p: (p / "adapter_model.safetensors").is_file())
        try:  # the final adapter's disk space, claimed now: a full disk fails here, not after training
            reserve_peft_adapter(run, model.adapter_state(), cfg.lora(), base_model(model.artifact))
        except OSError as e:
            raise _disk_error(e, run / "adapter_model.safetensors") from None
        _write_run_config(run, cfg, model, dist, state)
    held = None
    if cfg.eval_data:
        held = tokenize(held_records, ses.tokenizer,
                        max_len=cfg.max_len, overlong=cfg.overlong,
                        vocab_size=vocab)
        if cfg.metric_for_best == "eval_accuracy":
            _check_label_data(held, cfg)
    return _Run(model, ses.tokenizer, examples, pad_id(ses.tokenizer), total, params, opt, state, last_good, dist,
                held)


def _check_label_data(held: list, cfg: TrainConfig) -> None:
    if label_candidates(held) is None:
        raise PactError(f"--metric-for-best eval_accuracy: {cfg.eval_data} is not label data (its completions are "
                        "not a small set of answers); use eval_loss")


def _write_run_config(run: Path, cfg: TrainConfig, model: PactModel, dist: Dist, state: dict) -> None:
    """RUN/train_config.json (rank 0): the config, the recipe the model runs, the world, the inputs'
    fingerprints and --activations auto's choice once made; written beside and renamed in."""
    replace_text(run / "train_config.json", json.dumps({
        **cfg.as_json(), "recipe": model.recipe.as_json(), "graphed": model.cuda_graphs,
        "backward_weights_read": model.ops.dgrad_reads, "world_size": dist.world,
        "global_batch": cfg.batch_size * dist.world * cfg.grad_accum, "inputs_sha256": state["inputs"],
        **({"recipe_auto": state["recipe_auto"]} if "recipe_auto" in state else {})}, indent=2) + "\n")


def _step(r: _Run, cfg: TrainConfig, micro: list) -> dict:
    """One optimizer step over the global micro-batches ``micro`` (this rank computes its share of
    each); returns the step's metrics (global, without timing)."""
    device, state, dist = r.model.device, r.state, r.dist
    shares = [idx[dist.share(len(idx))] for _, _, idx in micro]
    make = collate_packed if cfg.packing else collate
    # graphed steps: sequence lengths padded to a few buckets (one capture each); padding is never a target
    width = (lambda n: bucket_length(n, cfg.max_len)) if r.model.cuda_graphs else None
    loaded = [make(r.examples, share, r.pad, device, width=width) for share in shares if share]
    local_targets = sum(int((b[1][:, 1:] != -100).sum()) for b in loaded)
    local_tokens = sum(len(r.examples[i].ids) for share in shares for i in share)  # real ones: not the padding
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


def _probe(r: _Run, cfg: TrainConfig, run: Path, factor: float) -> None:
    """--activations auto: the saved precisions the probe picks (runtime/autorecipe.py) on a few
    batches of the run's data (rank 0's choice, on every rank), from now on; the choice, its
    gradient errors and cost go into the checkpointed state and train_config.json."""
    make = collate_packed if cfg.packing else collate
    order = batches(r.examples, probe_rows(cfg.batch_size), seed=cfg.seed + 1, epoch=0)[:PROBE_BATCHES]
    loaded = [make(r.examples, idx, r.pad, r.model.device) for idx in order]
    dev = r.model.device
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):  # the run's random stream untouched
        chosen, record = choose(r.model, loaded, factor)
    pick = [float(i) if r.dist.main else 0.0 for i in saved_codes(chosen)]
    codes = [int(v) for v in r.dist.sum(pick, r.model.device)]  # rank 0's choice everywhere
    chosen = from_codes(r.model.recipe, codes)
    record.update(chosen=chosen.spec(), step=r.state["step"])
    r.model.use_recipe(chosen)
    r.state["recipe_auto"] = record
    log.info("--activations %s: probe at step %d (%d batches, %d passes, %.1f s) picked %s (%d of %d budget "
             "bytes per token)", cfg.activations, record["step"], record["batches"], record["passes"],
             record["seconds"], record["chosen"], record["bytes_per_token"], record["budget_bytes_per_token"])
    if r.dist.main:
        _write_run_config(run, cfg, r.model, r.dist, r.state)



def _out_of_memory(cfg: TrainConfig, where: str) -> PactError:
    """The error of a run out of GPU memory: the flags that lower it (--backward-weights forward where the run
    loads the backward layouts and its backend can do without them)."""
    dgrad_fp8 = parse_auto(cfg.activations) is None and parse_recipe(cfg.activations).dgrad == "fp8"
    more = "" if cfg.backward_weights == "forward" or cfg.compute == "nvfp4-native" or dgrad_fp8 else (
        ", or --backward-weights forward (the backward layouts stay on disk: about half the frozen weights' "
        "memory; BENCHMARKS.md measures what it costs)")
    return PactError(f"out of GPU memory {where}: lower --batch-size (raise --grad-accum to keep the effective "
                     f"batch) or --max-len, or add --checkpoint{more}")


def _train(cfg: TrainConfig, art: Artifact, run: Path, resume: bool, progress: bool, stop_after: int | None,
           dist: Dist, device: str | None) -> dict:
    r, error = None, None
    try:
        r = _setup(cfg, art, run, resume, dist, device)
    except torch.cuda.OutOfMemoryError:  # loading the weights (both layouts) or the first allocations
        error = _out_of_memory(cfg, "while loading the model")
    except Exception as e:
        error = e
    dist.check(error, device)
    state, device = r.state, r.model.device
    auto = parse_auto(cfg.activations)
    stream = _micro_batches(r.examples, cfg, state["epoch"], state["pos"], dist.world)
    reporter = Reporter(parse_report_to(cfg.report_to), run, cfg.as_json()) if dist.main else None  # (first: its
    metrics_f = open(run / "metrics.jsonl", "a") if dist.main else open(os.devnull, "w")  # failure leaves no file open)
    bar = tqdm(total=r.total, initial=state["step"], desc="train", unit="step", disable=not progress)
    t_start = time.perf_counter()
    last, graphed = {}, r.model.cuda_graphs
    try:
        while state["step"] < r.total:
            if auto is not None and "recipe_auto" not in state and state["step"] == probe_step(r.total):
                _probe(r, cfg, run, auto)
            t0 = time.perf_counter()
            last = _step(r, cfg, [next(stream) for _ in range(cfg.grad_accum)])
            dt = time.perf_counter() - t0
            if graphed and not r.model.cuda_graphs:  # a capture failed under --cuda-graphs auto: eager from here
                graphed = False
                if dist.main:
                    _write_run_config(run, cfg, r.model, dist, state)
            last.update(tokens_per_s=last["tokens"] / dt, epoch=state["epoch"],
                        peak_mem_gb=round(_peak_memory_gb(device), 3),
                        elapsed_s=round(time.perf_counter() - t_start, 3))
            if device.type == "cuda":  # what the process holds (a graphed run's captures share one pool, held)
                last["reserved_mem_gb"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 3)
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
        raise _out_of_memory(cfg, f"at --batch-size {cfg.batch_size} and --max-len {cfg.max_len}") from None
    finally:
        bar.close()
        metrics_f.close()
        if reporter is not None:
            reporter.close()
