"""The arguments of the SDK's ``TrainingClient.train`` translated into one kubetune job spec
(:func:`spec_from_train`, a pure function): the model, dataset and trainer parameter objects, the
storage, the resources, and the Secret references of the env lists. An argument the spec cannot
carry is refused by name, all of them in one line; a credential given as a value is refused with
the Secret reference to use instead."""

from __future__ import annotations

import re
from typing import Any

from kubetune.compat.kubeflow.errors import HF_TOKEN_FIX, S3_KEYS_FIX, Problems
from kubetune.compat.kubeflow.training_arguments import changed_fields, plain, training_arguments
from kubetune.config.tasks import default_task, entries

# kubeflow.training.constants: what train() passes when the caller gives no storage_config.
SDK_DEFAULT_STORAGE = {"size": "10Gi", "storage_class": None, "access_modes": ["ReadWriteOnce", "ReadOnlyMany"]}
# The SDK's transformer_type -> the task, and the task -> the peft TaskType a LoRA config implies:
# what each registered task declares (config.tasks.TaskEntry.auto_model / peft_task_type).
_TASKS = {entry.auto_model: name for name, entry in entries().items() if entry.auto_model}
_PEFT_TASK_TYPES = {name: entry.peft_task_type for name, entry in entries().items() if entry.peft_task_type}
_SECRET_ENV = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|ACCESS_KEY|API_KEY|PRIVATE", re.IGNORECASE)
# LoraConfig fields that describe the config rather than the adapter (peft fills them in itself).
_LORA_IGNORED = {"peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision", "inference_mode"}
# The storage_config access modes a pod can mount read-write.
_WRITABLE = {"ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod"}


def spec_from_train(
    name: str | None,
    namespace: str | None = None,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    num_workers: int = 1,
    num_procs_per_worker: int = 1,
    resources_per_worker: Any = None,
    model_provider_parameters: Any = None,
    dataset_provider_parameters: Any = None,
    trainer_parameters: Any = None,
    init_env_vars: Any = None,
    env_vars: Any = None,
    storage_config: dict | None = None,
    queue_name: str | None = None,
) -> dict:
    """Translate the arguments of the SDK's ``TrainingClient.train`` into a kubetune job spec.

    Args: those of ``kubeflow.training.TrainingClient.train`` (1.9); ``storage_config`` None means
        "not given", as does a dict equal to the SDK's default.

    Returns:
        The spec as a dict (``kubetune.config.parse_spec`` validates it; ``Client.train`` runs it).

    Raises:
        UnsupportedParameter: every argument (or field of a parameter object) the spec cannot
            carry, named in one line.
    """
    problems = Problems()
    required = (
        ("name", name),
        ("model_provider_parameters", model_provider_parameters),
        ("dataset_provider_parameters", dataset_provider_parameters),
        ("trainer_parameters", trainer_parameters),
    )
    for field, value in required:
        if not value:
            problems.add(field, "is required", "pass it as in the SDK's train()")
    problems.raise_any()

    model, task = _model(model_provider_parameters, problems)
    data, s3 = _dataset(dataset_provider_parameters, problems)
    training, output, distributed, lora = _trainer(trainer_parameters, task, problems)
    kubernetes: dict[str, Any] = {
        "namespace": namespace,
        "labels": dict(labels) if labels else None,
        "annotations": dict(annotations) if annotations else None,
        "queue": queue_name,
        "storage": _storage(storage_config, num_workers, problems),
        "secrets": _secrets(env_vars, init_env_vars, problems),
    }
    resources = _resources(resources_per_worker, problems)
    problems.raise_any()

    spec: dict[str, Any] = {"name": name, "task": task, "model": model, "data": data}
    if lora is not None:
        spec["lora"] = lora
    spec["training"] = training
    spec["distributed"] = {"nodes": num_workers, "procs_per_node": num_procs_per_worker, **distributed}
    spec["output"] = output
    if s3:
        spec["s3"] = s3
    spec["resources"] = resources
    kubernetes = {key: value for key, value in kubernetes.items() if value}  # what was given
    if kubernetes:
        spec["kubernetes"] = kubernetes
    return spec


