"""A run folder from someone else (pact-train --resume on a copied folder): links planted under the names
pact writes or reads are refused before anything is written, and pact's writers replace a link at their
temp path instead of writing through it."""

import os

import pytest
import torch

from pact.formats import PactError
from pact.formats.files import open_new, replace_text
from pact.formats.peft import ADAPTER_TMP, LoraConfig, reserve_peft_adapter
from pact.runtime.runfolder import _prepare_run

KEEP = "the user's file, outside the run folder\n"


def _victim(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    f = home / "thesis.tex"
    f.write_text(KEEP)
    return f


@pytest.mark.parametrize("where", [".adapter_model.safetensors.tmp", ".train_config.json.tmp", "metrics.jsonl",
                                   "checkpoints/step-2/state.json", "checkpoints"])
def test_resume_refuses_a_run_folder_with_links(tmp_path, where):
    victim, run = _victim(tmp_path), tmp_path / "run"
    (run / "checkpoints" / "step-2").mkdir(parents=True)
    (run / "train_config.json").write_text("{}")
    link = run / where
    if link.exists():
        os.rename(link, run / "checkpoints-real")
    os.symlink(victim if where != "checkpoints" else victim.parent, link)
    with pytest.raises(PactError, match=rf"{where.split('/')[-1]} is a symbolic link.*start a new --out"):
        _prepare_run(run, resume=True)
    assert victim.read_text() == KEEP


def test_resume_refuses_a_named_pipe(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "metrics.jsonl")
    with pytest.raises(PactError, match="metrics.jsonl is not a regular file"):
        _prepare_run(run, resume=True)


def test_writers_replace_a_planted_link(tmp_path):
    victim, run = _victim(tmp_path), tmp_path / "run"
    run.mkdir()
    os.symlink(victim, run / ".train_config.json.tmp")
    replace_text(run / "train_config.json", '{"ok": 1}')
    assert (run / "train_config.json").read_text() == '{"ok": 1}'
    for name in ADAPTER_TMP:  # the adapter's reserved space: a link of the final size is not written into
        (run / name).unlink(missing_ok=True)
        os.symlink(victim, run / name)
    reserve_peft_adapter(run, {"model.layers.0.self_attn.q_proj.weight": (torch.zeros(2, 8), torch.zeros(8, 2))},
                         LoraConfig(r=2, alpha=4, targets=("q_proj",)), "base")
    assert not any((run / n).is_symlink() for n in ADAPTER_TMP) and (run / ADAPTER_TMP[0]).stat().st_size > 0
    os.symlink(victim, run / "x")
    with open_new(run / "x") as f:
        f.write("new")
    assert (run / "x").read_text() == "new" and not (run / "x").is_symlink()
    assert victim.read_text() == KEEP


def test_a_taken_out_is_said_first(tmp_path):
    """pact-train refuses an --out holding another run before anything else it would say (a note that it
    trains uncalibrated, then the refusal, read as if it had trained)."""
    from click.testing import CliRunner

    from conftest import make_converted_llama
    from pact.pipelines.train import main

    d = make_converted_llama(tmp_path, 8)  # 8 records: too few to calibrate, which a note would say
    (d / "run").mkdir()
    (d / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    r = CliRunner().invoke(main, [str(d / "art"), "--data", str(d / "train.jsonl"), "--out", str(d / "run")])
    assert r.exit_code == 1 and r.output.startswith("Error: --out ") and "is not empty" in r.output, r.output
    assert "note:" not in r.output


def test_wandb_keeps_its_own_links(tmp_path):
    """W&B, which --report-to wandb starts in RUN/wandb, makes links there (latest-run, debug.log): a run it
    logged still resumes. The folder itself being a link, or a link anywhere else, is still refused."""
    from pact.formats.files import check_plain_tree

    run = tmp_path / "run"
    (run / "wandb" / "offline-run-1").mkdir(parents=True)
    os.symlink(run / "wandb" / "offline-run-1", run / "wandb" / "latest-run")
    check_plain_tree(run, "--out", "fix", opaque=("wandb",))
    os.symlink(tmp_path, run / "checkpoints")
    with pytest.raises(PactError, match="checkpoints is a symbolic link"):
        check_plain_tree(run, "--out", "fix", opaque=("wandb",))
    (run / "checkpoints").unlink()
    os.rename(run / "wandb", tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", run / "wandb")
    with pytest.raises(PactError, match="wandb is a symbolic link"):
        check_plain_tree(run, "--out", "fix", opaque=("wandb",))
