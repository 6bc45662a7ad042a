"""Kubeflow backend: submit / status / logs / wait / delete / list of PyTorchJobs (and TrainJobs)
through the official ``kubernetes`` client. API errors are translated here, at the boundary,
into one-line ``KubetuneError`` messages naming the verb, the resource and the namespace.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from kubernetes import client as k8s

from kubetune.backends import manifests
from kubetune.backends.status import TERMINAL, JobStatus, PodInfo, WaitTimeout
from kubetune.config import JobSpec
from kubetune.errors import KubetuneError

TARGETS = {"pytorchjob": (*manifests.PYTORCHJOB_API, "PyTorchJob"), "trainjob": (*manifests.TRAINJOB_API, "TrainJob")}
POD_FAILURES = (
    "OOMKilled",
    "ImagePullBackOff",
    "ErrImagePull",
    "CrashLoopBackOff",
    "CreateContainerConfigError",
    "InvalidImageName",
    "Error",
)
# The rank-0 log lines `status` reads for progress: the newest progress line is among the last few;
# an evaluation older than this many lines (more than ~400 log steps ago) is not shown.
PROGRESS_LINES = 400
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


class KubeflowBackend:
    """Runs job specs on a cluster with the Kubeflow Training Operator (or Trainer v2)."""

    def __init__(
        self,
        namespace: str | None = None,
        kubeconfig: str | None = None,
        context: str | None = None,
        target: str = "pytorchjob",
    ):
        if target not in TARGETS:
            raise KubetuneError(f"unknown target {target!r}", field="--target", fix="use pytorchjob or trainjob")
        self.api, default_ns = connect(kubeconfig, context)
        self.namespace = namespace or default_ns
        self.target = target
        self.group, self.version, self.plural, self.kind = TARGETS[target]
        self.core = k8s.CoreV1Api(self.api)
        self.custom = k8s.CustomObjectsApi(self.api)
        self.apps = k8s.AppsV1Api(self.api)

    @classmethod
    def of_job(
        cls, name: str, namespace: str | None = None, kubeconfig: str | None = None, context: str | None = None
    ) -> KubeflowBackend:
        """The backend for the job called ``name``, whichever kind it is on the cluster (a
        PyTorchJob or a TrainJob), so ``--target`` is needed only at submit. No job of that name:
        the PyTorchJob backend, whose calls then say it is not found."""
        backend = cls(namespace=namespace, kubeconfig=kubeconfig, context=context)
        found = [target for target in TARGETS if backend._has(target, name)]
        if len(found) > 1:
            raise KubetuneError(
                f"both a PyTorchJob and a TrainJob are named '{name}' in namespace '{backend.namespace}'",
                field="--target",
                fix="pass --target pytorchjob or --target trainjob",
            )
        if found:
            backend.target = found[0]
            backend.group, backend.version, backend.plural, backend.kind = TARGETS[found[0]]
        return backend

    def _has(self, target: str, name: str) -> bool:
        from kubernetes.client.exceptions import ApiException

        group, version, plural, _ = TARGETS[target]
        with self._errors("get", f"{plural}.{group}", name):
            try:
                self.custom.get_namespaced_custom_object(group, version, self.namespace, plural, name)
            except ApiException as e:
                if e.status == 404:  # no such job, or this kind is not served at all
                    return False
                raise
        return True

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
        if e.status == 403 and "admission webhook" in message:
            # the operator's validating webhook refused the object (controller-runtime answers 403)
            return KubetuneError(
                f"the cluster refused {what}: {message}",
                fix="change the spec's kubernetes/distributed settings the message names, or use the other --target",
            )
        if e.status == 403:
            return KubetuneError(
                f"forbidden: cannot {verb} {resource} in namespace '{self.namespace}' ({message})",
                fix="ask for the RBAC in deploy/rbac, or set kubernetes.namespace / --namespace",
            )
        if e.status == 401:
            return KubetuneError(
                f"the API server at {self.api.configuration.host} rejected the credentials (401)",
                fix="refresh the kubeconfig credentials",
            )
        if e.status == 404 and name is None or (e.status == 404 and "could not find the requested resource" in message):
            fix = (
                "install the Kubeflow Training Operator: deploy/install.sh"
                if self.target == "pytorchjob"
                else (
                    "install Kubeflow Trainer v2.3 or later with JobSet: deploy/install.sh --with trainer (or "
                    "submit with --target pytorchjob)"
                )
            )
            return KubetuneError(f"{resource} are not served by this cluster ({message})", fix=fix)
        if e.status == 404:
            return KubetuneError(
                f"{what} not found in namespace '{self.namespace}'",
                fix="check the name with `kubetune list` and --namespace",
            )
        if e.status == 409:
            return KubetuneError(
                f"{what} already exists in namespace '{self.namespace}'",
                fix=f"pass --replace, or `kubetune delete {name}` first",
            )
        if e.status == 422:
            return KubetuneError(
                f"the API server rejected {what}: {message}", fix="check the spec's kubernetes section"
            )
        return KubetuneError(f"Kubernetes API error {e.status} {e.reason} on {verb} {what}: {message}")

    # ---- submit ----
    def submit(self, spec: JobSpec, replace: bool = False) -> str:
        """Create the job, its ConfigMap and TensorBoard owned by it (deleting the job deletes
        them), and its workspace PVC, which is not owned: the output and checkpoints on it outlive
        the job (``delete(..., storage=True)`` removes it). Returns the job name.

        Before anything is created, a server-side dry run shows what the cluster would store: a
        field it would drop (an older operator or Trainer) is refused in one line, as is a
        TrainJob runtime the cluster does not have.
        """
        rendered = manifests.render(spec, self.namespace, self.target)
        name = spec.name
        if self.target == "trainjob":
            self._check_runtime(spec.kubernetes.runtime)
        # A dry run of a job that exists answers 409 like the create would; with --replace the
        # old job goes first and the dry run is repeated before the real create.
        checked = self._check_served(rendered.job, exists_ok=replace)
        if replace:
            self._delete_and_wait(name)
            if not checked:
                self._check_served(rendered.job)
        with self._errors("create", f"{self.plural}.{self.group}", name):
            job = self.custom.create_namespaced_custom_object(
                self.group, self.version, self.namespace, self.plural, rendered.job
            )
        owner = {
            "apiVersion": f"{self.group}/{self.version}",
            "kind": self.kind,
            "name": name,
            "uid": job["metadata"]["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
        try:
            for obj in [rendered.config_map, *rendered.tensorboard]:
                obj = {**obj, "metadata": {**obj["metadata"], "ownerReferences": [owner]}}
                self._create_owned(obj, replace)
            if rendered.pvc:
                self._ensure_claim(rendered.pvc, name)
        except KubetuneError:
            # Never leave a job whose ConfigMap is missing: roll the job back.
            with contextlib.suppress(Exception):
                self.custom.delete_namespaced_custom_object(self.group, self.version, self.namespace, self.plural, name)
            raise
        return name

    def _check_served(self, job: dict, exists_ok: bool = False) -> bool:
        """Server-side dry run of the job: every field sent must come back (a CRD schema prunes
        what it does not know, silently). Trainer v2.0/v2.1 drop spec.runtimePatches (no volume
        for the spec: `kubetune fetch` fails), v2.2 drops the pod's terminationGracePeriodSeconds
        (the SIGTERM checkpoint is killed at 30 s). Returns False, checking nothing, when a job
        of that name exists and `exists_ok`."""
        from kubernetes.client.exceptions import ApiException

        with self._errors("create", f"{self.plural}.{self.group}", job["metadata"]["name"]):
            try:
                stored = self.custom.create_namespaced_custom_object(
                    self.group, self.version, self.namespace, self.plural, job, dry_run="All"
                )
            except ApiException as e:
                if e.status == 409 and exists_ok:
                    return False
                raise
        dropped = missing_paths(job.get("spec") or {}, (stored or {}).get("spec") or {}, "spec")
        if not dropped:
            return True
        if self.target == "trainjob":
            if any(p == "spec.runtimePatches" for p in dropped):
                hint = "the cluster runs Trainer older than v2.3 (v2.0/v2.1 have no runtimePatches)"
            elif any(p.endswith("terminationGracePeriodSeconds") for p in dropped):
                hint = "the cluster runs Trainer v2.2 (no terminationGracePeriodSeconds in runtime patches)"
            else:
                hint = "the cluster's TrainJob CRD is older than v2.3"
            fix = "install Trainer v2.3 or later (deploy/install.sh --with trainer), or use --target pytorchjob"
        else:
            hint = "the cluster's Training Operator is older than the one kubetune renders for (v1.8.1+)"
            fix = "upgrade the Training Operator (deploy/install.sh), or remove the settings that need those fields"
        raise KubetuneError(
            (
                f"the cluster would drop {', '.join(dropped[:3])}{' ...' if len(dropped) > 3 else ''} from the "
                f"{self.kind}: {hint}"
            ),
            fix=fix,
        )

    def _check_runtime(self, runtime: str) -> None:
        from kubernetes.client.exceptions import ApiException

        # A cluster without the runtime CRD has no Trainer: _errors says so, and how to install it.
        with self._errors("get", "clustertrainingruntimes.trainer.kubeflow.org", runtime):
            try:
                self.custom.get_cluster_custom_object(
                    "trainer.kubeflow.org", "v1alpha1", "clustertrainingruntimes", runtime
                )
                return
            except ApiException as e:
                if e.status != 404 or "could not find the requested resource" in (e.body or ""):
                    raise
        names = [r["name"] for r in self.runtimes()]
        raise KubetuneError(
            f"the cluster has no ClusterTrainingRuntime '{runtime}'"
            + (f" (it has: {', '.join(names)})" if names else ""),
            field="kubernetes.runtime",
            fix=(
                "pick one that `kubetune runtimes` lists, or install Trainer's runtimes (deploy/install.sh --with "
                "trainer)"
            ),
        )

    def runtimes(self) -> list[dict]:
        """The cluster's ClusterTrainingRuntimes: name and framework."""
        with self._errors("list", "clustertrainingruntimes.trainer.kubeflow.org"):
            items = self.custom.list_cluster_custom_object(
                "trainer.kubeflow.org", "v1alpha1", "clustertrainingruntimes"
            )["items"]
        return [
            {
                "name": r["metadata"]["name"],
                "framework": (r["metadata"].get("labels") or {}).get("trainer.kubeflow.org/framework", ""),
            }
            for r in items
        ]

    def _ensure_claim(self, pvc: dict, job: str) -> None:
        """Create the workspace claim, or keep the one an earlier run of this job left (it holds
        that run's output and checkpoints, which a resubmitted job resumes from). A claim of that
        name that kubetune did not make for this job is never touched."""
        from kubernetes.client.exceptions import ApiException

        name = pvc["metadata"]["name"]
        with self._errors("create", "persistentvolumeclaims", name):
            try:
                self.core.create_namespaced_persistent_volume_claim(self.namespace, pvc)
                return
            except ApiException as e:
                if e.status != 409:
                    raise
            existing = self.core.read_namespaced_persistent_volume_claim(name, self.namespace)
        if (existing.metadata.labels or {}).get(manifests.JOB_LABEL) != job:
            raise KubetuneError(
                (
                    f"persistentvolumeclaim '{name}' already exists in namespace '{self.namespace}' and is not job "
                    f"'{job}''s workspace"
                ),
                field="kubernetes.storage",
                fix="set kubernetes.storage.existing_claim to use it, or rename the job",
            )

    def _create_owned(self, obj: dict, replace: bool) -> None:
        from kubernetes.client.exceptions import ApiException

        kind, name = obj["kind"], obj["metadata"]["name"]
        create, delete = {
            "ConfigMap": (self.core.create_namespaced_config_map, self.core.delete_namespaced_config_map),
            "Service": (self.core.create_namespaced_service, self.core.delete_namespaced_service),
            "Deployment": (self.apps.create_namespaced_deployment, self.apps.delete_namespaced_deployment),
        }[kind]
        resource = kind.lower() + "s"
        with self._errors("create", resource, name):
            try:
                create(self.namespace, obj)
            except ApiException as e:
                if e.status != 409:
                    raise
                # Left over from a job deleted without its garbage collector having finished.
                delete(name, self.namespace)
                create(self.namespace, obj)

    def _delete_and_wait(self, name: str, timeout: float = 60) -> None:
        from kubernetes.client.exceptions import ApiException

        with self._errors("delete", f"{self.plural}.{self.group}", name):
            try:
                self.custom.delete_namespaced_custom_object(
                    self.group, self.version, self.namespace, self.plural, name, propagation_policy="Foreground"
                )
            except ApiException as e:
                if e.status == 404:
                    return
                raise
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    self.custom.get_namespaced_custom_object(
                        self.group, self.version, self.namespace, self.plural, name
                    )
                except ApiException as e:
                    if e.status == 404:
                        return
                    raise
                time.sleep(1)
        raise KubetuneError(
            f"{self.kind} '{name}' is still being deleted after {timeout:.0f} s", fix="wait, then submit again"
        )

    # ---- status ----
    def get(self, name: str) -> dict:
        with self._errors("get", f"{self.plural}.{self.group}", name):
            return self.custom.get_namespaced_custom_object(self.group, self.version, self.namespace, self.plural, name)

    def status(self, name: str, log_lines: int = 20) -> JobStatus:
        job = self.get(name)
        st = job.get("status") or {}
        result = JobStatus(
            name=name,
            namespace=self.namespace,
            kind=self.kind,
            phase=phase_of(job),
            replicas={
                k: {kk: int(vv) for kk, vv in v.items() if isinstance(vv, int)}
                for k, v in (st.get("replicaStatuses") or {}).items()
            },
        )
        result.pods = self._pods(name)
        result.restarts = sum(p.restarts for p in result.pods)
        failing = next((p for p in result.pods if p.reason), None)
        if failing:
            result.reason, result.message, result.failed_pod = failing.reason, failing.message, failing.name
            if failing.reason not in ("ImagePullBackOff", "ErrImagePull", "Unschedulable", "InvalidImageName"):
                result.log_tail = self._tail(failing.name, log_lines)
        elif result.phase == "Failed":
            cond = next((c for c in reversed(st.get("conditions") or []) if c.get("type") == "Failed"), {})
            result.reason, result.message = cond.get("reason"), cond.get("message")
        result.output = self._output_of(name)
        # Progress from rank 0's log (its `progress:` and evaluation lines): the CLI may already read
        # pod logs, so no annotation to patch and no extra RBAC for the pods.
        master = next((p for p in result.pods if p.node_rank == 0 and p.phase in ("Running", "Succeeded")), None)
        if master is not None:
            from kubetune.training.loggers import progress_from_log

            result.progress = progress_from_log(self._tail(master.name, PROGRESS_LINES))
        return result

    def for_job(self, name: str) -> KubeflowBackend:
        """This backend, once job ``name`` is found: a cluster job is its name, so a handle follows
        whichever job has it.

        Raises:
            KubetuneError: no such job (or the cluster cannot be read).
        """
        self.get(name)
        return self

    def output_dir(self, name: str) -> None:
        """None: a cluster job writes its output in its pods (``status().output`` says where)."""
        return None

    def spec_of(self, name: str):
        """The job's spec, read from its ConfigMap (None once the job, and with it the ConfigMap, is gone)."""
        import yaml
        from kubernetes.client.exceptions import ApiException

        from kubetune.config import parse_spec

        try:
            cm = self.core.read_namespaced_config_map(f"{name}-spec", self.namespace)
            return parse_spec(yaml.safe_load((cm.data or {}).get("job.yaml", "")) or {})
        except (ApiException, KubetuneError, ValueError, TypeError):
            return None

    def _output_of(self, name: str) -> str | None:
        """Where the job writes its artifacts (None once the job is gone)."""
        spec = self.spec_of(name)
        return output_location(spec) if spec is not None else None

    def _pods(self, name: str) -> list[PodInfo]:
        with self._errors("list", "pods"):
            pods = self.core.list_namespaced_pod(self.namespace, label_selector=f"{manifests.JOB_LABEL}={name}").items
        out = [
            pod_info(p) for p in pods if (p.metadata.labels or {}).get("app.kubernetes.io/component") != "tensorboard"
        ]
        return sorted(out, key=lambda p: p.node_rank)

    def _tail(self, pod: str, lines: int) -> list[str]:
        from kubernetes.client.exceptions import ApiException

        try:
            text = self.core.read_namespaced_pod_log(
                pod,
                self.namespace,
                container=manifests.CONTAINER if self.target == "pytorchjob" else None,
                tail_lines=lines,
            )
        except ApiException:
            return []
        return text.splitlines()[-lines:]

    # ---- logs ----
    def logs(
        self, name: str, follow: bool = False, rank: int | None = None, all_ranks: bool = False, tail: int | None = None
    ) -> Iterator[str]:
        """Lines of the job's pods, each prefixed ``[node N]``; streamed (bounded memory)."""
        self.get(name)  # a clear error when the job does not exist
        pods = self._pods(name)
        if not pods:
            raise KubetuneError(
                f"{self.kind} '{name}' has no pods yet", fix="try again in a moment, or see `kubetune status`"
            )
        if not all_ranks:
            want = rank or 0
            pods = [p for p in pods if p.node_rank == want]
            if not pods:
                raise KubetuneError(
                    f"no pod with node rank {want} in '{name}'",
                    field="--node",
                    fix=f"use 0..{len(self._pods(name)) - 1} or --all",
                )
        if len(pods) == 1:
            yield from self._stream(pods[0], follow, tail)
            return
        # Several pods: one reader thread each, merged through a bounded queue.
        lines: queue.Queue = queue.Queue(maxsize=1000)
        done = object()

        def pump(pod: PodInfo) -> None:
            try:
                for line in self._stream(pod, follow, tail):
                    lines.put(line)
            except KubetuneError as e:
                lines.put(f"[node {pod.node_rank}] error: {e}")
            finally:
                lines.put(done)

        for p in pods:
            threading.Thread(target=pump, args=(p,), daemon=True).start()
        remaining = len(pods)
        while remaining:
            item = lines.get()
            if item is done:
                remaining -= 1
            else:
                yield item

    def _stream(self, pod: PodInfo, follow: bool, tail: int | None) -> Iterator[str]:
        with self._errors("get", "pods/log", pod.name):
            resp = self.core.read_namespaced_pod_log(
                pod.name,
                self.namespace,
                container=manifests.CONTAINER if self.target == "pytorchjob" else None,
                follow=follow,
                tail_lines=tail,
                _preload_content=False,
            )
        prefix = f"[node {pod.node_rank}] "
        try:
            yield from (prefix + line for line in iter_lines(resp))
        finally:
            resp.release_conn()

    # ---- wait ----
    def wait(self, name: str, timeout: float | None = None) -> JobStatus:
        """Block until the job succeeds or fails, following a watch (no polling loop).

        Raises:
            KubetuneError: the job disappeared, or ``timeout`` passed (``WaitTimeout``).
        """
        from kubernetes import watch

        deadline = None if timeout is None else time.monotonic() + timeout
        job = self.get(name)
        version = job["metadata"].get("resourceVersion")
        while phase_of(job) not in TERMINAL:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise WaitTimeout(
                    f"{self.kind} '{name}' is still {phase_of(job)} after {timeout:.0f} s",
                    fix="wait longer (--timeout) or see `kubetune status`",
                )
            w = watch.Watch()
            kwargs = {
                "field_selector": f"metadata.name={name}",
                "timeout_seconds": max(1, int(remaining)) if remaining is not None else 300,
            }
            if version:
                kwargs["resource_version"] = version
            with self._errors("watch", f"{self.plural}.{self.group}", name):
                for event in w.stream(
                    self.custom.list_namespaced_custom_object,
                    self.group,
                    self.version,
                    self.namespace,
                    self.plural,
                    **kwargs,
                ):
                    obj = event["object"]
                    if event["type"] == "DELETED":
                        w.stop()
                        raise KubetuneError(f"{self.kind} '{name}' was deleted while waiting")
                    if event["type"] == "ERROR":  # e.g. 410 Gone: re-read and watch again
                        version = None
                        break
                    job, version = obj, obj["metadata"].get("resourceVersion", version)
                    if phase_of(job) in TERMINAL:
                        w.stop()
                        break
            if version is None:
                job = self.get(name)
                version = job["metadata"].get("resourceVersion")
        return self.status(name)

    # ---- delete / list ----
    def delete(self, name: str, storage: bool = False, **_: object) -> list[str]:
        """Delete the job (its ConfigMap and TensorBoard go with it). The workspace claim kubetune
        created for it, which holds the output, stays unless ``storage`` (a claim named by
        ``existing_claim`` is never deleted). The deletion goes on in the background: a local
        run's ``timeout`` means nothing here.

        Returns:
            What was kept or removed, one line each (for the CLI to print).
        """
        from kubernetes.client.exceptions import ApiException

        with self._errors("delete", f"{self.plural}.{self.group}", name):
            self.custom.delete_namespaced_custom_object(
                self.group, self.version, self.namespace, self.plural, name, propagation_policy="Background"
            )
        claim = manifests.own_claim(name)
        with self._errors("get", "persistentvolumeclaims", claim):
            try:
                pvc = self.core.read_namespaced_persistent_volume_claim(claim, self.namespace)
            except ApiException as e:
                if e.status == 404:
                    return []
                raise
        if (pvc.metadata.labels or {}).get(manifests.JOB_LABEL) != name:
            return []
        if not storage:
            return [
                (
                    f"kept persistentvolumeclaim '{claim}' (the job's output and checkpoints); `kubetune delete "
                    f"{name} --delete-storage` removes it"
                )
            ]
        with self._errors("delete", "persistentvolumeclaims", claim):
            self.core.delete_namespaced_persistent_volume_claim(claim, self.namespace)
        return [f"deleted persistentvolumeclaim '{claim}'"]

    def list(self) -> list[dict]:
        with self._errors("list", f"{self.plural}.{self.group}"):
            items = self.custom.list_namespaced_custom_object(
                self.group, self.version, self.namespace, self.plural, label_selector="app.kubernetes.io/name=kubetune"
            )["items"]
        return [
            {"name": j["metadata"]["name"], "phase": phase_of(j), "created": j["metadata"].get("creationTimestamp", "")}
            for j in items
        ]


