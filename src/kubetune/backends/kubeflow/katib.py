"""Pure builders: a spec's ``tune`` section → a Katib ``Experiment`` (kubeflow.org/v1beta1) whose trials are the
PyTorchJob (or the Trainer v2 TrainJob) kubetune renders for the spec, built with Katib's own typed models
(``kubeflow-katib-api``).

Each trial's values reach kubetune as ``--set PATH=VALUE`` on the pods' staging command (``kubetune fetch``),
which writes the trial's own spec into the trial's own staging directory; the trial's output is
``output.uri/trials/<trial name>``. Katib's StdOut metrics collector reads the primary pod's log: kubetune's
evaluation lines (``epoch 1, step 50: eval_loss 0.52 eval_accuracy 0.81``, lm-eval's ``step 50: lm_eval
arc_easy/acc 0.41``) through a metrics format of two groups (name, value), and the objective is the latest
value (the evaluation after training). Early stopping is Katib's medianstop; the algorithms have the same
names in Katib as in the spec (Katib's Optuna and Goptuna suggestion services).
"""

from __future__ import annotations

import copy
import math
import shlex
from dataclasses import dataclass

from kubetune.artifacts.output import Output
from kubetune.backends.cluster.objects import CONTAINER, stage_dir, to_yaml
from kubetune.config import JobSpec
from kubetune.config.load import load_yaml
from kubetune.config.tune import ParamSpec, TuneSpec
from kubetune.errors import KubetuneError, SpecError, short

KATIB_API = ("kubeflow.org", "v1beta1", "experiments")
# kubetune's evaluation lines: a metric's name (eval_*, train_*, or an lm-eval task/metric) and its value
METRICS_FORMAT = (
    r"((?:eval|train)_[A-Za-z0-9_]+|[A-Za-z0-9_.-]+/[A-Za-z0-9_./-]+)[ =]([-+]?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?)"
)
MAX_NAME = 40  # Katib's webhook: an Experiment's name (its trials' and suggestion's names derive from it)
INJECTION_LABEL = "katib.kubeflow.org/metrics-collector-injection"  # the namespace label Katib's webhook needs
TRIAL_NAME = "trialName"  # the trial parameter that carries the trial's name (``${trialSpec.Name}``)
# When Katib counts a trial job as finished (GJSON over the job): a PyTorchJob's conditions (as Katib's SDK sets
# them), a TrainJob's (Trainer v2's Complete and Failed, as the Kubeflow SDK's OptimizerClient sets them)
CONDITIONS = {
    "PyTorchJob": (
        'status.conditions.#(type=="Succeeded")#|#(status=="True")#',
        'status.conditions.#(type=="Failed")#|#(status=="True")#',
    ),
    "TrainJob": (
        'status.conditions.#(type=="Complete")#|#(status=="True")#',
        'status.conditions.#(type=="Failed")#|#(status=="True")#',
    ),
}
# A TrainJob's pods (Trainer v2's torch runtimes): JobSet's replicated job "node", its container "node"
TRAINJOB_CONTAINER = "node"


@dataclass(frozen=True)
class RenderedTune:
    """What a study on Katib needs, in creation order: the spec's ConfigMap (the trials' shared spec), the
    workspace claim, the Experiment."""

    config_map: dict
    pvc: dict | None
    experiment: dict

    def objects(self) -> list[dict]:
        return [self.config_map, *([self.pvc] if self.pvc else []), self.experiment]

    def to_yaml(self) -> str:
        return to_yaml(self.objects())


def param_name(path: str) -> str:
    """A search-space path as a Katib parameter and trial-parameter name: ``training.learning_rate`` ->
    ``training-learning_rate`` (Katib substitutes ``${trialParameters.NAME}`` for names of letters, digits,
    ``-`` and ``_``)."""
    return path.replace(".", "-")


def check_values(spec: JobSpec, target: str) -> None:
    """Refuse a choice value that Katib's text substitution cannot carry to the trial intact. Katib's trial
    controller puts each value into the trial template's JSON text as it is (``strings.Replace`` of
    ``${trialParameters.NAME}``, pkg/controller.v1beta1/experiment/manifest/generator.go) and parses the result:
    a ``"`` would end the JSON string (``x", "--set", "model.uri=..."`` adds arguments to the trial's command), a
    backslash starts an escape, a control character is not valid JSON, and a ``${trialParameters.`` would be
    substituted in turn. A TrainJob trial's values then sit in one single-quoted shell line, where a ``'`` would
    end the quotes. Last, ``kubetune fetch --set PATH=VALUE`` reads the value as YAML: a string that reads back
    as something else (``yes``, ``8``, ``a: b``, ``x #y``, a leading space) would reach the trial changed. Ranges
    are safe: Katib's suggestion writes their values as numbers.

    Raises:
        KubetuneError: the first such value, naming its tune.space path, the value and the fix.
    """
    for path, param in spec.tune.space.items() if spec.tune else ():
        for value in param.values or []:
            text = _text(value)
            why = _unsafe(text, target)
            if why is None and isinstance(value, str) and _as_set_reads(text) != value:
                why = f"YAML that `kubetune fetch --set` would read as {short(repr(_as_set_reads(text)), 40)}"
            if why:
                raise KubetuneError(
                    f"the choice {short(repr(text), 60)} holds {why}, which Katib's text substitution into the "
                    f"{'TrainJob' if target == 'trainjob' else 'PyTorchJob'} trial cannot carry intact",
                    field=f"tune.space.{path}",
                    fix="drop that from the value (or tune it locally, with kubetune tune)"
                    + (", or use --target pytorchjob (no shell between Katib and kubetune)" if why == QUOTE else ""),
                )


