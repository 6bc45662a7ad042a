"""The serving backend: `kubetune submit|status|delete --serve` on a cluster with KServe. It creates what
``serving.render_serve`` builds for a finished job's export (the ServiceAccount that names the job's
storage Secrets, then the InferenceService), reads the InferenceService's readiness and URLs, and
deletes what kubetune made for it. A Secret is never read, created, copied or deleted here: KServe's
storage initializer finds the job's own Secrets through the ServiceAccount, by name.

Like the Kubeflow backend: a server-side dry run before anything is created, an object of the same
name refused unless ``replace``, and nothing deleted that does not carry kubetune's serving labels.
API errors are translated at the boundary (``cluster.api.ClusterConnection``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from kubetune.backends.cluster.api import ClusterConnection
from kubetune.backends.kserve import manifests as serving
from kubetune.backends.kserve.manifests import ISVC_API, SERVES_LABEL
from kubetune.backends.kubeflow.backend import missing_paths
from kubetune.config import JobSpec
from kubetune.errors import KubetuneError

KIND = "InferenceService"
RESOURCE = f"{ISVC_API[2]}.{ISVC_API[0]}"
# The labels serving._labels puts on every object kubetune makes to serve an export: delete and
# --replace touch an object only when it has them (and names this InferenceService as its instance).
OWN_LABELS = {"app.kubernetes.io/name": "kubetune", "app.kubernetes.io/component": "serving"}
INSTANCE = "app.kubernetes.io/instance"


@dataclass
class ServeStatus:
    """What `kubetune status --serve` prints: whether the InferenceService is Ready, where it answers,
    its predictor's replicas, and why it is not ready."""

    name: str
    namespace: str
    kind: str
    phase: str  # Ready, NotReady, or Pending before KServe has written a Ready condition
    url: str | None = None  # status.url: the external (or cluster-local) URL
    address: str | None = None  # status.address.url: the address inside the cluster
    replicas: dict[str, int] = field(default_factory=dict)  # the predictor Deployment's (Standard mode)
    model: str | None = None  # status.modelStatus.states.activeModelState
    reason: str | None = None
    message: str | None = None
    job: str | None = None  # the job whose export it serves

    @property
    def ready(self) -> bool:
        return self.phase == "Ready"


