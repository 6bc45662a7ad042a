"""Hyperparameter search from the job spec's ``tune`` section: ``kubetune tune`` runs a durable Optuna study
whose trials are normal kubetune runs of the spec with the trial's values in."""

from __future__ import annotations

from pathlib import Path

from kubetune.config import JobSpec
from kubetune.config.tune import TuneSpec
from kubetune.errors import KubetuneError


def require(spec: JobSpec) -> TuneSpec:
    """``spec``'s tune section.

    Raises:
        KubetuneError: ``spec`` has no tune section.
    """
    if spec.tune is None:
        raise KubetuneError(
            "the spec has no tune section",
            field="tune",
            fix="add tune: {space: {training.learning_rate: {type: float, low: 1.0e-5, high: 1.0e-3, log: true}}, "
            "objective: eval_loss}",
        )
    return spec.tune


def local_output(spec: JobSpec) -> Path:
    """The study's directory: ``output.uri``, which must be local (each trial's run goes under it)."""
    from kubetune.artifacts.output import Output

    out = Output.for_spec(spec)
    if out.scheme != "file":
        raise KubetuneError(
            f"kubetune tune keeps its study in a local directory, and output.uri is {out.uri}",
            field="output.uri",
            fix="give a local directory (each trial's run goes under it)",
        )
    return out.local.resolve()


def run(spec: JobSpec) -> tuple[dict, Path]:
    """Check ``spec``'s tune section, run (or continue) its study to the end and write tune.json, best.yaml and
    report.html. Returns the study's summary and its directory.

    Raises:
        KubetuneError: no tune section, a search space or objective the checks refuse (before any trial), another
            session on the same study, more failed trials than tune.max_failed.
    """
    from kubetune.tune import devices, report, space, study

    tune = require(spec)
    base = spec.model_dump(mode="json", exclude_unset=True)
    out = local_output(spec)
    gpus = devices.visible_gpus()
    space.check(spec, gpus)
    result = study.Search(base, spec, out, gpus).run()
    return report.write(result, base, out, tune.objective), out
