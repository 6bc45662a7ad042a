"""What a spec needs before it goes to a cluster (no cluster access here): the problems that refuse
a render (``cluster_problems``: inputs the pods cannot reach; ``trainjob_problems``: fields a
TrainJob has no place for; ``typed_problems``: an affinity the typed model refuses), and the
warnings a user must hear about a spec that renders (``warnings_for``). Each is one line naming the
field, the problem and the fix.
"""

from __future__ import annotations

from kubetune import providers
from kubetune.artifacts.output import Output
from kubetune.backends.cluster.objects import WORKSPACE
from kubetune.config import JobSpec

LOCAL_HOSTS = ("localhost", "127.0.0.1", "0.0.0.0", "::1", "[::1]")

# Spec fields a TrainJob of Trainer v2.3 has no place for (the runtime and its JobSet own them);
# set explicitly with --target trainjob, each is refused by name rather than dropped.
TRAINJOB_UNSUPPORTED = {
    "restart_policy": "the runtime's JobSet failure policy decides restarts",
    "backoff_limit": "the runtime's JobSet failure policy decides restarts",
    "ttl_seconds_after_finished": "a TrainJob has no TTL",
    "clean_pod_policy": "the runtime decides what happens to finished pods",
    "image_pull_policy": (
        "the runtime's container sets it (a TrainJob patch carries only env, volumeMounts and securityContext)"
    ),
    "elastic": "a TrainJob has no elastic policy",
    "priority_class": (
        "a TrainJob's pod patch has no priorityClassName; use kubernetes.queue with a Kueue WorkloadPriorityClass"
    ),
    "master_port": "the runtime sets the rendezvous port",
}


def trainjob_problems(spec: JobSpec) -> list[str]:
    """One line per ``kubernetes.*`` field the user set that a TrainJob (v2.3) cannot carry."""
    kube = spec.kubernetes
    return [
        f"kubernetes.{name}: {why} — remove it for --target trainjob, or use --target pytorchjob"
        for name, why in TRAINJOB_UNSUPPORTED.items()
        if name in kube.model_fields_set and getattr(kube, name) is not None
    ]


def cluster_problems(spec: JobSpec) -> list[str]:
    """What makes a spec fail only inside a pod: model or data paths on this machine, an S3
    endpoint or MLflow server on localhost (or no MLflow server named). Local paths work on a named
    claim that holds them (pvc mode with existing_claim; relative paths and paths under /workspace
    are on it)."""
    from urllib.parse import urlsplit

    st = spec.kubernetes.storage
    on_claim = st.mode == "pvc" and st.existing_claim
    out = []
    for field, uri in (("model.uri", spec.model.uri), ("data.train", spec.data.train), ("data.eval", spec.data.eval)):
        parsed = providers.parse_uri(uri) if uri is not None else None
        if parsed is None or parsed.scheme != "file":
            continue
        path = parsed.body
        if on_claim and (not path.startswith(("/", "~")) or path.startswith(WORKSPACE + "/")):
            continue
        out.append(
            f"{field}: {uri!r} is a path on this machine, which the pods cannot read — use s3:// or hf://, pkg:// "
            "for files inside the image, or a path on a named claim (kubernetes.storage: "
            f"{{mode: pvc, existing_claim: NAME}}, path relative to {WORKSPACE})"
        )
    endpoint = spec.s3.endpoint_url
    if endpoint and (urlsplit(endpoint).hostname or "").lower() in LOCAL_HOSTS:
        out.append(
            f"s3.endpoint_url: {endpoint!r} is this machine, not reachable from the pods — use the in-cluster address "
            "(e.g. http://minio.minio.svc.cluster.local:9000), or leave it out and put AWS_ENDPOINT_URL in the "
            "Secret kubernetes.secrets.s3"
        )
    mlflow = spec.tracking.mlflow
    if mlflow is not None and not mlflow.uri:
        out.append(
            "tracking.mlflow.uri: required on Kubernetes (the pods do not see this machine's MLFLOW_TRACKING_URI) — "
            "set it to the server's in-cluster address, e.g. http://mlflow.mlflow.svc.cluster.local:5000"
        )
    elif mlflow is not None and (urlsplit(mlflow.uri).hostname or "").lower() in LOCAL_HOSTS:
        out.append(
            f"tracking.mlflow.uri: {mlflow.uri!r} is this machine, not reachable from the pods — use the server's "
            "in-cluster address, e.g. http://mlflow.mlflow.svc.cluster.local:5000"
        )
    return out


def typed_problems(spec: JobSpec) -> list[str]:
    """The user's affinity, checked against the Kubernetes typed model (unknown or mistyped fields)."""
    from kubetune.backends.cluster import strict

    if not spec.kubernetes.affinity:
        return []
    return [f"kubernetes.{p}" for p in strict.check_model(spec.kubernetes.affinity, "V1Affinity", "affinity")]


def warnings_for(spec: JobSpec) -> list[str]:
    """Problems that do not stop a render but that a user must hear about."""
    out = []
    if not Output.for_spec(spec).remote and spec.kubernetes.storage.mode == "node-local":
        out.append(
            f"output.uri: {spec.output.uri!r} is inside the pod's node-local storage and is lost when the pod ends — "
            "use an s3:// or hf:// output, or kubernetes.storage.mode: pvc"
        )
    if spec.kubernetes.tensorboard and spec.kubernetes.storage.mode != "pvc":
        out.append(
            "kubernetes.tensorboard: TensorBoard reads the event files from the shared PVC — set "
            "kubernetes.storage.mode: pvc"
        )
    if spec.resources.gpu and spec.resources.gpu != spec.distributed.procs_per_node:
        out.append(
            f"resources.gpu is {spec.resources.gpu} but distributed.procs_per_node is "
            f"{spec.distributed.procs_per_node} — use one process per GPU"
        )
    if (
        spec.kubernetes.storage.mode == "pvc"
        and spec.distributed.nodes > 1
        and spec.kubernetes.storage.access_modes == ["ReadWriteOnce"]
    ):
        out.append(
            "kubernetes.storage.access_modes: ReadWriteOnce cannot be mounted by pods on different nodes — use "
            "ReadWriteMany or node-local mode"
        )
    from kubetune.config.tasks import entries

    return out + entries()[spec.task].render_warnings(spec)
