"""Job lifecycle against a FAKE Kubernetes API server (tests/fakes/kube_api.py) over real HTTP
with the real `kubernetes` client: no real apiserver can run on this machine. The fake stands in
for the Training Operator too: tests set job conditions, pods and container logs themselves."""

from __future__ import annotations

import functools
import json
import threading
import time

import pytest
from conftest import MINILM, kubetune
from fakes.kube_api import FakeKubeAPI
from fakes.objects import job_status, pod
from typer.testing import CliRunner

from kubetune.cli import app

pytestmark = pytest.mark.integration
NS = "team-a"
JOBS = ("kubeflow.org/v1", "pytorchjobs")


@pytest.fixture
def cluster(tmp_path):
    with FakeKubeAPI() as server:
        server.kubeconfig = str(server.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS))
        yield server


@pytest.fixture
def spec_file(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(f"""
name: demo
model: {{uri: "{MINILM}"}}
data: {{train: hf://acme/reviews, text_column: text, label_column: label}}
distributed: {{nodes: 2, procs_per_node: 1}}
kubernetes:
  storage: {{mode: pvc}}
  secrets: {{hf_token: {{name: hf-secrets, key: HF_TOKEN}}}}
output: {{uri: runs/demo}}
""")
    return path


def cli(cluster, *args):
    result = CliRunner().invoke(app, [*args, "--kubeconfig", cluster.kubeconfig])
    return result.exit_code, result.stdout, result.stderr


_pod = functools.partial(pod, namespace=NS)


def test_submit_creates_owned_objects_in_the_context_namespace(cluster, spec_file):
    proc = kubetune("submit", str(spec_file), "--kubeconfig", cluster.kubeconfig)  # the real CLI, as a user runs it
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "demo"
    job = cluster.get_obj(*JOBS, NS, "demo")
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    assert (
        cluster.get_obj("v1", "configmaps", NS, "demo-spec")["metadata"]["ownerReferences"][0]["uid"]
        == job["metadata"]["uid"]
    )
    # The claim holds output.uri and the checkpoints: not owned by the job, so neither the operator's
    # TTL deletion nor `kubetune delete` garbage-collects the model with it.
    assert "ownerReferences" not in cluster.get_obj("v1", "persistentvolumeclaims", NS, "demo-workspace")["metadata"]
    code, out, _ = cli(cluster, "delete", "demo")
    assert code == 0 and out.splitlines() == [
        "deleted demo",
        "kept persistentvolumeclaim 'demo-workspace' (the job's output and checkpoints); "
        "`kubetune delete demo --delete-storage` removes it",
    ]
    assert cluster.objects("v1", "configmaps", NS) == [] and cluster.objects(*JOBS, NS) == []
    assert [p["metadata"]["name"] for p in cluster.objects("v1", "persistentvolumeclaims", NS)] == ["demo-workspace"]
    # Submitted again, the job finds its claim (and resumes from the checkpoints on it).
    assert cli(cluster, "submit", str(spec_file))[0] == 0
    code, out, _ = cli(cluster, "delete", "demo", "--delete-storage")
    assert code == 0 and out.splitlines() == ["deleted demo", "deleted persistentvolumeclaim 'demo-workspace'"]
    assert cluster.objects("v1", "persistentvolumeclaims", NS) == []


def test_a_claim_of_the_same_name_that_is_not_the_jobs_is_never_touched(cluster, spec_file):
    cluster.put(
        "v1",
        "persistentvolumeclaims",
        NS,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "demo-workspace", "namespace": NS},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
        },
    )
    code, _, err = cli(cluster, "submit", str(spec_file))
    assert (
        code == 2
        and "persistentvolumeclaim 'demo-workspace' already exists in namespace 'team-a' and is not job 'demo''s workspace"
        in err
    )
    assert cluster.objects(*JOBS, NS) == []  # rolled back
    assert "kubetune.io/job" not in (
        cluster.get_obj("v1", "persistentvolumeclaims", NS, "demo-workspace")["metadata"].get("labels") or {}
    )


def test_status_of_a_finished_job_says_where_the_model_is(cluster, spec_file):
    assert cli(cluster, "submit", str(spec_file))[0] == 0
    cluster.set_status(*JOBS, NS, "demo", job_status("Created", "Running", "Succeeded"))
    code, out, _ = cli(cluster, "status", "demo")
    assert (
        code == 0
        and "  output: persistentvolumeclaim/demo-workspace at /workspace/runs/demo (mounted at /workspace)"
        in out.splitlines()
    )
    code, out, _ = cli(cluster, "wait", "demo", "--timeout", "5")
    assert (
        code == 0
        and out.strip()
        == "demo: Succeeded; output: persistentvolumeclaim/demo-workspace at /workspace/runs/demo (mounted at /workspace)"
    )