def is_own(obj: dict, name: str) -> bool:
    """Whether ``obj`` was made by kubetune to serve the InferenceService ``name``."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in OWN_LABELS.items()) and labels.get(INSTANCE) == name


def serve_status(isvc: dict, namespace: str, replicas: dict[str, int] | None = None) -> ServeStatus:
    """The status of the InferenceService ``isvc`` as KServe wrote it (``replicas``: its predictor's)."""
    st = isvc.get("status") or {}
    conditions = st.get("conditions") or []
    ready = next((c for c in conditions if c.get("type") == "Ready"), None)
    phase = "Pending" if ready is None else "Ready" if str(ready.get("status")) == "True" else "NotReady"
    model = st.get("modelStatus") or {}
    result = ServeStatus(
        name=isvc["metadata"]["name"],
        namespace=namespace,
        kind=KIND,
        phase=phase,
        url=st.get("url"),
        address=(st.get("address") or {}).get("url"),
        replicas=replicas or {},
        model=(model.get("states") or {}).get("activeModelState"),
        job=(isvc["metadata"].get("labels") or {}).get(SERVES_LABEL),
    )
    if phase != "Ready":
        # KServe carries a component's failure up to Ready; where it has not (yet), the first condition
        # that is False says why, and a model that failed to load says it in lastFailureInfo.
        failing = [c for c in conditions if str(c.get("status")) == "False" and (c.get("reason") or c.get("message"))]
        failure = model.get("lastFailureInfo") or {}
        why = next((c for c in failing if c.get("type") == "Ready"), None) or (failing[0] if failing else failure)
        result.reason, result.message = why.get("reason"), why.get("message")
    return result


class KServeBackend(ClusterConnection):
    """Serves finished jobs' exports as KServe InferenceServices in one namespace."""

    def _fix(self, case: str, name: str | None) -> str:
        return {
            "refused": "change the spec's serving section the message names",
            "forbidden": (
                f"ask for create, get, update and delete on {RESOURCE} and serviceaccounts in this namespace "
                "(deploy/rbac grants neither), or set kubernetes.namespace / --namespace"
            ),
            "not served": "KServe is not installed: deploy/install.sh --with kserve",
            "not found": "check the name with `kubectl get inferenceservices` and --namespace",
            "exists": f"pass --replace, or `kubetune delete --serve {name}` first",
            "invalid": "check the spec's serving section",
        }[case]

    # ---- submit ----
    def submit(self, spec: JobSpec, replace: bool = False) -> str:
        """Create the InferenceService serving the export of ``spec``, and first the ServiceAccount
        that names the job's storage Secrets where it needs them. Returns the InferenceService's name.

        Before anything is created, a server-side dry run shows what the cluster would store: a field
        an older KServe would drop is refused in one line, as is an existing InferenceService of that
        name (``replace``: delete it first, when kubetune made it).

        Raises:
            KubetuneError: the export cannot be served, or the cluster refused (one line).
        """
        rendered = serving.render_serve(spec, self.namespace)
        isvc = rendered.inference_service
        name = isvc["metadata"]["name"]
        checked = self._check_served(isvc, exists_ok=replace)
        if replace and not checked:
            self._refuse_foreign(self.get(name), name)
            self._delete_and_wait(ISVC_API, KIND, name, 120)  # KServe's finalizer runs first
            self._check_served(isvc)
        created = self._ensure_service_account(rendered.service_account, name) if rendered.service_account else None
        try:
            with self._errors("create", RESOURCE, name):
                self.custom.create_namespaced_custom_object(*ISVC_API[:2], self.namespace, ISVC_API[2], isvc)
        except KubetuneError:
            # Never leave a ServiceAccount this call made behind an InferenceService that is not there.
            if created:
                with contextlib.suppress(Exception):
                    self.core.delete_namespaced_service_account(created, self.namespace)
            raise
        return name

    def _check_served(self, isvc: dict, exists_ok: bool = False) -> bool:
        """Server-side dry run of the InferenceService: every field sent must come back (a CRD schema
        prunes what it does not know, silently). Returns False, checking nothing, when one of that
        name exists and ``exists_ok``."""
        stored = self._dry_run_create(ISVC_API, isvc, exists_ok)
        if stored is None:
            return False
        dropped = missing_paths(isvc.get("spec") or {}, stored.get("spec") or {}, "spec")
        if dropped:
            raise KubetuneError(
                f"the cluster would drop {', '.join(dropped[:3])}{' ...' if len(dropped) > 3 else ''} from the "
                "InferenceService: the cluster's KServe is older than the v0.20.0 kubetune renders for",
                fix="upgrade KServe: deploy/install.sh --with kserve",
            )
        return True

    def _ensure_service_account(self, account: dict, isvc: str) -> str | None:
        """Create the ServiceAccount, or bring one kubetune made earlier for this InferenceService up to
        date (a deletion that stopped half-way leaves it). One of that name that kubetune did not make
        for it is never touched. Returns its name when this call created it."""
        from kubernetes.client.exceptions import ApiException

        name = account["metadata"]["name"]
        with self._errors("create", "serviceaccounts", name):
            try:
                self.core.create_namespaced_service_account(self.namespace, account)
                return name
            except ApiException as e:
                if e.status != 409:
                    raise
            existing = self.api.sanitize_for_serialization(
                self.core.read_namespaced_service_account(name, self.namespace)
            )
        if not is_own(existing, isvc):
            raise KubetuneError(
                f"serviceaccount '{name}' already exists in namespace '{self.namespace}' and is not the one kubetune "
                f"made for InferenceService '{isvc}'",
                field="serving.name",
                fix="serve under another name, or remove that ServiceAccount",
            )
        account = {
            **account,
            "metadata": {**account["metadata"], "resourceVersion": existing["metadata"].get("resourceVersion")},
        }
        with self._errors("update", "serviceaccounts", name):
            self.core.replace_namespaced_service_account(name, self.namespace, account)
        return None

    def _refuse_foreign(self, isvc: dict, name: str) -> None:
        if not is_own(isvc, name):
            raise KubetuneError(
                f"InferenceService '{name}' in namespace '{self.namespace}' was not made by kubetune (it lacks the "
                f"labels {', '.join(f'{k}={v}' for k, v in OWN_LABELS.items())}), so kubetune leaves it alone",
                fix="serve under another name (serving.name), or delete it with kubectl",
            )

    # ---- status ----
    def get(self, name: str) -> dict:
        with self._errors("get", RESOURCE, name):
            return self.custom.get_namespaced_custom_object(*ISVC_API[:2], self.namespace, ISVC_API[2], name)

    def status(self, name: str) -> ServeStatus:
        """Whether the InferenceService ``name`` is Ready, its URLs, its predictor's replicas (where
        KServe runs it as a Deployment that can be read), and why it is not ready.

        Raises:
            KubetuneError: no such InferenceService, or the cluster cannot be read (one line).
        """
        return serve_status(self.get(name), self.namespace, self._predictor_replicas(name))

    def _predictor_replicas(self, name: str) -> dict[str, int]:
        """The predictor Deployment's replicas in Standard mode (KServe names it NAME-predictor);
        none where there is no such Deployment (Knative mode) or it may not be read."""
        import json

        from kubernetes.client.exceptions import ApiException

        with self._errors("get", "deployments", f"{name}-predictor"):
            try:
                # the raw object: the status needs no typed model, nor its required fields
                resp = self.apps.read_namespaced_deployment(f"{name}-predictor", self.namespace, _preload_content=False)
            except ApiException as e:
                if e.status in (403, 404):  # a detail, not worth failing `status` for
                    return {}
                raise
        deployment = json.loads(resp.data)
        desired = (deployment.get("spec") or {}).get("replicas")
        return {
            "ready": (deployment.get("status") or {}).get("readyReplicas") or 0,
            "desired": 1 if desired is None else desired,
        }

    # ---- delete ----
    def delete(self, name: str) -> list[str]:
        """Delete the InferenceService ``name`` and the ServiceAccount kubetune made for it; never a
        Secret. Only objects that carry kubetune's serving labels for ``name`` are deleted.

        Returns:
            What was removed or kept, one line each (for the CLI to print).

        Raises:
            KubetuneError: no such InferenceService, one kubetune did not make, or a cluster error.
        """
        from kubernetes.client.exceptions import ApiException

        isvc = self.get(name)
        self._refuse_foreign(isvc, name)
        with self._errors("delete", RESOURCE, name):
            self.custom.delete_namespaced_custom_object(
                *ISVC_API[:2], self.namespace, ISVC_API[2], name, propagation_policy="Background"
            )
        account = ((isvc.get("spec") or {}).get("predictor") or {}).get("serviceAccountName")
        if not account:
            return []
        with self._errors("get", "serviceaccounts", account):
            try:
                found = self.api.sanitize_for_serialization(
                    self.core.read_namespaced_service_account(account, self.namespace)
                )
            except ApiException as e:
                if e.status == 404:
                    return []
                raise
        if not is_own(found, name):
            return [f"kept serviceaccount '{account}' (kubetune did not make it)"]
        with self._errors("delete", "serviceaccounts", account):
            self.core.delete_namespaced_service_account(account, self.namespace)
        secrets = [s["name"] for s in found.get("secrets") or [] if s.get("name")]
        return [f"deleted serviceaccount '{account}'"] + (
            [f"kept secret(s) {', '.join(repr(s) for s in secrets)} (the job's; kubetune never deletes a Secret)"]
            if secrets
            else []
        )
