"""Submitting to clusters that run different operator releases, against the FAKE API server
(tests/fakes/kube_api.py: no kube-apiserver can run here). The fake admits Kubeflow objects with
the upstream CRDs and the operators' webhook rules, so a submit fails here where it would fail on
a real cluster of that release, and an older Trainer drops the fields it does not know."""

from __future__ import annotations

from pathlib import Path

import pytest
from fakes.kube_api import FakeKubeAPI
from typer.testing import CliRunner

from kubetune.backends.kubeflow import manifests
from kubetune.backends.kubeflow.backend import KubeflowBackend
from kubetune.cli import app
from kubetune.config import load_spec
from kubetune.errors import KubetuneError

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
NS = "team-a"


def _submit(server: FakeKubeAPI, tmp_path: Path, spec: Path, *args: str) -> tuple[int, str, str]:
    kubeconfig = str(server.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS))
    result = CliRunner().invoke(app, ["submit", str(spec), "--kubeconfig", kubeconfig, "--namespace", NS, *args])
    return result.exit_code, result.stdout, result.stderr


def _error(err: str) -> str:
    """The error line of the CLI's stderr (warnings about the spec may come before it)."""
    lines = [line for line in err.splitlines() if not line.startswith("warning: ")]
    assert len(lines) == 1, err
    return lines[0]


def _nothing_created(server: FakeKubeAPI) -> bool:
    kinds = [("v1", "configmaps"), ("v1", "persistentvolumeclaims"), ("kubeflow.org/v1", "pytorchjobs")]
    if server.trainer:
        kinds.append(("trainer.kubeflow.org/v1alpha1", "trainjobs"))
    return all(server.objects(gv, plural, NS) == [] for gv, plural in kinds)


@pytest.mark.parametrize("operator", ["v1.8.1", "v1.9.0"])
def test_every_example_submits_as_a_pytorchjob(tmp_path, operator):
    with FakeKubeAPI(operator=operator) as server:
        for example in EXAMPLES:
            code, out, err = _submit(server, tmp_path, example)
            assert code == 0, f"{example.name}: {err}"
            stored = server.get_obj("kubeflow.org/v1", "pytorchjobs", NS, load_spec(example).name)
            sent = manifests.render(load_spec(example), NS).job
            assert stored["spec"] == sent["spec"]  # nothing pruned on the way in


def test_every_example_but_the_elastic_one_submits_as_a_trainjob(tmp_path):
    with FakeKubeAPI(trainer="v2.3.0") as server:
        for example in EXAMPLES:
            code, out, err = _submit(server, tmp_path, example, "--target", "trainjob")
            if example.stem == "sentiment-minilm-2x2-gpu":
                assert code == 2 and "kubernetes.elastic: a TrainJob has no elastic policy" in err
                continue
            assert code == 0, f"{example.name}: {err}"


@pytest.mark.parametrize(
    "trainer, dropped, hint",
    [
        ("v2.1.0", "spec.runtimePatches", "Trainer older than v2.3 (v2.0/v2.1 have no runtimePatches)"),
        (
            "v2.2.0",
            "spec.runtimePatches[0].trainingRuntimeSpec.template.spec.replicatedJobs[0].template.spec.template.spec.terminationGracePeriodSeconds",
            "Trainer v2.2 (no terminationGracePeriodSeconds in runtime patches)",
        ),
    ],
)
def test_an_older_trainer_is_refused_in_one_line_before_anything_is_created(tmp_path, trainer, dropped, hint):
    with FakeKubeAPI(trainer=trainer) as server:
        code, _, err = _submit(server, tmp_path, ROOT / "examples" / "sentiment-minilm.yaml", "--target", "trainjob")
        assert code == 2
        assert _error(err) == (
            f"error: the cluster would drop {dropped} from the TrainJob: the cluster runs {hint} — "
            "install Trainer v2.3 or later (deploy/install.sh --with trainer), or use --target pytorchjob"
        )
        assert _nothing_created(server)
        dry_runs = [q for method, path, q in server.requests if method == "POST" and path.endswith("/trainjobs")]
        assert dry_runs == [{"dryRun": "All"}]


def test_a_cluster_without_trainer_says_how_to_install_it(tmp_path):
    with FakeKubeAPI(trainer=None) as server:
        code, _, err = _submit(server, tmp_path, ROOT / "examples" / "sentiment-minilm.yaml", "--target", "trainjob")
        assert code == 2 and _error(err).startswith(
            "error: clustertrainingruntimes.trainer.kubeflow.org are not served by this cluster"
        )
        assert "not served by this cluster" in err and "deploy/install.sh --with trainer" in err
        assert _nothing_created(server)


