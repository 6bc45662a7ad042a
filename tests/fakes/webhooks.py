"""The operators' admission rules that no CRD schema expresses, restated for tests.

No Training Operator or Trainer webhook can run on this machine. These functions restate, rule by
rule, what the upstream validating webhooks check on create, so the fake API server
(tests/fakes/kube_api.py) refuses what a real cluster refuses:

- PyTorchJob, kubeflow/training-operator v1.8.1 and v1.9.0, ``pkg/webhooks/pytorch/pytorchjob_webhook.go``
  and ``pkg/webhooks/utils``: DNS-1035 name; with an elasticPolicy, a Worker replica spec and no
  ``elasticPolicy.nProcPerNode`` together with ``spec.nprocPerNode``; replica types Master/Worker
  only; every replica has containers, each with an image, one named ``pytorch``; Master replicas
  exactly 1; Worker replicas at least 1; (v1.9.0) ``runPolicy.managedBy`` one of two controllers.
- TrainJob, kubeflow/trainer v2.3.0, ``pkg/webhooks/trainjob_webhook.go`` with the runtime's
  plugins: the referenced ClusterTrainingRuntime exists; torch plugin: ``numProcPerNode`` an int
  or auto/cpu/gpu and no torchrun-reserved PET_* env; jobset plugin: runtime patches name only
  replicated jobs and containers the runtime has, and set no env on the node/initializer
  containers (the Trainer API carries those).
- InferenceService, kserve/kserve v0.20.0, ``pkg/apis/serving/v1beta1/inference_service_validation.go``
  (the rules an InferenceService from `kubetune render --serve` can meet): the name's format; no
  ``name`` in a standard predictor (``model``); exactly one predictor implementation; not both
  ``storageUri`` and ``storageUris``; each storage URI non-empty with an absolute mount path, not
  ``/`` and without ``..``; the non-PVC mount paths share a parent below ``/``; replica bounds.

Each returns apiserver-style field errors ("spec.x: Forbidden: ..."); an empty list admits.
"""

from __future__ import annotations

import re
from typing import Any

from fakes.crds import dns1035_label_errors

PYTORCHJOB_WEBHOOK = "validator.pytorchjob.training-operator.kubeflow.org"
ISVC_WEBHOOK = "inferenceservice.kserve-webhook-server.validator"
TRAINJOB_WEBHOOK = "validator.trainjob.trainer.kubeflow.org"
_MANAGED_BY = ("kubeflow.org/training-operator", "kueue.x-k8s.io/multikueue")
_TORCHRUN_RESERVED = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
_RESERVED_CONTAINERS = ("dataset-initializer", "model-initializer", "node")


def pytorchjob_errors(job: dict, release: str) -> list[str]:
    errs = []
    name = (job.get("metadata") or {}).get("name", "")
    problems = dns1035_label_errors(name)
    if problems:
        errs.append(f'metadata.name: Invalid value: "{name}": should match: {",".join(problems)}')
    spec = job.get("spec") or {}
    run_policy = spec.get("runPolicy") or {}
    if release >= "v1.9.0" and run_policy.get("managedBy") not in (None, *_MANAGED_BY):
        errs.append(
            f'spec.runPolicy.managedBy: Unsupported value: "{run_policy["managedBy"]}": supported values: '
            + ", ".join(f'"{m}"' for m in _MANAGED_BY)
        )
    replicas = spec.get("pytorchReplicaSpecs")
    elastic = spec.get("elasticPolicy")
    if elastic is not None:
        if "Worker" not in (replicas or {}):
            errs.append(
                "spec.pytorchReplicaSpecs[Worker]: Required value: must be configured if elastic policy is used"
            )
        if elastic.get("nProcPerNode") is not None and spec.get("nprocPerNode") is not None:
            errs.append("spec.elasticPolicy.nProcPerNode: Forbidden: must not be used with spec.nprocPerNode")
    if replicas is None:
        errs.append("spec.pytorchReplicaSpecs: Required value: must be required")
    for rtype, rspec in (replicas or {}).items():
        role = f"spec.pytorchReplicaSpecs[{rtype}]"
        containers_path = f"{role}.template.spec.containers"
        if rtype not in ("Master", "Worker"):
            errs.append(f'{role}: Unsupported value: "{rtype}": supported values: "Master", "Worker"')
        containers = ((((rspec or {}).get("template") or {}).get("spec") or {}).get("containers")) or []
        if not containers:
            errs.append(f"{containers_path}: Required value: must be specified")
        for i, c in enumerate(containers):
            if not c.get("image"):
                errs.append(f"{containers_path}[{i}].image: Required value: must be required")
        if not any(c.get("name") == "pytorch" for c in containers):
            errs.append(f"{containers_path}: Required value: must have at least one container with name pytorch")
        count = (rspec or {}).get("replicas")
        if rtype == "Master" and count != 1:
            errs.append(f"{role}.replicas: Forbidden: must be 1")
        elif rtype != "Master" and count is not None and count < 1:
            errs.append(f"{role}.replicas: Forbidden: must be at least 1")
    return errs


