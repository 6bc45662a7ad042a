"""`kubetune pull` (an exported artifact onto this machine) and `seed-hf-cache`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kubetune.cli.common import (
    INTERNAL,
    _fail,
    app,
)
from kubetune.errors import KubetuneError


@app.command()
def pull(
    uri: Annotated[str, typer.Argument(help="Artifact: s3://BUCKET/PREFIX (a job's output.uri) or hf://ORG/REPO.")],
    dest: Annotated[Path, typer.Argument(help="Local directory: new, empty, or an earlier pull's.")],
    endpoint_url: Annotated[
        str | None,
        typer.Option("--endpoint-url", help="S3 endpoint (MinIO); default $S3_ENDPOINT_URL / $AWS_ENDPOINT_URL."),
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help=(
                "Pull into a non-empty directory that kubetune did not write (files of the artifact replace "
                "same-named ones)."
            ),
        ),
    ] = False,
) -> None:
    """Download an exported artifact and verify it against its manifest (sizes and sha256)."""
    from kubetune.artifacts import output
    from kubetune.artifacts.pull import pull as do_pull
    from kubetune.providers import S3Settings

    s3 = S3Settings(endpoint_url=endpoint_url)
    try:
        output.check_pull_dest(dest, overwrite)
        path = do_pull(uri, dest, s3)
        output.mark_pulled(dest, uri)
    except KubetuneError as e:
        _fail(e)
    except OSError as e:
        _fail(
            KubetuneError(f"cannot write to {dest}: {e.strerror or e}", field="DEST", fix="choose a writable directory")
        )
    typer.echo(str(path))


@app.command("seed-hf-cache", rich_help_panel=INTERNAL)
def seed_hf_cache() -> None:
    """Put the packaged all-MiniLM-L6-v2 into the Hugging Face cache (for offline hf:// use)."""
    from kubetune.providers.hf import SEED_REPO_ID, seed_cache

    try:
        path = seed_cache()
    except KubetuneError as e:
        _fail(e)
    typer.echo(f"hf://{SEED_REPO_ID} -> {path}")
