"""deploy/rbac grants exactly what kubetune needs: the whole job lifecycle of the Python client
(submit with leftovers in the way, --replace, status with a failing pod, logs, wait, list,
delete; PyTorchJob and TrainJob, with the ClusterTrainingRuntime a TrainJob names and the
runtimes listing; a Katib Experiment's submit, replace, status and delete) runs against a FAKE Kubernetes API server (tests/fakes, real HTTP and the real
`kubernetes` client; no real apiserver can run here) that authorizes every request with the
rendered Role (namespace kubetune) and ClusterRole (cluster-scoped), as kube-apiserver's RBAC
authorizer would. Then every permission granted must have been used, or be on a short list of
documented extras."""

from __future__ import annotations

import threading
import time

import pytest
from deploy_support import render
from fakes import kube_api
from fakes.kube_api import FakeKubeAPI
from fakes.objects import pod

from kubetune import Client
from kubetune.backends import base
from kubetune.config.load import parse_spec

pytestmark = pytest.mark.integration
NS = "kubetune"  # the jobs namespace deploy/namespaces creates and the RoleBinding is in
SUBJECT = "system:serviceaccount:jupyterhub:kubetune"

# Granted but not called by kubetune, each for a reason written next to it in deploy/rbac/role.yaml.
EXTRAS = {
    ("", "pods", "get"),
    ("", "pods", "watch"),  # kubectl logs / get pods -w from a notebook terminal
    *((g, "events", v) for g in ("", "events.k8s.io") for v in ("get", "list", "watch")),  # kubectl describe
    (
        "kubeflow.org",
        "pytorchjobs/finalizers",
        "update",
    ),  # blockOwnerDeletion under OwnerReferencesPermissionEnforcement
    ("trainer.kubeflow.org", "trainjobs/finalizers", "update"),
    ("kubeflow.org", "experiments/finalizers", "update"),
}


def _role():
    objects = render("rbac")
    role = next(o for o in objects if o["kind"] == "Role")
    binding = next(o for o in objects if o["kind"] == "RoleBinding")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == NS
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert [f"system:serviceaccount:{s['namespace']}:{s['name']}" for s in binding["subjects"]] == [SUBJECT]
    return role


def _cluster_role():
    """The one cluster-wide grant: read-only ClusterTrainingRuntimes, bound to the same subject."""
    objects = render("rbac")
    roles = [o for o in objects if o["kind"] == "ClusterRole"]
    bindings = [o for o in objects if o["kind"] == "ClusterRoleBinding"]
    assert len(roles) == len(bindings) == 1, "exactly one ClusterRole and one ClusterRoleBinding"
    role, binding = roles[0], bindings[0]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert [f"system:serviceaccount:{s['namespace']}:{s['name']}" for s in binding["subjects"]] == [SUBJECT]
    return role


def test_the_cluster_wide_grant_is_reading_clustertrainingruntimes_only():
    assert _granted(_cluster_role()) == {
        ("trainer.kubeflow.org", "clustertrainingruntimes", v) for v in ("get", "list")
    }


def _granted(role) -> set[tuple[str, str, str]]:
    out = set()
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], f"wildcard in {rule}"
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
        out |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    return out


class RbacKubeAPI(FakeKubeAPI):
    """The fake API server, authorizing like RBAC: one Role bound in one namespace, and one
    ClusterRole bound cluster-wide (it applies to cluster-scoped requests and every namespace)."""

    def __init__(self, granted: set[tuple[str, str, str]], cluster_granted: set[tuple[str, str, str]]):
        super().__init__(user=SUBJECT, katib="v0.19.0")
        self.granted = granted
        self.cluster_granted = cluster_granted
        self.used: set[tuple[str, str, str]] = set()
        self.denied: list[tuple[str, str, str, str]] = []

    def _authorize(self, verb, res, sub, namespace, name):
        key = (res.group, f"{res.plural}/{sub}" if sub else res.plural, verb)
        if key not in self.cluster_granted and (namespace != NS or key not in self.granted):
            self.denied.append((verb, key[0], key[1], namespace))
            raise kube_api._forbidden(res, sub, name, verb, namespace, self.user)
        self.used.add(key)


def _spec(name):
    return {
        "name": name,
        "model": {"uri": "hf://sentence-transformers/all-MiniLM-L6-v2"},
        "data": {"train": "s3://kubeflow-examples/datasets/train.csv", "text_column": "text", "label_column": "label"},
        "distributed": {"nodes": 2, "procs_per_node": 1},
        "s3": {"endpoint_url": "http://minio.minio.svc.cluster.local:9000"},
        "kubernetes": {
            "namespace": NS,
            "service_account": "kubetune-runner",
            "storage": {"mode": "pvc"},
            "tensorboard": True,
            "secrets": {"s3": "minio-credentials"},
        },
        "output": {"uri": f"runs/{name}"},
    }


def _pod(name, job, rtype, index, failed=False):
    state = {"phase": "Failed", "container_state": {"terminated": {"exitCode": 1, "reason": "Error"}}} if failed else {}
    return pod(name, job, rtype, index, NS, **state)


def _finish_soon(server, group_version, plural, name, condition):
    def finish():
        time.sleep(0.5)
        server.set_status(group_version, plural, NS, name, {"conditions": [{"type": condition, "status": "True"}]})

    threading.Thread(target=finish, daemon=True).start()


