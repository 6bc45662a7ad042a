"""Pure builders: a JobSpec → the Kubernetes objects that run it (no cluster access here).

Objects are built with the official typed models (``kubernetes.client`` models, the
``kubeflow-training`` PyTorchJob models, the ``kubeflow-trainer-api`` TrainJob models) and
serialized from them. The resolved job spec travels in a ConfigMap mounted into the pods; secrets
are only ever referenced (secretKeyRef / envFrom.secretRef), never copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml
from kubernetes import client as k8s

from kubetune import providers
from kubetune.artifacts.output import Output
from kubetune.config import JobSpec, dump_spec
from kubetune.config.cluster import default_image
from kubetune.errors import SpecError

SPEC_DIR = "/etc/kubetune"
WORKSPACE = "/workspace"
STAGE_ROOT = f"{WORKSPACE}/stage"
CONTAINER = "pytorch"  # the Training Operator requires this container name
PYTORCHJOB_API = ("kubeflow.org", "v1", "pytorchjobs")
TRAINJOB_API = ("trainer.kubeflow.org", "v1alpha1", "trainjobs")
JOB_LABEL = "kubetune.io/job"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


@dataclass(frozen=True)
class Rendered:
    """Everything one job needs, in creation order; ``job`` is the PyTorchJob or TrainJob."""

    config_map: dict
    pvc: dict | None
    job: dict
    tensorboard: list[dict]

    def objects(self) -> list[dict]:
        return [self.config_map, *([self.pvc] if self.pvc else []), self.job, *self.tensorboard]

    def to_yaml(self) -> str:
        return yaml.dump_all(self.objects(), Dumper=_BlockDumper, sort_keys=False)


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (the spec in the ConfigMap) as readable ``|`` blocks."""


_BlockDumper.add_representer(
    str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)
)


def _ser(obj) -> dict:
    """Serialize a typed model the way the kubernetes client sends it (camelCase, no nulls)."""
    return k8s.ApiClient().sanitize_for_serialization(obj)


def labels(spec: JobSpec) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "kubetune",
        "app.kubernetes.io/instance": spec.name,
        JOB_LABEL: spec.name,
        **spec.kubernetes.labels,
    }


def job_labels(spec: JobSpec) -> dict[str, str]:
    """The job object's labels: Kueue reads its queue from the job itself."""
    return {**labels(spec), **({QUEUE_LABEL: spec.kubernetes.queue} if spec.kubernetes.queue else {})}


def _meta(spec: JobSpec, name: str, namespace: str, **extra_annotations) -> k8s.V1ObjectMeta:
    annotations = {**spec.kubernetes.annotations, **extra_annotations}
    return k8s.V1ObjectMeta(name=name, namespace=namespace, labels=labels(spec), annotations=annotations or None)


def config_map_name(spec: JobSpec) -> str:
    return f"{spec.name}-spec"


def pvc_name(spec: JobSpec) -> str:
    return spec.kubernetes.storage.existing_claim or own_claim(spec.name)


def own_claim(job: str) -> str:
    """The workspace claim kubetune creates for the job called ``job`` (pvc mode, no existing_claim)."""
    return f"{job}-workspace"


def build_config_map(spec: JobSpec, namespace: str) -> dict:
    """The resolved spec, mounted read-only at /etc/kubetune/job.yaml."""
    return _ser(
        k8s.V1ConfigMap(
            api_version="v1",
            kind="ConfigMap",
            metadata=_meta(spec, config_map_name(spec), namespace),
            data={"job.yaml": dump_spec(spec)},
        )
    )


def build_pvc(spec: JobSpec, namespace: str) -> dict | None:
    st = spec.kubernetes.storage
    if st.mode != "pvc" or st.existing_claim:
        return None
    return _ser(
        k8s.V1PersistentVolumeClaim(
            api_version="v1",
            kind="PersistentVolumeClaim",
            metadata=_meta(spec, pvc_name(spec), namespace),
            spec=k8s.V1PersistentVolumeClaimSpec(
                access_modes=list(st.access_modes),
                storage_class_name=st.storage_class,
                resources=k8s.V1VolumeResourceRequirements(requests={"storage": st.size}),
            ),
        )
    )


