"""Local backend: ``nodes × procs_per_node`` workers through torch's elastic launcher (c10d rendezvous)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from pathlib import Path

from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from kubetune.config import JobSpec, dump_spec
from kubetune.errors import KubetuneError

log = logging.getLogger(__name__)
WORKER_MODULE = "kubetune.worker"
SHUTDOWN_GRACE_S = 110


def launch_config(spec: JobSpec, *, run_id: str, rdzv_port: int | None = None, local_addr: str | None = None, log_dir: Path | None = None) -> LaunchConfig:
    """Pure: the elastic launch configuration for this node of ``spec`` (torch elastic keeps its
    per-run files in ``log_dir``; by default a ``/tmp/torchelastic_*`` directory it never removes)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    dist = spec.distributed
    if dist.nodes > 1 and not dist.rdzv_endpoint:
        raise KubetuneError("multi-node local runs need a rendezvous address", field="distributed.rdzv_endpoint", fix="set it to HOST:PORT of the first node, and run `kubetune run` on every node")
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
        monitor_interval=0.5,
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

    return {"shutdown_timeout": SHUTDOWN_GRACE_S} if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)} else {}


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
        KubetuneError: a worker failed (names the rank and its exit code).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from kubetune.distributed import EXIT_PREEMPTED

    # Every node of a multi-node job must use the same run id; a single node gets a fresh one.
    run_id = spec.name if spec.distributed.nodes > 1 else f"{spec.name}-{uuid.uuid4().hex[:8]}"
    os.environ.update(worker_env(spec))
    # The elastic agent logs every restart and shutdown at WARNING; our workers already say why.
    for name in [n for n in logging.root.manager.loggerDict if n.startswith("torch.distributed.elastic")] + ["torch.distributed.elastic"]:
        logging.getLogger(name).setLevel(logging.ERROR)  # torch sets levels on its child loggers too
    workdir = Path(tempfile.mkdtemp(prefix=f"kubetune-{spec.name}-"))  # removed when the run ends, however it ends
    spec_file = workdir / "job.yaml"
    try:
        config = launch_config(spec, run_id=run_id, local_addr=local_addr, log_dir=workdir / "elastic")
        spec_file.write_text(dump_spec(spec))
        return elastic_launch(config, entrypoint=sys.executable)("-u", "-m", WORKER_MODULE, str(spec_file))
    except SignalException as e:
        # This launcher got SIGTERM/SIGINT; torch elastic has passed it on to the workers, which
        # finished their step and wrote a checkpoint before exiting.
        raise Stopped(f"stopped by {e.sigval.name}") from None
    except ChildFailedError as e:
        rank, failure = root_failure(e.failures)
        code = failure.exitcode
        if code == 2:
            raise KubetuneError(f"rank {rank} stopped on a user error (its message is above)") from None
        if code == EXIT_PREEMPTED:
            raise Stopped(f"rank {rank} was stopped by a signal after writing a checkpoint") from None
        raise WorkerFailed(rank, code) from None
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def root_failure(failures: dict[int, object]) -> tuple[int, object]:
    """Pure: the failure that most likely caused the others, as ``(rank, ProcessFailure)``.

    torch's ``get_first_failure`` orders by timestamp, but a worker killed by a signal (the OOM
    killer's SIGKILL, a segfault) leaves no error file, so its timestamp is only when the agent
    noticed it, after its peers had already recorded their own collective errors; and the agent's
    teardown then SIGTERMs the survivors. So: a rank killed by a signal other than that teardown
    SIGTERM comes first (lowest rank), then ranks that exited on their own (earliest timestamp),
    then the teardown's SIGTERMs (earliest timestamp).
    """
    def cause_order(rank: int) -> tuple:
        code = failures[rank].exitcode
        teardown = code == -signal.SIGTERM
        killed = code < 0 and not teardown
        return (not killed, teardown, 0 if killed else failures[rank].timestamp, rank)

    rank = min(failures, key=cause_order)
    return rank, failures[rank]


class Stopped(Exception):
    """The run was stopped by SIGTERM/SIGINT after a checkpoint: exit 143, resume by running again."""


class WorkerFailed(Exception):
    """A worker crashed (not a user error): exit non-zero with that rank's code."""

    def __init__(self, rank: int, exitcode: int):
        self.rank, self.exitcode = rank, exitcode
        super().__init__(f"worker rank {rank} failed with exit code {exitcode} (its error is above)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
