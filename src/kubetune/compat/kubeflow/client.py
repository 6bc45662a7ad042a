"""The SDK's ``TrainingClient`` on kubetune: ``train`` translates its arguments into a job spec
(:func:`~kubetune.compat.kubeflow.translate.spec_from_train`) that :class:`kubetune.client.Client`
runs locally or submits as a PyTorchJob, and the job calls answer with the SDK's return types and
exceptions."""

from __future__ import annotations

import contextlib
import re
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from kubetune.backends.status import WaitTimeout
from kubetune.client import Client, Job
from kubetune.compat.kubeflow.errors import JobError, JobTimeout, Problems, UnsupportedParameter, job_errors, refuse
from kubetune.compat.kubeflow.translate import spec_from_train
from kubetune.errors import SpecError

JOB_KIND = "PyTorchJob"
CONDITIONS = ("Created", "Running", "Restarting", "Succeeded", "Failed")


def _condition_check(condition: str) -> Callable[..., bool]:
    """The SDK's ``is_job_<condition>`` method: whether the job's condition ``condition`` is True."""

    def check(
        self: TrainingClient,
        name: str | None = None,
        namespace: str | None = None,
        job_kind: str | None = None,
        job: Any = None,
        timeout: int = 120,
    ) -> bool:
        return _has(self.get_job_conditions(name, namespace, job_kind, job), condition)

    check.__name__ = check.__qualname__ = f"is_job_{condition.lower()}"
    check.__doc__ = f"Whether the {condition} condition of ``job`` (or of the job named ``name``) is True."
    return check


