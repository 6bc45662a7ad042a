"""Kubeflow Training SDK v1 drop-in: the SDK's ``TrainingClient().train(...)`` call runs on kubetune::

    from kubetune.compat.kubeflow import TrainingClient      # instead of kubeflow.training's
    client = TrainingClient(backend="local")                 # or "kubeflow" (the default), as the SDK
    client.train(name="fine-tune-bert", model_provider_parameters=HuggingFaceModelParams(...),
                 dataset_provider_parameters=HuggingFaceDatasetParams(...),
                 trainer_parameters=HuggingFaceTrainerParams(...), num_workers=4, num_procs_per_worker=2)
    client.wait_for_job_conditions("fine-tune-bert")
    logs, _ = client.get_job_logs("fine-tune-bert")

The SDK's own parameter objects (``HuggingFaceModelParams``, ``HuggingFaceDatasetParams``,
``S3DatasetParams``, ``HuggingFaceTrainerParams`` holding ``transformers.TrainingArguments`` and
``peft.LoraConfig``) become one kubetune job spec (:func:`spec_from_train`, a pure function), which
:class:`kubetune.client.Client` runs on this machine or submits as a PyTorchJob. An argument the spec
cannot carry is refused by name, all of them in one line (:class:`UnsupportedParameter`), never
dropped; a credential given as a value (an access token, S3 keys, a secret-looking env value) is
refused with the Secret reference to use instead, so no secret ever enters a spec, a ConfigMap or a log.

Return types and exceptions follow the SDK 1.9: ``train`` returns None, ``get_job``/``list_jobs``/
``wait_for_job_conditions`` return ``KubeflowOrgV1PyTorchJob`` objects, ``get_job_logs`` a pair of
dicts, and failures raise RuntimeError / TimeoutError / ValueError subclasses that are also
``KubetuneError`` (one line naming the field and the fix).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import time
import warnings
from typing import Any

from kubetune.backends.status import WaitTimeout
from kubetune.client import Client, KubeflowJob, LocalJob
from kubetune.errors import KubetuneError, SpecError

JOB_KIND = "PyTorchJob"
CONDITIONS = ("Created", "Running", "Restarting", "Succeeded", "Failed")
# kubeflow.training.constants: what train() passes when the caller gives no storage_config.
SDK_DEFAULT_STORAGE = {"size": "10Gi", "storage_class": None, "access_modes": ["ReadWriteOnce", "ReadOnlyMany"]}
_TASKS = {"AutoModelForSequenceClassification": "sequence-classification", "AutoModelForCausalLM": "causal-lm"}
_PEFT_TASK_TYPES = {"sequence-classification": "SEQ_CLS", "causal-lm": "CAUSAL_LM"}
_SECRET_ENV = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|ACCESS_KEY|API_KEY|PRIVATE", re.IGNORECASE)
_HF_TOKEN_FIX = (
    "create a Secret (kubectl create secret generic hf-secrets --from-env-file=.env) and pass env_vars=[V1EnvVar("
    "name='HF_TOKEN', value_from=V1EnvVarSource(secret_key_ref=V1SecretKeySelector(name='hf-secrets', "
    "key='HF_TOKEN')))] (the spec's kubernetes.secrets.hf_token); locally, export HF_TOKEN"
)
_S3_KEYS_FIX = (
    "put the keys in a Secret (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) and pass env_vars=[V1EnvFromSource("
    "secret_ref=V1SecretEnvSource(name='minio-credentials'))] (the spec's kubernetes.secrets.s3); locally, export "
    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
)

# TrainingArguments fields that only change what is displayed or logged, or that HF's Trainer itself
# does not read (do_train/do_eval/do_predict are for user scripts; local_rank is set by the launcher).
_TA_IGNORED = {
    "disable_tqdm",
    "log_level",
    "log_level_replica",
    "logging_strategy",
    "logging_first_step",
    "logging_nan_inf_filter",
    "log_on_each_node",
    "logging_dir",
    "run_name",
    "project",
    "trackio_space_id",
    "trackio_bucket_id",
    "trackio_static_space_id",
    "skip_memory_metrics",
    "include_num_input_tokens_seen",
    "do_train",
    "do_eval",
    "do_predict",
    "local_rank",
    "output_dir",
}
# LoraConfig fields that describe the config rather than the adapter (peft fills them in itself).
_LORA_IGNORED = {"peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision", "inference_mode"}


class UnsupportedParameter(KubetuneError, ValueError):
    """train() arguments that a kubetune spec cannot carry; ``problems`` holds (field, message, fix)
    for each. A ValueError, as the SDK raises for invalid parameters."""

    def __init__(self, problems: list[tuple[str, str, str]]):
        self.problems = problems
        if len(problems) == 1:
            field, message, fix = problems[0]
            super().__init__(message, field=field, fix=fix)
        else:
            super().__init__("; ".join(f"{f}: {m} — {x}" for f, m, x in problems))
            self.field = ", ".join(f for f, _, _ in problems)


class JobError(KubetuneError, RuntimeError):
    """A job could not be created, read or deleted, or it failed (RuntimeError, as in the SDK)."""


class JobTimeout(KubetuneError, TimeoutError):
    """wait_for_job_conditions ran out of time (TimeoutError, as in the SDK)."""


class _Problems:
    def __init__(self) -> None:
        self.items: list[tuple[str, str, str]] = []

    def add(self, field: str, message: str, fix: str) -> None:
        self.items.append((field, message, fix))

    def raise_any(self) -> None:
        if self.items:
            raise UnsupportedParameter(self.items)


# ---------------------------------------------------------------- translation (pure)


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
    problems = _Problems()
    missing = [
        n
        for n, v in (
            ("name", name),
            ("model_provider_parameters", model_provider_parameters),
            ("dataset_provider_parameters", dataset_provider_parameters),
            ("trainer_parameters", trainer_parameters),
        )
        if not v
    ]
    for field in missing:
        problems.add(field, "is required", "pass it as in the SDK's train()")
    problems.raise_any()

    model, task = _model(model_provider_parameters, problems)
    data, s3 = _dataset(dataset_provider_parameters, problems)
    training, output, distributed, lora = _trainer(trainer_parameters, task, problems)
    kubernetes: dict[str, Any] = {}
    if namespace:
        kubernetes["namespace"] = namespace
    if labels:
        kubernetes["labels"] = dict(labels)
    if annotations:
        kubernetes["annotations"] = dict(annotations)
    if queue_name:
        kubernetes["queue"] = queue_name
    storage = _storage(storage_config, num_workers, problems)
    if storage:
        kubernetes["storage"] = storage
    secrets = _secrets(env_vars, init_env_vars, problems)
    if secrets:
        kubernetes["secrets"] = secrets
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


def _model(params: Any, problems: _Problems) -> tuple[dict, str]:
    hf_model = _sdk()[0]
    field = "model_provider_parameters"
    if not isinstance(params, hf_model):
        problems.add(
            field,
            f"{type(params).__name__} is not supported",
            "pass kubeflow.storage_initializer.hugging_face.HuggingFaceModelParams",
        )
        return {}, "sequence-classification"
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
        problems.add(
            f"{field}.transformer_type",
            f"{kind_name} is not supported",
            (
                "kubetune fine-tunes AutoModelForSequenceClassification (task sequence-classification) and "
                "AutoModelForCausalLM (task causal-lm)"
            ),
        )
        task = "sequence-classification"
    if params.access_token:
        problems.add(f"{field}.access_token", "a token is never put into a job spec", _HF_TOKEN_FIX)
    if params.num_labels is not None:
        problems.add(
            f"{field}.num_labels",
            f"{params.num_labels!r} cannot be carried",
            "remove it: kubetune sizes the classification head from the labels found in the data (and saves id2label)",
        )
    return {"uri": uri}, task


def _dataset(params: Any, problems: _Problems) -> tuple[dict, dict]:
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
            problems.add(f"{field}.access_token", "a token is never put into a job spec", _HF_TOKEN_FIX)
        # kubetune loads hf:// datasets with datasets.load_dataset(split=...), slices included.
        return {"train": f"hf://{repo}", "train_split": params.split or "train"}, {}
    if isinstance(params, s3_dataset):
        if params.access_key or params.secret_key:
            names = " and ".join(n for n in ("access_key", "secret_key") if getattr(params, n))
            problems.add(f"{field}.{names}", "S3 keys are never put into a job spec", _S3_KEYS_FIX)
        key = str(params.file_key).lstrip("/")
        s3 = {"endpoint_url": params.endpoint_url}
        if params.region_name:
            s3["region"] = params.region_name
        return {"train": f"s3://{params.bucket_name}/{key}"}, s3
    problems.add(
        field,
        f"{type(params).__name__} is not supported",
        "pass HuggingFaceDatasetParams or S3DatasetParams from kubeflow.storage_initializer",
    )
    return {"train": ""}, {}


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def _changed(obj: Any, reference: Any) -> dict[str, Any]:
    """The init fields of a dataclass whose value differs from ``reference`` (what the user set)."""
    out = {}
    for f in dataclasses.fields(obj):
        if f.init and _plain(getattr(obj, f.name, None)) != _plain(getattr(reference, f.name, None)):
            out[f.name] = _plain(getattr(obj, f.name, None))
    return out


def _trainer(params: Any, task: str, problems: _Problems) -> tuple[dict, dict, dict, dict | None]:
    hf_trainer = _sdk()[2]
    field = "trainer_parameters"
    if not isinstance(params, hf_trainer):
        problems.add(
            field,
            f"{type(params).__name__} is not supported",
            "pass kubeflow.storage_initializer.hugging_face.HuggingFaceTrainerParams",
        )
        return {}, {"uri": ""}, {}, None
    training, output, distributed = _training_arguments(
        params.training_parameters, f"{field}.training_parameters", problems
    )
    lora = _lora(params.lora_config, task, f"{field}.lora_config", problems)
    return training, output, distributed, lora


def _training_arguments(args: Any, field: str, problems: _Problems) -> tuple[dict, dict, dict]:
    import transformers

    if not isinstance(args, transformers.TrainingArguments):
        problems.add(field, f"{type(args).__name__} is not supported", "pass transformers.TrainingArguments")
        return {}, {"uri": ""}, {}
    # What the user set = what differs from the same class built with only the same output_dir
    # (several defaults are derived from output_dir and from each other in __post_init__).
    changed = _changed(args, type(args)(output_dir=args.output_dir))
    handled = set(_TA_IGNORED)
    training: dict[str, Any] = {}
    distributed: dict[str, Any] = {}
    output: dict[str, Any] = {"uri": str(args.output_dir)}

    def refuse(name: str, fix: str, show: bool = True) -> None:
        shown = (
            f"{changed.get(name, _plain(getattr(args, name, None)))!r} is not supported" if show else "is not supported"
        )
        problems.add(f"{field}.{name}", shown, fix)

    # The recipe: carried whatever its value, HF's defaults included, so the job trains what the
    # SDK's trainer would (HF's defaults differ from kubetune's: 3 epochs, batch 8, no weight decay).
    handled |= {
        "num_train_epochs",
        "max_steps",
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "learning_rate",
        "weight_decay",
        "max_grad_norm",
        "seed",
        "warmup_steps",
        "warmup_ratio",
    }
    if args.max_steps and args.max_steps > 0:
        # HF: max_steps overrides num_train_epochs. kubetune stops at whichever comes first, and an
        # epoch is at least one optimizer step, so epochs = max_steps always reaches max_steps.
        training["epochs"] = int(args.max_steps)
        training["max_steps"] = int(args.max_steps)
    elif float(args.num_train_epochs) != int(args.num_train_epochs) or args.num_train_epochs < 1:
        refuse("num_train_epochs", "use a whole number of epochs, or max_steps")
    else:
        training["epochs"] = int(args.num_train_epochs)
    training["batch_size"] = args.per_device_train_batch_size
    training["grad_accum"] = args.gradient_accumulation_steps
    training["learning_rate"] = args.learning_rate
    training["weight_decay"] = args.weight_decay
    training["max_grad_norm"] = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
    training["seed"] = args.seed
    ratio = float(getattr(args, "warmup_ratio", 0) or 0)
    steps = args.warmup_steps or 0
    if 0 < steps < 1:  # transformers 5 takes a ratio in warmup_steps
        ratio = float(steps)
    elif steps >= 1:
        if args.max_steps and args.max_steps > 0:
            ratio = steps / args.max_steps  # kubetune warms up round(ratio × total steps) = steps
        else:
            refuse(
                "warmup_steps",
                "kubetune warms up a fraction of the steps: pass warmup_steps=0.06 (a ratio), or set max_steps",
            )
    training["warmup_ratio"] = ratio

    # Operational settings: carried when the user changed them, else kubetune's defaults hold.
    handled |= {
        "logging_steps",
        "eval_strategy",
        "evaluation_strategy",
        "eval_steps",
        "save_strategy",
        "save_steps",
        "save_total_limit",
        "per_device_eval_batch_size",
        "bf16",
        "fp16",
        "gradient_checkpointing",
        "activation_checkpointing",
        "torch_compile",
        "dataloader_num_workers",
        "optim",
        "lr_scheduler_type",
        "report_to",
        "train_sampling_strategy",
        "group_by_length",
        "ddp_backend",
        "ddp_timeout",
        "push_to_hub",
        "hub_model_id",
        "hub_private_repo",
        "hub_token",
        "overwrite_output_dir",
    }
    if "logging_steps" in changed:
        if args.logging_steps >= 1:
            training["log_every"] = int(args.logging_steps)
        else:
            refuse("logging_steps", "give a number of steps (kubetune has no fractional logging interval)")
    strategy = _plain(getattr(args, "eval_strategy", None) or getattr(args, "evaluation_strategy", None) or "no")
    if strategy == "steps":
        every = args.eval_steps or args.logging_steps
        if every >= 1:
            training["eval_every"] = int(every)
        else:
            refuse("eval_steps", "give a number of steps")
    # "no" and "epoch" need nothing: kubetune evaluates the held-out data at the end of every epoch.
    save = _plain(args.save_strategy)
    if save == "steps" and "save_steps" in changed:
        if args.save_steps >= 1:
            training["checkpoint_every"] = int(args.save_steps)
        else:
            refuse("save_steps", "give a number of steps")
    elif save not in ("steps", "no"):
        refuse(
            "save_strategy",
            "use 'steps' with save_steps (kubetune checkpoints every N steps, and always on SIGTERM), or 'no'",
        )
    if args.save_total_limit is not None:
        training["keep_checkpoints"] = args.save_total_limit
    if "per_device_eval_batch_size" in changed:
        training["eval_batch_size"] = args.per_device_eval_batch_size
    if args.bf16 or args.fp16:
        training["precision"] = "bf16" if args.bf16 else "fp16"
    # transformers 5 renamed gradient_checkpointing to activation_checkpointing; the old name mirrors it.
    if getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False):
        training["gradient_checkpointing"] = True
    if "activation_checkpointing_kwargs" in changed:
        handled.add("gradient_checkpointing_kwargs")  # the same setting under its old name: refuse it once
    if args.torch_compile:
        training["compile"] = True
        if _plain(getattr(args, "torch_compile_backend", None)) == "inductor":
            handled.add(
                "torch_compile_backend"
            )  # what torch_compile=True fills in: torch.compile's default, as kubetune's
    if "dataloader_num_workers" in changed:
        training["dataloader_workers"] = args.dataloader_num_workers
    if "optim" in changed and changed["optim"] not in ("adamw_torch", "adamw_torch_fused"):
        refuse("optim", "kubetune trains with torch's (fused) AdamW: use adamw_torch or adamw_torch_fused")
    if _plain(args.lr_scheduler_type) != "linear":
        refuse("lr_scheduler_type", "kubetune uses a linear schedule with warmup: use 'linear'")
    reporters = [
        r for r in (args.report_to if isinstance(args.report_to, list) else [args.report_to]) if r not in (None, "none")
    ]
    if any(r != "tensorboard" for r in reporters):
        refuse(
            "report_to", "kubetune writes TensorBoard events and history.jsonl: use report_to='tensorboard' or 'none'"
        )
    sampling = _plain(getattr(args, "train_sampling_strategy", "random"))
    if sampling == "group_by_length" or getattr(args, "group_by_length", False):
        training["group_by_length"] = True
    elif sampling != "random":
        refuse("train_sampling_strategy", "use 'random' or 'group_by_length'")
    if "ddp_backend" in changed:
        if changed["ddp_backend"] in ("gloo", "nccl"):
            distributed["backend"] = changed["ddp_backend"]
        else:
            refuse("ddp_backend", "use gloo or nccl")
    if "ddp_timeout" in changed:
        distributed["timeout_minutes"] = max(1, math.ceil(args.ddp_timeout / 60))
    if getattr(args, "hub_token", None):
        refuse("hub_token", _HF_TOKEN_FIX, show=False)
    if args.push_to_hub:
        if args.hub_model_id and args.hub_model_id.count("/") == 1:
            output["uri"] = f"hf://{args.hub_model_id}"  # kubetune pushes model, tokenizer and card in one commit
            if args.hub_private_repo is not None:
                output["hf_private"] = bool(args.hub_private_repo)
        else:
            refuse("hub_model_id", "with push_to_hub=True, name the repo as hub_model_id='ORG/NAME'")
    elif "hub_model_id" in changed or "hub_private_repo" in changed:
        refuse(
            "hub_model_id" if "hub_model_id" in changed else "hub_private_repo",
            "set push_to_hub=True to push, or remove it",
        )
    if getattr(args, "overwrite_output_dir", False):
        output["overwrite"] = True

    for name in sorted(set(changed) - handled):
        refuse(
            name,
            (
                "remove it (kubetune has no equivalent), or write a kubetune job spec; `kubetune explain` lists "
                "what a spec carries"
            ),
        )
    return training, output, distributed


def _lora(config: Any, task: str, field: str, problems: _Problems) -> dict | None:
    if config is None:
        return None  # a full fine-tune
    import peft

    if not isinstance(config, peft.LoraConfig):
        problems.add(
            field, f"{type(config).__name__} is not supported", "pass peft.LoraConfig, or None for a full fine-tune"
        )
        return None
    changed = _changed(config, peft.LoraConfig())
    # r, alpha and dropout are carried whatever their value: peft's defaults (alpha 8, dropout 0)
    # are not kubetune's (alpha 16, dropout 0.05).
    lora: dict[str, Any] = {"r": config.r, "alpha": config.lora_alpha, "dropout": config.lora_dropout}
    handled = set(_LORA_IGNORED) | {"r", "lora_alpha", "lora_dropout", "target_modules", "task_type", "bias"}
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
    task_type = _plain(config.task_type)
    if task_type is not None and task_type != _PEFT_TASK_TYPES[task]:
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


def _storage(config: dict | None, nodes: int, problems: _Problems) -> dict:
    # The SDK always creates a claim, written by worker 0's init container and read by the others.
    # Without one asked for, kubetune's node-local staging needs no shared storage class at all.
    if config is None or config == SDK_DEFAULT_STORAGE:
        return {}
    field = "storage_config"
    if not isinstance(config, dict):
        problems.add(
            field, f"{type(config).__name__} is not supported", "pass a dict with size, storage_class and access_modes"
        )
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
            writable = {"ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod"} & set(modes)
            if nodes > 1 and "ReadWriteMany" not in modes:
                problems.add(
                    f"{field}['access_modes']",
                    f"{modes} cannot be mounted read-write by pods on {nodes} nodes",
                    "use ['ReadWriteMany'], or leave storage_config out to stage model and data on each node",
                )
            elif not writable:
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


def _resources(res: Any, problems: _Problems) -> dict:
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
        problems.add(
            field,
            f"{type(res).__name__} is not supported",
            "pass a dict with cpu, memory and gpu, or a V1ResourceRequirements",
        )
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


def _secrets(env_vars: Any, init_env_vars: Any, problems: _Problems) -> dict:
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
        if not env:
            continue
        items = [(k, v) for k, v in env.items()] if isinstance(env, dict) else list(enumerate(env))
        for key, item in items:
            where = f"{label}[{key!r}]"
            if isinstance(env, dict):
                name, value_from, secret_ref = str(key), None, None
            else:
                name, value_from, secret_ref = (
                    getattr(item, "name", None),
                    getattr(item, "value_from", None),
                    getattr(item, "secret_ref", None),
                )
                if name:
                    where = f"{label}[{name!r}]"
            key_ref = getattr(value_from, "secret_key_ref", None)
            if secret_ref is not None and getattr(secret_ref, "name", None):
                put(
                    "s3", secret_ref.name, where
                )  # envFrom a Secret: the S3 keys (and endpoint), as kubetune reads them
            elif name == "HF_TOKEN" and key_ref is not None and key_ref.name and key_ref.key:
                put("hf_token", {"name": key_ref.name, "key": key_ref.key}, where)
            elif name and _SECRET_ENV.search(name) and value_from is None:
                problems.add(
                    where,
                    "a secret value is never put into a job spec",
                    _HF_TOKEN_FIX
                    if name == "HF_TOKEN"
                    else _S3_KEYS_FIX
                    if name.startswith("AWS_")
                    else "reference a Secret instead",
                )
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


# ---------------------------------------------------------------- the client


class TrainingClient:
    """The SDK's ``TrainingClient`` on kubetune: same constructor, ``train`` and job calls.

    Args:
        config_file: kubeconfig path (default: $KUBECONFIG, ~/.kube/config, or in-cluster).
        context: kubeconfig context.
        client_configuration: not supported (refused): kubetune connects from a kubeconfig.
        namespace: default namespace of every call; default the kubeconfig context's (the SDK's
            default is the pod's own namespace or ``default``). Ignored by the local backend.
        job_kind: ``PyTorchJob`` (the only kind kubetune runs).
        backend: ``kubeflow`` (submit a PyTorchJob, as the SDK) or ``local`` (train on this
            machine under torch elastic, same spec).

    Raises:
        UnsupportedParameter: an option kubetune cannot honour.
    """

    def __init__(
        self,
        config_file: str | None = None,
        context: str | None = None,
        client_configuration: Any = None,
        namespace: str | None = None,
        job_kind: str = JOB_KIND,
        backend: str = "kubeflow",
    ):
        problems = _Problems()
        if backend not in ("kubeflow", "local"):
            problems.add("backend", f"{backend!r} is not a backend", "use 'kubeflow' or 'local'")
        if client_configuration is not None:
            problems.add(
                "client_configuration", "is not supported", "pass config_file (a kubeconfig) and context instead"
            )
        if backend == "local":
            for name, value in (("config_file", config_file), ("context", context)):
                if value is not None:
                    problems.add(
                        name,
                        "configures a cluster connection, which backend='local' does not use",
                        "remove it, or use backend='kubeflow'",
                    )
        _check_kind(job_kind, problems)
        problems.raise_any()
        self.backend = backend
        self.namespace = namespace
        self.job_kind = JOB_KIND
        self._options = {k: v for k, v in (("kubeconfig", config_file), ("context", context)) if v is not None}
        self._clients: dict[str | None, Client] = {}
        self._jobs: dict[tuple[str | None, str], LocalJob | KubeflowJob] = {}

    # ---- train

    def train(
        self,
        name: str | None = None,
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
        *,
        overrides: list[str] | None = None,
    ) -> None:
        """Start the fine-tuning job the SDK's ``train`` describes; returns None, as the SDK.

        Args: those of the SDK's ``train`` (see :func:`spec_from_train`), plus the keyword-only
            kubetune extension ``overrides``: ``KEY=VALUE`` strings applied to the translated spec
            as ``kubetune run --set`` (e.g. ``["data.max_length=256"]``).

        Raises:
            UnsupportedParameter: an argument the spec cannot carry (before anything starts).
            JobError: the job could not be started (it exists, the cluster refused it, ...).
        """
        ns = self._namespace(namespace)
        problems = _Problems()
        if self.backend == "local" and num_workers != 1:
            problems.add(
                "num_workers",
                f"{num_workers} nodes cannot run on one machine",
                (
                    "use num_workers=1 with backend='local' (num_procs_per_worker sets the processes), or "
                    "backend='kubeflow'"
                ),
            )
        problems.raise_any()
        spec = spec_from_train(
            name,
            namespace=ns,
            labels=labels,
            annotations=annotations,
            num_workers=num_workers,
            num_procs_per_worker=num_procs_per_worker,
            resources_per_worker=resources_per_worker,
            model_provider_parameters=model_provider_parameters,
            dataset_provider_parameters=dataset_provider_parameters,
            trainer_parameters=trainer_parameters,
            init_env_vars=init_env_vars,
            env_vars=env_vars,
            storage_config=storage_config,
            queue_name=queue_name,
        )
        job_spec = _validate(spec, overrides)
        if self.backend == "kubeflow":
            from kubetune.backends.manifests import warnings_for

            for line in warnings_for(job_spec):
                warnings.warn(line, UserWarning, stacklevel=2)
        try:
            handle = self._client(ns).train(job_spec)  # validated above, overrides applied
        except KubetuneError as e:
            raise _job_error(e) from None
        self._jobs[(ns, job_spec.name)] = handle

    def kubetune_job(self, name: str, namespace: str | None = None) -> LocalJob | KubeflowJob:
        """kubetune's own handle on a job (``status()``, ``wait()``, ``logs()``, ``output``).

        Raises:
            JobError: no such job.
        """
        ns = self._namespace(namespace)
        handle = self._jobs.get((ns, name))
        if handle is None:
            try:
                handle = self._client(ns).get(name)
            except KubetuneError as e:
                raise _job_error(e) from None
        return handle

    def create_job(self, *args: Any, **kwargs: Any) -> None:
        """Not supported: the SDK's ``create_job`` runs arbitrary images and functions.

        Raises:
            UnsupportedParameter: always.
        """
        raise UnsupportedParameter(
            [
                (
                    "create_job",
                    "is not supported: kubetune runs fine-tuning job specs, not arbitrary images or functions",
                    "use train(...), or a kubetune job spec with kubetune.Client",
                )
            ]
        )

    # ---- jobs

    def get_job(self, name: str, namespace: str | None = None, job_kind: str | None = None, timeout: int = 120) -> Any:
        """The job as the SDK's ``KubeflowOrgV1PyTorchJob`` (``metadata``, ``status.conditions``;
        for a local run ``spec`` is None).

        Raises:
            JobError: no such job, or the cluster could not be read (a RuntimeError).
        """
        _raise_kind(job_kind)
        handle = self.kubetune_job(name, namespace)
        try:
            if isinstance(handle, LocalJob):
                return _job_model(_local_object(handle))
            return _job_model(handle.backend.get(name))
        except KubetuneError as e:
            raise _job_error(e) from None

    def list_jobs(self, namespace: str | None = None, job_kind: str | None = None, timeout: int = 120) -> list[Any]:
        """The jobs kubetune started, as ``KubeflowOrgV1PyTorchJob`` objects: on the cluster, every
        kubetune PyTorchJob of the namespace; locally, the runs started from this Python process.

        Raises:
            JobError: the cluster could not be read.
        """
        _raise_kind(job_kind)
        ns = self._namespace(namespace)
        client = self._client(ns)
        out = []
        try:
            names = [row["name"] for row in client.list()]
        except KubetuneError as e:
            raise _job_error(e) from None
        for name in names:
            try:
                out.append(self.get_job(name, namespace))
            except JobError:
                continue  # deleted between the list and the read
        return out

    def get_job_conditions(
        self,
        name: str | None = None,
        namespace: str | None = None,
        job_kind: str | None = None,
        job: Any = None,
        timeout: int = 120,
    ) -> list[Any]:
        """The job's conditions (``KubeflowOrgV1JobCondition``), as the SDK returns them."""
        if job is None:
            if name is None:
                raise UnsupportedParameter(
                    [("name", "is required when job is not given", "pass the job name or a job object")]
                )
            job = self.get_job(name, namespace, job_kind)
        return list((job.status.conditions if job.status else None) or [])

    def is_job_created(
        self,
        name: str | None = None,
        namespace: str | None = None,
        job_kind: str | None = None,
        job: Any = None,
        timeout: int = 120,
    ) -> bool:
        return _has(self.get_job_conditions(name, namespace, job_kind, job), "Created")

    def is_job_running(
        self,
        name: str | None = None,
        namespace: str | None = None,
        job_kind: str | None = None,
        job: Any = None,
        timeout: int = 120,
    ) -> bool:
        return _has(self.get_job_conditions(name, namespace, job_kind, job), "Running")

    def is_job_restarting(
        self,
        name: str | None = None,
        namespace: str | None = None,
        job_kind: str | None = None,
        job: Any = None,
        timeout: int = 120,
    ) -> bool:
        return _has(self.get_job_conditions(name, namespace, job_kind, job), "Restarting")

    def is_job_succeeded(
        self,
        name: str | None = None,
        namespace: str | None = None,
        job_kind: str | None = None,
        job: Any = None,
        timeout: int = 120,
    ) -> bool:
        return _has(self.get_job_conditions(name, namespace, job_kind, job), "Succeeded")

    def is_job_failed(
        self,
        name: str | None = None,
        namespace: str | None = None,
        job_kind: str | None = None,
        job: Any = None,
        timeout: int = 120,
    ) -> bool:
        return _has(self.get_job_conditions(name, namespace, job_kind, job), "Failed")

    def wait_for_job_conditions(
        self,
        name: str,
        namespace: str | None = None,
        job_kind: str | None = None,
        expected_conditions: set[str] = frozenset({"Succeeded"}),
        wait_timeout: int = 600,
        polling_interval: int = 15,
        callback: Any = None,
        timeout: int = 120,
    ) -> Any:
        """Wait until the job has one of ``expected_conditions``; returns the job object.

        Between polls it waits on kubetune's handle (a watch on the cluster, the process locally),
        so a job that ends is seen at once rather than at the next ``polling_interval``.

        Raises:
            ValueError: ``expected_conditions`` names an unknown condition.
            JobError: the job failed while Failed is not expected (a RuntimeError, with the reason).
            JobTimeout: ``wait_timeout`` passed, or the job ended without reaching them (a TimeoutError).
        """
        expected = set(expected_conditions)
        if not expected <= set(CONDITIONS):
            raise UnsupportedParameter(
                [
                    (
                        "expected_conditions",
                        f"{sorted(expected - set(CONDITIONS))} are not job conditions",
                        f"use a subset of {list(CONDITIONS)}",
                    )
                ]
            )
        handle = self.kubetune_job(name, namespace)
        deadline = time.monotonic() + wait_timeout
        while True:
            job = self.get_job(name, namespace, job_kind)
            conditions = self.get_job_conditions(job=job)
            if callback:
                callback(job)
            if "Failed" not in expected and _has(conditions, "Failed"):
                failed = next(c for c in conditions if c.type == "Failed")
                raise JobError(
                    f"{JOB_KIND} {name} is Failed: {failed.reason or ''} {failed.message or ''}".strip(),
                    fix="see get_job_logs(name) or `kubetune status`",
                )
            if any(_has(conditions, c) for c in expected):
                return job
            if _has(conditions, "Succeeded"):
                # A finished job's conditions no longer change: waiting longer cannot help.
                raise JobTimeout(f"{JOB_KIND} {name} ended Succeeded without reaching {sorted(expected)}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise JobTimeout(
                    f"timeout waiting for {JOB_KIND} {name} to reach {sorted(expected)} ({wait_timeout} s)",
                    fix="wait longer (wait_timeout=...)",
                )
            try:
                handle.wait(min(polling_interval, remaining))
            except WaitTimeout:
                pass
            except KubetuneError as e:  # e.g. deleted while waiting
                raise _job_error(e) from None

    def get_job_logs(
        self,
        name: str,
        namespace: str | None = None,
        job_kind: str | None = None,
        is_master: bool = True,
        replica_type: str | None = None,
        replica_index: int | None = None,
        follow: bool = False,
        timeout: int = 120,
        verbose: bool = False,
    ) -> tuple[dict[str, str], dict[str, list[str]]]:
        """The logs of the job's pods as ``({pod name: log text}, {})``, as the SDK returns them.

        A local run is one "pod" named ``NAME-master-0`` holding every process's lines (each
        ``[rank N]``). ``follow`` prints ``[Pod NAME]: line`` as lines arrive, until the job ends.

        Raises:
            UnsupportedParameter: ``verbose`` (Kubernetes events), or an unknown replica type.
            JobError: the job or its logs could not be read.
        """
        _raise_kind(job_kind)
        if verbose:
            raise UnsupportedParameter(
                [
                    (
                        "verbose",
                        "Kubernetes events are not collected",
                        "kubetune_job(name).status() gives the phase, each pod's failure reason and a log tail",
                    )
                ]
            )
        if replica_type is not None and replica_type.lower() not in ("master", "worker"):
            raise UnsupportedParameter(
                [("replica_type", f"{replica_type!r} is not a PyTorchJob replica type", "use 'master' or 'worker'")]
            )
        handle = self.kubetune_job(name, namespace)

        def wanted(pod: str) -> bool:
            m = re.search(r"-(master|worker)-(\d+)$", pod)
            kind, index = (m.group(1), int(m.group(2))) if m else ("", -1)
            return (
                (not is_master or kind == "master")
                and (replica_type is None or kind == replica_type.lower())
                and (replica_index is None or index == replica_index)
            )

        logs: dict[str, list[str]] = {}
        try:
            if isinstance(handle, LocalJob):
                pod = f"{name}-master-0"
                if wanted(pod):
                    for line in handle.logs(follow=follow):
                        _collect(logs, pod, line, follow)
            else:
                pods = {p.node_rank: p.name for p in handle.status().pods if p.phase != "Pending" and wanted(p.name)}
                if len(pods) == 1:
                    stream = handle.logs(follow=follow, rank=next(iter(pods)))
                else:
                    stream = handle.logs(follow=follow, all_ranks=True) if pods else iter(())
                for line in stream:
                    # kubetune prefixes every line with its pod's node rank; the SDK keys by pod name.
                    m = re.match(r"\[node (\d+)\] ?(.*)$", line, re.DOTALL)
                    if m and int(m.group(1)) in pods:
                        _collect(logs, pods[int(m.group(1))], m.group(2), follow)
        except KubetuneError as e:
            raise _job_error(e) from None
        return {pod: "\n".join(lines) + "\n" for pod, lines in logs.items()}, {}

    def delete_job(
        self, name: str, namespace: str | None = None, job_kind: str | None = None, delete_options: Any = None
    ) -> None:
        """Delete the job (a local run is stopped: SIGTERM, so it writes a checkpoint). On the
        cluster the workspace claim with the output stays (``kubetune delete --delete-storage``).

        Raises:
            UnsupportedParameter: ``delete_options`` given.
            JobError: no such job, or the cluster refused.
        """
        _raise_kind(job_kind)
        if delete_options is not None:
            raise UnsupportedParameter(
                [
                    (
                        "delete_options",
                        "is not supported",
                        "remove it: kubetune deletes in the background with the job's owned objects",
                    )
                ]
            )
        ns = self._namespace(namespace)
        handle = self.kubetune_job(name, namespace)
        try:
            handle.delete()
        except KubetuneError as e:
            raise _job_error(e) from None
        self._jobs.pop((ns, name), None)

    # ---- helpers

    def _namespace(self, namespace: str | None) -> str | None:
        return None if self.backend == "local" else namespace or self.namespace

    def _client(self, namespace: str | None) -> Client:
        if namespace not in self._clients:
            if self.backend == "local":
                self._clients[namespace] = Client("local")
            else:
                extra = {"namespace": namespace} if namespace else {}
                self._clients[namespace] = Client("kubeflow", **self._options, **extra)
        return self._clients[namespace]


