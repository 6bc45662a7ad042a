"""Objects the Training Operator and the kubelet would write, for tests that play the cluster's part
against the fake API server (tests/fakes/kube_api.py): a job's pods and its status conditions."""

from __future__ import annotations


def pod(
    name: str,
    job: str,
    rtype: str,
    index: int,
    namespace: str,
    *,
    phase: str = "Running",
    container_state: dict | None = None,
    last_state: dict | None = None,
    conditions: list[dict] | None = None,
) -> dict:
    """Replica ``rtype``/``index`` of ``job``, labelled as kubetune's manifests label its pods."""
    status = {
        "phase": phase,
        "containerStatuses": [
            {
                "name": "pytorch",
                "restartCount": 1 if last_state else 0,
                "ready": phase == "Running",
                "image": "x",
                "imageID": "",
                "state": container_state or {"running": {}},
                **({"lastState": last_state} if last_state else {}),
            }
        ],
    }
    if conditions:
        status["conditions"] = conditions
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {
                "kubetune.io/job": job,
                "training.kubeflow.org/replica-type": rtype,
                "training.kubeflow.org/replica-index": str(index),
            },
        },
        "spec": {"containers": [{"name": "pytorch", "image": "x"}]},
        "status": status,
    }


def job_status(*types: str, message: str | None = None) -> dict:
    """A PyTorchJob status with these conditions True, in order; ``message`` replaces the last one's."""
    out = [{"type": t, "status": "True", "reason": f"PyTorchJob{t}", "message": f"job is {t.lower()}"} for t in types]
    if message:
        out[-1]["message"] = message
    return {"conditions": out}