def test_existing_job_409_and_replace(cluster, spec_file):
    assert cli(cluster, "submit", str(spec_file))[0] == 0
    uid = cluster.get_obj(*JOBS, NS, "demo")["metadata"]["uid"]
    code, _, err = cli(cluster, "submit", str(spec_file))
    assert code == 2
    assert (
        err.strip()
        == f"error: pytorchjobs.kubeflow.org 'demo' already exists in namespace '{NS}' — pass --replace, or `kubetune delete demo` first"
    )
    code, out, err = cli(cluster, "submit", str(spec_file), "--replace")
    assert code == 0, err
    assert cluster.get_obj(*JOBS, NS, "demo")["metadata"]["uid"] != uid
    assert len(cluster.objects("v1", "configmaps", NS)) == 1


def test_forbidden_is_one_line_naming_verb_resource_namespace(cluster, spec_file):
    cluster.deny("create", "pytorchjobs", NS)
    code, _, err = cli(cluster, "submit", str(spec_file))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"error: forbidden: cannot create pytorchjobs.kubeflow.org in namespace '{NS}' (")
    assert "deploy/rbac" in lines[0]
    assert cluster.objects("v1", "configmaps", NS) == []  # nothing half-created


def test_configmap_failure_rolls_the_job_back(cluster, spec_file):
    cluster.deny("create", "configmaps", NS)
    code, _, err = cli(cluster, "submit", str(spec_file))
    assert code == 2 and "cannot create configmaps" in err
    assert cluster.objects(*JOBS, NS) == []


def test_missing_job_404(cluster):
    for cmd in (["status", "nope"], ["wait", "nope"], ["logs", "nope"], ["delete", "nope"]):
        code, _, err = cli(cluster, *cmd)
        assert code == 2, cmd
        assert (
            err.strip()
            == f"error: pytorchjobs.kubeflow.org 'nope' not found in namespace '{NS}' — check the name with `kubetune list` and --namespace"
        )


def test_unreachable_api_server(tmp_path, spec_file):
    with FakeKubeAPI() as server:
        kubeconfig = str(server.write_kubeconfig(tmp_path / "kc"))
        url = server.url
    # The server is gone now: nothing listens on that port.
    result = CliRunner().invoke(app, ["status", "demo", "--kubeconfig", kubeconfig])
    assert result.exit_code == 2
    assert result.stderr.strip().startswith(f"error: cannot reach the Kubernetes API server at {url}")


def test_wait_succeeded_uses_a_watch_not_polling(cluster, spec_file):
    assert cli(cluster, "submit", str(spec_file))[0] == 0
    cluster.set_status(*JOBS, NS, "demo", job_status("Created", "Running"))

    def finish():
        time.sleep(1.0)
        cluster.set_status(*JOBS, NS, "demo", job_status("Created", "Running", "Succeeded"))

    threading.Thread(target=finish).start()
    before = len(cluster.requests)
    code, out, err = cli(cluster, "wait", "demo", "--timeout", "30")
    assert code == 0, err
    assert (
        out.strip()
        == "demo: Succeeded; output: persistentvolumeclaim/demo-workspace at /workspace/runs/demo (mounted at /workspace)"
    )
    seen = cluster.requests[before:]
    watches = [r for r in seen if r[2].get("watch") in ("true", "1", "True")]
    assert len(watches) == 1 and watches[0][2].get("fieldSelector") == "metadata.name=demo"
    assert len(seen) < 10  # one get, one watch, the final status reads: no polling loop


def test_wait_timeout_exit_3(cluster, spec_file):
    assert cli(cluster, "submit", str(spec_file))[0] == 0
    cluster.set_status(*JOBS, NS, "demo", job_status("Created", "Running"))
    code, _, err = cli(cluster, "wait", "demo", "--timeout", "1")
    assert code == 3 and "still Running after 1 s" in err


