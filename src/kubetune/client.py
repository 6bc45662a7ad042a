"""Python API for notebooks, mirroring Kubeflow's ``TrainingClient().train(...)`` flow::

    from kubetune import Client
    client = Client(backend="local")            # or "kubeflow", with namespace= / context= / kubeconfig=
    job = client.train("examples/sentiment-minilm.yaml", overrides=["training.max_steps=20"])
    status = job.wait()                         # a JobStatus on both backends: .phase, .reason, .log_tail
    print(status.phase, *job.logs(tail=5), sep="\\n")
    client.list()                               # [{"name", "phase", "created"}, ...]

The local backend runs ``kubetune run`` in a background process; the cluster backends submit
a PyTorchJob (or TrainJob) and reads its status, logs and completion from the cluster. Both
handles answer the same calls with the same types: ``status()`` and ``wait()`` return a
:class:`~kubetune.backends.kubeflow.JobStatus`, ``logs()`` takes ``follow``, ``rank``,
``all_ranks`` and ``tail``, and ``wait(timeout)`` raises ``WaitTimeout``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kubetune.backends.local_runs import LocalJob
from kubetune.backends.status import JobStatus
from kubetune.config import JobSpec, load_spec, parse_spec
from kubetune.errors import KubetuneError


def _as_spec(spec: JobSpec | dict | str | Path, overrides: list[str] | None) -> JobSpec:
    if isinstance(spec, (str, Path)):
        return load_spec(spec, overrides)
    return parse_spec(spec, overrides)


class Client:
    """Entry point: ``Client(backend="local" | "kubeflow" | "pytorchjob" | "trainjob", **backend_options)``.

    The backends are those of ``kubetune.backends.base.REGISTRY``. Cluster options are
    ``namespace`` (default: the spec's ``kubernetes.namespace`` for ``train``, else the
    context's), ``kubeconfig`` and ``context``; ``kubeflow`` also takes ``target``
    (``pytorchjob`` or ``trainjob``; default: PyTorchJob at ``train``, the job's kind as found on
    the cluster at ``get``). The local backend takes none.
    """

    def __init__(self, backend: str = "local", **options: Any):
        from kubetune.backends.base import REGISTRY

        if backend not in (*REGISTRY, "kubeflow"):
            raise KubetuneError(
                f"unknown backend {backend!r}", field="backend", fix=f"use one of {', '.join([*REGISTRY, 'kubeflow'])}"
            )
        if backend == "local" and options:
            raise KubetuneError(
                f"the local backend takes no options, got {sorted(options)}",
                field="backend",
                fix="drop them, or use backend='kubeflow'",
            )
        if backend in REGISTRY and backend != "local":  # the target is the backend's name
            options = {**options, "target": backend}
        self.backend = "local" if backend == "local" else "kubeflow"
        self.options = options

    def _backend(self, namespace: str | None = None, target: str | None = None):
        from kubetune.backends import base

        if self.backend == "local":
            return base.get("local")
        options = {"namespace": namespace, **self.options}
        return base.get(target or options.pop("target", "pytorchjob"), **options)

    def train(
        self, spec: JobSpec | dict | str | Path, overrides: list[str] | None = None, replace: bool = False
    ) -> LocalJob | KubeflowJob:
        """Start a job from a spec object, a dict or a YAML path; returns a handle at once.

        Args:
            spec: the job spec (validated like ``kubetune validate``).
            overrides: ``KEY=VALUE`` strings, as ``--set``.
            replace: a job of the same name that exists (kubeflow) or is running from this Python
                process (local) is deleted first; its checkpoints stay, so the new job resumes
                from them when its spec is compatible.

        Raises:
            KubetuneError: the spec is invalid, or a job of that name exists and ``replace`` is False.
        """
        job_spec = _as_spec(spec, overrides)
        backend = self._backend(job_spec.kubernetes.namespace)
        name = backend.submit(job_spec, replace=replace)
        return backend.job(name) if self.backend == "local" else KubeflowJob(backend, name, spec=job_spec)

    def get(self, name: str) -> LocalJob | KubeflowJob:
        """A handle on an existing job: one on the cluster (kubeflow), or one started from this
        Python process (local).

        Raises:
            KubetuneError: no such job.
        """
        if self.backend == "local":
            return self._backend().job(name)
        if "target" in self.options:
            backend = self._backend()
        else:  # the job's kind as found on the cluster
            from kubetune.backends.kubeflow import KubeflowBackend

            backend = KubeflowBackend.of_job(name, **{"namespace": None, **self.options})
        backend.get(name)  # a clear not-found error now, not at the first status()
        return KubeflowJob(backend, name)

    def list(self) -> list[dict[str, str]]:
        """The jobs: ``[{"name", "phase", "created"}]``, as `kubetune list` prints them; on the
        local backend the runs started from this Python process (``created`` is ISO 8601 UTC)."""
        return self._backend().list()


class KubeflowJob:
    """A submitted PyTorchJob/TrainJob."""

    def __init__(self, backend, name: str, spec: JobSpec | None = None):
        self.backend, self.name, self.spec = backend, name, spec

    def status(self) -> JobStatus:
        """Phase, replica counts, restarts, pods, and why a pod failed (with its log tail)."""
        return self.backend.status(self.name)

    def wait(self, timeout: float | None = None) -> JobStatus:
        """Block until Succeeded or Failed (a watch); raises ``WaitTimeout`` after ``timeout`` s."""
        return self.backend.wait(self.name, timeout)

    def progress(self) -> dict | None:
        """Rank 0's progress (step, total_steps, epoch, loss, lr, samples_per_s, eta_s, last_eval), read
        from its log; None before its first progress line."""
        return self.status().progress

    def metrics(self) -> dict | None:
        """A succeeded job's metrics: its whole metrics.json where the CLI can read the output (s3://),
        else the headline metrics of rank 0's last log line; None before it succeeded."""
        st = self.status()
        if st.phase != "Succeeded":
            return None
        spec = self.backend.spec_of(self.name)
        if spec is not None and spec.output.uri.startswith("s3://"):
            from kubetune import providers
            from kubetune.providers import s3

            providers.configure(spec)  # the spec's endpoint (MinIO); credentials from the environment
            text = s3.read_text(spec.output.uri.rstrip("/") + "/metrics.json", field="output.uri")
            if text:
                return json.loads(text)
        return (st.progress or {}).get("metrics")

    def logs(
        self, follow: bool = False, rank: int | None = None, all_ranks: bool = False, tail: int | None = None
    ) -> Iterator[str]:
        """Lines of the pod with node rank ``rank`` (default 0), or of every pod (``all_ranks``),
        each prefixed ``[node N]``; ``tail``: only the last N lines of each pod."""
        return self.backend.logs(self.name, follow=follow, rank=rank, all_ranks=all_ranks, tail=tail)

    def delete(self, storage: bool = False) -> list[str]:
        """Delete the job; its workspace claim (the output) only with ``storage``.

        Returns notes on what was kept or removed.
        """
        return self.backend.delete(self.name, storage=storage)
