"""Local backend: ``nodes × procs_per_node`` workers through torch's elastic launcher (c10d rendezvous)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import sys
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from kubetune.config import JobSpec, dump_spec
from kubetune.errors import KubetuneError
from kubetune.lifetime import PARENT_PID_ENV
from kubetune.pod.launch import WORKER_MODULE, Stopped, WorkerFailed, root_failure, translated_failures
from kubetune.training.events import RUN_STARTED_ENV, process_started

__all__ = [
    "SHUTDOWN_GRACE_S", "Stopped", "WorkerFailed", "launch", "launch_config", "root_failure", "run",
    "single_node_config", "worker_env",
]  # fmt: skip
log = logging.getLogger(__name__)
SHUTDOWN_GRACE_S = 110


def launch_config(
    spec: JobSpec,
    *,
    run_id: str,
    rdzv_port: int | None = None,
    local_addr: str | None = None,
    log_dir: Path | None = None,
) -> LaunchConfig:
    """Pure: the elastic launch configuration for this node of ``spec`` (torch elastic keeps its
    per-run files in ``log_dir``; by default a ``/tmp/torchelastic_*`` directory it never removes)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    dist = spec.distributed
    if dist.nodes > 1 and not dist.rdzv_endpoint:
        raise KubetuneError(
            "multi-node local runs need a rendezvous address",
            field="distributed.rdzv_endpoint",
            fix="set it to HOST:PORT of the first node, and run `kubetune run` on every node",
        )
    endpoint = dist.rdzv_endpoint or f"127.0.0.1:{rdzv_port or _free_port()}"
    rdzv_configs = {}
    if dist.nodes > 1 and local_addr:
        # torch guesses which node hosts the rendezvous store from the machine's hostname
        # addresses; an explicit local address that is the endpoint's host settles it.
        rdzv_configs["is_host"] = endpoint.rsplit(":", 1)[0] == local_addr
    return LaunchConfig(
        min_nodes=dist.nodes,
        max_nodes=dist.nodes,
        nproc_per_node=dist.procs_per_node,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs,
        max_restarts=dist.max_restarts,
        # how often the agent polls its workers: a finished run's launcher exits within this (torch's
        # default is 0.1 s; the polling costs nothing measurable)
        monitor_interval=0.1,
        **_shutdown_grace(),
        # The address other nodes reach this one at (MASTER_ADDR when it holds rank 0).
        local_addr=local_addr or ("127.0.0.1" if dist.nodes == 1 else None),
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir)) if log_dir else None,
    )


def _shutdown_grace() -> dict:
    """After SIGTERM the workers get this long to finish the step and write a checkpoint before
    the launcher kills them (torch's default is 30 s). LaunchConfig has the field from torch 2.13;
    older releases keep their 30 s."""
    import dataclasses

    return (
        {"shutdown_timeout": SHUTDOWN_GRACE_S}
        if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}
        else {}
    )


def worker_env(spec: JobSpec) -> dict[str, str]:
    """Pure: environment additions for the launcher and its workers."""
    threads = spec.distributed.threads_per_proc or max(1, (os.cpu_count() or 1) // spec.distributed.procs_per_node)
    return {
        "OMP_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        # A fresh rendezvous TCPStore every round: the shared one outlives restarts, and restarted
        # workers then read the addresses their dead predecessors published (gloo connects to a
        # port nobody listens on). The per-agent restart count cannot namespace it either: after
        # one node is replaced, the nodes' counts differ.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }


def run(spec: JobSpec, local_addr: str | None = None) -> dict[int, object]:
    """Run ``spec`` on this machine; blocks until the workers finish.

    Raises:
        KubetuneError: a worker stopped on a user error.
        Stopped: SIGTERM/SIGINT stopped the run after a checkpoint.
        WorkerFailed: a worker crashed or was killed (names the rank and its exit code).
    """
    # Every node of a multi-node job must use the same run id; a single node gets a fresh one.
    run_id = spec.name if spec.distributed.nodes > 1 else f"{spec.name}-{uuid.uuid4().hex[:8]}"
    # The elastic agent logs every restart and shutdown at WARNING; our workers already say why.
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")] + [
        "torch.distributed.elastic"
    ]:
        logging.getLogger(name).setLevel(logging.ERROR)  # torch sets levels on its child loggers too
    workdir = Path(tempfile.mkdtemp(prefix=f"kubetune-{spec.name}-"))  # removed when the run ends, however it ends
    spec_file = workdir / "job.yaml"
    try:
        config = launch_config(spec, run_id=run_id, local_addr=local_addr, log_dir=workdir / "elastic")
        spec_file.write_text(dump_spec(spec))
        with translated_failures():
            # the workers' phases count from this process's start (its checks included)
            env = {**worker_env(spec), RUN_STARTED_ENV: repr(process_started())}
            return launch(config, ("-u", "-m", WORKER_MODULE, str(spec_file)), env)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def launch(config: LaunchConfig, args: Sequence[str], env: Mapping[str, str] | None = None) -> dict[int, object]:
    """The one elastic launch of kubetune's local processes (`kubetune run`'s workers, `kubetune eval --procs`'s
    ranks): ``config``'s workers each run ``python *args`` with this process's environment plus ``env`` and
    ``PARENT_PID_ENV`` (the workers die with this process, however it ends: ``kubetune.lifetime``), restored
    after. Blocks until they end.

    Returns:
        Each local rank's return value (torch's ``elastic_launch``).

    Raises:
        SignalException: the launcher's handler took SIGTERM or SIGINT and stopped the workers.
        ChildFailedError: a worker failed (torch's; ``pod.launch.translated_failures`` translates it for a job).
    """
    with _launcher_environment({**(env or {}), PARENT_PID_ENV: str(os.getpid())}):
        return elastic_launch(config, entrypoint=sys.executable)(*args)


def single_node_config(procs: int, *, run_id: str, monitor_interval: float) -> LaunchConfig:
    """Pure: the launch of ``procs`` processes on this machine that restart nothing (`kubetune eval --procs`),
    rendezvous on a free local port (c10d), torch's defaults otherwise."""
    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=procs,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=monitor_interval,
    )


@contextlib.contextmanager
def _launcher_environment(additions: dict[str, str]):
    """This process's environment with ``additions`` while the launch runs, restored afterwards.

    Why this process's own environment and not a dict passed down: torch's elastic launcher takes
    none (``LaunchConfig`` has no field for it). Each worker's environment is a copy of the
    launching process's plus the per-rank variables the agent adds, and the agent's rendezvous
    handler reads TORCH_DISABLE_SHARE_RDZV_TCP_STORE from this process's environment itself.
    """
    saved = {name: os.environ.get(name) for name in additions}
    os.environ.update(additions)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
