"""Artifacts (and trained adapters) out to what inference engines and transformers load.

- ``compressed-tensors``: a Hugging Face checkpoint in compressed-tensors' ``nvfp4-pack-quantized``
  format (weight-only NVFP4, what vLLM and SGLang load): per frozen projection ``weight_packed``
  (the forward layout's codes, same packing), ``weight_scale`` (its E4M3 block scales; a 2d
  artifact's 16x16 scales are stored per row already, so they are 1x16 scales as they are) and
  ``weight_global_scale`` = 1 / g (compressed-tensors' encode direction). Dense tensors as bf16.
  With an adapter: beside it in PEFT format (``adapter/``), or ``merge``d into the weights and
  re-quantized (the added error per projection is returned).
- ``bf16``: a plain checkpoint of the dequantized weights (adapter merged) for transformers.

What an export holds: the weights it computed, a config.json without code-loading keys (an artifact
whose config asks for custom code is refused), the artifact's side files on an allow-list (config,
tokenizer, chat template, processor: never weights or pickles) and ``pact_export.json``, the marker
naming every file written. Every tensor is checked finite before it is written.

Written into a temp folder beside OUT; with --overwrite only a folder carrying a valid marker (an
earlier export, nothing added to it) is replaced, by rename, never by deleting first: the old export
is renamed aside, the new one renamed in, the old one removed last. OUT may not be, hold or sit
inside the artifact or the adapter run.
"""

from __future__ import annotations

import datetime as _dt
import errno
import json
import logging
import math
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError

from pact.formats import PactError, check_apart, default_cache, open_artifact
from pact.formats.artifact import check_outside_artifacts, check_writable
from pact.formats.errors import write_error
from pact.formats.families import classify
from pact.formats.files import atomic_folder, recover_aside, save_safetensors
from pact.formats.interop import ct_quantization_config, ct_tensors
from pact.formats.layout import SIDE_FILES
from pact.formats.nvfp4 import SCALE_RULES, NVFP4Tensor, dequantize, global_scale_from_amax, quantize
from pact.formats.peft import load_peft_adapter, peft_key, save_peft_adapter

SHARD_BYTES = 2 << 30
MARKER = "pact_export.json"  # written last into every export: what --overwrite may replace
# config keys that make transformers / vLLM import code (with trust_remote_code): refused, never shipped
CODE_KEYS = ("auto_map", "custom_pipelines")

log = logging.getLogger(__name__)

