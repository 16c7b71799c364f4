"""`pact-push ARTIFACT DEST`: upload an artifact to an fsspec destination (hf://org/repo, s3://..., a
folder), every file first and the manifest last, so a reader never sees a partial artifact."""

from __future__ import annotations

import click

from pact.formats.remote import push_artifact

from .common import cli_errors


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("artifact", type=click.Path(file_okay=False))
@click.argument("dest")
@click.option("--overwrite", is_flag=True, help="Replace an artifact already at DEST.")
@cli_errors
def main(artifact, dest, overwrite) -> None:
    """Upload ARTIFACT (verified first) to DEST."""
    click.echo(f"pushed {artifact} -> {push_artifact(artifact, dest, overwrite=overwrite)}")


if __name__ == "__main__":
    main()
