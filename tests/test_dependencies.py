"""Every third-party module the package imports is declared in pyproject.toml (dependencies or an
extra), and optional ones fail in one line naming their extra."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions, requires
from pathlib import Path

import pytest

from pact.formats.errors import DISTRIBUTION

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("formats", "convert", "calibrate", "runtime", "assets", "pipelines")
# what each of our packages may import of ours: imports go down the stack only (ARCHITECTURE.md)
MAY_IMPORT = {
    "formats": set(),
    "convert": {"formats"},
    "runtime": {"formats"},
    "calibrate": {"formats", "convert", "runtime"},
    "assets": {"formats", "runtime"},
    "pipelines": {"formats", "convert", "calibrate", "runtime", "assets"},
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imported_modules() -> dict[str, list[str]]:
    """Top-level module -> files importing it, for every absolute import (and ``require``) in the package."""
    found: dict[str, list[str]] = {}
    files = [ROOT / "__init__.py", *(f for d in PACKAGE_DIRS for f in sorted((ROOT / d).rglob("*.py")))]
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "require" and node.args
                  and isinstance(node.args[0], ast.Constant)):  # optional imports: require("PIL.Image", ...)
                names = [node.args[0].value]
            else:
                continue
            for n in names:
                found.setdefault(n.split(".")[0], []).append(str(f.relative_to(ROOT)))
    return found


def test_imports_go_down_the_stack():
    """formats imports nothing of ours; convert and runtime only formats; nothing but the CLIs
    imports pipelines."""
    wrong = []
    for d, allowed in MAY_IMPORT.items():
        for f in sorted((ROOT / d).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text(), str(f))):
                mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                        [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
                for m in mods:
                    parts = m.split(".")
                    if parts[0] == "pact" and len(parts) > 1 and parts[1] != d and parts[1] not in allowed:
                        wrong.append(f"{f.relative_to(ROOT)} imports {m}")
    assert not wrong, "imports up or across the stack:\n" + "\n".join(wrong)


def _declared() -> set[str]:
    """Distributions pact's installed metadata declares, required and in every extra."""
    reqs = requires(DISTRIBUTION) or []
    return {_norm(re.match(r"[A-Za-z0-9_.-]+", r).group(0)) for r in reqs}


def test_every_third_party_import_is_declared():
    declared = _declared()
    assert {"torch", "transformers", "datasets", "accelerate", "zarr", "pillow", "triton"} <= declared
    dists = packages_distributions()
    missing = []
    for mod, where in sorted(_imported_modules().items()):
        if mod in sys.stdlib_module_names or mod in ("pact", "__future__"):
            continue
        providers = {_norm(d) for d in dists.get(mod, [])}
        if not providers:
            missing.append(f"{mod} (imported by {where[0]}): no installed distribution provides it")
        elif not providers & declared:
            missing.append(f"{mod} (imported by {where[0]}) comes from {sorted(providers)}, not declared")
    assert not missing, "undeclared imports:\n" + "\n".join(missing)


@pytest.fixture
def from_index(monkeypatch):
    """pact as if installed from the package index (no local source recorded by pip)."""
    from importlib import metadata

    class Dist:
        def read_text(self, name):
            return None

    monkeypatch.setattr(metadata, "distribution", lambda name: Dist())


def test_optional_dependency_error_names_the_extra(monkeypatch, from_index):
    from pact.formats import PactError, require

    monkeypatch.setitem(sys.modules, "PIL", None)  # as if Pillow were not installed
    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    with pytest.raises(PactError, match=r'pip install "pact-nvfp4\[vision\]"'):
        require("PIL.Image", "vision", "--prompts imgs/")


@pytest.mark.parametrize("recorded, hint", [
    (None, 'pip install "pact-nvfp4[remote]"'),  # from the index
    ('{"url": "file:///src/my%20pact", "dir_info": {"editable": true}}', 'pip install -e "/src/my pact[remote]"'),
    ('{"url": "file:///src/pact", "dir_info": {}}', 'pip install "/src/pact[remote]"'),
    ('{"url": "https://example.org/pact_nvfp4-0.1.0.whl", "archive_info": {}}', 'pip install "pact-nvfp4[remote]"'),
])
def test_install_hint_names_where_pact_came_from(monkeypatch, recorded, hint):
    """A clone's install gets the hint that works there (the distribution may not be on the index)."""
    from importlib import metadata

    from pact.formats.errors import install_hint

    class Dist:
        def read_text(self, name):
            return recorded if name == "direct_url.json" else None

    monkeypatch.setattr(metadata, "distribution", lambda name: Dist())
    assert install_hint("remote") == hint
    assert install_hint(upgrade=True).startswith("pip install -U ")


def test_image_prompts_without_pillow_one_line(tmp_path, monkeypatch, from_index):
    from pact.calibrate.prompts import _image_samples
    from pact.formats import PactError

    monkeypatch.setitem(sys.modules, "PIL", None)
    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    (tmp_path / "a.png").write_bytes(b"")
    with pytest.raises(PactError, match=r"--prompts .* needs the PIL package: pip install \"pact-nvfp4\[vision\]\""):
        _image_samples(tmp_path, tmp_path, None, max_samples=1, seq_len=64)


def test_triton_kernels_without_triton(monkeypatch, from_index):
    from pact.formats import PactError
    from pact.runtime.ops import get_ops
    from pact.runtime.recipe import parse_recipe

    monkeypatch.setitem(sys.modules, "triton", None)
    with pytest.raises(PactError,
                       match=r'--kernels triton needs the triton package: pip install "pact-nvfp4\[kernels\]"'):
        get_ops(parse_recipe(None), "triton")


def test_unavailable_device_one_line(monkeypatch):
    import torch

    from pact.formats import PactError
    from pact.runtime.ops import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(PactError, match="no CUDA device here.*drop --device"):
        resolve_device("cuda")
    with pytest.raises(PactError, match="not a device name"):
        resolve_device("gpu0")
    assert resolve_device(None).type == "cpu"