def secret_env(spec: JobSpec) -> tuple[list[k8s.V1EnvVar], list[k8s.V1EnvFromSource]]:
    """Secrets only by reference: HF_TOKEN and the MLflow credentials via secretKeyRef, S3 credentials
    via envFrom.secretRef."""
    s = spec.kubernetes.secrets
    env = []
    if s.hf_token:
        env.append(
            k8s.V1EnvVar(
                name="HF_TOKEN",
                value_from=k8s.V1EnvVarSource(
                    secret_key_ref=k8s.V1SecretKeySelector(name=s.hf_token.name, key=s.hf_token.key)
                ),
            )
        )
    env += [
        k8s.V1EnvVar(
            name=key,
            value_from=k8s.V1EnvVarSource(
                secret_key_ref=k8s.V1SecretKeySelector(name=s.mlflow, key=key, optional=True)
            ),
        )
        for key in (MLFLOW_SECRET_KEYS if s.mlflow else ())
    ]
    env_from = [k8s.V1EnvFromSource(secret_ref=k8s.V1SecretEnvSource(name=s.s3))] if s.s3 else []
    return env, env_from


# The MLflow client's credential variables: a Secret may hold a user and password, or a token.
MLFLOW_SECRET_KEYS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")


def _common_env(spec: JobSpec) -> list[k8s.V1EnvVar]:
    return [
        # torchrun kills workers this long after forwarding SIGTERM (default 30 s): leave them the
        # pod's grace period, less a margin, to finish the step and write the checkpoint.
        k8s.V1EnvVar(
            name="TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
            value=str(max(5, spec.kubernetes.termination_grace_period_seconds - 10)),
        ),
        # torchrun: a fresh rendezvous store per round, so restarted workers never read stale peers.
        k8s.V1EnvVar(name="TORCH_DISABLE_SHARE_RDZV_TCP_STORE", value="1"),
        k8s.V1EnvVar(name="HF_HOME", value=f"{WORKSPACE}/cache/hf"),
        k8s.V1EnvVar(name="KUBETUNE_CACHE", value=f"{WORKSPACE}/cache/kubetune"),
        k8s.V1EnvVar(name="PYTHONUNBUFFERED", value="1"),
        k8s.V1EnvVar(name="TOKENIZERS_PARALLELISM", value="false"),
    ]


def _resources(spec: JobSpec) -> k8s.V1ResourceRequirements:
    r = spec.resources
    amounts = {k: v for k, v in {"cpu": r.cpu, "memory": r.memory}.items() if v}
    limits = dict(amounts)
    if r.gpu:
        limits[r.gpu_resource] = str(r.gpu)
    return k8s.V1ResourceRequirements(requests=amounts or None, limits=limits or None)


def _tolerations(kube) -> list[k8s.V1Toleration]:
    """kubernetes.tolerations as the pod spec's typed objects (PyTorchJob pods and the TrainJob patch)."""
    return [
        k8s.V1Toleration(
            key=t.key, operator=t.operator, value=t.value, effect=t.effect, toleration_seconds=t.toleration_seconds
        )
        for t in kube.tolerations
    ]


def _volumes(spec: JobSpec) -> list[k8s.V1Volume]:
    st = spec.kubernetes.storage
    workspace = (
        k8s.V1Volume(
            name="workspace", persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(claim_name=pvc_name(spec))
        )
        if st.mode == "pvc"
        else k8s.V1Volume(name="workspace", empty_dir=k8s.V1EmptyDirVolumeSource(size_limit=st.size))
    )
    return [
        k8s.V1Volume(name="job-spec", config_map=k8s.V1ConfigMapVolumeSource(name=config_map_name(spec))),
        workspace,
        # /dev/shm defaults to 64Mi in containers: too small for NCCL and DataLoader workers.
        k8s.V1Volume(
            name="dshm", empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory", size_limit=spec.resources.shm_size)
        ),
    ]


def _mounts(with_shm: bool = True) -> list[k8s.V1VolumeMount]:
    mounts = [
        k8s.V1VolumeMount(name="job-spec", mount_path=SPEC_DIR, read_only=True),
        k8s.V1VolumeMount(name="workspace", mount_path=WORKSPACE),
    ]
    if with_shm:
        mounts.append(k8s.V1VolumeMount(name="dshm", mount_path="/dev/shm"))
    return mounts


def image(spec: JobSpec) -> str:
    return spec.kubernetes.image or default_image(spec.resources.gpu)


