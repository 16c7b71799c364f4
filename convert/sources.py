"""Where weights come from: a local HF folder, a hub id, or a GGUF file.

Every source ends as a folder of config.json + safetensors, read one tensor at a time
through safetensors' memory map (never pickle).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pact.formats import PactError
from pact.formats.artifact import sha256_file
from pact.formats.nvfp4 import NVFP4Tensor, dequantize

log = logging.getLogger(__name__)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")
_SIDE_FILE_MAX = 64 << 20  # tokenizer/config/processor files; anything larger is not one
# what an artifact's hf/ may hold: config, tokenizer, chat template and image processor files
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
              "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "processor_config.json",
              "video_preprocessor_config.json")
# compressed-tensors' NVFP4 layout (llm-compressor's output, what vLLM loads): per quantized Linear,
# weight_packed uint8 [N, K/2] (E2M1 codes, low nibble first, bit 3 the sign: pact's own packing),
# weight_scale e4m3 [N, K/16] and weight_global_scale fp32 [1] in the encode direction (1 / pact's g);
# the rest (input_global_scale, ...) concerns inference-time activations and is not read.
CT_NVFP4_FORMAT = "nvfp4-pack-quantized"
_CT_PARTS = ("weight_packed", "weight_scale", "weight_global_scale")
# ModelOpt's NVFP4 export (TensorRT-LLM / vLLM "modelopt"): ``weight`` uint8 [N, K/2] (same packing),
# ``weight_scale`` e4m3 [N, K/16] and ``weight_scale_2`` fp32 in the decode direction (pact's g itself)
_MO_PARTS = ("weight", "weight_scale", "weight_scale_2")
_CT_IGNORED = ("input_global_scale", "input_scale", "weight_zero_point", "output_scale", "k_scale", "v_scale")
_ST_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "BOOL": torch.bool,
    "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
}


class SafetensorsFile:
    """Reads one tensor at a time with plain file reads into memory the tensor owns.

    safetensors' own loader memory-maps the file, and every page it touches then counts
    in the converter's resident memory until the file is closed; plain reads keep the
    peak at the tensors in flight. The format is an 8-byte little-endian header length,
    a JSON header {name: {dtype, shape, data_offsets}}, then the data.
    """

    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > size - 8:
                    raise ValueError(f"header length {n} exceeds the file")
                self.header_bytes = f.read(n)
            header = json.loads(self.header_bytes)
        except (struct.error, ValueError, UnicodeDecodeError) as e:
            raise PactError(f"{path}: not a readable safetensors file ({e}): re-download it") from None
        header.pop("__metadata__", None)
        self.base = 8 + n
        self.entries = header
        for name, e in header.items():
            start, end = e["data_offsets"]
            if self.base + end > size:
                raise PactError(f"{path}: {name} ends past the end of the file (truncated): re-download it")
            if e["dtype"] not in _ST_DTYPES:
                raise PactError(f"{path}: {name} has dtype {e['dtype']}, which pact does not read")

    def shape(self, name: str) -> list[int]:
        return list(self.entries[name]["shape"])

    def get(self, name: str) -> torch.Tensor:
        e = self.entries[name]
        start, end = e["data_offsets"]
        dtype, shape = _ST_DTYPES[e["dtype"]], e["shape"]
        if end == start:
            return torch.empty(shape, dtype=dtype)
        buf = bytearray(end - start)
        with open(self.path, "rb") as f:
            f.seek(self.base + start)
            f.readinto(buf)
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)


@dataclass
class Source:
    """An HF-layout folder opened for streaming reads."""

    folder: Path
    provenance: dict
    config: dict = field(init=False)
    _index: dict[str, SafetensorsFile] = field(init=False)
    # weight name -> its NVFP4 parts (packed, block scales, global scale) in an NVFP4 checkpoint
    packed: dict[str, tuple[str, str, str]] = field(init=False, default_factory=dict)
    encode_global: bool = field(init=False, default=True)  # compressed-tensors: 1 / g; ModelOpt: g


    def __post_init__(self) -> None:
        cfg = self.folder / "config.json"
        if not cfg.is_file():
            raise PactError(
                f"{self.folder} has no config.json: point pact-convert at a Hugging Face model "
                "folder (config.json + *.safetensors), a .gguf file, or a hub id"
            )
        try:
            self.config = json.loads(cfg.read_text())
        except json.JSONDecodeError as e:
            raise PactError(f"{cfg} is not valid JSON ({e}): re-download the model") from None
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            found = sorted(p.name for p in self.folder.iterdir() if p.suffix in _WEIGHT_SUFFIXES)
            hint = f" (found {', '.join(found)})" if found else ""
            raise PactError(
                f"{self.folder} has no *.safetensors files{hint}: pact reads safetensors only "
                "(pickle files are never loaded); re-save with save_pretrained(safe_serialization=True)"
            )
        self._index = {}
        for f in files:
            st = SafetensorsFile(f)
            for name in st.entries:
                self._index[name] = st
        index_json = self.folder / "model.safetensors.index.json"
        if index_json.is_file():
            wanted = json.loads(index_json.read_text()).get("weight_map", {})
            missing = sorted({v for k, v in wanted.items() if k not in self._index})
            if missing:
                raise PactError(f"{index_json} names shards that are missing or incomplete: {missing[:3]}: re-download them")
        self._read_quantization()

    @property
    def producer(self) -> str:
        """Who wrote an NVFP4 checkpoint's layout: "compressed-tensors" or "modelopt"."""
        return "compressed-tensors" if self.encode_global else "modelopt"

    @property
    def quantization(self) -> dict | None:
        q = self.config.get("quantization_config")
        hq = self.folder / "hf_quant_config.json"  # ModelOpt exports describe themselves here too
        if not q and hq.is_file():
            try:
                q = {"quant_method": "modelopt", **json.loads(hq.read_text()).get("quantization", {})}
            except (ValueError, AttributeError):
                raise PactError(f"{hq}: not valid JSON: re-export the checkpoint") from None
        return q

    def _read_quantization(self) -> None:
        """A quantized checkpoint: NVFP4 from compressed-tensors (llm-compressor) or ModelOpt is
        imported as it is (its codes and scales become the artifact's forward layout); anything else
        is one clear error."""
        q, cfg = self.quantization, self.folder / "config.json"
        if not q:
            return
        method, fmt = q.get("quant_method"), q.get("format") or q.get("quant_algo")
        if method == "compressed-tensors" and fmt == CT_NVFP4_FORMAT:
            suffix, parts_of, self.encode_global = "weight_packed", _CT_PARTS, True
        elif method == "modelopt" and fmt == "NVFP4":
            suffix, parts_of, self.encode_global = "weight_scale_2", _MO_PARTS, False
        else:
            raise PactError(f"{cfg}: the checkpoint is already quantized ({method}, {fmt}): pact-convert reads "
                            f"bf16 / fp16 / fp32 weights, or NVFP4 as compressed-tensors ({CT_NVFP4_FORMAT}, "
                            "llm-compressor's output) or ModelOpt (quant_algo NVFP4) write it; point it at the "
                            "unquantized model")
        for name in list(self._index):
            base, _, part = name.rpartition(".")
            if part == suffix:
                parts = tuple(f"{base}.{p}" for p in parts_of)
                lacking = [p for p in parts if p not in self._index]
                if lacking:
                    raise PactError(f"{self.file_of(name)}: {name} comes without {lacking[0]}: the NVFP4 checkpoint "
                                    "is incomplete; re-download or re-export it")
                self.packed[f"{base}.weight"] = parts

    def names(self) -> list[str]:
        """Tensor names in file order; an imported NVFP4 weight appears once, as ``<module>.weight``."""
        if not self.packed:
            return list(self._index)
        out, parts = [], {p for v in self.packed.values() for p in v}
        for name in self._index:
            base, _, part = name.rpartition(".")
            if name in parts and self.packed.get(f"{base}.weight", ())[:1] == (name,):
                out.append(f"{base}.weight")  # the packed codes stand for the weight
            elif name not in parts and part not in _CT_IGNORED:
                out.append(name)
        return out

    def file_of(self, name: str) -> Path:
        return self._index[self.packed[name][0] if name in self.packed else name].path

    def shape(self, name: str) -> list[int]:
        if name in self.packed:
            n, kb = self._index[self.packed[name][0]].shape(self.packed[name][0])
            return [n, 2 * kb]
        return self._index[name].shape(name)

    def nvfp4(self, name: str) -> NVFP4Tensor | None:
        """An imported weight's NVFP4 codes and scales as stored (global scale turned to pact's decode
        direction, g = 1 / weight_global_scale), or None for a weight the checkpoint holds unquantized."""
        if name not in self.packed:
            return None
        packed, scales, gs = (self._index[p].get(p) for p in self.packed[name])
        n, kb = packed.shape
        if packed.dtype != torch.uint8 or scales.dtype != torch.float8_e4m3fn or tuple(scales.shape) != (n, kb // 8) \
                or gs.numel() != 1 or not bool(torch.isfinite(gs).all()) or float(gs.reshape(())) <= 0:
            raise PactError(f"{self.file_of(name)}: {name}'s NVFP4 parts are not {self.producer}'s NVFP4 "
                            f"layout (packed {packed.dtype} {tuple(packed.shape)}, scales "
                            f"{scales.dtype} {tuple(scales.shape)}, global scale {gs.tolist()}): re-export it")
        gs = gs.reshape(()).float()
        g = torch.tensor(1.0, dtype=torch.float32) / gs if self.encode_global else gs
        return NVFP4Tensor(packed.contiguous(), scales.contiguous(), g)

    def load(self, name: str) -> torch.Tensor:
        """A tensor as the checkpoint holds it; an imported NVFP4 weight dequantized to fp32 as its
        producer does it ((q * s_b) / weight_global_scale for compressed-tensors, (q * s_b) * g else)."""
        if name in self.packed:
            t = self.nvfp4(name)
            if not self.encode_global:
                return dequantize(t)
            gs = self._index[self.packed[name][2]].get(self.packed[name][2]).reshape(()).float()
            return dequantize(NVFP4Tensor(t.packed, t.scales, torch.tensor(1.0))) / gs
        return self._index[name].get(name)

    def side_files(self) -> list[Path]:
        """config, tokenizer, chat template and processor files to ship in the artifact: an
        allow-list (SIDE_FILES), so nothing else in the source folder (.env, scripts, links to
        host files) travels with a shared artifact."""
        out = []
        roots = [self.folder.resolve()]
        if self.folder.parent.name == "snapshots":  # a Hugging Face cache snapshot links to its blobs/
            roots.append((self.folder.parent.parent / "blobs").resolve())
        for name in SIDE_FILES:
            p = self.folder / name
            if p.is_symlink() and not any(p.resolve().is_relative_to(r) for r in roots):
                log.warning("%s: a link to outside the model folder, not copied into the artifact", p)
                continue
            if p.is_file() and p.stat().st_size <= _SIDE_FILE_MAX:
                out.append(p)
        return out

    def fingerprint(self) -> str:
        """sha256 of config.json, each safetensors file's name, size and header (dtypes,
        shapes, offsets): identifies the source without reading its weights again."""
        h = hashlib.sha256((self.folder / "config.json").read_bytes())
        for st in sorted(set(self._index.values()), key=lambda st: st.path.name):
            h.update(st.path.name.encode())
            h.update(str(st.path.stat().st_size).encode())
            h.update(st.header_bytes)
        return h.hexdigest()


def _from_hub(repo_id: str, revision: str | None) -> tuple[Path, dict]:
    try:
        from huggingface_hub import snapshot_download

        folder = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"],
            )
        )
    except Exception as e:
        raise PactError(
            f"{repo_id!r} is not a local path and could not be fetched from the hub ({type(e).__name__}: {e}): "
            "check the path, or the hub id and your network"
        ) from None
    return folder, {"source_kind": "hub", "revision": folder.name}


