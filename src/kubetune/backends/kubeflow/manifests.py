"""Pure builders: a JobSpec → the Kubernetes objects that run it (no cluster access here).

Objects are built with the official typed models (``kubernetes.client`` models, the
``kubeflow-training`` PyTorchJob models, the ``kubeflow-trainer-api`` TrainJob models) and
serialized from them. The resolved job spec travels in a ConfigMap mounted into the pods; secrets
are only ever referenced (secretKeyRef / envFrom.secretRef), never copied.

Here: the ConfigMap, the workspace PVC, the pod both job kinds run (containers, environment,
volumes, commands), the PyTorchJob and the TrainJob, and ``render``, which checks the spec first
(``checks``) and adds the TensorBoard objects (``tensorboard``). The names, labels and paths every
object shares are in ``cluster.objects``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kubernetes import client as k8s

from kubetune.artifacts.output import Output
from kubetune.backends.cluster.objects import (
    CONTAINER,
    SPEC_DIR,
    WORKSPACE,
    config_map_name,
    job_labels,
    labels,
    object_meta,
    pvc_name,
    serialized,
    stage_dir,
    to_yaml,
)
from kubetune.backends.kubeflow import katib
from kubetune.backends.kubeflow.checks import cluster_problems, trainjob_problems, typed_problems
from kubetune.backends.kubeflow.tensorboard import build_tensorboard
from kubetune.config import JobSpec, dump_spec
from kubetune.config.cluster import default_image
from kubetune.errors import KubetuneError, SpecError


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
        return to_yaml(self.objects())


def build_config_map(spec: JobSpec, namespace: str) -> dict:
    """The resolved spec, mounted read-only at /etc/kubetune/job.yaml."""
    return serialized(
        k8s.V1ConfigMap(
            api_version="v1",
            kind="ConfigMap",
            metadata=object_meta(spec, config_map_name(spec), namespace),
            data={"job.yaml": dump_spec(spec)},
        )
    )


def build_pvc(spec: JobSpec, namespace: str) -> dict | None:
    st = spec.kubernetes.storage
    if st.mode != "pvc" or st.existing_claim:
        return None
    return serialized(
        k8s.V1PersistentVolumeClaim(
            api_version="v1",
            kind="PersistentVolumeClaim",
            metadata=object_meta(spec, pvc_name(spec), namespace),
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


def worker_command(spec: JobSpec) -> list[str]:
    """`kubetune launch`: torch's elastic launcher configured from the operator's PET_*
    environment exactly as torchrun would, exiting with codes the restart policy can act on
    (143 after a graceful stop, >= 128 for infrastructure, 1 for user errors)."""
    from kubetune.pod.launch import pod_command

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
    # Elastic jobs have only Worker replicas, so a worker's index is its node rank (see read.pod_info).
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
    metadata = object_meta(spec, spec.name, namespace)
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
    body = serialized(job)
    for rs in body["spec"]["pytorchReplicaSpecs"].values():
        rs["template"]["spec"] = _with_affinity(rs["template"]["spec"], spec)
    return body


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
    volumes = [serialized(v) for v in _volumes(spec)]
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
                                "containers": [{"name": "node", "volumeMounts": [serialized(m) for m in _mounts()]}],
                                "serviceAccountName": kube.service_account,
                                "nodeSelector": kube.node_selector or None,
                                "tolerations": [serialized(t) for t in _tolerations(kube)] or None,
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
    metadata = serialized(object_meta(spec, spec.name, namespace))
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
                "resourcesPerNode": serialized(_resources(spec)),
                "env": [serialized(e) for e in _common_env(spec) + env],
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


def render(spec: JobSpec, namespace: str, target: str = "pytorchjob") -> Rendered:
    """All objects for ``spec`` in ``namespace``; ``target`` is pytorchjob or trainjob.

    Raises:
        SpecError: the spec cannot work on a cluster (every problem, one line each): inputs that
            are paths on this machine, a localhost S3 endpoint, fields the target cannot carry,
            an affinity or toleration the Kubernetes typed models refuse.
    """
    if target not in ("pytorchjob", "trainjob"):
        raise KubetuneError(f"unknown target {target!r}", field="--target", fix="use pytorchjob or trainjob")
    problems = cluster_problems(spec) + (trainjob_problems(spec) if target == "trainjob" else []) + typed_problems(spec)
    if problems:
        raise SpecError(problems, "spec")
    job = build_pytorchjob(spec, namespace) if target == "pytorchjob" else build_trainjob(spec, namespace)
    return Rendered(
        build_config_map(spec, namespace), build_pvc(spec, namespace), job, build_tensorboard(spec, namespace)
    )


def _drop_none(obj):
    if isinstance(obj, dict):
        return {k: _drop_none(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_drop_none(v) for v in obj]
    return obj


def render_tune(
    spec: JobSpec, namespace: str, target: str = "pytorchjob", retain_trials: bool = False
) -> katib.RenderedTune:
    """The Katib Experiment for ``spec``'s tune section (``retain_trials``: Katib keeps each finished trial's job).

    Raises:
        KubetuneError / SpecError: no tune section, a name Katib refuses, a choice Katib's substitution cannot
            carry, what the job's render refuses.
    """
    if spec.tune is None:
        raise KubetuneError("the spec has no tune section", field="tune", fix="add one, or drop --tune")
    if len(spec.name) > katib.MAX_NAME:
        raise KubetuneError(
            f"the Experiment is named after the job, and Katib refuses names over {katib.MAX_NAME} characters "
            f"({spec.name!r} has {len(spec.name)})",
            field="name",
            fix=f"a name of at most {katib.MAX_NAME} characters",
        )
    katib.check_values(spec, target)
    if Output.for_spec(spec).scheme == "hf":
        raise KubetuneError(
            "each trial writes its own output under output.uri/trials/, and a Hub repository holds one model",
            field="output.uri",
            fix="give the study an s3:// output or a path on the workspace claim, then push the best trial",
        )
    from kubetune.tune import space

    # what a local study refuses before its first trial, Katib would otherwise find out trial by trial (a metric
    # the trials never print leaves every trial without an observation)
    space.check_search(spec)
    job_spec = spec.model_copy(update={"tune": None})
    rendered = render(job_spec, namespace, target)
    experiment = katib.build_experiment(spec, rendered.job, namespace, retain=retain_trials)
    return katib.RenderedTune(rendered.config_map, rendered.pvc, experiment)


tune_warnings = katib.tune_warnings