class PyTorchJobBackend(KubeflowBackend):
    """Kubeflow Training Operator v1: a PyTorchJob (registered as ``pytorchjob``)."""

    def __init__(self, namespace: str | None = None, kubeconfig: str | None = None, context: str | None = None):
        super().__init__(namespace, kubeconfig, context, target="pytorchjob")


class TrainJobBackend(KubeflowBackend):
    """Kubeflow Trainer v2: a TrainJob on a ClusterTrainingRuntime (registered as ``trainjob``)."""

    def __init__(self, namespace: str | None = None, kubeconfig: str | None = None, context: str | None = None):
        super().__init__(namespace, kubeconfig, context, target="trainjob")


def missing_paths(sent, stored, path: str) -> list[str]:
    """Dotted paths present in ``sent`` and absent from ``stored`` (what a server pruned).
    Lists are compared item by item; values the server changed (defaults, mutating webhooks)
    are not reported, only keys that disappeared."""
    if isinstance(sent, dict):
        if not isinstance(stored, dict):
            return [path]
        out = []
        for k, v in sent.items():
            if k not in stored:
                out.append(f"{path}.{k}")
            else:
                out += missing_paths(v, stored[k], f"{path}.{k}")
        return out
    if isinstance(sent, list) and isinstance(stored, list):
        return [p for i, (a, b) in enumerate(zip(sent, stored)) for p in missing_paths(a, b, f"{path}[{i}]")]
    return []