def stage_dir(spec: JobSpec) -> str:
    """Per job, so jobs sharing one claim never read each other's staged spec."""
    return f"{STAGE_ROOT}/{spec.name}"


def worker_command(spec: JobSpec) -> list[str]:
    """`kubetune launch`: torch's elastic launcher configured from the operator's PET_*
    environment exactly as torchrun would, exiting with codes the restart policy can act on
    (143 after a graceful stop, >= 128 for infrastructure, 1 for user errors)."""
    from kubetune.launch import pod_command

    return pod_command(f"{stage_dir(spec)}/job.yaml")


def fetch_command(spec: JobSpec) -> list[str]:
    return ["kubetune", "fetch", f"{SPEC_DIR}/job.yaml", "--dest", stage_dir(spec)]


def build_pod_template(spec: JobSpec) -> k8s.V1PodTemplateSpec:
    kube = spec.kubernetes
    env, env_from = secret_env(spec)
    stage = k8s.V1Container(
        name="stage",
        image=image(spec),
        image_pull_policy=kube.image_pull_policy,
        command=fetch_command(spec),
        env=_common_env(spec) + env,
        env_from=env_from or None,
        volume_mounts=_mounts(with_shm=False),
        resources=k8s.V1ResourceRequirements(requests={k: v for k, v in {"cpu": "1", "memory": "2Gi"}.items()}),
    )
    main = k8s.V1Container(
        name=CONTAINER,
        image=image(spec),
        image_pull_policy=kube.image_pull_policy,
        command=worker_command(spec),
        working_dir=WORKSPACE,
        # The init container staged everything: workers reach for the Hub only to push an hf:// output.
        env=_common_env(spec)
        + ([] if Output.for_spec(spec).scheme == "hf" else [k8s.V1EnvVar(name="HF_HUB_OFFLINE", value="1")])
        + env,
        env_from=env_from or None,
        ports=[k8s.V1ContainerPort(name="pytorchjob-port", container_port=kube.master_port, protocol="TCP")],
        resources=_resources(spec),
        volume_mounts=_mounts(),
    )
    # Elastic jobs have only Worker replicas, so a worker's index is its node rank (see kubeflow.pod_info).
    pod_labels = {**labels(spec), **({"kubetune.io/elastic": "true"} if kube.elastic else {})}
    return k8s.V1PodTemplateSpec(
        metadata=k8s.V1ObjectMeta(
            labels=pod_labels, annotations={"sidecar.istio.io/inject": "false", **kube.annotations}
        ),
        spec=k8s.V1PodSpec(
            init_containers=[stage],
            containers=[main],
            volumes=_volumes(spec),
            service_account_name=kube.service_account,
            node_selector=kube.node_selector or None,
            tolerations=_tolerations(kube) or None,
            image_pull_secrets=[k8s.V1LocalObjectReference(name=n) for n in kube.image_pull_secrets] or None,
            termination_grace_period_seconds=kube.termination_grace_period_seconds,
            priority_class_name=kube.priority_class,
            # The image's user is 1000; fsGroup makes the PVC writable for it.
            security_context=k8s.V1PodSecurityContext(run_as_non_root=True, run_as_user=1000, fs_group=1000),
        ),
    )


def _with_affinity(pod_spec: dict, spec: JobSpec) -> dict:
    """The user's affinity, as written (camelCase), in a serialized pod spec."""
    return {**pod_spec, "affinity": spec.kubernetes.affinity} if spec.kubernetes.affinity else pod_spec


