"""Katib v0.19.0's admission rules for v1beta1 Experiments, restated (the Experiment CRD has no schema: what
Katib refuses is in its webhook, pkg/webhook/v1beta1/experiment/validator/validator.go and
validation_webhook.go at tag v0.19.0, after its defaulter, experiment_defaults.go). A fake, because no Katib
can run here; each rule names the Go check it restates. ``validate`` returns Katib's error lines, [] when
the Experiment would be admitted."""

from __future__ import annotations

import json
import re

# katib-config v0.19.0 (manifests/v1beta1/installs/katib-standalone/katib-config.yaml)
SUGGESTIONS = {"random", "tpe", "grid", "hyperband", "bayesianoptimization", "cmaes", "sobol", "multivariate-tpe",
               "enas", "darts", "pbt"}  # fmt: skip
EARLY_STOPPING = {"medianstop"}
MEDIANSTOP_SETTINGS = {"min_trials_required", "start_step"}  # medianstop/service.py's own check (at run time)
COLLECTORS = {"StdOut", "File", "TensorFlowEvent", "Custom", "Push"}  # PrometheusMetric: not in the default config
TRIAL_KINDS = {("kubeflow.org/v1", "PyTorchJob"), ("trainer.kubeflow.org/v1alpha1", "TrainJob"), ("batch/v1", "Job"),
               ("kubeflow.org/v1", "TFJob"), ("kubeflow.org/v1", "MPIJob"), ("kubeflow.org/v1", "XGBoostJob")}  # fmt: skip
NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?")  # unanchored at the end, as in the validator
META = re.compile(r"\$\{trialSpec\.(.+?)\}")
TRIAL_PARAM = re.compile(r"\$\{trialParameters\..+?\}")
INJECTION_LABEL = ("katib.kubeflow.org/metrics-collector-injection", "enabled")


def defaults(exp: dict) -> dict:
    """experiment_defaults.go's SetDefault (what the mutating webhook adds before validation)."""
    spec = exp.setdefault("spec", {})
    spec.setdefault("parallelTrialCount", 3)
    spec.setdefault("resumePolicy", "Never")
    mc = spec.setdefault("metricsCollectorSpec", {})
    mc.setdefault("collector", {}).setdefault("kind", "StdOut")
    for p in spec.get("parameters") or []:
        p.setdefault("feasibleSpace", {}).setdefault("distribution", "uniform")
    tt = spec.get("trialTemplate") or {}
    kind = (tt.get("trialSpec") or {}).get("kind")
    if tt.get("trialSpec") and kind in ("PyTorchJob", "TFJob", "XGBoostJob", "MPIJob"):
        tt.setdefault("successCondition", 'status.conditions.#(type=="Succeeded")#|#(status=="True")#')
        tt.setdefault("failureCondition", 'status.conditions.#(type=="Failed")#|#(status=="True")#')
        tt.setdefault("primaryPodLabels", {"training.kubeflow.org/job-role": "master"})
    return exp