def output_location(spec: JobSpec) -> str:
    """Where a cluster job's artifacts are: the remote URI, a path on its claim, or a warning."""
    from kubetune.artifacts.output import Output

    out = Output.for_spec(spec)
    if out.remote:
        return spec.output.uri
    full = out.pod_path(manifests.WORKSPACE)
    if spec.kubernetes.storage.mode == "pvc":
        return f"persistentvolumeclaim/{manifests.pvc_name(spec)} at {full} (mounted at {manifests.WORKSPACE})"
    return (
        f"{full} inside the pods' node-local storage (lost with the pods; use s3://, hf:// or "
        "kubernetes.storage.mode: pvc)"
    )


def phase_of(job: dict) -> str:
    """The job's phase: the last condition whose status is True (Created, Running, Restarting,
    Succeeded, Failed, Suspended), or Pending before the operator has written any."""
    conditions = (job.get("status") or {}).get("conditions") or []
    true = [c for c in conditions if str(c.get("status")) == "True"]
    if any(c.get("type") in ("Failed", "Succeeded") for c in true):
        return next(c["type"] for c in reversed(true) if c.get("type") in ("Failed", "Succeeded"))
    if any(c.get("type") == "Complete" for c in true):  # TrainJob
        return "Succeeded"
    return true[-1]["type"] if true else "Pending"


