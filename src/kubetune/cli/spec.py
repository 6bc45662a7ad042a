"""`kubetune validate`, `explain`, `init` and `schema`: the job spec's commands."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kubetune.cli.common import (
    SetOpt,
    SpecArg,
    _fail,
    app,
)
from kubetune.errors import KubetuneError


@app.command()
def validate(spec: SpecArg, set_: SetOpt = None) -> None:
    """Check a job spec: prints `ok`, or every problem (one per line) and exits 2."""
    from kubetune.config import load_spec

    try:
        job = load_spec(spec, set_)
        if not job.resources.gpu:  # no GPU pods either: the job can only run on a machine like this one
            _check_this_machine(job)
    except KubetuneError as e:
        _fail(e)
    typer.echo("ok")


def _check_this_machine(job) -> None:
    """Refuse what needs a CUDA GPU (QLoRA, FSDP CPU offload) on a machine without one, before any
    worker starts (they failed 20 s into start-up), and a transformers older than kubetune needs."""
    from kubetune.inference.model import check_transformers

    check_transformers()
    needs = []
    if job.lora and job.lora.quantization:
        needs.append(("lora.quantization", f"{job.lora.quantization} quantization (QLoRA)"))
    if job.distributed.fsdp.cpu_offload:
        needs.append(("distributed.fsdp.cpu_offload", "FSDP CPU offload (it moves GPU state to the host)"))
    if not needs:
        return
    import torch

    if not torch.cuda.is_available():
        field, what = needs[0]
        raise KubetuneError(
            f"{what} needs a CUDA GPU and this machine has none",
            field=field,
            fix=f"remove {field}, or run on a GPU machine / GPU nodes (resources.gpu)",
        )


@app.command()
def explain(
    section: Annotated[
        str | None, typer.Argument(help="A section or key, e.g. training, data or lora.r; default: every field.")
    ] = None,
) -> None:
    """Print the spec's fields (every one, or a section's) with type, default and help text."""
    from kubetune.config.load import field_reference

    rows = [r for r in field_reference() if section is None or r[0] == section or r[0].startswith(f"{section}.")]
    if not rows:
        sections = sorted({r[0].split(".")[0] for r in field_reference()})
        _fail(
            KubetuneError(f"no spec key or section {section!r}", field="section", fix=f"one of: {', '.join(sections)}")
        )
    for key, type_, default, help_ in rows:
        typer.echo(f"{key:<28} {type_:<22} {default:<14} {help_}")


@app.command()
def init(
    task: Annotated[str, typer.Argument(help="The task: `kubetune explain task` lists them.")],
    out: Annotated[Path, typer.Option("--output", "-o", help="Where to write the spec.")] = Path("job.yaml"),
) -> None:
    """Write a commented starter job spec for TASK (job.yaml), never over an existing file: the task's own,
    or (a task that ships none) one built from its registry entry, with model.uri and data.train to fill in."""
    from kubetune.config.tasks import entries, starter_text

    if task not in entries():
        _fail(KubetuneError(f"no task {task!r}", field="task", fix=f"one of: {', '.join(entries())}"))
    if out.exists() or out.is_symlink():
        _fail(KubetuneError(f"{out} already exists", field="--output", fix="pass another path with --output"))
    try:
        text = starter_text(task)
    except KubetuneError as e:
        _fail(e)
    try:
        with out.open("x", encoding="utf-8") as f:  # "x": never replaces a file that appeared meanwhile
            f.write(text)
    except OSError as e:
        _fail(KubetuneError(f"cannot write {out}: {e.strerror}", field="--output", fix="pass a writable path"))
    fill = "fill in model.uri and data.train, then " if entries()[task].starter is None else ""
    typer.echo(f"wrote {out}: {fill}check it with `kubetune validate {out}`, run it with `kubetune run {out}`")


@app.command()
def schema(
    out: Annotated[Path | None, typer.Option("--output", "-o", help="Write to this file instead of stdout.")] = None,
) -> None:
    """Write the job spec's JSON Schema, for editors: put `# yaml-language-server: $schema=PATH`
    at the top of job.yaml."""
    from kubetune.config.load import json_schema
    from kubetune.paths import write_atomic

    text = json.dumps(json_schema(), indent=1) + "\n"
    if out is None:
        typer.echo(text, nl=False)
    else:
        try:
            write_atomic(out, text)
        except OSError as e:  # a directory, a path under a file, /proc, a read-only place
            under = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
            why = f"{under} is not a directory" if under else e.strerror or str(e)
            _fail(
                KubetuneError(
                    f"cannot write {out}: {why}", field="--output", fix="give a file path in a writable directory"
                )
            )
        typer.echo(f"wrote {out}")
