"""The artifact's on-disk format in constants: its name and version, the hf/ side files, the
array storage dtypes and sizes, and the test for a folder holding a pact artifact."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from .files import read_json

FORMAT_NAME = "pact-nvfp4"
FORMAT_VERSION = 1
# The files an artifact's hf/ folder may hold beside the weights (config, tokenizer, chat template,
# processor): what pact-convert copies from a source and pact-export ships, nothing else.
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
              "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "processor_config.json",
              "video_preprocessor_config.json")
HF_DIR = "hf"
LAYOUTS = ("fwd", "bwd")
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
    """Bytes of a manifest array's one chunk (its shape and stored dtype), in exact integers (numpy's
    product wraps around at 2**63 and would let a crafted shape match a small file)."""
    return math.prod(spec["shape"]) * np.dtype(_STORAGE[spec["dtype"]][0]).itemsize


def is_artifact(path: Path) -> bool:
    """A folder whose zarr.json carries a pact manifest (what --overwrite may replace); read as any
    metadata file is (read_json: a regular file, bounded in size and depth), so a pipe or a crafted file
    there is no artifact rather than a hang or a traceback."""
    try:
        return read_json(path / "zarr.json", "")["attributes"]["pact"]["format"] == FORMAT_NAME
    except (OSError, ValueError, KeyError, TypeError):  # (PactError is a ValueError)
        return False
