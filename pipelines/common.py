"""What every pact command shares: logging set-up and turning PactError into one clear line."""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import click

from pact.formats import PactError


def cli_errors(fn: Callable) -> Callable:
    """Run a command body; a PactError becomes `Error: <message>` and exit status 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        try:
            return fn(*args, **kwargs)
        except PactError as e:
            raise click.ClickException(str(e)) from None

    return wrapper


ACTIVATIONS_HELP = (
    "Precision recipe of the activations (weights stay NVFP4): a preset, default 'nvfp4-saved' (NVFP4 copies "
    "saved for backward; GEMMs and LoRA read unquantized rows), 'nvfp4' (every use reads the NVFP4 copy) or "
    "'bf16' (nothing quantized: the reference), optionally followed by SITE.FIELD=VALUE overrides, e.g. "
    "'nvfp4,down.saved=bf16' (SITE: qkv, o, gate_up, down or *; FIELD: gemm, lora, saved; VALUE: nvfp4, bf16). "
    "See README 'Precision recipe'."
)
