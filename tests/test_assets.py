"""The demo task's data (assets/sentiment.py) and the `pact demo` command's wiring, without downloads."""

import bz2
import csv
import io
import json

from click.testing import CliRunner

from pact.assets.sentiment import PROMPT, majority, sparkline, splits
from pact.pipelines.cli import main as pact_cli


def test_splits_are_disjoint_deterministic_and_named_by_start(tmp_path):
    rows = [{"text": f"snippet {i}", "category": ("fresh", "rotten", "plot")[i % 3]} for i in range(60)]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=["text", "category"])
    w.writeheader()
    w.writerows(rows)
    src = tmp_path / "rt.csv.bz2"
    src.write_bytes(bz2.compress(buf.getvalue().encode()))
    train_f, test_f, calib_f = splits(src, tmp_path / "data", 20, 10, 5)
    assert train_f.name == "rt-train-20-at10.jsonl" and calib_f.name == "rt-calib-5-at30.jsonl"
    train, test = ([json.loads(x) for x in open(f)] for f in (train_f, test_f))
    calib = [json.loads(x)["text"] for x in open(calib_f)]
    assert len(train) == 20 and len(test) == 10 and len(calib) == 5
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert all(r["prompt"].startswith(PROMPT.split("{")[0]) and r["completion"] in (" fresh", " rotten") for r in train)
    again = splits(src, tmp_path / "again", 20, 10, 5)
    assert [p.read_text() for p in again] == [p.read_text() for p in (train_f, test_f, calib_f)]
    assert 0.5 <= majority(test_f) <= 1.0
    assert len(sparkline([3.0, 2.0, 1.0, 0.5])) == 4


def test_pact_group_lists_every_command():
    r = CliRunner().invoke(pact_cli, ["--help"])
    assert r.exit_code == 0
    for cmd in ("convert", "calibrate", "train", "eval", "export", "push", "demo"):
        assert cmd in r.output
    assert CliRunner().invoke(pact_cli, ["demo", "--help"]).exit_code == 0