QUOTE = "a ' (quote)"


def _unsafe(text: str, target: str) -> str | None:
    """What in ``text`` breaks out of its place in the trial template, or None."""
    if '"' in text:
        return 'a " (double quote)'
    if "\\" in text:
        return "a \\ (backslash)"
    control = next((c for c in text if ord(c) < 0x20), None)
    if control is not None:
        return f"a control character ({control!r})"
    if "${trialParameters." in text:
        return "a ${trialParameters. reference"
    if target == "trainjob" and "'" in text:
        return QUOTE
    return None


def _as_set_reads(text: str):
    """``text`` as ``--set PATH=text`` reads it (``config.load``): YAML, or the text itself where it is not YAML."""
    try:
        return load_yaml(text, "--set") if text.strip() else ""
    except SpecError:
        return text


def build_experiment(spec: JobSpec, job: dict, namespace: str, retain: bool = False) -> dict:
    """The Experiment of ``spec``'s tune section whose trials are ``job`` (``trial_job``); ``retain``: Katib keeps
    each finished trial's job and pods instead of deleting them (the trial template's ``retain``)."""
    from kubeflow_katib_api import models as kt

    tune = spec.tune
    assert tune is not None  # render_tune refused a spec without one
    parameters = [_parameter(path, p) for path, p in tune.space.items()]
    trial_parameters = [
        kt.V1beta1TrialParameterSpec(name=param_name(path), reference=param_name(path), description=f"spec {path}")
        for path in tune.space
    ] + [kt.V1beta1TrialParameterSpec(name=TRIAL_NAME, reference="${trialSpec.Name}", description="the trial")]
    stop = tune.early_stopping
    early = None
    if stop is not None:
        if "/" in tune.objective:
            # task/metric: an lm-eval objective, which space.check_search (run before this) found among the
            # evaluation section's tasks (no registered task reports a metric with a '/')
            assert spec.evaluation is not None
            every = spec.evaluation.every
        else:
            every = spec.training.eval_every
        early = kt.V1beta1EarlyStoppingSpec(
            algorithm_name="medianstop",
            algorithm_settings=[
                kt.V1beta1EarlyStoppingSetting(name="min_trials_required", value=str(stop.min_trials)),
                # medianstop counts evaluations reported, not steps
                kt.V1beta1EarlyStoppingSetting(
                    name="start_step", value=str(max(1, math.ceil(stop.warmup_steps / every)) if every else 1)
                ),
            ],
        )
    settings = (
        [] if tune.algorithm == "grid" else [kt.V1beta1AlgorithmSetting(name="random_state", value=str(tune.seed))]
    )
    experiment = kt.V1beta1Experiment(
        api_version="kubeflow.org/v1beta1",
        kind="Experiment",
        metadata={"name": spec.name, "namespace": namespace, "labels": {"app.kubernetes.io/managed-by": "kubetune"}},
        spec=kt.V1beta1ExperimentSpec(
            objective=kt.V1beta1ObjectiveSpec(
                type="minimize" if tune.minimize() else "maximize",
                objective_metric_name=tune.objective,
                metric_strategies=[kt.V1beta1MetricStrategy(name=tune.objective, value="latest")],
            ),
            algorithm=kt.V1beta1AlgorithmSpec(algorithm_name=tune.algorithm, algorithm_settings=settings or None),
            early_stopping=early,
            # Katib refuses more at once, or more failures, than trials
            parallel_trial_count=min(tune.parallel, tune.trials),
            max_trial_count=tune.trials,
            max_failed_trial_count=min(tune.max_failed, tune.trials),
            parameters=parameters,
            metrics_collector_spec=kt.V1beta1MetricsCollectorSpec(
                collector=kt.V1beta1CollectorSpec(kind="StdOut"),
                source=kt.V1beta1SourceSpec(filter=kt.V1beta1FilterSpec(metrics_format=[METRICS_FORMAT])),
            ),
            trial_template=kt.V1beta1TrialTemplate(
                primary_container_name=TRAINJOB_CONTAINER if job["kind"] == "TrainJob" else CONTAINER,
                primary_pod_labels=_primary_pod(job),
                success_condition=CONDITIONS[job["kind"]][0],
                failure_condition=CONDITIONS[job["kind"]][1],
                trial_parameters=trial_parameters,
                trial_spec=trial_job(spec, job),
                retain=True if retain else None,  # absent means false to Katib
            ),
        ),
    )
    return experiment.model_dump(by_alias=True, exclude_none=True, mode="json")


