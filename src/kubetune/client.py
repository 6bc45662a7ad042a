"""Python API for notebooks, mirroring Kubeflow's ``TrainingClient().train(...)`` flow::

    from kubetune import Client
    client = Client(backend="local")            # or "kubeflow", with namespace= / context= / kubeconfig=
    job = client.train("examples/sentiment-minilm.yaml", overrides=["training.max_steps=20"])
    status = job.wait()                         # a JobStatus on every backend: .phase, .reason, .log_tail
    print(status.phase, *job.logs(tail=5), sep="\\n")
    client.list()                               # [{"name", "phase", "created"}, ...]

The local backend runs ``kubetune run`` in a background process; the cluster backends submit
a PyTorchJob (or TrainJob) and read its status, logs and completion from the cluster. Every
backend hands back the same handle, :class:`Job`, whose calls go through the backend protocol
(``kubetune.backends.base.Backend``): ``status()`` and ``wait()`` return a
:class:`~kubetune.backends.status.JobStatus`, ``logs()`` takes ``follow``, ``rank``,
``all_ranks`` and ``tail``, and ``wait(timeout)`` raises ``WaitTimeout``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kubetune.backends.status import JobStatus
from kubetune.config import JobSpec, load_spec, parse_spec
from kubetune.errors import KubetuneError


def _as_spec(spec: JobSpec | dict | str | Path, overrides: list[str] | None) -> JobSpec:
    if isinstance(spec, (str, Path)):
        return load_spec(spec, overrides)
    return parse_spec(spec, overrides)


class Client:
    """Entry point: ``Client(backend="local" | "kubeflow" | "pytorchjob" | "trainjob", **backend_options)``.

    The backends are those of ``kubetune.backends.base.REGISTRY``; ``kubeflow`` (the Kubeflow SDK's
    name) stands for its cluster backends. Cluster options are ``namespace`` (default: the spec's
    ``kubernetes.namespace`` for ``train``, else the context's), ``kubeconfig`` and ``context``;
    ``kubeflow`` also takes ``target`` (``pytorchjob`` or ``trainjob``; default: PyTorchJob at
    ``train``, the job's kind as found on the cluster at ``get``). The local backend takes none.
    """

    def __init__(self, backend: str = "local", **options: Any):
        from kubetune.backends import base

        known = [*base.REGISTRY, *base.GROUPS]
        if backend not in known:
            raise KubetuneError(f"unknown backend {backend!r}", field="backend", fix=f"use one of {', '.join(known)}")
        if options and not set(base.GROUPS.get(backend, (backend,))) <= set(base.CLUSTER):
            raise KubetuneError(
                f"the {backend} backend takes no options, got {sorted(options)}",
                field="backend",
                fix="drop them, or use backend='kubeflow'",
            )
        if backend in base.CLUSTER:  # the target is the backend's name
            options = {**options, "target": backend}
        self.backend = backend
        self.options = options

    def _names(self) -> tuple[str, ...]:
        """The registered backends this client's jobs may be on: its target's, or its group's."""
        from kubetune.backends import base

        target = self.options.get("target")
        return (target,) if target else base.GROUPS.get(self.backend, (self.backend,))

    def _backend(self, namespace: str | None = None):
        """The backend new jobs go to (the first of ``_names``), with this client's options."""
        from kubetune.backends import base

        name = self._names()[0]
        options = {k: v for k, v in self.options.items() if k != "target"}
        if name in base.CLUSTER:
            options = {"namespace": namespace, **options}
        return base.get(name, **options)

    def train(
        self, spec: JobSpec | dict | str | Path, overrides: list[str] | None = None, replace: bool = False
    ) -> Job:
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
        return Job(backend.for_job(name), name, job_spec)

    def get(self, name: str) -> Job:
        """A handle on an existing job: one on the cluster (kubeflow), or one started from this
        Python process (local; the handle ``train`` returned while it is referenced).

        Raises:
            KubetuneError: no such job.
        """
        from kubetune.backends import base

        if len(self._names()) == 1:
            backend = self._backend()
        else:  # the job's kind as found on the cluster
            backend = base.of_job(name, **{"namespace": None, **self.options})
        return Job(backend.for_job(name), name)  # for_job: a clear not-found error now

    def list(self) -> list[dict[str, str]]:
        """The jobs: ``[{"name", "phase", "created"}]`` (and a TrainJob's ``progress``, the percentage
        of its ``status.trainerStatus``), as `kubetune list` prints them; on the
        local backend the runs started from this Python process (``created`` is ISO 8601 UTC)."""
        return self._backend().list()


class Job:
    """A handle on one job, whichever backend runs it (what ``Client.train`` and ``Client.get``
    return): each call is the backend protocol's call on the job's name, on ``backend`` (the one
    the backend's ``for_job`` gave: a local run's handle keeps answering for that run after a
    later run took its name)."""

    def __init__(self, backend, name: str, spec: JobSpec | None = None):
        self.backend, self.name, self._spec = backend, name, spec

    def __eq__(self, other: object) -> bool:
        # The same job: the same name on the same backend object (for_job gives a local run's own one).
        return isinstance(other, Job) and other.backend is self.backend and other.name == self.name

    def __hash__(self) -> int:
        return hash((id(self.backend), self.name))

    @property
    def spec(self) -> JobSpec | None:
        """The spec the job was started with: the one ``train`` was given, else the backend's
        (``spec_of``: None once the job is gone)."""
        if self._spec is None:
            self._spec = self.backend.spec_of(self.name)
        return self._spec

    @property
    def output(self) -> Path | None:
        """The directory on this machine the job writes its output to (a local run's); None for a
        cluster job, whose ``status().output`` says where its artifacts are."""
        return self.backend.output_dir(self.name)

    def status(self) -> JobStatus:
        """Phase, replica counts, restarts, pods, and why the job failed (with its log tail)."""
        return self.backend.status(self.name)

    def wait(self, timeout: float | None = None) -> JobStatus:
        """Block until Succeeded or Failed; raises ``WaitTimeout`` after ``timeout`` s."""
        return self.backend.wait(self.name, timeout)

    def progress(self) -> dict | None:
        """Rank 0's progress (step, total_steps, epoch, loss, lr, samples_per_s, eta_s, last_eval);
        None before its first progress line. A TrainJob's comes from its ``status.trainerStatus``
        where the Trainer has one (with ``percent`` and ``source: trainerStatus``), else from the log."""
        return self.status().progress

    def metrics(self) -> dict | None:
        """A succeeded job's metrics: its whole metrics.json where this machine can read the output
        (a local run's directory, s3://), else the headline metrics of rank 0's last log line; None
        before it succeeded."""
        st = self.status()
        if st.phase != "Succeeded":  # an earlier run's metrics.json may still be there
            return None
        here = self.backend.output_dir(self.name)
        if here is not None:
            try:
                return json.loads((here / "metrics.json").read_text(encoding="utf-8"))
            except (OSError, ValueError):
                return None
        spec = self.backend.spec_of(self.name)
        if spec is not None:
            from kubetune.artifacts.output import Output

            # the spec's endpoint (MinIO) and the environment's credentials
            found = Output.for_spec(spec).remote_metrics()
            if found is not None:
                return found
        return (st.progress or {}).get("metrics")

    def logs(
        self, follow: bool = False, rank: int | None = None, all_ranks: bool = False, tail: int | None = None
    ) -> Iterator[str]:
        """The job's lines: on a cluster, those of the pod with node rank ``rank`` (default 0) or of
        every pod (``all_ranks``), each prefixed ``[node N]``; a local run's one log holds every
        process's (its only node rank is 0). ``follow``: until the job ends; ``tail``: only the
        last N lines of each log.

        Raises:
            KubetuneError: no such rank, or ``tail`` is negative.
        """
        return self.backend.logs(self.name, follow=follow, rank=rank, all_ranks=all_ranks, tail=tail)

    def delete(self, storage: bool = False, timeout: float | None = None) -> list[str]:
        """Delete the job; a cluster job's workspace claim (the output) only with ``storage`` (a
        local run's output is never deleted). A local run gets SIGTERM, so it writes a
        checkpoint, and is killed after ``timeout`` seconds (default: its shutdown grace plus 10 s).

        Returns notes on what was kept or removed.
        """
        return self.backend.delete(self.name, storage=storage, timeout=timeout)
