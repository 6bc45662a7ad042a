"""kubetune.compat.kubeflow: the Kubeflow Training SDK v1 train() call translated into a kubetune
spec (table-driven), every refused argument one line naming it, no secret ever in a spec or an
error, and the SDK-shaped answers of the job calls on the local backend (a small script stands in
for `kubetune run`, as in test_client_api.py; the real run is tests/integration/test_seed004.py)."""

from __future__ import annotations

import sys

import pytest
import transformers
import yaml
from conftest import seed004_call as seed_call
from kubeflow.storage_initializer.hugging_face import (
    HuggingFaceDatasetParams,
    HuggingFaceModelParams,
    HuggingFaceTrainerParams,
)
from kubeflow.storage_initializer.s3 import S3DatasetParams
from kubeflow.training.models import KubeflowOrgV1PyTorchJob
from kubernetes.client import (
    V1EnvFromSource,
    V1EnvVar,
    V1EnvVarSource,
    V1ResourceRequirements,
    V1SecretEnvSource,
    V1SecretKeySelector,
)
from peft import LoraConfig

from kubetune.backends.local import runs as client_mod
from kubetune.compat.kubeflow import (
    JobError,
    JobTimeout,
    TrainingClient,
    UnsupportedParameter,
    spec_from_train,
)
from kubetune.config import parse_spec
from kubetune.errors import KubetuneError

CLS = transformers.AutoModelForSequenceClassification
TOKEN = "hf_canaryTOKEN0123456789"  # must never appear in a spec or an error
S3_SECRET = "canary-secret-key-9876"


def _args(**kw) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(output_dir=kw.pop("output_dir", "test_trainer"), **kw)


_SEED_LORA = object()


def _trainer(lora=_SEED_LORA, after: dict | None = None, **args) -> HuggingFaceTrainerParams:
    """``after``: fields set once built, e.g. bf16, which TrainingArguments refuses on a machine without bf16 support."""
    if lora is _SEED_LORA:
        lora = LoraConfig(r=8, lora_alpha=8, lora_dropout=0.1)
    training = _args(**args)
    for key, value in (after or {}).items():
        setattr(training, key, value)
    return HuggingFaceTrainerParams(training_parameters=training, lora_config=lora)


SEED_SPEC = {
    "name": "fine-tune-bert",
    "task": "sequence-classification",
    "model": {"uri": "hf://google-bert/bert-base-cased"},
    "data": {"train": "hf://yelp_review_full", "train_split": "train[:3000]"},
    "lora": {"r": 8, "alpha": 8, "dropout": 0.1},
    # HF's defaults are carried (3 epochs, batch 8, no weight decay): the job trains what the SDK's would.
    "training": {
        "epochs": 3,
        "batch_size": 8,
        "grad_accum": 1,
        "learning_rate": 5e-5,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "seed": 42,
        "warmup_ratio": 0.0,
    },
    "distributed": {"nodes": 4, "procs_per_node": 2},
    "output": {"uri": "test_trainer"},
    "resources": {"cpu": "5", "memory": "10G", "gpu": 2},
}


def test_seed_call_translates_to_the_expected_spec():
    spec = spec_from_train(**seed_call())
    assert spec == SEED_SPEC
    job = parse_spec(spec)
    assert (job.distributed.nodes, job.distributed.procs_per_node, job.resources.gpu) == (4, 2, 2)
    assert job.kubernetes.storage.mode == "node-local"  # the SDK's default storage_config: no claim needed


