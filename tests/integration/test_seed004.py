"""Seed 004 (Kubeflow's "How to Fine-Tune LLM with Kubeflow" page): its `TrainingClient().train(...)`
call, with the SDK's own parameter classes, run through kubetune.compat.kubeflow.

(a) backend="local": the call adapted only in sizes (the packaged MiniLM instead of BERT, a
    120-row Hub dataset from the offline cache instead of Yelp's 3000, 1 worker × 2 CPU processes,
    3 steps) trains for real, and the SDK's job calls answer; the exported model loads.
(b) backend="kubeflow" against the fake API server (tests/fakes/kube_api.py): the seed call as it
    is creates a PyTorchJob of 4 nodes × 2 processes with its resources; the test plays the
    operator (conditions, pods, logs), and the SDK's job calls answer from the cluster.

transformers 5 renamed TrainingArguments(evaluation_strategy=) to eval_strategy=: the seed's
spelling fails in transformers itself, before any Kubeflow or kubetune code runs.
"""

from __future__ import annotations

import json

import pytest
import transformers
import yaml
from conftest import MINILM
from conftest import seed004_call as seed_call
from fakes.kube_api import FakeKubeAPI
from fakes.objects import job_status, pod
from kubeflow.storage_initializer.hugging_face import (
    HuggingFaceDatasetParams,
    HuggingFaceModelParams,
    HuggingFaceTrainerParams,
)
from kubeflow.training.models import KubeflowOrgV1PyTorchJob
from kubernetes.client import V1EnvVar, V1EnvVarSource, V1SecretKeySelector
from peft import LoraConfig

from kubetune.compat.kubeflow import JobError, TrainingClient

pytestmark = pytest.mark.integration
NS = "team-a"
JOBS = ("kubeflow.org/v1", "pytorchjobs")


def test_seed_call_trains_locally_and_the_sdk_calls_answer(tmp_path, hub_dataset):
    out = tmp_path / "test_trainer"
    client = TrainingClient(backend="local")
    client.train(
        name="fine-tune-minilm",
        model_provider_parameters=HuggingFaceModelParams(
            model_uri=MINILM, transformer_type=transformers.AutoModelForSequenceClassification
        ),
        dataset_provider_parameters=HuggingFaceDatasetParams(repo_id=hub_dataset, split="train[:120]"),
        trainer_parameters=HuggingFaceTrainerParams(
            training_parameters=transformers.TrainingArguments(
                output_dir=str(out),
                save_strategy="no",
                eval_strategy="no",
                do_eval=False,
                disable_tqdm=True,
                log_level="info",
                max_steps=3,
                per_device_train_batch_size=8,
                logging_steps=2,
            ),
            lora_config=LoraConfig(r=8, lora_alpha=8, lora_dropout=0.1, bias="none"),
        ),
        num_workers=1,
        num_procs_per_worker=2,
        resources_per_worker={
            "gpu": 0,
            "cpu": 2,
            "memory": "4G",
        },  # carried into the spec; a local run does not use them
        overrides=["data.max_length=32"],  # kubetune's extension: the SDK call has no place for it
    )
    try:
        job = client.wait_for_job_conditions("fine-tune-minilm", wait_timeout=240, polling_interval=2)
    except JobError:
        pytest.fail(
            "\n".join(
                client.get_job_logs("fine-tune-minilm")[0].get("fine-tune-minilm-master-0", "").splitlines()[-30:]
            )
        )
    assert isinstance(job, KubeflowOrgV1PyTorchJob) and job.metadata.name == "fine-tune-minilm"
    assert client.is_job_succeeded("fine-tune-minilm") and not client.is_job_failed("fine-tune-minilm")

    logs, events = client.get_job_logs("fine-tune-minilm")
    assert list(logs) == ["fine-tune-minilm-master-0"] and events == {}
    text = logs["fine-tune-minilm-master-0"]
    assert "[rank 0]" in text and "loss" in text

    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["global_step"] == 3 and metrics["world_size"] == 2
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out / "model")
    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "model")
    assert set(model.config.id2label.values()) == {"negative", "neutral", "positive"}
    assert model(**tokenizer(["what a lovely day"], return_tensors="pt")).logits.shape == (1, 3)
    assert (out / "adapter").is_dir()  # LoRA, as the seed asked

    # The local backend lists every job this Python process started (other tests' too).
    assert "fine-tune-minilm" in [j.metadata.name for j in client.list_jobs()]
    client.delete_job("fine-tune-minilm")
    assert "fine-tune-minilm" not in [j.metadata.name for j in client.list_jobs()]


# ---- (b) the kubeflow backend against the fake API server


@pytest.fixture
def cluster(tmp_path):
    with FakeKubeAPI() as server:
        server.kubeconfig = str(server.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS))
        yield server


def _pod(job: str, rtype: str, index: int) -> dict:
    return pod(f"{job}-{rtype}-{index}", job, rtype, index, NS)