def test_failed_with_oomkilled_reason_and_log_tail(cluster, spec_file):
    assert cli(cluster, "submit", str(spec_file))[0] == 0
    cluster.put("v1", "pods", NS, _pod("demo-master-0", "demo", "master", 0))
    cluster.put(
        "v1",
        "pods",
        NS,
        _pod(
            "demo-worker-0",
            "demo",
            "worker",
            0,
            phase="Failed",
            container_state={"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
        ),
    )
    cluster.append_log(NS, "demo-worker-0", "pytorch", *[f"step {i}" for i in range(30)], "allocating 9 GiB")
    cluster.set_status(
        *JOBS,
        NS,
        "demo",
        job_status(
            "Created",
            "Running",
            "Failed",
            message="PyTorchJob demo is failed because 1 Worker replica(s) failed.",
        ),
    )
    code, _, err = cli(cluster, "wait", "demo", "--timeout", "10")
    assert code == 1
    first = err.splitlines()[0]
    assert first.startswith("error: PyTorchJob demo failed: OOMKilled on demo-worker-0")
    assert "  allocating 9 GiB" in err and "step 0" not in err  # only the last lines
    code, out, _ = cli(cluster, "status", "demo")
    assert code == 0
    assert "PyTorchJob demo in team-a: Failed" in out and "reason: OOMKilled on demo-worker-0" in out


@pytest.mark.parametrize(
    "pod, reason",
    [
        (
            _pod(
                "demo-master-0",
                "demo",
                "master",
                0,
                phase="Pending",
                container_state={
                    "waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "ghcr.io/x:1"'}
                },
            ),
            "ImagePullBackOff",
        ),
        (
            _pod(
                "demo-master-0",
                "demo",
                "master",
                0,
                phase="Pending",
                container_state={"waiting": {"reason": "ErrImagePull", "message": "not found"}},
            ),
            "ErrImagePull",
        ),
        (
            _pod(
                "demo-master-0",
                "demo",
                "master",
                0,
                container_state={"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 5m0s"}},
            ),
            "CrashLoopBackOff",
        ),
        (
            _pod(
                "demo-master-0",
                "demo",
                "master",
                0,
                phase="Pending",
                container_state={"waiting": {"reason": "ContainerCreating"}},
                conditions=[
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
                    }
                ],
            ),
            "Unschedulable",
        ),
    ],
    ids=["ImagePullBackOff", "ErrImagePull", "CrashLoopBackOff", "Unschedulable"],
)
def test_status_reads_failure_reasons_from_pods(cluster, spec_file, pod, reason):
    assert cli(cluster, "submit", str(spec_file))[0] == 0
    cluster.set_status(*JOBS, NS, "demo", job_status("Created"))
    cluster.put("v1", "pods", NS, pod)
    code, out, _ = cli(cluster, "status", "demo")
    assert code == 0
    assert f"reason: {reason} on demo-master-0" in out


def test_status_of_a_running_job_shows_rank_0s_progress(cluster, spec_file):
    """Progress reaches `status` through rank 0's log (its event lines, read with json.loads), which
    the CLI may already read: no annotation patched by the pods, no extra RBAC for them."""
    import json

    from kubetune.training.events import Event, log_line

    def progress(step: int, **fields) -> str:
        record = {"phase": "training", "step": step, "total_steps": 30, "epoch": 1, "epochs": 1, **fields}
        return "[rank 0] INFO " + log_line(Event("progress", step, context=record))

    assert cli(cluster, "submit", str(spec_file))[0] == 0
    cluster.set_status(*JOBS, NS, "demo", job_status("Created", "Running"))
    for name, rtype in (("demo-master-0", "master"), ("demo-worker-0", "worker")):
        cluster.put("v1", "pods", NS, _pod(name, "demo", rtype, 0))
    cluster.append_log(
        NS,
        "demo-master-0",
        "pytorch",
        "12:00:01 [rank 0] INFO progress: step=10/30 epoch=1/1 loss=1.0986 lr=2.00e-05",
        "12:00:01 " + progress(10, loss=1.0986, lr=2e-05),
        "12:00:04 [rank 0] INFO epoch 1, step 15: eval_loss 1.0500 eval_accuracy 0.4000 eval_f1_macro 0.3800",
        "12:00:04 [rank 0] INFO "
        + log_line(Event("eval", 15, {"eval_loss": 1.05, "eval_accuracy": 0.4, "eval_f1_macro": 0.38})),
        "12:00:05 [rank 0] INFO progress: step=20/30 epoch=1/1 loss=1.0412 lr=1.00e-05 samples/s=91.5 eta=1m05s",
        "12:00:05 " + progress(20, loss=1.0412, lr=1e-05, samples_per_s=91.5, eta_s=65.0),
    )
    cluster.append_log(NS, "demo-worker-0", "pytorch", "12:00:05 " + progress(99).replace("rank 0", "rank 1"))
    code, out, err = cli(cluster, "status", "demo", "--json")
    assert code == 0, err
    st = json.loads(out)
    assert st["phase"] == "Running"
    assert st["progress"] == {
        "phase": "training",
        "step": 20,
        "total_steps": 30,
        "epoch": 1,
        "epochs": 1,
        "loss": 1.0412,
        "lr": 1e-05,
        "samples_per_s": 91.5,
        "eta_s": 65.0,
        "last_eval": {"step": 15, "eval_loss": 1.05, "eval_accuracy": 0.4, "eval_f1_macro": 0.38},
    }
    code, out, _ = cli(cluster, "status", "demo")
    assert "  progress: step=20/30 epoch=1/1 loss=1.0412 lr=1.00e-05 samples/s=91.5 ETA 1m05s" in out.splitlines()
    assert "  last evaluation (step 15): eval_loss 1.0500 eval_accuracy 0.4000 eval_f1_macro 0.3800" in out