def validate(exp: dict, namespace_labels: dict[str, str] | None = None) -> list[str]:
    """Katib's refusals of ``exp`` (after its defaults), in the validator's order; [] when admitted."""
    exp = defaults(json.loads(json.dumps(exp)))
    errors: list[str] = []
    labels = namespace_labels if namespace_labels is not None else dict([INJECTION_LABEL])
    if labels.get(INJECTION_LABEL[0]) != INJECTION_LABEL[1]:  # validation_webhook.go: the namespace's label
        return [f"the namespace lacks label {INJECTION_LABEL[0]}: {INJECTION_LABEL[1]}"]
    name = exp.get("metadata", {}).get("name", "")
    if not NAME.match(name) or len(name) > 40:
        errors.append("metadata.name: must start with a letter, and may not be longer than 40 characters")
    spec = exp["spec"]
    maxt, par, maxf = spec.get("maxTrialCount"), spec.get("parallelTrialCount"), spec.get("maxFailedTrialCount")
    if maxf is not None and maxf < 0:
        errors.append("spec.maxFailedTrialCount: should not be less than 0")
    if maxt is not None and maxt <= 0:
        errors.append("spec.maxTrialCount: must be greater than 0")
    if par is not None and par <= 0:
        errors.append("spec.parallelTrialCount: must be greater than 0")
    if maxt is not None and maxf is not None and maxf > maxt:
        errors.append("spec.maxFailedTrialCount: should be less than or equal to spec.maxTrialCount")
    if maxt is not None and par is not None and par > maxt:
        errors.append("spec.parallelTrialCount: should be less than or equal to spec.maxTrialCount")
    if spec.get("resumePolicy") not in ("", "Never", "LongRunning", "FromVolume"):
        errors.append("spec.resumePolicy: invalid ResumePolicyType")
    objective = spec.get("objective")
    if not objective:  # validateObjective: returns at once
        return errors + ["spec.objective: must be specified"]
    if objective.get("type") not in ("minimize", "maximize"):
        return errors + ["spec.objective.type: must be minimize or maximize"]
    if not objective.get("objectiveMetricName"):
        return errors + ["spec.objective.objectiveMetricName: must be specified"]
    if objective["objectiveMetricName"] in (objective.get("additionalMetricNames") or []):
        return errors + ["spec.objective.additionalMetricNames: should not contain spec.objective.objectiveMetricName"]
    algorithm = (spec.get("algorithm") or {}).get("algorithmName")
    if not algorithm:
        errors.append("spec.algorithm.algorithmName: must be specified")
    elif algorithm not in SUGGESTIONS:
        errors.append(f"unable to get Suggestion config data for algorithm {algorithm}")
    stop = spec.get("earlyStopping")
    if stop is not None:
        if not stop.get("algorithmName"):
            errors.append("spec.earlyStopping.algorithmName: must be specified")
        elif stop["algorithmName"] not in EARLY_STOPPING:
            errors.append(f"unable to get EarlyStopping config data for algorithm {stop['algorithmName']}")
        for s in stop.get("algorithmSettings") or []:  # medianstop's service refuses these when the trials run
            if s.get("name") not in MEDIANSTOP_SETTINGS:
                errors.append(f"unknown setting {s.get('name')} for algorithm medianstop")
    errors += _parameters(spec)
    errors += _trial_template(spec)
    errors += _collector(spec)
    return errors


def _parameters(spec: dict) -> list[str]:
    params, nas = spec.get("parameters"), spec.get("nasConfig")
    if not params and not nas:
        return ["spec.parameters or spec.nasConfig must be specified"]
    if params and nas:
        return ["only one of spec.parameters and spec.nasConfig can be specified"]
    errors = []
    for i, p in enumerate(params or []):
        kind, space = p.get("parameterType"), p.get("feasibleSpace") or {}
        where = f"spec.parameters[{i}]"
        if kind not in ("int", "double", "categorical", "discrete", "unknown"):
            errors.append(f"{where}.parameterType: {kind} is not supported")
        if space.get("distribution") not in ("", None, "uniform", "logUniform", "normal", "logNormal", "unknown"):
            errors.append(f"{where}.feasibleSpace.distribution: {space['distribution']} is not supported")
        if kind in ("int", "double"):
            if space.get("list"):
                errors.append(f"{where}.feasibleSpace.list is not supported for parameterType: {kind}")
            if space.get("max") is None or space.get("min") is None:
                errors.append(f"{where}.feasibleSpace.max or feasibleSpace.min must be specified for {kind}")
        if kind in ("categorical", "discrete") and any(space.get(k) is not None for k in ("max", "min", "step")):
            errors.append(f"{where}.feasibleSpace .max, .min and .step is not supported for parameterType: {kind}")
    return errors