def test_seed_call_submits_a_pytorchjob_and_the_sdk_calls_answer(cluster):
    client = TrainingClient(config_file=cluster.kubeconfig)  # backend="kubeflow" is the default, as in the SDK
    with pytest.warns(UserWarning, match="node-local storage"):  # output_dir="test_trainer" lives in the pod
        assert client.train(**seed_call()) is None

    job = cluster.get_obj(*JOBS, NS, "fine-tune-bert")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 3)
    assert str(job["spec"]["nprocPerNode"]) == "2"
    for role in ("Master", "Worker"):
        container = next(c for c in replicas[role]["template"]["spec"]["containers"] if c["name"] == "pytorch")
        # GPUs as a limit only: Kubernetes sets an extended resource's request to its limit.
        assert container["resources"] == {
            "limits": {"cpu": "5", "memory": "10G", "nvidia.com/gpu": "2"},
            "requests": {"cpu": "5", "memory": "10G"},
        }
    spec = yaml.safe_load(cluster.get_obj("v1", "configmaps", NS, "fine-tune-bert-spec")["data"]["job.yaml"])
    assert spec["model"]["uri"] == "hf://google-bert/bert-base-cased" and spec["task"] == "sequence-classification"
    assert (spec["data"]["train"], spec["data"]["train_split"]) == ("hf://yelp_review_full", "train[:3000]")
    assert (spec["lora"]["r"], spec["lora"]["alpha"], spec["lora"]["dropout"]) == (8, 8, 0.1)
    assert (spec["training"]["epochs"], spec["training"]["batch_size"]) == (3, 8)

    # The test plays the operator: the job runs, its pods log, it succeeds.
    assert not client.is_job_running("fine-tune-bert")
    cluster.set_status(*JOBS, NS, "fine-tune-bert", job_status("Created", "Running"))
    assert client.is_job_created("fine-tune-bert") and client.is_job_running("fine-tune-bert")
    assert (
        client.wait_for_job_conditions("fine-tune-bert", expected_conditions={"Running"}, wait_timeout=5).metadata.name
        == "fine-tune-bert"
    )
    cluster.put("v1", "pods", NS, _pod("fine-tune-bert", "master", 0))
    cluster.put("v1", "pods", NS, _pod("fine-tune-bert", "worker", 0))
    cluster.append_log(
        NS, "fine-tune-bert-master-0", "pytorch", "[rank 0] INFO step 10 loss 1.21", "[rank 0] INFO done"
    )
    cluster.append_log(NS, "fine-tune-bert-worker-0", "pytorch", "[rank 2] INFO step 10")
    cluster.set_status(*JOBS, NS, "fine-tune-bert", job_status("Created", "Running", "Succeeded"))

    job = client.wait_for_job_conditions("fine-tune-bert", wait_timeout=10, polling_interval=1)
    assert isinstance(job, KubeflowOrgV1PyTorchJob) and job.spec.nproc_per_node in (2, "2")
    assert client.is_job_succeeded("fine-tune-bert") and not client.is_job_failed("fine-tune-bert")
    assert client.get_job_logs("fine-tune-bert") == (
        {"fine-tune-bert-master-0": "[rank 0] INFO step 10 loss 1.21\n[rank 0] INFO done\n"},
        {},
    )
    logs, _ = client.get_job_logs("fine-tune-bert", is_master=False)
    assert logs == {
        "fine-tune-bert-master-0": "[rank 0] INFO step 10 loss 1.21\n[rank 0] INFO done\n",
        "fine-tune-bert-worker-0": "[rank 2] INFO step 10\n",
    }
    assert list(client.get_job_logs("fine-tune-bert", is_master=False, replica_type="worker", replica_index=0)[0]) == [
        "fine-tune-bert-worker-0"
    ]

    listed = client.list_jobs()
    assert [j.metadata.name for j in listed] == ["fine-tune-bert"] and isinstance(listed[0], KubeflowOrgV1PyTorchJob)
    client.delete_job("fine-tune-bert")
    assert cluster.objects(*JOBS, NS) == [] and client.list_jobs() == []
    with pytest.raises(RuntimeError, match="not found in namespace 'team-a'"):
        client.get_job("fine-tune-bert")


def test_storage_and_secret_references_reach_the_cluster_and_failure_raises(cluster):
    client = TrainingClient(config_file=cluster.kubeconfig, namespace="team-b")
    client.train(
        **seed_call(
            storage_config={"size": "20Gi", "storage_class": "openebs-hostpath", "access_modes": ["ReadWriteMany"]},
            env_vars=[
                V1EnvVar(
                    name="HF_TOKEN",
                    value_from=V1EnvVarSource(secret_key_ref=V1SecretKeySelector(name="hf-secrets", key="HF_TOKEN")),
                )
            ],
        )
    )
    pvc = cluster.get_obj("v1", "persistentvolumeclaims", "team-b", "fine-tune-bert-workspace")
    assert (
        pvc["spec"]["resources"]["requests"]["storage"] == "20Gi"
        and pvc["spec"]["storageClassName"] == "openebs-hostpath"
    )
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    job = cluster.get_obj(*JOBS, "team-b", "fine-tune-bert")
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    token = next(e for e in container["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"] == {"secretKeyRef": {"name": "hf-secrets", "key": "HF_TOKEN"}}

    cluster.set_status(
        *JOBS,
        "team-b",
        "fine-tune-bert",
        job_status("Created", "Running", "Failed", message="1 Worker replica(s) failed"),
    )
    with pytest.raises(
        JobError, match="fine-tune-bert is Failed: PyTorchJobFailed 1 Worker replica\\(s\\) failed"
    ) as err:
        client.wait_for_job_conditions("fine-tune-bert", wait_timeout=5)
    assert isinstance(err.value, RuntimeError)
    assert client.is_job_failed("fine-tune-bert")
