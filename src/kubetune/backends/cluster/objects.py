"""What every object kubetune puts on a cluster agrees on (no cluster access here): the job APIs it
targets, the paths inside the pods, the container name, the labels and names by which the backend
finds a job's objects again, their metadata, and how a typed model is serialized.

The builders (``kubeflow.manifests``, ``kubeflow.tensorboard``, ``kserve.manifests``), the pre-render checks
(``kubeflow.checks``) and the cluster backends (``kubeflow.backend``, ``kserve.backend``) all import these from
here, so each is defined once; ``to_yaml`` writes the objects a render prints.
"""

from __future__ import annotations

import yaml
from kubernetes import client as k8s

from kubetune.config import JobSpec

SPEC_DIR = "/etc/kubetune"
WORKSPACE = "/workspace"
STAGE_ROOT = f"{WORKSPACE}/stage"
CONTAINER = "pytorch"  # the Training Operator requires this container name
PYTORCHJOB_API = ("kubeflow.org", "v1", "pytorchjobs")
TRAINJOB_API = ("trainer.kubeflow.org", "v1alpha1", "trainjobs")
JOB_LABEL = "kubetune.io/job"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def serialized(obj) -> dict:
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


def object_meta(spec: JobSpec, name: str, namespace: str, **extra_annotations) -> k8s.V1ObjectMeta:
    """An object's metadata: its name and namespace, the job's labels and the spec's annotations."""
    annotations = {**spec.kubernetes.annotations, **extra_annotations}
    return k8s.V1ObjectMeta(name=name, namespace=namespace, labels=labels(spec), annotations=annotations or None)


def config_map_name(spec: JobSpec) -> str:
    return f"{spec.name}-spec"


def pvc_name(spec: JobSpec) -> str:
    return spec.kubernetes.storage.existing_claim or own_claim(spec.name)


def own_claim(job: str) -> str:
    """The workspace claim kubetune creates for the job called ``job`` (pvc mode, no existing_claim)."""
    return f"{job}-workspace"


def stage_dir(spec: JobSpec) -> str:
    """Per job, so jobs sharing one claim never read each other's staged spec."""
    return f"{STAGE_ROOT}/{spec.name}"


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (the spec in the ConfigMap) as readable ``|`` blocks."""


_BlockDumper.add_representer(
    str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)
)


def to_yaml(objects: list[dict]) -> str:
    """Objects as one multi-document YAML, in their order, multi-line strings as ``|`` blocks."""
    return yaml.dump_all(objects, Dumper=_BlockDumper, sort_keys=False)