def pod_info(pod) -> PodInfo:
    """Node rank and the reason a pod is failing (OOMKilled, ImagePullBackOff, Unschedulable, ...)."""
    labels = pod.metadata.labels or {}
    index = int(
        labels.get("training.kubeflow.org/replica-index") or labels.get("batch.kubernetes.io/job-completion-index") or 0
    )
    rank = (
        index + 1
        if labels.get("training.kubeflow.org/replica-type", "").lower() == "worker"
        and not labels.get("kubetune.io/elastic")
        else index
    )
    status = pod.status
    statuses = (status.container_statuses or []) + (status.init_container_statuses or []) if status else []
    restarts = sum(s.restart_count or 0 for s in statuses)
    reason = message = None
    for s in statuses:
        state, last = s.state, s.last_state
        if state and state.waiting and state.waiting.reason in POD_FAILURES:
            reason, message = state.waiting.reason, state.waiting.message
        elif state and state.terminated and state.terminated.exit_code:
            reason, message = (
                state.terminated.reason or "Error",
                f"container {s.name} exited with code {state.terminated.exit_code}",
            )
        elif last and last.terminated and last.terminated.reason == "OOMKilled":
            reason, message = (
                "OOMKilled",
                f"container {s.name} was killed for exceeding its memory limit (restarts: {s.restart_count})",
            )
        if reason:
            break
    if not reason and status:
        for c in status.conditions or []:
            if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable":
                reason, message = "Unschedulable", c.message
    return PodInfo(
        name=pod.metadata.name,
        node_rank=rank,
        phase=(status.phase if status else None) or "Unknown",
        restarts=restarts,
        reason=reason,
        message=message,
    )


def iter_lines(resp, chunk: int = 8192, max_line: int = 1 << 20) -> Iterator[str]:
    """Split a streamed HTTP body into lines, holding at most one partial line (≤ max_line)."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    buf = ""
    for data in resp.stream(chunk):
        buf += decoder.decode(data)
        *complete, buf = buf.split("\n")
        yield from complete
        if len(buf) > max_line:  # a runaway line: emit it in pieces instead of growing without bound
            yield buf
            buf = ""
    buf += decoder.decode(b"", final=True)
    if buf:
        yield buf
