"""Every example, rendered for each target, is admitted by the upstream CRDs and webhook rules of
each operator release kubetune supports, as an API server would admit it; and each admission rule
refuses what it should (one negative test per rule).

The CRDs are the upstream files (tests/data/kubeflow-crds/, see its README); the API server's CRD
handling (pruning, schema, CEL) is tests/fakes/crds.py and the webhook rules tests/fakes/webhooks.py,
because neither a kube-apiserver nor the operators can run on this machine.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from fakes import crds, webhooks
from fakes.crds import TRAINER_RELEASES

from kubetune.backends.kubeflow import manifests
from kubetune.config import load_spec

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
REFUSED_TRAINJOB = {"sentiment-minilm-2x2-gpu"}  # elastic: test_manifests.py checks the one-line refusal
RUNTIMES = {r["metadata"]["name"]: r for r in crds.shipped_runtimes()}
CASES = [
    pytest.param(p, "pytorchjob", rel, id=f"{p.stem}-pytorchjob-{rel}")
    for p in EXAMPLES
    for rel in ("v1.8.1", "v1.9.0")
]
CASES += [
    pytest.param(p, "trainjob", "v2.3.0", id=f"{p.stem}-trainjob-v2.3.0")
    for p in EXAMPLES
    if p.stem not in REFUSED_TRAINJOB
]


def _job(path: Path, target: str) -> dict:
    spec = load_spec(path)
    return manifests.render(spec, spec.kubernetes.namespace or "default", target).job


def admit(job: dict, target: str, release: str) -> tuple[list[str], list[str]]:
    """(errors, pruned paths) of a create, schema first, then the webhook, as on a cluster."""
    plural = "pytorchjobs" if target == "pytorchjob" else "trainjobs"
    outcome = crds.crd(plural, release if target == "pytorchjob" else "v2.3.0").admit(job)
    if outcome.errors:
        return outcome.errors, outcome.pruned
    hook = (
        webhooks.pytorchjob_errors(outcome.stored, release)
        if target == "pytorchjob"
        else webhooks.trainjob_errors(outcome.stored, RUNTIMES)
    )
    return hook, outcome.pruned


@pytest.mark.parametrize("path, target, release", CASES)
def test_every_example_is_admitted_whole(path, target, release):
    errors, pruned = admit(_job(path, target), target, release)
    assert errors == []
    assert pruned == []  # a real server would drop these silently


# Every kubernetes.* field the examples leave unset, set, so that each one's rendering meets the
# upstream CRDs too (the examples alone would leave queue, priority, affinity, ... unchecked).
_AFFINITY = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100"]}]}]
        }
    }
}
_EVERY_FIELD = [
    "kubernetes.queue=team-a",
    f"kubernetes.affinity={_AFFINITY}".replace("'", '"'),
    'kubernetes.tolerations=[{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]',
    'kubernetes.node_selector={"pool": "gpu"}',
    'kubernetes.image_pull_secrets=["regcred"]',
    'kubernetes.annotations={"team": "a"}',
    'kubernetes.labels={"cost": "ml"}',
    "kubernetes.service_account=trainer",
    "kubernetes.active_deadline_seconds=3600",
    "kubernetes.tensorboard=true",
    "kubernetes.runtime=torch-distributed",
    "kubernetes.secrets.mlflow=mlflow-credentials",
    "tracking.mlflow.uri=http://mlflow.kubetune.svc.cluster.local:5000",
]
_PYTORCHJOB_ONLY = [
    "kubernetes.priority_class=high",
    "kubernetes.restart_policy=ExitCode",
    "kubernetes.backoff_limit=5",
    "kubernetes.ttl_seconds_after_finished=60",
    "kubernetes.clean_pod_policy=All",
    "kubernetes.image_pull_policy=Always",
]


@pytest.mark.parametrize("example", ["llama-lora", "sentiment-minilm-2x2-gpu"])
@pytest.mark.parametrize("release", ["v1.8.1", "v1.9.0"])
def test_every_kubernetes_field_set_is_admitted_whole_as_a_pytorchjob(example, release):
    spec = load_spec(ROOT / "examples" / f"{example}.yaml", _EVERY_FIELD + _PYTORCHJOB_ONLY)
    job = manifests.render(spec, "team-a").job
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"  # the fields did reach the job
    assert admit(job, "pytorchjob", release) == ([], [])


def test_every_kubernetes_field_a_trainjob_carries_is_admitted_whole():
    job = manifests.render(load_spec(ROOT / "examples" / "llama-lora.yaml", _EVERY_FIELD), "team-a", "trainjob").job
    assert job["spec"]["suspend"] is True
    # the MLflow credentials by reference only, each key optional (a user and password, or a token)
    env = job["spec"]["trainer"]["env"]
    assert {
        "name": "MLFLOW_TRACKING_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "mlflow-credentials", "key": "MLFLOW_TRACKING_TOKEN", "optional": True}},
    } in env
    assert admit(job, "trainjob", "v2.3.0") == ([], [])


def test_the_shipped_runtimes_are_valid_cluster_training_runtimes():
    definition = crds.crd("clustertrainingruntimes", "v2.3.0")
    assert "torch-distributed" in RUNTIMES
    for runtime in RUNTIMES.values():
        outcome = definition.admit(runtime)
        assert (outcome.errors, outcome.pruned) == ([], []), runtime["metadata"]["name"]


# -------------------------------------------------------------------- the API server's CRD handling


@pytest.fixture(scope="module")
def pytorchjob():
    return _job(ROOT / "examples" / "llama-lora.yaml", "pytorchjob")


@pytest.fixture(scope="module")
def trainjob():
    return _job(ROOT / "examples" / "llama-lora.yaml", "trainjob")


def _with(job: dict, path: str, value) -> dict:
    out = copy.deepcopy(job)
    node = out
    keys = path.split(".")
    for key in keys[:-1]:
        node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
    last = int(keys[-1]) if isinstance(node, list) else keys[-1]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return out


_DELETE = object()
_MASTER = "spec.pytorchReplicaSpecs.Master"
_MASTER_C = f"{_MASTER}.template.spec.containers.0"


@pytest.mark.parametrize(
    "path, value",
    [
        ("spec.unknownField", 1),
        (f"{_MASTER}.template.spec.containerz", []),
        (f"{_MASTER_C}.resources.limitz", {"cpu": "1"}),
    ],
)
def test_unknown_fields_are_pruned(pytorchjob, path, value):
    errors, pruned = admit(_with(pytorchjob, path, value), "pytorchjob", "v1.8.1")
    assert errors == [] and pruned == [path.replace(".0.", "[0].")]


@pytest.mark.parametrize(
    "path, value, expected",
    [
        (
            f"{_MASTER}.replicas",
            "1",
            f'{_MASTER}.replicas: Invalid value: "string": {_MASTER}.replicas in body must be of type integer: "1"',
        ),
        (
            "spec.runPolicy.suspend",
            "yes",
            'spec.runPolicy.suspend: Invalid value: "string": spec.runPolicy.suspend in body must be of type boolean: "yes"',
        ),
        (
            f"{_MASTER}.template.spec.containers",
            {"name": "pytorch"},
            f'{_MASTER}.template.spec.containers: Invalid value: "object"',
        ),
        (
            f"{_MASTER_C}.resources.limits.cpu",
            "4 cores",
            f'{_MASTER_C.replace(".0", "[0]")}.resources.limits.cpu: Invalid value: "4 cores"',
        ),
        (f"{_MASTER_C}.image", _DELETE, None),
        (f"{_MASTER_C}.name", _DELETE, f"{_MASTER_C.replace('.0', '[0]')}.name: Required value"),
        (
            "spec.runPolicy.backoffLimit",
            2**40,
            "spec.runPolicy.backoffLimit: Invalid value: 1099511627776: spec.runPolicy.backoffLimit in body must be of type int32",
        ),
        ("metadata.labels", {"bad key!": "x"}, 'metadata.labels: Invalid value: "bad key!"'),
        ("metadata.labels", {"ok": "-bad"}, 'metadata.labels: Invalid value: "-bad"'),
        ("metadata.namespace", "../../x Y", 'metadata.namespace: Invalid value: "../../x Y"'),
    ],
)
def test_the_schema_refuses(pytorchjob, path, value, expected):
    errors, _ = admit(_with(pytorchjob, path, value), "pytorchjob", "v1.9.0")
    if expected is None:  # the schema allows it; the webhook refuses (see below)
        assert errors and all("Required value" in e for e in errors)
    else:
        assert any(e.startswith(expected) for e in errors), errors


@pytest.mark.parametrize(
    "name, expected",
    [
        ("9-lives", "metadata.name must match RFC 1035 DNS label format"),
        ("a" * 64, "metadata.name must be no more than 63 characters"),
    ],
)
def test_the_trainjob_cel_rules_refuse_bad_names(trainjob, name, expected):
    errors, _ = admit(_with(trainjob, "metadata.name", name), "trainjob", "v2.3.0")
    assert errors == [f'<nil>: Invalid value: "object": {expected}']


def test_cel_transition_rules_run_on_update_only(pytorchjob):
    job = _with(pytorchjob, "spec.runPolicy.schedulingPolicy", {"queue": "a"})
    definition = crds.crd("pytorchjobs", "v1.9.0")
    assert definition.admit(job).errors == []
    moved = _with(job, "spec.runPolicy.schedulingPolicy.queue", "b")
    assert definition.admit(moved, old=job).errors == [
        'spec.runPolicy.schedulingPolicy.queue: Invalid value: "object": spec.runPolicy.schedulingPolicy.queue is immutable'
    ]


def test_older_trainer_releases_lack_the_fields_kubetune_needs(trainjob):
    full = crds.crd("trainjobs", "v2.3.0")
    assert full.without(*TRAINER_RELEASES["v2.1.0"]).admit(trainjob).pruned == ["spec.runtimePatches"]
    pruned = full.without(*TRAINER_RELEASES["v2.2.0"]).admit(trainjob).pruned
    assert pruned == [
        "spec.runtimePatches[0].trainingRuntimeSpec.template.spec.replicatedJobs[0].template.spec.template.spec.terminationGracePeriodSeconds"
    ]


# ----------------------------------------------------------------------------- the webhook rules

_ELASTIC = {"minReplicas": 1, "maxReplicas": 2, "rdzvBackend": "c10d"}


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"metadata.name": "9-lives"}, 'metadata.name: Invalid value: "9-lives": should match: a DNS-1035 label'),
        (
            {"spec.elasticPolicy": {**_ELASTIC, "nProcPerNode": 1}, "spec.nprocPerNode": "1"},
            "spec.elasticPolicy.nProcPerNode: Forbidden: must not be used with spec.nprocPerNode",
        ),
        (
            {"spec.elasticPolicy": _ELASTIC, "spec.pytorchReplicaSpecs.Worker": _DELETE},
            "spec.pytorchReplicaSpecs[Worker]: Required value: must be configured if elastic policy is used",
        ),
        ({f"{_MASTER}.replicas": 2}, "spec.pytorchReplicaSpecs[Master].replicas: Forbidden: must be 1"),
        (
            {"spec.pytorchReplicaSpecs.Worker.replicas": 0},
            "spec.pytorchReplicaSpecs[Worker].replicas: Forbidden: must be at least 1",
        ),
        (
            {f"{_MASTER_C}.name": "trainer"},
            "spec.pytorchReplicaSpecs[Master].template.spec.containers: Required value: must have at least one container with name pytorch",
        ),
        (
            {f"{_MASTER_C}.image": _DELETE},
            "spec.pytorchReplicaSpecs[Master].template.spec.containers[0].image: Required value: must be required",
        ),
        (
            {f"{_MASTER}.template.spec.containers": []},
            "spec.pytorchReplicaSpecs[Master].template.spec.containers: Required value: must be specified",
        ),
        (
            {
                "spec.pytorchReplicaSpecs.Chief": {
                    "replicas": 1,
                    "template": {"spec": {"containers": [{"name": "pytorch", "image": "x"}]}},
                }
            },
            'spec.pytorchReplicaSpecs[Chief]: Unsupported value: "Chief"',
        ),
        ({"spec.pytorchReplicaSpecs": _DELETE}, "spec.pytorchReplicaSpecs: Required value: must be required"),
    ],
)
@pytest.mark.parametrize("release", ["v1.8.1", "v1.9.0"])
def test_each_pytorchjob_webhook_rule(pytorchjob, change, expected, release):
    job = pytorchjob
    for path, value in change.items():
        job = _with(job, path, value)
    errors = webhooks.pytorchjob_errors(job, release)
    assert any(e.startswith(expected) for e in errors), errors


def test_managed_by_is_checked_from_v1_9(pytorchjob):
    job = _with(pytorchjob, "spec.runPolicy.managedBy", "someone/else")
    assert webhooks.pytorchjob_errors(job, "v1.8.1") == []
    assert webhooks.pytorchjob_errors(job, "v1.9.0")[0].startswith(
        'spec.runPolicy.managedBy: Unsupported value: "someone/else"'
    )


_PATCHED_JOB = "spec.runtimePatches.0.trainingRuntimeSpec.template.spec.replicatedJobs.0"
_PATCHED_POD = f"{_PATCHED_JOB}.template.spec.template.spec"


@pytest.mark.parametrize(
    "change, expected",
    [
        (
            {"spec.runtimeRef.name": "no-such-runtime"},
            'spec.runtimeRef: Invalid value: {"name":"no-such-runtime"}: clustertrainingruntimes.trainer.kubeflow.org "no-such-runtime" not found',
        ),
        ({"spec.runtimeRef.kind": "TrainingRuntimeX"}, "unsupported runtime: TrainingRuntimeX.trainer.kubeflow.org"),
        (
            {"spec.trainer.numProcPerNode": "many"},
            'spec.trainer.numProcPerNode: Invalid value: "many": must have an int value or [auto cpu gpu]',
        ),
        (
            {"spec.trainer.env": [{"name": "PET_NNODES", "value": "2"}]},
            "spec.trainer.env: Invalid value: ...: must not have reserved envs, invalid envs configured: [PET_NNODES]",
        ),
        (
            {f"{_PATCHED_JOB}.name": "launcher"},
            f'{_PATCHED_JOB.replace(".0", "[0]")}.name: Invalid value: "launcher": must not have a replicated job',
        ),
        (
            {f"{_PATCHED_POD}.containers.0.name": "sidecar"},
            f'{_PATCHED_JOB.replace(".0", "[0]")}: Invalid value: "sidecar": must not have container that does not exist in the runtime job node',
        ),
        (
            {f"{_PATCHED_POD}.containers.0.env": [{"name": "X", "value": "1"}]},
            f"{_PATCHED_JOB.replace('.0', '[0]')}: Invalid value: ...: must not have envs for the dataset-initializer, model-initializer, node containers",
        ),
    ],
)
def test_each_trainjob_webhook_rule(trainjob, change, expected):
    job = trainjob
    for path, value in change.items():
        job = _with(job, path, value)
    errors = webhooks.trainjob_errors(job, RUNTIMES)
    assert any(e.startswith(expected) for e in errors), errors


def test_the_shipped_runtime_files_are_what_the_fake_serves():
    names = {
        d["metadata"]["name"] for p in crds.RUNTIMES_DIR.glob("*.yaml") for d in yaml.safe_load_all(p.read_text()) if d
    }
    assert names == set(RUNTIMES)
