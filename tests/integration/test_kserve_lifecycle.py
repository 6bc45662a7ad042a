"""`kubetune submit|status|delete --serve` against a FAKE Kubernetes API server (tests/fakes/kube_api.py)
over real HTTP with the real `kubernetes` client: no real apiserver (nor KServe) can run on this machine.
The fake admits InferenceServices through KServe v0.20.0's upstream CRD and webhook rules, as
tests/unit/test_serving_manifests.py does; tests play KServe's controller by writing the status."""

from __future__ import annotations

import base64
import json

import pytest
from fakes import crds, webhooks
from fakes.kube_api import FakeKubeAPI
from typer.testing import CliRunner

from kubetune.backends.kserve import manifests as serving
from kubetune.cli import app

pytestmark = pytest.mark.integration
NS = "team-a"
ISVC = ("serving.kserve.io/v1beta1", "inferenceservices")
SECRET_VALUE = "wJalrXUtnFEMI-not-a-real-key"
SPEC = """
name: demo
task: causal-lm
model: {uri: "hf://org/base"}
data: {train: "hf://org/d"}
s3: {endpoint_url: "http://minio.minio.svc:9000"}
output: {uri: "s3://bucket/runs/demo"}
kubernetes:
  secrets: {s3: s3-keys}
serving: {cpu: "1", memory: 4Gi}
"""
NOT_OURS = (
    "error: InferenceService 'demo' in namespace 'team-a' was not made by kubetune (it lacks the labels "
    "app.kubernetes.io/name=kubetune, app.kubernetes.io/component=serving), so kubetune leaves it alone — serve "
    "under another name (serving.name), or delete it with kubectl"
)


@pytest.fixture
def cluster(tmp_path):
    with FakeKubeAPI(kserve="v0.20.0") as server:
        server.kubeconfig = str(server.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS))
        # the job's S3 keys, as the user created them for the job: kubetune only names this Secret
        server.put(
            "v1",
            "secrets",
            NS,
            {
                "metadata": {"name": "s3-keys"},
                "data": {"AWS_SECRET_ACCESS_KEY": base64.b64encode(SECRET_VALUE.encode()).decode()},
            },
        )
        yield server


@pytest.fixture
def spec_file(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(SPEC)
    return path


def cli(cluster, *args):
    result = CliRunner().invoke(app, [*args, "--kubeconfig", cluster.kubeconfig])
    return result.exit_code, result.stdout, result.stderr


def _ready(url="http://demo.team-a.example.com"):
    """The status KServe's controller writes once the predictor serves."""
    true = {"status": "True", "lastTransitionTime": "2025-01-01T00:00:00Z"}
    return {
        "conditions": [{"type": t, **true} for t in ("IngressReady", "PredictorReady", "Ready")],
        "url": url,
        "address": {"url": "http://demo-predictor.team-a.svc.cluster.local"},
        "modelStatus": {"states": {"activeModelState": "Loaded", "targetModelState": "Loaded"}},
    }


def _predictor_deployment(ready: int) -> dict:
    return {
        "metadata": {"name": "demo-predictor", "labels": {"serving.kserve.io/inferenceservice": "demo"}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "isvc.demo-predictor"}},
            "template": {"spec": {"containers": [{"name": "kserve-container", "image": "x"}]}},
        },
        "status": {"replicas": 1, "readyReplicas": ready},
    }


def serving_spec(path):
    """The job spec in ``path``, as the CLI loads it."""
    from kubetune.config import load_spec

    return load_spec(path)


