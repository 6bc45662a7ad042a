"""The Katib backend: `kubetune submit|status|delete --tune` on a cluster with Katib. It creates what
``manifests.render_tune`` builds for a spec's tune section (the Experiment, the spec's ConfigMap owned by it, the
workspace claim its trials share, which is not owned), reads the Experiment's progress and best trial as Katib
writes them, and deletes the Experiment (Katib removes its trials and their jobs; the ConfigMap goes with it).

Like the job backend: a server-side dry run before anything is created (Katib's webhooks answer it), an
Experiment of the same name refused unless ``replace``, and nothing deleted that kubetune did not make.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from kubetune.backends.cluster.api import ClusterConnection
from kubetune.backends.kubeflow import manifests
from kubetune.backends.kubeflow.backend import OwnedObjects
from kubetune.backends.kubeflow.katib import KATIB_API, TRIAL_NAME
from kubetune.config import JobSpec
from kubetune.errors import KubetuneError

KIND = "Experiment"
RESOURCE = f"{KATIB_API[2]}.{KATIB_API[0]}"
MANAGED = ("app.kubernetes.io/managed-by", "kubetune")  # what build_experiment labels an Experiment with
# Katib's Experiment conditions, the one that decides the phase first
PHASES = ("Succeeded", "Failed", "Restarting", "Running", "Created")
# status.<key> -> the count `status --tune` shows
COUNTS = {
    "trials": "trials",
    "trialsPending": "pending",
    "trialsRunning": "running",
    "trialsSucceeded": "succeeded",
    "trialsEarlyStopped": "early stopped",
    "trialsFailed": "failed",
    "trialsKilled": "killed",
    "trialsMetricsUnavailable": "metrics unavailable",
}


@dataclass
class TuneStatus:
    """What `kubetune status --tune` prints: the Experiment's phase, its trials by state, the best trial so far
    (its values by spec path, its objective and other metrics, where its output is), and why it failed."""

    name: str
    namespace: str
    kind: str
    phase: str  # Created, Running, Restarting, Succeeded, Failed; Pending before Katib has written a condition
    objective: str | None = None
    goal: float | None = None
    trials: dict[str, int] = field(default_factory=dict)
    max_trials: int | None = None
    best_trial: str | None = None
    best_values: dict[str, str] = field(default_factory=dict)  # spec path -> the value Katib assigned
    best_metrics: dict[str, dict[str, str]] = field(default_factory=dict)  # name -> {latest, min, max}
    best_output: str | None = None
    running: list[str] = field(default_factory=list)
    reason: str | None = None
    message: str | None = None


def spec_path(parameter: str) -> str:
    """A Katib parameter name back to the spec path it stands for (``katib.param_name``'s inverse: spec paths
    have no ``-``)."""
    return parameter.replace("-", ".")


def tune_status(exp: dict, namespace: str) -> TuneStatus:
    """The status of the Experiment ``exp`` as Katib wrote it."""
    st = exp.get("status") or {}
    spec = exp.get("spec") or {}
    true = {c.get("type"): c for c in st.get("conditions") or [] if str(c.get("status")) == "True"}
    phase = next((p for p in PHASES if p in true), "Pending")
    objective = spec.get("objective") or {}
    result = TuneStatus(
        name=exp["metadata"]["name"],
        namespace=namespace,
        kind=KIND,
        phase=phase,
        objective=objective.get("objectiveMetricName"),
        goal=objective.get("goal"),
        trials={label: int(st[key]) for key, label in COUNTS.items() if st.get(key)},
        max_trials=spec.get("maxTrialCount"),
        running=list(st.get("runningTrialList") or []),
    )
    best = st.get("currentOptimalTrial") or {}
    if best.get("bestTrialName"):
        result.best_trial = best["bestTrialName"]
        result.best_values = {
            spec_path(a["name"]): a.get("value") for a in best.get("parameterAssignments") or [] if a.get("name")
        }
        result.best_metrics = {
            m["name"]: {k: m[k] for k in ("latest", "min", "max") if m.get(k) is not None}
            for m in (best.get("observation") or {}).get("metrics") or []
            if m.get("name")
        }
        result.best_output = _trial_output(spec, result.best_trial)
    if phase in ("Failed", "Restarting", "Pending"):
        why: dict = true.get(phase) or next(
            (c for c in st.get("conditions") or [] if c.get("reason") or c.get("message")), {}
        )
        result.reason, result.message = why.get("reason"), why.get("message")
    return result


def _trial_output(spec: dict, trial: str) -> str | None:
    """Where trial ``trial`` writes: the ``output.uri=`` its trial template sets (``katib.trial_job``)."""
    import json
    import re

    text = json.dumps((spec.get("trialTemplate") or {}).get("trialSpec") or {})
    found = re.search(r"output\.uri=([^\s'\"]+)", text)
    return found.group(1).replace(f"${{trialParameters.{TRIAL_NAME}}}", trial) if found else None


def is_own(exp: dict) -> bool:
    return ((exp.get("metadata") or {}).get("labels") or {}).get(MANAGED[0]) == MANAGED[1]


class KatibBackend(OwnedObjects, ClusterConnection):
    """Runs specs' tune sections as Katib Experiments in one namespace."""

    def __init__(self, namespace: str | None = None, kubeconfig: str | None = None, context: str | None = None):
        super().__init__(namespace, kubeconfig, context)
        self._connection = {"kubeconfig": kubeconfig, "context": context}

    def _fix(self, case: str, name: str | None) -> str:
        return {
            "refused": "change the spec's tune section the message names",
            "forbidden": (
                f"ask for create, get and delete on {RESOURCE}, configmaps and persistentvolumeclaims in this "
                "namespace, or set kubernetes.namespace / --namespace"
            ),
            "not served": "Katib is not installed: deploy/install.sh --with katib",
            "not found": "check the name with `kubectl get experiments` and --namespace",
            "exists": f"pass --replace, or `kubetune delete --tune {name}` first",
            "invalid": "check the spec's tune section",
        }[case]

    # ---- submit ----
    def submit(
        self, spec: JobSpec, replace: bool = False, target: str = "pytorchjob", retain_trials: bool = False
    ) -> str:
        """Create the Experiment for ``spec``'s tune section (its trials: ``target`` jobs), the spec's ConfigMap
        owned by it, and the workspace claim the trials share. Returns the Experiment's name. ``retain_trials``:
        Katib keeps each finished trial's job and pods (the trial template's ``retain``), as the Katib SDK's
        ``tune(retain_trials=True)`` asks.

        Raises:
            KubetuneError: the spec cannot be tuned on a cluster, Katib refused it, or a cluster error (one line).
        """
        rendered = manifests.render_tune(spec, self.namespace, target, retain_trials=retain_trials)
        exp = rendered.experiment
        name = exp["metadata"]["name"]
        self._check_trials(spec, exp, target)
        # Katib's webhooks answer a dry run before anything is created (an Experiment has no schema to prune)
        checked = self._dry_run_create(KATIB_API, exp, exists_ok=replace) is not None
        if replace and not checked:
            self._refuse_foreign(self.get(name), name)
            self._delete_and_wait(KATIB_API, KIND, name, 120)
            self._dry_run_create(KATIB_API, exp)
        with self._errors("create", RESOURCE, name):
            created = self.custom.create_namespaced_custom_object(*KATIB_API[:2], self.namespace, KATIB_API[2], exp)
        owner = {
            "apiVersion": f"{KATIB_API[0]}/{KATIB_API[1]}",
            "kind": KIND,
            "name": name,
            "uid": created["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
        try:
            cm = rendered.config_map
            self._create_owned({**cm, "metadata": {**cm["metadata"], "ownerReferences": [owner]}}, replace)
            if rendered.pvc:
                self._ensure_claim(rendered.pvc, name)
        except KubetuneError:
            # Never leave an Experiment whose trials cannot find their spec.
            with contextlib.suppress(Exception):
                self.custom.delete_namespaced_custom_object(*KATIB_API[:2], self.namespace, KATIB_API[2], name)
            raise
        return name

    def _check_trials(self, spec: JobSpec, exp: dict, target: str) -> None:
        """What Katib's own webhook does not check (its validator dry-runs batch Jobs only): that the cluster runs
        the trials' kind, and admits the trial job (its CRD's schema and pruning, the operator's webhook, a TrainJob's
        runtime), through the job backend's own checks on the template under a placeholder name. Otherwise every
        trial would fail at its creation, after the Experiment was accepted."""
        from kubetune.backends.kubeflow.backend import KubeflowBackend

        jobs = KubeflowBackend(self.namespace, target=target, **self._connection)
        if target == "trainjob":
            jobs._check_runtime(spec.kubernetes.runtime)
        trial = exp["spec"]["trialTemplate"]["trialSpec"]
        jobs._check_served({**trial, "metadata": {**trial["metadata"], "name": f"{exp['metadata']['name']}-trial"}})

    def _refuse_foreign(self, exp: dict, name: str) -> None:
        if not is_own(exp):
            raise KubetuneError(
                f"Experiment '{name}' in namespace '{self.namespace}' was not made by kubetune (it lacks the label "
                f"{MANAGED[0]}={MANAGED[1]}), so kubetune leaves it alone",
                fix="rename the job (name), or delete that Experiment with kubectl",
            )

    # ---- status ----
    def get_raw(self, name: str) -> dict:
        return self.custom.get_namespaced_custom_object(*KATIB_API[:2], self.namespace, KATIB_API[2], name)

    def get(self, name: str) -> dict:
        with self._errors("get", RESOURCE, name):
            return self.get_raw(name)

    def experiments(self) -> list[dict]:
        """Every Experiment of the namespace, kubetune's or not, as Katib's SDK lists them.

        Raises:
            KubetuneError: Katib is not installed, or the cluster cannot be read (one line).
        """
        with self._errors("list", RESOURCE):
            listed = self.custom.list_namespaced_custom_object(*KATIB_API[:2], self.namespace, KATIB_API[2])
        return list(listed.get("items") or [])

    def wait_change(self, name: str, version: str | None, timeout: float) -> None:
        """Block until the Experiment ``name`` changes from its ``version`` (Katib wrote its status, or it was
        deleted), or ``timeout`` seconds pass; returns either way, without reading it (a watch, not a poll)."""
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        if timeout < 1 or not version:  # a watch's timeout is whole seconds
            time.sleep(max(0.0, timeout))
            return
        w = watch.Watch()
        with self._errors("watch", RESOURCE, name):
            try:
                for _ in w.stream(
                    self.custom.list_namespaced_custom_object,
                    *KATIB_API[:2],
                    self.namespace,
                    KATIB_API[2],
                    field_selector=f"metadata.name={name}",
                    resource_version=version,
                    timeout_seconds=int(timeout),
                ):
                    w.stop()  # any event: a change since `version`
                    return
            except ApiException as e:
                if e.status != 410:  # 410 Gone: `version` is too old to follow; the caller reads it again
                    raise

    def status(self, name: str) -> TuneStatus:
        """The Experiment's phase, trials by state and best trial so far.

        Raises:
            KubetuneError: no such Experiment, or the cluster cannot be read (one line).
        """
        return tune_status(self.get(name), self.namespace)

    # ---- delete ----
    def delete(self, name: str, storage: bool = False) -> list[str]:
        """Delete the Experiment (Katib deletes its trials and their jobs; its ConfigMap goes with it). The
        workspace claim, which holds every trial's output, stays unless ``storage``.

        Returns:
            What was kept or removed, one line each.

        Raises:
            KubetuneError: no such Experiment, one kubetune did not make, or a cluster error.
        """
        self._refuse_foreign(self.get(name), name)
        with self._errors("delete", RESOURCE, name):
            self.custom.delete_namespaced_custom_object(
                *KATIB_API[:2], self.namespace, KATIB_API[2], name, propagation_policy="Background"
            )
        return self._drop_claim(name, storage, "every trial's output", f"kubetune delete --tune {name}")