def build_pytorchjob(spec: JobSpec, namespace: str) -> dict:
    """The kubeflow.org/v1 PyTorchJob: Master 1 + Worker nodes-1 (elastic: Worker × nodes)."""
    from kubeflow.training import models as kf

    kube, dist = spec.kubernetes, spec.distributed
    template = build_pod_template(spec)

    def replica(n: int) -> kf.KubeflowOrgV1ReplicaSpec:
        return kf.KubeflowOrgV1ReplicaSpec(replicas=n, restart_policy=kube.restart_policy, template=template)

    if kube.elastic:
        # Elastic jobs have no Master: the operator points the c10d rendezvous at worker 0.
        # Processes per node go in spec.nprocPerNode only: the v1.8+ webhook refuses
        # elasticPolicy.nProcPerNode beside it, and v1.7's controller fails such a job.
        replicas = {"Worker": replica(dist.nodes)}
        elastic = kf.KubeflowOrgV1ElasticPolicy(
            min_replicas=kube.elastic.min_nodes,
            max_replicas=kube.elastic.max_nodes,
            max_restarts=kube.elastic.max_restarts,
            rdzv_backend="c10d",
        )
    else:
        replicas = {"Master": replica(1), **({"Worker": replica(dist.nodes - 1)} if dist.nodes > 1 else {})}
        elastic = None
    metadata = _meta(spec, spec.name, namespace)
    metadata.labels = job_labels(spec)
    job = kf.KubeflowOrgV1PyTorchJob(
        api_version="kubeflow.org/v1",
        kind="PyTorchJob",
        metadata=metadata,
        spec=kf.KubeflowOrgV1PyTorchJobSpec(
            nproc_per_node=str(dist.procs_per_node),
            elastic_policy=elastic,
            pytorch_replica_specs=replicas,
            run_policy=kf.KubeflowOrgV1RunPolicy(
                clean_pod_policy=kube.clean_pod_policy,
                ttl_seconds_after_finished=kube.ttl_seconds_after_finished,
                backoff_limit=kube.backoff_limit,
                active_deadline_seconds=kube.active_deadline_seconds,
                # Kueue starts a queued job by unsuspending it.
                suspend=True if kube.queue else None,
                scheduling_policy=kf.KubeflowOrgV1SchedulingPolicy(priority_class=kube.priority_class)
                if kube.priority_class
                else None,
            ),
        ),
    )
    body = _ser(job)
    for rs in body["spec"]["pytorchReplicaSpecs"].values():
        rs["template"]["spec"] = _with_affinity(rs["template"]["spec"], spec)
    return body


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


def build_trainjob(spec: JobSpec, namespace: str) -> dict:
    """The Kubeflow Trainer v2 TrainJob equivalent (runtime ``kubernetes.runtime``, default
    ``torch-distributed``).

    Trainer v2 runtimes own the pod template, so staging runs in the trainer container before
    torchrun (idempotent per node) and the spec ConfigMap and workspace come in as runtime patches.
    """
    from kubeflow_trainer_api import models as tr

    kube, dist = spec.kubernetes, spec.distributed
    env, env_from = secret_env(spec)
    if env_from:
        # TrainJob's container patch has no envFrom: reference each S3 key explicitly.
        env += [
            k8s.V1EnvVar(
                name=key,
                value_from=k8s.V1EnvVarSource(
                    secret_key_ref=k8s.V1SecretKeySelector(name=kube.secrets.s3, key=key, optional=optional)
                ),
            )
            for key, optional in (
                ("AWS_ACCESS_KEY_ID", False),
                ("AWS_SECRET_ACCESS_KEY", False),
                ("AWS_ENDPOINT_URL", True),
            )
        ]
    volumes = [_ser(v) for v in _volumes(spec)]
    node_patch = {
        "name": "node",
        "template": {
            "spec": {
                "template": {
                    "metadata": {
                        "labels": labels(spec),
                        "annotations": {"sidecar.istio.io/inject": "false", **kube.annotations},
                    },
                    "spec": _with_affinity(
                        _drop_none(
                            {
                                "volumes": volumes,
                                "containers": [{"name": "node", "volumeMounts": [_ser(m) for m in _mounts()]}],
                                "serviceAccountName": kube.service_account,
                                "nodeSelector": kube.node_selector or None,
                                "tolerations": [_ser(t) for t in _tolerations(kube)] or None,
                                "imagePullSecrets": [{"name": n} for n in kube.image_pull_secrets] or None,
                                "terminationGracePeriodSeconds": kube.termination_grace_period_seconds,
                                "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000},
                            }
                        ),
                        spec,
                    ),
                }
            }
        },
    }
    metadata = _ser(_meta(spec, spec.name, namespace))
    metadata["labels"] = job_labels(spec)
    body = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": metadata,
        "spec": {
            "runtimeRef": {"name": kube.runtime, "kind": "ClusterTrainingRuntime", "apiGroup": "trainer.kubeflow.org"},
            "suspend": True if kube.queue else None,  # Kueue starts a queued job by unsuspending it
            "activeDeadlineSeconds": kube.active_deadline_seconds,
            "trainer": {
                "image": image(spec),
                "command": ["sh", "-c", " ".join(fetch_command(spec)) + " && exec " + " ".join(worker_command(spec))],
                "numNodes": dist.nodes,
                "numProcPerNode": dist.procs_per_node,
                "resourcesPerNode": _ser(_resources(spec)),
                "env": [_ser(e) for e in _common_env(spec) + env],
            },
            "runtimePatches": [
                {
                    "manager": "kubetune.io/render",
                    "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [node_patch]}}},
                }
            ],
        },
    }
    return tr.TrainerV1alpha1TrainJob.from_dict(_drop_none(body)).to_dict()


