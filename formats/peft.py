"""LoRA adapters as files: their configuration and PEFT's format (adapter_config.json + safetensors),
which pact-train writes, pact-eval and pact-export read, and PEFT loads."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from .errors import PactError
from .families import PROJECTIONS
from .files import check_regular, link_outside, open_new, own_roots, read_json

ALL_TARGETS = tuple(PROJECTIONS)  # q_proj k_proj v_proj o_proj gate_proj up_proj down_proj


@dataclass
class LoraConfig:
    r: int = field(default=16, metadata={"help": "LoRA rank"})
    alpha: float = field(default=32.0, metadata={"help": "scale = alpha / r"})
    dropout: float = field(default=0.0, metadata={"help": "dropout on the adapter input"})
    targets: tuple[str, ...] = field(default=ALL_TARGETS, metadata={"help": "projections that get adapters"})
    layers: str = field(default="all", metadata={"help": "decoder blocks that get adapters (parse_layers)"})

    def __post_init__(self) -> None:
        self.targets = tuple(self.targets)
        parse_layers(self.layers, None)  # the syntax now; the range once the model's depth is known
        if self.r < 1:
            raise PactError(f"--lora-r must be >= 1, got {self.r}")
        if not 0.0 <= self.dropout < 1.0:
            raise PactError(f"--lora-dropout must be in [0, 1), got {self.dropout}")
        bad = [t for t in self.targets if t not in ALL_TARGETS]
        if bad or not self.targets:
            raise PactError(f"--targets: unknown {bad or 'empty'}; choose from {', '.join(ALL_TARGETS)}")

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    def layer_ids(self, n_layers: int) -> list[int]:
        return parse_layers(self.layers, n_layers)


def parse_layers(spec: str, n_layers: int | None) -> list[int]:
    """--lora-layers: ``all``, ``top:N`` (the N last blocks), ``A-B`` (0-based, inclusive) or a
    comma list of block indices -> sorted indices (``n_layers`` None: the syntax alone, [])."""
    spec = str(spec).strip()
    fix = "use all, top:N (the N last decoder blocks), A-B (0-based, inclusive) or a comma list like 10,11"
    try:
        if spec == "all":
            ids = None
        elif spec.startswith("top:"):
            k = int(spec[4:])
            if k < 1:
                raise ValueError
            ids = None if n_layers is None else list(range(n_layers - k, n_layers))
        elif "-" in spec:
            a, b = (int(v) for v in spec.split("-"))
            if not 0 <= a <= b:
                raise ValueError
            ids = list(range(a, b + 1))
        else:
            ids = sorted({int(v) for v in spec.split(",")})
            if not ids or ids[0] < 0:
                raise ValueError
    except ValueError:
        raise PactError(f"--lora-layers {spec!r}: {fix}") from None
    if n_layers is None:
        return []
    if spec.startswith("top:") and int(spec[4:]) > n_layers:
        raise PactError(f"--lora-layers {spec}: the model has {n_layers} decoder blocks")
    if ids is None:
        return list(range(n_layers))
    if ids[-1] >= n_layers:
        raise PactError(f"--lora-layers {spec}: block {ids[-1]} does not exist (the model has {n_layers} decoder "
                        f"blocks, 0-{n_layers - 1})")
    return ids


def peft_key(hf_weight_name: str, which: str) -> str:
    """'model.layers.0.self_attn.q_proj.weight' ->
    PEFT's 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'."""
    stem = hf_weight_name.removesuffix(".weight")
    return f"base_model.model.{stem}.lora_{which}.weight"


ADAPTER_TMP = (".adapter_model.safetensors.tmp", ".adapter_config.json.tmp")


def _adapter_bytes(adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], cfg: LoraConfig,
                   base_model: str) -> tuple[bytes, bytes]:
    """The two files of a PEFT adapter as bytes: weights (safetensors) and adapter_config.json.
    Their sizes depend only on the names and shapes, never on the values."""
    tensors = {}
    for name, (A, B) in adapters.items():
        tensors[peft_key(name, "A")] = A.detach().float().cpu().contiguous()
        tensors[peft_key(name, "B")] = B.detach().float().cpu().contiguous()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": cfg.r,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": sorted(cfg.targets),
        **({} if cfg.layers == "all" else {"layers_to_transform": sorted(
            {int(m.group(1)) for m in (re.search(r"\.layers\.(\d+)\.", n) for n in adapters) if m}),
            "layers_pattern": "layers"}),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }
    return save(tensors, metadata={"format": "pt"}), (json.dumps(config, indent=2) + "\n").encode()


def _write_into(path: Path, data: bytes) -> None:
    """``data`` into ``path``: overwritten in place when the file already holds exactly as many
    bytes (a reservation: no new disk blocks are needed), else written anew."""
    if not path.is_symlink() and path.is_file() and path.stat().st_size == len(data):
        with os.fdopen(os.open(path, os.O_RDWR | os.O_NOFOLLOW), "r+b") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    else:
        with open_new(path, "wb") as f:  # (a link there is replaced, never written through)
            f.write(data)


def reserve_peft_adapter(out_dir: str | os.PathLike, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]],
                         cfg: LoraConfig, base_model: str) -> None:
    """Claim, at the start of a run, the disk space its final adapter needs: temp files of the
    final size that ``save_peft_adapter`` later overwrites in place and renames. A full disk
    then fails the run before it trains, never at its last write."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in zip(ADAPTER_TMP, _adapter_bytes(adapters, cfg, base_model)):
        _write_into(out / name, data)


