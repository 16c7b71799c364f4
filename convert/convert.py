"""HF / GGUF weights -> a pact NVFP4 artifact, streaming one fused group at a time."""

from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import os
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from tqdm.auto import tqdm

from pact import __version__
from pact.formats import ArtifactWriter, PactError, check_output, classify, family_of
from pact.formats.artifact import check_config_shapes
from pact.formats.errors import write_error
from pact.formats.families import VISION_FAMILIES
from pact.formats.files import work_path
from pact.formats.nvfp4 import (
    BLOCK,
    SCALE_RULES,
    SCALINGS,
    NVFP4Tensor,
    dequantize,
    global_scale_from_amax,
    quantize,
    quantize_weight,
)

from . import cpu_kernel
from .sources import Source, open_source, remove_tree

log = logging.getLogger(__name__)


def relative_error(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """||W - W_hat||_F / ||W||_F (0 for an all-zero W); the sums in float64, so a GPU's order of summation
    and the CPU's give the same figure."""
    w = w.float()
    den = float(torch.linalg.vector_norm(w, dtype=torch.float64))
    return float(torch.linalg.vector_norm(w - w_hat, dtype=torch.float64)) / den if den > 0 else 0.0


def _plan(source: Source, scaling: str) -> list[list[str]]:
    """Units of work in file order: a fused group of frozen projections, or one tensor.

    Checks every frozen projection's shape from the headers before anything is written.
    """
    groups: dict[str, list[str]] = defaultdict(list)
    units: list[list[str]] = []
    for name in source.names():
        role = classify(name)
        if not role.frozen_projection:
            units.append([name])
            continue
        shape = source.shape(name)
        if len(shape) != 2 or shape[0] % BLOCK or shape[1] % BLOCK:
            raise PactError(
                f"{source.file_of(name)}: {name} has shape {shape}; NVFP4 ({scaling}) needs both "
                f"dimensions divisible by {BLOCK}: this model cannot be converted"
            )
        if role.group not in groups:
            units.append(groups[role.group])  # the group's list, filled as names arrive
        groups[role.group].append(name)
    return units


def resolve_device(device: str | torch.device) -> torch.device:
    """``auto``: the GPU when torch sees one (quantization math only; reads and writes stay on the host)."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise PactError(f"--device must be auto, cpu or cuda[:N], got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise PactError(f"--device {device}: torch sees no CUDA GPU here: use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise PactError(f"--device must be auto, cpu or cuda[:N], got {device!r}")
    return dev


def quantize_member(w: torch.Tensor, g: torch.Tensor, *, scaling: str, scale_rule: str,
                    device: torch.device) -> tuple[NVFP4Tensor, NVFP4Tensor, float]:
    """One frozen projection -> (forward, backward, relative error of the forward layout), on the host.
    The CPU runs the C kernel (1d; ``cpu_kernel``), else ``quantize_weight`` runs on ``device``: the same
    codes and scales either way (tests/test_convert.py checks it)."""
    if device.type == "cpu" and scaling == "1d":
        done = cpu_kernel.quantize_weight_cpu(w, g, scale_rule)
        if done is not None:
            return done
    wd = w.to(device, non_blocking=True)
    fwd, bwd = quantize_weight(wd, global_scale=g.to(device), scaling=scaling, scale_rule=scale_rule)
    err = relative_error(wd, dequantize(fwd))
    host = [NVFP4Tensor(t.packed.cpu(), t.scales.cpu(), t.global_scale.cpu()) for t in (fwd, bwd)]
    return host[0], host[1], err


def _load_checked(source: Source, name: str) -> tuple[torch.Tensor, float]:
    """The tensor and its largest magnitude (the global scale's amax), refused if not float or not finite.
    One aminmax pass in pieces finds both: min and max are finite exactly when every value is (NaN and
    Inf propagate), ~9x cheaper than counting isfinite; the count runs only to word the error."""
    t = source.load(name)
    if not t.is_floating_point():
        raise PactError(f"{source.file_of(name)}: {name} has dtype {t.dtype}; pact stores float tensors only")
    flat = t.reshape(-1)
    step = 1 << 22  # in pieces: a whole-tensor temporary would be the converter's peak
    amax, finite = 0.0, True
    for i in range(0, flat.numel(), step):
        lo, hi = (float(v) for v in torch.aminmax(flat[i : i + step]))
        finite = finite and math.isfinite(lo) and math.isfinite(hi)  # (max() would pass a NaN over)
        amax = max(amax, -lo, hi)
    if not finite:
        bad = sum(int((~torch.isfinite(flat[i : i + step])).sum()) for i in range(0, flat.numel(), step))
        raise PactError(
            f"{source.file_of(name)}: {name} has {bad} NaN/Inf values: the checkpoint is damaged; "
            "re-download or re-export it"
        )
    return t, amax


def convert(
    src: str,
    out: str | os.PathLike,
    *,
    scaling: str = "1d",
    block_scales: str = "mse",
    keep_bf16: float = 0.0,
    overwrite: bool = False,
    revision: str | None = None,
    progress: bool = True,
    device: str | torch.device = "auto",
    require_tokenizer: bool = False,
) -> Path:
    """Convert ``src`` (HF folder, .gguf file or hub id) into an artifact at ``out``.

    Frozen projections become NVFP4 (forward + backward layouts; q/k/v and gate/up share a
    global scale); everything else is stored bf16. ``block_scales`` picks each block's e4m3
    scale (``amax``: the largest magnitude maps to 6; ``mse``: the least-error scale near it).
    ``keep_bf16`` keeps that fraction of the frozen projections, those with the largest relative
    NVFP4 error, in bf16. ``device`` runs the
    quantization math (``auto``: cuda when available); the artifact is the same on any device.
    ``require_tokenizer`` (pact-convert): a source without tokenizer files is refused before any work,
    since every pact tool that reads text needs the artifact's (benchmarks convert bare weights).
    """
    if scaling not in SCALINGS:
        raise PactError(f"--scaling must be one of {', '.join(SCALINGS)}, got {scaling!r}")
    if block_scales not in SCALE_RULES:
        raise PactError(f"--block-scales must be one of {', '.join(SCALE_RULES)}, got {block_scales!r}")
    if not 0.0 <= keep_bf16 < 1.0:
        raise PactError(f"--keep-bf16 is a fraction in [0, 1), got {keep_bf16}")
    dev = resolve_device(device)
    out = check_output(out, overwrite)
    workdir = work_path(out, "gguf") if str(src).endswith(".gguf") else None
    try:
        source = open_source(str(src), revision=revision, workdir=workdir)
        if require_tokenizer:
            _check_tokenizer(source, src)
        return _convert(source, out, scaling=scaling, block_scales=block_scales, keep_bf16=keep_bf16,
                        overwrite=overwrite, progress=progress, device=dev)
    except OSError as e:  # the writer has removed its temp folder; OUT is untouched
        raise write_error(e, getattr(e, "filename", None) or out, f"nothing was written to {out}") from None
    finally:
        remove_tree(workdir)


def _check_tokenizer(source, src) -> None:
    """The source ships a tokenizer (tokenizer.json, a sentencepiece tokenizer.model, or vocab.json +
    merges.txt): an artifact without one cannot be fixed later (its files are checksummed)."""
    names = {f.name for f in source.side_files()}
    if not ({"tokenizer.json", "tokenizer.model"} & names or {"vocab.json", "merges.txt"} <= names):
        raise PactError(f"{src}: no tokenizer (tokenizer.json, tokenizer.model, or vocab.json + merges.txt): "
                        "pact-train, pact-eval and pact-calibrate read the artifact's; copy the model's tokenizer "
                        "files into the folder and convert again")


def _check_names(config: dict, source: str) -> None:
    """``architectures`` a list of names and ``model_type`` a name (family_of looks them up)."""
    archs, model_type = config.get("architectures"), config.get("model_type")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise PactError(f"{source}: 'architectures' is {archs!r}, not a list of class names: restore the model's "
                        "own config.json")
    if model_type is not None and not isinstance(model_type, str):
        raise PactError(f"{source}: 'model_type' is {model_type!r}, not a name: restore the model's own config.json")


def _convert(source: Source, out: Path, *, scaling: str, block_scales: str, keep_bf16: float, overwrite: bool,
             progress: bool, device: torch.device = torch.device("cpu")) -> Path:
    cfg_file = str(source.folder / "config.json")
    _check_names(source.config, cfg_file)
    family = family_of(source.config, cfg_file)
    # sizes valid and fitting every tensor's header shape (an imported NVFP4 weight: its [N, K]), before any work
    check_config_shapes(source.config, {name: source.shape(name) for name in source.names()}, cfg_file)
    if source.packed and scaling != "1d":
        raise PactError(f"{source.folder}: an NVFP4 checkpoint keeps its own 1x16 blocks (imported as they are): "
                        "drop --scaling 2d")
    units = _plan(source, scaling)
    errors: dict[str, float] = {}
    stored_bf16: list[str] = []  # projections an NVFP4 checkpoint holds unquantized
    # the source's bytes are hashed by a thread while the main one quantizes (hashlib releases the GIL)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="pact-source-hash") as pool, \
            ArtifactWriter(out, overwrite=overwrite) as writer:
        source_sha256 = pool.submit(source.content_sha256)
        for unit in tqdm(units, desc=f"convert -> {out.name}", unit="group", disable=not progress):
            loaded = {name: _load_checked(source, name) for name in unit}
            tensors = {name: t for name, (t, _) in loaded.items()}
            first = classify(unit[0])
            if not first.frozen_projection:
                name, t = unit[0], tensors[unit[0]]
                writer.add_dense(name, t.to(torch.bfloat16), role=first.role, layer=first.layer,
                                 source_dtype=str(t.dtype))
                continue
            imported = {name: source.nvfp4(name) for name in unit}
            if source.packed and all(t is None for t in imported.values()):
                # an NVFP4 checkpoint left this group unquantized (its ignore list): kept as stored, in bf16
                for name, w in tensors.items():
                    role = classify(name)
                    writer.add_dense(name, w.to(torch.bfloat16), role=role.role, layer=role.layer, group=role.group,
                                     kept_bf16=True, imported="unquantized", source_dtype=str(w.dtype))
                    stored_bf16.append(name)
                del tensors, loaded
                continue
            one_scale = len({float(t.global_scale) for t in imported.values() if t is not None}) == 1
            if all(t is not None for t in imported.values()) and one_scale:
                _add_imported(writer, imported, tensors, block_scales, errors, source.producer)
                del tensors, loaded
                continue
            if any(t is not None for t in imported.values()):
                log.warning("%s: NVFP4 members without one shared global scale: re-quantized from their values "
                            "to one (pact's fused GEMM needs it)", classify(unit[0]).group)
            # fused group: one global scale from the amax over all members
            g = global_scale_from_amax(max(amax for _, amax in loaded.values()))
            for name, w in tensors.items():
                role = classify(name)
                fwd, bwd, errors[name] = quantize_member(w, g, scaling=scaling, scale_rule=block_scales, device=device)
                writer.add_nvfp4(
                    name, fwd, bwd, role=role.role, layer=role.layer, group=role.group,
                    scaling=scaling, error=errors[name], source_dtype=str(w.dtype),
                    **({"imported": "requantized"} if imported[name] is not None else {}),
                )
            del tensors, loaded
        protected = _protect(source, writer, errors, keep_bf16)
        # an imported checkpoint's quantization_config describes its files, not the artifact's: dropped
        # from the config (transformers would otherwise try to quantize what reads it), kept in provenance
        config = {k: v for k, v in source.config.items() if k != "quantization_config"}
        for f in source.side_files():
            if f.name == "config.json" and source.quantization:
                writer.add_bytes("config.json", (json.dumps(config, indent=2) + "\n").encode())
            else:
                writer.add_file(f)
        meta = dict(
            architecture=(source.config.get("architectures") or [None])[0],
            family=family,
            vision=family in VISION_FAMILIES,
            hf_config=config,
            provenance={
                **source.provenance,
                **({"source_quantization": source.quantization} if source.quantization else {}),
                "source_fingerprint": source.fingerprint(),
                "source_sha256": source_sha256.result(),  # the weights' bytes: calibration checks its source by it
                "scaling": scaling,
                "block_scales": block_scales,
                "keep_bf16": keep_bf16,
                "kept_bf16": stored_bf16 + protected,
                "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "pact_version": __version__,
                "torch_version": torch.__version__,
            },
        )
        return writer.commit(**meta)


def _add_imported(writer: ArtifactWriter, imported: dict, values: dict, block_scales: str, errors: dict,
                  producer: str) -> None:
    """A group stored NVFP4 in the source with one global scale: its codes and scales are the forward
    layout as they are (no second rounding); the backward layout W^T is quantized from the same
    dequantized values with that global scale. ``error`` is 0: relative to the source's own weights."""
    for name, fwd in imported.items():
        role = classify(name)
        bwd = quantize(values[name].t().contiguous(), global_scale=fwd.global_scale, scaling="1d",
                       scale_rule=block_scales)
        errors[name] = 0.0
        writer.add_nvfp4(name, fwd, bwd, role=role.role, layer=role.layer, group=role.group, scaling="1d",
                         error=0.0, source_dtype="nvfp4", imported=producer)


def _protect(source: Source, writer: ArtifactWriter, errors: dict[str, float], fraction: float) -> list[str]:
    """AQLoRA-style protected layers: rewrite the worst ``fraction`` of projections in bf16."""
    k = math.floor(fraction * len(errors) + 0.5)
    if k == 0:
        return []
    worst = sorted(errors, key=errors.get, reverse=True)[:k]
    for name in worst:
        entry = writer.tensors[name]
        writer.remove(name)
        w = source.load(name)
        writer.add_dense(
            name, w.to(torch.bfloat16), role=entry["role"], layer=entry["layer"], group=entry["group"],
            kept_bf16=True, nvfp4_error=entry["error"], global_scale=entry["global_scale"], source_dtype=str(w.dtype),
        )
    log.info("kept %d of %d projections in bf16 (largest NVFP4 error)", k, len(errors))
    return worst