def _trial_template(spec: dict) -> list[str]:
    tt = spec.get("trialTemplate")
    if tt is None:
        return ["spec.trialTemplate: must be specified"]
    errors = []
    if not tt.get("primaryContainerName"):
        errors.append("spec.trialTemplate.primaryContainerName: must be specified")
    if not tt.get("successCondition") or not tt.get("failureCondition"):
        errors.append("spec.trialTemplate: successCondition and failureCondition must be specified")
    if tt.get("trialParameters") is None:
        return errors + ["spec.trialTemplate.trialParameters: must be specified"]
    if not tt.get("trialSpec"):  # kubetune renders trialSpec (a configMap template is not restated here)
        return errors + ["spec.trialTemplate.trialSpec or spec.trialTemplate.configMap must be specified"]
    text = json.dumps(tt["trialSpec"])
    names = {p.get("name") for p in spec.get("parameters") or []}
    seen_names, seen_refs = set(), set()
    for p in tt["trialParameters"]:
        name, ref = p.get("name") or "", p.get("reference") or ""
        if not name or not ref or "{" in name or "}" in name:
            errors.append("spec.trialTemplate.trialParameters: name and reference must be specified")
            continue
        if name in seen_names:
            errors.append(f"parameter name {name} can't be duplicated in spec.trialTemplate.trialParameters")
        if ref in seen_refs:
            errors.append(f"parameter reference {ref} can't be duplicated in spec.trialTemplate.trialParameters")
        seen_names.add(name)
        seen_refs.add(ref)
        meta = META.fullmatch(ref)
        if meta:
            key = meta.group(1)
            if key not in ("Name", "Namespace", "Kind", "APIVersion") and not re.fullmatch(
                r"(Annotations|Labels)\[(.+)]", key
            ):
                errors.append(f"unknown meta reference {ref}")
        elif names and ref not in names:
            errors.append(f"parameter reference {ref} does not exist in spec.parameters")
        token = "${trialParameters." + name + "}"
        if token not in text:
            return errors + [f"parameter name: {name} in spec.trialParameters not found in spec.trialTemplate"]
        text = text.replace(token, "substituted")
    if TRIAL_PARAM.search(text):
        errors.append(f"parameters: {TRIAL_PARAM.findall(text)} in spec.trialTemplate not found in trialParameters")
    job = json.loads(text)
    meta = job.get("metadata") or {}
    if meta.get("name") or meta.get("namespace"):
        errors.append("metadata.name and metadata.namespace in spec.trialTemplate must be omitted")
    if not job.get("apiVersion") or not job.get("kind"):
        errors.append("APIVersion and Kind in spec.trialTemplate must be specified")
    elif (job["apiVersion"], job["kind"]) not in TRIAL_KINDS:  # katib-config's trialResources (the controller's)
        errors.append(f"the trial kind {job['kind']} is not in katib-config's trialResources")
    return errors


def _collector(spec: dict) -> list[str]:
    mc = spec.get("metricsCollectorSpec") or {}
    kind = (mc.get("collector") or {}).get("kind")
    if kind not in COLLECTORS:
        return [f"invalid metrics collector kind: {kind}"]
    errors = []
    for fmt in ((mc.get("source") or {}).get("filter") or {}).get("metricsFormat") or []:
        try:
            re.compile(fmt)
        except re.error as e:
            errors.append(f"invalid filter: {e}")
            continue
        if not re.match(r".*\(.*\).*\(.*\).*", fmt):
            errors.append("two top subexpressions are required in a metrics format")
    return errors


def collect(lines: list[str], metrics_format: str, names: list[str]) -> dict[str, list[float]]:
    """file-metricscollector's TEXT parsing: a line counts only if it holds a metric name; every match of the
    format gives (group 1: name, group 2: value), kept when the name is exactly a metric's."""
    pattern = re.compile(metrics_format)
    out: dict[str, list[float]] = {}
    for line in lines:
        if not any(n in line for n in names):
            continue
        for m in pattern.findall(line):
            name, value = m[0].strip(), m[1].strip()
            if name in names:
                out.setdefault(name, []).append(float(value))
    return out


# Katib v0.19.0's experiment controller: how it writes an Experiment's status from its trials
# (pkg/controller.v1beta1/experiment/util/status_util.go: updateTrialsSummary, UpdateExperimentStatusCondition;
# pkg/apis/controller/experiments/v1beta1/util.go: the Mark* functions and setCondition). A trial here is a dict:
# name, state (one of TRIAL_STATES), assignments ({parameter name: value}), metrics ([{name, latest, min, max}]).
TRIAL_STATES = {  # a trial's state -> the status's count and list, in updateTrialsSummary's order
    "Killed": ("trialsKilled", "killedTrialList"),
    "Failed": ("trialsFailed", "failedTrialList"),
    "Succeeded": ("trialsSucceeded", "succeededTrialList"),
    "EarlyStopped": ("trialsEarlyStopped", "earlyStoppedTrialList"),
    "Running": ("trialsRunning", "runningTrialList"),
    "MetricsUnavailable": ("trialMetricsUnavailable", "metricsUnavailableTrialList"),
    "Pending": ("trialsPending", "pendingTrialList"),
}


