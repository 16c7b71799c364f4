"""The pact artifact: one zarr v3 directory store, memory-mapped zero-copy at run time.

Layout (``ARCHITECTURE.md`` has the full picture)::

    artifact/
      zarr.json                      root group; attributes["pact"] = the manifest
      hf/                            config.json, tokenizer and processor files (plain files)
      tensors/<hf name>/fwd_packed   uint8 [N, K/2]     } frozen projection, NVFP4
      tensors/<hf name>/fwd_scales   e4m3 [N, K/16]     } (stored as uint8 bits)
      tensors/<hf name>/bwd_packed   uint8 [K, N/2]     } backward layout = W^T
      tensors/<hf name>/bwd_scales   e4m3 [K, N/16]     }
      tensors/<hf name>/data         bf16 (uint16 bits) embeddings, norms, lm_head, bf16-kept

Every array is one chunk, uncompressed, codec ``bytes`` only, so its chunk file holds the
raw little-endian bytes and ``numpy.memmap`` maps it. The reader needs only each array's
``zarr.json``; it refuses anything it cannot map rather than silently reading it whole.

Manifest (root attributes["pact"]): ``format``, ``format_version``, ``architecture``,
``family``, ``hf_config``, ``provenance``, ``files`` (hf/ files with sha256) and ``tensors``:
``{name: {role, kind: "nvfp4"|"dense", shape, dtype, layer, group, scaling, global_scale,
error, arrays: {part: {path, dtype, shape, sha256}}}}``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from .errors import ArtifactError
from .nvfp4 import NVFP4Tensor, dequantize as _dequantize

FORMAT_NAME = "pact-nvfp4"
FORMAT_VERSION = 1
HF_DIR = "hf"
LAYOUTS = ("fwd", "bwd")

log = logging.getLogger(__name__)

# logical dtype -> (numpy storage dtype, torch view dtype). e4m3 and bf16 have no zarr v3
# core data type, so their bits are stored as uint8/uint16 and viewed back after mapping.
_STORAGE = {
    "uint8": (np.uint8, torch.uint8),
    "float8_e4m3fn": (np.uint8, torch.float8_e4m3fn),
    "bfloat16": (np.uint16, torch.bfloat16),
    "float32": (np.float32, torch.float32),
}
_TORCH_NAME = {v[1]: k for k, v in _STORAGE.items()}


def array_nbytes(spec: dict) -> int:
    """Bytes of a manifest array's one chunk (its shape and stored dtype)."""
    return int(np.prod(spec["shape"])) * np.dtype(_STORAGE[spec["dtype"]][0]).itemsize
_BYTES_CODEC_OK = ({"name": "bytes"}, {"name": "bytes", "configuration": {"endian": "little"}})


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _to_storage(t: torch.Tensor) -> tuple[np.ndarray, str]:
    name = _TORCH_NAME.get(t.dtype)
    if name is None:
        raise TypeError(f"artifact arrays hold {sorted(_STORAGE)}, got {t.dtype}")
    np_dtype = _STORAGE[name][0]
    bits = t.detach().cpu().contiguous()
    if name in ("float8_e4m3fn", "bfloat16"):
        bits = bits.view(torch.uint8 if name == "float8_e4m3fn" else torch.int16)
    return bits.numpy().view(np_dtype), name


# --------------------------------------------------------------------------------------
# writing


def _is_artifact(path: Path) -> bool:
    """A folder whose zarr.json carries a pact manifest (what --overwrite may replace)."""
    try:
        return json.loads((path / "zarr.json").read_text())["attributes"]["pact"]["format"] == FORMAT_NAME
    except (OSError, ValueError, KeyError, TypeError):
        return False


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def work_path(out: Path, kind: str) -> Path:
    """A temp path beside ``out`` (``kind``: tmp, old, gguf, src) named by this process, so a later
    run can tell a killed run's leftovers from a live run's."""
    return out.parent / f".{out.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def sweep_leftovers(out: Path) -> None:
    """Remove temp folders a killed run left beside ``out`` (their process is gone)."""
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(tmp|old|gguf|src)-(\d+)-[0-9a-f]{{8}}$")
    for p in out.parent.iterdir() if out.parent.is_dir() else []:
        m = pattern.match(p.name)
        if m and not p.is_symlink() and p.is_dir() and not pid_alive(int(m.group(2))):
            size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())
            log.warning("removing %s (%.1f MB), left by an interrupted run (pid %s)", p, size / 1e6, m.group(2))
            shutil.rmtree(p, ignore_errors=True)


