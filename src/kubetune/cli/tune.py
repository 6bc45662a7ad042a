"""``kubetune tune``: the spec's ``tune`` section as a durable Optuna study on this machine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kubetune.cli.common import SpecArg, _fail, app
from kubetune.errors import KubetuneError


@app.command()
def tune(
    spec: SpecArg,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override a field, e.g. --set tune.trials=4 (repeatable).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the study's summary as JSON at the end.")] = False,
    status: Annotated[
        bool,
        typer.Option("--status", help="Only show where the study stands (it may be running in another shell)."),
    ] = False,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help="Write the study into a non-empty output that kubetune tune did not create (its tune.json, "
            "best.yaml, report.html and plots/ there are replaced).",
        ),
    ] = False,
) -> None:
    """Search the spec's tune.space: every trial a kubetune run of the spec with the trial's values, under
    output.uri/trials/. Run the same command again to continue a study that stopped (kill -9 included).

    Writes output.uri/best.yaml (the best trial's spec), tune.json (every trial) and report.html, into a new or
    empty directory or the study's own (one study to a directory, as kubetune run refuses someone else's output)."""
    from kubetune.config import load_spec
    from kubetune.config.load import resolve_data_paths

    try:
        job = resolve_data_paths(
            load_spec(spec, [*(set_ or []), *(["output.overwrite=true"] if overwrite else [])]), spec.parent
        )
        from kubetune import tune as search

        if status:
            search.require(job)
            _status(job, search.local_output(job), as_json)
            return
        data, out = search.run(job)
    except KubetuneError as e:
        _fail(e)
    if as_json:
        typer.echo(json.dumps(data, indent=1, default=str))
        return
    from kubetune.tune import report

    typer.echo(report.table(data))
    if data["best"]:
        best = data["best"]
        assert job.tune is not None  # search.run refused a spec without one (search.require)
        typer.echo(
            f"best: trial {best['number']}, {job.tune.objective} {best['value']:.6g}; "
            f"`kubetune run {out / 'best.yaml'}` trains it again; report: {out / 'report.html'}"
        )


def _status(job, out: Path, as_json: bool) -> None:
    """The study's trials as they stand, with each running trial's progress (its progress.json)."""
    from kubetune.training.loggers import format_line, read_progress
    from kubetune.tune import report, storage

    found = storage.load(job, out)
    data = report.summary(found, out)
    data["objective"] = job.tune.objective
    for t in data["trials"]:
        if t["state"] == "running" and t["dir"]:
            t["progress"] = read_progress(Path(t["dir"]))
    if as_json:
        typer.echo(json.dumps(data, indent=1, default=str))
        return
    done = sum(t["state"] in ("complete", "pruned", "fail") for t in data["trials"])
    typer.echo(f"study {job.name} in {out}: {done} of {job.tune.trials} trials done")
    typer.echo(report.table(data))
    for t in data["trials"]:
        if t.get("progress") and t["progress"].get("step") is not None:
            typer.echo(f"trial {t['number']} running: {format_line(t['progress'])}")
    if data["best"]:
        typer.echo(f"best so far: trial {data['best']['number']}, {job.tune.objective} {data['best']['value']:.6g}")