def export(artifact: str, out: str | os.PathLike, *, fmt: str = "compressed-tensors", adapter: str | None = None,
           merge: bool = False, overwrite: bool = False, progress: bool = False,
           merge_solver=None, merge_keep_bf16: float = 0.0) -> dict:
    """Export ``artifact`` (with a PEFT ``adapter``) to ``out`` in ``fmt``; returns a summary (for
    a merged NVFP4 export: each projection's added relative error from re-quantizing).
    ``merge_solver(artifact_path, adapter) -> (tensors, summary)``: makes the merged NVFP4 tensors
    of the adapted projections (calibrate.merge's error-compensating one, which runtime cannot
    import), called once every input is checked; without it a merge rounds to nearest.
    ``merge_keep_bf16``: that share of the adapted projections, whole fused groups with the largest
    layer-output error of the solver's merge first, written in bf16 with the adapter folded in exactly
    (compressed-tensors' ignore list) instead of re-quantized."""
    if fmt not in FORMATS:
        raise PactError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if merge and not adapter:
        raise PactError("--merge folds an adapter into the weights: give --adapter RUN")
    if not 0 <= merge_keep_bf16 < 1:
        raise PactError(f"--merge-keep-bf16 must be in [0, 1) (a share of the adapted projections), "
                        f"got {merge_keep_bf16}")
    if merge_keep_bf16 and not (merge and fmt == "compressed-tensors" and merge_solver):
        raise PactError("--merge-keep-bf16 ranks the projections by the GPTQ merge's error: it needs --merge with "
                        "--merge-method gptq and --format compressed-tensors")
    out = Path(out)
    if out.name in ("", ".", ".."):  # "." or "..": the folder by its name (temp folders go beside it)
        out = out.resolve()
    remote = isinstance(artifact, str) and "://" in artifact
    sources = {} if remote else {"artifact": Path(artifact)}
    if adapter:
        sources["--adapter run"] = Path(adapter)
    _check_out(out, overwrite, sources)  # before long work (verifying the artifact)
    art = open_artifact(artifact)
    sources["artifact"] = art.path  # a URL's cached copy
    check_apart(out, sources, "an export")
    art.verify_cached(default_cache())
    _check_config(art)
    if art.corrected and fmt != "bf16":
        raise PactError(f"{art.path}: its projections carry low-rank corrections (pact-calibrate --correct-rank), "
                        f"which an NVFP4 checkpoint cannot hold: export --format bf16 (the corrections folded in "
                        "exactly), or export an artifact calibrated without --correct-rank")
    lora_cfg, adapters = load_peft_adapter(adapter) if adapter else (None, {})
    _check_adapter(adapter, adapters, art)
    merged = merge or fmt == "bf16"  # bf16 folders take the adapter folded in
    requantized = merge and bool(adapters) and fmt != "bf16"
    merged_weights, how = (merge_solver(art.path, adapter) if requantized and merge_solver
                           else (None, {"method": "rtn"} if requantized else None))
    keep = _worst_groups(art, how.get("output_error") or {}, merge_keep_bf16) if merge_keep_bf16 and how else set()
    if keep:
        how["kept_bf16"] = sorted(keep)
    existed = out.exists()
    try:
        # filled beside out, then renamed in: the earlier export renamed aside, removed last (_recover
        # undoes a kill between the renames); an error removes the temp folder
        with atomic_folder(out) as tmp:
            summary = _write(art, tmp, fmt, lora_cfg, adapters, merged, progress, merged_weights, keep)
            if adapters and not merged:  # served beside the quantized base (vLLM LoRA)
                save_peft_adapter(tmp / "adapter", adapters, lora_cfg, str(out.resolve()))
            _write_marker(tmp, art, fmt, adapter, summary["adapter"])
            _check_out(out, overwrite, sources)  # again: something may have appeared at out meanwhile
    except OSError as e:
        kept = f"the earlier export in {out} is kept" if existed and out.exists() else f"nothing was written to {out}"
        raise write_error(e, getattr(e, "filename", None) or out, kept) from None
    return {"out": str(out), "format": fmt, **summary, **({"merge": how} if how else {})}


# --------------------------------------------------------------------------------------
# where an export may go


def _nvfp4_groups(art) -> dict[str, list[str]]:
    """The artifact's NVFP4 projections by fused group (q|k|v, gate|up; a lone projection by its name)."""
    groups: dict[str, list[str]] = {}
    for name in art.names("nvfp4"):
        groups.setdefault(art.entry(name).get("group") or name, []).append(name)
    return groups


def _worst_groups(art, errors: dict[str, dict[str, float]], share: float) -> set[str]:
    """The members of the fused groups (q|k|v, gate|up, or one projection) with the largest merge
    error (the worst member's ``gptq`` layer-output error), taken until they hold ``share`` of the
    adapted projections (rounded up)."""
    scored = sorted(((max(errors[m]["gptq"] for m in ms if m in errors), ms) for ms in _nvfp4_groups(art).values()
                     if any(m in errors for m in ms)), key=lambda t: -t[0])
    want, keep = math.ceil(share * len(errors)), set()
    for _, ms in scored:
        if sum(m in errors for m in keep) >= want:
            break
        keep.update(ms)
    return keep


def _check_out(out: Path, overwrite: bool, sources: dict[str, Path]) -> None:
    """A new folder, or with ``overwrite`` an earlier export (a folder carrying a valid marker that
    lists every file in it): never any other folder (a model, a home directory), which replacing
    would delete. Puts back what an interrupted run left aside first."""
    if out.is_symlink():
        raise PactError(f"--out {out} is a symbolic link: give the folder it points to (an export is put in "
                        "place by renaming folders)")
    check_apart(out, sources, "an export")
    check_outside_artifacts(out, "--out")
    check_writable(out, "--out")
    recover_aside(out, "the export", lambda p: read_marker(p) is not None)
    if not out.exists():
        return
    if not overwrite:
        raise PactError(f"--out {out} exists: choose a new folder or pass --overwrite")
    doc = read_marker(out)
    if doc is None:
        raise PactError(f"--out {out} is not a checkpoint folder pact-export wrote (no valid {MARKER}): refusing "
                        "to replace it, which would delete what is in it; choose another --out (an export from a "
                        f"pact before {MARKER} existed: delete it yourself)")
    extra = _unlisted(out, doc)
    if extra:
        raise PactError(f"--out {out} holds {extra}, which pact-export did not write: refusing to replace the "
                        "folder, which would delete it; move it out or choose another --out")