def test_submit_status_delete(cluster, spec_file):
    code, out, err = cli(cluster, "submit", "--serve", str(spec_file))
    assert code == 0, err
    assert out.strip() == "demo"
    assert "serving.kserve.io/s3-endpoint=minio.minio.svc:9000" in err  # the render's warning, as render prints it
    rendered = serving.render_serve(serving_spec(spec_file), NS)
    stored = cluster.get_obj(*ISVC, NS, "demo")
    # stored as KServe's CRD and webhook admit it: nothing pruned, nothing refused
    outcome = crds.crd("inferenceservices", "v0.20.0").admit(rendered.inference_service)
    assert (outcome.errors, outcome.pruned, webhooks.inferenceservice_errors(outcome.stored)) == ([], [], [])
    assert stored["spec"] == rendered.inference_service["spec"] == outcome.stored["spec"]
    account = cluster.get_obj("v1", "serviceaccounts", NS, "demo-storage")
    assert account["secrets"] == [{"name": "s3-keys"}] and stored["spec"]["predictor"]["serviceAccountName"] == (
        "demo-storage"
    )

    code, out, _ = cli(cluster, "status", "--serve", "demo")
    assert code == 0 and out.splitlines() == [
        "InferenceService demo in team-a: Pending",
        "  serves: the export of job demo",
    ]

    cluster.set_status(*ISVC, NS, "demo", _ready())  # KServe's controller, once the predictor is up
    cluster.put("apps/v1", "deployments", NS, _predictor_deployment(ready=1))
    code, out, _ = cli(cluster, "status", "--serve", "demo")
    assert code == 0 and out.splitlines() == [
        "InferenceService demo in team-a: Ready",
        "  url: http://demo.team-a.example.com",
        "  address: http://demo-predictor.team-a.svc.cluster.local",
        "  predictor: ready 1, desired 1",
        "  model: Loaded",
        "  serves: the export of job demo",
    ]
    code, out, _ = cli(cluster, "status", "--serve", "demo", "--json")
    st = json.loads(out)
    assert code == 0 and (st["phase"], st["url"], st["replicas"]) == (
        "Ready",
        "http://demo.team-a.example.com",
        {"ready": 1, "desired": 1},
    )

    code, out, err = cli(cluster, "delete", "--serve", "demo")
    assert code == 0, err
    assert out.splitlines() == [
        "deleted demo",
        "deleted serviceaccount 'demo-storage'",
        "kept secret(s) 's3-keys' (the job's; kubetune never deletes a Secret)",
    ]
    assert cluster.objects(*ISVC, NS) == [] and cluster.objects("v1", "serviceaccounts", NS) == []
    assert [s["metadata"]["name"] for s in cluster.objects("v1", "secrets", NS)] == ["s3-keys"]
    _assert_no_secret_was_touched(cluster)


def _assert_no_secret_was_touched(cluster):
    """No request read, created, changed or deleted a Secret, and no body carried the secret value."""
    assert not [r for r in cluster.requests if "/secrets" in r[1]]
    encoded = base64.b64encode(SECRET_VALUE.encode())
    for _, path, body in cluster.bodies:
        assert SECRET_VALUE.encode() not in body and encoded not in body, path
        assert b'"kind": "Secret"' not in body and b'"kind":"Secret"' not in body, path


def test_an_existing_inference_service_is_refused_unless_replace(cluster, spec_file):
    assert cli(cluster, "submit", "--serve", str(spec_file))[0] == 0
    uid = cluster.get_obj(*ISVC, NS, "demo")["metadata"]["uid"]
    code, _, err = cli(cluster, "submit", "--serve", str(spec_file))
    assert code == 2 and err.splitlines()[-1] == (
        "error: inferenceservices.serving.kserve.io 'demo' already exists in namespace 'team-a' — pass --replace, or "
        "`kubetune delete --serve demo` first"
    )
    code, out, err = cli(cluster, "submit", "--serve", str(spec_file), "--replace")
    assert code == 0 and out.strip() == "demo", err
    assert cluster.get_obj(*ISVC, NS, "demo")["metadata"]["uid"] != uid
    assert len(cluster.objects("v1", "serviceaccounts", NS)) == 1
    _assert_no_secret_was_touched(cluster)


