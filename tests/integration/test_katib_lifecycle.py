"""`kubetune submit|status|delete --tune` against a FAKE Kubernetes API server (tests/fakes/kube_api.py) over real
HTTP with the real `kubernetes` client: no real apiserver (nor Katib) can run on this machine. The fake admits
Experiments through Katib v0.19.0's webhook rules (tests/fakes/katib.py, restated from its source: Katib's CRD has
no schema) and plays Katib's trial controller: it creates a trial's job from the Experiment's template with the
trial's values, through the upstream PyTorchJob or TrainJob CRD and the operator's webhook rules, as a real
apiserver would admit it. Tests play Katib's controller by writing the Experiment's status."""

from __future__ import annotations

import json
import shlex

import pytest
from fakes import katib as fake_katib
from fakes.kube_api import FakeKubeAPI
from typer.testing import CliRunner

from kubetune.backends.kubeflow.manifests import render_tune
from kubetune.cli import app
from kubetune.config import load_spec

pytestmark = pytest.mark.integration
NS = "team-a"
EXP = ("kubeflow.org/v1beta1", "experiments")
SPEC = """
name: demo
task: sequence-classification
model: {uri: "hf://org/base"}
data: {train: "hf://org/d"}
lora: {r: 8}
training: {eval_every: 20}
s3: {endpoint_url: "http://minio.minio.svc:9000"}
output: {uri: "s3://bucket/runs/demo"}
kubernetes:
  secrets: {s3: s3-keys}
  storage: {mode: pvc, size: 20Gi}
tune:
  space:
    training.learning_rate: {type: float, low: 1.0e-5, high: 1.0e-3, log: true}
    lora.r: {type: choice, values: [4, 8, 16]}
  objective: eval_accuracy
  trials: 6
  parallel: 2
  early_stopping: {min_trials: 2}
"""
VALUES = {"training-learning_rate": "0.00031", "lora-r": "16"}


@pytest.fixture
def cluster(tmp_path):
    with FakeKubeAPI(katib="v0.19.0") as server:
        server.kubeconfig = str(server.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS))
        yield server


