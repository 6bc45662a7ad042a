"""The search space against the spec: each trial's spec, and every problem of a ``tune`` section found before
any trial starts (a path that is not a spec field, a value the field refuses, an objective the task never
reports, more trials at once than the machine runs), one line each."""

from __future__ import annotations

import copy
import os
from typing import Any

from kubetune.config import JobSpec
from kubetune.config.load import parse_spec
from kubetune.config.tune import ParamSpec, Scalar, TuneSpec
from kubetune.errors import KubetuneError, SpecError
from kubetune.tune import devices


def set_path(raw: dict, path: str, value: Any) -> None:
    """``raw`` (a spec as a mapping) with the field at the dotted ``path`` set to ``value`` (sections made)."""
    *parents, last = path.split(".")
    node = raw
    for part in parents:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[last] = value


def trial_spec(base: dict, values: dict[str, Any], output: str, tags: dict[str, str] | None = None) -> dict:
    """The spec of one trial: ``base`` (the user's, validated, relative paths resolved) without its ``tune``
    section, with the trial's values in and its own output (and, with MLflow, the tags that nest its run). The
    study's ``output.overwrite`` (``kubetune tune --overwrite``) is not the trial's: its run writes into a directory
    of its own, and replaces nothing."""
    raw = copy.deepcopy(base)
    raw.pop("tune", None)
    for path, value in values.items():
        set_path(raw, path, value)
    set_path(raw, "output.uri", output)
    raw["output"].pop("overwrite", None)
    mlflow = (raw.get("tracking") or {}).get("mlflow")
    if tags and isinstance(mlflow, dict):
        mlflow["tags"] = {**(mlflow.get("tags") or {}), **tags}
    return raw


def check(spec: JobSpec, gpus: list[str]) -> None:
    """Every problem of the ``tune`` section of ``spec`` for a study on this machine, before any trial runs: those
    of :func:`check_search`, then the machine's (one node; enough of its ``gpus``, else cores, for the trials at
    once).

    Raises:
        KubetuneError: the first problem, in one line naming the field, the value and the fix.
    """
    check_search(spec)
    _check_machine(spec, gpus)


def check_search(spec: JobSpec) -> None:
    """The problems of the ``tune`` section of ``spec`` wherever the study runs (here or as a Katib Experiment):
    a path that is not a spec field or a value it refuses, an objective the task never reports, early stopping
    without evaluations during training, an algorithm the space does not suit.

    Raises:
        KubetuneError: the first problem, in one line naming the field, the value and the fix.
    """
    from kubetune import tasks

    base = spec.model_dump(mode="json", exclude_unset=True)
    objectives = tasks.reported_metrics(spec.task)
    tune = spec.tune
    assert tune is not None  # the callers check it first (kubetune.tune.require, render_tune)
    for path, param in tune.space.items():
        if path.split(".")[0] in ("tune", "output", "name"):
            raise KubetuneError(
                f"{path} cannot be searched: each trial's {path.split('.')[0]} is kubetune's",
                field=f"tune.space.{path}",
                fix="search training, lora, data or a task's own fields",
            )
        for value in param.candidates():
            try:
                parse_spec(trial_spec(base, {path: value}, spec.output.uri))
            except SpecError as e:
                raise KubetuneError(
                    f"{path} = {value!r} is not a valid spec: {e.problems[0]}",
                    field=f"tune.space.{path}",
                    fix="search a field of the spec (kubetune explain) within the values it takes",
                ) from None
    name = tune.objective
    if name not in objectives and not (spec.evaluation and name.split("/")[0] in spec.evaluation.tasks):
        shown = ", ".join(sorted(objectives))
        raise KubetuneError(
            f"objective {name!r} is not a metric task {spec.task} reports (it reports {shown}"
            + (", and task/metric of the evaluation section's tasks)" if spec.evaluation else ")"),
            field="tune.objective",
            fix="name one of those",
        )
    if tune.early_stopping and not _evaluates_during_training(spec, tune):
        raise KubetuneError(
            "tune.early_stopping stops trials from their evaluations during training, and this spec evaluates "
            "only at the end of each epoch",
            field="tune.early_stopping",
            fix="set training.eval_every (or evaluation.every for an lm-eval objective), or drop early_stopping",
        )
    if tune.algorithm == "cmaes" and any(p.type == "choice" for p in tune.space.values()):
        raise KubetuneError(
            "algorithm cmaes searches float and int ranges only, and the space has a choice",
            field="tune.algorithm",
            fix="use tpe or random, or make every dimension a range",
        )
    if tune.algorithm == "grid" and any(p.grid() is None for p in tune.space.values()):
        path = next(path for path, p in tune.space.items() if p.grid() is None)
        raise KubetuneError(
            f"algorithm grid needs a finite set of values, and {path} is a continuous range",
            field=f"tune.space.{path}",
            fix="give it a step, or make it a choice",
        )