def build_tensorboard(spec: JobSpec, namespace: str) -> list[dict]:
    """A TensorBoard Deployment + Service reading the job's event files from the shared PVC."""
    if not spec.kubernetes.tensorboard:
        return []
    name = f"{spec.name}-tensorboard"
    tb_labels = {**labels(spec), "app.kubernetes.io/component": "tensorboard"}
    logdir = f"{Output.for_spec(spec).pod_path(WORKSPACE)}/tensorboard"
    pod = k8s.V1PodTemplateSpec(
        metadata=k8s.V1ObjectMeta(labels=tb_labels, annotations={"sidecar.istio.io/inject": "false"}),
        spec=k8s.V1PodSpec(
            containers=[
                k8s.V1Container(
                    name="tensorboard",
                    image=spec.kubernetes.tensorboard_image,
                    command=["tensorboard", f"--logdir={logdir}", "--host=0.0.0.0", "--port=6006"],
                    ports=[k8s.V1ContainerPort(container_port=6006, name="http")],
                    volume_mounts=[k8s.V1VolumeMount(name="workspace", mount_path=WORKSPACE, read_only=True)],
                    resources=k8s.V1ResourceRequirements(
                        requests={"cpu": "100m", "memory": "512Mi"}, limits={"memory": "2Gi"}
                    ),
                )
            ],
            volumes=[
                k8s.V1Volume(
                    name="workspace",
                    persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(
                        claim_name=pvc_name(spec), read_only=True
                    ),
                )
            ],
            service_account_name=spec.kubernetes.service_account,
        ),
    )
    deployment = k8s.V1Deployment(
        api_version="apps/v1",
        kind="Deployment",
        metadata=k8s.V1ObjectMeta(name=name, namespace=namespace, labels=tb_labels),
        spec=k8s.V1DeploymentSpec(
            replicas=1,
            selector=k8s.V1LabelSelector(
                match_labels={JOB_LABEL: spec.name, "app.kubernetes.io/component": "tensorboard"}
            ),
            template=pod,
        ),
    )
    service = k8s.V1Service(
        api_version="v1",
        kind="Service",
        metadata=k8s.V1ObjectMeta(name=name, namespace=namespace, labels=tb_labels),
        spec=k8s.V1ServiceSpec(
            selector={JOB_LABEL: spec.name, "app.kubernetes.io/component": "tensorboard"},
            ports=[k8s.V1ServicePort(name="http", port=6006, target_port=6006)],
        ),
    )
    return [_ser(deployment), _ser(service)]


def render(spec: JobSpec, namespace: str, target: str = "pytorchjob") -> Rendered:
    """All objects for ``spec`` in ``namespace``; ``target`` is pytorchjob or trainjob.

    Raises:
        SpecError: the spec cannot work on a cluster (every problem, one line each): inputs that
            are paths on this machine, a localhost S3 endpoint, fields the target cannot carry,
            an affinity or toleration the Kubernetes typed models refuse.
    """
    problems = (
        cluster_problems(spec) + (trainjob_problems(spec) if target == "trainjob" else []) + _typed_problems(spec)
    )
    if problems:
        raise SpecError(problems, "spec")
    job = build_pytorchjob(spec, namespace) if target == "pytorchjob" else build_trainjob(spec, namespace)
    return Rendered(
        build_config_map(spec, namespace), build_pvc(spec, namespace), job, build_tensorboard(spec, namespace)
    )


LOCAL_HOSTS = ("localhost", "127.0.0.1", "0.0.0.0", "::1", "[::1]")


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


def _typed_problems(spec: JobSpec) -> list[str]:
    """The user's affinity, checked against the Kubernetes typed model (unknown or mistyped fields)."""
    from kubetune.backends import strict

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
    return out


def _drop_none(obj):
    if isinstance(obj, dict):
        return {k: _drop_none(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_drop_none(v) for v in obj]
    return obj
