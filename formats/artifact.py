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

import functools
import hashlib
import itertools
import json
import logging
import math
import os
import re
import shutil
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from .errors import ArtifactError, PactError
from .families import PROJECTIONS, check_config, classify, family_of, text_config
from .files import (  # noqa: F401 (re-exported: pact.formats.artifact.<helper> keeps working)
    JSON_DEPTH,
    JSON_MAX,
    check_regular,
    default_cache,
    pid_alive,
    read_json,
    recover_aside,
    replace_by_rename,
    save_safetensors,
    sha256_file,
    sweep_leftovers,
    tree_entries,
    work_path,
)
from .layout import (  # noqa: F401
    _STORAGE,
    _TORCH_NAME,
    FORMAT_NAME,
    FORMAT_VERSION,
    HF_DIR,
    LAYOUTS,
    SIDE_FILES,
    array_nbytes,
)
from .layout import is_artifact as _is_artifact
from .nvfp4 import BLOCK, SCALE_RULES, SCALINGS, NVFP4Tensor
from .nvfp4 import dequantize as _dequantize

log = logging.getLogger(__name__)


_NBYTES_MAX = 2**62  # an array larger than this is no model's (and would overflow int64 offsets)
# names what verify() checks: a stamp from a pact whose verify() checked less (before the scan for
# non-finite values) does not let an artifact skip the current checks
_VERIFY_CHECKS = "sha256+non-finite"
_BYTES_CODEC_OK = ({"name": "bytes"}, {"name": "bytes", "configuration": {"endian": "little"}})


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


def check_output(out: str | os.PathLike, overwrite: bool) -> Path:
    """Where an artifact may be written: a new path, or with ``overwrite`` an existing pact
    artifact — never any other folder (a model, a home directory), which --overwrite would delete.
    The folder it goes in must be writable. Called before long work, and again by the writer;
    removes what an interrupted run left beside it."""
    out = Path(out)
    check_outside_artifacts(out, "output", ArtifactError)
    recover_aside(out, "the artifact", _is_artifact)  # (a run killed between its two renames left it aside)
    if out.exists() and not overwrite:
        raise ArtifactError(f"output {out} already exists: pass --overwrite to replace it")
    if out.exists():
        check_replaceable(out, "--overwrite", ArtifactError)
    check_writable(out, "output", ArtifactError)
    sweep_leftovers(out)
    return out


def check_outside_artifacts(out: Path, label: str, error: type[PactError] = PactError) -> None:
    """``out`` is not inside an artifact (resolved: links and '..' do not hide it): an artifact holds only
    what its manifest lists, and a folder written into one makes it refuse --overwrite and pact-push."""
    for above in Path(out).resolve().parents:
        if (above / "zarr.json").is_file() and _is_artifact(above):
            raise error(f"{label} {out} is inside the artifact {above}: choose a folder outside it")


def check_writable(out: Path, label: str, error: type[PactError] = PactError) -> None:
    """The folder ``out`` goes in can be made and written (a probe file), said before long work, naming
    ``out`` (``label``: how the user gave it), never a temp path of ours."""
    probe = out.parent / f".{out.name}.probe-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise error(f"{label} {out}: cannot write in {out.parent} ({e.strerror or e}): choose a writable "
                    "folder") from None


_OS_FILES = (".DS_Store", "Thumbs.db", "desktop.ini")  # what file browsers leave: nobody's data


def check_replaceable(out: Path, flag: str, error: type[PactError] = PactError) -> None:
    """``out`` may be replaced (``flag`` asks for it): a pact artifact holding only what its manifest
    lists. A folder that is not an artifact, or an artifact a user keeps other files in (notes, a
    training run), is refused: replacing it would delete them."""
    from .remote import _plan

    if not _is_artifact(out):
        raise error(f"output {out} exists and is not a pact artifact: {flag} only replaces an artifact (nothing "
                    "else is deleted); choose another output folder")
    try:
        meta = read_json(out / "zarr.json", "", error)["attributes"]["pact"]
        listed = {rel for rel, _, _ in _plan(meta)} | {"zarr.json", "tensors/zarr.json"}
    except (PactError, KeyError, TypeError):
        raise error(f"output {out}: its manifest cannot be read, so what {flag} would delete cannot be told; "
                    "remove the folder yourself or choose another output folder") from None
    extra = []
    for dirpath, dirnames, filenames in os.walk(out):
        for n in filenames + [d for d in dirnames if (Path(dirpath) / d).is_symlink()]:
            rel = (Path(dirpath) / n).relative_to(out).as_posix()
            if rel not in listed and n not in _OS_FILES:
                extra.append(rel)
    if extra:
        shown = ", ".join(sorted(extra)[:3]) + (f" and {len(extra) - 3} more" if len(extra) > 3 else "")
        raise error(f"output {out} is an artifact that also holds files its manifest does not list ({shown}): "
                    f"{flag} would delete them; move them out of it, or choose another output folder")


def check_apart(out: str | os.PathLike, sources: dict[str, Path], tool: str) -> None:
    """``out`` is not one of ``sources`` (what ``tool`` reads: an artifact, an adapter run), nor inside
    one, nor holding one (resolved paths: links and '..' do not hide it): writing or replacing it
    would delete the tool's own input, or nest an output inside it."""
    o = Path(out).resolve()
    for what, src in sources.items():
        s = Path(src).resolve()
        if o == s or o.is_relative_to(s) or s.is_relative_to(o):
            how = "is" if o == s else "is inside" if o.is_relative_to(s) else "holds"
            raise ArtifactError(f"--out {out} {how} the {what} {src}: {tool} never writes over or into what it "
                                "reads; choose an --out outside it")