def _check_machine(spec: JobSpec, gpus: list[str]) -> None:
    tune = spec.tune
    assert tune is not None  # check_search refused a spec without one (its caller's check)
    if spec.distributed.nodes > 1:
        raise KubetuneError(
            "kubetune tune runs the trials on this machine, and the spec asks for several nodes",
            field="distributed.nodes",
            fix="set distributed.nodes: 1 for a local study",
        )
    procs = spec.distributed.procs_per_node
    devices.check_processes(  # each trial's processes on GPUs of their own, or the cores shared out
        tune.parallel * procs,
        f"{tune.parallel} trials at once of {procs} processes each",
        "tune.parallel",
        lambda have: f"set tune.parallel to at most {max(1, have // procs)}",
        gpus,
    )


def threads_per_trial(spec: JobSpec) -> int | None:
    """Each trial process's threads when trials run side by side: the cores shared out, so that ``parallel``
    trials do not each take every core (the spec's own ``distributed.threads_per_proc`` wins); None for one
    trial at a time. Set in the trial's spec: ``kubetune run`` sizes its workers' threads from it, not from
    OMP_NUM_THREADS (two trials of two threads each on 2 cores trained 18x slower, benchmarks/tune_study.py)."""
    tune = spec.tune
    assert tune is not None  # a study's spec (kubetune.tune.require)
    if tune.parallel == 1 or spec.distributed.threads_per_proc:
        return None
    return max(1, (os.cpu_count() or 1) // (tune.parallel * spec.distributed.procs_per_node))


def _evaluates_during_training(spec: JobSpec, tune: TuneSpec) -> bool:
    if "/" in tune.objective:
        return bool(spec.evaluation and spec.evaluation.every)
    return bool(spec.training.eval_every) or spec.training.epochs > 1


def suggest(trial, path: str, param: ParamSpec):
    """The trial's value for one dimension (Optuna's ``suggest_*``; an enqueued trial gets its fixed value)."""
    if param.type == "choice":
        return trial.suggest_categorical(path, param.values)
    low, high = param.low, param.high
    assert low is not None and high is not None  # a range has both ends (the spec's validation)
    if param.type == "int":
        return trial.suggest_int(path, int(low), int(high), step=int(param.step or 1), log=param.log)
    return trial.suggest_float(path, low, high, step=param.step, log=param.log)


def grid_values(tune: TuneSpec) -> dict[str, list[Scalar]]:
    """Every dimension's values under a grid search (``check_search`` refused a continuous range there)."""
    out: dict[str, list[Scalar]] = {}
    for path, p in tune.space.items():
        values = p.grid()
        assert values is not None, path
        out[path] = values
    return out


def sampler(tune: TuneSpec, offset: int = 0):
    """Optuna's sampler of ``tune.algorithm``, seeded with ``tune.seed + offset`` (the trials a study already has)."""
    import optuna

    seed = tune.seed + offset
    if tune.algorithm == "grid":
        return optuna.samplers.GridSampler(grid_values(tune), seed=seed)
    if tune.algorithm == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if tune.algorithm == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def pruner(tune: TuneSpec):
    import optuna

    stop = tune.early_stopping
    if stop is None:
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=stop.min_trials, n_warmup_steps=stop.warmup_steps)