def parameters(tune: TuneSpec) -> list[dict]:
    """The Experiment's ``spec.parameters`` for the tune section ``tune`` (Katib's JSON form): each dimension as a
    Katib search space, named by ``param_name``."""
    return [
        _parameter(path, p).model_dump(by_alias=True, exclude_none=True, mode="json") for path, p in tune.space.items()
    ]


def _parameter(path: str, p: ParamSpec):
    from kubeflow_katib_api import models as kt

    if p.type == "choice":
        values = p.values
        assert values is not None  # a choice has values (the spec's validation)
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        return kt.V1beta1ParameterSpec(
            name=param_name(path),
            parameter_type="discrete" if numeric else "categorical",
            feasible_space=kt.V1beta1FeasibleSpace(list=[_text(v) for v in values]),
        )
    assert p.low is not None and p.high is not None  # a range has both ends (the spec's validation)
    cast: type[int] | type[float] = int if p.type == "int" else float
    return kt.V1beta1ParameterSpec(
        name=param_name(path),
        parameter_type="int" if p.type == "int" else "double",
        feasible_space=kt.V1beta1FeasibleSpace(
            min=_text(cast(p.low)),
            max=_text(cast(p.high)),
            step=_text(cast(p.step)) if p.step is not None else None,
            distribution="logUniform" if p.log else "uniform",
        ),
    )


def _text(v) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else repr(v) if isinstance(v, float) else str(v)


def _primary_pod(job: dict) -> dict[str, str]:
    """The pod whose log holds the metrics: the Master (rank 0), worker 0 of an elastic job, a TrainJob's node 0."""
    if job["kind"] == "TrainJob":
        return {"jobset.sigs.k8s.io/replicatedjob-name": "node", "batch.kubernetes.io/job-completion-index": "0"}
    if "Master" in job["spec"]["pytorchReplicaSpecs"]:
        return {"training.kubeflow.org/job-role": "master"}
    return {"training.kubeflow.org/replica-type": "worker", "training.kubeflow.org/replica-index": "0"}


def trial_job(spec: JobSpec, job: dict) -> dict:
    """The PyTorchJob or TrainJob as a trial template: staged into the trial's own directory with the trial's
    values set (``kubetune fetch --set``), writing to the trial's own output."""
    trial = copy.deepcopy(job)
    trial["metadata"] = {k: v for k, v in trial["metadata"].items() if k in ("labels", "annotations")}
    stage = stage_dir(spec)
    own = f"{stage}/${{trialParameters.{TRIAL_NAME}}}"
    assert spec.tune is not None  # build_experiment's spec (render_tune refused one without)
    sets = [f"{path}=${{trialParameters.{param_name(path)}}}" for path in spec.tune.space]
    sets.append(f"output.uri={Output.for_spec(spec).prefix}/trials/${{trialParameters.{TRIAL_NAME}}}")
    moved = {stage: own, f"{stage}/job.yaml": f"{own}/job.yaml"}

    def retarget(command: list[str]) -> list[str]:
        command = [moved.get(arg, arg) for arg in command]
        if command[:2] != ["kubetune", "fetch"]:
            return command
        end = command.index("&&") if "&&" in command else len(command)
        return command[:end] + [a for item in sets for a in ("--set", item)] + command[end:]

    if trial["kind"] == "TrainJob":
        # one shell line: `kubetune fetch ... && exec kubetune launch ...`; Katib puts the values in as text, so
        # every word is quoted for the shell
        trainer = trial["spec"]["trainer"]
        words = retarget(shlex.split(trainer["command"][-1]))
        trainer["command"] = [*trainer["command"][:-1], " ".join(w if w == "&&" else shlex.quote(w) for w in words)]
        return trial
    for replica in trial["spec"]["pytorchReplicaSpecs"].values():
        pod = replica["template"]["spec"]
        for container in pod.get("initContainers", []) + pod["containers"]:
            container["command"] = retarget(container["command"])
    return trial


def tune_warnings(spec: JobSpec, namespace: str) -> list[str]:
    """What a render cannot check about the cluster, one line each."""
    return [
        f"Katib admits an Experiment only in a namespace labelled {INJECTION_LABEL}=enabled: "
        f"kubectl label namespace {namespace} {INJECTION_LABEL}=enabled (deploy/install.sh --with katib does it "
        "for the kubetune namespace)"
    ]
