"""NVFP4 numerics and the on-disk artifact. Imports nothing else of pact's."""

from .artifact import (
    FORMAT_NAME,
    FORMAT_VERSION,
    Artifact,
    ArtifactWriter,
    check_apart,
    check_output,
    default_cache,
    open_artifact,
)
from .errors import ArtifactError, PactError, require
from .families import ARCHITECTURES, classify, family_of, text_config
from .nvfp4 import (
    BLOCK,
    E2M1_VALUES,
    NVFP4Tensor,
    dequantize,
    quantize,
    quantize_weight,
    sqnr_db,
)

__all__ = [
    "ARCHITECTURES",
    "Artifact",
    "ArtifactError",
    "ArtifactWriter",
    "BLOCK",
    "E2M1_VALUES",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "NVFP4Tensor",
    "PactError",
    "check_apart",
    "check_output",
    "classify",
    "default_cache",
    "dequantize",
    "family_of",
    "open_artifact",
    "quantize",
    "quantize_weight",
    "require",
    "sqnr_db",
    "text_config",
]
