"""Python API for notebooks, mirroring Kubeflow's ``TrainingClient().train(...)`` flow::

    from kubetune import Client
    job = Client(backend="local").train("examples/sentiment-minilm.yaml", overrides=["training.max_steps=20"])
    job.wait(); print(job.status()); print("".join(job.logs()))

The local backend runs ``kubetune run`` in a background process; the kubeflow backend submits
a PyTorchJob (or TrainJob) and reads its status, logs and completion from the cluster.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kubetune.config import JobSpec, dump_spec, load_spec, parse_spec
from kubetune.errors import KubetuneError


def _as_spec(spec: JobSpec | dict | str | Path, overrides: list[str] | None) -> JobSpec:
    if isinstance(spec, (str, Path)):
        return load_spec(spec, overrides)
    return parse_spec(spec, overrides)


class Client:
    """Entry point: ``Client(backend="local" | "kubeflow", **backend_options)``."""

    def __init__(self, backend: str = "local", **options: Any):
        if backend not in ("local", "kubeflow"):
            raise KubetuneError(f"unknown backend {backend!r}", field="backend", fix="use local or kubeflow")
        self.backend = backend
        self.options = options

    def train(self, spec: JobSpec | dict | str | Path, overrides: list[str] | None = None, replace: bool = False) -> LocalJob | KubeflowJob:
        """Start a job from a spec object, a dict or a YAML path; returns a handle at once."""
        job_spec = _as_spec(spec, overrides)
        if self.backend == "local":
            return LocalJob.start(job_spec)
        from kubetune.backends.kubeflow import KubeflowBackend

        backend = KubeflowBackend(**{"namespace": job_spec.kubernetes.namespace, **self.options})
        return KubeflowJob(backend, backend.submit(job_spec, replace=replace))


class LocalJob:
    """A `kubetune run` in a background process on this machine."""

    def __init__(self, spec: JobSpec, proc: subprocess.Popen, log_path: Path):
        self.spec, self.name, self._proc, self.log_path = spec, spec.name, proc, log_path

    @classmethod
    def start(cls, spec: JobSpec) -> LocalJob:
        workdir = Path(tempfile.mkdtemp(prefix=f"kubetune-{spec.name}-"))
        spec_file, log_path = workdir / "job.yaml", workdir / "job.log"
        spec_file.write_text(dump_spec(spec))
        log = log_path.open("wb")
        proc = subprocess.Popen([sys.executable, "-m", "kubetune", "run", str(spec_file)], stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()
        return cls(spec, proc, log_path)

    def status(self) -> str:
        code = self._proc.poll()
        return "Running" if code is None else "Succeeded" if code == 0 else "Failed"

    def wait(self, timeout: float | None = None) -> str:
        """Block until the run ends; returns Succeeded or Failed."""
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise KubetuneError(f"job {self.name} is still running after {timeout:.0f} s", fix="wait longer") from None
        return self.status()

    def logs(self, follow: bool = False) -> Iterator[str]:
        """The run's output lines; with ``follow``, until the run ends."""
        with self.log_path.open("r", encoding="utf-8", errors="replace") as f:
            while True:
                line = f.readline()
                if line:
                    yield line.rstrip("\n")
                elif follow and self._proc.poll() is None:
                    time.sleep(0.2)
                else:
                    rest = f.read()
                    yield from rest.splitlines()
                    return

    def delete(self) -> None:
        """Stop the run (SIGTERM to the launcher, which stops its workers)."""
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()

    @property
    def output(self) -> Path:
        return Path(self.spec.output.uri.removeprefix("file://"))


class KubeflowJob:
    """A submitted PyTorchJob/TrainJob."""

    def __init__(self, backend, name: str):
        self.backend, self.name = backend, name

    def status(self):
        return self.backend.status(self.name)

    def wait(self, timeout: float | None = None):
        return self.backend.wait(self.name, timeout)

    def logs(self, follow: bool = False, rank: int | None = None, all_ranks: bool = False, tail: int | None = None) -> Iterator[str]:
        return self.backend.logs(self.name, follow=follow, rank=rank, all_ranks=all_ranks, tail=tail)

    def delete(self) -> None:
        self.backend.delete(self.name)