def _leftovers(server, name):
    """Objects a job deleted a moment ago can leave behind until garbage collection ends:
    kubetune deletes and re-creates them (409 path), so put one of each in its way. The
    workspace claim an earlier run of the job left is kept, not replaced (409, then get)."""
    meta = {"name": "", "namespace": NS}
    server.put(
        "v1",
        "configmaps",
        NS,
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {**meta, "name": f"{name}-spec"}, "data": {}},
    )
    server.put(
        "v1",
        "persistentvolumeclaims",
        NS,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {**meta, "name": f"{name}-workspace", "labels": {"kubetune.io/job": name}},
            "spec": {},
        },
    )
    server.put(
        "v1",
        "services",
        NS,
        {"apiVersion": "v1", "kind": "Service", "metadata": {**meta, "name": f"{name}-tensorboard"}, "spec": {}},
    )
    server.put(
        "apps/v1",
        "deployments",
        NS,
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {**meta, "name": f"{name}-tensorboard"},
            "spec": {},
        },
    )


def test_role_covers_the_whole_lifecycle_and_nothing_more(tmp_path):
    role = _role()
    granted = _granted(role)
    cluster_granted = _granted(_cluster_role())
    assert not {r for (_, r, _) in granted | cluster_granted} & {
        "secrets",
        "pods/exec",
        "pods/attach",
        "serviceaccounts",
        "roles",
        "rolebindings",
    }
    with RbacKubeAPI(granted, cluster_granted) as server:
        kubeconfig = str(server.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS))

        # PyTorchJob: submit over leftovers, a failing pod's status, logs, wait, list, replace, delete
        client = Client(backend="kubeflow", kubeconfig=kubeconfig)
        _leftovers(server, "demo")
        job = client.train(_spec("demo"))
        assert {o["metadata"]["name"] for o in server.objects("apps/v1", "deployments", NS)} == {"demo-tensorboard"}
        server.put("v1", "pods", NS, _pod("demo-master-0", "demo", "master", 0))
        server.put("v1", "pods", NS, _pod("demo-worker-0", "demo", "worker", 0, failed=True))
        server.append_log(NS, "demo-master-0", "pytorch", "[rank 0] INFO step 10")
        server.append_log(NS, "demo-worker-0", "pytorch", "[rank 1] ERROR boom")
        status = job.status()
        assert status.reason == "Error" and status.log_tail == ["[rank 1] ERROR boom"]
        assert sorted(job.logs(all_ranks=True)) == ["[node 0] [rank 0] INFO step 10", "[node 1] [rank 1] ERROR boom"]
        _finish_soon(server, "kubeflow.org/v1", "pytorchjobs", "demo", "Succeeded")
        assert job.wait(timeout=10).phase == "Succeeded"  # a watch sees it finish
        assert [j["name"] for j in job.backend.list()] == ["demo"]
        # the client's own list/get (namespace from the kubeconfig context) need nothing more
        assert [(j["name"], j["phase"]) for j in client.list()] == [("demo", "Succeeded")]
        assert client.get("demo").status().phase == "Succeeded"
        job = client.train(_spec("demo"), replace=True)
        assert "kept persistentvolumeclaim 'demo-workspace'" in " ".join(job.delete())  # the output outlives the job

        # TrainJob (Trainer v2): the same calls on trainjobs, after reading the runtime it names
        # the fake cluster has the runtimes a default Trainer v2.3.0 install creates
        client = Client(backend="kubeflow", kubeconfig=kubeconfig, target="trainjob")
        job = client.train(_spec("demo-v2"))
        assert {"name": "torch-distributed", "framework": "torch"} in job.backend.runtimes()  # `kubetune runtimes`
        _finish_soon(server, "trainer.kubeflow.org/v1alpha1", "trainjobs", "demo-v2", "Complete")
        assert job.wait(timeout=10).phase == "Succeeded"
        assert [j["name"] for j in job.backend.list()] == ["demo-v2"]
        job = client.train(_spec("demo-v2"), replace=True)
        assert "deleted persistentvolumeclaim 'demo-v2-workspace'" in " ".join(job.delete(storage=True))

        # A Katib Experiment (`kubetune submit|status|delete --tune`): submit, replace, status, delete with the claim
        tuning = base.tuning(kubeconfig=kubeconfig)
        tuned = {
            **_spec("demo-tune"),
            "output": {"uri": "s3://kubeflow-examples/runs/demo-tune"},
            "training": {"eval_every": 10},
            "tune": {"space": {"training.learning_rate": {"type": "float", "low": 1e-5, "high": 1e-3}}, "trials": 2},
        }
        assert tuning.submit(parse_spec(tuned)) == "demo-tune"
        assert tuning.submit(parse_spec(tuned), replace=True) == "demo-tune"
        assert tuning.status("demo-tune").phase == "Pending"
        assert "deleted persistentvolumeclaim 'demo-tune-workspace'" in " ".join(
            tuning.delete("demo-tune", storage=True)
        )

        assert server.denied == []
        # the same Role does not reach into another namespace
        other = Client(backend="kubeflow", kubeconfig=kubeconfig, namespace="kubeflow")
        with pytest.raises(
            Exception, match=r"forbidden: cannot create (\(dry run\) )?pytorchjobs.kubeflow.org in namespace 'kubeflow'"
        ):
            other.train({**_spec("x"), "kubernetes": {**_spec("x")["kubernetes"], "namespace": "kubeflow"}})

    used = server.used
    assert used <= granted | cluster_granted
    unused = (granted | cluster_granted) - used
    assert unused == EXTRAS, (
        f"granted but neither used nor documented: {sorted(unused - EXTRAS)}; documented but not granted: {sorted(EXTRAS - unused)}"
    )
