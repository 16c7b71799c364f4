"""Where weights come from: a local HF folder, a hub id, or a GGUF file.

Every source ends as a folder of config.json + safetensors, read one tensor at a time
through safetensors' memory map (never pickle).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pact.formats import PactError, default_cache
from pact.formats.files import (
    check_regular,
    link_outside,
    own_roots,
    read_json,
    sha256_file,
    sweep_leftovers,
    work_path,
)
from pact.formats.interop import CT_IGNORED, CT_NVFP4_FORMAT, CT_PARTS, MO_PARTS
from pact.formats.layout import SIDE_FILES
from pact.formats.nvfp4 import NVFP4Tensor, dequantize

log = logging.getLogger(__name__)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")
_SIDE_FILE_MAX = 64 << 20  # tokenizer/config/processor files; anything larger is not one
_ST_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "BOOL": torch.bool,
    "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
}


_ST_HEADER_MAX = 100_000_000  # safetensors' own bound on the JSON header


def _unique_keys(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"key {next(k for k in keys if keys.count(k) > 1)!r} appears twice")
    return dict(pairs)


class SafetensorsFile:
    """Reads one tensor at a time with plain file reads into memory the tensor owns.

    safetensors' own loader memory-maps the file, and every page it touches then counts
    in the converter's resident memory until the file is closed; plain reads keep the
    peak at the tensors in flight. The format is an 8-byte little-endian header length,
    a JSON header {name: {dtype, shape, data_offsets}}, then the data. The header is checked
    as safetensors checks it (``_validate``): a file ``safetensors.load_file`` refuses is refused
    here too, never read as other tensors than it claims.
    """

    def __init__(self, path: Path):
        self.path = path
        st = path.stat()
        check_regular(path, st.st_mode, "remove it from the model folder or re-download it", PactError)
        size = st.st_size
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > min(size - 8, _ST_HEADER_MAX):
                    raise ValueError(f"header length {n} exceeds the file or safetensors' {_ST_HEADER_MAX} bytes")
                self.header_bytes = f.read(n)
            header = json.loads(self.header_bytes.decode("utf-8"), object_pairs_hook=_unique_keys)
        except RecursionError:
            raise PactError(f"{path}: not a readable safetensors file (header nested too deeply): "
                            "re-download it") from None
        except (struct.error, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            raise PactError(f"{path}: not a readable safetensors file ({e}): re-download it") from None
        if not isinstance(header, dict):
            raise PactError(f"{path}: not a readable safetensors file (header is not an object): re-download it")
        header.pop("__metadata__", None)
        self.base = 8 + n
        self.entries = header
        self._validate(size - self.base)

    def _validate(self, data_bytes: int) -> None:
        """safetensors' rules: each entry a known dtype, a shape of non-negative integers and
        data_offsets [start, end] whose length is numel x itemsize; sorted by offset, the entries
        tile the data from 0 to the end of the file, without gap or overlap."""
        def bad(name: str, what: str) -> PactError:
            return PactError(f"{self.path}: {name} {what}: not a valid safetensors file (safetensors refuses it "
                             "too); re-download or re-save it")

        for name, e in self.entries.items():
            if not isinstance(e, dict) or e.get("dtype") not in _ST_DTYPES:
                dtype = e.get("dtype") if isinstance(e, dict) else e
                raise PactError(f"{self.path}: {name} has dtype {dtype!r}, which pact does not read")
            shape, offsets = e.get("shape"), e.get("data_offsets")
            if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                      for d in shape):
                raise bad(name, f"has shape {shape!r}")
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(
                    isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
                    and offsets[0] <= offsets[1]):
                raise bad(name, f"has data_offsets {offsets!r}")
        end = 0
        for name, e in sorted(self.entries.items(), key=lambda kv: tuple(kv[1]["data_offsets"])):
            start, stop = e["data_offsets"]
            if start != end:
                raise bad(name, f"starts at byte {start} of the data, where the tensor before it ends at {end} "
                                "(overlapping or out of order)")
            nbytes = math.prod(e["shape"]) * _ST_DTYPES[e["dtype"]].itemsize
            if stop - start != nbytes:
                raise bad(name, f"has {stop - start} bytes for {e['dtype']} {e['shape']} ({nbytes} bytes)")
            end = stop
        if end > data_bytes:
            raise PactError(f"{self.path}: tensors end past the end of the file (truncated): re-download it")
        if end != data_bytes:
            raise bad("the header", f"covers {end} bytes of {data_bytes} after it (trailing data)")

    def shape(self, name: str) -> list[int]:
        return list(self.entries[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return _ST_DTYPES[self.entries[name]["dtype"]]

    def get(self, name: str) -> torch.Tensor:
        e = self.entries[name]
        start, end = e["data_offsets"]
        dtype, shape = _ST_DTYPES[e["dtype"]], e["shape"]
        if end == start:
            return torch.empty(shape, dtype=dtype)
        # not a bytearray: that one is zeroed first, a pass for nothing
        buf = torch.empty(end - start, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.base + start)
            got = f.readinto(memoryview(buf.numpy()))
        if got != buf.numel():  # the file shrank since its header was read
            raise PactError(f"{self.path}: {name} ends past the end of the file (truncated): re-download it")
        return buf.view(dtype).reshape(shape)


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
        self._roots = own_roots(self.folder)
        cfg = self.folder / "config.json"
        if not cfg.is_file():
            raise PactError(
                f"{self.folder} has no config.json: not a model; give a Hugging Face model folder "
                "(config.json + *.safetensors), a .gguf file, or a hub id"
            )
        self.config = self._json(cfg)
        if not isinstance(self.config, dict):
            raise PactError(f"{cfg}: not a JSON object of the model's settings: re-download the model")
        files = [self._own(f) for f in sorted(self.folder.glob("*.safetensors"))]
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
                if name in self._index:  # which copy would be read is arbitrary
                    raise PactError(f"{f}: {name} is also in {self._index[name].path.name}: a tensor stored twice; "
                                    "remove the stray shard or re-download the model")
                self._index[name] = st
        index_json = self.folder / "model.safetensors.index.json"
        if index_json.is_file():
            wanted = self._json(index_json)
            wanted = wanted.get("weight_map") if isinstance(wanted, dict) else None
            if not isinstance(wanted, dict) or not all(isinstance(v, str) for v in wanted.values()):
                raise PactError(f"{index_json}: no 'weight_map' of tensor name -> file: re-download it")
            missing = sorted({v for k, v in wanted.items() if k not in self._index})
            if missing:
                raise PactError(f"{index_json} names shards that are missing or incomplete: {missing[:3]}: "
                                "re-download them")
        self._read_quantization()

    def _own(self, p: Path) -> Path:
        """``p``, a file of the model's own: a link is followed only into the folder or, for a
        hub-cache snapshot, its repo's blobs/ (files.own_roots); anything else is refused, so no host file
        (/etc/..., ~/.ssh/...) is copied into an artifact made to be shared."""
        target = p.resolve()
        if link_outside(p, self._roots) is not None:
            where = " or its hub cache's blobs/" if len(self._roots) > 1 else ""
            raise PactError(f"{p}: a link to {target}, outside the model folder{where}: refusing it (pact-convert "
                            "copies only the model's own files into an artifact made to be shared); replace the "
                            "link with the file itself if you trust it")
        if target.exists() and not target.is_dir():
            check_regular(p, target.stat().st_mode, "remove it from the model folder", PactError)
        return p

    def _json(self, f: Path):
        return read_json(self._own(f), "re-download the model or restore the file", PactError)

    @property
    def producer(self) -> str:
        """Who wrote an NVFP4 checkpoint's layout: "compressed-tensors" or "modelopt"."""
        return "compressed-tensors" if self.encode_global else "modelopt"

    @property
    def quantization(self) -> dict | None:
        q = self.config.get("quantization_config")
        hq = self.folder / "hf_quant_config.json"  # ModelOpt exports describe themselves here too
        if not q and hq.is_file():
            doc = self._json(hq)
            q = doc.get("quantization") if isinstance(doc, dict) else None
            if not isinstance(q, dict):
                raise PactError(f"{hq}: no 'quantization' object: re-export the checkpoint")
            q = {"quant_method": "modelopt", **q}
        if q is not None and not isinstance(q, dict):
            raise PactError(f"{self.folder / 'config.json'}: quantization_config is {q!r}, not an object: "
                            "re-download the model")
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
            suffix, parts_of, self.encode_global = "weight_packed", CT_PARTS, True
        elif method == "modelopt" and fmt == "NVFP4":
            suffix, parts_of, self.encode_global = "weight_scale_2", MO_PARTS, False
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
                self._check_parts(f"{base}.weight")

    def _check_parts(self, name: str) -> None:
        """An imported weight's parts, from the headers (before anything is read or written), are one
        NVFP4 layout: codes uint8 [N, K/2], E4M3 block scales [N, K/16] (K a multiple of 16) and one
        fp32 global scale; the values are checked when read (``nvfp4``)."""
        parts = self.packed[name]
        (packed, scales, gs), dtypes = ([self._index[p].shape(p) for p in parts],
                                        tuple(self._index[p].dtype(p) for p in parts))
        k = 2 * packed[1] if len(packed) == 2 else 0
        if dtypes != (torch.uint8, torch.float8_e4m3fn, torch.float32) or not k or k % 16 \
                or scales != [packed[0], k // 16] or math.prod(gs) != 1:
            raise PactError(f"{self.file_of(name)}: {name}'s NVFP4 parts are not {self.producer}'s NVFP4 layout "
                            f"(packed {dtypes[0]} {packed}, scales {dtypes[1]} {scales}, global scale {dtypes[2]} "
                            f"{gs}; it needs uint8 [N, K/2], float8_e4m3fn [N, K/16] with K % 16 == 0, one float32): "
                            "re-export it")

    def names(self) -> list[str]:
        """Tensor names in file order; an imported NVFP4 weight appears once, as ``<module>.weight``."""
        if not self.packed:
            return list(self._index)
        out, parts = [], {p for v in self.packed.values() for p in v}
        for name in self._index:
            base, _, part = name.rpartition(".")
            if name in parts and self.packed.get(f"{base}.weight", ())[:1] == (name,):
                out.append(f"{base}.weight")  # the packed codes stand for the weight
            elif name not in parts and part not in CT_IGNORED:
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
        allow-list (SIDE_FILES), so nothing else in the source folder (.env, scripts) travels with a
        shared artifact; a link out of the model's own files is refused (``_own``), and a JSON one
        that does not parse is refused here rather than by whoever opens the artifact."""
        out = []
        for name in SIDE_FILES:
            p = self.folder / name
            if (p.is_symlink() or p.is_file()) and self._own(p).is_file() and p.stat().st_size <= _SIDE_FILE_MAX:
                if p.suffix == ".json":
                    self._json(p)
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

    def content_sha256(self) -> str:
        """sha256 over config.json and every safetensors file's name and bytes: the weights
        themselves (two sources with the same shapes and other values differ here, not in
        ``fingerprint``). Reads every file once."""
        h = hashlib.sha256((self.folder / "config.json").read_bytes())
        for st in sorted(set(self._index.values()), key=lambda st: st.path.name):
            h.update(f"{st.path.name}\0{sha256_file(st.path)}\n".encode())
        return h.hexdigest()


HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]  # what a source needs


def _from_hub(repo_id: str, revision: str | None, max_bytes: int | None = None) -> tuple[Path, dict]:
    """The hub repo's files a source needs (HUB_PATTERNS), downloaded into the hub cache. ``max_bytes``: refuse a
    repo whose files come to more, before anything is downloaded (the files listed at one commit, and that commit
    downloaded: the repo cannot grow in between)."""
    try:
        from huggingface_hub import HfApi, snapshot_download

        cached_only = False
        if max_bytes is not None:
            import fnmatch

            try:
                info = HfApi().model_info(repo_id, revision=revision, files_metadata=True)
            except Exception:  # offline or unreachable: the hub cache only (nothing downloaded, nothing to bound)
                info, cached_only = None, True
            if info is not None:
                total = sum(f.size or 0 for f in info.siblings or []
                            if any(fnmatch.fnmatch(f.rfilename, p) for p in HUB_PATTERNS))
                if total > max_bytes:
                    raise PactError(f"{repo_id!r}: its model files come to {total / 1e9:.2f} GB, more than the "
                                    f"{max_bytes / 1e9:.2f} GB the artifact's weights need as a source (4 bytes a "
                                    "weight): not this artifact's source, and not downloaded; pass --source with "
                                    "the original model")
                revision = info.sha or revision
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS,
                                        local_files_only=cached_only))
    except PactError:
        raise
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


GGUF_CACHE_GB = 1.0  # default PACT_GGUF_CACHE_GB: GGUF files up to this size keep their dequantized folder


def _gguf_cache_limit() -> float:
    raw = os.environ.get("PACT_GGUF_CACHE_GB", "").strip()
    try:
        limit = float(raw) if raw else GGUF_CACHE_GB
    except ValueError:
        limit = math.nan
    if not limit >= 0:  # (NaN too)
        raise PactError(f"PACT_GGUF_CACHE_GB={raw!r}: give a size in GB >= 0 (0 turns the GGUF cache off, inf "
                        "keeps every file)")
    return limit


def _gguf_entry_ok(entry: Path) -> bool:
    """A complete cache entry: its `done` record lists every file of hf/ with its sha256, and they match."""
    try:
        files = json.loads((entry / "done").read_text())["files"]
        return bool(files) and all(sha256_file(entry / "hf" / rel) == h for rel, h in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _gguf_cached(path: Path) -> tuple[Path, dict] | None:
    """The dequantized HF folder of the GGUF file ``path`` from ``$PACT_CACHE/gguf/<sha256>/``, made
    there on first use, so pact-convert, pact-calibrate and later conversions of the same file read it
    once through transformers' GGUF loader (which spends ~30 s on SmolLM2-135M's, most of it parsing
    the file's metadata three times). Each use checks the entry's files against the sha256s recorded
    when it was made; a damaged entry is made again. Files larger than PACT_GGUF_CACHE_GB (default 1;
    0: never) are dequantized into a temp folder each time instead (None)."""
    if path.stat().st_size > _gguf_cache_limit() * 1e9:
        return None
    sha = sha256_file(path)
    entry = default_cache() / "gguf" / sha
    prov = {"source_kind": "gguf", "gguf_sha256": sha}
    if entry.exists():
        if _gguf_entry_ok(entry):
            return entry / "hf", prov
        log.warning("%s: a damaged cache entry (its files do not match their record): making it again", entry)
        shutil.rmtree(entry, ignore_errors=True)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        sweep_leftovers(entry)
        tmp = work_path(entry, "tmp")
        try:
            _from_gguf(path, tmp / "hf")
            files = {str(f.relative_to(tmp / "hf")): sha256_file(f) for f in sorted((tmp / "hf").rglob("*"))
                     if f.is_file()}
            (tmp / "done").write_text(json.dumps({"gguf_sha256": sha, "files": files}, indent=1) + "\n")
            try:
                os.rename(tmp, entry)
            except OSError:
                if not _gguf_entry_ok(entry):  # not another process's complete entry
                    raise
                shutil.rmtree(tmp, ignore_errors=True)  # another process made it meanwhile: theirs is used
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    except OSError as e:  # an unwritable or full cache: no cache, the conversion goes on without it
        log.warning("could not keep the dequantized GGUF in %s (%s): reading it without the cache", entry, e)
        return None
    return entry / "hf", prov


def open_source(src: str, *, revision: str | None = None, workdir: Path | None = None,
                max_bytes: int | None = None) -> Source:
    """Resolve SRC (folder, .gguf, or hub id) to a streaming Source.

    ``workdir`` receives the HF folder a GGUF file is dequantized into (caller removes it). ``max_bytes``: a hub
    repo larger than this is refused before its download (a source an artifact names, not the user).
    """
    path = Path(src)
    if path.is_dir():
        if not any(path.iterdir()):
            raise PactError(f"source folder {path} is empty: point at a Hugging Face model folder "
                            "(config.json + *.safetensors)")
        return Source(path, {"source": str(path.resolve()), "source_kind": "folder", "revision": revision})
    if path.is_file():
        if path.suffix != ".gguf":
            raise PactError(
                f"source {path} is a file but not .gguf: give a model folder (config.json + *.safetensors), "
                "a .gguf file or a hub id"
            )
        cached = _gguf_cached(path)
        if cached is not None:
            folder, prov = cached
        else:
            if workdir is None:
                workdir = Path(tempfile.mkdtemp(prefix="pact-gguf-"))
            folder, prov = _from_gguf(path, workdir)
        return Source(folder, {"source": str(path.resolve()), **prov})
    if _HUB_ID.match(src) and not src.startswith((".", "/")):
        folder, prov = _from_hub(src, revision, max_bytes)
        return Source(folder, {"source": src, **prov})
    raise PactError(f"source {src!r} does not exist: give a local model folder, a .gguf file, "
                    "or a hub id like org/name")


def remove_tree(path: Path | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)
