"""What every pact command shares: logging set-up and turning PactError into one clear line."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import types
import typing
from typing import Any, Callable

import click

from pact.formats import PactError, require


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


def config_options(cls, only: tuple[str, ...] | None = None, required: bool = True,
                   helps: dict[str, str] | None = None, aliases: dict[str, tuple[str, ...]] | None = None) -> Callable:
    """Click options (and arguments) made from the fields of the config dataclass ``cls``: one
    place for each setting's name, type, default, help and choices (their ``_opt`` metadata).
    ``only``: those fields, in that order. ``--snake-case`` names (plus any ``aliases`` in the
    metadata: TRL/transformers spellings); bools are flags; tuples are comma-separated strings
    (config_from splits them). ``required=False``: no option is required by click (a --config file
    may give them; config_from names what is still missing). ``helps``: a command's own help for a field
    (what it means there, e.g. --activations in a command that does not train); ``aliases``: more
    aliases for a field there (pact-eval's --per-device-eval-batch-size)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    chosen = [fields[n] for n in only] if only else list(fields.values())

    def decorate(fn: Callable) -> Callable:
        for f in reversed(chosen):  # decorators apply bottom-up: keep the dataclass's order in --help
            fn = _option(f, hints[f.name], required, (helps or {}).get(f.name), (aliases or {}).get(f.name))(fn)
        return fn

    return decorate


class Folder(click.Path):
    """A folder argument or option: a file given there is one error with ``hint`` (what goes there and how
    to make it), not click's bare "is a file"."""

    def __init__(self, hint: str, **kw):
        super().__init__(file_okay=False, **kw)
        self.hint = hint

    def convert(self, value, param, ctx):
        if isinstance(value, (str, os.PathLike)) and os.path.isfile(value):
            self.fail(f"{os.fspath(value)!r} is a file, not a folder: {self.hint}", param, ctx)
        return super().convert(value, param, ctx)


ARTIFACT = Folder("an artifact is the folder pact-convert writes; convert a model file (.gguf) or folder first: "
                  "pact-convert MODEL ARTIFACT/")
ADAPTER = Folder("--adapter takes the run folder pact-train wrote (or a PEFT adapter folder: adapter_config.json "
                 "and adapter_model.safetensors)")
OUT = Folder("give the path of a folder to write (it is created)")


def _option(f: dataclasses.Field, hint, required: bool = True, help: str | None = None,
            aliases: tuple[str, ...] | None = None) -> Callable:
    meta = f.metadata
    if meta.get("argument"):
        return click.argument(f.name, type=ARTIFACT, required=required)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None: X
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    kind = typing.get_origin(hint) or hint
    default = meta.get("cli_default", None if f.default is dataclasses.MISSING else f.default)
    kw: dict = {"help": help or meta.get("help"), "metavar": meta.get("metavar")}
    names = (f"--{f.name.replace('_', '-')}", *meta.get("aliases", ()), *(aliases or ()),
             f.name)  # the field's name, then aliases
    if kind is bool:
        return click.option(*names, is_flag=True, **kw)
    if kind is tuple:
        default = ",".join(default)
    if "choices" in meta:
        kw["type"] = click.Choice(list(meta["choices"]))
    elif meta.get("path"):
        kw["type"] = OUT if f.name == "out" else ADAPTER if f.name == "adapter" else click.Path(file_okay=False)
    elif kind in (int, float):
        kw["type"] = kind
    required = required and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    return click.option(*names, default=default, required=required,
                        show_default=default is not None, **kw)


def config_from(cls, params: dict):
    """``cls`` from a command's parameters (config_options' names); comma-separated tuples split; a
    required setting that is still missing (no flag, no --config key) is named."""
    hints = typing.get_type_hints(cls)
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name in params:
            v = params[f.name]
            if typing.get_origin(hints[f.name]) is tuple and isinstance(v, str):
                v = tuple(t.strip() for t in v.split(",") if t.strip())
            kw[f.name] = v
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and kw.get(f.name) is None:
            name = f.name.upper() if f.metadata.get("argument") else f"--{f.name.replace('_', '-')}"
            raise PactError(f"{name} is required: give it on the command line or in the --config file")
    return cls(**kw)


# --activations where nothing trains: only what the forward reads matters
SCORING_HELPS = {"activations": "Precision recipe of the forward's activations, as pact-train's --activations "
                                "(only what the GEMMs and LoRA read matters here: nothing is saved for backward). "
                                "Default: the recipe the --adapter's run trained with (its train_config.json), "
                                "else the default."}


# what train_config.json adds to the options; --config ignores them
RUN_RECORD_KEYS = ("recipe", "graphed", "backward_weights_read", "world_size", "global_batch", "inputs_sha256",
                   "recipe_auto")


def with_config_file(path: str, params: dict) -> dict:
    """``params`` (the current click command's, by parameter name) with the settings of a config
    file (.json, .yaml/.yml, or a run folder's train_config.json) under them: a flag given on the
    command line wins. Keys: a parameter's name or any spelling of its option (``lr``,
    ``learning-rate``, ``learning_rate``); an unknown key is an error naming it."""
    ctx = click.get_current_context()
    values = _read_config_file(path)
    by_key = {}
    for p in ctx.command.params:
        for spelling in [p.name, *getattr(p, "opts", ())]:
            key = spelling.lstrip("-")
            by_key[key], by_key[key.replace("-", "_")] = p, p
    out = dict(params)
    for key, value in values.items():
        if key in RUN_RECORD_KEYS:
            continue
        p = by_key.get(key)
        if p is None or p.name == "config":
            import difflib

            near = difflib.get_close_matches(key, [k for k in by_key if "-" not in k], n=1)
            raise PactError(f"--config {path}: unknown key {key!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
                            + f": the keys are {ctx.find_root().info_name or ctx.command.name}'s options, e.g. lr or "
                            "learning_rate")
        if ctx.get_parameter_source(p.name) not in (None, click.core.ParameterSource.DEFAULT):
            continue  # given on the command line: it wins
        out[p.name] = _convert(p, key, value, path, ctx)
    return out


def _convert(p: click.Parameter, key: str, value, path: str, ctx: click.Context):
    """A config file's value as the option would parse it from the command line."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        value = ",".join(value)  # tuple settings: a YAML/JSON list, or the comma-separated string
    is_flag = getattr(p, "is_flag", False)
    if (is_flag and not isinstance(value, bool)) or (not is_flag and isinstance(value, (bool, dict, list))) \
            or (isinstance(value, float) and isinstance(p.type, click.types.IntParamType) and not value.is_integer()):
        raise PactError(f"--config {path}: {key}: {value!r} is not a valid value for {p.opts[0] if p.opts else key}")
    try:
        return p.type.convert(value, p, ctx)
    except click.BadParameter as e:
        raise PactError(f"--config {path}: {key}: {e.message}") from None


def _read_config_file(path: str) -> dict:
    import json
    from pathlib import Path

    p = Path(path)
    if p.is_dir():  # a run folder: its train_config.json
        p = p / "train_config.json"
    if not p.is_file():
        raise PactError(f"--config {p}: no such file (a .yaml, .json or a run's train_config.json)")
    text = p.read_text(encoding="utf-8", errors="replace")
    if p.suffix in (".yaml", ".yml"):
        yaml = require("yaml", "yaml", f"--config {p}")  # PyYAML: transformers and datasets install it too

        try:
            values = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise PactError(f"--config {p}: not valid YAML ({str(e).splitlines()[0]})") from None
    elif p.suffix == ".json":
        try:
            values = json.loads(text)
        except ValueError as e:
            raise PactError(f"--config {p}: not valid JSON ({e})") from None
    else:
        raise PactError(f"--config {p}: expected a .yaml, .yml or .json file")
    if not isinstance(values, dict):
        raise PactError(f"--config {p}: expected a mapping of option names to values, got {type(values).__name__}")
    return values
