"""The backend seam: one protocol every place a job can run implements, and the name registry the
CLI and the Python client pick a backend from. A new backend is one module and one line here."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any, Protocol

from kubetune.backends.status import JobStatus
from kubetune.config import JobSpec
from kubetune.errors import KubetuneError


class Backend(Protocol):
    def submit(self, spec: JobSpec, replace: bool = False) -> str:
        """Start the job; returns its name. ``replace``: delete a job of that name first."""

    def status(self, name: str) -> JobStatus:
        """Phase, replicas, restarts, and why it failed."""

    def logs(self, name: str, follow: bool = False, tail: int | None = None, **options: Any) -> Iterator[str]:
        """The job's log lines (``follow``: until it ends; ``tail``: the last N first)."""

    def wait(self, name: str, timeout: float | None = None) -> JobStatus:
        """Block until it succeeds or fails; raises ``WaitTimeout`` after ``timeout`` seconds."""

    def delete(self, name: str, **options: Any) -> list[str]:
        """Stop and remove the job; returns notes on what was kept or removed."""

    def list(self) -> list[dict]:
        """The jobs: ``[{"name", "phase", "created"}]``."""

    def spec_of(self, name: str) -> JobSpec | None:
        """The job's spec as it was submitted (None once the job is gone)."""


# name -> "module:class" (imported on first use: the cluster backends load the Kubernetes client)
REGISTRY = {
    "local": "kubetune.backends.local_runs:LocalBackend",
    "pytorchjob": "kubetune.backends.kubeflow:PyTorchJobBackend",
    "trainjob": "kubetune.backends.kubeflow:TrainJobBackend",
}


def get(name: str, **options: Any) -> Backend:
    """The backend registered as ``name``, made with ``options`` (e.g. namespace, kubeconfig).

    Raises:
        KubetuneError: no backend of that name.
    """
    if name not in REGISTRY:
        raise KubetuneError(
            f"unknown backend {name!r}", field="--target", fix=f"use one of {', '.join(sorted(REGISTRY))}"
        )
    module, _, cls = REGISTRY[name].partition(":")
    return getattr(importlib.import_module(module), cls)(**options)