def _check_kind(job_kind: str | None, problems: _Problems) -> None:
    if job_kind is not None and job_kind != JOB_KIND:
        problems.add(
            "job_kind", f"{job_kind!r} is not supported", "use 'PyTorchJob': kubetune runs fine-tuning as PyTorchJobs"
        )


def _raise_kind(job_kind: str | None) -> None:
    problems = _Problems()
    _check_kind(job_kind, problems)
    problems.raise_any()


def _validate(spec: dict, overrides: list[str] | None):
    from kubetune.config import parse_spec

    try:
        return parse_spec(spec, overrides, source="train()")
    except SpecError as e:
        # One line for a notebook's traceback, every problem named (SpecError's str is a count).
        raise UnsupportedParameter(
            [("train()", "; ".join(e.lines()), "fix the arguments (or overrides) named")]
        ) from None


def _job_error(e: KubetuneError) -> JobError:
    """kubetune's error as the RuntimeError the SDK raises there: same line, same field and fix."""
    err = JobError(str(e))
    err.field, err.fix = e.field, e.fix
    return err


def _collect(logs: dict[str, list[str]], pod: str, line: str, follow: bool) -> None:
    if follow:
        print(f"[Pod {pod}]: {line}", flush=True)  # what the SDK prints while following
    logs.setdefault(pod, []).append(line)


def _has(conditions: list[Any], kind: str) -> bool:
    return any(c.type == kind and c.status == "True" for c in conditions)


def _local_object(job: LocalJob) -> dict:
    """A local run as a PyTorchJob object: Created, then Running, then Succeeded or Failed."""
    status = job.status()
    conditions = [{"type": "Created", "status": "True", "reason": "LocalRunCreated", "lastTransitionTime": job.created}]
    running = status.phase == "Running"
    conditions.append({"type": "Running", "status": str(running), "reason": "LocalRunRunning"})
    if not running:
        conditions.append(
            {
                "type": status.phase,
                "status": "True",
                "reason": status.reason or f"LocalRun{status.phase}",
                "message": status.message,
            }
        )
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": JOB_KIND,
        "metadata": {"name": job.name, "creationTimestamp": job.created},
        "status": {"conditions": conditions, "startTime": job.created},
    }


def _job_model(obj: dict) -> Any:
    from kubeflow.training.api_client import ApiClient
    from kubeflow.training.utils.utils import FakeResponse

    return ApiClient().deserialize(FakeResponse(obj), "KubeflowOrgV1PyTorchJob")