def _sdk():
    from kubeflow.storage_initializer.hugging_face import (
        HuggingFaceDatasetParams,
        HuggingFaceModelParams,
        HuggingFaceTrainerParams,
    )
    from kubeflow.storage_initializer.s3 import S3DatasetParams

    return HuggingFaceModelParams, HuggingFaceDatasetParams, HuggingFaceTrainerParams, S3DatasetParams


def _model(params: Any, problems: Problems) -> tuple[dict, str]:
    hf_model = _sdk()[0]
    field = "model_provider_parameters"
    if not isinstance(params, hf_model):
        problems.wrong_type(field, params, "pass kubeflow.storage_initializer.hugging_face.HuggingFaceModelParams")
        return {}, default_task()
    uri = str(params.model_uri).strip()
    scheme, sep, body = uri.partition("://")
    if not sep:
        uri = f"hf://{uri}"  # the SDK downloads a bare "org/name" from the Hub (urlparse netloc + path)
    elif scheme.lower() != "hf" or not body.strip("/"):
        problems.add(
            f"{field}.model_uri",
            f"{uri!r}: the SDK's model provider reads Hugging Face Hub models only",
            "write hf://ORG/NAME (a kubetune spec's model.uri also takes s3:// and local models)",
        )
    kind = params.transformer_type
    kind_name = kind if isinstance(kind, str) else getattr(kind, "__name__", type(kind).__name__)
    task = _TASKS.get(kind_name)
    if task is None:
        tasks = " and ".join(f"{model_class} (task {name})" for model_class, name in _TASKS.items())
        problems.add(f"{field}.transformer_type", f"{kind_name} is not supported", f"kubetune fine-tunes {tasks}")
        task = default_task()
    if params.access_token:
        problems.token(f"{field}.access_token")
    if params.num_labels is not None:
        problems.add(
            f"{field}.num_labels",
            f"{params.num_labels!r} cannot be carried",
            "remove it: kubetune sizes the classification head from the labels found in the data (and saves id2label)",
        )
    return {"uri": uri}, task


def _dataset(params: Any, problems: Problems) -> tuple[dict, dict]:
    _, hf_dataset, _, s3_dataset = _sdk()
    field = "dataset_provider_parameters"
    if isinstance(params, hf_dataset):
        repo = str(params.repo_id).strip().strip("/")
        if "://" in repo or not repo or repo.count("/") > 1:
            problems.add(
                f"{field}.repo_id",
                f"{params.repo_id!r} is not a Hub dataset id",
                "write NAME or ORG/NAME, as datasets.load_dataset takes it",
            )
        if params.access_token:
            problems.token(f"{field}.access_token")
        # kubetune loads hf:// datasets with datasets.load_dataset(split=...), slices included.
        return {"train": f"hf://{repo}", "train_split": params.split or "train"}, {}
    if isinstance(params, s3_dataset):
        if params.access_key or params.secret_key:
            names = " and ".join(n for n in ("access_key", "secret_key") if getattr(params, n))
            problems.add(f"{field}.{names}", "S3 keys are never put into a job spec", S3_KEYS_FIX)
        key = str(params.file_key).lstrip("/")
        s3 = {"endpoint_url": params.endpoint_url}
        if params.region_name:
            s3["region"] = params.region_name
        return {"train": f"s3://{params.bucket_name}/{key}"}, s3
    problems.wrong_type(
        field, params, "pass HuggingFaceDatasetParams or S3DatasetParams from kubeflow.storage_initializer"
    )
    return {"train": ""}, {}