def check_output(out: str | os.PathLike, overwrite: bool) -> Path:
    """Where an artifact may be written: a new path, or with ``overwrite`` an existing pact
    artifact — never any other folder (a model, a home directory), which --overwrite would delete.
    The folder it goes in must be writable. Called before long work, and again by the writer;
    removes what an interrupted run left beside it."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise ArtifactError(f"output {out} already exists: pass --overwrite to replace it")
    if out.exists() and not _is_artifact(out):
        raise ArtifactError(f"output {out} exists and is not a pact artifact: --overwrite only replaces an "
                            "artifact (nothing else is deleted); choose another output folder")
    probe = out.parent / f".{out.name}.probe-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ArtifactError(f"output {out}: cannot write in {out.parent} ({e.strerror or e}): choose a writable "
                            "folder") from None
    sweep_leftovers(out)
    return out


class ArtifactWriter:
    """Writes an artifact into a temp dir beside ``out``; ``commit()`` renames it into place.

    Use as a context manager: leaving the block by an exception removes the temp dir, so
    no half-written artifact is ever left at ``out``.
    """

    def __init__(self, out: str | os.PathLike, *, overwrite: bool = False):
        import zarr

        if sys.byteorder != "little":  # chunk files are written as the tensor's native bytes
            raise ArtifactError("writing artifacts needs a little-endian machine")
        self.out = check_output(out, overwrite)
        self.overwrite = overwrite
        self.tmp = work_path(self.out, "tmp")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.root = zarr.open_group(str(self.tmp), mode="w-")
        # hf/ holds plain files; marking it a group keeps zarr's own readers from warning
        self.root.create_group(HF_DIR, attributes={"contents": "HF config, tokenizer and processor files"})
        self.tensors: dict[str, dict[str, Any]] = {}
        self.files: dict[str, str] = {}

    def __enter__(self) -> "ArtifactWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _array(self, name: str, part: str, t: torch.Tensor) -> dict[str, Any]:
        data, dtype = _to_storage(t)
        path = f"tensors/{name}/{part}"
        # zarr writes the array's metadata; the one chunk is written here, straight from
        # the tensor's memory: with codec `bytes` (little endian, no compression) the chunk
        # file is exactly those bytes, and zarr's own write would copy the array twice.
        self.root.create_array(
            path,
            shape=data.shape,
            dtype=data.dtype,
            chunks=data.shape,  # one chunk: the file is the array, mappable as is
            compressors=None,
            filters=None,
            fill_value=0,
        )
        chunk = _chunk_path(self.tmp / path, len(data.shape))
        chunk.parent.mkdir(parents=True, exist_ok=True)
        view = memoryview(np.ascontiguousarray(data)).cast("B")
        with open(chunk, "wb") as f:
            f.write(view)
        return {"path": path, "dtype": dtype, "shape": list(data.shape), "sha256": hashlib.sha256(view).hexdigest()}

    def add_nvfp4(self, name: str, fwd: NVFP4Tensor, bwd: NVFP4Tensor, **info: Any) -> None:
        """A frozen projection W [N, K]: forward layout and the backward (W^T) layout."""
        arrays = {}
        for layout, t in (("fwd", fwd), ("bwd", bwd)):
            arrays[f"{layout}_packed"] = self._array(name, f"{layout}_packed", t.packed)
            arrays[f"{layout}_scales"] = self._array(name, f"{layout}_scales", t.scales)
        self.tensors[name] = {
            **info,
            "kind": "nvfp4",
            "shape": list(fwd.shape),
            "block_size": 16,
            "global_scale": float(fwd.global_scale),
            "arrays": arrays,
        }

    def add_dense(self, name: str, t: torch.Tensor, **info: Any) -> None:
        self.tensors[name] = {
            **info,
            "kind": "dense",
            "shape": list(t.shape),
            "dtype": _TORCH_NAME[t.dtype],
            "arrays": {"data": self._array(name, "data", t)},
        }

    def remove(self, name: str) -> None:
        self.tensors.pop(name)
        shutil.rmtree(self.tmp / "tensors" / name)

    def add_file(self, src: str | os.PathLike, rel: str | None = None) -> None:
        """Copy a plain file (config, tokenizer, processor) into ``hf/``."""
        src = Path(src)
        rel = rel or src.name
        dst = self.tmp / HF_DIR / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        self.files[rel] = sha256_file(dst)

    def add_bytes(self, rel: str, data: bytes) -> None:
        """Write ``data`` as ``hf/<rel>`` (a file the writer made, e.g. a config with a part removed)."""
        dst = self.tmp / HF_DIR / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(data)
        self.files[rel] = sha256_file(dst)

    def commit(self, **meta: Any) -> Path:
        """Write the manifest and rename the temp dir to ``out`` (replacing it if allowed)."""
        manifest = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            **meta,
            "files": self.files,
            "tensors": self.tensors,
        }
        self.root.attrs["pact"] = manifest
        old = None
        if self.out.exists():
            if not self.overwrite:
                raise ArtifactError(f"output {self.out} appeared while converting: pass --overwrite")
            old = work_path(self.out, "old")
            os.rename(self.out, old)
        os.rename(self.tmp, self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.out


# --------------------------------------------------------------------------------------
# reading


def default_cache() -> Path:
    """pact's cache folder: $PACT_CACHE, else ~/.cache/pact (downloads, verified-artifact stamps)."""
    return Path(os.environ.get("PACT_CACHE", Path.home() / ".cache" / "pact"))


