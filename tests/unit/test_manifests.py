"""Rendered Kubernetes objects: golden files, strict validation against the typed models,
the structure the Training Operator needs, and no secret value anywhere."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from kubetune.backends import manifests, strict
from kubetune.config import load_spec, parse_spec

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def _render(path: Path, target: str) -> str:
    spec = load_spec(path)
    return manifests.render(spec, spec.kubernetes.namespace or "default", target).to_yaml()


@pytest.mark.parametrize("target", ["pytorchjob", "trainjob"])
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_match_golden_files(path, target):
    """Set UPDATE_GOLDEN=1 to rewrite them after an intended change (and review the diff)."""
    golden = GOLDEN / f"{path.stem}.{target}.yaml"
    text = _render(path, target)
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}; run with UPDATE_GOLDEN=1"
    assert text == golden.read_text()


@pytest.mark.parametrize("target", ["pytorchjob", "trainjob"])
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_rendered_object_is_strictly_valid(path, target):
    for obj in yaml.safe_load_all(_render(path, target)):
        assert strict.validate(obj) == [], obj["kind"]


def test_strict_validation_catches_unknown_and_mistyped_fields():
    spec = load_spec(EXAMPLES[0])
    job = manifests.render(spec, "ns").job
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    container["imagePullPolcy"] = "Always"
    container["ports"][0]["containerPort"] = "23456"
    job["spec"]["runPolicy"]["backoffLimit"] = True
    problems = strict.validate(job)
    assert any("containers[0].imagePullPolcy: unknown field for V1Container" in p for p in problems)
    assert any("ports[0].containerPort: expected int" in p for p in problems)
    assert any("runPolicy.backoffLimit: expected int" in p for p in problems)
    train = manifests.render(spec, "ns", "trainjob").job
    train["spec"]["trainer"]["numNodez"] = 2
    assert strict.validate(train) == ["TrainJob.spec.trainer.numNodez: unknown field for TrainerV1alpha1Trainer"]


BASE = {"name": "j", "model": {"uri": "hf://org/m"}, "data": {"train": "hf://org/d"}, "output": {"uri": "runs/j"}}


def _spec(**kw):
    raw = yaml.safe_load(yaml.safe_dump(BASE))
    for key, value in kw.items():
        section, _, name = key.partition("__")
        raw.setdefault(section, {})[name] = value
    return parse_spec(raw)


def test_two_nodes_two_gpus_structure():
    spec = _spec(distributed__nodes=2, distributed__procs_per_node=2, resources__gpu=2, kubernetes__storage={"mode": "pvc"},
                 kubernetes__secrets={"hf_token": {"name": "hf", "key": "token"}, "s3": "minio"})
    r = manifests.render(spec, "team-a")
    job = r.job
    assert (job["apiVersion"], job["kind"], job["spec"]["nprocPerNode"]) == ("kubeflow.org/v1", "PyTorchJob", "2")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert {k: v["replicas"] for k, v in replicas.items()} == {"Master": 1, "Worker": 1}
    pod = replicas["Worker"]["template"]
    assert pod["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
    main = pod["spec"]["containers"][0]
    assert main["name"] == "pytorch" and main["command"] == ["torchrun", "-m", "kubetune.worker", "/workspace/stage/j/job.yaml"]
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == str(pod["spec"]["terminationGracePeriodSeconds"] - 10)  # time to checkpoint
    assert main["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in main["env"]
    assert main["envFrom"] == [{"secretRef": {"name": "minio"}}]
    init = pod["spec"]["initContainers"][0]
    assert init["command"] == ["kubetune", "fetch", "/etc/kubetune/job.yaml", "--dest", "/workspace/stage/j"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["job-spec"]["configMap"]["name"] == "j-spec"
    assert volumes["workspace"]["persistentVolumeClaim"]["claimName"] == "j-workspace"
    assert pod["spec"]["terminationGracePeriodSeconds"] >= 60
    assert job["spec"]["runPolicy"] == {"backoffLimit": 3, "cleanPodPolicy": "None", "ttlSecondsAfterFinished": 86400}
    assert "elasticPolicy" not in job["spec"]
    # The spec travels in the ConfigMap, not on a command line.
    assert parse_spec(yaml.safe_load(r.config_map["data"]["job.yaml"])) == spec
    assert r.pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_single_node_has_no_worker_and_node_local_uses_empty_dir():
    r = manifests.render(_spec(), "ns")
    assert list(r.job["spec"]["pytorchReplicaSpecs"]) == ["Master"]
    assert r.pvc is None
    pod = r.job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert {v["name"]: v for v in pod["volumes"]}["workspace"] == {"name": "workspace", "emptyDir": {"sizeLimit": "50Gi"}}
    assert any("lost when the pod ends" in w for w in manifests.warnings_for(_spec()))


def test_elastic_policy():
    spec = _spec(distributed__nodes=3, kubernetes__elastic={"min_nodes": 2, "max_nodes": 4, "max_restarts": 5})
    job = manifests.render(spec, "ns").job
    assert job["spec"]["elasticPolicy"] == {"maxReplicas": 4, "maxRestarts": 5, "minReplicas": 2, "nProcPerNode": 1, "rdzvBackend": "c10d"}
    assert {k: v["replicas"] for k, v in job["spec"]["pytorchReplicaSpecs"].items()} == {"Worker": 3}


@pytest.mark.parametrize("target", ["pytorchjob", "trainjob"])
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_no_secret_value_in_any_rendered_output(path, target, monkeypatch):
    secrets = {"HF_TOKEN": "hf_SECRETtoken123456", "AWS_ACCESS_KEY_ID": "AKIASECRETKEYID0001", "AWS_SECRET_ACCESS_KEY": "s3cr3t/Key+Value/0123456789"}
    for k, v in secrets.items():
        monkeypatch.setenv(k, v)
    text = _render(path, target)
    for value in secrets.values():
        assert value not in text


def test_trainjob_structure():
    spec = _spec(distributed__nodes=2, distributed__procs_per_node=4, resources__gpu=4)
    job = manifests.render(spec, "ns", "trainjob").job
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 4)
    assert trainer["command"][-1].endswith("kubetune fetch /etc/kubetune/job.yaml --dest /workspace/stage/j && exec torchrun -m kubetune.worker /workspace/stage/j/job.yaml")
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"