def test_what_kubetune_did_not_make_is_never_replaced_nor_deleted(cluster, spec_file):
    theirs = {
        "metadata": {"name": "demo", "labels": {"team": "b"}},
        "spec": {"predictor": {"model": {"modelFormat": {"name": "sklearn"}, "storageUri": "gs://b/m"}}},
    }
    cluster.put(*ISVC, NS, theirs)
    code, _, err = cli(cluster, "submit", "--serve", str(spec_file), "--replace")
    assert code == 2 and err.splitlines()[-1] == NOT_OURS
    code, _, err = cli(cluster, "delete", "--serve", "demo")
    assert code == 2 and err.strip() == NOT_OURS
    assert cluster.get_obj(*ISVC, NS, "demo")["spec"] == theirs["spec"]
    assert cluster.objects("v1", "serviceaccounts", NS) == []


def test_a_service_account_of_that_name_that_is_not_kubetunes_is_never_touched(cluster, spec_file):
    cluster.put("v1", "serviceaccounts", NS, {"metadata": {"name": "demo-storage"}, "secrets": [{"name": "other"}]})
    code, _, err = cli(cluster, "submit", "--serve", str(spec_file))
    assert code == 2 and err.splitlines()[-1] == (
        "error: serving.name: serviceaccount 'demo-storage' already exists in namespace 'team-a' and is not the one "
        "kubetune made for InferenceService 'demo' — serve under another name, or remove that ServiceAccount"
    )
    assert cluster.objects(*ISVC, NS) == []
    assert cluster.get_obj("v1", "serviceaccounts", NS, "demo-storage")["secrets"] == [{"name": "other"}]


def test_a_service_account_left_by_an_earlier_submit_is_brought_up_to_date(cluster, spec_file):
    left = serving.render_serve(serving_spec(spec_file), NS).service_account
    cluster.put("v1", "serviceaccounts", NS, {**left, "secrets": [{"name": "old-keys"}]})
    code, _, err = cli(cluster, "submit", "--serve", str(spec_file))
    assert code == 0, err
    assert cluster.get_obj("v1", "serviceaccounts", NS, "demo-storage")["secrets"] == [{"name": "s3-keys"}]


def test_not_ready_says_why(cluster, spec_file):
    assert cli(cluster, "submit", "--serve", str(spec_file))[0] == 0
    failed = {"reason": "ModelLoadFailed", "message": "storage initializer: s3://bucket/runs/demo/model not found"}
    cluster.set_status(
        *ISVC,
        NS,
        "demo",
        {
            "conditions": [
                {"type": "PredictorReady", "status": "False", **failed},
                {"type": "Ready", "status": "False", **failed},
            ],
            "modelStatus": {"states": {"activeModelState": "FailedToLoad"}},
        },
    )
    cluster.put("apps/v1", "deployments", NS, _predictor_deployment(ready=0))
    code, out, _ = cli(cluster, "status", "--serve", "demo")
    assert code == 0 and out.splitlines() == [
        "InferenceService demo in team-a: NotReady",
        "  predictor: ready 0, desired 1",
        "  model: FailedToLoad",
        "  reason: ModelLoadFailed: storage initializer: s3://bucket/runs/demo/model not found",
        "  serves: the export of job demo",
    ]


def test_missing_inference_service_is_one_line(cluster):
    for cmd in (["status", "--serve", "nope"], ["delete", "--serve", "nope"]):
        code, _, err = cli(cluster, *cmd)
        assert code == 2 and err.strip() == (
            "error: inferenceservices.serving.kserve.io 'nope' not found in namespace 'team-a' — check the name with "
            "`kubectl get inferenceservices` and --namespace"
        ), cmd


def test_a_cluster_without_kserve_says_how_to_install_it(tmp_path, spec_file):
    with FakeKubeAPI() as server:  # KServe is opt-in: not installed
        server.kubeconfig = str(server.write_kubeconfig(tmp_path / "kc", namespace=NS))
        for cmd in (["submit", "--serve", str(spec_file)], ["status", "--serve", "demo"]):
            code, _, err = cli(server, *cmd)
            assert code == 2 and err.splitlines()[-1] == (
                "error: inferenceservices.serving.kserve.io are not served by this cluster (the server could not find "
                "the requested resource) — KServe is not installed: deploy/install.sh --with kserve"
            ), cmd
        assert server.objects("v1", "serviceaccounts", NS) == []