def test_a_runtime_the_cluster_lacks_lists_those_it_has(tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text((ROOT / "examples" / "sentiment-minilm.yaml").read_text() + "\n")
    with FakeKubeAPI() as server:
        code, _, err = _submit(
            server, tmp_path, spec, "--target", "trainjob", "--set", "kubernetes.runtime=torch-custom"
        )
        assert code == 2
        assert _error(err).startswith(
            "error: kubernetes.runtime: the cluster has no ClusterTrainingRuntime 'torch-custom' (it has: deepspeed-distributed, "
        )
        assert "torch-distributed" in err and _nothing_created(server)


def test_a_job_the_webhook_refuses_is_one_line_not_an_rbac_error(tmp_path):
    """What the previous render of the 2x2-GPU example met on a v1.8.1+ cluster: the admission
    webhook refuses elasticPolicy.nProcPerNode with spec.nprocPerNode (HTTP 403 from the webhook)."""
    with FakeKubeAPI(operator="v1.8.1") as server:
        kubeconfig = str(server.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS))
        backend = KubeflowBackend(kubeconfig=kubeconfig)
        job = manifests.render(load_spec(ROOT / "examples" / "sentiment-minilm-2x2-gpu.yaml"), NS).job
        job["spec"]["elasticPolicy"]["nProcPerNode"] = 2  # the old render
        with pytest.raises(KubetuneError) as e:
            backend._check_served(job)
        assert str(e.value) == (
            "the cluster refused pytorchjobs.kubeflow.org 'sentiment-minilm-gpu': admission webhook "
            '"validator.pytorchjob.training-operator.kubeflow.org" denied the request: '
            "spec.elasticPolicy.nProcPerNode: Forbidden: must not be used with spec.nprocPerNode — "
            "change the spec's kubernetes/distributed settings the message names, or use the other --target"
        )
        assert server.objects("kubeflow.org/v1", "pytorchjobs", NS) == []


def test_a_pruned_field_is_refused_by_name(tmp_path):
    """A field the cluster's CRD lacks comes back missing from the dry run: refused, not lost."""
    with FakeKubeAPI(operator="v1.8.1") as server:
        kubeconfig = str(server.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS))
        backend = KubeflowBackend(kubeconfig=kubeconfig)
        job = manifests.render(load_spec(ROOT / "examples" / "sentiment-minilm.yaml"), NS).job
        job["spec"]["runPolicy"]["futureKnob"] = True
        with pytest.raises(
            KubetuneError,
            match=r"the cluster would drop spec.runPolicy.futureKnob from the PyTorchJob: "
            r"the cluster's Training Operator is older",
        ):
            backend._check_served(job)


def _cli(server: FakeKubeAPI, tmp_path: Path, *args: str) -> tuple[int, str, str]:
    kubeconfig = str(server.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS))
    result = CliRunner().invoke(app, [*args, "--kubeconfig", kubeconfig])
    return result.exit_code, result.stdout, result.stderr


def test_after_submit_the_job_kind_is_found_on_the_cluster(tmp_path):
    """`--target trainjob` at submit only: status, wait and delete find the TrainJob by name."""
    example = ROOT / "examples" / "llama-lora.yaml"
    name = load_spec(example).name
    with FakeKubeAPI() as server:
        assert _submit(server, tmp_path, example, "--target", "trainjob")[0] == 0
        server.set_status(
            "trainer.kubeflow.org/v1alpha1",
            "trainjobs",
            NS,
            name,
            {"conditions": [{"type": "Complete", "status": "True", "reason": "JobSetCompleted", "message": "done"}]},
        )
        code, out, err = _cli(server, tmp_path, "status", name)
        assert code == 0, err
        assert "TrainJob" in out and "Succeeded" in out
        code, out, err = _cli(server, tmp_path, "wait", name, "--timeout", "5")
        assert code == 0 and out.startswith(f"{name}: Succeeded"), err
        code, out, err = _cli(server, tmp_path, "delete", name)
        assert code == 0, err
        assert server.objects("trainer.kubeflow.org/v1alpha1", "trainjobs", NS) == []
        # the same name as both kinds: say so, and how to choose
        assert _submit(server, tmp_path, example, "--target", "trainjob")[0] == 0
        assert _submit(server, tmp_path, example)[0] == 0
        code, _, err = _cli(server, tmp_path, "status", name)
        assert code == 2 and _error(err) == (
            f"error: --target: both a PyTorchJob and a TrainJob are named '{name}' in namespace '{NS}' — "
            "pass --target pytorchjob or --target trainjob"
        )
        assert _cli(server, tmp_path, "status", name, "--target", "pytorchjob")[0] == 0


def test_the_python_client_finds_the_kind_too(tmp_path):
    from kubetune import Client

    example = ROOT / "examples" / "sentiment-minilm.yaml"
    with FakeKubeAPI() as server:
        kubeconfig = str(server.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS))
        Client(backend="kubeflow", kubeconfig=kubeconfig, target="trainjob").train(example)
        job = Client(backend="kubeflow", kubeconfig=kubeconfig).get(load_spec(example).name)
        assert job.status().kind == "TrainJob"
