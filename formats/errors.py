"""The one exception type pact raises for bad input: its message names the thing and the fix."""


# The distribution's name on the package index ("pact" there is an unrelated library): what every
# install hint names. The import name stays `pact`.
DISTRIBUTION = "pact-nvfp4"


def install_hint(extra: str | None = None, upgrade: bool = False) -> str:
    """The pip command that installs ``extra`` (or upgrades pact) where this pact came from: the
    index's distribution, or the local source folder it was installed from (a clone: the
    distribution may not be on the index), as pip recorded it (direct_url.json)."""
    import json
    from importlib import metadata
    from urllib.parse import unquote, urlparse

    target, editable = DISTRIBUTION, False
    try:
        info = json.loads(metadata.distribution(DISTRIBUTION).read_text("direct_url.json") or "{}")
        if info.get("url", "").startswith("file://"):
            target, editable = unquote(urlparse(info["url"]).path), bool(info.get("dir_info", {}).get("editable"))
    except (metadata.PackageNotFoundError, ValueError, AttributeError):
        pass
    spec = f"{target}[{extra}]" if extra else target
    return f'pip install {"-U " if upgrade else ""}{"-e " if editable else ""}"{spec}"'


class PactError(ValueError):
    """Bad input or a broken artifact. The message says which file/flag and how to fix it."""


class ArtifactError(PactError):
    """An artifact that is missing, truncated, corrupted or of an unknown format version."""


def require(module: str, extra: str, purpose: str):
    """Import an optional dependency, or fail in one line naming the extra that installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise PactError(f"{purpose} needs the {module.split('.')[0]} package: {install_hint(extra)}") from None


def write_error(e: OSError, path, what: str) -> PactError:
    """An OSError while writing ``path`` as one line: the path, the cause (a full disk named as such)
    and what was kept (``what``)."""
    import errno

    full = e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))  # (a quota: no EDQUOT on Windows)
    why = "the disk is full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
    fix = "free space or choose another output" if full else "choose a writable output folder"
    return PactError(f"{path}: could not write ({why}): {fix}; {what}")
