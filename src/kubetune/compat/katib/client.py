"""Katib's ``KatibClient`` on kubetune: ``tune`` (its LLM form) translates its arguments into a job spec with a
tune section (:func:`~kubetune.compat.katib.translate.spec_from_tune`), which runs as a local Optuna study
(``backend="local"``, ``kubetune tune``'s) or is created on the cluster as a Katib Experiment whose trials are
kubetune's PyTorchJobs (``backend="kubeflow"``, ``kubetune submit --tune``'s). The calls that follow it in Katib's
guide and in users' code (``wait_for_experiment_condition``, ``get_experiment``, ``list_experiments``,
``is_experiment_*``, ``get_optimal_hyperparameters``, ``delete_experiment``) answer with Katib's own models
(kubeflow-katib-api's ``V1beta1Experiment``, ``V1beta1OptimalTrial``: the SDK's fields and names); a local study
answers as the Experiment Katib would have made of it."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubetune.compat.katib.translate import SDK_BASE_IMAGE, spec_from_tune
from kubetune.compat.kubeflow.errors import (
    JobError,
    JobTimeout,
    Problems,
    UnsupportedParameter,
    job_error,
    job_errors,
    refuse,
)
from kubetune.config import JobSpec
from kubetune.errors import KubetuneError, SpecError

CONDITIONS = ("Created", "Running", "Restarting", "Succeeded", "Failed")  # Katib's Experiment conditions
DEFAULT_TIMEOUT = 120  # the SDK's constants.DEFAULT_TIMEOUT: its API server timeout (kubetune's client has its own)


@dataclass
class _Study:
    """A study a client ran on this machine: its directory, its spec, and why it failed (None: it finished)."""

    out: Path
    spec: JobSpec
    error: str | None = None


def _condition_check(condition: str) -> Callable[..., bool]:
    """The SDK's ``is_experiment_<condition>`` method: whether the Experiment's condition ``condition`` is True."""

    def check(
        self: KatibClient,
        name: str,
        namespace: str | None = None,
        experiment: Any = None,
        timeout: int = DEFAULT_TIMEOUT,
    ) -> bool:
        return _has(self.get_experiment_conditions(name, namespace, experiment, timeout), condition)

    check.__name__ = check.__qualname__ = f"is_experiment_{condition.lower()}"
    check.__doc__ = f"Whether the {condition} condition of ``experiment`` (or of the Experiment ``name``) is True."
    return check


class KatibClient:
    """Katib's ``KatibClient`` on kubetune: same constructor, ``tune``, and the Experiment calls that follow it
    (``get_experiment``, ``list_experiments``, ``get_experiment_conditions``, ``is_experiment_*``,
    ``wait_for_experiment_condition``, ``get_optimal_hyperparameters``, ``delete_experiment``), with the SDK's
    signatures, return types and exceptions (RuntimeError, TimeoutError, ValueError).

    Args:
        config_file: kubeconfig path (default: $KUBECONFIG, ~/.kube/config, or in-cluster).
        context: kubeconfig context.
        client_configuration: not supported (refused): kubetune connects from a kubeconfig.
        namespace: default namespace of every call; default the kubeconfig context's. Ignored locally.
        backend: ``kubeflow`` (create a Katib Experiment, as the SDK) or ``local`` (an Optuna study on this
            machine, every trial a kubetune run; same spec).

    Raises:
        UnsupportedParameter: an option kubetune cannot honour.
    """

    def __init__(
        self,
        config_file: str | None = None,
        context: str | None = None,
        client_configuration: Any = None,
        namespace: str | None = None,
        backend: str = "kubeflow",
    ):
        problems = Problems()
        if backend not in ("kubeflow", "local"):
            problems.add("backend", f"{backend!r} is not a backend", "use 'kubeflow' or 'local'")
        if client_configuration is not None:
            problems.add(
                "client_configuration", "is not supported", "pass config_file (a kubeconfig) and context instead"
            )
        if backend == "local" and (config_file is not None or context is not None):
            problems.add(
                "config_file" if config_file is not None else "context",
                "configures a cluster connection, which backend='local' does not use",
                "remove it, or use backend='kubeflow'",
            )
        problems.raise_any()
        self.backend = backend
        self.namespace = namespace
        self._connection = {"kubeconfig": config_file, "context": context}
        self._studies: dict[str, _Study] = {}  # local: each tune() of this client, by the name it was given
        self._backends: dict[str | None, Any] = {}  # kubeflow: the Katib backend of each namespace used

    def tune(
        self,
        name: str,
        model_provider_parameters: Any = None,
        dataset_provider_parameters: Any = None,
        trainer_parameters: Any = None,
        storage_config: dict | None = None,
        objective: Any = None,
        base_image: str = SDK_BASE_IMAGE,
        parameters: dict | None = None,
        namespace: str | None = None,
        env_per_trial: Any = None,
        algorithm_name: str = "random",
        algorithm_settings: Any = None,
        objective_metric_name: str | None = None,
        additional_metric_names: list | None = None,
        objective_type: str = "maximize",
        objective_goal: float | None = None,
        max_trial_count: int | None = None,
        parallel_trial_count: int | None = None,
        max_failed_trial_count: int | None = None,
        resources_per_trial: Any = None,
        retain_trials: bool = False,
        packages_to_install: list | None = None,
        pip_index_urls: list | None = None,
        metrics_collector_config: dict | None = None,
        trial_active_deadline_seconds: int | None = None,
        *,
        overrides: list[str] | None = None,
    ) -> None:
        """Run the search the SDK's ``tune`` describes; returns None, as the SDK. Locally the call returns when the
        study has finished (its table, best.yaml and report in the TrainingArguments' output_dir); on a cluster,
        once the Experiment is created.

        Args: those of the SDK's ``tune`` (see :func:`spec_from_tune`), plus the keyword-only kubetune extension
            ``overrides``: ``KEY=VALUE`` strings applied to the translated spec as ``kubetune tune --set``.
            ``retain_trials``, as in the SDK, sets the trial template's ``retain``: Katib keeps each finished
            trial's job and pods (a local study keeps every trial's output whatever it is).

        Raises:
            UnsupportedParameter: an argument the spec cannot carry, or a spec it makes that is invalid (before
                anything starts; a ValueError).
            JobError: the study or Experiment could not be run or created (the cluster refused it, trials failed,
                ...).
        """
        # the SDK's arguments, by name, as spec_from_tune takes them (the same names and defaults)
        arguments = {k: v for k, v in locals().items() if k not in ("self", "overrides")}
        raw = spec_from_tune(**{**arguments, "namespace": namespace or self.namespace})
        if self.backend == "local" and raw["distributed"]["nodes"] != 1:
            refuse(
                "resources_per_trial.num_workers",
                f"{raw['distributed']['nodes']} nodes cannot run on one machine",
                "use num_workers=1 with backend='local' (num_procs_per_worker sets the processes), or "
                "backend='kubeflow'",
            )
        spec = _validate(raw, overrides)
        if self.backend == "local":
            self._run_local(name, spec)  # every trial's output is kept: retain_trials=True changes nothing
            return
        with job_errors():
            self._tuning(namespace).submit(spec, retain_trials=bool(retain_trials))

    def _run_local(self, name: str, spec: JobSpec) -> None:
        from kubetune import tune

        with job_errors():
            tune.require(spec)  # a spec whose overrides removed its tune section: refused before a study is kept
            study = _Study(tune.local_output(spec), spec)
        self._studies[name] = study  # the name tune() was given (overrides may rename the spec)
        try:
            tune.run(spec)
        except KubetuneError as e:
            study.error = str(e)  # the Experiment's Failed condition says why
            raise job_error(e) from None

    # ---- the Experiment, as Katib's SDK reads it

    def get_experiment(self, name: str, namespace: str | None = None, timeout: int = DEFAULT_TIMEOUT) -> Any:
        """The Experiment as Katib's ``V1beta1Experiment`` (kubeflow-katib-api's model: the SDK's fields). A local
        study is the Experiment Katib would have made of it: its objective, algorithm and parameters, its trials
        by state, the best trial, and its conditions (Created, then Succeeded, or Failed with the reason).

        Raises:
            JobError: no such Experiment, or the cluster could not be read (a RuntimeError, as in the SDK).
        """
        from kubeflow_katib_api import models as kt

        if self.backend == "local":
            study = self._studies.get(name)
            if study is None:
                raise JobError(
                    f"no study {name!r} was run by this client",
                    field="name",
                    fix="pass the name given to tune() (a local study is known to the client that ran it)",
                )
            return kt.V1beta1Experiment.from_dict(_study_object(name, study))
        with job_errors():
            return kt.V1beta1Experiment.from_dict(self._tuning(namespace).get(name))

    def list_experiments(self, namespace: str | None = None, timeout: int = DEFAULT_TIMEOUT) -> list[Any]:
        """Every Experiment of the namespace (``V1beta1Experiment``), as the SDK lists them; locally, the studies
        this client ran.

        Raises:
            JobError: the cluster could not be read (a RuntimeError).
        """
        from kubeflow_katib_api import models as kt

        if self.backend == "local":
            return [self.get_experiment(name) for name in self._studies]
        with job_errors():
            return [kt.V1beta1Experiment.from_dict(e) for e in self._tuning(namespace).experiments()]

    def get_experiment_conditions(
        self, name: str, namespace: str | None = None, experiment: Any = None, timeout: int = DEFAULT_TIMEOUT
    ) -> list[Any]:
        """The Experiment's conditions (``V1beta1ExperimentCondition``), [] before Katib has written one."""
        if experiment is None:
            experiment = self.get_experiment(name, namespace, timeout)
        return list((experiment.status.conditions if experiment.status else None) or [])

    is_experiment_created = _condition_check("Created")
    is_experiment_running = _condition_check("Running")
    is_experiment_restarting = _condition_check("Restarting")
    is_experiment_succeeded = _condition_check("Succeeded")
    is_experiment_failed = _condition_check("Failed")

    def wait_for_experiment_condition(
        self,
        name: str,
        namespace: str | None = None,
        expected_condition: str = "Succeeded",
        timeout: int = 600,
        polling_interval: int = 15,
        apiserver_timeout: int = DEFAULT_TIMEOUT,
    ) -> Any:
        """Wait until the Experiment has the condition ``expected_condition`` (default Succeeded); returns it as a
        ``V1beta1Experiment``. Prints the trials' progress at each look, as the SDK does. Between looks it follows
        the Experiment (a watch), so a change Katib writes is seen at once, not at the next ``polling_interval``.
        A local study has finished when ``tune()`` returns.

        Raises:
            UnsupportedParameter: ``expected_condition`` is not an Experiment condition (a ValueError).
            JobError: the Experiment failed while Failed is not expected, or it cannot be read (a RuntimeError).
            JobTimeout: ``timeout`` passed, or the Experiment ended without reaching the condition (a TimeoutError).
        """
        if expected_condition not in CONDITIONS:
            refuse(
                "expected_condition",
                f"{expected_condition!r} is not an Experiment condition",
                f"use one of {', '.join(CONDITIONS)}",
            )
        deadline = time.monotonic() + timeout
        while True:
            experiment = self.get_experiment(name, namespace, apiserver_timeout)
            ns = experiment.metadata.namespace if experiment.metadata and experiment.metadata.namespace else "local"
            conditions = self.get_experiment_conditions(name, experiment=experiment)
            _print_status(experiment)
            if _has(conditions, "Failed") and expected_condition != "Failed":  # the SDK's order: Failed first
                failed = next(c for c in conditions if c.type == "Failed" and c.status == "True")
                raise JobError(
                    f"Experiment {ns}/{name} is Failed: {failed.reason or ''} {failed.message or ''}".strip(),
                    fix=f"see `kubetune status --tune {name}` and the failed trials' logs",
                )
            if _has(conditions, expected_condition):
                return experiment
            if _has(conditions, "Succeeded") or self.backend == "local":
                # a finished Experiment's conditions no longer change: waiting longer cannot help
                raise JobTimeout(f"Experiment {ns}/{name} ended Succeeded without reaching {expected_condition}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise JobTimeout(
                    f"timeout waiting for Experiment {ns}/{name} to reach {expected_condition} ({timeout} s)",
                    fix="wait longer (timeout=...)",
                )
            with job_errors():
                version = experiment.metadata.resource_version if experiment.metadata else None
                self._tuning(namespace).wait_change(name, version, min(polling_interval, remaining))

    def get_optimal_hyperparameters(self, name: str, namespace: str | None = None, timeout: int = DEFAULT_TIMEOUT):
        """The best trial so far, as Katib's ``V1beta1OptimalTrial``: its name, its parameter assignments (Katib's
        parameter names, the spec path with ``-`` for ``.``) and its observation; None before a trial has an
        observation, as the SDK answers.

        Raises:
            JobError: no such Experiment, or the cluster could not be read (a RuntimeError).
        """
        status = self.get_experiment(name, namespace, timeout).status
        best = status.current_optimal_trial if status else None
        if best is None or best.observation is None or not best.observation.metrics:
            return None
        return best

    def delete_experiment(self, name: str, namespace: str | None = None, delete_options: Any = None) -> None:
        """Delete the Experiment (its trials' workspace claim, with every trial's output, is kept).

        Raises:
            UnsupportedParameter: a local study (kubetune never deletes one), or ``delete_options``.
            JobError: no such Experiment, one kubetune did not make, or a cluster error (a RuntimeError).
        """
        if self.backend == "local":
            refuse(
                "backend",
                "a local study is its output directory, which kubetune never deletes",
                "remove the directory yourself when you no longer need it",
            )
        if delete_options is not None:
            refuse("delete_options", "is not supported", "remove it")
        with job_errors():
            self._tuning(namespace).delete(name)

    def _tuning(self, namespace: str | None):
        """The Katib backend for ``namespace`` (default the client's, else the kubeconfig's), made once."""
        from kubetune.backends import base

        ns = namespace or self.namespace
        if ns not in self._backends:
            self._backends[ns] = base.tuning(namespace=ns, **self._connection)
        return self._backends[ns]