def _gguf_truncated(path: Path) -> bool:
    """Whether a GGUF file's tensors run past its end (a cut download)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        return max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0) > path.stat().st_size
    except ValueError as e:  # numpy cannot shape a tensor whose bytes the file lacks
        return "cannot reshape" in str(e)
    except Exception:
        return False


def _from_gguf(path: Path, workdir: Path) -> tuple[Path, dict]:
    """Dequantize a GGUF file through transformers' loader and save an HF folder in workdir."""
    try:
        import gguf  # noqa: F401  (transformers needs it to read .gguf)
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    except ImportError as e:
        raise PactError(f"{path}: reading .gguf needs the gguf package ({e}): pip install gguf") from None
    try:
        kw = dict(gguf_file=path.name, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True), **kw
        )
        tok = AutoTokenizer.from_pretrained(str(path.parent), **kw)
    except Exception as e:
        if _gguf_truncated(path):
            raise PactError(f"{path}: truncated ({path.stat().st_size} bytes; its tensors run past the end of the "
                            "file): re-download it") from None
        raise PactError(f"{path}: transformers could not load this GGUF file ({type(e).__name__}: {e})") from None
    model.save_pretrained(workdir)
    tok.save_pretrained(workdir)
    del model
    return workdir, {"source_kind": "gguf", "gguf_sha256": sha256_file(path)}