class TrainingClient:
    """The SDK's ``TrainingClient`` on kubetune: same constructor, ``train`` and job calls.

    Args:
        config_file: kubeconfig path (default: $KUBECONFIG, ~/.kube/config, or in-cluster).
        context: kubeconfig context.
        client_configuration: not supported (refused): kubetune connects from a kubeconfig.
        namespace: default namespace of every call; default the kubeconfig context's (the SDK's
            default is the pod's own namespace or ``default``). Ignored by the local backend.
        job_kind: ``PyTorchJob`` (the only kind kubetune runs).
        backend: ``kubeflow`` (submit a PyTorchJob, as the SDK) or ``local`` (train on this
            machine under torch elastic, same spec).

    Raises:
        UnsupportedParameter: an option kubetune cannot honour.
    """

    def __init__(
        self,
        config_file: str | None = None,
        context: str | None = None,
        client_configuration: Any = None,
        namespace: str | None = None,
        job_kind: str = JOB_KIND,
        backend: str = "kubeflow",
    ):
        problems = Problems()
        if backend not in ("kubeflow", "local"):
            problems.add("backend", f"{backend!r} is not a backend", "use 'kubeflow' or 'local'")
        if client_configuration is not None:
            problems.add(
                "client_configuration", "is not supported", "pass config_file (a kubeconfig) and context instead"
            )
        if backend == "local":
            for name, value in (("config_file", config_file), ("context", context)):
                if value is not None:
                    problems.add(
                        name,
                        "configures a cluster connection, which backend='local' does not use",
                        "remove it, or use backend='kubeflow'",
                    )
        _check_kind(job_kind, problems)
        problems.raise_any()
        self.backend = backend
        self.namespace = namespace
        self.job_kind = JOB_KIND
        self._options = {k: v for k, v in (("kubeconfig", config_file), ("context", context)) if v is not None}
        self._clients: dict[str | None, Client] = {}
        self._jobs: dict[tuple[str | None, str], Job] = {}

    # ---- train

    def train(
        self,
        name: str | None = None,
        namespace: str | None = None,
        labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
        num_workers: int = 1,
        num_procs_per_worker: int = 1,
        resources_per_worker: Any = None,
        model_provider_parameters: Any = None,
        dataset_provider_parameters: Any = None,
        trainer_parameters: Any = None,
        init_env_vars: Any = None,
        env_vars: Any = None,
        storage_config: dict | None = None,
        queue_name: str | None = None,
        *,
        overrides: list[str] | None = None,
    ) -> None:
        """Start the fine-tuning job the SDK's ``train`` describes; returns None, as the SDK.

        Args: those of the SDK's ``train`` (see :func:`spec_from_train`), plus the keyword-only
            kubetune extension ``overrides``: ``KEY=VALUE`` strings applied to the translated spec
            as ``kubetune run --set`` (e.g. ``["data.max_length=256"]``).

        Raises:
            UnsupportedParameter: an argument the spec cannot carry (before anything starts).
            JobError: the job could not be started (it exists, the cluster refused it, ...).
        """
        ns = self._namespace(namespace)
        if self.backend == "local" and num_workers != 1:
            refuse(
                "num_workers",
                f"{num_workers} nodes cannot run on one machine",
                (
                    "use num_workers=1 with backend='local' (num_procs_per_worker sets the processes), or "
                    "backend='kubeflow'"
                ),
            )
        spec = spec_from_train(
            name,
            namespace=ns,
            labels=labels,
            annotations=annotations,
            num_workers=num_workers,
            num_procs_per_worker=num_procs_per_worker,
            resources_per_worker=resources_per_worker,
            model_provider_parameters=model_provider_parameters,
            dataset_provider_parameters=dataset_provider_parameters,
            trainer_parameters=trainer_parameters,
            init_env_vars=init_env_vars,
            env_vars=env_vars,
            storage_config=storage_config,
            queue_name=queue_name,
        )
        job_spec = _validate(spec, overrides)
        if self.backend == "kubeflow":
            from kubetune.backends.kubeflow.checks import warnings_for

            for line in warnings_for(job_spec):
                warnings.warn(line, UserWarning, stacklevel=2)
        with job_errors():
            handle = self._client(ns).train(job_spec)  # validated above, overrides applied
        self._jobs[(ns, job_spec.name)] = handle

    def kubetune_job(self, name: str, namespace: str | None = None) -> Job:
        """kubetune's own handle on a job (``status()``, ``wait()``, ``logs()``, ``output``).

        Raises:
            JobError: no such job.
        """
        ns = self._namespace(namespace)
        handle = self._jobs.get((ns, name))
        if handle is None:
            with job_errors():
                handle = self._client(ns).get(name)
        return handle

    def create_job(self, *args: Any, **kwargs: Any) -> None:
        """Not supported: the SDK's ``create_job`` runs arbitrary images and functions.

        Raises:
            UnsupportedParameter: always.
        """
        refuse(
            "create_job",
            "is not supported: kubetune runs fine-tuning job specs, not arbitrary images or functions",
            "use train(...), or a kubetune job spec with kubetune.Client",
        )

    # ---- jobs

    def get_job(self, name: str, namespace: str | None = None, job_kind: str | None = None, timeout: int = 120) -> Any:
        """The job as the SDK's ``KubeflowOrgV1PyTorchJob`` (``metadata``, ``status.conditions``;
        for a local run ``spec`` is None).

        Raises:
            JobError: no such job, or the cluster could not be read (a RuntimeError).
        """
        _raise_kind(job_kind)
        handle = self.kubetune_job(name, namespace)
        with job_errors():
            if self.backend == "local":
                return _job_model(_local_object(handle))
            return _job_model(handle.backend.get(name))

    def list_jobs(self, namespace: str | None = None, job_kind: str | None = None, timeout: int = 120) -> list[Any]:
        """The jobs kubetune started, as ``KubeflowOrgV1PyTorchJob`` objects: on the cluster, every
        kubetune PyTorchJob of the namespace; locally, the runs started from this Python process.

        Raises:
            JobError: the cluster could not be read.
        """
        _raise_kind(job_kind)
        client = self._client(self._namespace(namespace))
        with job_errors():
            names = [row["name"] for row in client.list()]
        out = []
        for name in names:
            try:
                out.append(self.get_job(name, namespace))
            except JobError:
                continue  # deleted between the list and the read
        return out

    def get_job_conditions(
        self,
        name: str | None = None,
        namespace: str | None = None,
        job_kind: str | None = None,
        job: Any = None,
        timeout: int = 120,
    ) -> list[Any]:
        """The job's conditions (``KubeflowOrgV1JobCondition``), as the SDK returns them."""
        if job is None:
            if name is None:
                refuse("name", "is required when job is not given", "pass the job name or a job object")
            job = self.get_job(name, namespace, job_kind)
        return list((job.status.conditions if job.status else None) or [])

    is_job_created = _condition_check("Created")
    is_job_running = _condition_check("Running")
    is_job_restarting = _condition_check("Restarting")
    is_job_succeeded = _condition_check("Succeeded")
    is_job_failed = _condition_check("Failed")

    def wait_for_job_conditions(
        self,
        name: str,
        namespace: str | None = None,
        job_kind: str | None = None,
        expected_conditions: set[str] | frozenset[str] = frozenset({"Succeeded"}),
        wait_timeout: int = 600,
        polling_interval: int = 15,
        callback: Any = None,
        timeout: int = 120,
    ) -> Any:
        """Wait until the job has one of ``expected_conditions``; returns the job object.

        Between polls it waits on kubetune's handle (a watch on the cluster, the process locally),
        so a job that ends is seen at once rather than at the next ``polling_interval``.

        Raises:
            ValueError: ``expected_conditions`` names an unknown condition.
            JobError: the job failed while Failed is not expected (a RuntimeError, with the reason).
            JobTimeout: ``wait_timeout`` passed, or the job ended without reaching them (a TimeoutError).
        """
        expected = set(expected_conditions)
        if not expected <= set(CONDITIONS):
            refuse(
                "expected_conditions",
                f"{sorted(expected - set(CONDITIONS))} are not job conditions",
                f"use a subset of {list(CONDITIONS)}",
            )
        handle = self.kubetune_job(name, namespace)
        deadline = time.monotonic() + wait_timeout
        while True:
            job = self.get_job(name, namespace, job_kind)
            conditions = self.get_job_conditions(job=job)
            if callback:
                callback(job)
            if "Failed" not in expected and _has(conditions, "Failed"):
                failed = next(c for c in conditions if c.type == "Failed")
                raise JobError(
                    f"{JOB_KIND} {name} is Failed: {failed.reason or ''} {failed.message or ''}".strip(),
                    fix="see get_job_logs(name) or `kubetune status`",
                )
            if any(_has(conditions, c) for c in expected):
                return job
            if _has(conditions, "Succeeded"):
                # A finished job's conditions no longer change: waiting longer cannot help.
                raise JobTimeout(f"{JOB_KIND} {name} ended Succeeded without reaching {sorted(expected)}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise JobTimeout(
                    f"timeout waiting for {JOB_KIND} {name} to reach {sorted(expected)} ({wait_timeout} s)",
                    fix="wait longer (wait_timeout=...)",
                )
            with job_errors(), contextlib.suppress(WaitTimeout):  # a JobError: e.g. deleted while waiting
                handle.wait(min(polling_interval, remaining))

    def get_job_logs(
        self,
        name: str,
        namespace: str | None = None,
        job_kind: str | None = None,
        is_master: bool = True,
        replica_type: str | None = None,
        replica_index: int | None = None,
        follow: bool = False,
        timeout: int = 120,
        verbose: bool = False,
    ) -> tuple[dict[str, str], dict[str, list[str]]]:
        """The logs of the job's pods as ``({pod name: log text}, {})``, as the SDK returns them.

        A local run is one "pod" named ``NAME-master-0`` holding every process's lines (each
        ``[rank N]``). ``follow`` prints ``[Pod NAME]: line`` as lines arrive, until the job ends.

        Raises:
            UnsupportedParameter: ``verbose`` (Kubernetes events), or an unknown replica type.
            JobError: the job or its logs could not be read.
        """
        _raise_kind(job_kind)
        if verbose:
            refuse(
                "verbose",
                "Kubernetes events are not collected",
                "kubetune_job(name).status() gives the phase, each pod's failure reason and a log tail",
            )
        if replica_type is not None and replica_type.lower() not in ("master", "worker"):
            refuse("replica_type", f"{replica_type!r} is not a PyTorchJob replica type", "use 'master' or 'worker'")
        handle = self.kubetune_job(name, namespace)

        def wanted(pod: str) -> bool:
            m = re.search(r"-(master|worker)-(\d+)$", pod)
            kind, index = (m.group(1), int(m.group(2))) if m else ("", -1)
            return (
                (not is_master or kind == "master")
                and (replica_type is None or kind == replica_type.lower())
                and (replica_index is None or index == replica_index)
            )

        logs: dict[str, list[str]] = {}
        with job_errors():
            for pod, line in _pod_lines(handle, name, wanted, follow, local=self.backend == "local"):
                if follow:
                    print(f"[Pod {pod}]: {line}", flush=True)  # what the SDK prints while following
                logs.setdefault(pod, []).append(line)
        return {pod: "\n".join(lines) + "\n" for pod, lines in logs.items()}, {}

    def delete_job(
        self, name: str, namespace: str | None = None, job_kind: str | None = None, delete_options: Any = None
    ) -> None:
        """Delete the job (a local run is stopped: SIGTERM, so it writes a checkpoint). On the
        cluster the workspace claim with the output stays (``kubetune delete --delete-storage``).

        Raises:
            UnsupportedParameter: ``delete_options`` given.
            JobError: no such job, or the cluster refused.
        """
        _raise_kind(job_kind)
        if delete_options is not None:
            refuse(
                "delete_options",
                "is not supported",
                "remove it: kubetune deletes in the background with the job's owned objects",
            )
        ns = self._namespace(namespace)
        handle = self.kubetune_job(name, namespace)
        with job_errors():
            handle.delete()
        self._jobs.pop((ns, name), None)

    # ---- helpers

    def _namespace(self, namespace: str | None) -> str | None:
        return None if self.backend == "local" else namespace or self.namespace

    def _client(self, namespace: str | None) -> Client:
        if namespace not in self._clients:
            if self.backend == "local":
                self._clients[namespace] = Client("local")
            else:
                extra = {"namespace": namespace} if namespace else {}
                self._clients[namespace] = Client("kubeflow", **self._options, **extra)
        return self._clients[namespace]