def controller_status(exp: dict, trials: list[dict], suggestion_done: bool = False) -> dict:
    """The status Katib's experiment controller writes for ``exp`` (its current status carried on) once its
    trials are ``trials``: counts and lists by state, the current optimal trial, and the conditions (Created at
    the first reconcile; then Running, or Succeeded / Failed with Running set False, as the Mark functions do)."""
    status = json.loads(json.dumps(exp.get("status") or {}))
    spec = exp["spec"]
    _set_condition(status, "Created", "True", "ExperimentCreated", "Experiment is created")
    for count, listed in TRIAL_STATES.values():
        status[count] = 0
        status.pop(listed, None)
    objective = spec["objective"]
    strategy = {s["name"]: s["value"] for s in objective.get("metricStrategies") or []}.get(
        objective["objectiveMetricName"], "latest"
    )
    best, best_value, goal_reached = None, None, False
    goal = objective.get("goal")
    for trial in trials:
        count, listed = TRIAL_STATES[trial["state"]]
        status[count] += 1
        status.setdefault(listed, []).append(trial["name"])
        metric = next((m for m in trial.get("metrics") or [] if m["name"] == objective["objectiveMetricName"]), None)
        if metric is None:
            continue
        value = float(metric.get(strategy if strategy in ("min", "max") else "latest") or metric["latest"])
        if best is None or (value < best_value if objective["type"] == "minimize" else value > best_value):
            best, best_value = trial, value
        if goal is not None and (best_value <= goal if objective["type"] == "minimize" else best_value >= goal):
            goal_reached = True
    status["trials"] = len(trials)
    if best is not None:
        status["currentOptimalTrial"] = {
            "bestTrialName": best["name"],
            "parameterAssignments": [{"name": k, "value": str(v)} for k, v in best["assignments"].items()],
            "observation": {"metrics": best["metrics"]},
        }
    if not _true(status, "Succeeded") and not _true(status, "Failed"):
        _mark(status, spec, goal_reached, suggestion_done)
    return status


def _mark(status: dict, spec: dict, goal_reached: bool, suggestion_done: bool) -> None:
    """UpdateExperimentStatusCondition."""
    finished = ("trialsSucceeded", "trialsFailed", "trialsKilled", "trialsEarlyStopped", "trialMetricsUnavailable")
    done = sum(status[k] for k in finished)
    failed = status["trialsFailed"] + status["trialMetricsUnavailable"]
    if goal_reached:
        _finish(
            status, "Succeeded", "ExperimentGoalReached", "Experiment has succeeded because Objective goal has reached"
        )
    elif spec.get("maxFailedTrialCount") is not None and failed and failed >= spec["maxFailedTrialCount"]:
        _finish(status, "Failed", "ExperimentFailed", "Experiment has failed because max failed count has reached")
    elif spec.get("maxTrialCount") is not None and done >= spec["maxTrialCount"]:
        _finish(
            status,
            "Succeeded",
            "ExperimentMaxTrialsReached",
            "Experiment has succeeded because max trial count has reached",
        )
    elif suggestion_done and status["trialsPending"] + status["trialsRunning"] == 0:
        message = "Experiment has succeeded because suggestion service has reached the end"
        _finish(status, "Succeeded", "ExperimentSuggestionEndReached", message)
    else:
        _set_condition(status, "Running", "True", "ExperimentRunning", "Experiment is running")


def _finish(status: dict, kind: str, reason: str, message: str) -> None:
    """MarkExperimentStatusSucceeded / MarkExperimentStatusFailed: Running set False, then the condition."""
    running = next((c for c in status.get("conditions") or [] if c["type"] == "Running"), None)
    if running is not None:
        _set_condition(status, "Running", "False", running.get("reason", ""), running.get("message", ""))
    _set_condition(status, kind, "True", reason, message)
    status["completionTime"] = _now()


def _set_condition(status: dict, kind: str, value: str, reason: str, message: str) -> None:
    """setCondition: nothing when neither the status nor the reason changes; else the condition moved last."""
    conditions = status.setdefault("conditions", [])
    current = next((c for c in conditions if c["type"] == kind), None)
    if current is not None and current["status"] == value and current.get("reason") == reason:
        return
    now = _now()
    kept = current is not None and current["status"] == value  # lastTransitionTime moves only with the status
    new = {"type": kind, "status": value, "reason": reason, "message": message, "lastUpdateTime": now}
    new["lastTransitionTime"] = current["lastTransitionTime"] if kept else now
    status["conditions"] = [c for c in conditions if c["type"] != kind] + [new]


def _true(status: dict, kind: str) -> bool:
    return any(c["type"] == kind and c["status"] == "True" for c in status.get("conditions") or [])


def _now() -> str:
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