@functools.cache
def _zarr_json(shape: tuple[int, ...] | None, dtype: np.dtype | None) -> bytes:
    """The zarr.json zarr itself writes for a one-chunk uncompressed array of ``shape`` and ``dtype``
    (None: for a group), made in a memory store."""
    import zarr
    from zarr.storage import MemoryStore

    files: dict = {}
    if shape is None:
        zarr.open_group(store=MemoryStore(store_dict=files), mode="w-")
    else:
        zarr.create_array(store=MemoryStore(store_dict=files), shape=shape, dtype=dtype, chunks=shape,
                          compressors=None, filters=None, fill_value=0)
    return files["zarr.json"].to_bytes()


def _write_chunk(chunk: Path, data: np.ndarray) -> str:
    """One array's chunk file (exactly its bytes: codec `bytes`, no compression) -> its sha256."""
    view = memoryview(np.ascontiguousarray(data)).cast("B")
    with open(chunk, "wb") as f:
        f.write(view)
    return hashlib.sha256(view).hexdigest()


class ArtifactWriter:
    """Writes an artifact into a temp dir beside ``out``; ``commit()`` renames it into place.

    Use as a context manager: leaving the block by an exception removes the temp dir, so
    no half-written artifact is ever left at ``out``.

    Chunk files are written and hashed by background threads (file writes and sha256 release the
    GIL) while the caller produces the next tensor; at most ``PENDING_BYTES`` wait at a time. The
    writer keeps a reference to each tensor it is given: callers must not change one in place after
    handing it over. ``commit()`` waits for every chunk and raises the first write error.
    """

    PENDING_BYTES = 1 << 29  # chunk bytes queued for the writer threads before add_* waits

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
        self._groups: set[str] = set()  # group folders whose zarr.json is written
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pact-writer")
        self._pending: list[tuple[dict[str, Any], Future, int]] = []  # (array entry, its sha256, bytes)

    def __enter__(self) -> "ArtifactWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            for _, fut, _ in self._pending:  # no thread may still write into what is removed
                fut.cancel()
            self._pool.shutdown(wait=True)
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _drain(self, keep_bytes: int = 0) -> None:
        """Wait for queued chunks, oldest first, until at most ``keep_bytes`` are queued; each
        finished chunk's sha256 goes into its entry (a write error is raised here)."""
        queued = sum(n for _, _, n in self._pending)
        while self._pending and queued > keep_bytes:
            entry, fut, n = self._pending.pop(0)
            entry["sha256"] = fut.result()
            queued -= n

    def _array(self, name: str, part: str, t: torch.Tensor) -> dict[str, Any]:
        data, dtype = _to_storage(t)
        path = f"tensors/{name}/{part}"
        # The array's metadata is zarr's own (made once per shape and dtype in memory, then written as
        # a file; zarr's create_array per array costs ~7 ms of its event loop). The one chunk is
        # written straight from the tensor's memory: with codec `bytes` (little endian, no
        # compression) the chunk file is exactly those bytes.
        for group in ("tensors", f"tensors/{name}"):
            if group not in self._groups:
                (self.tmp / group).mkdir(parents=True, exist_ok=True)
                (self.tmp / group / "zarr.json").write_bytes(_zarr_json(None, None))
                self._groups.add(group)
        chunk = _chunk_path(self.tmp / path, len(data.shape))
        chunk.parent.mkdir(parents=True, exist_ok=True)
        (self.tmp / path / "zarr.json").write_bytes(_zarr_json(data.shape, data.dtype))
        entry = {"path": path, "dtype": dtype, "shape": list(data.shape), "sha256": None}
        self._drain(self.PENDING_BYTES - data.nbytes)
        self._pending.append((entry, self._pool.submit(_write_chunk, chunk, data), data.nbytes))
        return entry

    def add_nvfp4(self, name: str, fwd: NVFP4Tensor, bwd: NVFP4Tensor,
                  correction: tuple[torch.Tensor, torch.Tensor] | None = None, **info: Any) -> None:
        """A frozen projection W [N, K]: forward layout and the backward (W^T) layout; ``correction``
        (U [N, R], V [R, K], stored bf16): the weight the model computes with is dequantize(fwd) + U V."""
        arrays = {}
        for layout, t in (("fwd", fwd), ("bwd", bwd)):
            arrays[f"{layout}_packed"] = self._array(name, f"{layout}_packed", t.packed)
            arrays[f"{layout}_scales"] = self._array(name, f"{layout}_scales", t.scales)
        if correction is not None:
            for part, t in zip(("corr_u", "corr_v"), correction):
                arrays[part] = self._array(name, part, t.to(torch.bfloat16).contiguous())
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
        self._drain()
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
        self._drain()
        self._pool.shutdown(wait=True)
        manifest = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            **meta,
            "files": self.files,
            "tensors": self.tensors,
        }
        self.root.attrs["pact"] = manifest
        if self.out.exists() and not self.overwrite:
            raise ArtifactError(f"output {self.out} appeared while converting: pass --overwrite")
        replace_by_rename(self.tmp, self.out)
        return self.out