def _trainer(params: Any, task: str, problems: Problems) -> tuple[dict, dict, dict, dict | None]:
    hf_trainer = _sdk()[2]
    field = "trainer_parameters"
    if not isinstance(params, hf_trainer):
        problems.wrong_type(field, params, "pass kubeflow.storage_initializer.hugging_face.HuggingFaceTrainerParams")
        return {}, {"uri": ""}, {}, None
    training, output, distributed = training_arguments(
        params.training_parameters, f"{field}.training_parameters", problems
    )
    lora = _lora(params.lora_config, task, f"{field}.lora_config", problems)
    return training, output, distributed, lora


def _lora(config: Any, task: str, field: str, problems: Problems) -> dict | None:
    if config is None:
        return None  # a full fine-tune
    import peft

    if not isinstance(config, peft.LoraConfig):
        problems.wrong_type(field, config, "pass peft.LoraConfig, or None for a full fine-tune")
        return None
    changed = changed_fields(config, peft.LoraConfig())
    # r, alpha and dropout are carried whatever their value: peft's defaults (alpha 8, dropout 0)
    # are not kubetune's (alpha 16, dropout 0.05).
    lora: dict[str, Any] = {"r": config.r, "alpha": config.lora_alpha, "dropout": config.lora_dropout}
    handled = _LORA_IGNORED | {"r", "lora_alpha", "lora_dropout", "target_modules", "task_type", "bias"}
    targets = config.target_modules
    if isinstance(targets, str):
        if targets == "all-linear":
            lora["target_modules"] = "all-linear"
        else:
            problems.add(
                f"{field}.target_modules",
                f"{targets!r} (a regular expression) is not supported",
                "list the module names, e.g. ['query', 'value'], or 'all-linear'",
            )
    elif targets:
        lora["target_modules"] = sorted(targets)
    task_type = plain(config.task_type)
    if task_type is not None and task_type != _PEFT_TASK_TYPES.get(task):
        problems.add(
            f"{field}.task_type",
            f"{task_type!r} does not match the model's task {task}",
            f"use {_PEFT_TASK_TYPES[task]!r} or leave it unset",
        )
    if config.bias != "none":
        problems.add(
            f"{field}.bias",
            f"{config.bias!r} is not supported",
            "use bias='none' (kubetune trains no biases in the base model)",
        )
    for name in sorted(set(changed) - handled):
        problems.add(
            f"{field}.{name}",
            f"{changed[name]!r} is not supported",
            "remove it: kubetune's lora section has r, alpha, dropout, target_modules (and quantization)",
        )
    return lora


def _storage(config: dict | None, nodes: int, problems: Problems) -> dict:
    # The SDK always creates a claim, written by worker 0's init container and read by the others.
    # Without one asked for, kubetune's node-local staging needs no shared storage class at all.
    if config is None or config == SDK_DEFAULT_STORAGE:
        return {}
    field = "storage_config"
    if not isinstance(config, dict):
        problems.wrong_type(field, config, "pass a dict with size, storage_class and access_modes")
        return {}
    storage: dict[str, Any] = {"mode": "pvc"}
    for key, value in config.items():
        if key == "size" and value:
            storage["size"] = str(value)
        elif key == "storage_class":
            if value:
                storage["storage_class"] = value
        elif key == "access_modes":
            modes = list(value or [])
            # Every kubetune pod mounts the claim read-write (staging, checkpoints, the output), so
            # the SDK's ReadOnlyMany sharing cannot work; pods on several nodes need ReadWriteMany.
            if nodes > 1 and "ReadWriteMany" not in modes:
                problems.add(
                    f"{field}['access_modes']",
                    f"{modes} cannot be mounted read-write by pods on {nodes} nodes",
                    "use ['ReadWriteMany'], or leave storage_config out to stage model and data on each node",
                )
            elif not _WRITABLE & set(modes):
                problems.add(
                    f"{field}['access_modes']",
                    f"{modes} has no writable mode",
                    "use ['ReadWriteOnce'] or ['ReadWriteMany']",
                )
            else:
                storage["access_modes"] = modes
        else:
            problems.add(f"{field}[{key!r}]", "is not supported", "use size, storage_class and access_modes")
    return storage