def _validate(raw: dict, overrides: list[str] | None):
    from kubetune.config.load import parse_spec

    try:
        return parse_spec(raw, overrides or [], source="tune()")
    except SpecError as e:
        # one line for a notebook's traceback, every problem named (SpecError's str is only a count)
        raise UnsupportedParameter(
            [("tune()", "; ".join(e.lines()), "fix the arguments (or overrides) named")]
        ) from None
    except KubetuneError as e:
        raise job_error(e) from None


def _has(conditions: list[Any], kind: str) -> bool:
    return any(c.type == kind and c.status == "True" for c in conditions)


def _print_status(experiment: Any) -> None:
    """The trials' progress, as the SDK's ``wait_for_experiment_condition`` prints it at each look."""
    st = experiment.status
    if st is None:
        return
    print(
        f"Experiment Trials status: {st.trials or 0} Trials, {st.trials_pending or 0} Pending Trials, "
        f"{st.trials_running or 0} Running Trials, {st.trials_succeeded or 0} Succeeded Trials, "
        f"{st.trials_failed or 0} Failed Trials, {st.trials_early_stopped or 0} EarlyStopped Trials, "
        f"{st.trial_metrics_unavailable or 0} MetricsUnavailable Trials",
        flush=True,
    )


# A local trial's state (tune.json's, Optuna's) -> the Experiment status's count and list of it
_STATES = {
    "complete": ("trialsSucceeded", "succeededTrialList"),
    "pruned": ("trialsEarlyStopped", "earlyStoppedTrialList"),
    "fail": ("trialsFailed", "failedTrialList"),
    "running": ("trialsRunning", "runningTrialList"),
    "waiting": ("trialsPending", "pendingTrialList"),
    "interrupted": ("trialsKilled", "killedTrialList"),  # its session died; it ran again as another trial
}


