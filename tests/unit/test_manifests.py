"""Rendered Kubernetes objects: golden files, strict validation against the typed models,
the structure the Training Operator needs, and no secret value anywhere."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from fakes import crds, webhooks

from kubetune.backends.cluster import strict
from kubetune.backends.kserve import manifests as serving
from kubetune.backends.kubeflow import checks, manifests
from kubetune.config import load_spec, parse_spec
from kubetune.config.tasks import entries, starter_text
from kubetune.errors import SpecError

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
# The example/target pairs that cannot render, and the one line that says why.
REFUSED = {
    (
        "sentiment-minilm-2x2-gpu",
        "trainjob",
    ): "kubernetes.elastic: a TrainJob has no elastic policy — remove it for --target trainjob, or use --target pytorchjob"
}
PAIRS = [
    pytest.param(p, t, id=f"{p.stem}-{t}")
    for p in EXAMPLES
    for t in ("pytorchjob", "trainjob")
    if (p.stem, t) not in REFUSED
]


def _render(path: Path, target: str) -> str:
    spec = load_spec(path)
    return manifests.render(spec, spec.kubernetes.namespace or "default", target).to_yaml()


@pytest.mark.parametrize("path, target", PAIRS)
def test_examples_match_golden_files(path, target):
    """Set UPDATE_GOLDEN=1 to rewrite them after an intended change (and review the diff)."""
    golden = GOLDEN / f"{path.stem}.{target}.yaml"
    text = _render(path, target)
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}; run with UPDATE_GOLDEN=1"
    assert text == golden.read_text()


@pytest.mark.parametrize("path, target", PAIRS)
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
    spec = _spec(
        distributed__nodes=2,
        distributed__procs_per_node=2,
        resources__gpu=2,
        kubernetes__storage={"mode": "pvc"},
        kubernetes__secrets={"hf_token": {"name": "hf", "key": "token"}, "s3": "minio"},
    )
    r = manifests.render(spec, "team-a")
    job = r.job
    assert (job["apiVersion"], job["kind"], job["spec"]["nprocPerNode"]) == ("kubeflow.org/v1", "PyTorchJob", "2")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert {k: v["replicas"] for k, v in replicas.items()} == {"Master": 1, "Worker": 1}
    pod = replicas["Worker"]["template"]
    assert pod["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
    main = pod["spec"]["containers"][0]
    assert main["name"] == "pytorch" and main["command"] == ["kubetune", "launch", "/workspace/stage/j/job.yaml"]
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == str(
        pod["spec"]["terminationGracePeriodSeconds"] - 10
    )  # time to checkpoint
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
    assert {v["name"]: v for v in pod["volumes"]}["workspace"] == {
        "name": "workspace",
        "emptyDir": {"sizeLimit": "50Gi"},
    }
    assert any("lost when the pod ends" in w for w in checks.warnings_for(_spec()))


def test_elastic_policy():
    spec = _spec(distributed__nodes=3, kubernetes__elastic={"min_nodes": 2, "max_nodes": 4, "max_restarts": 5})
    job = manifests.render(spec, "ns").job
    # nProcPerNode only in spec.nprocPerNode: the v1.8+ webhook refuses it in both places.
    assert job["spec"]["elasticPolicy"] == {"maxReplicas": 4, "maxRestarts": 5, "minReplicas": 2, "rdzvBackend": "c10d"}
    assert job["spec"]["nprocPerNode"] == "1"
    assert {k: v["replicas"] for k, v in job["spec"]["pytorchReplicaSpecs"].items()} == {"Worker": 3}


@pytest.mark.parametrize("path, target", PAIRS)
def test_no_secret_value_in_any_rendered_output(path, target, monkeypatch):
    secrets = {
        "HF_TOKEN": "hf_SECRETtoken123456",
        "AWS_ACCESS_KEY_ID": "AKIASECRETKEYID0001",
        "AWS_SECRET_ACCESS_KEY": "s3cr3t/Key+Value/0123456789",
    }
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
    assert trainer["command"][-1].endswith(
        "kubetune fetch /etc/kubetune/job.yaml --dest /workspace/stage/j && exec kubetune launch /workspace/stage/j/job.yaml"
    )
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"


def test_mlflow_on_kubernetes_needs_a_server_the_pods_reach_and_credentials_by_reference():
    with pytest.raises(SpecError) as e:
        manifests.render(_spec(tracking__mlflow={"experiment": "x"}), "ns")
    assert e.value.lines()[0].startswith("tracking.mlflow.uri: required on Kubernetes")
    with pytest.raises(SpecError) as e:
        manifests.render(_spec(tracking__mlflow={"uri": "http://localhost:5000"}), "ns")
    assert "'http://localhost:5000' is this machine, not reachable from the pods" in e.value.lines()[0]
    spec = _spec(
        tracking__mlflow={"uri": "http://mlflow.kubetune.svc.cluster.local:5000"},
        kubernetes__secrets={"mlflow": "mlflow-credentials"},
    )
    main = manifests.render(spec, "ns").job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][
        0
    ]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in main["env"] if e["name"].startswith("MLFLOW_")}
    assert refs == {
        key: {"name": "mlflow-credentials", "key": key, "optional": True}
        for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
    }


@pytest.mark.parametrize("stem, target", sorted(REFUSED))
def test_example_refused_for_a_target_says_why(stem, target):
    with pytest.raises(SpecError) as e:
        manifests.render(load_spec(ROOT / "examples" / f"{stem}.yaml"), "ns", target)
    assert e.value.lines() == [REFUSED[(stem, target)]]


@pytest.mark.parametrize(
    "kw, expected",
    [
        (
            {"data__train": "examples/data/x.jsonl"},
            "data.train: 'examples/data/x.jsonl' is a path on this machine, which the pods cannot read",
        ),
        ({"model__uri": "/home/me/models/bert"}, "model.uri: '/home/me/models/bert' is a path on this machine"),
        ({"data__eval": "file:///data/eval.csv"}, "data.eval: 'file:///data/eval.csv' is a path on this machine"),
        (
            {"s3__endpoint_url": "http://localhost:9000"},
            "s3.endpoint_url: 'http://localhost:9000' is this machine, not reachable from the pods",
        ),
        ({"s3__endpoint_url": "http://127.0.0.1:9000"}, "s3.endpoint_url: 'http://127.0.0.1:9000' is this machine"),
        (
            {"kubernetes__affinity": {"nodeAffinity": {"requiredDuringScheduling": {}}}},
            "kubernetes.affinity.nodeAffinity.requiredDuringScheduling: unknown field for V1NodeAffinity",
        ),
    ],
)
def test_specs_that_cannot_work_in_a_pod_are_refused_at_render(kw, expected):
    for target in ("pytorchjob", "trainjob"):
        with pytest.raises(SpecError) as e:
            manifests.render(_spec(**kw), "ns", target)
        assert any(line.startswith(expected) for line in e.value.lines()), e.value.lines()


def test_local_paths_on_a_named_claim_and_pkg_uris_render():
    on_claim = _spec(
        data__train="data/train.csv",
        model__uri="/workspace/models/bert",
        kubernetes__storage={"mode": "pvc", "existing_claim": "datasets"},
    )
    manifests.render(on_claim, "ns")
    manifests.render(_spec(data__train="pkg://kubetune/assets/sentiment/sentiment-chat.jsonl"), "ns")


@pytest.mark.parametrize(
    "field, value",
    [
        ("restart_policy", "ExitCode"),
        ("backoff_limit", 5),
        ("ttl_seconds_after_finished", 60),
        ("image_pull_policy", "Always"),
        ("clean_pod_policy", "All"),
        ("priority_class", "high"),
        ("master_port", 29500),
    ],
)
def test_trainjob_refuses_what_it_cannot_carry_by_name(field, value):
    spec = _spec(**{f"kubernetes__{field}": value})
    with pytest.raises(SpecError) as e:
        manifests.render(spec, "ns", "trainjob")
    assert e.value.lines()[0].startswith(f"kubernetes.{field}: ") and "--target pytorchjob" in e.value.lines()[0]
    manifests.render(spec, "ns", "pytorchjob")  # the PyTorchJob carries it


def test_trainjob_carries_what_v2_3_can():
    spec = _spec(
        kubernetes__image_pull_secrets=["regcred"],
        kubernetes__annotations={"team": "nlp"},
        kubernetes__node_selector={"gpu": "h100"},
        kubernetes__affinity={
            "nodeAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 1,
                        "preference": {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                    }
                ]
            }
        },
        kubernetes__queue="team-queue",
        kubernetes__runtime="torch-distributed-gpu",
    )
    job = manifests.render(spec, "ns", "trainjob").job
    pod = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"][
        "spec"
    ]["template"]
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["metadata"]["annotations"]["team"] == "nlp" and job["metadata"]["annotations"] == {"team": "nlp"}
    assert pod["spec"]["nodeSelector"] == {"gpu": "h100"} and pod["spec"]["affinity"] == spec.kubernetes.affinity
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-queue" and job["spec"]["suspend"] is True
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed-gpu"


def test_queue_and_priority_on_a_pytorchjob():
    job = manifests.render(_spec(kubernetes__queue="team-queue", kubernetes__priority_class="high-priority"), "ns").job
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-queue"
    assert job["spec"]["runPolicy"]["suspend"] is True  # Kueue admits it by unsuspending
    assert job["spec"]["runPolicy"]["schedulingPolicy"] == {"priorityClass": "high-priority"}
    assert job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["priorityClassName"] == "high-priority"
    plain = manifests.render(_spec(), "ns").job
    assert (
        "suspend" not in plain["spec"]["runPolicy"] and "kueue.x-k8s.io/queue-name" not in plain["metadata"]["labels"]
    )


@pytest.mark.parametrize("name", ["1job", "9-lives"])
def test_job_name_must_start_with_a_letter(name):
    """DNS-1035, as the PyTorchJob webhook and the TrainJob CRD require."""
    with pytest.raises(SpecError, match="starting with a letter"):
        parse_spec({**BASE, "name": name})


@pytest.mark.parametrize("task", sorted(entries()))
@pytest.mark.parametrize("target", ["pytorchjob", "trainjob"])
def test_every_tasks_starter_renders_objects_the_upstream_crds_and_webhooks_admit(task, target, tmp_path):
    """Each task's `kubetune init` starter (a new task's too: the registry is read, not a list) as a PyTorchJob and
    a TrainJob: the typed model (strict), then what the operator's API server does with the job: the upstream CRD
    (../shared/kubeflow-crds: schema, unknown fields pruned, CEL) and the operator's webhook rules; and, for a task
    KServe's runtime serves, its InferenceService through the KServe v0.20 CRD and webhook."""
    raw = yaml.safe_load(starter_text(task))
    for key in ("train", "eval"):  # a starter's data on this machine (which a pod cannot read) as an object store's
        value = raw["data"].get(key)
        if isinstance(value, str) and "://" not in value:
            raw["data"][key] = f"s3://datasets/{Path(value).name}"
    raw["output"] = {"uri": f"s3://runs/{raw['name']}"}  # where a cluster's export goes (and KServe reads it)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    spec = load_spec(path)
    objects = list(yaml.safe_load_all(manifests.render(spec, "default", target).to_yaml()))
    for obj in objects:
        assert strict.validate(obj) == [], (task, obj["kind"])
    job = next(o for o in objects if o["kind"] in ("PyTorchJob", "TrainJob"))
    if target == "pytorchjob":
        for release in ("v1.8.1", "v1.9.0"):
            outcome = crds.crd("pytorchjobs", release).admit(job)
            assert outcome.errors == [] and outcome.pruned == [], (release, outcome)
            assert webhooks.pytorchjob_errors(outcome.stored, release) == []
    else:
        outcome = crds.crd("trainjobs", "v2.3.0").admit(job)
        assert outcome.errors == [] and outcome.pruned == [], outcome
        runtimes = {r["metadata"]["name"]: r for r in crds.shipped_runtimes()}
        assert webhooks.trainjob_errors(outcome.stored, runtimes) == []
    if entries()[task].kserve is not None and target == "pytorchjob":
        isvc = serving.render_serve(spec, "default").inference_service
        outcome = crds.crd("inferenceservices", "v0.20.0").admit(isvc)
        assert outcome.errors == [] and outcome.pruned == [], outcome
        assert webhooks.inferenceservice_errors(outcome.stored) == []
