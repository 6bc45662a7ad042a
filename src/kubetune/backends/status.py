"""What every backend answers about a job: its status, and the wait timeout. Neutral (no
Kubernetes client), so a local run never imports one."""

from __future__ import annotations

from dataclasses import dataclass, field

from kubetune.errors import KubetuneError

TERMINAL = ("Succeeded", "Failed")


@dataclass
class PodInfo:
    name: str
    node_rank: int
    phase: str
    restarts: int
    reason: str | None = None
    message: str | None = None


@dataclass
class JobStatus:
    """What `kubetune status` prints: phase, replicas, restarts and why a job failed."""

    name: str
    namespace: str
    kind: str
    phase: str
    replicas: dict[str, dict[str, int]] = field(default_factory=dict)
    restarts: int = 0
    reason: str | None = None
    message: str | None = None
    failed_pod: str | None = None
    log_tail: list[str] = field(default_factory=list)
    pods: list[PodInfo] = field(default_factory=list)
    output: str | None = None  # where the job's artifacts are (or will be)
    progress: dict | None = None  # step, total_steps, epoch, loss, lr, rates, eta_s, last_eval (rank 0's)
    metrics: dict | None = None  # a succeeded job's metrics.json, where it can be read

    @property
    def done(self) -> bool:
        return self.phase in TERMINAL


class WaitTimeout(KubetuneError):
    """`kubetune wait` ran out of time (exit code 3)."""
