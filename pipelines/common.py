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