def _stat_key(f: Path) -> str:
    try:
        st = f.stat()
    except OSError:
        return f"{f}:missing"
    return f"{f}:{st.st_size}:{st.st_mtime_ns}"


def _chunk_path(array_dir: Path, ndim: int) -> Path:
    # default chunk key encoding, "/" separator, a single chunk: c/0/0 (2-D), c/0 (1-D)
    return array_dir.joinpath("c", *(["0"] * ndim))


# One function per old format version, each taking a manifest to the next version.
_UPGRADES: dict[int, Callable[[dict], dict]] = {}


def _upgrade(meta: dict, path: Path) -> dict:
    version = meta.get("format_version")
    if not isinstance(version, int):
        raise ArtifactError(f"{path}: manifest has no integer format_version: not a pact artifact")
    if version > FORMAT_VERSION:
        raise ArtifactError(
            f"{path}: artifact format version {version} is newer than this pact reads "
            f"(up to {FORMAT_VERSION}): upgrade pact (pip install -U pact)"
        )
    while version < FORMAT_VERSION:
        step = _UPGRADES.get(version)
        if step is None:
            raise ArtifactError(
                f"{path}: artifact format version {version} is unknown to this pact "
                f"(reads {FORMAT_VERSION}): re-run pact-convert on the source model"
            )
        log.info("upgrading artifact manifest %s from format version %d", path, version)
        meta = step(meta)
        version = meta["format_version"]
    return meta


_ENTRY_KEYS = {"kind": str, "shape": list, "arrays": dict}
_ARRAY_KEYS = {"path": str, "dtype": str, "shape": list, "sha256": str}
_NVFP4_PARTS = {f"{layout}_{p}" for layout in LAYOUTS for p in ("packed", "scales")}