@pytest.mark.parametrize(
    ("over", "section", "expected"),
    [
        (
            {"trainer_parameters": _trainer(max_steps=6, num_train_epochs=1.5)},
            "training",
            {"epochs": 6, "max_steps": 6},
        ),  # max_steps overrides epochs, as in HF
        (
            {
                "trainer_parameters": _trainer(
                    logging_steps=2, eval_strategy="steps", eval_steps=5, save_steps=50, save_total_limit=3
                )
            },
            "training",
            {"log_every": 2, "eval_every": 5, "checkpoint_every": 50, "keep_checkpoints": 3},
        ),
        (
            {
                "trainer_parameters": _trainer(
                    warmup_steps=0.06,
                    per_device_train_batch_size=4,
                    gradient_accumulation_steps=2,
                    learning_rate=2e-4,
                    weight_decay=0.01,
                    seed=7,
                    per_device_eval_batch_size=32,
                )
            },
            "training",
            {
                "warmup_ratio": 0.06,
                "batch_size": 4,
                "grad_accum": 2,
                "learning_rate": 2e-4,
                "weight_decay": 0.01,
                "seed": 7,
                "eval_batch_size": 32,
            },
        ),
        ({"trainer_parameters": _trainer(warmup_steps=10, max_steps=100)}, "training", {"warmup_ratio": 0.1}),
        (
            {
                "trainer_parameters": _trainer(
                    after={"bf16": True},
                    activation_checkpointing=True,
                    torch_compile=True,
                    max_grad_norm=0.0,
                    dataloader_num_workers=2,
                    report_to="tensorboard",
                    optim="adamw_torch",
                )
            },
            "training",
            {
                "precision": "bf16",
                "gradient_checkpointing": True,
                "compile": True,
                "max_grad_norm": None,
                "dataloader_workers": 2,
            },
        ),
        (
            {"trainer_parameters": _trainer(num_train_epochs=2, train_sampling_strategy="group_by_length")},
            "training",
            {"epochs": 2, "group_by_length": True},
        ),
        (
            {"trainer_parameters": _trainer(after={"ddp_backend": "gloo"}, ddp_timeout=600)},
            "distributed",
            {"backend": "gloo", "timeout_minutes": 10},
        ),
        (
            {"trainer_parameters": _trainer(push_to_hub=True, hub_model_id="acme/bert-yelp", hub_private_repo=False)},
            "output",
            {"uri": "hf://acme/bert-yelp", "hf_private": False},
        ),
        ({"trainer_parameters": _trainer(output_dir="s3://runs/bert")}, "output", {"uri": "s3://runs/bert"}),
        (
            {
                "trainer_parameters": _trainer(
                    lora=LoraConfig(r=16, lora_alpha=32, target_modules=["query", "value"], task_type="SEQ_CLS")
                )
            },
            "lora",
            {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": ["query", "value"]},
        ),
        ({"trainer_parameters": _trainer(lora=None)}, "lora", None),  # no LoRA: a full fine-tune
        (
            {
                "model_provider_parameters": HuggingFaceModelParams(
                    model_uri="TinyLlama/TinyLlama-1.1B-Chat-v1.0", transformer_type=transformers.AutoModelForCausalLM
                ),
                "trainer_parameters": _trainer(lora=LoraConfig(target_modules="all-linear", task_type="CAUSAL_LM")),
            },
            "model",
            {"uri": "hf://TinyLlama/TinyLlama-1.1B-Chat-v1.0"},
        ),
        (
            {"dataset_provider_parameters": HuggingFaceDatasetParams(repo_id="acme/reviews")},
            "data",
            {"train": "hf://acme/reviews", "train_split": "train"},
        ),
        (
            {
                "dataset_provider_parameters": S3DatasetParams(
                    endpoint_url="http://minio.minio.svc:9000",
                    bucket_name="kubeflow-examples",
                    file_key="datasets/yelp.csv",
                    region_name="eu-west-1",
                )
            },
            "s3",
            {"endpoint_url": "http://minio.minio.svc:9000", "region": "eu-west-1"},
        ),
        (
            {
                "dataset_provider_parameters": S3DatasetParams(
                    endpoint_url="http://minio.minio.svc:9000",
                    bucket_name="kubeflow-examples",
                    file_key="/datasets/yelp.csv",
                )
            },
            "data",
            {"train": "s3://kubeflow-examples/datasets/yelp.csv"},
        ),
        ({"resources_per_worker": None}, "resources", {"cpu": None, "memory": None}),  # the SDK sets no requests either
        (
            {"resources_per_worker": V1ResourceRequirements(limits={"cpu": "8", "memory": "32Gi", "amd.com/gpu": "1"})},
            "resources",
            {"cpu": "8", "memory": "32Gi", "gpu": 1, "gpu_resource": "amd.com/gpu"},
        ),
        (
            {
                "storage_config": {
                    "size": "20Gi",
                    "storage_class": "openebs-hostpath",
                    "access_modes": ["ReadWriteMany"],
                }
            },
            "kubernetes",
            {
                "storage": {
                    "mode": "pvc",
                    "size": "20Gi",
                    "storage_class": "openebs-hostpath",
                    "access_modes": ["ReadWriteMany"],
                }
            },
        ),
        (
            {
                "storage_config": {
                    "size": "10Gi",
                    "storage_class": None,
                    "access_modes": ["ReadWriteOnce", "ReadOnlyMany"],
                }
            },
            "kubernetes",
            None,
        ),
        (
            {
                "namespace": "kubeflow",
                "labels": {"team": "nlp"},
                "annotations": {"note": "seed"},
                "queue_name": "gpu-queue",
                "env_vars": [
                    V1EnvVar(
                        name="HF_TOKEN",
                        value_from=V1EnvVarSource(
                            secret_key_ref=V1SecretKeySelector(name="hf-secrets", key="HF_TOKEN")
                        ),
                    )
                ],
                "init_env_vars": [V1EnvFromSource(secret_ref=V1SecretEnvSource(name="minio-credentials"))],
            },
            "kubernetes",
            {
                "namespace": "kubeflow",
                "labels": {"team": "nlp"},
                "annotations": {"note": "seed"},
                "queue": "gpu-queue",
                "secrets": {"hf_token": {"name": "hf-secrets", "key": "HF_TOKEN"}, "s3": "minio-credentials"},
            },
        ),
    ],
)
def test_translation_table(over, section, expected):
    spec = spec_from_train(**seed_call(**over))
    got = spec.get(section)
    if isinstance(expected, dict) and isinstance(got, dict):
        got = {k: got.get(k, "<absent>") for k in expected}
    assert got == expected
    parse_spec(spec)  # every translated spec is a valid kubetune spec


def test_causal_lm_task():
    spec = spec_from_train(
        **seed_call(
            model_provider_parameters=HuggingFaceModelParams(
                model_uri="hf://TinyLlama/TinyLlama-1.1B-Chat-v1.0", transformer_type=transformers.AutoModelForCausalLM
            ),
            trainer_parameters=_trainer(lora=LoraConfig(target_modules="all-linear")),
        )
    )
    assert spec["task"] == "causal-lm" and spec["lora"]["target_modules"] == "all-linear"


REFUSED = [
    (
        {
            "model_provider_parameters": HuggingFaceModelParams(
                model_uri="hf://meta-llama/Llama-3.2-1B", transformer_type=CLS, access_token=TOKEN
            )
        },
        "model_provider_parameters.access_token",
        "kubernetes.secrets.hf_token",
    ),
    (
        {"dataset_provider_parameters": HuggingFaceDatasetParams(repo_id="yelp_review_full", access_token=TOKEN)},
        "dataset_provider_parameters.access_token",
        "HF_TOKEN",
    ),
    (
        {
            "dataset_provider_parameters": S3DatasetParams(
                endpoint_url="http://minio:9000",
                bucket_name="b",
                file_key="k.csv",
                access_key="AKIAX",
                secret_key=S3_SECRET,
            )
        },
        "dataset_provider_parameters.access_key and secret_key",
        "kubernetes.secrets.s3",
    ),
    (
        {
            "model_provider_parameters": HuggingFaceModelParams(
                model_uri="hf://dslim/bert-base-NER", transformer_type=transformers.AutoModelForTokenClassification
            )
        },
        "model_provider_parameters.transformer_type",
        "AutoModelForTokenClassification is not supported",
    ),
    (
        {"model_provider_parameters": HuggingFaceModelParams(model_uri="s3://bucket/model", transformer_type=CLS)},
        "model_provider_parameters.model_uri",
        "hf://ORG/NAME",
    ),
    (
        {
            "model_provider_parameters": HuggingFaceModelParams(
                model_uri="hf://google-bert/bert-base-cased", transformer_type=CLS, num_labels=5
            )
        },
        "model_provider_parameters.num_labels",
        "labels found in the data",
    ),
    (
        {"trainer_parameters": _trainer(adam_beta1=0.8)},
        "trainer_parameters.training_parameters.adam_beta1",
        "0.8 is not supported",
    ),
    ({"trainer_parameters": _trainer(optim="adafactor")}, "trainer_parameters.training_parameters.optim", "sgd"),
    (
        {"trainer_parameters": _trainer(lr_scheduler_type="polynomial")},
        "trainer_parameters.training_parameters.lr_scheduler_type",
        "'cosine'",
    ),
    (
        {"trainer_parameters": _trainer(report_to="wandb")},
        "trainer_parameters.training_parameters.report_to",
        "tensorboard",
    ),
    ({"trainer_parameters": _trainer(hub_token=TOKEN)}, "trainer_parameters.training_parameters.hub_token", "Secret"),
    (
        {"trainer_parameters": _trainer(num_train_epochs=1.5)},
        "trainer_parameters.training_parameters.num_train_epochs",
        "whole number",
    ),
    (
        {"trainer_parameters": _trainer(warmup_steps=100)},
        "trainer_parameters.training_parameters.warmup_steps",
        "ratio",
    ),
    (
        {"trainer_parameters": _trainer(save_strategy="epoch")},
        "trainer_parameters.training_parameters.save_strategy",
        "save_steps",
    ),
    (
        {"trainer_parameters": _trainer(label_smoothing_factor=0.1)},
        "trainer_parameters.training_parameters.label_smoothing_factor",
        "no equivalent",
    ),
    (
        {"trainer_parameters": _trainer(lora=LoraConfig(use_dora=True))},
        "trainer_parameters.lora_config.use_dora",
        "True is not supported",
    ),
    (
        {"trainer_parameters": _trainer(lora=LoraConfig(bias="all"))},
        "trainer_parameters.lora_config.bias",
        "bias='none'",
    ),
    (
        {"trainer_parameters": _trainer(lora=LoraConfig(task_type="CAUSAL_LM"))},
        "trainer_parameters.lora_config.task_type",
        "SEQ_CLS",
    ),
    (
        {"trainer_parameters": _trainer(lora=LoraConfig(target_modules=r".*\.query"))},
        "trainer_parameters.lora_config.target_modules",
        "regular expression",
    ),
    (
        {"storage_config": {"size": "10Gi", "access_modes": ["ReadWriteOnce", "ReadOnlyMany"]}},
        "storage_config['access_modes']",
        "ReadWriteMany",
    ),
    (
        {"storage_config": {"size": "10Gi", "volume_mode": "Block"}},
        "storage_config['volume_mode']",
        "size, storage_class and access_modes",
    ),
    (
        {"resources_per_worker": {"cpu": 2, "ephemeral-storage": "50Gi"}},
        "resources_per_worker['ephemeral-storage']",
        "cpu, memory and gpu",
    ),
    ({"resources_per_worker": {"gpu": "two"}}, "resources_per_worker['gpu']", "whole number"),
    ({"env_vars": {"HF_TOKEN": TOKEN}}, "env_vars['HF_TOKEN']", "secret_key_ref"),
    (
        {"env_vars": [V1EnvVar(name="AWS_SECRET_ACCESS_KEY", value=S3_SECRET)]},
        "env_vars['AWS_SECRET_ACCESS_KEY']",
        "V1EnvFromSource",
    ),
    (
        {"init_env_vars": {"HTTP_PROXY": "http://proxy:3128"}},
        "init_env_vars['HTTP_PROXY']",
        "not environment variables",
    ),
    ({"model_provider_parameters": None}, "model_provider_parameters", "is required"),
    ({"dataset_provider_parameters": "yelp_review_full"}, "dataset_provider_parameters", "S3DatasetParams"),
]


@pytest.mark.parametrize(("over", "field", "says"), REFUSED, ids=[r[1] for r in REFUSED])
def test_refused_arguments_are_one_line_naming_the_parameter(over, field, says):
    with pytest.raises(UnsupportedParameter) as err:
        spec_from_train(**seed_call(**over))
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith(f"{field}: ") and says in text, text
    assert err.value.field == field
    assert TOKEN not in text and S3_SECRET not in text
    assert isinstance(err.value, ValueError) and isinstance(err.value, KubetuneError)


def test_several_refusals_are_named_together_in_one_line():
    with pytest.raises(UnsupportedParameter) as err:
        spec_from_train(
            **seed_call(
                trainer_parameters=_trainer(adam_beta1=0.8, optim="adafactor", lora=LoraConfig(use_rslora=True))
            )
        )
    text = str(err.value)
    assert "\n" not in text
    for field in ("training_parameters.adam_beta1", "training_parameters.optim", "lora_config.use_rslora"):
        assert f"trainer_parameters.{field}: " in text
    assert len(err.value.problems) == 3


def test_secrets_are_references_never_values():
    spec = spec_from_train(
        **seed_call(
            env_vars=[
                V1EnvVar(
                    name="HF_TOKEN",
                    value_from=V1EnvVarSource(secret_key_ref=V1SecretKeySelector(name="hf-secrets", key="HF_TOKEN")),
                )
            ],
            dataset_provider_parameters=S3DatasetParams(
                endpoint_url="http://minio.minio.svc:9000", bucket_name="kubeflow-examples", file_key="d.csv"
            ),
            init_env_vars=[V1EnvFromSource(secret_ref=V1SecretEnvSource(name="minio-credentials"))],
        )
    )
    dumped = yaml.safe_dump(spec)
    assert spec["kubernetes"]["secrets"] == {
        "hf_token": {"name": "hf-secrets", "key": "HF_TOKEN"},
        "s3": "minio-credentials",
    }
    assert not any(key in dumped for key in ("access_key", "secret_key", "access_token", "value"))
    # The same arguments with values instead of references are refused, and the values are not echoed.
    for over in (
        {"env_vars": {"HF_TOKEN": TOKEN}},
        {
            "model_provider_parameters": HuggingFaceModelParams(
                model_uri="hf://x/y", transformer_type=CLS, access_token=TOKEN
            )
        },
        {"trainer_parameters": _trainer(hub_token=TOKEN)},
    ):
        with pytest.raises(UnsupportedParameter) as err:
            spec_from_train(**seed_call(**over))
        assert TOKEN not in str(err.value) and TOKEN not in repr(err.value.problems)


def test_client_options_refused_by_name():
    for kwargs, field in [
        ({"client_configuration": object()}, "client_configuration"),
        ({"job_kind": "TFJob"}, "job_kind"),
        ({"backend": "local", "config_file": "/tmp/kubeconfig"}, "config_file"),
        ({"backend": "slurm"}, "backend"),
    ]:
        with pytest.raises(UnsupportedParameter, match=f"^{field}: "):
            TrainingClient(**kwargs)


# ---- the job calls on the local backend, `kubetune run` replaced by a script


@pytest.fixture
def fake_run(monkeypatch, tmp_path):
    script = tmp_path / "fake_run.py"
    monkeypatch.setattr(client_mod, "run_command", lambda spec_file: [sys.executable, str(script), str(spec_file)])
    monkeypatch.setattr(client_mod, "_LOCAL_JOBS", {})
    yield script
    for job in list(client_mod._LOCAL_JOBS.values()):
        job.delete(timeout=5)


def _local_call(**over) -> dict:
    return seed_call(num_workers=1, resources_per_worker=None, **over)


def test_local_train_returns_none_and_the_job_calls_answer_like_the_sdk(fake_run):
    fake_run.write_text(
        "import sys\nprint('[rank 0] INFO step 1 loss 1.1')\nprint('[rank 1] INFO step 1 loss 1.2')\nsys.exit(0)\n"
    )
    client = TrainingClient(backend="local", namespace="kubeflow")  # a namespace is accepted and means nothing locally
    assert client.train(**_local_call()) is None
    job = client.wait_for_job_conditions("fine-tune-bert", wait_timeout=30, polling_interval=1)
    assert isinstance(job, KubeflowOrgV1PyTorchJob) and job.metadata.name == "fine-tune-bert"
    assert [(c.type, c.status) for c in job.status.conditions] == [
        ("Created", "True"),
        ("Running", "False"),
        ("Succeeded", "True"),
    ]
    assert client.is_job_succeeded("fine-tune-bert") and client.is_job_created("fine-tune-bert")
    assert not client.is_job_running("fine-tune-bert") and not client.is_job_failed("fine-tune-bert")
    logs, events = client.get_job_logs("fine-tune-bert")
    assert (
        logs == {"fine-tune-bert-master-0": "[rank 0] INFO step 1 loss 1.1\n[rank 1] INFO step 1 loss 1.2\n"}
        and events == {}
    )
    assert client.get_job_logs("fine-tune-bert", is_master=False, replica_type="worker") == (
        {},
        {},
    )  # a local run is one node
    assert [j.metadata.name for j in client.list_jobs()] == ["fine-tune-bert"]
    client.delete_job("fine-tune-bert")
    assert client.list_jobs() == []
    with pytest.raises(RuntimeError, match="no local run named 'fine-tune-bert'"):
        client.get_job("fine-tune-bert")


def test_local_failure_raises_runtime_error_with_the_reason(fake_run):
    fake_run.write_text("import sys\nprint('error: data.train: no such file', file=sys.stderr)\nsys.exit(2)\n")
    client = TrainingClient(backend="local")
    client.train(**_local_call())
    with pytest.raises(
        JobError, match="PyTorchJob fine-tune-bert is Failed: InvalidInput .*error: data.train: no such file"
    ) as err:
        client.wait_for_job_conditions("fine-tune-bert", wait_timeout=30, polling_interval=1)
    assert isinstance(err.value, RuntimeError)
    assert (
        client.wait_for_job_conditions("fine-tune-bert", expected_conditions={"Failed"}, wait_timeout=5).metadata.name
        == "fine-tune-bert"
    )


def test_local_wait_times_out_with_timeout_error(fake_run):
    fake_run.write_text("import time\ntime.sleep(30)\n")
    client = TrainingClient(backend="local")
    client.train(**_local_call())
    assert client.wait_for_job_conditions(
        "fine-tune-bert", expected_conditions={"Running"}, wait_timeout=10, polling_interval=1
    )
    with pytest.raises(JobTimeout) as err:
        client.wait_for_job_conditions("fine-tune-bert", wait_timeout=1, polling_interval=1)
    assert isinstance(err.value, TimeoutError)
    with pytest.raises(ValueError, match="expected_conditions"):
        client.wait_for_job_conditions("fine-tune-bert", expected_conditions={"Done"})


def test_local_refusals_start_nothing(fake_run):
    client = TrainingClient(backend="local")
    with pytest.raises(UnsupportedParameter, match="^num_workers: 4 nodes cannot run on one machine"):
        client.train(**seed_call())
    with pytest.raises(UnsupportedParameter, match=r"^train\(\): .*name"):
        client.train(**_local_call(name="Fine_Tune"))  # kubetune's own validation, in one line
    with pytest.raises(UnsupportedParameter, match="^verbose: "):
        client.get_job_logs("fine-tune-bert", verbose=True)
    assert client_mod._LOCAL_JOBS == {}


def test_signatures_and_defaults_mirror_the_sdk():
    import inspect

    from kubeflow.training import TrainingClient as SdkClient
    from kubeflow.training.constants import constants

    from kubetune.compat import kubeflow as compat

    for method in (
        "train",
        "get_job",
        "list_jobs",
        "get_job_conditions",
        "is_job_created",
        "is_job_running",
        "is_job_restarting",
        "is_job_succeeded",
        "is_job_failed",
        "wait_for_job_conditions",
        "get_job_logs",
        "delete_job",
    ):
        ours = [p for p in inspect.signature(getattr(TrainingClient, method)).parameters if p != "overrides"]
        assert ours == list(inspect.signature(getattr(SdkClient, method)).parameters), method
    assert list(inspect.signature(TrainingClient).parameters)[:5] == list(inspect.signature(SdkClient).parameters)
    assert compat.SDK_DEFAULT_STORAGE == {
        "size": constants.PVC_DEFAULT_SIZE,
        "storage_class": None,
        "access_modes": constants.PVC_DEFAULT_ACCESS_MODES,
    }
    assert set(compat.CONDITIONS) == constants.JOB_CONDITIONS


@pytest.mark.parametrize(
    "arguments, training",
    [
        ({"optim": "sgd"}, {"optimizer": "sgd", "momentum": 0.0}),
        ({"optim": "adamw_bnb_8bit"}, {"optimizer": "adamw_8bit"}),
        ({"optim": "adamw_torch_fused"}, {"optimizer": "adamw"}),
        ({"lr_scheduler_type": "cosine"}, {"lr_scheduler": "cosine"}),
        ({"lr_scheduler_type": "constant_with_warmup"}, {"lr_scheduler": "constant"}),
        ({"lr_scheduler_type": "linear"}, {"lr_scheduler": "linear"}),
    ],
)
def test_the_optimizers_and_schedules_a_spec_carries_are_translated(arguments, training):
    from kubetune.config import parse_spec

    spec = parse_spec(spec_from_train(**seed_call(trainer_parameters=_trainer(**arguments))))  # a valid spec
    assert {key: getattr(spec.training, key) for key in training} == training
