"""`pact-push ARTIFACT DEST`: upload an artifact to a destination (a local folder or file://, s3://,
hf://org/repo[/path]), the manifest last, so a reader never sees a partial artifact. Refused before
anything is written: http(s):// (read-only), the artifact itself or a folder inside or around it, a
file, and a non-empty destination that is not a pact artifact (--overwrite replaces artifacts only)."""

from __future__ import annotations

import click

from pact.formats.push import push_artifact

from .common import ARTIFACT, cli_errors


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("artifact", type=ARTIFACT)
@click.argument("dest")
@click.option("--overwrite", is_flag=True, help="Replace a pact artifact already at DEST (never any other files).")
@cli_errors
def main(artifact, dest, overwrite) -> None:
    """Upload ARTIFACT (verified first) to DEST: a local folder, file://PATH, s3://BUCKET/PREFIX or
    hf://ORG/REPO[/PATH]; a new or empty one, or an artifact with --overwrite."""
    click.echo(f"pushed {artifact} -> {push_artifact(artifact, dest, overwrite=overwrite)}")


if __name__ == "__main__":
    main()
