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