def save_peft_adapter(out_dir: str | os.PathLike, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]],
                      cfg: LoraConfig, base_model: str) -> Path:
    """adapters: HF weight name -> (A [r,K], B [N,r]). Written atomically (temp names, rename),
    into the space ``reserve_peft_adapter`` claimed when it ran first."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmps = [out / name for name in ADAPTER_TMP]
    try:
        for tmp, data in zip(tmps, _adapter_bytes(adapters, cfg, base_model)):
            _write_into(tmp, data)
    except OSError:
        for tmp in tmps:
            tmp.unlink(missing_ok=True)
        raise
    os.replace(tmps[0], out / "adapter_model.safetensors")
    os.replace(tmps[1], out / "adapter_config.json")
    return out


ADAPTER_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # floats (what PEFT and pact write)


def load_peft_adapter(
        adapter_dir: str | os.PathLike) -> tuple[LoraConfig, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    d = Path(adapter_dir)
    cfg_path, w_path = d / "adapter_config.json", d / "adapter_model.safetensors"
    if not d.exists():
        raise PactError(f"--adapter {d}: no such folder (give the run folder pact-train wrote, or a PEFT adapter)")
    if not cfg_path.is_file() or not w_path.is_file():
        raise PactError(f"{d} is not a PEFT LoRA adapter (needs adapter_config.json + adapter_model.safetensors)")
    fix = "re-save it with PEFT or pact-train"
    roots = own_roots(d)
    for p in (cfg_path, w_path):  # an adapter from anyone: its files are its own, not links to elsewhere
        if (target := link_outside(p, roots)) is not None:
            raise PactError(f"{p}: a symbolic link to {target}, outside the adapter's folder (or its hub "
                            "cache's blobs/): refusing it; copy the adapter without links (cp -rL) if you trust "
                            "its source")
    check_regular(w_path, w_path.stat().st_mode, fix, PactError)  # (read_json checks the config's)
    c = read_json(cfg_path, fix, PactError)
    if not isinstance(c, dict):
        raise PactError(f"{cfg_path}: expected a JSON object: {fix}")
    for key, ok in (("r", lambda v: isinstance(v, int) and v >= 1),
                    ("lora_alpha", lambda v: isinstance(v, (int, float)) and 0 < v < float("inf")),
                    ("target_modules", lambda v: isinstance(v, list) and v and all(isinstance(t, str) for t in v))):
        if not ok(c.get(key)):
            raise PactError(f"{cfg_path}: '{key}' is missing or invalid ({c.get(key)!r}): {fix}")
    if c.get("peft_type", "LORA") != "LORA" or c.get("use_dora") or c.get("use_rslora"):
        raise PactError(f"{cfg_path}: a {c.get('peft_type')} adapter (use_dora={c.get('use_dora')}, use_rslora="
                        f"{c.get('use_rslora')}): pact applies plain LoRA only")
    layers = c.get("layers_to_transform")
    if layers is not None and not (isinstance(layers, int) or (isinstance(layers, list) and layers and all(
            isinstance(v, int) for v in layers))):
        raise PactError(f"{cfg_path}: 'layers_to_transform' is invalid ({layers!r}): {fix}")
    layers = "all" if layers is None else ",".join(map(str, [layers] if isinstance(layers, int) else layers))
    dropout = c.get("lora_dropout", 0.0)
    if not (isinstance(dropout, (int, float)) and not isinstance(dropout, bool) and 0 <= dropout < 1):
        raise PactError(f"{cfg_path}: 'lora_dropout' is invalid ({dropout!r}; a number in [0, 1)): {fix}")
    cfg = LoraConfig(r=c["r"], alpha=c["lora_alpha"], dropout=dropout,
                     targets=tuple(c["target_modules"]), layers=layers)
    try:
        tensors = load_file(w_path)
    except Exception as e:  # safetensors raises its own error types for damaged headers
        raise PactError(f"{w_path}: unreadable ({e}): the adapter is damaged; {fix}") from None
    out: dict[str, list] = {}
    for key, t in tensors.items():
        stem, sep, which = key.removeprefix("base_model.model.").rpartition(".lora_")
        if not sep or which not in ("A.weight", "B.weight"):
            raise PactError(f"{w_path}: tensor {key!r} is not a LoRA A/B weight: {fix}")
        out.setdefault(stem + ".weight", [None, None])["AB".index(which[0])] = t
    if not out:  # (an empty file: nothing to apply, and its r alone would size the modules)
        raise PactError(f"{w_path}: holds no LoRA A/B weights: {fix}")
    strays = [k for k in out if not any(k.removesuffix(".weight") == t or k.removesuffix(".weight").endswith("." + t)
                                        for t in cfg.targets)]
    if strays:  # applied by one reader and dropped by another, the adapter would be two models
        more = f" and {len(strays) - 1} more" if len(strays) > 1 else ""
        raise PactError(f"{w_path}: holds LoRA weights for {strays[0]!r}{more}, which {cfg_path.name}'s "
                        f"target_modules ({', '.join(cfg.targets)}) does not name: the config and the weights "
                        f"disagree; {fix}")
    for k, (a, b) in out.items():
        if a is None or b is None or a.dim() != 2 or b.dim() != 2 or a.shape[0] != c["r"] or b.shape[1] != c["r"]:
            raise PactError(f"{w_path}: {k}: A/B missing or not of rank r={c['r']}: {fix}")
    for k, (a, b) in out.items():
        if not (a.dtype in ADAPTER_DTYPES and b.dtype in ADAPTER_DTYPES):  # (integers would be cast, as numbers
            # they never were trained as: a quantized or damaged adapter, not one PEFT or pact writes)
            raise PactError(f"{w_path}: {k}: LoRA weights of dtype {a.dtype} / {b.dtype}, not a float "
                            f"type: {fix}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise PactError(f"{w_path}: {k}: the adapter holds NaN or Inf values: it cannot be used; retrain it "
                            "(or resume from an earlier checkpoint)")
    return cfg, {k: (a, b) for k, (a, b) in out.items()}
