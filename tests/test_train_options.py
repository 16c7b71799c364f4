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
    ("--data-split", "--dataset-train-split", "validation"),
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


def test_eval_split_alias(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    ours = parse(["--eval-data", "held", "--eval-split", "dev"], monkeypatch)
    assert ours.eval_split == "dev"
    assert ours == parse(["--eval-data", "held", "--dataset-test-split", "dev"], monkeypatch)


def test_all_aliases_at_once(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    ours = parse([a for n, _, v in ALIASES for a in (n, v) if a is not None], monkeypatch)
    theirs = parse([a for _, t, v in ALIASES for a in (t, v) if a is not None], monkeypatch)
    assert ours == theirs and ours.lr == 3e-4 and ours.steps == 7 and ours.checkpoint


# ---- --lr-scheduler


@pytest.mark.parametrize("name", ["cosine", "linear", "constant", "constant_with_warmup", "polynomial", "inverse_sqrt"])
@pytest.mark.parametrize("total,ratio", [(100, 0.1), (37, 0.03), (10, 0.0)])
def test_schedules_follow_transformers(name, total, ratio):
    """Each schedule is transformers' get_scheduler formula; only the warmup is one step ahead
    (pact's step s uses (s + 1) / warm, transformers' s / warm: pact's first step is not at lr 0)."""
    import torch
    from transformers import get_scheduler

    from pact.runtime.trainer import lr_at

    base, warm = 2e-4, int(total * ratio)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    sched = get_scheduler(name, opt, num_warmup_steps=warm, num_training_steps=total)
    theirs = []
    for _ in range(total + 1):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    ours = [lr_at(s, total, base, ratio, name) for s in range(total)]
    shifted = [theirs[s + 1] if s < warm and name != "constant" else theirs[s] for s in range(total)]
    # the same formulas; rtol 1e-12: transformers multiplies base by a factor, pact scales base directly
    assert ours == pytest.approx(shifted, rel=1e-12, abs=0)


def test_default_schedule_is_the_warmup_cosine():
    """The default keeps the loop's earlier schedule exactly (the formula, bit for bit)."""
    import math

    from pact.runtime.trainer import lr_at

    def before(step, total, base, warmup_ratio):  # lr_at as it was before --lr-scheduler
        warm = int(total * warmup_ratio)
        if step < warm:
            return base * (step + 1) / warm
        progress = (step - warm) / max(1, total - warm)
        return base * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    assert TrainConfig(artifact="a", data="d", out="o").lr_scheduler == "cosine"
    assert all(lr_at(s, 200, 2e-4, 0.03) == before(s, 200, 2e-4, 0.03) for s in range(200))


def test_unknown_scheduler_one_line(monkeypatch, tmp_path):
    from pact.formats import PactError

    with pytest.raises(PactError, match=r"--lr-scheduler must be one of cosine, linear, .* got 'cosine_annealing'"):
        TrainConfig(artifact="a", data="d", out="o", lr_scheduler="cosine_annealing")
    monkeypatch.chdir(tmp_path)
    assert parse(["--lr-scheduler-type", "linear"], monkeypatch) == parse(["--lr-scheduler", "linear"], monkeypatch)


# ---- --config run.yaml / run.json / a run's train_config.json


def test_config_file_and_flags_over_it(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text("artifact: art\ndata: train.jsonl\nout: run\nlearning_rate: 3e-4\n"
                                       "max-steps: 7\ntargets: [q_proj, v_proj]\ngradient_checkpointing: true\n")
    flags = parse(["--lr", "3e-4", "--steps", "7", "--targets", "q_proj,v_proj", "--checkpoint"], monkeypatch)
    seen = {}
    monkeypatch.setattr(train_mod, "train", lambda cfg, **kw: seen.update(cfg=cfg, **kw) or {})

    def run(*args):
        r = CliRunner().invoke(train_mod.main, [*args, "--quiet"])
        assert r.exit_code == 0, r.output
        return seen["cfg"]

    assert run("--config", "run.yaml") == flags  # YAML's 3e-4 (a string to YAML 1.1) parses as --lr would
    assert run("--config", "run.yaml", "--max-steps", "9").steps == 9  # a flag wins over the file
    assert run("--config", "run.yaml", "--resume").lr == 3e-4 and seen["resume"] is True
    import json

    (tmp_path / "run.json").write_text(json.dumps({"artifact": "art", "data": "train.jsonl", "out": "run", "lr": 3e-4,
                                                   "steps": 7, "targets": "q_proj,v_proj", "checkpoint": True}))
    assert run("--config", "run.json") == flags


def test_a_runs_train_config_is_a_config(monkeypatch, tmp_path):
    """train_config.json as pact-train writes it (with the recipe and fingerprints) gives the same TrainConfig."""
    import json

    monkeypatch.chdir(tmp_path)
    cfg = parse(["--lr-scheduler", "linear", "--lora-r", "4", "--activations", "bf16"], monkeypatch)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "train_config.json").write_text(json.dumps({
        **cfg.as_json(), "recipe": {}, "world_size": 1, "global_batch": 8, "inputs_sha256": {}}))
    seen = {}
    monkeypatch.setattr(train_mod, "train", lambda c, **kw: seen.setdefault("cfg", c) and {})
    for path in ("old/train_config.json", "old"):
        seen.clear()
        r = CliRunner().invoke(train_mod.main, ["--config", path, "--quiet"])
        assert r.exit_code == 0, r.output
        assert seen["cfg"] == cfg


@pytest.mark.parametrize("text,suffix,match", [
    ("lerning_rate: 1e-4\n", ".yaml", r"--config .*bad.yaml: unknown key 'lerning_rate' \(did you mean "
                                      r"'learning_rate'\?\)"),
    ("lr: [1]\n", ".yaml", r"bad.yaml: lr: \[1\] is not a valid value for --lr"),
    ("steps: 2.5\n", ".yaml", r"bad.yaml: steps: 2.5 is not a valid value"),
    ("lr_scheduler: cosine_annealing\n", ".yaml", r"bad.yaml: lr_scheduler: 'cosine_annealing' is not one of"),
    ("[1, 2]", ".json", r"bad.json: expected a mapping of option names to values, got list"),
    ("{lr: ", ".json", r"bad.json: not valid JSON"),
    ("lr: [", ".yaml", r"bad.yaml: not valid YAML"),
    ("lr = 1", ".toml", r"bad.toml: expected a .yaml, .yml or .json file"),
])
def test_bad_config_one_line(monkeypatch, tmp_path, text, suffix, match):
    monkeypatch.chdir(tmp_path)
    (tmp_path / f"bad{suffix}").write_text(text)
    r = CliRunner().invoke(train_mod.main, BASE + ["--config", f"bad{suffix}", "--quiet"])
    assert r.exit_code == 1 and r.output.count("\n") == 1, r.output
    import re

    assert re.search(match, r.output), r.output


def test_missing_required_names_it(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.json").write_text('{"artifact": "art", "data": "train.jsonl"}')
    r = CliRunner().invoke(train_mod.main, ["--config", "c.json", "--quiet"])
    assert r.exit_code == 1 and "--out is required: give it on the command line or in the --config file" in r.output
    r = CliRunner().invoke(train_mod.main, ["--data", "d", "--out", "o"])
    assert r.exit_code == 1 and "ARTIFACT is required" in r.output