def test_logs_follow_all_ranks_streams_until_pods_finish(cluster, spec_file):
    assert cli(cluster, "submit", str(spec_file))[0] == 0
    for name, rtype in (("demo-master-0", "master"), ("demo-worker-0", "worker")):
        cluster.put("v1", "pods", NS, _pod(name, "demo", rtype, 0))
    cluster.append_log(NS, "demo-master-0", "pytorch", "[rank 0] INFO epoch 1")

    def progress():
        time.sleep(0.5)
        cluster.append_log(NS, "demo-worker-0", "pytorch", "[rank 1] WARNING slow step")
        cluster.append_log(NS, "demo-master-0", "pytorch", "[rank 0] INFO done")
        time.sleep(0.5)
        for name, rtype in (("demo-master-0", "master"), ("demo-worker-0", "worker")):
            cluster.put(
                "v1",
                "pods",
                NS,
                _pod(
                    name,
                    "demo",
                    rtype,
                    0,
                    phase="Succeeded",
                    container_state={"terminated": {"exitCode": 0, "reason": "Completed"}},
                ),
            )

    threading.Thread(target=progress).start()
    code, out, err = cli(cluster, "logs", "demo", "-f", "--all")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert sorted(lines) == sorted(
        ["[node 0] [rank 0] INFO epoch 1", "[node 1] [rank 1] WARNING slow step", "[node 0] [rank 0] INFO done"]
    )
    assert lines.index("[node 0] [rank 0] INFO epoch 1") < lines.index("[node 0] [rank 0] INFO done")
    # --rank is the process rank the lines carry (1 process per node here: node 1), --node the pod's node rank
    for option in ("--rank", "--node"):
        code, out, _ = cli(cluster, "logs", "demo", option, "1", "--tail", "1")
        assert (code, out.strip()) == (0, "[node 1] [rank 1] WARNING slow step"), option
    code, _, err = cli(cluster, "logs", "demo", "--rank", "1", "--node", "1")
    assert code == 2 and "pass --rank or --node, not both" in err


def test_list_and_python_client(cluster, spec_file):
    from kubetune import Client

    job = Client(backend="kubeflow", kubeconfig=cluster.kubeconfig).train(spec_file)
    assert job.name == "demo"
    cluster.set_status(*JOBS, NS, "demo", job_status("Created", "Running", "Succeeded"))
    assert job.wait(timeout=10).phase == "Succeeded"
    # the handle's progress() and metrics(): rank 0's last progress event and its `done` event
    from kubetune.training.events import Event, log_line

    cluster.put("v1", "pods", NS, _pod("demo-master-0", "demo", "master", 0, phase="Succeeded"))
    record = {"step": 30, "total_steps": 30, "epoch": 1, "epochs": 1, "loss": 0.9, "lr": 0.0}
    cluster.append_log(
        NS,
        "demo-master-0",
        "pytorch",
        "[rank 0] INFO progress: step=30/30 epoch=1/1 loss=0.9000 lr=0.00e+00",
        "[rank 0] INFO " + log_line(Event("progress", 30, context=record)),
        "[rank 0] INFO done: eval_accuracy 0.7133, eval_f1_macro 0.7100, 91.5 samples/s; artifacts in runs/demo",
        "[rank 0] INFO "
        + log_line(Event("done", 30, {"eval_accuracy": 0.7133, "eval_f1_macro": 0.71}, {"output": "runs/demo"})),
    )
    assert job.progress()["step"] == 30 and job.progress()["output"] == "runs/demo"
    assert job.metrics() == {"eval_accuracy": 0.7133, "eval_f1_macro": 0.71}
    code, out, _ = cli(cluster, "list")
    assert code == 0 and out.split()[:2] == ["demo", "Succeeded"]
    code, out, _ = cli(cluster, "list", "--json")
    listed = json.loads(out)
    assert code == 0 and [(j["name"], j["phase"]) for j in listed] == [("demo", "Succeeded")]
    job.delete()
    assert cluster.objects(*JOBS, NS) == []


def test_context_selects_namespace_and_namespace_flag_wins(cluster, spec_file):
    import json as _json

    config = _json.loads(open(cluster.kubeconfig).read())
    other = {**config["contexts"][0], "name": "other"}
    other["context"] = {**other["context"], "namespace": "team-b"}
    config["contexts"].append(other)
    open(cluster.kubeconfig, "w").write(_json.dumps(config))
    assert cli(cluster, "submit", str(spec_file), "--context", "other")[0] == 0
    assert cluster.get_obj(*JOBS, "team-b", "demo") is not None and cluster.get_obj(*JOBS, NS, "demo") is None
    assert cli(cluster, "submit", str(spec_file), "--namespace", "team-c")[0] == 0
    assert cluster.get_obj(*JOBS, "team-c", "demo") is not None
