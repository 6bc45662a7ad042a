"""The Kubeflow backend's reading side: a job's status (phase, pods, the reason a pod fails, a
failing pod's log tail, progress from rank 0's log, where the output is), its logs (one pod, or
every pod merged), a wait that follows a watch, and the list of jobs. Nothing here changes the
cluster.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

from kubetune.backends.cluster.api import KubeflowConnection
from kubetune.backends.cluster.objects import CONTAINER, JOB_LABEL, WORKSPACE, pvc_name
from kubetune.backends.status import TERMINAL, JobStatus, PodInfo, WaitTimeout
from kubetune.config import JobSpec
from kubetune.errors import KubetuneError

POD_FAILURES = (
    "OOMKilled",
    "ImagePullBackOff",
    "ErrImagePull",
    "CrashLoopBackOff",
    "CreateContainerConfigError",
    "InvalidImageName",
    "Error",
)
# The rank-0 log lines `status` reads for progress: the newest progress event is among the last few; an
# evaluation older than this many lines (more than ~400 log steps ago: a log step is two lines, the progress
# line and its event) is not shown.
PROGRESS_LINES = 800


class KubeflowReader(KubeflowConnection):
    """Reads jobs of one kind in one namespace: get, status, logs, wait, list (and a job's spec)."""

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
            cond: dict[str, Any] = next(
                (c for c in reversed(st.get("conditions") or []) if c.get("type") == "Failed"), {}
            )
            result.reason, result.message = cond.get("reason"), cond.get("message")
        result.output = self._output_of(name)
        # A TrainJob's own status.trainerStatus first (Trainer v2.3 with the TrainJobStatus gate: rank 0
        # sends it), else progress from rank 0's log: the trainer's events, which it also writes there as
        # JSON lines (`training.events.log_line`), read back with json.loads. The CLI may already read pod
        # logs, so no annotation to patch and no extra RBAC for the pods.
        result.progress = self._trainer_progress(job)
        master = next((p for p in result.pods if p.node_rank == 0 and p.phase in ("Running", "Succeeded")), None)
        if result.progress is None and master is not None:
            from kubetune.training.loggers import progress_from_events

            result.progress = progress_from_events(self._tail(master.name, PROGRESS_LINES))
        return result

    def _trainer_progress(self, job: dict) -> dict | None:
        """A TrainJob's ``status.trainerStatus`` as a progress record; None for a PyTorchJob, or without one."""
        if self.target != "trainjob":
            return None
        from kubetune.training.trainer_status import progress_of

        return progress_of((job.get("status") or {}).get("trainerStatus"))

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
            pods = self.core.list_namespaced_pod(self.namespace, label_selector=f"{JOB_LABEL}={name}").items
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
                container=CONTAINER if self.target == "pytorchjob" else None,
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
                container=CONTAINER if self.target == "pytorchjob" else None,
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

    # ---- list ----
    def list(self) -> list[dict]:
        with self._errors("list", f"{self.plural}.{self.group}"):
            items = self.custom.list_namespaced_custom_object(
                self.group, self.version, self.namespace, self.plural, label_selector="app.kubernetes.io/name=kubetune"
            )["items"]
        out = []
        for j in items:
            row = {
                "name": j["metadata"]["name"],
                "phase": phase_of(j),
                "created": j["metadata"].get("creationTimestamp", ""),
            }
            percent = (self._trainer_progress(j) or {}).get("percent")
            if percent is not None:  # a TrainJob's status.trainerStatus (no log is read for a list)
                row["progress"] = percent
            out.append(row)
        return out


def output_location(spec: JobSpec) -> str:
    """Where a cluster job's artifacts are: the remote URI, a path on its claim, or a warning."""
    from kubetune.artifacts.output import Output

    out = Output.for_spec(spec)
    if out.remote:
        return spec.output.uri
    full = out.pod_path(WORKSPACE)
    if spec.kubernetes.storage.mode == "pvc":
        return f"persistentvolumeclaim/{pvc_name(spec)} at {full} (mounted at {WORKSPACE})"
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