def read_marker(folder: Path) -> dict | None:
    """The marker of an export pact-export wrote into ``folder``, or None."""
    f = folder / MARKER
    if not folder.is_dir() or f.is_symlink() or not f.is_file() or f.stat().st_size > 64 << 20:
        return None
    try:
        doc = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    ok = isinstance(doc, dict) and doc.get("written_by") == "pact-export" and isinstance(doc.get("files"), list)
    return doc if ok else None


def _files(folder: Path) -> list[str]:
    """Every file (and link) under ``folder``, relative, '/'-separated, sorted."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        d = Path(dirpath)
        out += [(d / n).relative_to(folder).as_posix() for n in filenames]
        out += [(d / n).relative_to(folder).as_posix() for n in dirnames if (d / n).is_symlink()]
    return sorted(out)


def _unlisted(folder: Path, doc: dict) -> str | None:
    """The first file in ``folder`` its marker does not list (added after the export), or None."""
    listed = set(doc["files"]) | {MARKER}
    return next((rel for rel in _files(folder) if rel not in listed), None)


def _write_marker(tmp: Path, art, fmt: str, adapter: str | None, how: str | None) -> None:
    """The marker, written last: its presence says the export is complete; it lists every file."""
    doc = {
        "written_by": "pact-export",
        "format": fmt,
        "artifact": art.url or str(art.path.resolve()),
        "artifact_fingerprint": art.fingerprint(),
        "adapter": str(Path(adapter).resolve()) if adapter else None,
        "adapter_placement": how,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "files": _files(tmp),
    }
    (tmp / MARKER).write_text(json.dumps(doc, indent=2) + "\n")


# --------------------------------------------------------------------------------------
# what an export may carry


def _check_config(art) -> None:
    """The artifact's config asks for no code: transformers / vLLM would import what ``auto_map``
    names (from a hub repo, too) under trust_remote_code. Refused, not dropped: a model pact
    converts needs no custom code, so an artifact that asks for it was edited."""
    cfg = art.meta["hf_config"]
    for part in [cfg] + [v for v in cfg.values() if isinstance(v, dict)]:  # text_config, vision_config
        key = next((k for k in CODE_KEYS if k in part), None)
        if key:
            raise PactError(f"{art.path}/zarr.json: the manifest's hf_config asks for custom code ({key}): refusing "
                            "to export it (pact never ships code-loading keys); re-run pact-convert on a trusted model")


def _side_files(art) -> list[str]:
    """The artifact's hf/ files an export carries: the allow-list (config, tokenizer, chat template,
    processor files), never weights, pickles or anything else an artifact lists."""
    keep = [rel for rel in art.meta["files"] if rel in SIDE_FILES and rel != "config.json"]
    for rel in sorted(set(art.meta["files"]) - set(keep) - {"config.json"}):
        log.warning("%s: not a config, tokenizer or processor file: not copied into the export", art.hf_dir / rel)
    for rel in keep:
        if rel.endswith(".json"):
            try:
                doc = json.loads((art.hf_dir / rel).read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, ValueError, RecursionError):
                continue  # tokenizer.json and friends are read by their own loaders; verify() checked the bytes
            key = next((k for k in CODE_KEYS if isinstance(doc, dict) and k in doc), None)
            if key:
                raise PactError(f"{art.hf_dir / rel}: asks for custom code ({key}): refusing to export it (pact "
                                "never ships code-loading keys); re-run pact-convert on a trusted model")
    return keep


def _check_adapter(adapter: str | None, adapters: dict, art) -> None:
    """Every adapted weight is one the artifact holds, of its shape, and every A/B value is finite."""
    other = "an adapter trained on another model: export it with the artifact it was trained on"
    for name, (A, B) in adapters.items():
        if name not in art.meta["tensors"]:
            raise PactError(f"--adapter {adapter}: adapts {name}, which {art.path} does not have ({other})")
        want, got = list(art.entry(name)["shape"]), [B.shape[0], A.shape[1]]
        if got != want:
            raise PactError(f"--adapter {adapter}: {name} is adapted as {got} (lora_A {list(A.shape)}, lora_B "
                            f"{list(B.shape)}) but {art.path} holds it as {want} ({other})")
        for which, t in (("A", A), ("B", B)):
            if not _finite(t):
                raise PactError(f"--adapter {adapter}: {peft_key(name, which)} holds non-finite values (NaN or inf): "
                                "the run diverged; retrain (a lower --lr) or export a checkpoint from before it")


# --------------------------------------------------------------------------------------
# the checkpoint


def _finite(t: torch.Tensor) -> bool:
    """No NaN or inf in ``t`` (checked in slices: no full-size temporary)."""
    flat = t.reshape(-1)
    if t.dtype == torch.float8_e4m3fn:  # e4m3fn has no inf; NaN is S.1111.111
        return not bool(((flat.view(torch.uint8) & 0x7F) == 0x7F).any())
    if not t.is_floating_point():
        return True
    return all(bool(torch.isfinite(part).all()) for part in flat.split(1 << 24))


def _nvfp4(art, name: str) -> NVFP4Tensor:
    """The artifact's forward-layout tensor, refused when its global scale is not a finite number
    > 0 or a block scale is NaN or negative (written out, they load as NaN or sign-flipped weights)."""
    fix = "the artifact is damaged: re-copy it or re-run pact-convert"
    g = art.entry(name)["global_scale"]
    if not (math.isfinite(g) and g > 0):
        raise PactError(f"{art.path}: {name}: global scale {g} is not a finite number > 0: {fix}")
    t = art.nvfp4(name, "fwd")
    bits = t.scales.view(torch.uint8)
    if bool((((bits & 0x7F) == 0x7F) | (bits > 0x80)).any()):
        raise PactError(f"{art.path}: {name}: its block scales (fwd_scales) hold NaN or negative values: {fix}")
    return t


def _effective(art, name: str) -> torch.Tensor:
    """The weight the model computes with (fp32): the checked NVFP4 one, its low-rank correction added."""
    return art.with_correction(name, dequantize(_nvfp4(art, name)))


def merged_weight(w: torch.Tensor, name: str, adapters: dict, scale: float) -> torch.Tensor:
    """W + scale * B A for an adapted ``name`` (W as given otherwise), refused when not finite."""
    if name not in adapters:
        return w
    A, B = adapters[name]
    w = w + scale * (B.float() @ A.float())
    if not _finite(w):  # before re-quantizing, which would turn NaN into zero codes
        raise PactError(f"{name}: merged with the adapter it holds non-finite values (NaN or inf): the adapter's "
                        "values are out of range; retrain (a lower --lr) or export it beside, without --merge")
    return w


class Writer:
    """One export format: what each dense tensor and each group of frozen projections becomes, and
    the config.json it ships. ``_write`` walks the artifact and hands every tensor to the format's
    writer; a new format is a subclass and its entry in WRITERS."""

    name = ""
    folds_adapter = False  # the adapter always merged into the weights (a plain bf16 folder)
    quantized = False  # projections stay NVFP4

    def __init__(self, art, rule: str):
        self.art, self.rule = art, rule

    def dense(self, name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: w}

    def projections(self, members: list[str], merged: dict[str, torch.Tensor] | None,
                    solved: dict[str, NVFP4Tensor] | None, added: dict[str, float]) -> dict[str, torch.Tensor]:
        """The tensors of one group (q|k|v, gate|up, or one projection). ``merged``: W + s * B A per
        member where the adapter is folded in (None: the artifact's weights as they are); ``solved``:
        the merge solver's NVFP4 tensors; ``added`` collects each re-quantized member's added error."""
        raise NotImplementedError

    def config(self, config: dict) -> dict:
        return config


class CompressedTensorsWriter(Writer):
    """compressed-tensors ``nvfp4-pack-quantized`` (formats/interop.py): what vLLM and SGLang load."""

    name, quantized = "compressed-tensors", True

    def __init__(self, art, rule: str):
        super().__init__(art, rule)
        self.ignore = ["lm_head"]

    def dense(self, name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        if classify(name).frozen_projection:
            self.ignore.append(name.removesuffix(".weight"))  # a projection kept bf16 (--keep-bf16)
        return {name: w}

    def projections(self, members, merged, solved, added):
        if merged is None:
            return {k: v for m in members for k, v in ct_tensors(m, _nvfp4(self.art, m)).items()}
        # the group's members re-quantized together: one global scale (vLLM fuses q|k|v, gate|up)
        g = global_scale_from_amax(max(float(w.abs().amax()) for w in merged.values()))
        out = {}
        for m, w in merged.items():
            # (a group the solver left out, one with a member kept bf16 in the artifact: rounded to nearest)
            t = solved[m] if solved and m in solved else quantize(w, global_scale=g, scaling="1d", scale_rule=self.rule)
            added[m] = float((dequantize(t) - w).norm() / w.norm()) if float(w.norm()) > 0 else 0.0
            out.update(ct_tensors(m, t))
        return out

    def config(self, config: dict) -> dict:
        return {**config, "quantization_config": ct_quantization_config(self.ignore)}


class BF16Writer(Writer):
    """A plain transformers folder: every weight dequantized to bf16, the adapter folded in."""

    name, folds_adapter = "bf16", True

    def projections(self, members, merged, solved, added):
        return {m: (merged[m] if merged else _effective(self.art, m)).to(torch.bfloat16) for m in members}


WRITERS: dict[str, type[Writer]] = {w.name: w for w in (CompressedTensorsWriter, BF16Writer)}
FORMATS = tuple(WRITERS)  # --format's choices


def _write(art, tmp: Path, fmt: str, lora_cfg, adapters: dict, merge: bool, progress: bool = False,
           merged_weights: dict[str, NVFP4Tensor] | None = None, keep: set[str] = frozenset()) -> dict:
    from tqdm.auto import tqdm

    side = _side_files(art)
    rule = art.block_scale_rule
    if rule not in SCALE_RULES:
        raise PactError(f"{art.path}/zarr.json: provenance block_scales {rule!r} is not one of "
                        f"{', '.join(SCALE_RULES)}: the artifact is damaged; re-run pact-convert")
    tmp.mkdir(parents=True, exist_ok=True)
    writer = WRITERS[fmt](art, rule)
    scale = lora_cfg.scale if lora_cfg else 0.0
    tensors: dict[str, torch.Tensor] = {}
    added: dict[str, float] = {}
    quantized = []
    groups = _nvfp4_groups(art)
    done = set()
    for name in tqdm(art.names(), desc="export", unit="tensor", disable=not progress):
        if name in done:
            continue
        e = art.entry(name)
        if e["kind"] != "nvfp4":
            w = art.dense(name)
            tensors.update(writer.dense(name, merged_weight(w.float(), name, adapters, scale).to(torch.bfloat16)
                                        if merge else w))
            done.add(name)
            continue
        members = groups[e.get("group") or name]
        merged = None
        if merge and (writer.folds_adapter or any(m in adapters for m in members)):
            merged = {m: merged_weight(_effective(art, m), m, adapters, scale) for m in members}
        done.update(members)
        if merged is not None and keep & set(members):  # the adapter folded in exactly, in bf16
            for m in members:
                tensors.update(writer.dense(m, merged[m].to(torch.bfloat16)))
            continue
        tensors.update(writer.projections(members, merged, merged_weights, added))
        quantized += members
    _save_sharded(tensors, tmp, art)
    (tmp / "config.json").write_text(json.dumps(writer.config(dict(art.meta["hf_config"])), indent=2) + "\n")
    for rel in side:
        shutil.copyfile(art.hf_dir / rel, tmp / rel)
    out = {"quantized_projections": len(quantized) if writer.quantized else 0,
           "adapter": "merged" if merge and adapters else "beside" if adapters else None}
    if added:
        vals = sorted(added.values())
        out["requantization_error"] = {"median": vals[len(vals) // 2], "max": vals[-1], "per_projection": added}
    return out


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    try:
        save_safetensors(tensors, path, metadata={"format": "pt"})
    except SafetensorError as e:  # its I/O errors (a full disk: "os error 28") are not OSErrors
        m = re.search(r"os error (\d+)", str(e))
        code = int(m.group(1)) if m else errno.EIO
        raise OSError(code, os.strerror(code), str(path)) from None


def _save_sharded(tensors: dict[str, torch.Tensor], folder: Path, art) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors + index past SHARD_BYTES. Every
    tensor is checked finite first (the last guard: a value out of range anywhere upstream)."""
    for k, t in tensors.items():
        if not _finite(t):
            raise PactError(f"{k}: non-finite values (NaN or inf) in the export of {art.path}: refusing to write "
                            "it; re-run pact-convert on a healthy model (or retrain the adapter merged into it)")
    shards, cur, size = [], {}, 0
    for k, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > SHARD_BYTES:
            shards.append(cur)
            cur, size = {}, 0
        cur[k], size = t.contiguous(), size + nbytes
    shards.append(cur)
    if len(shards) == 1:
        _save(shards[0], folder / "model.safetensors")
        return
    weight_map = {}
    for i, sh in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _save(sh, folder / fname)
        weight_map.update({k: fname for k in sh})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