def _check_manifest(meta: dict, path: Path) -> None:
    """Every key the reader relies on is there with the right type: a damaged or hand-edited
    manifest fails here, in one line naming what is wrong, not as a KeyError deep in a run."""
    def bad(what: str) -> ArtifactError:
        return ArtifactError(f"{path}/zarr.json: manifest {what}: the artifact is damaged or was not written by "
                             "pact; re-copy it or re-run pact-convert")

    for key, typ in (("tensors", dict), ("files", dict), ("hf_config", dict)):
        if not isinstance(meta.get(key), typ):
            raise bad(f"has no '{key}' {typ.__name__}")
    if not meta["tensors"]:
        raise bad("lists no tensors")
    def typed(obj: Any, keys: dict, what: str) -> None:
        if not isinstance(obj, dict):
            raise bad(f"{what} is not an object")
        for key, typ in keys.items():
            if not isinstance(obj.get(key), typ):
                raise bad(f"{what} has no '{key}' {typ.__name__}")

    for name, e in meta["tensors"].items():
        typed(e, _ENTRY_KEYS, f"entry {name!r}")
        if e["kind"] not in ("nvfp4", "dense"):
            raise bad(f"entry {name!r} has kind {e['kind']!r} (nvfp4 or dense)")
        need = _NVFP4_PARTS if e["kind"] == "nvfp4" else {"data"}
        if not need <= set(e["arrays"]):
            raise bad(f"entry {name!r} lacks arrays {sorted(need - set(e['arrays']))}")
        if e["kind"] == "nvfp4" and not isinstance(e.get("global_scale"), (int, float)):
            raise bad(f"entry {name!r} has no numeric 'global_scale'")
        for part, spec in e["arrays"].items():
            typed(spec, _ARRAY_KEYS, f"array {name}/{part}")
            if spec["dtype"] not in _STORAGE:
                raise bad(f"array {name}/{part} has dtype {spec['dtype']!r} (pact stores {', '.join(_STORAGE)})")
            if not all(isinstance(d, int) and d > 0 for d in spec["shape"]):
                raise bad(f"array {name}/{part} has shape {spec['shape']!r}")


def _inside(rel: Any, what: str, path: Path) -> None:
    """``rel`` names a place inside the artifact: a relative path without '..'."""
    if not isinstance(rel, str) or not rel or Path(rel).is_absolute() or ".." in Path(rel).parts:
        raise ArtifactError(f"{path}: {what} {rel!r} points outside the artifact: refusing it (an artifact "
                            "only names files inside its folder); re-run pact-convert on a trusted model")


