"""Sequential NVFP4 GPTQ over an artifact: decoder layers in order, each layer's inputs taken
from the already-calibrated layers before it, with activations quantized exactly as the
runtime quantizes them (the runtime's own layer forward is run; its GEMM inputs are captured).

One Hessian per shared input: q|k|v share one, gate|up share one (and o, down one each).
The high-precision weights come from the artifact's source model (its provenance, or
``source``); the artifact itself only has the NVFP4 (round-to-nearest) weights.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from pact import __version__
from pact.convert.sources import open_source, remove_tree
from pact.formats import ArtifactWriter, PactError, check_apart, check_output
from pact.formats.artifact import CORRECTION_MAX_RANK
from pact.formats.errors import write_error
from pact.formats.files import sha256_file, work_path
from pact.formats.nvfp4 import SCALE_RULES, NVFP4Tensor, dequantize, quantize, quantize_weight, transpose_2d
from pact.runtime.generate import sample_texts
from pact.runtime.model import PactModel
from pact.runtime.session import Session, open_session
from pact.runtime.vision import ImageSample, VisionTower, image_inputs

from .gptq import GPTQ
from .prompts import load_prompts
from .quantizer import NVFP4Quantizer

log = logging.getLogger(__name__)
GROUPS = ("qkv", "o", "gate_up", "down")
BACKWARD_LAYOUTS = ("forward", "source")  # calibrate(backward_layout=...): what the backward GEMM reads
BATCH_TOKENS = 4096  # text prompts go through a layer in right-padded batches of about this many tokens


class SourceError(PactError):
    """The artifact's source model cannot be read as the one it was converted from (gone, emptied, its
    weights removed, or another model at its path): GPTQ needs the original weights."""


def _correction(E: torch.Tensor, L: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """U [N, R], V [R, K] (fp32) of the rank-R C = U V closest to the weights' error E = W - Q on the
    inputs: C minimizes ||(E - C) L|| with L L^T = Hd (`_input_factor`), as ||M L||^2 = tr(M Hd M^T) for
    any such factor: with E L = P S Z^T, C = P_R S_R Z_R^T L^-1, split as U = P_R S_R^1/2, V = S_R^1/2
    Z_R^T L^-1. A LoRA started from the error alone (LoftQ) holds ~10% of it at rank 16 on SmolLM2;
    weighed by the inputs, 60% (BENCHMARKS.md "Calibration downstream")."""
    M = E.float() @ L
    r = min(rank, *M.shape)
    if r * 4 < min(M.shape):  # the top R only: a randomized range finder (Halko et al.), a few passes over M
        P, S, Z = torch.svd_lowrank(M, q=min(r + 16, *M.shape), niter=4)
        Zt = Z.t()
    else:
        P, S, Zt = torch.linalg.svd(M, full_matrices=False)
    s = S[:r].sqrt()
    return P[:, :r] * s, torch.linalg.solve_triangular(L, s[:, None] * Zt[:r], upper=False, left=False)


def _input_factor(H: torch.Tensor, damp: float) -> torch.Tensor:
    """L (lower, fp32) with L L^T = Hd = H + damp * mean(diag H) I, one per group (its members share the
    inputs): the damping keeps the correction small along directions the inputs barely reach."""
    Hd = H.float().clone()
    Hd.diagonal().add_(damp * float(Hd.diagonal().mean().clamp(min=1e-12)))
    return torch.linalg.cholesky(Hd)


def _output_error(W: torch.Tensor, Q: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """Relative layer-output error on the calibration inputs, from H = 2/n X^T X:
    ||X (W - Q)^T||_F / ||X W^T||_F = sqrt(tr(D H D^T) / tr(W H W^T)); 0 where the denominator is 0.
    A 0-dim tensor: the caller reads it once all layers are done (no device sync per weight)."""
    D = (W - Q).float()
    num = torch.einsum("nk,kl,nl->", D, H, D)
    den = torch.einsum("nk,kl,nl->", W.float(), H, W.float())
    return torch.where(den > 0, torch.sqrt(num / den), torch.zeros_like(den))


class _Clock:
    """Seconds per stage: ``lap(stage)`` charges the time since the last lap to ``stage`` (after
    waiting for the device, so that queued GPU work is charged to the stage that queued it)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.seconds: dict[str, float] = {}
        self.t0 = self.t = time.perf_counter()

    def lap(self, stage: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self.t
        self.t = now

    def report(self) -> dict[str, float]:
        out = {k: round(v, 2) for k, v in self.seconds.items()}
        out["total"] = round(self.t - self.t0, 2)
        return out


@dataclass
class Unit:
    """Prompts run through a layer together: inputs x [B * S, H] (right-padded to S), RoPE tables,
    and which rows are real tokens (None: all). Causal attention never lets a real token see the
    padding after it, and every kernel works per row, so a real row's values are those of its
    prompt run alone."""

    x: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    B: int
    S: int
    real: torch.Tensor | None = None


def source_bound(art) -> int:
    """The most a source of ``art``'s weights can hold: 4 bytes a weight (an fp32 checkpoint) and 256 MiB of
    config, tokenizer and template files. A hub repo the artifact names (someone else's choice) is downloaded only
    within it."""
    n = 0
    for name in art.names():
        shape = art.entry(name)["shape"]
        n += math.prod(shape)
    return 4 * n + (256 << 20)


def calibrate(
    artifact: str | os.PathLike,
    prompts: str | os.PathLike | None,
    out: str | os.PathLike,
    *,
    model_texts: bool = False,
    seed: int | None = None,
    source: str | None = None,
    max_samples: int = 128,
    seq_len: int = 512,
    min_tokens: int = 0,
    damp: float = 0.01,
    actorder: bool = False,
    static_scales: bool = False,
    blocksize: int = 128,
    block_scales: str = "auto",
    backward_layout: str = "forward",
    correct_rank: int = 0,
    device: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    prompts_label: str | None = None,
    record: dict | None = None,
) -> Path:
    """GPTQ of ``artifact``'s projections on ``prompts`` (or, ``model_texts``, on max_samples texts
    of seq_len tokens that the artifact's own model samples from its BOS token, seeded by ``seed``:
    no data needed); the calibrated artifact is written to ``out``. ``prompts_label``: what the
    provenance records as the prompts (default: their path); ``record``: more keys for it. Text
    prompts: the first ``max_samples``, and (``min_tokens``) more after them until they hold that
    many tokens (each cut to ``seq_len``).

    ``backward_layout``: what the backward GEMM (dX = dY W, through the stored W^T) reads. "forward":
    the calibrated weights, transposed and rounded again along the other dimension. "source": W^T
    rounded to nearest from the source weights, as pact-convert makes it: GPTQ lowers the forward
    GEMM's error on inputs like the prompts by moving the weights away from the source, which raises
    the backward GEMM's error on the gradients (BENCHMARKS.md "Calibration downstream").

    ``correct_rank`` R > 0: each projection also stores a frozen rank-R correction U V (bf16) of what
    the NVFP4 weights still miss, fitted to the prompts' inputs (`_correction`); the model computes
    with dequantize(W_q) + U V."""
    if prompts is not None and model_texts:
        raise PactError("--prompts and --model-texts: give one of them (--model-texts samples the texts instead)")
    if prompts is None and not model_texts:
        raise PactError("give --prompts FILE|FOLDER, or --model-texts to calibrate on texts the model samples "
                        "itself (no data needed)")
    if seed is not None and not model_texts:
        raise PactError("--seed seeds --model-texts' sampling; with --prompts it would change nothing: drop it")
    seed = 0 if seed is None else seed
    if not 0 <= seed < 2**63:
        raise PactError(f"--seed must be in [0, 2**63), got {seed}")
    if not 0 < damp < 1:
        raise PactError(f"--damp must be in (0, 1), got {damp}")
    if not 0 <= correct_rank <= CORRECTION_MAX_RANK:
        raise PactError(f"--correct-rank must be in [0, {CORRECTION_MAX_RANK}] (0: no correction), got {correct_rank}")
    if model_texts and max_samples < 1:
        raise PactError(f"--max-samples must be >= 1 (texts to sample), got {max_samples}")
    if max_samples < 0 or (max_samples == 0 and not min_tokens):
        raise PactError(f"--max-samples must be >= 1 (or 0 with --min-tokens: texts until that many tokens), "
                        f"got {max_samples}")
    if min_tokens < 0:
        raise PactError(f"--min-tokens must be >= 0, got {min_tokens}")
    if model_texts and min_tokens:
        raise PactError("--min-tokens reads more --prompts texts; --model-texts samples --max-samples texts of "
                        "--seq-len tokens instead: drop it")
    if seq_len < 2:  # (a prompt of fewer tokens gives GPTQ nothing; images need more, said where they are read)
        what = "sampled text" if model_texts else "prompt"
        raise PactError(f"--seq-len must be >= 2 (tokens a {what}), got {seq_len}")
    if blocksize % 16 or blocksize < 16:
        raise PactError(f"--blocksize must be a multiple of 16, got {blocksize}")
    if backward_layout not in BACKWARD_LAYOUTS:
        raise PactError(f"--backward-layout must be {' or '.join(BACKWARD_LAYOUTS)}, got {backward_layout!r}")
    if block_scales not in ("auto", *SCALE_RULES):
        raise PactError(f"--block-scales must be auto, {' or '.join(SCALE_RULES)}, got {block_scales!r}")
    check_apart(out, {"artifact": Path(artifact)}, "pact-calibrate")
    out = check_output(out, overwrite)
    clock = _Clock("cpu")  # the device is known once the session is open
    ses = open_session(artifact, device=device, tool="pact-calibrate")  # a damaged artifact is never calibrated
    art = ses.artifact
    if "source_quantization" in art.meta["provenance"]:
        raise PactError(f"{art.path}: imported from an already quantized checkpoint "
                        f"({art.meta['provenance']['source_quantization'].get('format')}): GPTQ needs the "
                        "unquantized weights; calibrate an artifact converted from the original model")
    # auto: the rule the artifact was converted with (artifacts from before the choice existed: amax)
    rule = art.block_scale_rule if block_scales == "auto" else block_scales
    samples = None if model_texts else load_prompts(prompts, ses.tokenizer, vision=art.meta["vision"],
                                                    max_samples=max_samples, seq_len=seq_len, hf_dir=art.hf_dir,
                                                    min_tokens=min_tokens)
    prov = art.meta["provenance"]
    src_name = source or prov["source"]
    gguf = str(src_name).endswith(".gguf")
    if source is None and gguf and Path(src_name).is_file() and sha256_file(Path(src_name)) != prov.get("gguf_sha256"):
        raise SourceError(f"{src_name}: not the GGUF file this artifact was converted from (sha256 differs): "
                        "pass --source with the original model")
    workdir = work_path(out, "src") if gguf else None
    if source is None:  # said before it is read or fetched: the artifact, maybe a stranger's, named it
        kind = "a local path" if Path(src_name).is_absolute() or Path(src_name).exists() else "a hub id"
        log.info("reading the source model the artifact names, %s (%s%s): pass --source to choose it", src_name,
                    kind, f", revision {prov['revision']}" if prov.get("revision") else "")
    try:
        try:
            src = open_source(src_name, revision=prov.get("revision"), workdir=workdir,
                              max_bytes=None if source is not None else source_bound(art))
        except PactError as e:  # gone, emptied, no safetensors left, ...
            raise SourceError(f"--source {e}" if source is not None else
                              f"the artifact's recorded source: {e} (pass --source with the original model)") from None
        # a GGUF source is checked by its file hash above (its dequantized folder is made anew)
        if source is None and not gguf and src.fingerprint() != prov.get("source_fingerprint"):
            raise SourceError(f"{src_name}: not the model this artifact was converted from (fingerprint differs): "
                            "pass --source with the original model")
        # the weights' own bytes (artifacts converted since it is recorded), with --source too: GPTQ on
        # another model's weights would silently write a mix of two models
        if not gguf and "source_sha256" in prov and src.content_sha256() != prov["source_sha256"]:
            raise SourceError(f"{src_name}: not the weights this artifact was converted from (sha256 of the "
                            f"safetensors differs): pass {'--source with ' if source is None else ''}"
                            "the original model")
        clock.device = torch.device(ses.device)
        clock.lap("read")
        texts = (max_samples, seq_len, seed) if model_texts else None
        # how the texts were taken (with the prompts' sha256: enough to take them again)
        taken = {"max_samples": max_samples, "seq_len": seq_len, **({"min_tokens": min_tokens} if min_tokens else {})}
        return _calibrate(ses, src, samples, out, clock, prompts=None if model_texts else Path(prompts), texts=texts,
                          damp=damp, actorder=actorder, static_scales=static_scales, blocksize=blocksize,
                          scale_rule=rule, backward_layout=backward_layout, correct_rank=correct_rank,
                          overwrite=overwrite, progress=progress,
                          label=prompts_label, record={**taken, **(record or {})})
    except OSError as e:  # the writer has removed its temp folder; OUT is untouched
        raise write_error(e, getattr(e, "filename", None) or out, f"nothing was written to {out}") from None
    finally:
        remove_tree(workdir)


def _calibrate(ses: Session, src, samples, out: Path, clock: _Clock, *, prompts: Path | None, texts, damp, actorder,
               static_scales, blocksize, scale_rule, backward_layout, correct_rank, overwrite, progress, label,
               record) -> Path:
    art, dev = ses.artifact, ses.device
    scaling = art.meta["provenance"]["scaling"]
    model = ses.model(None, backward=False)  # forward only: the backward layouts are read from disk when written
    if texts is not None:  # --model-texts: the round-to-nearest model writes its own calibration texts
        samples = _model_texts(model, ses.tokenizer, *texts)
        clock.lap("model texts")
    units = _units(model, art, samples)
    new: dict[str, tuple] = {}
    errors: dict[str, dict[str, torch.Tensor]] = {}
    for li, L in enumerate(tqdm(model.layers, desc="calibrate", unit="layer", disable=not progress)):
        groups = {name: getattr(L, name) for name in GROUPS}
        hess = {id(g.weight): GPTQ(g.weight.shape[1], dev) for g in groups.values() if g.weight is not None}
        unit = {k: torch.zeros(h.columns, h.columns, device=dev) for k, h in hess.items()} if correct_rank else {}
        with torch.no_grad():
            for u in units:
                def add(w, x, u=u):  # the GEMM's input rows (as the recipe feeds it), padding rows left out
                    if id(w) in hess:
                        rows = x if u.real is None else x[u.real]
                        hess[id(w)].add_batch(rows)
                        if unit:  # every token's input scaled to norm 1: each token weighs the same
                            r = rows.float()
                            r = r / r.norm(dim=1, keepdim=True).clamp(min=1e-30)
                            unit[id(w)].addmm_(r.t(), r)

                with model.observing(add):
                    model.layer(L, u.x, u.cos, u.sin, u.B, u.S)
        clock.lap("activations")
        if li == 0:
            _warn_few_tokens(hess.values())
        for gname, g in groups.items():
            if g.weight is None:  # a member kept in bf16: the group runs dense, nothing to calibrate
                log.info("layer %d %s: kept in bf16, not calibrated", li, gname)
                continue
            H = hess[id(g.weight)]
            Ws = [src.load(name).float().to(dev) for name in g.names]
            clock.lap("read")
            # the members share H and the global scale, and GPTQ's rows are independent: one sweep
            # over their stacked rows gives each member's codes (row counts are multiples of 16)
            q = NVFP4Quantizer(g.weight.global_scale, scaling=scaling, static=static_scales, scale_rule=scale_rule)
            Q, _ = H.quantize(torch.cat(Ws), q, blocksize=blocksize, percdamp=damp, actorder=actorder)
            fwd_all = q.pack(Q)
            r0, corr = 0, []
            factor = _input_factor(unit[id(g.weight)], damp) if correct_rank else None
            for name, W in zip(g.names, Ws):
                r1 = r0 + W.shape[0]
                Qn = Q[r0:r1]
                fwd = NVFP4Tensor(fwd_all.packed[r0:r1], fwd_all.scales[r0:r1], fwd_all.global_scale)
                if backward_layout == "source":  # the converter's W^T, from the source (its rule and global scale)
                    bwd = quantize_weight(W, global_scale=fwd.global_scale, scaling=scaling,
                                          scale_rule=art.block_scale_rule)[1]
                else:
                    bwd = (transpose_2d(fwd) if scaling == "2d" else
                           quantize(Qn.t().contiguous(), global_scale=fwd.global_scale, scale_rule=scale_rule))
                rtn = dequantize(art.nvfp4(name, "fwd")).to(dev)
                errors[name] = {"rtn": _output_error(W, rtn, H.H), "gptq": _output_error(W, Qn, H.H)}
                c = _correction(W - Qn, factor, correct_rank) if correct_rank else None
                if c is not None:
                    errors[name]["corrected"] = _output_error(W, Qn + c[0] @ c[1], H.H)
                    c = (c[0].to(torch.bfloat16), c[1].to(torch.bfloat16))
                corr.append(c)
                new[name] = (fwd, bwd, (W - Qn).norm() / W.norm(), c)  # a tensor: read after the sweep, no sync
                r0 = r1
            # the layer now runs on the calibrated weights (forward only: no backward layout needed here)
            g.weight = type(g.weight)(fwd_all.packed, fwd_all.scales, g.weight.global_scale)
            g.corr = corr if correct_rank else []  # (with its correction, or none: an earlier one fits other codes)
            clock.lap("solve")
        with torch.no_grad():
            for u in units:
                u.x = model.layer(L, u.x, u.cos, u.sin, u.B, u.S)
        clock.lap("activations")
    new = {k: (f, b, float(rel), c) for k, (f, b, rel, c) in new.items()}
    errors = {k: {m: float(v) for m, v in e.items()} for k, e in errors.items()}
    clock.lap("solve")
    return _write(art, out, new, errors, clock, overwrite=overwrite, prompts=prompts, label=label, record=record,
                  samples=samples, damp=damp, actorder=actorder, static_scales=static_scales, blocksize=blocksize,
                  block_scales=scale_rule, backward_layout=backward_layout,
                  **({"correct_rank": correct_rank} if correct_rank else {}),
                  # the source layout keeps the converter's rule, whatever --block-scales says
                  backward_block_scales=art.block_scale_rule if backward_layout == "source" else scale_rule,
                  **({"model_texts": {"seed": texts[2], "temperature": 1.0}} if texts is not None else {}))


_MORE_CALIBRATION_TEXT = ("calibrate on more or longer texts (pact-calibrate: more --prompts texts, --max-samples / "
                          "--seq-len or --min-tokens N; pact-train: more --data records, --calibrate-samples or "
                          "--max-len; 128 x 128 tokens is what BENCHMARKS.md measured)")


def _warn_few_tokens(hessians, what: str = "calibration", fix: str = _MORE_CALIBRATION_TEXT) -> None:
    """GPTQ's Hessian has rank at most the token count: with fewer calibration tokens than a
    projection's input columns the damping decides most of the solve. Said once, not refused
    (a smoke test on a few texts is legitimate)."""
    tokens, widest = min(h.nsamples for h in hessians), max(h.columns for h in hessians)
    if tokens < widest:
        log.warning("%s: %d tokens, fewer than the widest projection's %d input columns: the Hessian is "
                    "rank-deficient and the result stays near round-to-nearest; %s", what, tokens, widest, fix)


def _units(model: PactModel, art, samples) -> list[Unit]:
    """First layer's inputs. Text prompts: token embeddings, longest first, right-padded into
    batches of at most BATCH_TOKENS (padded) tokens. Image prompts, one each: embeddings with
    the vision tower's features in place and M-RoPE positions."""
    dev = model.device
    if isinstance(samples[0], ImageSample):
        tower = VisionTower(art, dev)
        units = []
        for s in samples:
            x, pos = image_inputs(model, tower, s)
            units.append(Unit(x, *model.rope_at(x, pos), 1, x.shape[0]))
        return units
    order = sorted(samples, key=len, reverse=True)
    units, i = [], 0
    while i < len(order):
        S = len(order[i])
        B = max(1, min(len(order) - i, BATCH_TOKENS // S))
        ids = torch.zeros(B, S, dtype=torch.long)
        real = torch.zeros(B, S, dtype=torch.bool)
        for b, t in enumerate(order[i:i + B]):
            ids[b, : len(t)], real[b, : len(t)] = t, True
        x = model.embed_ids(ids.to(dev)).reshape(B * S, -1)
        units.append(Unit(x, *model.rope(x, S), B, S, None if bool(real.all()) else real.reshape(-1).to(dev)))
        i += B
    return units


def _model_texts(model, tokenizer, n: int, length: int, seed: int) -> list[torch.Tensor]:
    """``n`` texts of ``length`` tokens sampled by ``model`` from the tokenizer's BOS token (its
    end-of-text token where it has none): runtime.generate.sample_texts, temperature 1."""
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if start is None:
        raise PactError(f"--model-texts: the tokenizer of {model.artifact.path} has neither a BOS nor an "
                        "end-of-text token to start from: give --prompts")
    window = int(getattr(model.cfg, "max_position_embeddings", 0) or 0)
    if window and length > window:
        raise PactError(f"--seq-len {length}: longer than the model's context ({window} tokens); give --seq-len "
                        f"<= {window}")
    # what the model may write: the tokenizer's own ids (not the embedding's padding rows), no special
    # tokens but end-of-text (an image placeholder would have no image behind it)
    allowed = torch.zeros(model.embed.shape[0], dtype=torch.bool, device=model.device)
    allowed[: min(len(tokenizer), model.embed.shape[0])] = True
    special = [i for i in tokenizer.all_special_ids if i != tokenizer.eos_token_id and i < allowed.numel()]
    allowed[special] = False
    log.info("--model-texts: sampling %d texts of %d tokens", n, length)
    return sample_texts(model, int(start), n, length, seed=seed, allowed=allowed)


def _folder_digest(samples) -> str:
    """sha256 over the names and bytes of the images used (and the .txt requests beside them)."""
    h = hashlib.sha256()
    for s in samples:
        for f in (Path(s.source), Path(s.source).with_suffix(".txt")):
            if f.is_file():
                h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _write(art, out: Path, new: dict, errors: dict, clock: _Clock, *, overwrite, prompts: Path, label, record,
           samples, **settings) -> Path:
    with ArtifactWriter(out, overwrite=overwrite) as w:
        for name in art.names():
            e, info = art.entry(name), art.entry_info(name)
            if name in new:
                fwd, bwd, rel, corr = new[name]
                w.add_nvfp4(name, fwd, bwd, corr, **{**info, "error": rel, "calibrated": "gptq",
                                                     "output_error": errors[name]})
            elif e["kind"] == "nvfp4":
                w.add_nvfp4(name, art.nvfp4(name, "fwd"), art.nvfp4(name, "bwd"), art.correction(name), **info)
            else:
                w.add_dense(name, art.dense(name), **info)
        for rel in art.meta["files"]:
            w.add_file(art.hf_dir / rel, rel)
        if prompts is not None and prompts.is_file():
            digest = sha256_file(prompts)
        elif samples and hasattr(samples[0], "source"):  # a folder of images
            digest = _folder_digest(samples)
        else:  # --model-texts, a datasets folder or a hub dataset: the token ids themselves
            digest = hashlib.sha256(torch.cat(samples).to(torch.int64).numpy().tobytes()).hexdigest()
        clock.lap("write")  # what commit does after this (the manifest, a rename) is left out of the record
        seconds = clock.report()
        log.info("calibration: %s s", ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()))
        meta = {k: art.meta[k] for k in ("architecture", "family", "vision", "hf_config")}
        meta["provenance"] = {
            **art.meta["provenance"],
            "calibration": {
                "method": "gptq",
                "from_artifact": str(art.path.resolve()),
                "from_artifact_fingerprint": art.fingerprint(),
                "prompts": label or (str(prompts) if prompts is not None else "model texts"),
                "prompts_sha256": digest,
                "modality": "images" if isinstance(samples[0], ImageSample) else "text",
                "samples": len(samples),
                "tokens": int(sum(s.numel() for s in samples)),
                "seq_len_max": int(max(s.numel() for s in samples)),
                **settings,
                "layer_output_error": errors,
                "seconds": seconds,
                "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "pact_version": __version__,
                **record,
            },
        }
        return w.commit(**meta)
