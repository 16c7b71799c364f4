"""pact-train's options: TRL/transformers spellings give the same TrainConfig as pact's own."""

import pytest
from click.testing import CliRunner

import pact.pipelines.train as train_mod
from pact.runtime.trainer import TrainConfig

BASE = ["art", "--data", "train.jsonl", "--out", "run"]
ALIASES = [  # (pact's name, the TRL/transformers name, a value)
    ("--lr", "--learning-rate", "3e-4"),
    ("--steps", "--max-steps", "7"),
    ("--epochs", "--num-train-epochs", "2.5"),
    ("--grad-accum", "--gradient-accumulation-steps", "4"),
    ("--max-len", "--max-seq-length", "128"),
    ("--batch-size", "--per-device-train-batch-size", "3"),
    ("--checkpoint", "--gradient-checkpointing", None),
]


def parse(args, monkeypatch) -> TrainConfig:
    """The TrainConfig pact-train builds from ``args`` (train() itself replaced)."""
    seen = {}
    monkeypatch.setattr(train_mod, "train", lambda cfg, **kw: seen.setdefault("cfg", cfg) and {})
    result = CliRunner().invoke(train_mod.main, BASE + args + ["--quiet"])
    assert result.exit_code == 0, result.output
    return seen["cfg"]


@pytest.mark.parametrize("name,alias,value", ALIASES)
def test_alias_gives_the_same_config(name, alias, value, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    extra = [] if value is None else [value]
    ours, theirs = parse([name, *extra], monkeypatch), parse([alias, *extra], monkeypatch)
    assert ours == theirs
    assert ours != parse([], monkeypatch)  # the option took effect


def test_all_aliases_at_once(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    ours = parse([a for n, _, v in ALIASES for a in (n, v) if a is not None], monkeypatch)
    theirs = parse([a for _, t, v in ALIASES for a in (t, v) if a is not None], monkeypatch)
    assert ours == theirs and ours.lr == 3e-4 and ours.steps == 7 and ours.checkpoint

