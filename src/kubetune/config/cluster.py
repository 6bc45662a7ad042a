"""Spec sections used only when the job runs on Kubernetes: ``resources`` and ``kubernetes``."""

from __future__ import annotations

import re
from typing import Any, Literal, Self

from pydantic import Field, ValidationInfo, field_validator, model_validator

from kubetune.config.base import Section
from kubetune.version import __version__

# Built by docker/Dockerfile (`make image`); the tag pins the kubetune version and the variant.
DEFAULT_IMAGE_REPO = "ghcr.io/kubetune/trainer"
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_NAME_PART = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]{1,253}$")


def _show(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def qualified_name_problem(key: str) -> str | None:
    """Why ``key`` is not a Kubernetes label/annotation key ([prefix/]name), or None."""
    prefix, sep, name = key.rpartition("/")
    if sep and not _DNS_SUBDOMAIN.match(prefix):
        return f"key {_show(key)}: its prefix must be a DNS subdomain (lowercase letters, digits, '-', '.')"
    if not _NAME_PART.match(name):
        return (
            f"key {_show(key)} is not a valid Kubernetes key: "
            "at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit "
            "(optionally after a DNS prefix and '/')"
        )
    return None


def _labels(v: dict[str, str], what: str, values: bool) -> dict[str, str]:
    for key, value in v.items():
        problem = qualified_name_problem(key)
        if problem:
            raise ValueError(problem)
        if values and value and not _NAME_PART.match(value):
            raise ValueError(
                f"{what} value {_show(value)} (key {_show(key)}) "
                "must be at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
            )
    return v


def _dns_subdomain(v: str | None, what: str) -> str | None:
    if v is not None and not _DNS_SUBDOMAIN.match(v):
        raise ValueError(
            f"{_show(v)} is not a valid {what} name: lowercase letters, digits, '-' and '.', at most 253 characters"
        )
    return v


def default_image(gpu: int) -> str:
    """The trainer image tag that `make image` builds for this kubetune version."""
    return f"{DEFAULT_IMAGE_REPO}:{__version__}-{'cuda' if gpu else 'cpu'}"


def _quantity(v: str | int | float | None, what: str) -> str | None:
    if v is None:
        return None
    text = str(v)
    if not _QUANTITY.match(text):
        raise ValueError(f"{text!r} is not a Kubernetes quantity; write e.g. {what}")
    return text


class ResourcesSpec(Section):
    cpu: str | None = Field(
        default="4", description="CPU per node (pod), a Kubernetes quantity such as '4' or '3500m'; requests = limits."
    )
    memory: str | None = Field(default="16Gi", description="Memory per node (pod), e.g. '16Gi'; requests = limits.")
    gpu: int = Field(
        default=0,
        ge=0,
        le=64,
        description="GPUs per node (pod); rendered as the nvidia.com/gpu limit. Set procs_per_node to match.",
    )
    gpu_resource: str = Field(default="nvidia.com/gpu", description="Extended resource name for GPUs.")
    shm_size: str = Field(
        default="2Gi",
        description="Size of /dev/shm (a memory-backed emptyDir); "
        "DataLoader workers and NCCL need more than Docker's 64Mi.",
    )

    @field_validator("cpu")
    @classmethod
    def _cpu(cls, v: str | None) -> str | None:
        return _quantity(v, "'4' or '3500m'")

    @field_validator("memory", "shm_size")
    @classmethod
    def _mem(cls, v: str | None) -> str | None:
        return _quantity(v, "'16Gi'")


AccessMode = Literal["ReadWriteOnce", "ReadWriteMany", "ReadOnlyMany", "ReadWriteOncePod"]


def _read_write_many() -> list[AccessMode]:
    return ["ReadWriteMany"]


class StorageSpec(Section):
    mode: Literal["node-local", "pvc"] = Field(
        default="node-local",
        description="node-local: every pod stages its own copy of model and data into an emptyDir (no shared storage "
        "class needed). pvc: one PersistentVolumeClaim shared by all pods "
        "(needs ReadWriteMany for more than one node).",
    )
    size: str = Field(default="50Gi", description="Size of the PVC (pvc mode) or the emptyDir limit (node-local mode).")
    storage_class: str | None = Field(
        default=None, description="StorageClass of the PVC; default: the cluster's default class."
    )
    access_modes: list[AccessMode] = Field(default_factory=_read_write_many, description="Access modes of the PVC.")
    existing_claim: str | None = Field(
        default=None, description="Use this existing PVC instead of creating one (pvc mode)."
    )

    @field_validator("existing_claim", "storage_class")
    @classmethod
    def _names(cls, v: str | None) -> str | None:
        return _dns_subdomain(v, "PersistentVolumeClaim / StorageClass")

    @field_validator("size")
    @classmethod
    def _size(cls, v: str) -> str | None:
        return _quantity(v, "'50Gi'")


class SecretKeyRef(Section):
    name: str = Field(description="Name of the Kubernetes Secret.")
    key: str = Field(description="Key inside the Secret.")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str | None:
        return _dns_subdomain(v, "Secret")

    @field_validator("key")
    @classmethod
    def _key(cls, v: str) -> str:
        if not _SECRET_KEY.match(v):
            raise ValueError(f"{_show(v)} is not a valid Secret key: letters, digits, '-', '_' and '.'")
        return v


class SecretsSpec(Section):
    hf_token: SecretKeyRef | None = Field(
        default=None,
        description="Secret key holding the Hugging Face token; exposed to the pods as HF_TOKEN via secretKeyRef.",
    )
    s3: str | None = Field(
        default=None,
        description="Name of a Secret with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
        "(and optionally AWS_ENDPOINT_URL); "
        "exposed through envFrom.secretRef.",
    )

    mlflow: str | None = Field(
        default=None,
        description="Name of a Secret with MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD or "
        "MLFLOW_TRACKING_TOKEN (each optional); each key exposed through an optional secretKeyRef.",
    )

    @field_validator("s3", "mlflow")
    @classmethod
    def _s3(cls, v: str | None) -> str | None:
        return _dns_subdomain(v, "Secret")


class Toleration(Section):
    key: str | None = Field(default=None, description="Taint key to tolerate.")
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: str | None = Field(default=None, description="Taint value (with operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to tolerate; absent = all."
    )
    toleration_seconds: int | None = Field(
        default=None, ge=0, description="For NoExecute: how long the pod stays bound after the taint appears."
    )


class ElasticSpec(Section):
    min_nodes: int = Field(ge=1, description="Fewest nodes the job runs with (elasticPolicy.minReplicas).")
    max_nodes: int = Field(ge=1, description="Most nodes the job runs with (elasticPolicy.maxReplicas).")
    max_restarts: int = Field(
        default=3,
        ge=0,
        description="Restarts of the whole worker group that torchrun allows (elasticPolicy.maxRestarts).",
    )

    @model_validator(mode="after")
    def _order(self) -> Self:
        if self.min_nodes > self.max_nodes:
            raise ValueError("kubernetes.elastic.min_nodes must be <= max_nodes")
        return self


class KubernetesSpec(Section):
    namespace: str | None = Field(
        default=None, description="Namespace; default: the kubeconfig context's namespace (in a pod: its own)."
    )
    image: str | None = Field(
        default=None,
        description="Trainer image; default: "
        "the pinned tag that docker/Dockerfile builds (CPU or CUDA by resources.gpu).",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Image pull policy."
    )
    image_pull_secrets: list[str] = Field(
        default_factory=list, description="Names of Secrets for pulling from a private registry."
    )
    service_account: str | None = Field(default=None, description="ServiceAccount the pods run as.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels the pods must match.")
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Taints the pods tolerate (e.g. GPU nodes)."
    )
    labels: dict[str, str] = Field(default_factory=dict, description="Extra labels on every object and pod.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Extra annotations on every object and pod.")
    storage: StorageSpec = Field(default_factory=StorageSpec, description="Where model and data are staged.")
    secrets: SecretsSpec = Field(default_factory=SecretsSpec, description="Secret references (never values).")
    ttl_seconds_after_finished: int | None = Field(
        default=86400,
        ge=0,
        description="Delete the finished job (and its pods) after this many seconds; null keeps it.",
    )
    backoff_limit: int = Field(
        default=3, ge=0, description="Pod restarts before the job is marked Failed (runPolicy.backoffLimit)."
    )
    active_deadline_seconds: int | None = Field(
        default=None, ge=1, description="Kill the job after this many seconds of running."
    )
    clean_pod_policy: Literal["None", "Running", "All"] = Field(
        default="None", description="Which pods to delete when the job ends: None keeps them (logs stay readable)."
    )
    restart_policy: Literal["OnFailure", "Never", "ExitCode"] = Field(
        default="OnFailure", description="Replica restart policy; OnFailure restarts a failed pod, which then resumes."
    )
    termination_grace_period_seconds: int = Field(
        default=120,
        ge=10,
        description="Time a pod gets after SIGTERM (eviction, preemption) to finish the step and write a checkpoint.",
    )
    elastic: ElasticSpec | None = Field(
        default=None, description="Elastic training: a node range and torchrun restarts (elasticPolicy)."
    )
    tensorboard: bool = Field(
        default=False,
        description="Also render a TensorBoard Deployment + Service reading the job's event files (pvc mode).",
    )
    tensorboard_image: str = Field(
        default="tensorflow/tensorflow:2.17.0", description="Image for the TensorBoard Deployment."
    )
    master_port: int = Field(default=23456, ge=1024, le=65535, description="Rendezvous port on the master pod.")
    queue: str | None = Field(
        default=None,
        description="Kueue LocalQueue to submit to: sets the kueue.x-k8s.io/queue-name label "
        "and creates the job suspended, "
        "so that Kueue starts it when the queue admits it.",
    )
    priority_class: str | None = Field(
        default=None,
        description="PriorityClass of the pods (PyTorchJob: "
        "pod priorityClassName and runPolicy.schedulingPolicy.priorityClass).",
    )
    runtime: str = Field(
        default="torch-distributed",
        description="TrainJob target: the ClusterTrainingRuntime to run on (`kubetune runtimes` lists the cluster's).",
    )
    affinity: dict[Any, Any] | None = Field(
        default=None,
        description="Pod affinity as in a Kubernetes pod spec "
        "(nodeAffinity, podAffinity, podAntiAffinity; camelCase keys), "
        "checked against the Kubernetes typed model when rendered.",
    )
    status_interval_s: float = Field(
        default=30,
        ge=1,
        description="TrainJob target on a Kubeflow Trainer with the TrainJobStatus feature gate: rank 0 sends "
        "its progress (percentage, ETA, loss, rates, the last evaluation) to status.trainerStatus at the start, "
        "then at most once per this many seconds, and at the end.",
    )

    @field_validator("namespace")
    @classmethod
    def _ns(cls, v: str | None) -> str | None:
        if v is not None and not _DNS_LABEL.match(v):
            raise ValueError("must be a DNS label: lowercase letters, digits and '-', at most 63 characters")
        return v

    @field_validator("labels", "node_selector")
    @classmethod
    def _label_map(cls, v: dict[str, str]) -> dict[str, str]:
        return _labels(v, "label", values=True)

    @field_validator("annotations")
    @classmethod
    def _annotation_map(cls, v: dict[str, str]) -> dict[str, str]:
        return _labels(v, "annotation", values=False)

    @field_validator("service_account", "priority_class", "queue", "runtime")
    @classmethod
    def _object_names(cls, v: str | None, info: ValidationInfo) -> str | None:
        kinds = {
            "service_account": "ServiceAccount",
            "priority_class": "PriorityClass",
            "queue": "Kueue LocalQueue",
            "runtime": "ClusterTrainingRuntime",
        }
        assert info.field_name is not None  # a field's validator
        return _dns_subdomain(v, kinds[info.field_name])

    @field_validator("image_pull_secrets")
    @classmethod
    def _pull_secrets(cls, v: list[str]) -> list[str]:
        for name in v:
            _dns_subdomain(name, "Secret")
        return v


def namespace_problem(namespace: str) -> str | None:
    """Why ``namespace`` (e.g. from --namespace) is not a valid Kubernetes namespace, or None."""
    if _DNS_LABEL.match(namespace):
        return None
    return (
        f"{_show(namespace)} is not a valid namespace: "
        "a DNS label of lowercase letters, digits and '-', at most 63 characters"
    )