def open_source(src: str, *, revision: str | None = None, workdir: Path | None = None) -> Source:
    """Resolve SRC (folder, .gguf, or hub id) to a streaming Source.

    ``workdir`` receives the HF folder a GGUF file is dequantized into (caller removes it).
    """
    path = Path(src)
    if path.is_dir():
        if not any(path.iterdir()):
            raise PactError(f"source folder {path} is empty: point at a Hugging Face model folder (config.json + *.safetensors)")
        return Source(path, {"source": str(path.resolve()), "source_kind": "folder", "revision": revision})
    if path.is_file():
        if path.suffix != ".gguf":
            raise PactError(
                f"source {path} is a file but not .gguf: give a model folder (config.json + *.safetensors), a .gguf file or a hub id"
            )
        if workdir is None:
            workdir = Path(tempfile.mkdtemp(prefix="pact-gguf-"))
        folder, prov = _from_gguf(path, workdir)
        return Source(folder, {"source": str(path.resolve()), **prov})
    if _HUB_ID.match(src) and not src.startswith((".", "/")):
        folder, prov = _from_hub(src, revision)
        return Source(folder, {"source": src, **prov})
    raise PactError(f"source {src!r} does not exist: give a local model folder, a .gguf file, or a hub id like org/name")


def remove_tree(path: Path | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