def _check_contained(path: Path, meta: dict) -> None:
    """An artifact from anyone is safe to open: every path it names stays inside its folder, it
    holds no symbolic links (which could lead anywhere) and no code (nothing in it is ever run)."""
    for rel in meta.get("files", {}):
        _inside(rel, "file", path)
    for name, e in meta.get("tensors", {}).items():
        for part, spec in e.get("arrays", {}).items():
            _inside(spec.get("path") if isinstance(spec, dict) else None, f"array {name}/{part} path", path)
    for dirpath, dirnames, filenames in os.walk(path):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            if p.is_symlink():
                raise ArtifactError(f"{p}: a symbolic link inside the artifact: refusing it (links can lead "
                                    "outside the folder); copy the artifact without links (cp -rL) from a "
                                    "source you trust, or re-run pact-convert")
            if n.endswith((".py", ".pyc", ".so")):
                raise ArtifactError(f"{p}: the artifact ships code: refusing it (pact never runs code from an "
                                    "artifact); remove the file or re-run pact-convert on a trusted model")
    hf = path / HF_DIR
    for f in sorted(hf.glob("*.json")) if hf.is_dir() else []:
        try:
            doc = json.loads(f.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue  # damaged files are reported by verify() / the reader that needs them
        if isinstance(doc, dict) and "auto_map" in doc:
            raise ArtifactError(f"{f}: asks for custom code (auto_map): refusing it (pact never runs code from "
                                "an artifact); re-run pact-convert on a model that transformers supports natively")


class Artifact:
    """A read-only view of an artifact; every tensor is a zero-copy memory map of its file."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.url: str | None = None  # where it was fetched from (open_artifact of a URL)
        root_json = self.path / "zarr.json"
        if not root_json.is_file():
            raise ArtifactError(
                f"{self.path} is not a pact artifact (no zarr.json): create one with "
                f"`pact-convert MODEL {self.path}`"
            )
        try:
            root = json.loads(root_json.read_text())
            meta = root["attributes"]["pact"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ArtifactError(f"{root_json}: no pact manifest ({e!r}): re-run pact-convert") from None
        if meta.get("format") != FORMAT_NAME:
            raise ArtifactError(f"{root_json}: format is {meta.get('format')!r}, not {FORMAT_NAME!r}")
        self.meta: dict[str, Any] = _upgrade(meta, self.path)
        _check_manifest(self.meta, self.path)
        _check_contained(self.path, self.meta)
        self._maps: dict[tuple[str, str], torch.Tensor] = {}

    # -- names and metadata
    def names(self, kind: str | None = None) -> list[str]:
        """Tensor names (HF names); ``kind="nvfp4"`` for the frozen projections only."""
        return [n for n, e in self.meta["tensors"].items() if kind is None or e["kind"] == kind]

    def entry(self, name: str) -> dict[str, Any]:
        try:
            return self.meta["tensors"][name]
        except KeyError:
            raise KeyError(f"{name!r} is not in artifact {self.path}") from None

    @property
    def hf_dir(self) -> Path:
        """The folder holding config.json and the tokenizer/processor files."""
        return self.path / HF_DIR

    # -- zero-copy access
    def array(self, name: str, part: str) -> torch.Tensor:
        """One stored array as a tensor backed by a copy-on-write memory map of its file."""
        key = (name, part)
        if key not in self._maps:
            self._maps[key] = self._map(name, part)
        return self._maps[key]

    def _map(self, name: str, part: str) -> torch.Tensor:
        spec = self.entry(name)["arrays"][part]
        array_dir = self.path / spec["path"]
        try:
            zjson = json.loads((array_dir / "zarr.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ArtifactError(f"{array_dir}/zarr.json unreadable ({e}): artifact is damaged; re-copy or re-convert") from None
        shape = list(spec["shape"])
        np_dtype, torch_dtype = _STORAGE[spec["dtype"]]
        mappable = (
            zjson.get("zarr_format") == 3
            and zjson.get("shape") == shape
            and zjson.get("data_type") == np.dtype(np_dtype).name
            and zjson.get("chunk_grid", {}).get("configuration", {}).get("chunk_shape") == shape
            and zjson.get("chunk_key_encoding", {}).get("configuration", {}).get("separator", "/") == "/"
            and zjson.get("codecs") is not None
            and len(zjson["codecs"]) == 1
            and zjson["codecs"][0] in _BYTES_CODEC_OK
        )
        if not mappable:
            raise ArtifactError(
                f"{array_dir}: not a single-chunk uncompressed array of {spec['dtype']} {shape}, "
                "so it cannot be memory-mapped: re-run pact-convert to rewrite the artifact"
            )
        chunk = _chunk_path(array_dir, len(shape))
        expected = array_nbytes(spec)
        size = chunk.stat().st_size if chunk.is_file() else -1
        if size != expected:
            what = "missing" if size < 0 else f"{size} bytes, expected {expected}"
            raise ArtifactError(f"{chunk}: {what} (truncated or damaged): re-copy the artifact or re-run pact-convert")
        mm = np.memmap(chunk, dtype=np_dtype, mode="c", shape=tuple(shape))
        t = torch.from_numpy(mm)
        if torch_dtype == torch.bfloat16:
            t = t.view(torch.int16).view(torch.bfloat16)
        elif torch_dtype != t.dtype:
            t = t.view(torch_dtype)
        return t

    def nvfp4(self, name: str, layout: str = "fwd") -> NVFP4Tensor:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        e = self.entry(name)
        if e["kind"] != "nvfp4":
            raise ValueError(f"{name} is stored dense ({e['dtype']}), not NVFP4")
        g = torch.tensor(e["global_scale"], dtype=torch.float32)
        return NVFP4Tensor(self.array(name, f"{layout}_packed"), self.array(name, f"{layout}_scales"), g)

    def dense(self, name: str) -> torch.Tensor:
        return self.array(name, "data")

    def dequantize(self, name: str, layout: str = "fwd") -> torch.Tensor:
        """The float32 effective weight: shaped like the source for "fwd", transposed for "bwd"."""
        e = self.entry(name)
        if e["kind"] == "dense":
            t = self.dense(name).float()
            return t.t() if layout == "bwd" else t
        return _dequantize(self.nvfp4(name, layout))

    def verify(self) -> int:
        """Recompute every checksum; raise ArtifactError naming the first bad file. Returns bytes read."""
        total = 0
        for name, e in self.meta["tensors"].items():
            for part, spec in e["arrays"].items():
                chunk = _chunk_path(self.path / spec["path"], len(spec["shape"]))
                self._map(name, part)  # shape/size/layout checks first
                if sha256_file(chunk) != spec["sha256"]:
                    raise ArtifactError(
                        f"{chunk}: checksum mismatch (corrupted): re-copy the artifact or re-run pact-convert"
                    )
                total += chunk.stat().st_size
        for rel, digest in self.meta["files"].items():
            f = self.hf_dir / rel
            if not f.is_file() or sha256_file(f) != digest:
                raise ArtifactError(f"{f}: missing or checksum mismatch: re-copy the artifact or re-run pact-convert")
            total += f.stat().st_size
        return total

    def fingerprint(self) -> str:
        """sha256 over the manifest's tensors and files, which carry every stored byte's sha256: two
        artifacts with the same fingerprint hold the same data (once verified)."""
        doc = json.dumps({"tensors": self.meta["tensors"], "files": self.meta["files"]}, sort_keys=True)
        return hashlib.sha256(doc.encode()).hexdigest()

    def _stamp(self) -> str:
        """The fingerprint plus every data file's size and modification time."""
        parts = [self.fingerprint()]
        for e in self.meta["tensors"].values():
            for spec in e["arrays"].values():
                parts.append(_stat_key(_chunk_path(self.path / spec["path"], len(spec["shape"]))))
        parts += [_stat_key(self.hf_dir / rel) for rel in self.meta["files"]]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()

    def verify_cached(self, cache_dir: str | os.PathLike | None) -> bool:
        """``verify()``, skipped when this artifact verified before with every file unchanged (same
        fingerprint, sizes and modification times; the stamp is kept in ``cache_dir``). Returns
        whether the full check ran. ``cache_dir`` None: always verify."""
        stamp = self._stamp()
        marker = Path(cache_dir) / "verified" / stamp if cache_dir is not None else None
        if marker is not None and marker.is_file():
            return False
        self.verify()
        if marker is not None:
            try:
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.write_text(str(self.path.resolve()) + "\n")
            except OSError as e:  # a read-only cache costs a re-verify next time, nothing else
                log.warning("could not record the verified artifact in %s (%s)", marker.parent, e)
        return True

    def __repr__(self) -> str:
        n = len(self.names("nvfp4"))
        return f"Artifact({str(self.path)!r}, {self.meta.get('architecture')}, {n} NVFP4 projections)"


def open_artifact(path: str | os.PathLike) -> Artifact:
    """The artifact in a local folder, or at a URL (http(s)://, s3://, hf://, file://: fetched into
    the cache first and checked on the way in; formats/remote.py)."""
    if isinstance(path, str) and "://" in path:
        from .remote import fetch_artifact

        art = Artifact(fetch_artifact(path))
        art.url = path
        return art
    return Artifact(path)
