"""The pod's main process under ``restartPolicy: ExitCode``: the pod command run as a pod runs it
(the Training Operator's PET_* environment and the rendered container's env), interrupted by real
signals. The operator restarts a pod only on an exit code >= 128 (training-operator
pkg/util/train/train_util.go, IsRetryableExitCode), so: SIGTERM → 143 with a checkpoint, and the
next pod resumes; a worker killed by SIGKILL → 137; a lost peer → 200; a user error → 1."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, descendants, is_worker, write_spec

from kubetune.backends.cluster import objects
from kubetune.backends.kubeflow import manifests
from kubetune.config import load_spec
from kubetune.pod import launch

pytestmark = pytest.mark.integration


def _spec(out: Path, **changes) -> dict:
    """The tiny random-init Llama on the shipped chat data: about 12 steps a second on 2 CPU cores."""
    spec = {
        "name": "pod-exit",
        "task": "causal-lm",
        "model": {"uri": "pkg://kubetune/assets/tiny-llama"},
        "data": {
            "train": "pkg://kubetune/assets/sentiment/sentiment-chat.jsonl",
            "format": "chat",
            "eval_fraction": 0.05,
            "max_length": 128,
            "max_train_samples": 800,
        },
        "lora": {"r": 8, "alpha": 16, "target_modules": "all-linear"},
        "training": {"epochs": 3, "batch_size": 8, "learning_rate": 3.0e-3, "log_every": 1, "seed": 3},
        "distributed": {"nodes": 1, "procs_per_node": 2},
        "output": {"uri": str(out), "report_baseline": False},
    }
    for section, values in changes.items():
        spec[section] = {**spec.get(section, {}), **values}
    return spec


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def start_pod():
    """``start_pod(spec_path, pet_env)``: one pod's main container, running the pod command (the
    `kubetune` console script of this venv) with the rendered container's env and the operator's
    PET_* variables, in its own session as a container's PID 1 is. Signals go to that process
    only, as the kubelet sends them. Pods still running at the end are killed, workers included."""
    pods = []

    def start(spec_path: Path, pet: dict[str, str]) -> subprocess.Popen:
        spec = load_spec(spec_path)
        container = manifests.render(spec, "ns").job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"][
            "containers"
        ][0]
        rendered = {
            e["name"]: e["value"]
            for e in container["env"]
            if "value" in e and e["name"] not in ("HF_HOME", "KUBETUNE_CACHE")
        }
        env = {**os.environ, **rendered, **pet, "OMP_NUM_THREADS": "1"}
        cmd = launch.pod_command(str(spec_path))
        cmd = [str(Path(sys.executable).parent / cmd[0]), *cmd[1:]]
        pods.append(
            subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
        return pods[-1]

    yield start
    for pod in pods:
        if pod.poll() is None:
            _kill_pod(pod)
            pod.communicate()


def _kill_pod(pod: subprocess.Popen) -> None:
    """What losing the pod's node does: the launcher and its workers (each in a session of its
    own, so not one process group) killed at once."""
    for pid in [pod.pid, *descendants(pod.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _static_env(nodes: int, nproc: int, node_rank: int, port: int) -> dict[str, str]:
    """What the Training Operator (v1.8.1, v1.9.0) sets on a Master/Worker pod of a PyTorchJob."""
    return {
        "PET_NNODES": str(nodes),
        "PET_NPROC_PER_NODE": str(nproc),
        "PET_NODE_RANK": str(node_rank),
        "PET_MASTER_ADDR": "127.0.0.1",
        "PET_MASTER_PORT": str(port),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(nodes * nproc),
        "RANK": str(node_rank),
    }


def _elastic_env(nodes: str, nproc: int, port: int, max_restarts: int, index: int) -> dict[str, str]:
    """What the operator sets on a pod of an elastic PyTorchJob (no Master: c10d at worker 0).

    On a cluster, torch makes worker 0 the rendezvous host because its hostname is the endpoint's;
    here every pod is 127.0.0.1, so the rendezvous configuration says which one it is."""
    return {
        "PET_NNODES": nodes,
        "PET_NPROC_PER_NODE": str(nproc),
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": f"127.0.0.1:{port}",
        "PET_MAX_RESTARTS": str(max_restarts),
        "PET_RDZV_CONF": f"is_host={int(index == 0)}",
    }


def _train_steps(out: Path) -> list[int]:
    path = out / "history.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["step"] for line in lines if line.endswith("}") and json.loads(line)["type"] == "train"]


def _wait_for_step(out: Path, step: int, pod: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while len(_train_steps(out)) < step:
        assert pod.poll() is None, pod.communicate()[1][-3000:]
        assert time.time() < deadline, "training did not reach the step in time"
        time.sleep(0.05)


def _worker_pids(launcher: int) -> list[int]:
    return [pid for pid in descendants(launcher) if is_worker(pid)]


@pytest.mark.e2e  # make test: SIGTERM, checkpoint and resume through `kubetune run` (test_mlflow.py); exit codes below
def test_sigterm_checkpoints_exits_143_and_the_next_pod_resumes(tmp_path, start_pod):
    out = tmp_path / "out"
    spec_path = write_spec(tmp_path / "job.yaml", _spec(out, training={"max_steps": 30}))
    pod = start_pod(spec_path, _static_env(1, 2, 0, _free_port()))
    _wait_for_step(out, 3, pod)
    pod.send_signal(signal.SIGTERM)  # the kubelet: SIGTERM to the container's main process only
    _, err = pod.communicate(timeout=120)
    assert pod.returncode == 143, err[-3000:]
    saved = [p for p in (out / "checkpoints").glob("step-*") if (p / "COMPLETE").exists()]
    assert len(saved) == 1 and 3 <= int(saved[0].name[5:]) < 30, saved
    assert "kubetune launch: stopped by SIGTERM — exit 143 (retryable" in err

    # The operator deletes the pod and creates it again: same command, same environment.
    again = start_pod(spec_path, _static_env(1, 2, 0, _free_port()))
    _, err = again.communicate(timeout=120)
    assert again.returncode == 0, err[-3000:]
    assert f"resumed from checkpoint step {int(saved[0].name[5:])} " in err
    assert json.loads((out / "metrics.json").read_text())["global_step"] == 30
    assert _train_steps(out) == list(range(1, 31))  # nothing lost, nothing twice


def test_user_error_exits_1_which_the_operator_does_not_retry(tmp_path, start_pod):
    # No preflight in a pod: the workers find the missing column and exit 2; retrying cannot help.
    spec_path = write_spec(
        tmp_path / "job.yaml",
        _spec(tmp_path / "out", data={"messages_column": "conversation"}, distributed={"procs_per_node": 1}),
    )
    pod = start_pod(spec_path, _static_env(1, 1, 0, _free_port()))
    _, err = pod.communicate(timeout=120)
    assert pod.returncode == 1, err[-3000:]
    assert "conversation" in err and "kubetune launch: rank 0 stopped on a user error" in err and "not retryable" in err
    assert "Traceback" not in err


@pytest.mark.e2e  # make test: a user error's exit code below; the mapping of every failure is unit-tested (test_local_backend.py)
def test_oom_killed_worker_exits_137_and_its_peer_pod_exits_200(tmp_path, start_pod):
    # Two pods of an elastic job (c10d rendezvous at worker 0, as the operator sets it; no restarts
    # left). The OOM killer's SIGKILL to the second pod's worker: that pod exits 128 + 9; the first
    # pod's worker loses its peer in the middle of a collective, and that pod exits 200.
    out = tmp_path / "out"
    spec_path = write_spec(tmp_path / "job.yaml", _spec(out, distributed={"nodes": 2, "procs_per_node": 1}))
    port = _free_port()
    pods = [start_pod(spec_path, _elastic_env("2:2", 1, port, max_restarts=0, index=i)) for i in range(2)]
    _wait_for_step(out, 2, pods[0])
    (victim,) = _worker_pids(pods[1].pid)
    os.kill(victim, signal.SIGKILL)
    errs = [pod.communicate(timeout=120)[1] for pod in pods]
    assert [pod.returncode for pod in pods] == [launch.EXIT_INFRASTRUCTURE, 128 + signal.SIGKILL], (
        errs[0][-3000:] + errs[1][-3000:]
    )
    assert "failed with exit code -9 (SIGKILL)" in errs[1] and "exit 137 (retryable" in errs[1]
    # The worker exits 1 on the lost peer's error; if gloo aborts it while it exits (pending work on the
    # broken connection: timing-dependent), it ends by SIGABRT after recording that error. Both are 200.
    assert "gloo/transport/" in errs[0] and "exit 200 (retryable" in errs[0]
    assert re.search(r"worker rank 0 failed with exit code (1|-6 \(SIGABRT\)) ", errs[0]), errs[0][-3000:]


def test_rendered_pods_run_the_launcher(tmp_path):
    """Both targets' main container runs `kubetune launch` as its PID 1: the PyTorchJob directly,
    the TrainJob after staging through `exec`, so the shell neither keeps SIGTERM from the
    launcher nor changes its exit code."""
    spec = load_spec(write_spec(tmp_path / "job.yaml", _spec(tmp_path / "out", distributed={"nodes": 2})))
    staged = f"{objects.stage_dir(spec)}/job.yaml"
    for replica in manifests.render(spec, "ns").job["spec"]["pytorchReplicaSpecs"].values():
        assert replica["template"]["spec"]["containers"][0]["command"] == launch.pod_command(staged)
    trainer = manifests.build_trainjob(spec, "ns")["spec"]["trainer"]["command"]
    assert trainer[:2] == ["sh", "-c"] and trainer[2].endswith(" && exec " + shlex.join(launch.pod_command(staged)))
