"""The backend seam: one protocol every place a job can run implements, and the name registry the
CLI and the Python client pick a backend from. A new backend is one module and one line here.
What differs between backends for their callers (which take cluster connection options, which
a command line reaches a job of by name) is said here too, so that the CLI and the client never
branch on a backend's name."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from kubetune.backends.status import JobStatus
from kubetune.config import JobSpec
from kubetune.errors import KubetuneError


class Backend(Protocol):
    def submit(self, spec: JobSpec, replace: bool = False) -> str:
        """Start the job; returns its name. ``replace``: delete a job of that name first."""

    def status(self, name: str) -> JobStatus:
        """Phase, replicas, restarts, and why it failed."""

    def logs(
        self,
        name: str,
        follow: bool = False,
        *,
        tail: int | None = None,
        rank: int | None = None,
        all_ranks: bool = False,
    ) -> Iterator[str]:
        """The job's log lines (``follow``: until it ends; ``tail``: the last N first; ``rank``: node ``rank``'s
        only, ``all_ranks``: every node's)."""

    def wait(self, name: str, timeout: float | None = None) -> JobStatus:
        """Block until it succeeds or fails; raises ``WaitTimeout`` after ``timeout`` seconds."""

    def delete(self, name: str, **options: Any) -> list[str]:
        """Stop and remove the job; returns notes on what was kept or removed."""

    def list(self) -> list[dict]:
        """The jobs: ``[{"name", "phase", "created"}]``."""

    def spec_of(self, name: str) -> JobSpec | None:
        """The job's spec as it was submitted (None once the job is gone)."""

    def for_job(self, name: str) -> Backend:
        """The backend a handle on job ``name`` holds (``kubetune.client.Job``): it answers for
        that job from then on, also where a later job takes the name (a replaced local run).
        Raises ``KubetuneError`` when there is no job of that name."""

    def output_dir(self, name: str) -> Path | None:
        """The directory on this machine the job writes its output to; None for a job that runs
        elsewhere (its ``status().output`` says where its artifacts are)."""


class MachineBackend(Backend, Protocol):
    """A backend whose jobs run on this machine (one not in ``CLUSTER``)."""

    def has(self, name: str) -> bool:
        """Whether there is a run of that name (made by ``reach``: a record of it on this machine)."""


class ForegroundBackend(MachineBackend, Protocol):
    """The backend `kubetune run` runs a job with, in the foreground (``foreground``)."""

    def run(self, spec: JobSpec, local_addr: str | None = None) -> dict[int, object]:
        """Run the job here until it ends; returns the workers' results by rank."""

    def record_run(self, spec: JobSpec) -> Path | None:
        """Record the run (what `kubetune status NAME` reads from another shell); its record's path."""

    def end_run(self, record: Path, code: int) -> None:
        """Mark the recorded run ended with exit ``code``."""


# name -> "module:class" (imported on first use: the cluster backends load the Kubernetes client)
REGISTRY = {
    "local": "kubetune.backends.local.runs:LocalBackend",
    "pytorchjob": "kubetune.backends.kubeflow.backend:PyTorchJobBackend",
    "trainjob": "kubetune.backends.kubeflow.backend:TrainJobBackend",
}
# The backends whose jobs are on a cluster: they take the connection options (namespace,
# kubeconfig, context), and any process reaches their jobs by name (`kubetune submit`, `logs`,
# `wait`, `delete`). The others run jobs on this machine: such a run belongs to the process that
# started it, and a command line in another shell reads its record (`status`, `list`).
CLUSTER = ("pytorchjob", "trainjob")
# Client(backend="kubeflow"), the Kubeflow SDK's name: the cluster backends (its ``target`` option
# picks one; without it a job's kind is found on the cluster, and new jobs are PyTorchJobs).
GROUPS = {"kubeflow": CLUSTER}


# What serves a finished job's export on a cluster (`--serve`): KServe InferenceServices
SERVING = "kubetune.backends.kserve.backend:KServeBackend"


def _made(entry: str, **options: Any) -> Any:
    """The class ``entry`` names (``"module:class"``, its module imported now) made with ``options``."""
    module, _, cls = entry.partition(":")
    return getattr(importlib.import_module(module), cls)(**options)


def serving(namespace: str | None = None, kubeconfig: str | None = None, context: str | None = None):
    """The serving backend (``SERVING``) with these connection options (imported on first use)."""
    return _made(SERVING, namespace=namespace, kubeconfig=kubeconfig, context=context)


# What runs a spec's tune section on a cluster (`--tune`): Katib Experiments
TUNING = "kubetune.backends.kubeflow.experiments:KatibBackend"


def tuning(namespace: str | None = None, kubeconfig: str | None = None, context: str | None = None):
    """The tuning backend (``TUNING``) with these connection options (imported on first use)."""
    return _made(TUNING, namespace=namespace, kubeconfig=kubeconfig, context=context)


# The backend `kubetune run` runs a job with, in the foreground
FOREGROUND = "local"


def foreground() -> ForegroundBackend:
    """The backend ``FOREGROUND``: `kubetune run`'s."""
    return _made(REGISTRY[FOREGROUND])


def get(name: str, **options: Any) -> Backend:
    """The backend registered as ``name``, made with ``options`` (e.g. namespace, kubeconfig).

    Raises:
        KubetuneError: no backend of that name.
    """
    if name not in REGISTRY:
        raise KubetuneError(
            f"unknown backend {name!r}", field="--target", fix=f"use one of {', '.join(sorted(REGISTRY))}"
        )
    return _made(REGISTRY[name], **options)


def reach(
    name: str, namespace: str | None = None, kubeconfig: str | None = None, context: str | None = None
) -> Backend:
    """The backend registered as ``name`` as a command line reaches it: a cluster backend with
    these connection options; a backend on this machine over the runs recorded there (the
    connection options mean nothing to it).

    Raises:
        KubetuneError: no backend of that name.
    """
    if name in CLUSTER:
        return get(name, namespace=namespace, kubeconfig=kubeconfig, context=context)
    return get(name, recorded=True)


def recorded(name: str) -> Backend | None:
    """The backend on this machine (as ``reach`` makes it) with a run of job ``name`` recorded, or
    None.

    Raises:
        KubetuneError: ``name`` is not a job name, or its record is broken.
    """
    for here in [n for n in REGISTRY if n not in CLUSTER]:
        backend: MachineBackend = _made(REGISTRY[here], recorded=True)  # as ``reach`` makes it
        if backend.has(name):
            return backend
    return None


def of_job(
    name: str, namespace: str | None = None, kubeconfig: str | None = None, context: str | None = None
) -> Backend:
    """The cluster backend of job ``name``'s kind, as found on the cluster (a PyTorchJob or a
    TrainJob); the PyTorchJob backend when there is no such job, whose calls then say so.

    Raises:
        KubetuneError: both kinds have a job of that name, or the cluster cannot be reached.
    """
    from kubetune.backends.kubeflow.backend import KubeflowBackend

    return KubeflowBackend.of_job(name, namespace=namespace, kubeconfig=kubeconfig, context=context)