def _study_object(name: str, study: _Study) -> dict:
    """A local study as the Experiment object Katib would have written for it (its JSON form)."""
    from kubetune.backends.kubeflow.katib import parameters

    tune = study.spec.tune
    # spec_from_tune writes one, and a spec whose overrides dropped it (tune=null) is refused before a study is kept
    assert tune is not None
    path = study.out / "tune.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    trials = data.get("trials") or []
    status: dict[str, Any] = {"trials": len(trials)}
    for t in trials:
        count, listed = _STATES.get(t["state"], ("trialsPending", "pendingTrialList"))
        status[count] = status.get(count, 0) + 1
        status.setdefault(listed, []).append(_trial_name(t))
    conditions = [
        {"type": "Created", "status": "True", "reason": "ExperimentCreated", "message": "Experiment is created"}
    ]
    if study.error is not None:
        conditions += [
            {"type": "Running", "status": "False", "reason": "ExperimentRunning", "message": "Experiment is running"},
            {"type": "Failed", "status": "True", "reason": "ExperimentFailed", "message": study.error},
        ]
    else:
        done = sum(Counter(t["state"] for t in trials)[s] for s in ("complete", "pruned", "fail"))
        reason = "ExperimentMaxTrialsReached" if done >= tune.trials else "ExperimentSuggestionEndReached"
        conditions += [
            {"type": "Running", "status": "False", "reason": "ExperimentRunning", "message": "Experiment is running"},
            {"type": "Succeeded", "status": "True", "reason": reason, "message": "Experiment has succeeded"},
        ]
    status["conditions"] = conditions
    best = data.get("best")
    if best is not None:
        trial = next((t for t in trials if t["number"] == best["number"]), {"number": best["number"]})
        status["currentOptimalTrial"] = {
            "bestTrialName": _trial_name(trial),
            "parameterAssignments": [{"name": p.replace(".", "-"), "value": str(v)} for p, v in best["params"].items()],
            "observation": {"metrics": [{"name": data["objective"], "latest": str(best["value"])}]},
        }
    return {
        "apiVersion": "kubeflow.org/v1beta1",
        "kind": "Experiment",
        "metadata": {"name": name, "annotations": {"kubetune.io/study": str(study.out)}},
        "spec": {
            "objective": {"type": "minimize" if tune.minimize() else "maximize", "objectiveMetricName": tune.objective},
            "algorithm": {"algorithmName": tune.algorithm},
            "maxTrialCount": tune.trials,
            "parallelTrialCount": tune.parallel,
            "maxFailedTrialCount": tune.max_failed,
            "parameters": parameters(tune),
        },
        "status": status,
    }


def _trial_name(trial: dict) -> str:
    """A local trial's name: its directory's (as its run's output is named), else trial-NNN."""
    return Path(trial["dir"]).name if trial.get("dir") else f"trial-{trial['number']:03d}"
