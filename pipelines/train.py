"""`pact-train ARTIFACT --data train.jsonl --out run/` (or `pact-train --config run.yaml`): LoRA on
the NVFP4 artifact. The options are TrainConfig's fields (runtime/trainer.py: names, defaults, help
and choices live there)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from pact.formats import PactError
from pact.formats.artifact import CORRECTION_MAX_RANK
from pact.runtime.evaluate import collapse_note
from pact.runtime.trainer import TrainConfig, check_inputs, train

from .common import cli_errors, config_from, config_options, main_rank, with_config_file


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@config_options(TrainConfig, required=False)  # ARTIFACT, --data and --out may come from --config
@click.option("--config", type=click.Path(), default=None,
              help="A .yaml or .json of these options (or a run's train_config.json); flags given here override it.")
@click.option("--calibrate/--no-calibrate", default=None,
              help="First calibrate ARTIFACT with GPTQ on the first --calibrate-samples records of --data (as "
                   "pact-calibrate --prompts does) into OUT/calibrated/ (a second artifact of the same size), and "
                   "train on that: on 9 tasks it trained 1.2-2.1 points better on the mean than the uncalibrated "
                   "artifact at three learning rates (a task's gain moves by about a point with the texts it "
                   "calibrates on; BENCHMARKS.md). About a minute for a 1B model on one GPU; needs the artifact's "
                   "source model. Default: done when ARTIFACT is not calibrated and its source model is on this "
                   "machine (said when not); --calibrate insists, --no-calibrate trains on ARTIFACT as it is. "
                   "pact-eval and pact-export given ARTIFACT and the run use OUT/calibrated/ themselves.")
@click.option("--calibrate-samples", type=int, default=128, show_default=True,
              help="Calibration: how many training records (each at most min(--max-len, 512) tokens).")
@click.option("--calibrate-correct-rank", type=int, default=None, metavar="R",
              help="Calibration also fits a frozen rank-R correction of the NVFP4 weights' error (pact-calibrate "
                   "--correct-rank R; opt-in: +0.8 points on one task at lr 5e-4, less stable at 1e-3; BENCHMARKS.md). "
                   "Implies --calibrate. Default: the artifact's own rank (0 when it has none).")
@click.option("--resume", is_flag=True, help="Continue the run in --out from its latest checkpoint.")
@click.option("--quiet", is_flag=True, help="No progress bars or announcements (a note that the run "
              "trains uncalibrated, and why, is still said: --no-calibrate silences it).")
@cli_errors
def main(config: str | None, **params) -> None:
    """Train LoRA adapters on ARTIFACT; the adapter is saved in PEFT format in --out."""
    if config:
        params = _where_the_run_is(config, with_config_file(config, params))
    resume, quiet = params.pop("resume"), params.pop("quiet")
    with_gptq, samples = params.pop("calibrate"), params.pop("calibrate_samples")
    correct_rank = params.pop("calibrate_correct_rank")
    if correct_rank is not None:
        if not 0 <= correct_rank <= CORRECTION_MAX_RANK:
            raise PactError(f"--calibrate-correct-rank must be in [0, {CORRECTION_MAX_RANK}] (0: no correction), "
                            f"got {correct_rank}")
        if with_gptq is False:
            raise PactError("--calibrate-correct-rank: the correction is fitted by the run's calibration, which "
                            "--no-calibrate turns off: drop one of them (or pact-calibrate ARTIFACT --correct-rank R "
                            "first and train on its output)")
        with_gptq = True
    try:
        cfg = config_from(TrainConfig, params)  # every setting checked before a minute of calibration
    except PactError as e:  # a bad value the config file set: said with the file's name
        flag = str(e).split(" ", 1)[0].lstrip("-").replace("-", "_")
        source = click.get_current_context().get_parameter_source(flag)  # (None: not a parameter of this command)
        if config and flag in params and source in (None, click.core.ParameterSource.DEFAULT):  # not the command line's
            raise PactError(f"{e} (set in --config {config})") from None
        raise
    if with_gptq is not False:
        from pact.calibrate.forrun import check_samples

        check_samples(samples)
    auto = with_gptq is None
    from pact.runtime.runfolder import check_run

    # a taken --out is said first, not after a note about calibration (which checks a calibrated/ in it)
    check_run(Path(cfg.out), resume, calibrated_aside=with_gptq is not False)
    if auto:  # the default: calibrate when it can, or say why not
        from pact.calibrate.forrun import auto_calibrate
        from pact.runtime.evaluate import own_weights

        if resume:  # a run that trained on its own calibrated/ resumes on it as it is
            cfg.artifact = own_weights(cfg.artifact, cfg.out)
        with_gptq, note = auto_calibrate(cfg.artifact, cfg.data, cfg.out, resume, split=cfg.data_split)
        if note and main_rank():  # (even under --quiet: the run is not what the default promised)
            check_inputs(cfg, tokenize=True)  # a bad record is said alone, not after a note about calibration
            click.echo(f"note: {note}; --no-calibrate silences this", err=True)
    if with_gptq:
        from pact.calibrate.calibrate import SourceError
        from pact.calibrate.forrun import calibrate_for_run

        check_inputs(cfg, tokenize=True)  # a bad record in --data / --eval-data fails before GPTQ, not after
        announce = None
        if auto and not quiet and not resume:
            msg = (f"calibrating {cfg.artifact} on --data's first records (up to {samples}) into "
                   f"{Path(cfg.out) / 'calibrated'} before training (--no-calibrate skips it)")
            announce = lambda: click.echo(msg, err=True)  # noqa: E731
        try:
            cfg.artifact = str(calibrate_for_run(cfg.artifact, cfg.data, cfg.out, split=cfg.data_split,
                                                 samples=samples, seq_len=min(cfg.max_len, 512), resume=resume,
                                                 device=cfg.device, progress=not quiet, announce=announce,
                                                 correct_rank=correct_rank))
        except SourceError as e:  # the source is there but not the model converted: never a mix of two models
            fix = (f"calibrate with pact-calibrate {cfg.artifact} --source ORIGINAL_MODEL --prompts {cfg.data} "
                   "--out CALIBRATED/ and train on CALIBRATED/")
            if not auto:
                raise PactError(f"--calibrate: {e} ({fix}; or --no-calibrate)") from None
            if main_rank():
                click.echo(f"note: could not calibrate: {e}; training on {cfg.artifact} as it is ({fix}); "
                           "--no-calibrate silences this", err=True)
    try:
        result = train(cfg, resume=resume, progress=not quiet)
    except KeyboardInterrupt:
        if main_rank():
            saved = any((Path(cfg.out) / "checkpoints").glob("step-*"))
            how = ("the same command with --resume continues from the last checkpoint" if saved else
                   f"no checkpoint was saved: {'delete ' + str(cfg.out) + ' and ' if Path(cfg.out).exists() else ''}"
                   "run the command again (--save-every N keeps checkpoints to resume from)")
            click.echo(f"\ninterrupted: {how}", err=True)
        raise click.Abort() from None
    if main_rank():  # under torchrun, one result
        click.echo(json.dumps({k: v for k, v in result.items() if k != "eval_labels"}, indent=2))
        if (note := collapse_note(result)) is not None:
            click.echo(note, err=True)


def _where_the_run_is(config: str, params: dict) -> dict:
    """--config RUN/train_config.json of a run folder moved or copied since it was written: --out is the
    folder holding the file (and an artifact that was the run's own calibrated/ is the one there), not
    where the run was, unless given on the command line."""
    from pact.runtime.checkpoints import CALIBRATED
    from pact.runtime.evaluate import run_record, trained_on_own_calibrated
    from pact.runtime.runfolder import _trained

    p = Path(config).resolve()
    folder = p if p.is_dir() else p.parent
    record = run_record(str(folder)) if p.is_dir() or p.name == "train_config.json" else {}
    was = record.get("out")
    if "inputs_sha256" not in record or not isinstance(was, str) or Path(was) == folder or not _trained(folder):
        return params  # not a run folder's record, or the run is where it was written
    ctx = click.get_current_context()

    def given(name: str) -> bool:
        return ctx.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT)

    if given("out") and Path(params["out"]).resolve() != folder:
        return params  # another folder asked for: the settings as the file has them
    if not given("out"):
        click.echo(f"--config {config}: the run was written in {was} and is now in {folder}: training there "
                   "(--out chooses another folder)", err=True)
    params = {**params, "out": str(folder)}
    if trained_on_own_calibrated(record) and not given("artifact"):
        params["artifact"] = str(folder / CALIBRATED)  # pact-train's calibration's: the run's own, where it is now
    return params


if __name__ == "__main__":
    main()
