"""Katib's ``KatibClient`` on kubetune: ``tune`` (its LLM form) translates its arguments into a job spec with a
tune section (:func:`~kubetune.compat.katib.translate.spec_from_tune`), which runs as a local Optuna study
(``backend="local"``, ``kubetune tune``'s) or is created on the cluster as a Katib Experiment whose trials are
kubetune's PyTorchJobs (``backend="kubeflow"``, ``kubetune submit --tune``'s); ``get_optimal_hyperparameters``
answers from either with Katib's own model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kubetune.compat.katib.translate import SDK_BASE_IMAGE, spec_from_tune
from kubetune.compat.kubeflow.errors import Problems, job_errors, refuse


class KatibClient:
    """Katib's ``KatibClient`` on kubetune: same constructor, ``tune``, ``get_optimal_hyperparameters`` and
    ``delete_experiment``.

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
        self._studies: dict[str, Path] = {}  # local: the study's directory of each tune() of this client

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

        Raises:
            UnsupportedParameter: an argument the spec cannot carry (before anything starts).
            JobError: the study or Experiment could not be run or created (the cluster refused it, trials failed,
                ...).
        """
        # the SDK's arguments, by name, as spec_from_tune takes them (the same names and defaults)
        arguments = {k: v for k, v in locals().items() if k not in ("self", "overrides")}
        from kubetune.config.load import parse_spec

        raw = spec_from_tune(**{**arguments, "namespace": namespace or self.namespace})
        if self.backend == "local" and raw["distributed"]["nodes"] != 1:
            refuse(
                "resources_per_trial.num_workers",
                f"{raw['distributed']['nodes']} nodes cannot run on one machine",
                "use num_workers=1 with backend='local' (num_procs_per_worker sets the processes), or "
                "backend='kubeflow'",
            )
        with job_errors():
            spec = parse_spec(raw, overrides or [])
            if self.backend == "local":
                from kubetune import tune

                _, out = tune.run(spec)
                self._studies[name] = out  # the name tune() was given (overrides may rename the spec)
                return
            self._tuning(namespace).submit(spec)

    def get_optimal_hyperparameters(self, name: str, namespace: str | None = None, timeout: int = 120):
        """The best trial so far, as Katib's ``V1beta1OptimalTrial`` (kubeflow-katib-api's model): its name, its
        parameter assignments (Katib's parameter names, the spec path with ``-`` for ``.``) and its objective; None
        before a trial has finished."""
        from kubeflow_katib_api import models as kt

        with job_errors():
            if self.backend == "local":
                return self._local_optimal(name)
            st = self._tuning(namespace).get(name).get("status") or {}
        best = st.get("currentOptimalTrial") or {}
        if not best.get("bestTrialName"):
            return None
        return kt.V1beta1OptimalTrial.from_dict(best)

    def _local_optimal(self, name: str):
        from kubeflow_katib_api import models as kt

        from kubetune.backends.kubeflow.katib import param_name

        out = self._studies.get(name)
        if out is None:
            refuse("name", f"no study {name!r} was run by this client", "pass the name given to tune()")
        data = json.loads((out / "tune.json").read_text())
        best = data.get("best")
        if best is None:
            return None
        trial = next((t for t in data["trials"] if t["number"] == best["number"]), {})
        return kt.V1beta1OptimalTrial(
            best_trial_name=Path(trial["dir"]).name if trial.get("dir") else f"trial-{best['number']:03d}",
            parameter_assignments=[
                kt.V1beta1ParameterAssignment(name=param_name(path), value=str(value))
                for path, value in best["params"].items()
            ],
            observation=kt.V1beta1Observation(
                metrics=[kt.V1beta1Metric(name=data["objective"], latest=str(best["value"]))]
            ),
        )

    def delete_experiment(self, name: str, namespace: str | None = None, delete_options: Any = None) -> None:
        """Delete the Experiment (its trials' workspace claim, with every trial's output, is kept)."""
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
        from kubetune.backends import base

        return base.tuning(namespace=namespace or self.namespace, **self._connection)