@pytest.fixture
def spec_file(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(SPEC)
    return path


def cli(cluster, *args):
    result = CliRunner().invoke(app, [*args, "--kubeconfig", cluster.kubeconfig])
    return result.exit_code, result.stdout, result.stderr


def _stage_command(job: dict) -> list[str]:
    if job["kind"] == "TrainJob":
        return shlex.split(job["spec"]["trainer"]["command"][-1])
    return job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["initContainers"][0]["command"]


@pytest.mark.parametrize("target", ["pytorchjob", "trainjob"])
def test_submit_then_a_trial_job_katib_makes_is_admitted_then_status_and_delete(cluster, spec_file, target):
    code, out, err = cli(cluster, "submit", "--tune", str(spec_file), "--target", target)
    assert code == 0, err
    assert out.strip() == "demo"
    assert "katib.kubeflow.org/metrics-collector-injection=enabled" in err  # the render's warning
    stored = cluster.get_obj(*EXP, NS, "demo")
    rendered = render_tune(load_spec(spec_file), NS, target).experiment
    assert stored["spec"] == fake_katib.defaults(json.loads(json.dumps(rendered)))["spec"]
    assert stored["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kubetune"
    cm = cluster.get_obj("v1", "configmaps", NS, "demo-spec")
    assert cm["metadata"]["ownerReferences"][0]["kind"] == "Experiment"
    assert cm["metadata"]["ownerReferences"][0]["uid"] == stored["metadata"]["uid"]
    assert cluster.get_obj("v1", "persistentvolumeclaims", NS, "demo-workspace") is not None

    # Katib's trial controller makes the trial's job from the template: the operator's CRD and webhook admit it
    job = cluster.run_trial(NS, "demo", "demo-x7k2p9", VALUES)
    command = _stage_command(job)
    assert command[:2] == ["kubetune", "fetch"]
    sets = [command[i + 1] for i, word in enumerate(command) if word == "--set"]
    assert sets == [
        "training.learning_rate=0.00031",
        "lora.r=16",
        "output.uri=s3://bucket/runs/demo/trials/demo-x7k2p9",
    ]
    assert command[command.index("--dest") + 1].endswith("/demo/demo-x7k2p9")  # the trial's own staging directory

    code, out, _ = cli(cluster, "status", "--tune", "demo")
    assert (code, out.splitlines()) == (0, ["Experiment demo in team-a: Pending, 0 of 6 trials done"])

    cluster.set_status(
        *EXP,
        NS,
        "demo",
        {
            "conditions": [
                {"type": "Created", "status": "True", "reason": "ExperimentCreated"},
                {"type": "Running", "status": "True", "reason": "ExperimentRunning"},
            ],
            "trials": 4,
            "trialsSucceeded": 2,
            "trialsEarlyStopped": 1,
            "trialsRunning": 1,
            "runningTrialList": ["demo-x7k2p9"],
            "currentOptimalTrial": {
                "bestTrialName": "demo-4bq8fz",
                "parameterAssignments": [
                    {"name": "training-learning_rate", "value": "0.00012"},
                    {"name": "lora-r", "value": "8"},
                ],
                "observation": {"metrics": [{"name": "eval_accuracy", "latest": "0.81", "min": "0.5", "max": "0.81"}]},
            },
        },
    )
    code, out, _ = cli(cluster, "status", "--tune", "demo")
    assert code == 0 and out.splitlines() == [
        "Experiment demo in team-a: Running, 3 of 6 trials done",
        "  trials: running 1, succeeded 2, early stopped 1",
        "  running: demo-x7k2p9",
        "  best: demo-4bq8fz, eval_accuracy 0.81",
        "    training.learning_rate = 0.00012",
        "    lora.r = 8",
        "  its output: s3://bucket/runs/demo/trials/demo-4bq8fz",
    ]
    code, out, _ = cli(cluster, "status", "--tune", "demo", "--json")
    data = json.loads(out)
    assert (data["phase"], data["best_values"], data["trials"]["succeeded"]) == (
        "Running",
        {"training.learning_rate": "0.00012", "lora.r": "8"},
        2,
    )

    # a second submit is refused in one line, and changes nothing
    code, _, err = cli(cluster, "submit", "--tune", str(spec_file), "--target", target)
    assert code != 0 and len([line for line in err.splitlines() if not line.startswith("warning: ")]) == 1
    assert "experiments.kubeflow.org 'demo' already exists in namespace 'team-a'" in err and "--replace" in err

    code, out, err = cli(cluster, "delete", "--tune", "demo")
    assert code == 0, err
    assert out.splitlines() == [
        "deleted demo",
        "kept persistentvolumeclaim 'demo-workspace' (every trial's output); `kubetune delete --tune demo "
        "--delete-storage` removes it",
    ]
    assert cluster.get_obj(*EXP, NS, "demo") is None
    assert cluster.get_obj("v1", "configmaps", NS, "demo-spec") is None  # owned by the Experiment
    kind = "pytorchjobs" if target == "pytorchjob" else "trainjobs"
    group = "kubeflow.org/v1" if target == "pytorchjob" else "trainer.kubeflow.org/v1alpha1"
    assert cluster.get_obj(group, kind, NS, "demo-x7k2p9") is None  # Katib's trial job goes with it
    assert cluster.get_obj("v1", "persistentvolumeclaims", NS, "demo-workspace") is not None


def test_replace_deletes_the_old_experiment_first_and_keeps_the_claim(cluster, spec_file):
    assert cli(cluster, "submit", "--tune", str(spec_file))[0] == 0
    old = cluster.get_obj(*EXP, NS, "demo")["metadata"]["uid"]
    code, out, err = cli(cluster, "submit", "--tune", str(spec_file), "--replace")
    assert code == 0, err
    new = cluster.get_obj(*EXP, NS, "demo")
    assert new["metadata"]["uid"] != old
    assert (
        cluster.get_obj("v1", "configmaps", NS, "demo-spec")["metadata"]["ownerReferences"][0]["uid"]
        == (new["metadata"]["uid"])
    )
    code, out, _ = cli(cluster, "delete", "--tune", "demo", "--delete-storage")
    assert code == 0 and "deleted persistentvolumeclaim 'demo-workspace'" in out
    assert cluster.get_obj("v1", "persistentvolumeclaims", NS, "demo-workspace") is None


def test_katibs_webhook_refusal_is_one_line_and_nothing_is_created(cluster, spec_file):
    cluster.namespace_labels[NS] = {}  # a namespace Katib's webhook does not serve
    code, out, err = cli(cluster, "submit", "--tune", str(spec_file))
    assert code != 0 and out == ""
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: the cluster refused experiments.kubeflow.org 'demo': admission webhook")
    assert "metrics-collector-injection" in line and "change the spec's tune section" in line
    for kind in ((*EXP,), ("v1", "configmaps"), ("v1", "persistentvolumeclaims")):
        assert cluster.objects(*kind, NS) == []


def test_an_experiment_kubetune_did_not_make_is_left_alone(cluster, spec_file):
    foreign = render_tune(load_spec(spec_file), NS).experiment
    foreign["metadata"]["labels"] = {"team": "a"}
    cluster.put(*EXP, NS, foreign)
    for args in (("delete", "--tune", "demo"), ("submit", "--tune", str(spec_file), "--replace")):
        code, _, err = cli(cluster, *args)
        assert code != 0 and "was not made by kubetune" in err, args
    assert cluster.get_obj(*EXP, NS, "demo")["metadata"]["labels"] == {"team": "a"}


def test_without_katib_the_fix_is_installing_it(tmp_path, spec_file):
    with FakeKubeAPI() as server:
        kubeconfig = str(server.write_kubeconfig(tmp_path / "kc", namespace=NS))
        result = CliRunner().invoke(app, ["submit", "--tune", str(spec_file), "--kubeconfig", kubeconfig])
    assert result.exit_code != 0
    assert "experiments.kubeflow.org are not served" in result.stderr
    assert "deploy/install.sh --with katib" in result.stderr


def test_options_that_mean_nothing_with_tune_are_refused(cluster, spec_file):
    for args, field in (
        (("status", "--tune", "demo", "--target", "pytorchjob"), "--target"),
        (("delete", "--tune", "demo", "--serve"), "--tune"),
        (("submit", "--tune", str(spec_file), "--target", "local"), "--target"),
    ):
        code, _, err = cli(cluster, *args)
        (line,) = err.strip().splitlines()  # kubetune's own one line, not typer's usage error
        assert code == 2 and line.startswith("error: ") and field in line, (args, err)


@pytest.mark.parametrize(
    "target, missing, says",
    [
        ("trainjob", {"trainer": None}, "deploy/install.sh --with trainer"),
        ("pytorchjob", {"operator": None}, "install the Kubeflow Training Operator"),
    ],
)
def test_a_cluster_that_cannot_run_the_trials_is_refused_before_the_experiment(
    tmp_path, spec_file, target, missing, says
):
    """Katib admits an Experiment whose trial kind the cluster does not serve (its validator dry-runs batch Jobs
    only); every trial would then fail at its creation. submit --tune checks the trial job as a job submit does."""
    with FakeKubeAPI(katib="v0.19.0", **missing) as server:
        kubeconfig = str(server.write_kubeconfig(tmp_path / "kc", namespace=NS))
        result = CliRunner().invoke(
            app, ["submit", "--tune", str(spec_file), "--target", target, "--kubeconfig", kubeconfig]
        )
        assert result.exit_code != 0 and "are not served" in result.stderr and says in result.stderr, result.stderr
        assert server.objects(*EXP, NS) == [] and server.objects("v1", "configmaps", NS) == []