def trainjob_errors(job: dict, runtimes: dict[str, dict]) -> list[str]:
    spec = job.get("spec") or {}
    ref = spec.get("runtimeRef") or {}
    if (
        ref.get("kind", "ClusterTrainingRuntime") != "ClusterTrainingRuntime"
        or ref.get("apiGroup", "trainer.kubeflow.org") != "trainer.kubeflow.org"
    ):
        # the fake serves cluster runtimes only; a namespaced TrainingRuntime is outside what kubetune renders
        return [f"unsupported runtime: {ref.get('kind')}.{ref.get('apiGroup')}"]
    runtime = runtimes.get(ref.get("name", ""))
    if runtime is None:
        return [
            f'spec.runtimeRef: Invalid value: {{"name":"{ref.get("name")}"}}: clustertrainingruntimes.trainer.kubeflow.org "{ref.get("name")}" not found: '
            "specified clusterTrainingRuntime must be created before the TrainJob is created"
        ]
    errs = []
    trainer = spec.get("trainer") or {}
    ml_policy = (runtime.get("spec") or {}).get("mlPolicy") or {}
    if "torch" in ml_policy and trainer.get("numProcPerNode") is not None:
        npp = trainer["numProcPerNode"]
        if isinstance(npp, str) and npp not in ("auto", "cpu", "gpu"):
            errs.append(
                f'spec.trainer.numProcPerNode: Invalid value: "{npp}": must have an int value or [auto cpu gpu]'
            )
        reserved = sorted({e.get("name") for e in trainer.get("env") or []} & set(_TORCHRUN_RESERVED))
        if reserved:
            errs.append(
                f"spec.trainer.env: Invalid value: ...: must not have reserved envs, invalid envs configured: [{' '.join(reserved)}]"
            )
    errs += _patch_errors(spec.get("runtimePatches") or [], runtime)
    return errs


