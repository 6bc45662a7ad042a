"""Kubeflow backend: submit / status / logs / wait / delete / list of PyTorchJobs (and TrainJobs)
through the official ``kubernetes`` client. API errors are translated at the boundary
(``cluster.api``) into one-line ``KubetuneError`` messages naming the verb, the resource and the
namespace; the reading calls (status, logs, wait, list) are in ``read``. Here: what
changes the cluster (submit, with its server-side dry run, and delete), finding a job's kind, and
the two registered backends.
"""

from __future__ import annotations

import contextlib

from kubetune.backends.cluster.api import TARGETS, ClusterConnection
from kubetune.backends.cluster.objects import JOB_LABEL, own_claim
from kubetune.backends.kubeflow import manifests
from kubetune.backends.kubeflow.read import KubeflowReader
from kubetune.config import JobSpec
from kubetune.errors import KubetuneError


class OwnedObjects(ClusterConnection):
    """Creating what a job (or a Katib Experiment) brings along, for a backend on a ``ClusterConnection``: the
    workspace claim it keeps and the objects it owns."""

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
        if (existing.metadata.labels or {}).get(JOB_LABEL) != job:
            raise KubetuneError(
                (
                    f"persistentvolumeclaim '{name}' already exists in namespace '{self.namespace}' and is not job "
                    f"'{job}''s workspace"
                ),
                field="kubernetes.storage",
                fix="set kubernetes.storage.existing_claim to use it, or rename the job",
            )

    def _drop_claim(self, name: str, storage: bool, holds: str, command: str) -> list[str]:
        """After ``name`` is deleted: delete the workspace claim kubetune created for it when ``storage``, else
        say it was kept (what it ``holds``, and the ``command`` that with ``--delete-storage`` removes it). A
        claim kubetune did not create for ``name`` is never touched."""
        from kubernetes.client.exceptions import ApiException

        claim = own_claim(name)
        with self._errors("get", "persistentvolumeclaims", claim):
            try:
                pvc = self.core.read_namespaced_persistent_volume_claim(claim, self.namespace)
            except ApiException as e:
                if e.status == 404:
                    return []
                raise
        if (pvc.metadata.labels or {}).get(JOB_LABEL) != name:
            return []
        if not storage:
            return [f"kept persistentvolumeclaim '{claim}' ({holds}); `{command} --delete-storage` removes it"]
        with self._errors("delete", "persistentvolumeclaims", claim):
            self.core.delete_namespaced_persistent_volume_claim(claim, self.namespace)
        return [f"deleted persistentvolumeclaim '{claim}'"]

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


class KubeflowBackend(OwnedObjects, KubeflowReader):
    """Runs job specs on a cluster with the Kubeflow Training Operator (or Trainer v2)."""

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

    def for_job(self, name: str) -> KubeflowBackend:
        """This backend, once job ``name`` is found: a cluster job is its name, so a handle follows
        whichever job has it.

        Raises:
            KubetuneError: no such job (or the cluster cannot be read).
        """
        self.get(name)
        return self

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
            self._delete_and_wait((self.group, self.version, self.plural), self.kind, name, 60)
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
        stored = self._dry_run_create((self.group, self.version, self.plural), job, exists_ok)
        if stored is None:
            return False
        dropped = missing_paths(job.get("spec") or {}, stored.get("spec") or {}, "spec")
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

    # ---- delete / list ----
    def delete(self, name: str, storage: bool = False, **_: object) -> list[str]:
        """Delete the job (its ConfigMap and TensorBoard go with it). The workspace claim kubetune
        created for it, which holds the output, stays unless ``storage`` (a claim named by
        ``existing_claim`` is never deleted). The deletion goes on in the background: a local
        run's ``timeout`` means nothing here.

        Returns:
            What was kept or removed, one line each (for the CLI to print).
        """
        with self._errors("delete", f"{self.plural}.{self.group}", name):
            self.custom.delete_namespaced_custom_object(
                self.group, self.version, self.namespace, self.plural, name, propagation_policy="Background"
            )
        return self._drop_claim(name, storage, "the job's output and checkpoints", f"kubetune delete {name}")


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