def test_forbidden_is_one_line_and_nothing_is_created(cluster, spec_file):
    cluster.deny("create", "inferenceservices", NS)
    code, _, err = cli(cluster, "submit", "--serve", str(spec_file))
    assert code == 2
    line = err.splitlines()[-1]
    assert line.startswith(
        "error: forbidden: cannot create inferenceservices.serving.kserve.io in namespace 'team-a' ("
    ) and line.endswith(
        "— ask for create, get, update and delete on inferenceservices.serving.kserve.io and serviceaccounts in this "
        "namespace (deploy/rbac grants neither), or set kubernetes.namespace / --namespace"
    )
    assert cluster.objects("v1", "serviceaccounts", NS) == []


def _break(path, value):
    """render_serve, with one field of the InferenceService set to ``value``."""
    render = serving.render_serve

    def broken(spec, namespace):
        rendered = render(spec, namespace)
        node = rendered.inference_service
        *keys, last = path.split(".")
        for key in keys:
            node = node[key]
        node[last] = value
        return rendered

    return broken


@pytest.mark.parametrize(
    "path, value, expected",
    [
        (
            "spec.predictor.minReplicas",
            "1",
            "error: the API server rejected inferenceservices.serving.kserve.io 'demo': "
            'InferenceService.serving.kserve.io "demo" is invalid: spec.predictor.minReplicas: Invalid value: '
            '"string": spec.predictor.minReplicas in body must be of type integer: "1" — check the spec\'s serving '
            "section",
        ),
        (
            "spec.predictor.model.name",
            "m",
            "error: the cluster refused inferenceservices.serving.kserve.io 'demo': admission webhook "
            "\"inferenceservice.kserve-webhook-server.validator\" denied the request: the 'name' field is not allowed "
            "in standard predictor — change the spec's serving section the message names",
        ),
    ],
)
def test_what_kserve_refuses_is_one_line_with_the_servers_message(
    cluster, spec_file, monkeypatch, path, value, expected
):
    monkeypatch.setattr(serving, "render_serve", _break(path, value))
    code, _, err = cli(cluster, "submit", "--serve", str(spec_file))
    assert code == 2 and err.splitlines()[-1] == expected
    assert cluster.objects(*ISVC, NS) == [] and cluster.objects("v1", "serviceaccounts", NS) == []


def test_options_that_mean_nothing_with_serve_are_refused(cluster):
    code, _, err = cli(cluster, "status", "--serve", "demo", "--target", "trainjob")
    assert code == 2 and err.strip() == (
        "error: --target: --target picks a job's kind and means nothing with --serve — drop it"
    )
    code, _, err = cli(cluster, "delete", "--serve", "demo", "--delete-storage")
    assert code == 2 and "an InferenceService has none" in err


class _RefusesTheSecondCreate(FakeKubeAPI):
    """Admits the dry run of an InferenceService, then answers the real create with 403."""

    creates = 0

    def _authorize(self, verb, res, sub, namespace, name):
        if verb == "create" and res.plural == "inferenceservices":
            self.creates += 1
            if self.creates == 2:
                self.deny("create", "inferenceservices", namespace)
        super()._authorize(verb, res, sub, namespace, name)


def test_a_failed_create_takes_back_the_service_account_it_made(tmp_path, spec_file):
    with _RefusesTheSecondCreate(kserve="v0.20.0") as server:
        server.kubeconfig = str(server.write_kubeconfig(tmp_path / "kc", namespace=NS))
        code, _, err = cli(server, "submit", "--serve", str(spec_file))
        assert code == 2 and "forbidden: cannot create inferenceservices.serving.kserve.io" in err
        assert server.creates == 2
        assert [(m, p.rsplit("/", 2)[-2:]) for m, p, _ in server.requests if "serviceaccounts" in p] == [
            ("POST", ["team-a", "serviceaccounts"]),
            ("DELETE", ["serviceaccounts", "demo-storage"]),
        ]
        assert server.objects("v1", "serviceaccounts", NS) == [] and server.objects(*ISVC, NS) == []