def _resources(res: Any, problems: Problems) -> dict:
    # The SDK sets no requests or limits without resources_per_worker; neither does the spec then.
    out: dict[str, Any] = {"cpu": None, "memory": None}
    if res is None:
        return out
    field = "resources_per_worker"
    if isinstance(res, dict):
        amounts = {str(k).lower(): v for k, v in res.items()}
    elif hasattr(res, "limits") and hasattr(res, "requests"):  # kubernetes.client.V1ResourceRequirements
        if res.limits and res.requests and res.limits != res.requests:
            problems.add(field, "requests differ from limits", "kubetune sets requests = limits: give one of them")
        amounts = dict(res.limits or res.requests or {})
    else:
        problems.wrong_type(field, res, "pass a dict with cpu, memory and gpu, or a V1ResourceRequirements")
        return out
    for key, value in amounts.items():
        if key in ("cpu", "memory"):
            out[key] = str(value)
        elif key == "gpu" or key.endswith("/gpu"):
            try:
                count = int(str(value))
            except ValueError:
                problems.add(f"{field}[{key!r}]", f"{value!r} is not a whole number of GPUs", "give an integer")
                continue
            out["gpu"] = count
            if key not in ("gpu", "nvidia.com/gpu"):
                out["gpu_resource"] = key
        else:
            problems.add(
                f"{field}[{key!r}]", "is not supported", "give cpu, memory and gpu (kubetune sets requests = limits)"
            )
    return out


def _env_entries(label: str, env: Any) -> list[tuple[str, str | None, Any, Any]]:
    """(where, name, value_from, secret_ref) of each entry of an SDK env list (V1EnvVar or
    V1EnvFromSource objects) or dict (name -> value)."""
    if isinstance(env, dict):
        return [(f"{label}[{key!r}]", str(key), None, None) for key in env]
    out = []
    for index, item in enumerate(env):
        name = getattr(item, "name", None)
        where = f"{label}[{name!r}]" if name else f"{label}[{index!r}]"
        out.append((where, name, getattr(item, "value_from", None), getattr(item, "secret_ref", None)))
    return out


def _secrets(env_vars: Any, init_env_vars: Any, problems: Problems) -> dict:
    """Secret references in the SDK's env lists become the spec's kubernetes.secrets; values never do."""
    secrets: dict[str, Any] = {}

    def put(key: str, value: Any, where: str) -> None:
        if secrets.get(key, value) != value:
            problems.add(
                where,
                f"references a different Secret than another env entry ({secrets[key]!r})",
                "reference one Secret for it",
            )
        secrets[key] = value

    for label, env in (("env_vars", env_vars), ("init_env_vars", init_env_vars)):
        for where, name, value_from, secret_ref in _env_entries(label, env) if env else []:
            key_ref = getattr(value_from, "secret_key_ref", None)
            if secret_ref is not None and getattr(secret_ref, "name", None):
                put(
                    "s3", secret_ref.name, where
                )  # envFrom a Secret: the S3 keys (and endpoint), as kubetune reads them
            elif name == "HF_TOKEN" and key_ref is not None and key_ref.name and key_ref.key:
                put("hf_token", {"name": key_ref.name, "key": key_ref.key}, where)
            elif name and _SECRET_ENV.search(name) and value_from is None:
                problems.add(where, "a secret value is never put into a job spec", _secret_fix(name))
            else:
                problems.add(
                    where,
                    (
                        "is not supported: a kubetune spec carries Secret references (HF_TOKEN, envFrom one S3 "
                        "Secret), not environment variables"
                    ),
                    "remove it, or set the matching spec field (s3.endpoint_url, ...) in a kubetune spec",
                )
    return secrets


def _secret_fix(name: str) -> str:
    """The fix for the secret-looking env variable ``name`` given as a value."""
    if name == "HF_TOKEN":
        return HF_TOKEN_FIX
    return S3_KEYS_FIX if name.startswith("AWS_") else "reference a Secret instead"
