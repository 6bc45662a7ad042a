"""`kubetune serve`: an exported model behind an HTTP server (``kubetune.inference.server``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from kubetune.cli.common import _fail, app
from kubetune.errors import KubetuneError

TOKEN_ENV = "KUBETUNE_SERVE_TOKEN"


@app.command()
def serve(
    model: Annotated[
        str, typer.Argument(help="Exported model: a job's output (directory, s3://, hf://) or its model/ directory.")
    ],
    host: Annotated[
        str, typer.Option(help="Address to bind; 0.0.0.0 to serve other hosts (e.g. in a pod).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port.")] = 8000,
    name: Annotated[
        str | None, typer.Option(help="The model's name in the API; default: the export's job name.")
    ] = None,
    adapter: Annotated[
        bool, typer.Option("--adapter", help="A LoRA export: serve the base model plus adapter/ instead of model/.")
    ] = False,
    max_batch: Annotated[
        int,
        typer.Option(min=1, max=1024, help="Requests computed together at most (a causal LM: in flight at once)."),
    ] = 8,
    max_wait_ms: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=10_000.0,
            help="Classifiers: how long a text waits for others to batch with (a causal LM batches continuously).",
        ),
    ] = 10.0,
    max_queue: Annotated[int, typer.Option(min=1, help="Requests waiting at most; more are answered 429.")] = 64,
    timeout: Annotated[float, typer.Option(min=0.1, help="Seconds a request may take; then 504.")] = 60.0,
    max_request_kb: Annotated[int, typer.Option(min=1, help="Largest request body, KiB; larger: 413.")] = 1024,
    max_tokens: Annotated[int, typer.Option(min=1, help="The most new tokens one request may ask for.")] = 2048,
    header_timeout: Annotated[
        float,
        typer.Option(min=0.1, max=3600.0, help="Seconds a client may take to send a request's headers; then closed."),
    ] = 10.0,
    token_file: Annotated[
        Path | None,
        typer.Option(help=f"A file holding the bearer token clients must send (or set ${TOKEN_ENV}); default: none."),
    ] = None,
    endpoint_url: Annotated[
        str | None, typer.Option("--endpoint-url", help="S3 endpoint for s3:// models (MinIO).")
    ] = None,
) -> None:
    """Serve an exported model over HTTP: the OpenAI API for causal LMs (/v1/completions,
    /v1/chat/completions, /v1/models), KServe's v1 and v2 protocols for classifiers, /health, /ready, /metrics."""
    from kubetune.inference.server.app import Limits, build_app
    from kubetune.inference.server.http import serve as run_server
    from kubetune.providers import S3Settings

    try:
        token = _token(token_file)
        path, engine, routes = _load(model, adapter, S3Settings(endpoint_url=endpoint_url))
        limits = Limits(
            max_batch,
            max_wait_ms,
            max_queue,
            timeout,
            max_request_kb * 1024,
            max_tokens,
            header_timeout_s=header_timeout,
        )
        name = name or _job_name(path)
        server = build_app(engine, name, routes, limits, token)
    except KubetuneError as e:
        _fail(e)
    device = getattr(engine, "device", None)  # the causal engines say where the model runs
    typer.echo(
        f"serving {name} ({routes.name}) on http://{host}:{port}"
        + (f", device {device}" if device is not None else "")
        + (" (bearer token required)" if token else ""),
        err=True,
    )
    run_server(server, host, port, limits.header_timeout_s)


def _load(model: str, adapter: bool, s3):
    """The export's model directory, the engine its task's inference serves it with, and the protocol. The
    model is checked once (``tasks.for_model``: ``check_model``), a LoRA export's base once
    (``adapter_beside``); the engine loads what was checked.

    Raises:
        KubetuneError: nothing servable there, or ``--adapter`` where the task serves no adapter.
    """
    from kubetune import tasks
    from kubetune.inference.model import adapter_beside, locate

    path = locate(model, s3)
    name, task = tasks.for_model(path)
    inference = task.inference
    assert inference is not None  # for_model answers only a task that has an inference
    if inference.serve is None or inference.routes is None:
        raise KubetuneError(
            f"the export of task {name} ({inference.noun}) is not served by kubetune serve",
            field="MODEL",
            fix="use kubetune predict",
        )
    if not adapter:
        return path, inference.serve(path, None), inference.routes
    if not inference.adapters:
        raise KubetuneError(
            f"kubetune serve serves a {inference.noun} export merged (its model/), not as its base model plus adapter/",
            field="--adapter",
            fix="drop --adapter",
        )
    base, adapter_dir = adapter_beside(path)
    return path, inference.serve(base, adapter_dir), inference.routes


def _token(path: Path | None) -> str | None:
    """The bearer token, from a file or the environment: never a command-line value (it would show in ps).
    The file is a regular file of at most 64 KiB: /dev/zero, a FIFO or a huge file is one line, not a
    read without end or a wait for a writer."""
    from kubetune.paths import MAX_TOKEN_BYTES, read_regular

    if path is not None:
        fix = f"pass a regular file that holds just the token, or set ${TOKEN_ENV}"
        try:
            data = read_regular(path, field="--token-file", limit=MAX_TOKEN_BYTES, fix=fix)
            token = data.decode("utf-8").strip()
        except OSError as e:
            raise KubetuneError(
                f"cannot read {path}: {e.strerror}", field="--token-file", fix="pass a readable file"
            ) from None
        except UnicodeDecodeError as e:
            raise KubetuneError(f"{path} is not UTF-8 text (offset {e.start})", field="--token-file", fix=fix) from None
        if not token:
            raise KubetuneError(f"{path} is empty", field="--token-file", fix="write the token into it")
        return token
    return os.environ.get(TOKEN_ENV) or None


def _job_name(path: Path) -> str:
    """The export's job name (job.yaml beside model/), else its directory's name."""
    import yaml

    from kubetune.paths import read_regular

    job = path.parent / "job.yaml"
    try:  # only a name: a job.yaml that is no regular file or over 4 MiB falls back to the directory's name
        text = read_regular(job, field="job.yaml", limit=4 << 20, fix="-").decode("utf-8")
        value = yaml.safe_load(text).get("name")
    except (KubetuneError, OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError):
        value = None
    return value if isinstance(value, str) and value else path.parent.name if path.name == "model" else path.name
