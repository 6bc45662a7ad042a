"""`kubetune predict`: the model's task predicts (its ``Inference.predict``, found through the task registry),
with the options it takes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kubetune.cli.common import (
    _fail,
    app,
)
from kubetune.errors import KubetuneError


@app.command()
def predict(
    model: Annotated[
        str, typer.Argument(help="Exported model: a job's output (directory, s3://, hf://) or its model/ directory.")
    ],
    texts: Annotated[list[str] | None, typer.Argument(help="Texts to classify, or prompts for a causal LM.")] = None,
    file: Annotated[Path | None, typer.Option("--file", "-f", help="Read texts from a file, one per line.")] = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print a JSON list of {text, label, score} (classifiers) or {prompt, completion} (causal LMs).",
        ),
    ] = False,
    endpoint_url: Annotated[
        str | None, typer.Option("--endpoint-url", help="S3 endpoint for s3:// models (MinIO).")
    ] = None,
    # None = not given: a classifier refuses these options rather than ignoring them
    max_new_tokens: Annotated[
        int | None,
        typer.Option("--max-new-tokens", min=1, help="Causal LMs: tokens to generate per prompt (default 64)."),
    ] = None,
    temperature: Annotated[
        float | None,
        typer.Option("--temperature", min=0.0, help="Causal LMs: sampling temperature; 0 = greedy (the default)."),
    ] = None,
    chat: Annotated[
        bool | None,
        typer.Option(
            "--chat/--no-chat",
            help="Causal LMs: wrap each prompt as a user turn in the model's chat template (default: when it has one).",
        ),
    ] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Causal LMs: seed for sampling (default 0).")] = None,
) -> None:
    """Classify texts or generate text with an exported model (a directory, s3:// artifact or hf:// repo)."""
    from kubetune import tasks
    from kubetune.inference.model import locate, read_texts
    from kubetune.providers import S3Settings

    s3 = S3Settings(endpoint_url=endpoint_url)
    items = list(texts or [])
    given = {"max_new_tokens": max_new_tokens, "temperature": temperature, "chat": chat, "seed": seed}
    given = {name: value for name, value in given.items() if value is not None}
    try:
        _check_texts(items)
        if file is not None:
            items += read_texts(file)
        if not items:
            raise KubetuneError("no texts given", field="TEXTS", fix="pass texts as arguments or --file texts.txt")
        local = locate(model, s3)  # s3:// and hf:// artifacts are downloaded once; for_model checks the model
        inference = tasks.for_model(local)[1].inference
        assert inference is not None  # for_model answers only a task that has an inference
        show = inference.show
        _check_predict_options(inference, given, model)
        results = inference.predict(str(local), items, given, lambda line: typer.echo(f"warning: {line}", err=True))
    except KubetuneError as e:
        _fail(e)
    if as_json:
        typer.echo(json.dumps(results, ensure_ascii=False, indent=2))
    else:
        for r in results:
            typer.echo(show(r))


def _check_texts(items: list[str]) -> None:
    for number, text in enumerate(items, 1):
        which = "the text argument" if len(items) == 1 else f"text argument {number} of {len(items)}"
        if not text.strip():
            raise KubetuneError(
                f"{which} is empty", field="TEXTS", fix="pass the text itself, or drop the empty argument"
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # bytes the shell passed that are not UTF-8 arrive as lone surrogates
            raise KubetuneError(
                f"{which} is not UTF-8 (byte 0x{ord(text[e.start]) & 0xFF:02x} at character {e.start})",
                field="TEXTS",
                fix="pass UTF-8 text (check the terminal's encoding)",
            ) from None


def _check_predict_options(inference, given: dict, model: str) -> None:
    """Refuse the options the model's task does not take, naming the kinds of model that do."""
    from kubetune import tasks

    refused = [name for name in given if name not in inference.predict_options]
    if not refused:
        return
    flags = [f"--{n.replace('_', '-')}" if n != "chat" or given[n] else "--no-chat" for n in refused]
    takers = {
        t.inference.noun
        for t in map(tasks.get, tasks.names())
        if t.inference is not None and refused[0] in t.inference.predict_options
    }
    raise KubetuneError(
        f"{'applies' if len(flags) == 1 else 'apply'} to {' and '.join(k + 's' for k in sorted(takers))} "
        f"only, and {model} is a {inference.noun}",
        field=", ".join(flags),
        fix=f"drop {' and '.join(flags)}",
    )