def _check_kind(job_kind: str | None, problems: Problems) -> None:
    if job_kind is not None and job_kind != JOB_KIND:
        problems.add(
            "job_kind", f"{job_kind!r} is not supported", "use 'PyTorchJob': kubetune runs fine-tuning as PyTorchJobs"
        )


def _raise_kind(job_kind: str | None) -> None:
    problems = Problems()
    _check_kind(job_kind, problems)
    problems.raise_any()


def _validate(spec: dict, overrides: list[str] | None):
    from kubetune.config import parse_spec

    try:
        return parse_spec(spec, overrides, source="train()")
    except SpecError as e:
        # One line for a notebook's traceback, every problem named (SpecError's str is a count).
        raise UnsupportedParameter(
            [("train()", "; ".join(e.lines()), "fix the arguments (or overrides) named")]
        ) from None


def _pod_lines(
    handle: Job, name: str, wanted: Callable[[str], bool], follow: bool, local: bool
) -> Iterator[tuple[str, str]]:
    """(pod name, log line) of every wanted pod of the job, as the lines arrive when ``follow``
    (``local``: a local run, one "pod" that holds every process's lines)."""
    if local:
        pod = f"{name}-master-0"
        if wanted(pod):
            for line in handle.logs(follow=follow):
                yield pod, line
        return
    pods = {p.node_rank: p.name for p in handle.status().pods if p.phase != "Pending" and wanted(p.name)}
    if len(pods) == 1:
        stream = handle.logs(follow=follow, rank=next(iter(pods)))
    else:
        stream = handle.logs(follow=follow, all_ranks=True) if pods else iter(())
    for line in stream:
        # kubetune prefixes every line with its pod's node rank; the SDK keys by pod name.
        m = re.match(r"\[node (\d+)\] ?(.*)$", line, re.DOTALL)
        if m and int(m.group(1)) in pods:
            yield pods[int(m.group(1))], m.group(2)


def _has(conditions: list[Any], kind: str) -> bool:
    return any(c.type == kind and c.status == "True" for c in conditions)


def _local_object(job: Job) -> dict:
    """A local run as a PyTorchJob object: Created, then Running, then Succeeded or Failed."""
    status = job.status()
    created = next((j["created"] for j in job.backend.list() if j["name"] == job.name), None)
    conditions = [{"type": "Created", "status": "True", "reason": "LocalRunCreated", "lastTransitionTime": created}]
    running = status.phase == "Running"
    conditions.append({"type": "Running", "status": str(running), "reason": "LocalRunRunning"})
    if not running:
        conditions.append(
            {
                "type": status.phase,
                "status": "True",
                "reason": status.reason or f"LocalRun{status.phase}",
                "message": status.message,
            }
        )
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": JOB_KIND,
        "metadata": {"name": job.name, "creationTimestamp": created},
        "status": {"conditions": conditions, "startTime": created},
    }


def _job_model(obj: dict) -> Any:
    from kubeflow.training.api_client import ApiClient
    from kubeflow.training.utils.utils import FakeResponse

    return ApiClient().deserialize(FakeResponse(obj), "KubeflowOrgV1PyTorchJob")