# --------------------------------------------------------------------------------------
# reading


def _stat_key(f: Path) -> str:
    """What says a file is the one verified: its size and modification time, and its inode and change time,
    which a write with the modification time put back (os.utime, cp -p over it) cannot restore."""
    try:
        st = f.stat()
    except OSError:
        return f"{f}:missing"
    return f"{f}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_ctime_ns}"


def _get(doc: Any, *keys: str, default: Any = None) -> Any:
    """doc[k1][k2]... where every level is an object, else ``default`` (a crafted zarr.json)."""
    for k in keys:
        if not isinstance(doc, dict) or k not in doc:
            return default
        doc = doc[k]
    return doc


def _non_finite(block: bytes, dtype: str) -> int:
    """How many values in ``block`` (raw little-endian bytes of ``dtype``) are NaN (or Inf)."""
    if dtype == "float8_e4m3fn":  # E4M3 (fn) has no Inf; NaN is S.1111.111
        return int(np.count_nonzero((np.frombuffer(block, np.uint8) & 0x7F) == 0x7F))
    if dtype == "bfloat16":  # exponent all ones: Inf or NaN
        return int(np.count_nonzero((np.frombuffer(block, np.uint16) & 0x7F80) == 0x7F80))
    if dtype == "float32":
        return int(np.count_nonzero(~np.isfinite(np.frombuffer(block, np.float32))))
    return 0


def _scan(chunk: Path, dtype: str, block: int = 1 << 24) -> tuple[str, int]:
    """A chunk file's sha256 and its count of non-finite values, in one read (blocks are a multiple
    of every item size)."""
    h, bad = hashlib.sha256(), 0
    with open(chunk, "rb") as f:
        while data := f.read(block):
            h.update(data)
            bad += _non_finite(data, dtype)
    return h.hexdigest(), bad


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


_ENTRY_KEYS = {"kind": str, "role": str, "shape": list, "arrays": dict}
_ARRAY_KEYS = {"path": str, "dtype": str, "shape": list, "sha256": str}
_NVFP4_PARTS = {f"{layout}_{p}" for layout in LAYOUTS for p in ("packed", "scales")}
CORRECTION_MAX_RANK = 1024  # a low-rank correction's rank bound (pact-calibrate --correct-rank; used: 16-64)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_FP32_MAX = float(np.finfo(np.float32).max)
# dense tensors the runtime binds by role: their rank (a 3-D norm would fail deep in the forward)
_DENSE_NDIM = {"norm": 1, "bias": 1, "embedding": 2, "lm_head": 2, **{p: 2 for p in PROJECTIONS}}
_MAX_NDIM = 5  # the vision tower's Conv3d patch embedding is the largest rank a supported model stores


