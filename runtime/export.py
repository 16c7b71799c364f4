"""Artifacts (and trained adapters) out to what inference engines and transformers load.

- ``compressed-tensors``: a Hugging Face checkpoint in compressed-tensors' ``nvfp4-pack-quantized``
  format (weight-only NVFP4, what vLLM and SGLang load): per frozen projection ``weight_packed``
  (the forward layout's codes, same packing), ``weight_scale`` (its E4M3 block scales; a 2d
  artifact's 16x16 scales are stored per row already, so they are 1x16 scales as they are) and
  ``weight_global_scale`` = 1 / g (compressed-tensors' encode direction). Dense tensors as bf16.
  With an adapter: beside it in PEFT format (``adapter/``), or ``merge``d into the weights and
  re-quantized (the added error per projection is returned).
- ``bf16``: a plain checkpoint of the dequantized weights (adapter merged) for transformers.

Every file is written into a temp folder beside OUT and renamed when complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from pact.formats import PactError, default_cache, open_artifact
from pact.formats.artifact import sweep_leftovers, work_path
from pact.formats.errors import write_error
from pact.formats.families import classify
from pact.formats.nvfp4 import NVFP4Tensor, dequantize, global_scale_from_amax, quantize

from .lora import load_peft_adapter, save_peft_adapter

FORMATS = ("compressed-tensors", "bf16")
SHARD_BYTES = 2 << 30

# compressed-tensors' weight-only NVFP4 scheme (its preset "NVFP4A16"), as its own config serializer
# writes it; `ignore` lists the Linear modules left unquantized (lm_head at least)
_CT_WEIGHTS = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
               "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax",
               "observer_kwargs": {}, "scale_dtype": "torch.float8_e4m3fn", "zp_dtype": None}


def _ct_config(ignore: list[str]) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": _CT_WEIGHTS, "input_activations": None,
                                      "output_activations": None, "format": "nvfp4-pack-quantized"}},
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
        "version": None,
    }


def _merged(w: torch.Tensor, name: str, adapters: dict, scale: float) -> torch.Tensor:
    if name not in adapters:
        return w
    A, B = adapters[name]
    return w + scale * (B.float() @ A.float())


def export(artifact: str, out: str | os.PathLike, *, fmt: str = "compressed-tensors", adapter: str | None = None,
           merge: bool = False, overwrite: bool = False) -> dict:
    """Export ``artifact`` (with a PEFT ``adapter``) to ``out`` in ``fmt``; returns a summary (for
    a merged NVFP4 export: each projection's added relative error from re-quantizing)."""
    if fmt not in FORMATS:
        raise PactError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if merge and not adapter:
        raise PactError("--merge folds an adapter into the weights: give --adapter RUN")
    art = open_artifact(artifact)
    art.verify_cached(default_cache())
    lora_cfg, adapters = load_peft_adapter(adapter) if adapter else (None, {})
    if adapters:
        missing = sorted(set(adapters) - set(art.names()))
        if missing:
            raise PactError(f"--adapter {adapter}: adapts {missing[0]}, which {art.path} does not have (an adapter "
                            "trained on another model)")
    out = Path(out)
    if out.exists() and not overwrite:
        raise PactError(f"--out {out} exists: choose a new folder or pass --overwrite")
    if out.exists() and not _is_export(out):  # --overwrite replaces an earlier export, never another folder
        raise PactError(f"--out {out} is not a checkpoint folder pact-export wrote (no config.json beside "
                        "model*.safetensors): refusing to replace it; choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep_leftovers(out)
    tmp = work_path(out, "tmp")
    merged = merge or fmt == "bf16"  # bf16 folders take the adapter folded in
    try:
        summary = _write(art, tmp, fmt, lora_cfg, adapters, merged)
        if adapters and not merged:  # served beside the quantized base (vLLM LoRA)
            save_peft_adapter(tmp / "adapter", adapters, lora_cfg, str(out.resolve()))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_error(e, getattr(e, "filename", None) or out, f"nothing was written to {out}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": str(out), "format": fmt, **summary}


def _is_export(folder: Path) -> bool:
    return folder.is_dir() and (folder / "config.json").is_file() and any(folder.glob("model*.safetensors"))


def _write(art, tmp: Path, fmt: str, lora_cfg, adapters: dict, merge: bool) -> dict:
    tmp.mkdir(parents=True)
    scale = lora_cfg.scale if lora_cfg else 0.0
    tensors: dict[str, torch.Tensor] = {}
    added: dict[str, float] = {}
    quantized, ignore = [], ["lm_head"]
    groups: dict[str, list[str]] = {}
    for name in art.names("nvfp4"):
        groups.setdefault(art.entry(name).get("group") or name, []).append(name)
    done = set()
    for name in art.names():
        if name in done:
            continue
        e = art.entry(name)
        if e["kind"] != "nvfp4":
            if fmt == "compressed-tensors" and classify(name).frozen_projection:
                ignore.append(name.removesuffix(".weight"))  # a projection kept bf16 (--keep-bf16)
            w = art.dense(name)
            tensors[name] = _merged(w.float(), name, adapters, scale).to(torch.bfloat16) if merge else w
            done.add(name)
            continue
        members = groups[e.get("group") or name]
        if fmt == "bf16":
            for m in members:
                w = art.dequantize(m)
                tensors[m] = (_merged(w, m, adapters, scale) if merge else w).to(torch.bfloat16)
        elif merge and any(m in adapters for m in members):
            # the group's members re-quantized together: one global scale (vLLM fuses q|k|v, gate|up)
            ws = {m: _merged(art.dequantize(m), m, adapters, scale) for m in members}
            g = global_scale_from_amax(max(float(w.abs().amax()) for w in ws.values()))
            rule = art.meta["provenance"].get("block_scales", "amax")
            for m, w in ws.items():
                t = quantize(w, global_scale=g, scaling="1d", scale_rule=rule)
                added[m] = float((dequantize(t) - w).norm() / w.norm()) if float(w.norm()) > 0 else 0.0
                _put_ct(tensors, m, t)
        else:
            for m in members:
                _put_ct(tensors, m, art.nvfp4(m, "fwd"))
        quantized += members
        done.update(members)
    _save_sharded(tensors, tmp)
    config = dict(art.meta["hf_config"])
    if fmt == "compressed-tensors":
        config["quantization_config"] = _ct_config(ignore)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for rel in art.meta["files"]:
        if rel != "config.json":
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(art.hf_dir / rel, tmp / rel)
    out = {"quantized_projections": len(quantized) if fmt == "compressed-tensors" else 0,
           "adapter": "merged" if merge and adapters else "beside" if adapters else None}
    if added:
        vals = sorted(added.values())
        out["requantization_error"] = {"median": vals[len(vals) // 2], "max": vals[-1], "per_projection": added}
    return out


def _put_ct(tensors: dict, name: str, t: NVFP4Tensor) -> None:
    base = name.removesuffix(".weight")
    tensors[f"{base}.weight_packed"] = t.packed.contiguous()
    tensors[f"{base}.weight_scale"] = t.scales.contiguous()
    tensors[f"{base}.weight_global_scale"] = encode_global_scale(t.global_scale).reshape(1)


def encode_global_scale(g: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' global scale (encode direction) for pact's g: the fp32 value next to 1/g
    whose reciprocal is g again, where one is (so export -> import keeps g bit for bit)."""
    g = g.float().reshape(())
    gs = torch.tensor(1.0) / g
    for cand in (gs, torch.nextafter(gs, torch.tensor(0.0)), torch.nextafter(gs, torch.tensor(float("inf")))):
        if torch.equal(torch.tensor(1.0) / cand, g):
            return cand
    return gs


def _save_sharded(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors + index past SHARD_BYTES."""
    shards, cur, size = [], {}, 0
    for k, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > SHARD_BYTES:
            shards.append(cur)
            cur, size = {}, 0
        cur[k], size = t.contiguous(), size + nbytes
    shards.append(cur)
    if len(shards) == 1:
        save_file(shards[0], folder / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, sh in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(sh, folder / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in sh})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
