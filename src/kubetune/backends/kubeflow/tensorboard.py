"""The TensorBoard a job may have beside it (``kubernetes.tensorboard``), as pure builders: a
Deployment and a Service reading the job's event files from its workspace claim (no cluster access
here; the backend creates them owned by the job, so they go when the job goes).
"""

from __future__ import annotations

from kubernetes import client as k8s

from kubetune.artifacts.output import Output
from kubetune.backends.cluster.objects import JOB_LABEL, WORKSPACE, labels, pvc_name, serialized
from kubetune.config import JobSpec


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
    return [serialized(deployment), serialized(service)]
