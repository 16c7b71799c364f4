"""Offline conversion: HF folder / hub id / GGUF file -> pact NVFP4 artifact."""

from .convert import convert, relative_error
from .sources import Source, open_source

__all__ = ["Source", "convert", "open_source", "relative_error"]
