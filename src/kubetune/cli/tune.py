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
) -> None:
    """Search the spec's tune.space: every trial a kubetune run of the spec with the trial's values, under
    output.uri/trials/. Run the same command again to continue a study that stopped (kill -9 included).

    Writes output.uri/best.yaml (the best trial's spec), tune.json (every trial) and report.html."""
    from kubetune.config import load_spec
    from kubetune.config.load import resolve_data_paths

    try:
        job = resolve_data_paths(load_spec(spec, set_ or []), spec.parent)
        if job.tune is None:
            raise KubetuneError(
                "the spec has no tune section",
                field="tune",
                fix="add tune: {space: {training.learning_rate: {type: float, low: 1.0e-5, high: 1.0e-3, log: true}}, "
                "objective: eval_loss}",
            )
        base = job.model_dump(mode="json", exclude_unset=True)
        out = _local_output(job)
        from kubetune import tasks
        from kubetune.tune import report, space, study

        task = tasks.get(job.task)
        objectives = {"eval_loss", "train_loss", *task.headline, *task.present.eval_curves}
        objectives |= {f"eval_{m}" for m in task.train_metrics}
        if status:
            _status(job, out, as_json)
            return
        space.check(base, job, objectives)
        search = study.Search(base, job, out)
        result = search.run()
    except KubetuneError as e:
        _fail(e)
    data = report.write(result, base, out, job.tune.objective)
    if as_json:
        typer.echo(json.dumps(data, indent=1, default=str))
        return
    typer.echo(report.table(data))
    if data["best"]:
        best = data["best"]
        typer.echo(
            f"best: trial {best['number']}, {job.tune.objective} {best['value']:.6g}; "
            f"`kubetune run {out / 'best.yaml'}` trains it again; report: {out / 'report.html'}"
        )


def _local_output(job) -> Path:
    from kubetune.artifacts.output import Output

    out = Output.for_spec(job)
    if out.scheme != "file":
        raise KubetuneError(
            f"kubetune tune keeps its study in a local directory, and output.uri is {out.uri}",
            field="output.uri",
            fix="give a local directory (each trial's run goes under it)",
        )
    return out.local.resolve()


def _status(job, out: Path, as_json: bool) -> None:
    """The study's trials as they stand, with each running trial's progress (its progress.json)."""
    from kubetune.training.loggers import format_line, read_progress
    from kubetune.tune import report, study

    found = study.load(job, out)
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
