"""How torch's elastic launcher ending becomes kubetune's outcome, shared by `kubetune run` and the
pod launcher: which worker failure caused the others, the pod's exit code for each outcome (the
Training Operator retries only codes >= 128), and the launch configuration torchrun would build
from the operator's PET_* environment."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest
import torch.distributed
from torch.distributed.elastic.multiprocessing import Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError

from kubetune.backends.local.launcher import Stopped, WorkerFailed, root_failure
from kubetune.errors import KubetuneError
from kubetune.pod import launch

GLOO_RESET = (
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:26241: "
    "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application."
)
GLOO_TIMEOUT = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv operation to complete"
NCCL_TIMEOUT = "DistBackendError: [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE) ran for 600000 milliseconds"


def _failure(rank: int, exitcode: int, timestamp: int, message: str | None = None, tmp=None) -> ProcessFailure:
    """A worker's failure as the agent reads it: with an error file (what torch's @record writes
    for an uncaught exception) when ``message`` is given, else none (a signal, sys.exit)."""
    error_file = "/nonexistent"
    if message is not None:
        error_file = str(tmp / f"error-{rank}.json")
        with open(error_file, "w") as f:
            json.dump(
                {
                    "message": {
                        "message": message,
                        "extraInfo": {"py_callstack": "Traceback ...", "timestamp": str(timestamp)},
                    }
                },
                f,
            )
    failure = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=error_file)
    failure.timestamp = timestamp  # as if read from the rank's error file
    return failure


@pytest.mark.parametrize(
    ("failures", "expected"),
    [
        # rank 1 SIGKILLed (OOM killer): rank 0's gloo error was recorded earlier, then the agent's
        # teardown SIGTERMed it: rank 1 is the cause (the CI failure this test pins).
        ({1: (-signal.SIGKILL, 200), 0: (-signal.SIGTERM, 100)}, (1, -signal.SIGKILL)),
        ({1: (-signal.SIGKILL, 200), 0: (1, 100)}, (1, -signal.SIGKILL)),
        ({0: (-signal.SIGSEGV, 300), 1: (-signal.SIGKILL, 200)}, (0, -signal.SIGSEGV)),
        # Python errors in both: the earlier one caused the other's collective error.
        ({0: (1, 200), 1: (1, 100)}, (1, 1)),
        # a user error beside the teardown SIGTERM of its peer
        ({1: (2, 200), 0: (-signal.SIGTERM, 100)}, (1, 2)),
        # only teardown signals: the earliest
        ({0: (-signal.SIGTERM, 200), 1: (-signal.SIGTERM, 100)}, (1, -signal.SIGTERM)),
        ({3: (143, 100)}, (3, 143)),
    ],
)
def test_root_failure_prefers_the_cause_over_its_consequences(failures, expected):
    rank, failure = root_failure({r: _failure(r, code, ts) for r, (code, ts) in failures.items()})
    assert (rank, failure.exitcode) == expected


@pytest.mark.parametrize(
    ("failures", "expected"),
    [
        # rank 1 stopped on its own error; rank 0's collective then lost its peer in the same second
        # (timestamps are whole seconds): the lost connection is the consequence.
        ({0: (1, 100, GLOO_RESET), 1: (1, 100, "ValueError: bad shape")}, 1),
        ({0: (1, 100, GLOO_RESET), 1: (2, 100, None)}, 1),
        # only lost connections (the cause is on another node): the earliest
        ({0: (1, 101, GLOO_RESET), 1: (1, 100, NCCL_TIMEOUT)}, 1),
    ],
)
def test_root_failure_puts_lost_connections_after_their_cause(tmp_path, failures, expected):
    rank, _ = root_failure({r: _failure(r, code, ts, msg, tmp_path) for r, (code, ts, msg) in failures.items()})
    assert rank == expected


@pytest.mark.parametrize(
    ("error", "code"),
    [
        # SIGTERM (eviction, preemption): the workers wrote a checkpoint; the restarted pod resumes.
        (Stopped("stopped by SIGTERM"), 143),
        (Stopped("stopped by SIGINT", signum=signal.SIGINT), 130),
        # a worker killed by a signal: 128 + the signal
        (WorkerFailed(1, -signal.SIGKILL), 137),
        (WorkerFailed(0, -signal.SIGABRT), 134),
        (WorkerFailed(0, -signal.SIGSEGV), 139),
        # a lost peer or a collective timeout, in the worker or in the agent's rendezvous
        (WorkerFailed(0, 1, GLOO_RESET), 200),
        (WorkerFailed(0, -signal.SIGABRT, GLOO_RESET), 200),  # recorded a lost peer, then aborted while exiting
        (WorkerFailed(0, 1, GLOO_TIMEOUT), 200),
        (WorkerFailed(0, 1, NCCL_TIMEOUT), 200),
        (WorkerFailed(0, 1, "torch.distributed.DistNetworkError: failed to recv, got 0 bytes"), 200),
        (WorkerFailed(0, 1, "ConnectionResetError: [Errno 104] Connection reset by peer"), 200),
        (RendezvousConnectionError("The connection to the C10d store has failed."), 200),
        (RendezvousTimeoutError("The node join timed out"), 200),
        (torch.distributed.DistStoreError("Timed out after 901 seconds waiting for clients. 1/2 clients joined."), 200),
        # retrying cannot help: a user error, a crash in the code, a bad PET_* value
        (KubetuneError("rank 0 stopped on a user error"), 1),
        (WorkerFailed(0, 1, "ValueError: could not broadcast input array"), 1),
        (WorkerFailed(0, 1, "torch.OutOfMemoryError: CUDA out of memory."), 1),
        (WorkerFailed(0, 1), 1),
        (SystemExit(2), 1),
        (ValueError("min_nodes must be > 0"), 1),
    ],
)
def test_exit_code_is_retryable_exactly_when_retrying_can_help(error, code):
    assert launch.exit_code(error) == code


@pytest.mark.parametrize(
    ("failures", "raised", "code"),
    [
        ({0: (2, 100, None), 1: (-signal.SIGTERM, 100, None)}, KubetuneError, 1),
        ({0: (143, 100, None), 1: (143, 100, None)}, Stopped, 143),
        ({0: (-signal.SIGTERM, 100, None), 1: (-signal.SIGKILL, 101, None)}, WorkerFailed, 137),
        ({0: (1, 100, GLOO_RESET)}, WorkerFailed, 200),
        ({0: (1, 100, "KeyError: 'labels'")}, WorkerFailed, 1),
    ],
)
def test_translated_failures(tmp_path, failures, raised, code):
    failed = ChildFailedError(
        "kubetune.pod.worker", {r: _failure(r, c, ts, msg, tmp_path) for r, (c, ts, msg) in failures.items()}
    )
    with pytest.raises(raised) as info, launch.translated_failures():
        raise failed
    assert launch.exit_code(info.value) == code


@pytest.fixture
def launched(monkeypatch, tmp_path):
    """``launched(env) -> (exit code, LaunchConfig, entrypoint, args)``: kubetune.pod.launch.run under
    ``env`` (the PET_* variables), with torch's elastic_launch replaced by a recorder."""
    import torch.distributed.run as torchrun

    for name in [n for n in os.environ if n.startswith(("PET_", "TORCH_ELASTIC_", "MASTER_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    calls = []

    def fake_elastic_launch(config, entrypoint):
        return lambda *args: calls.append((config, entrypoint, list(args))) or {}

    monkeypatch.setattr(torchrun, "elastic_launch", fake_elastic_launch)

    def run(env: dict[str, str]):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        code = launch.run(str(tmp_path / "job.yaml"))
        return (code, *calls[-1])

    return run


def test_static_pod_launches_as_torchrun_does(launched, tmp_path):
    # A PyTorchJob's Worker 1 of Master + 2 Workers (training-operator v1.8.1/v1.9.0 envvar.go, master.go)
    code, config, entrypoint, args = launched(
        {
            "PET_NNODES": "3",
            "PET_NPROC_PER_NODE": "2",
            "PET_NODE_RANK": "2",
            "PET_MASTER_ADDR": "job-master-0",
            "PET_MASTER_PORT": "23456",
            "MASTER_ADDR": "job-master-0",
            "MASTER_PORT": "23456",
            "WORLD_SIZE": "6",
            "RANK": "2",
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "110",  # the rendered env: the pod's grace period less 10 s
        }
    )
    assert code == 0
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (3, 3, 2)
    assert (config.rdzv_backend, config.rdzv_endpoint, config.rdzv_configs["rank"]) == (
        "static",
        "job-master-0:23456",
        2,
    )
    assert (config.max_restarts, config.shutdown_timeout) == (0, 110)
    assert (config.logs_specs._redirects, config.logs_specs._tee) == (
        Std.NONE,
        Std.NONE,
    )  # workers write to the pod's stdout/stderr
    assert (entrypoint, args) == (sys.executable, ["-u", "-m", "kubetune.pod.worker", str(tmp_path / "job.yaml")])


def test_elastic_pod_launches_as_torchrun_does(launched):
    # an elastic PyTorchJob's pod (elastic.go: rendezvous at worker 0's port, nnodes MIN:MAX)
    code, config, _, _ = launched(
        {
            "PET_NNODES": "1:3",
            "PET_NPROC_PER_NODE": "4",
            "PET_RDZV_BACKEND": "c10d",
            "PET_RDZV_ENDPOINT": "job-worker-0:23456",
            "PET_MAX_RESTARTS": "3",
        }
    )
    assert code == 0
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node, config.max_restarts) == (1, 3, 4, 3)
    assert (config.rdzv_backend, config.rdzv_endpoint) == ("c10d", "job-worker-0:23456")
    assert config.shutdown_timeout == 30  # torch's default when the env does not say


def test_single_node_pod_uses_a_local_rendezvous_as_torchrun_does(launched):
    # torchrun's own rule: one node and no master port → c10d on localhost, any free port
    code, config, _, _ = launched({"PET_NNODES": "1", "PET_NPROC_PER_NODE": "2"})
    assert (code, config.rdzv_backend, config.rdzv_endpoint) == (0, "c10d", "localhost:0")


def test_bad_pet_value_is_not_retryable(launched, capsys):
    with pytest.raises(ValueError):  # with its traceback; Python exits 1
        launched({"PET_NNODES": "two", "PET_NPROC_PER_NODE": "2"})
    assert "exit 1 (not retryable" in capsys.readouterr().err


def test_pod_command_is_the_launcher():
    assert launch.pod_command("/workspace/stage/j/job.yaml") == ["kubetune", "launch", "/workspace/stage/j/job.yaml"]
