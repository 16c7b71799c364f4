"""The one exception type pact raises for bad input: its message names the thing and the fix."""


# The distribution's name on the package index ("pact" there is an unrelated library): what every
# install hint names. The import name stays `pact`.
DISTRIBUTION = "pact-nvfp4"


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
        raise PactError(f"{purpose} needs the {module.split('.')[0]} package: pip install \"{DISTRIBUTION}[{extra}]\"") from None


def write_error(e: OSError, path, what: str) -> PactError:
    """An OSError while writing ``path`` as one line: the path, the cause (a full disk named as such)
    and what was kept (``what``)."""
    import errno

    why = "the disk is full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
    return PactError(f"{path}: could not write ({why}): free space or choose another output; {what}")