def _nvfp4_arrays(n: int, k: int) -> dict[str, tuple[str, list[int]]]:
    """What an NVFP4 projection W [N, K] stores: per layout, packed E2M1 codes (two a byte) and one
    E4M3 scale per 16 values along the contraction dim; the backward layout is W^T [K, N]."""
    return {"fwd_packed": ("uint8", [n, k // 2]), "fwd_scales": ("float8_e4m3fn", [n, k // BLOCK]),
            "bwd_packed": ("uint8", [k, n // 2]), "bwd_scales": ("float8_e4m3fn", [k, n // BLOCK])}


def _is_shape(shape: Any) -> bool:
    return isinstance(shape, list) and len(shape) <= _MAX_NDIM and all(
        isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_manifest(meta: dict, path: Path) -> None:
    """Every key the reader and the tools rely on is there with the right type, and every array is
    what its tensor's role stores (dtype, shape, byte count): a damaged, hand-edited or crafted
    manifest fails here, in one line naming what is wrong, not as a KeyError deep in a run or as
    bytes silently read as another type."""
    def bad(what: str) -> ArtifactError:
        return ArtifactError(f"{path}/zarr.json: manifest {what}: the artifact is damaged or was not written by "
                             "pact; re-copy it or re-run pact-convert")

    _check_top(meta, bad)
    for name, e in meta["tensors"].items():
        _check_entry(name, e, bad)


def _check_top(meta: dict, bad: Callable[[str], ArtifactError]) -> None:
    for key, typ in (("tensors", dict), ("files", dict), ("hf_config", dict), ("provenance", dict),
                     ("family", str), ("vision", bool)):
        if not isinstance(meta.get(key), typ):
            raise bad(f"has no '{key}' {typ.__name__}")
    if not isinstance(meta.get("architecture"), (str, type(None))):
        raise bad(f"has 'architecture' {meta['architecture']!r}, not a name")
    if not meta["tensors"]:
        raise bad("lists no tensors")
    for rel, digest in meta["files"].items():
        if not isinstance(digest, str) or not _SHA256.match(digest):
            raise bad(f"file {rel!r} has sha256 {digest!r}")
    prov = meta["provenance"]
    for key, ok, want in (("scaling", lambda v: v in SCALINGS, " or ".join(SCALINGS)),
                          ("source", lambda v: isinstance(v, str), "a name")):
        if not ok(prov.get(key)):
            raise bad(f"provenance has '{key}' {prov.get(key)!r} ({want})")
    for key, ok, want in (("block_scales", lambda v: v in SCALE_RULES, " or ".join(SCALE_RULES)),
                          ("kept_bf16", lambda v: isinstance(v, list), "a list"),
                          ("source_quantization", lambda v: isinstance(v, dict), "an object"),
                          ("source_sha256", lambda v: isinstance(v, str) and bool(_SHA256.match(v)), "a sha256"),
                          ("calibration", lambda v: isinstance(v, dict), "an object")):
        if key in prov and not ok(prov[key]):
            raise bad(f"provenance has '{key}' {prov[key]!r} ({want})")


def _check_keys(what: str, obj: Any, keys: dict, bad: Callable[[str], ArtifactError]) -> None:
    """``obj`` is an object holding each of ``keys`` with its type."""
    if not isinstance(obj, dict):
        raise bad(f"{what} is not an object")
    for key, typ in keys.items():
        if not isinstance(obj.get(key), typ):
            raise bad(f"{what} has no '{key}' {typ.__name__}")


def _check_entry(name: str, e: Any, bad: Callable[[str], ArtifactError]) -> None:
    what = f"entry {name!r}"
    _check_keys(what, e, _ENTRY_KEYS, bad)
    if e["kind"] not in ("nvfp4", "dense"):
        raise bad(f"{what} has kind {e['kind']!r} (nvfp4 or dense)")
    r = classify(name)
    if e["role"] != r.role or e.get("layer") != r.layer or e.get("group", r.group) != r.group:
        raise bad(f"{what} has role {e['role']!r}, layer {e.get('layer')!r}, group {e.get('group')!r}, but its "
                  f"name makes it {r.role!r}, {r.layer!r}, {r.group!r}")
    if not _is_shape(e["shape"]):
        raise bad(f"{what} has shape {e['shape']!r} (at most {_MAX_NDIM} positive integers)")
    for part, spec in e["arrays"].items():
        _check_array(name, part, spec, bad)
    if e["kind"] == "nvfp4":
        _check_nvfp4_entry(name, e, bad)
    else:
        _check_dense_entry(name, e, bad)


def _check_array(name: str, part: str, spec: Any, bad: Callable[[str], ArtifactError]) -> None:
    what = f"array {name}/{part}"
    _check_keys(what, spec, _ARRAY_KEYS, bad)
    if spec["dtype"] not in _STORAGE:
        raise bad(f"{what} has dtype {spec['dtype']!r} (pact stores {', '.join(_STORAGE)})")
    if not _is_shape(spec["shape"]):
        raise bad(f"{what} has shape {spec['shape']!r}")
    if array_nbytes(spec) > _NBYTES_MAX:
        raise bad(f"{what} has shape {spec['shape']!r}: {array_nbytes(spec)} bytes, more than any model's "
                  "array (the byte count overflows int64)")
    if not _SHA256.match(spec["sha256"]):
        raise bad(f"{what} has sha256 {spec['sha256']!r}")


def _check_nvfp4_entry(name: str, e: dict, bad: Callable[[str], ArtifactError]) -> None:
    what, shape = f"entry {name!r}", e["shape"]
    if e["role"] not in PROJECTIONS:
        raise bad(f"{what} is stored NVFP4 but is a {e['role']}, not a frozen projection")
    if len(shape) != 2 or shape[0] % BLOCK or shape[1] % BLOCK:
        raise bad(f"{what} is NVFP4 of shape {shape}: a projection is [N, K] with both divisible by {BLOCK}")
    want = _nvfp4_arrays(*shape)
    corr = e["arrays"].get("corr_u"), e["arrays"].get("corr_v")
    if all(isinstance(c, dict) for c in corr):  # a low-rank correction (pact-calibrate --correct-rank): [N, R], [R, K]
        r = corr[0]["shape"][-1] if len(corr[0]["shape"]) == 2 else 0
        if not 1 <= r <= min(CORRECTION_MAX_RANK, *shape):
            raise bad(f"{what} has a correction of rank {r} (1 to {min(CORRECTION_MAX_RANK, *shape)})")
        want = {**want, "corr_u": ("bfloat16", [shape[0], r]), "corr_v": ("bfloat16", [r, shape[1]])}
    if set(e["arrays"]) != set(want):
        raise bad(f"{what} has arrays {sorted(e['arrays'])}, not {sorted(want)}")
    for part, (dtype, ashape) in want.items():
        spec = e["arrays"][part]
        if (spec["dtype"], spec["shape"]) != (dtype, ashape):
            raise bad(f"array {name}/{part} is {spec['dtype']} {spec['shape']}, where an NVFP4 [N, K] = {shape} "
                      f"stores {dtype} {ashape}")
    g = e.get("global_scale")
    if not _is_number(g) or not 0 < g <= _FP32_MAX:  # NaN fails both comparisons
        raise bad(f"{what} has global_scale {g!r} (a finite float32 > 0)")
    if e.get("block_size", BLOCK) != BLOCK or e.get("scaling", SCALINGS[0]) not in SCALINGS:
        raise bad(f"{what} has block_size {e.get('block_size')!r} / scaling {e.get('scaling')!r} "
                  f"({BLOCK}; {' or '.join(SCALINGS)})")


def _check_dense_entry(name: str, e: dict, bad: Callable[[str], ArtifactError]) -> None:
    what, shape = f"entry {name!r}", e["shape"]
    ndim = _DENSE_NDIM.get(e["role"])
    if ndim is not None and len(shape) != ndim:
        raise bad(f"{what} is a {e['role']} of shape {shape}: a {e['role']} has {ndim} dimension(s)")
    if set(e["arrays"]) != {"data"}:
        raise bad(f"{what} has arrays {sorted(e['arrays'])}, not ['data']")
    spec = e["arrays"]["data"]
    if (e.get("dtype"), spec["dtype"], spec["shape"]) != ("bfloat16", "bfloat16", shape):
        raise bad(f"array {name}/data is {spec['dtype']} {spec['shape']} (entry dtype {e.get('dtype')!r}), where a "
                  f"dense tensor of shape {shape} stores bfloat16 {shape}")


def _inside(rel: Any, what: str, path: Path) -> None:
    """``rel`` names a place inside the artifact: a relative path without '..'."""
    if (not isinstance(rel, str) or not rel or Path(rel).is_absolute() or ".." in Path(rel).parts
            or "\0" in rel or "\\" in rel):  # (a NUL no path holds; a backslash a separator elsewhere)
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
            if spec["path"] != f"tensors/{name}/{part}":  # where the writer puts it: no array read as another's
                raise ArtifactError(f"{path}/zarr.json: manifest array {name}/{part} has path {spec['path']!r}, not "
                                    f"tensors/{name}/{part}: the artifact is damaged or was not written by pact; "
                                    "re-copy it or re-run pact-convert")
    def unlistable(folder: str, e: OSError) -> None:  # (a folder that cannot be listed cannot be checked)
        raise ArtifactError(f"{folder}: cannot be listed ({e.strerror or e}): make the artifact readable "
                            "(chmod -R u+rX) or re-copy it") from None

    hf = path / HF_DIR
    below_hf = f"{hf}{os.sep}"
    listed = set(meta.get("files", {}))
    for d in tree_entries(path, unlistable):
        p = Path(d.path)
        if d.is_symlink():
            raise ArtifactError(f"{p}: a symbolic link inside the artifact: refusing it (links can lead "
                                "outside the folder); re-copy the artifact from a source you trust, or re-run "
                                "pact-convert (a copy that follows links, cp -rL, takes in whatever they lead to)")
        if not d.is_dir(follow_symlinks=False) and not d.is_file(follow_symlinks=False):  # a pipe, device, socket
            check_regular(p, d.stat(follow_symlinks=False).st_mode,
                          "remove it, or re-copy the artifact from a source you trust")
        if d.name.endswith((".py", ".pyc", ".so")):
            raise ArtifactError(f"{p}: the artifact ships code: refusing it (pact never runs code from an "
                                "artifact); remove the file or re-run pact-convert on a trusted model")
        if d.path.startswith(below_hf) and d.is_file(follow_symlinks=False):  # transformers reads them whole
            _check_hf_size(p, d.stat(follow_symlinks=False).st_size)
            rel = p.relative_to(hf).as_posix()
            hidden = any(part.startswith(".") for part in rel.split("/"))  # (.ipynb_checkpoints/: no reader's)
            if rel not in listed and rel != "zarr.json" and d.name not in _OS_FILES and not hidden:
                raise ArtifactError(f"{p}: a file in hf/ the manifest does not list (no checksum covers it, yet "
                                    "transformers would read it: a tokenizer or config changed unseen); remove it, "
                                    "or re-copy the artifact or re-run pact-convert")
    if hf.is_dir():
        _check_hf(hf)


# transformers passes these files' keys to the tokenizer as arguments, and opens a file one names as written
# (joined onto hf/, or from the working directory: '..' and absolute paths included)
_TOKENIZER_ARGS = ("tokenizer_config.json", "special_tokens_map.json")
# tokenizer_config.json keys that transformers replaces with the folder's own file (old saves hold absolute paths)
_REPLACED_FILE_KEYS = frozenset({"tokenizer_file", "special_tokens_map_file", "added_tokens_file",
                                 "tokenizer_config_file", "chat_template_file"})


_CRAFTED = "the artifact is damaged or crafted; re-copy it or re-run pact-convert"
ADDED_TOKENS = 16384  # added tokens one hf/ file may list (supported families: up to a few thousand)
SPECIAL_TOKENS = 512  # special tokens they may name together (*_token keys, extra/additional special lists)


def _added_tokens(name: str, doc: Any) -> tuple[int, int]:
    """(added, special) tokens an hf/ JSON file lists for transformers to walk at load."""
    if not isinstance(doc, dict):
        return 0, 0
    if name == "tokenizer.json":
        return (len(doc["added_tokens"]) if isinstance(doc.get("added_tokens"), list) else 0), 0
    if name == "added_tokens.json":
        return len(doc), 0
    if name not in _TOKENIZER_ARGS:
        return 0, 0
    added = len(doc["added_tokens_decoder"]) if isinstance(doc.get("added_tokens_decoder"), dict) else 0
    special = sum(len(doc[k]) for k in ("extra_special_tokens", "additional_special_tokens")
                  if isinstance(doc.get(k), (list, dict)))
    return added, special + sum(k.endswith("_token") for k in doc)


def _check_hf_size(f: Path, size: int) -> None:
    if size > JSON_MAX:  # pact-convert ships no larger side file
        raise ArtifactError(f"{f}: {size} bytes, more than the {JSON_MAX} bytes a config, tokenizer or "
                            f"chat template file may hold (transformers reads it whole): {_CRAFTED}")


def _check_hf(hf: Path) -> None:
    """The hf/ files transformers reads, safe to read (each of bounded size, `_check_hf_size` in the walk
    above: it reads tokenizer, template and vocabulary files whole, and a 3 GiB sparse chat_template.jinja
    took 6 GiB of memory), each JSON one parsed once here (a damaged one is one line now, not a traceback
    in transformers later), none asking for code or naming a file for the tokenizer to open (a tokenizer
    read from outside the artifact, any host file)."""
    fix = _CRAFTED

    def file_key(doc: Any, top: bool) -> str | None:
        for k, v in doc.items() if isinstance(doc, dict) else ():
            if v is not None and (k.endswith(("_file", "_files")) or k in ("vocab", "merges") and top):
                if not (top and k in _REPLACED_FILE_KEYS):
                    return k
            if isinstance(v, dict) and (k := file_key(v, False)):  # sp_model_kwargs: {model_file: ...}
                return k
        return None

    added = special = 0
    for f in sorted(hf.glob("*.json")):
        if f.name.startswith("."):  # (hidden: listed by no manifest, read by no reader)
            continue
        doc = read_json(f, fix)
        if isinstance(doc, dict) and "auto_map" in doc:
            raise ArtifactError(f"{f}: asks for custom code (auto_map): refusing it (pact never runs code from "
                                "an artifact); re-run pact-convert on a model that transformers supports natively")
        a, sp = _added_tokens(f.name, doc)
        added, special = max(added, a), special + sp  # (tokenizer.json and the config list the same added ones)
        if added > ADDED_TOKENS or special > SPECIAL_TOKENS:
            raise ArtifactError(f"{f}: lists {added} added tokens, or hf/'s files {special} special tokens so far, "
                                f"more than {ADDED_TOKENS} / {SPECIAL_TOKENS} (transformers adds them one by one, "
                                "each checked against those before it: 64,000 took 20 s to load, 4,000 special tokens "
                                f"beside 4,000 added ones 15 s; real tokenizers: a few thousand / a few dozen); {fix}")
        if f.name in _TOKENIZER_ARGS and (key := file_key(doc, f.name == "tokenizer_config.json")):
            raise ArtifactError(f"{f}: '{key}' names a file for the tokenizer to open: refusing it (transformers "
                                "opens it as written, outside the artifact too; the tokenizer's files are hf/'s "
                                f"own); {fix} from a source without the key")


# --------------------------------------------------------------------------------------
# the config the runtime builds the model from


def _config_error(source: str, key: str, value: Any, why: str) -> PactError:
    return PactError(f"{source}: '{key}' is {value!r}, {why}: the config does not describe this model; restore "
                     "the model's own config.json")


def _text_sizes(tc: dict, source: str) -> dict[str, int | None]:
    """The sizes the forward is built from, each valid: optional sizes positive integers, epsilons and
    RoPE bases finite and > 0, head counts that divide (check_config has checked the required ones)."""
    for key in ("num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):
        v = tc.get(key)
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            raise _config_error(source, key, v, "not a positive integer")
    for key in ("rope_parameters", "rope_scaling"):
        if tc.get(key) is not None and not isinstance(tc[key], dict):
            raise _config_error(source, key, tc[key], "not an object")
    rope = tc.get("rope_parameters") or {}
    for key, v in (("rms_norm_eps", tc.get("rms_norm_eps")), ("rope_theta", tc.get("rope_theta")),
                   ("rope_parameters.rope_theta", rope.get("rope_theta"))):
        if v is not None and not (_is_number(v) and 0 < v < math.inf):
            raise _config_error(source, key, v, "not a finite number > 0")
    h, nh = tc["hidden_size"], tc["num_attention_heads"]
    hd = tc.get("head_dim")
    if hd is None and h % nh:
        raise _config_error(source, "num_attention_heads", nh,
                            f"which does not divide hidden_size {h} (no head_dim given)")
    hd = hd or h // nh
    if hd % 2:
        raise _config_error(source, "head_dim", hd, "odd (RoPE rotates pairs of dimensions)")
    nkv = tc.get("num_key_value_heads") or nh
    if nh % nkv:
        raise _config_error(source, "num_key_value_heads", nkv, f"which does not divide num_attention_heads {nh}")
    return {"hidden_size": h, "heads": nh, "kv_heads": nkv, "head_dim": hd,
            "intermediate_size": tc["intermediate_size"], "vocab_size": tc.get("vocab_size")}


def _expected_shape(name: str, shapes: dict, z: dict[str, int | None]) -> tuple[list[int], str] | None:
    """The shape the config gives tensor ``name`` and the keys it comes from; None where it gives none."""
    h, q, kv, i = z["hidden_size"], z["heads"] * z["head_dim"], z["kv_heads"] * z["head_dim"], z["intermediate_size"]
    heads, kv_heads = "num_attention_heads x head_dim", "num_key_value_heads x head_dim"
    projections = {"q_proj": ([q, h], f"{heads}, hidden_size"), "k_proj": ([kv, h], f"{kv_heads}, hidden_size"),
                   "v_proj": ([kv, h], f"{kv_heads}, hidden_size"), "o_proj": ([h, q], f"hidden_size, {heads}"),
                   "gate_proj": ([i, h], "intermediate_size, hidden_size"),
                   "up_proj": ([i, h], "intermediate_size, hidden_size"),
                   "down_proj": ([h, i], "hidden_size, intermediate_size")}
    r = classify(name)
    if r.role in projections:
        return projections[r.role]
    if r.role == "bias" and name.split(".")[-2] in projections:
        (rows, _), keys = projections[name.split(".")[-2]]
        return [rows], keys.split(", ")[0]
    if r.role in ("embedding", "lm_head") and len(shapes[name]) == 2:
        v = z.get("vocab_size")  # a table far larger than the vocabulary is memory a crafted artifact would cost;
        if v and shapes[name][0] > v + max(v // 8, 128):  # (real tables pad the vocabulary by far less)
            return [v, h], "vocab_size, hidden_size"
        return [shapes[name][0], h], "hidden_size"  # rows: the vocabulary (the tokenizer is checked at load)
    if r.role == "norm":
        per_head = name.endswith(("q_norm.weight", "k_norm.weight"))  # Qwen3: RMSNorm over each head
        return ([z["head_dim"]], "head_dim") if per_head else ([h], "hidden_size")
    return None


def check_config_shapes(config: Any, shapes: dict[str, list[int]], source: str) -> None:
    """A (text) config the forward can be built from, fitting the weights: families.check_config
    (required sizes, layer count), then every size valid and every decoder tensor the shape its
    config keys give. ``shapes``: tensor name -> shape. Raises PactError naming the key."""
    if not isinstance(config, dict) or not isinstance(text_config(config), dict):
        raise PactError(f"{source}: not a JSON object of the model's sizes: restore the model's own config.json")
    n = text_config(config).get("num_hidden_layers")
    if isinstance(n, int) and n > len(shapes):  # before check_config builds range(n)
        raise PactError(f"{source}: num_hidden_layers is {n} but the weights hold {len(shapes)} tensors: the config "
                        "does not match the weights; restore the model's own config.json")
    check_config(config, shapes, source)
    sizes = _text_sizes(text_config(config), source)
    for name, shape in shapes.items():
        want = _expected_shape(name, shapes, sizes)
        if want is not None and list(shape) != want[0]:
            raise PactError(f"{source}: {name} is {list(shape)} but the config's {want[1]} give {want[0]} "
                            f"({', '.join(f'{k} {v}' for k, v in sizes.items())}): the config does not match the "
                            "weights; restore the model's own config.json")


def _not_an_artifact(path: Path) -> str:
    """Why ``path`` is not an artifact, and the fix: it does not exist (convert into it), it is a folder
    that holds artifacts one level down (name one of them), or something else (convert into a new one)."""
    if not path.exists():
        return f"{path}: no such artifact folder: create one with `pact-convert MODEL {path}`"

    def is_file(p: Path) -> bool:
        try:
            return p.is_file()
        except OSError:  # unreadable: not counted
            return False

    try:
        entries = list(itertools.islice(path.iterdir(), 1000)) if path.is_dir() else []
    except OSError:
        entries = []
    inside = sorted(str(c) for c in entries if is_file(c / "zarr.json"))[:5]
    if inside:
        return (f"{path} is not a pact artifact (no zarr.json) but holds {'some' if len(inside) > 1 else 'one'}: "
                f"give {' or '.join(inside)}")
    if is_file(path / "adapter_config.json") or is_file(path / "train_config.json"):
        return (f"{path} is not a pact artifact (no zarr.json); it is a LoRA adapter or pact-train run: give the "
                f"artifact it was trained on, and this folder as --adapter {path}")
    if is_file(path / "config.json"):
        return (f"{path} is not a pact artifact (no zarr.json); it looks like a Hugging Face model folder: "
                f"convert it first, `pact-convert {path} ARTIFACT`, and give ARTIFACT")
    return f"{path} is not a pact artifact (no zarr.json): create one with `pact-convert MODEL NEW_FOLDER`"


class Artifact:
    """A read-only view of an artifact; every tensor is a zero-copy memory map of its file."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.url: str | None = None  # where it was fetched from (open_artifact of a URL)
        root_json = self.path / "zarr.json"
        if not root_json.is_file():
            raise ArtifactError(_not_an_artifact(self.path))
        root = read_json(root_json, "the artifact is damaged; re-copy it or re-run pact-convert")
        meta = root.get("attributes") if isinstance(root, dict) else None
        meta = meta.get("pact") if isinstance(meta, dict) else None
        if not isinstance(meta, dict):
            raise ArtifactError(f"{root_json}: no pact manifest (attributes.pact): re-run pact-convert")
        if meta.get("format") != FORMAT_NAME:
            raise ArtifactError(f"{root_json}: format is {meta.get('format')!r}, not {FORMAT_NAME!r}")
        self.meta: dict[str, Any] = _upgrade(meta, self.path)
        _check_manifest(self.meta, self.path)
        _check_contained(self.path, self.meta)
        self._check_config()
        self._maps: dict[tuple[str, str], torch.Tensor] = {}

    def _check_config(self) -> None:
        """hf/config.json (what the runtime builds the model from) states sizes that fit the stored
        weights, before transformers or the forward sees it (check_config_shapes)."""
        f = self.hf_dir / "config.json"
        if not f.is_file():
            return  # an artifact without one cannot train; load_text_config says so
        cfg = read_json(f, "the artifact is damaged; re-copy it or re-run pact-convert")
        shapes = {name: e["shape"] for name, e in self.meta["tensors"].items()}
        check_config_shapes(cfg, shapes, str(f))
        # the model the runtime builds is the manifest's family: a config of another (a gemma3_text config
        # under family llama ran as Llama, its norms, activation and embedding scale wrong) is refused
        archs = cfg.get("architectures")
        named = archs[0] if isinstance(archs, list) and archs else cfg.get("model_type")
        family = family_of(cfg, str(f)) if isinstance(archs, (list, type(None))) else None
        if family != self.meta["family"]:
            raise PactError(f"{f}: describes a {family or 'different'} model ({named!r}), the manifest a "
                            f"{self.meta['family']} one: the artifact is damaged or crafted; re-copy it or re-run "
                            "pact-convert")

    # -- names and metadata
    def names(self, kind: str | None = None) -> list[str]:
        """Tensor names (HF names); ``kind="nvfp4"`` for the frozen projections only."""
        return [n for n, e in self.meta["tensors"].items() if kind is None or e["kind"] == kind]

    def entry(self, name: str) -> dict[str, Any]:
        try:
            return self.meta["tensors"][name]
        except KeyError:
            raise KeyError(f"{name!r} is not in artifact {self.path}") from None

    # the entry keys ArtifactWriter.add_nvfp4 / add_dense set from the tensors themselves
    _WRITER_KEYS = frozenset({"kind", "shape", "arrays", "global_scale", "block_size", "dtype"})

    def entry_info(self, name: str) -> dict[str, Any]:
        """The entry's own information (role, layer, group, calibration records...), without what the writer
        derives from the tensors: what ``ArtifactWriter.add_*(name, ..., **info)`` takes to copy the entry."""
        return {k: v for k, v in self.entry(name).items() if k not in self._WRITER_KEYS}

    @property
    def block_scale_rule(self) -> str:
        """How this artifact's block scales were chosen (nvfp4.SCALE_RULES; older artifacts: amax):
        what re-quantizing its weights (a merge, a calibration) uses again."""
        return self.meta["provenance"].get("block_scales", "amax")

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
        zjson = read_json(array_dir / "zarr.json", "the artifact is damaged; re-copy it or re-run pact-convert")
        if not isinstance(zjson, dict):
            zjson = {}  # refused as not mappable below
        shape = list(spec["shape"])
        np_dtype, torch_dtype = _STORAGE[spec["dtype"]]
        mappable = (
            zjson.get("zarr_format") == 3
            and zjson.get("shape") == shape
            and zjson.get("data_type") == np.dtype(np_dtype).name
            and _get(zjson, "chunk_grid", "configuration", "chunk_shape") == shape
            and _get(zjson, "chunk_key_encoding", "configuration", "separator", default="/") == "/"
            and isinstance(zjson.get("codecs"), list)
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

    def correction(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The projection's low-rank correction (U [N, R], V [R, K] bf16: the model computes with
        dequantize(fwd) + U V), or None."""
        arrays = self.entry(name)["arrays"]
        return (self.array(name, "corr_u"), self.array(name, "corr_v")) if "corr_u" in arrays else None

    @property
    def corrected(self) -> bool:
        """Whether any projection carries a low-rank correction."""
        return any("corr_u" in e["arrays"] for e in self.meta["tensors"].values())

    def dequantize(self, name: str, layout: str = "fwd") -> torch.Tensor:
        """The float32 effective weight (the low-rank correction added, where there is one): shaped
        like the source for "fwd", transposed for "bwd"."""
        e = self.entry(name)
        if e["kind"] == "dense":
            t = self.dense(name).float()
            return t.t() if layout == "bwd" else t
        return self.with_correction(name, _dequantize(self.nvfp4(name, layout)), layout)

    def with_correction(self, name: str, w: torch.Tensor, layout: str = "fwd") -> torch.Tensor:
        """``w`` (the projection's dequantized weight, float32) plus its low-rank correction, where it has one."""
        if (c := self.correction(name)) is None:
            return w
        uv = c[0].float() @ c[1].float()
        return w + (uv.t() if layout == "bwd" else uv)

    def verify(self) -> int:
        """Recompute every checksum and, in the same read, look for values no converter writes (NaN
        block scales, NaN/Inf dense values: a model computing NaN would score or train as if fine);
        raise ArtifactError naming the first bad file. Returns bytes read."""
        total = 0
        for name, e in self.meta["tensors"].items():
            for part, spec in e["arrays"].items():
                chunk = _chunk_path(self.path / spec["path"], len(spec["shape"]))
                self._map(name, part)  # shape/size/layout checks first
                digest, bad = _scan(chunk, spec["dtype"])
                if digest != spec["sha256"]:
                    raise ArtifactError(
                        f"{chunk}: checksum mismatch (corrupted): re-copy the artifact or re-run pact-convert"
                    )
                if bad:
                    what = "NaN block scales (E4M3 0x7f/0xff)" if part.endswith("scales") else "NaN/Inf values"
                    raise ArtifactError(f"{chunk}: {name} ({part}) holds {bad} {what}, which no converter writes: "
                                        "the model would compute NaN; re-run pact-convert on the source model")
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
        """What verify() checked (_VERIFY_CHECKS), the fingerprint and every data file's size and
        modification time."""
        parts = [_VERIFY_CHECKS, self.fingerprint()]
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
