"""What every pact command shares: logging set-up and turning PactError into one clear line."""

from __future__ import annotations

import dataclasses
import functools
import logging
import types
import typing
from typing import Any, Callable

import click

from pact.formats import PactError


def main_rank() -> bool:
    """This process prints status lines and results: the only one, or rank 0 under torchrun."""
    from pact.runtime.distributed import env_rank

    return env_rank() == 0


def cli_errors(fn: Callable) -> Callable:
    """Run a command body; a PactError becomes `Error: <message>` and exit status 1. Under
    torchrun only rank 0 logs status lines (every rank still reports its own error)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        logging.basicConfig(level=logging.INFO if main_rank() else logging.ERROR, format="%(message)s")
        try:
            return fn(*args, **kwargs)
        except PactError as e:
            raise click.ClickException(str(e)) from None

    return wrapper


def config_options(cls, only: tuple[str, ...] | None = None) -> Callable:
    """Click options (and arguments) made from the fields of the config dataclass ``cls``: one
    place for each setting's name, type, default, help and choices (their ``_opt`` metadata).
    ``only``: those fields, in that order. ``--snake-case`` names (plus any ``aliases`` in the
    metadata: TRL/transformers spellings); bools are flags; tuples are comma-separated strings
    (config_from splits them)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    chosen = [fields[n] for n in only] if only else list(fields.values())

    def decorate(fn: Callable) -> Callable:
        for f in reversed(chosen):  # decorators apply bottom-up: keep the dataclass's order in --help
            fn = _option(f, hints[f.name])(fn)
        return fn

    return decorate


def _option(f: dataclasses.Field, hint) -> Callable:
    meta = f.metadata
    if meta.get("argument"):
        return click.argument(f.name, type=click.Path(file_okay=False))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None: X
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    kind = typing.get_origin(hint) or hint
    default = meta.get("cli_default", None if f.default is dataclasses.MISSING else f.default)
    kw: dict = {"help": meta.get("help"), "metavar": meta.get("metavar")}
    names = (f"--{f.name.replace('_', '-')}", *meta.get("aliases", ()), f.name)  # the field's name, then aliases
    if kind is bool:
        return click.option(*names, is_flag=True, **kw)
    if kind is tuple:
        default = ",".join(default)
    if "choices" in meta:
        kw["type"] = click.Choice(list(meta["choices"]))
    elif meta.get("path"):
        kw["type"] = click.Path(file_okay=False)
    elif kind in (int, float):
        kw["type"] = kind
    required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    return click.option(*names, default=default, required=required,
                        show_default=default is not None, **kw)


def config_from(cls, params: dict):
    """``cls`` from a command's parameters (config_options' names); comma-separated tuples split."""
    hints = typing.get_type_hints(cls)
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name in params:
            v = params[f.name]
            if typing.get_origin(hints[f.name]) is tuple and isinstance(v, str):
                v = tuple(t.strip() for t in v.split(",") if t.strip())
            kw[f.name] = v
    return cls(**kw)
