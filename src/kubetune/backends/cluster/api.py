"""The cluster backends' connection to a cluster: the API clients for one namespace (``ClusterConnection``;
for the Kubeflow backend, of one job kind: ``TARGETS``, a PyTorchJob or a TrainJob), from a kubeconfig or
the in-cluster service account (``connect``), and the boundary where the client's errors (ApiException,
an unreachable server) become one-line ``KubetuneError`` messages naming the verb, the resource and the
namespace, with the fix that the connection's kind of object calls for (``ClusterConnection._fix``).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from kubernetes import client as k8s

from kubetune.backends.cluster.objects import PYTORCHJOB_API, TRAINJOB_API
from kubetune.errors import KubetuneError

TARGETS = {"pytorchjob": (*PYTORCHJOB_API, "PyTorchJob"), "trainjob": (*TRAINJOB_API, "TrainJob")}
# What to install where a cluster does not serve a target's jobs.
NOT_SERVED_FIX = {
    "pytorchjob": "install the Kubeflow Training Operator: deploy/install.sh",
    "trainjob": (
        "install Kubeflow Trainer v2.3 or later with JobSet: deploy/install.sh --with trainer (or submit with --target "
        "pytorchjob)"
    ),
}
IN_CLUSTER_NS = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def connect(kubeconfig: str | None = None, context: str | None = None) -> tuple[k8s.ApiClient, str]:
    """An API client and the default namespace: kubeconfig (file, $KUBECONFIG, ~/.kube/config,
    optional context), else the in-cluster service account."""
    from kubernetes import config

    path = (
        kubeconfig or os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or str(Path("~/.kube/config").expanduser())
    )
    try:
        if Path(path).exists():
            api = config.new_client_from_config(config_file=path, context=context)
            contexts, active = config.list_kube_config_contexts(config_file=path)
            chosen = next((c for c in contexts if c["name"] == context), active) if context else active
            return api, (chosen or {}).get("context", {}).get("namespace") or "default"
        cfg = k8s.Configuration()
        config.load_incluster_config(client_configuration=cfg)
        return k8s.ApiClient(cfg), IN_CLUSTER_NS.read_text().strip() if IN_CLUSTER_NS.exists() else "default"
    except config.ConfigException as e:
        raise KubetuneError(
            f"no usable Kubernetes configuration ({str(e).splitlines()[0]})",
            field="kubeconfig",
            fix="set KUBECONFIG or --kubeconfig, pick a --context, or run inside a cluster",
        ) from None


class ClusterConnection:
    """The API clients for one namespace of a cluster, and the translation of their errors; a backend
    reads and writes its objects through it, and names the fixes of its errors (``_fix``)."""

    def __init__(self, namespace: str | None = None, kubeconfig: str | None = None, context: str | None = None):
        self.api, default_ns = connect(kubeconfig, context)
        self.namespace = namespace or default_ns
        self.core = k8s.CoreV1Api(self.api)
        self.custom = k8s.CustomObjectsApi(self.api)
        self.apps = k8s.AppsV1Api(self.api)

    # ---- errors at the boundary ----
    @contextlib.contextmanager
    def _errors(self, verb: str, resource: str, name: str | None = None):
        import urllib3
        from kubernetes.client.exceptions import ApiException

        try:
            yield
        except ApiException as e:
            raise self._translate(e, verb, resource, name) from None
        except (urllib3.exceptions.HTTPError, OSError) as e:
            host = self.api.configuration.host
            raise KubetuneError(
                f"cannot reach the Kubernetes API server at {host} ({type(e).__name__})",
                fix="check the kubeconfig context and the network (kubectl cluster-info)",
            ) from None

    def _translate(self, e, verb: str, resource: str, name: str | None) -> KubetuneError:
        import json

        try:
            body = json.loads(e.body or "{}")
        except ValueError:
            body = {}
        message = body.get("message") or e.reason or ""
        what = f"{resource} '{name}'" if name else resource
        if e.status in (400, 403) and "admission webhook" in message:
            # a validating webhook refused the object: controller-runtime's Denied answers 403 (the operators',
            # KServe's), its Errored 400 (Katib's experiment validator)
            return KubetuneError(f"the cluster refused {what}: {message}", fix=self._fix("refused", name))
        if e.status == 403:
            return KubetuneError(
                f"forbidden: cannot {verb} {resource} in namespace '{self.namespace}' ({message})",
                fix=self._fix("forbidden", name),
            )
        if e.status == 401:
            return KubetuneError(
                f"the API server at {self.api.configuration.host} rejected the credentials (401)",
                fix="refresh the kubeconfig credentials",
            )
        if e.status == 404 and name is None or (e.status == 404 and "could not find the requested resource" in message):
            return KubetuneError(
                f"{resource} are not served by this cluster ({message})", fix=self._fix("not served", name)
            )
        if e.status == 404:
            return KubetuneError(
                f"{what} not found in namespace '{self.namespace}'",
                fix=self._fix("not found", name),
            )
        if e.status == 409:
            return KubetuneError(
                f"{what} already exists in namespace '{self.namespace}'",
                fix=self._fix("exists", name),
            )
        if e.status == 422:
            return KubetuneError(f"the API server rejected {what}: {message}", fix=self._fix("invalid", name))
        return KubetuneError(f"Kubernetes API error {e.status} {e.reason} on {verb} {what}: {message}")

    # ---- what every cluster backend does with its custom objects ----
    def _dry_run_create(self, api: tuple[str, str, str], obj: dict, exists_ok: bool = False) -> dict | None:
        """Server-side dry run of creating ``obj``, a custom object of ``api`` (group, version, plural): what the
        cluster would store (its CRD's pruning and defaults, its webhooks' verdict). None, checking nothing, when
        one of that name exists and ``exists_ok``.

        Raises:
            KubetuneError: the cluster refused it (one line).
        """
        from kubernetes.client.exceptions import ApiException

        group, version, plural = api
        with self._errors("create", f"{plural}.{group}", obj["metadata"]["name"]):
            try:
                return self.custom.create_namespaced_custom_object(
                    group, version, self.namespace, plural, obj, dry_run="All"
                )
            except ApiException as e:
                if e.status == 409 and exists_ok:
                    return None
                raise

    def _delete_and_wait(self, api: tuple[str, str, str], kind: str, name: str, timeout: float) -> None:
        """Delete the custom object ``name`` of ``api`` in the foreground (what it owns first, a finalizer's work
        too) and wait until it is gone; gone already is fine.

        Raises:
            KubetuneError: still there after ``timeout`` seconds, or a cluster error.
        """
        from kubernetes.client.exceptions import ApiException

        group, version, plural = api
        with self._errors("delete", f"{plural}.{group}", name):
            try:
                self.custom.delete_namespaced_custom_object(
                    group, version, self.namespace, plural, name, propagation_policy="Foreground"
                )
            except ApiException as e:
                if e.status == 404:
                    return
                raise
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    self.custom.get_namespaced_custom_object(group, version, self.namespace, plural, name)
                except ApiException as e:
                    if e.status == 404:
                        return
                    raise
                time.sleep(1)
        raise KubetuneError(
            f"{kind} '{name}' is still being deleted after {timeout:.0f} s", fix="wait, then submit again"
        )

    def _fix(self, case: str, name: str | None) -> str:
        """What to do about an error the cluster answered, by ``case``: ``refused`` (an admission
        webhook said no), ``forbidden`` (RBAC, 403), ``not served`` (the kind's CRD is not installed),
        ``not found``, ``exists`` (409) or ``invalid`` (422); ``name``: the object's."""
        raise NotImplementedError


class KubeflowConnection(ClusterConnection):
    """The API clients for one namespace of a cluster and one job kind (``target``), and the
    translation of their errors; the cluster backend reads and writes jobs through it."""

    def __init__(
        self,
        namespace: str | None = None,
        kubeconfig: str | None = None,
        context: str | None = None,
        target: str = "pytorchjob",
    ):
        if target not in TARGETS:
            raise KubetuneError(f"unknown target {target!r}", field="--target", fix="use pytorchjob or trainjob")
        super().__init__(namespace, kubeconfig, context)
        self.target = target
        self.group, self.version, self.plural, self.kind = TARGETS[target]

    def _fix(self, case: str, name: str | None) -> str:
        return {
            "refused": "change the spec's kubernetes/distributed settings the message names, or use the other --target",
            "forbidden": "ask for the RBAC in deploy/rbac, or set kubernetes.namespace / --namespace",
            "not served": NOT_SERVED_FIX[self.target],
            "not found": "check the name with `kubetune list` and --namespace",
            "exists": f"pass --replace, or `kubetune delete {name}` first",
            "invalid": "check the spec's kubernetes section",
        }[case]