def _containers_by_job(runtime: dict) -> dict[str, set[str]]:
    jobs = ((((runtime.get("spec") or {}).get("template") or {}).get("spec") or {}).get("replicatedJobs")) or []
    out: dict[str, set[str]] = {}
    for rjob in jobs:
        pod = ((((rjob.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec")) or {}
        out[rjob["name"]] = {c["name"] for c in [*(pod.get("initContainers") or []), *(pod.get("containers") or [])]}
    return out


def _patch_errors(patches: list[dict], runtime: dict) -> list[str]:
    known = _containers_by_job(runtime)
    errs: list[str] = []
    for i, patch in enumerate(patches):
        path = f"spec.runtimePatches[{i}]"
        template = (patch.get("trainingRuntimeSpec") or {}).get("template") or {}
        for j, rjob in enumerate((template.get("spec") or {}).get("replicatedJobs") or []):
            name = rjob.get("name")
            where = f"{path}.trainingRuntimeSpec.template.spec.replicatedJobs[{j}]"
            if name not in known:
                errs.append(
                    f'{where}.name: Invalid value: "{name}": must not have a replicated job that does not exist in the runtime job template'
                )
                continue
            pod: Any = (((rjob.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
            for kind in ("initContainers", "containers"):
                for c in pod.get(kind) or []:
                    if c.get("name") not in known[name]:
                        errs.append(
                            f'{where}: Invalid value: "{c.get("name")}": must not have {kind[:-1]} that does not exist in the runtime job {name}'
                        )
                    elif kind == "containers" and c.get("env") and c.get("name") in _RESERVED_CONTAINERS:
                        errs.append(
                            f"{where}: Invalid value: ...: must not have envs for the dataset-initializer, model-initializer, node containers"
                        )
    return errs


# ------------------------------------------------------------------------------------ InferenceService

_ISVC_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# The predictor's implementations (PredictorSpec); `containers` is the custom one.
_PREDICTORS = (
    "model", "sklearn", "xgboost", "tensorflow", "pytorch", "triton", "onnx", "huggingface", "pmml", "lightgbm",
    "paddle", "containers",
)  # fmt: skip


def inferenceservice_errors(isvc: dict) -> list[str]:
    """KServe v0.20.0's validating webhook on create, for the predictor (kubetune renders no transformer
    or explainer). Its errors are plain sentences (the webhook returns Go errors, not field errors)."""
    name = (isvc.get("metadata") or {}).get("name") or ""
    if not _ISVC_NAME.match(name):
        return [
            f'the InferenceService "{name}" is invalid: a InferenceService name must consist of lower case '
            "alphanumeric characters or '-', and must start with alphabetical character"
        ]
    predictor = (isvc.get("spec") or {}).get("predictor") or {}
    out = []
    low, high = predictor.get("minReplicas"), predictor.get("maxReplicas")
    if low is not None and low < 0:
        out.append("MinReplicas cannot be less than 0")
    if high is not None and high < 0:
        out.append("MaxReplicas cannot be less than 0")
    if low is not None and high and low > high:
        out.append("MinReplicas cannot be greater than MaxReplicas")
    found = [key for key in _PREDICTORS if predictor.get(key)]
    if len(found) != 1:
        out.append(
            "exactly one of [Model, SKLearn, XGBoost, Tensorflow, PyTorch, Triton, ONNX, HuggingFace, PMML, "
            f"LightGBM, Paddle, Containers] must be specified in PredictorSpec, found {found}"
        )
    model = predictor.get("model") or {}
    if model.get("name"):
        out.append("the 'name' field is not allowed in standard predictor")
    uris = predictor.get("storageUris")
    if uris is not None and model.get("storageUri") is not None:
        out.append("Setting both StorageURI and StorageURIs is not supported.")
    return out + _storage_uris_errors(uris or [])


def _storage_uris_errors(uris: list[dict]) -> list[str]:
    """validateMultipleStorageURIsSpec: each URI and mount path, then a common parent of the non-PVC paths."""
    import posixpath

    paths = []
    for entry in uris:
        path = entry.get("mountPath", "/mnt/models")  # the CRD's default
        if not entry.get("uri"):
            return ["storage URI cannot be empty"]
        if path == "/":
            return ["storage path cannot be empty"]
        if not path.startswith("/"):
            return [f"storage path must be absolute: {path}"]
        if ".." in path:
            return [f"storage path cannot contain '..' for security reasons: {path}"]
        if not entry["uri"].startswith("pvc://"):
            paths.append(path)
    if len(paths) > 1 and posixpath.commonpath(paths) == "/":
        return [
            f"storage paths must have a common parent directory. Current paths: {paths} have no common parent "
            "beyond root"
        ]
    return []
