"""Katib's LLM `KatibClient().tune(...)` call (Kubeflow's "How to Optimize Hyperparameters of LLMs" guide), with
the SDK's own parameter classes and `katib.search.*` values (kubeflow-katib 0.19.0), run through
kubetune.compat.katib.

(a) backend="local": the guide's call adapted only in sizes (the packaged MiniLM classifier instead of a Llama, a
    120-row Hub dataset from the offline cache, 2 trials of 3 steps) runs a real Optuna study, each trial a
    kubetune run; the SDK's get_optimal_hyperparameters answers from it.
(b) backend="kubeflow" against the FAKE API server (tests/fakes/kube_api.py; no Katib can run here): the guide's
    call as it is creates an Experiment that Katib v0.19.0's webhook rules admit; the fake plays Katib's trial
    controller, whose PyTorchJob the operator's CRD and webhook admit; get_optimal_hyperparameters and
    delete_experiment answer from the cluster.
"""

from __future__ import annotations

import json

import kubeflow.katib as katib
import pytest
import transformers
from conftest import MINILM
from fakes import katib as fake_katib
from fakes.kube_api import FakeKubeAPI
from kubeflow.storage_initializer.hugging_face import (
    HuggingFaceDatasetParams,
    HuggingFaceModelParams,
    HuggingFaceTrainerParams,
)
from peft import LoraConfig

from kubetune.backends.kubeflow.katib import METRICS_FORMAT
from kubetune.compat.katib import KatibClient, spec_from_tune
from kubetune.compat.kubeflow import UnsupportedParameter

pytestmark = pytest.mark.integration
NS = "kubeflow"
EXP = ("kubeflow.org/v1beta1", "experiments")


def guide_call(**over) -> dict:
    """The arguments of the guide's `cl.tune(...)`, with the SDK's own classes; ``over`` replaces any of them."""
    call = {
        "name": "llm",
        "model_provider_parameters": HuggingFaceModelParams(
            model_uri="hf://meta-llama/Llama-3.2-1B", transformer_type=transformers.AutoModelForCausalLM
        ),
        "dataset_provider_parameters": HuggingFaceDatasetParams(repo_id="imdatta0/ultrachat_1k"),
        "trainer_parameters": HuggingFaceTrainerParams(
            training_parameters=transformers.TrainingArguments(
                output_dir="results",
                save_strategy="no",
                learning_rate=katib.search.double(min=1e-05, max=5e-05),
                num_train_epochs=1,
            ),
            lora_config=LoraConfig(r=katib.search.int(min=8, max=32), lora_alpha=8, lora_dropout=0.1, bias="none"),
        ),
        "objective_metric_name": "train_loss",
        "objective_type": "minimize",
        "algorithm_name": "random",
        "max_trial_count": 10,
        "parallel_trial_count": 2,
        "resources_per_trial": katib.TrainerResources(
            num_workers=2, num_procs_per_worker=2, resources_per_worker={"gpu": 2, "cpu": 1, "memory": "10G"}
        ),
    }
    return {**call, **over}


@pytest.mark.e2e
def test_the_guides_call_runs_a_local_study(tmp_path, hub_dataset, monkeypatch):
    monkeypatch.chdir(tmp_path)  # output_dir="results", as in the guide, relative to where the notebook runs
    args = transformers.TrainingArguments(
        output_dir="results",
        save_strategy="no",
        learning_rate=katib.search.double(min=1e-05, max=5e-05),
        max_steps=3,
        per_device_train_batch_size=8,
        logging_steps=1,
    )
    client = KatibClient(backend="local")
    client.tune(
        **guide_call(
            name="minilm",
            model_provider_parameters=HuggingFaceModelParams(
                model_uri=MINILM, transformer_type=transformers.AutoModelForSequenceClassification
            ),
            dataset_provider_parameters=HuggingFaceDatasetParams(repo_id=hub_dataset, split="train[:120]"),
            trainer_parameters=HuggingFaceTrainerParams(
                training_parameters=args,
                lora_config=LoraConfig(r=katib.search.int(min=8, max=32), lora_alpha=8, lora_dropout=0.1, bias="none"),
            ),
            max_trial_count=2,
            parallel_trial_count=1,
            algorithm_settings={"random_state": 3},
            resources_per_trial=katib.TrainerResources(
                num_workers=1, num_procs_per_worker=1, resources_per_worker={"cpu": 1, "memory": "4G"}
            ),
        ),
        overrides=["data.max_length=32"],  # kubetune's extension: the SDK call has no place for it
    )
    assert isinstance(args.learning_rate, katib.models.V1beta1ParameterSpec)  # the caller's objects untouched

    out = tmp_path / "results"
    data = json.loads((out / "tune.json").read_text())
    assert (data["objective"], data["direction"]) == ("train_loss", "minimize")
    assert [t["state"] for t in data["trials"]] == ["complete", "complete"]
    values = [t["params"] for t in data["trials"]]
    assert all(1e-5 <= v["training.learning_rate"] <= 5e-5 and 8 <= v["lora.r"] <= 32 for v in values)
    assert values[0] != values[1]
    best = min(data["trials"], key=lambda t: t["value"])
    for t in data["trials"]:  # each trial's objective: its run's own train_loss, also in its log's done: line
        run = out / "trials" / t["dir"].rsplit("/", 1)[-1]
        assert t["value"] == json.loads((run / "metrics.json").read_text())["train_loss"]
    (log,) = [p for p in (out / "logs").iterdir() if best["dir"].endswith(p.stem)]
    assert fake_katib.collect(log.read_text().splitlines(), METRICS_FORMAT, ["train_loss"]) == {
        "train_loss": [pytest.approx(best["value"], abs=5e-5)]
    }

    optimal = client.get_optimal_hyperparameters("minilm")
    assert optimal.best_trial_name == best["dir"].rsplit("/", 1)[-1]
    assert {a.name: float(a.value) for a in optimal.parameter_assignments} == {
        "training-learning_rate": best["params"]["training.learning_rate"],
        "lora-r": best["params"]["lora.r"],
    }
    assert optimal.observation.metrics[0].name == "train_loss"
    assert float(optimal.observation.metrics[0].latest) == best["value"]
    assert (out / "best.yaml").is_file()


def test_the_guides_call_creates_an_experiment_katib_admits(tmp_path):
    with FakeKubeAPI(katib="v0.19.0") as cluster:
        kubeconfig = str(cluster.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS))
        client = KatibClient(config_file=kubeconfig, namespace=NS)  # backend="kubeflow", as in the SDK
        assert client.tune(**guide_call()) is None

        exp = cluster.get_obj(*EXP, NS, "llm")
        assert fake_katib.validate(exp) == []
        spec = exp["spec"]
        assert (spec["objective"]["type"], spec["objective"]["objectiveMetricName"]) == ("minimize", "train_loss")
        assert (spec["algorithm"]["algorithmName"], spec["maxTrialCount"], spec["parallelTrialCount"]) == (
            "random",
            10,
            2,
        )
        params = {p["name"]: p for p in spec["parameters"]}
        assert params["training-learning_rate"]["parameterType"] == "double"
        assert params["training-learning_rate"]["feasibleSpace"]["min"] == "1e-05"
        assert (params["lora-r"]["parameterType"], params["lora-r"]["feasibleSpace"]["max"]) == ("int", "32")

        # Katib's trial controller makes a trial: 2 nodes × 2 processes with the resources asked, the values set
        job = cluster.run_trial(NS, "llm", "llm-q8z5m2k4", {"training-learning_rate": "3.2e-05", "lora-r": "17"})
        assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1  # a Master and a Worker: 2 nodes
        assert job["spec"]["nprocPerNode"] == "2"
        fetch = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["initContainers"][0]["command"]
        sets = [fetch[i + 1] for i, a in enumerate(fetch) if a == "--set"]
        assert sets[:2] == ["training.learning_rate=3.2e-05", "lora.r=17"]
        master = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
        assert master["resources"]["limits"] == {"cpu": "1", "memory": "10G", "nvidia.com/gpu": "2"}

        assert client.get_optimal_hyperparameters("llm") is None  # no trial has finished
        cluster.set_status(
            *EXP,
            NS,
            "llm",
            {
                "currentOptimalTrial": {
                    "bestTrialName": "llm-q8z5m2k4",
                    "parameterAssignments": [
                        {"name": "training-learning_rate", "value": "3.2e-05"},
                        {"name": "lora-r", "value": "17"},
                    ],
                    "observation": {"metrics": [{"name": "train_loss", "latest": "1.02", "min": "1.02", "max": "2.3"}]},
                }
            },
        )
        optimal = client.get_optimal_hyperparameters("llm")
        assert optimal.best_trial_name == "llm-q8z5m2k4"
        assert [(a.name, a.value) for a in optimal.parameter_assignments] == [
            ("training-learning_rate", "3.2e-05"),
            ("lora-r", "17"),
        ]
        client.delete_experiment("llm")
        assert cluster.get_obj(*EXP, NS, "llm") is None


def test_what_kubetune_cannot_honour_is_refused_by_name_in_one_line():
    def fn(parameters):  # the custom-objective form
        return parameters["lr"]

    for over, field in (
        ({"objective": fn, "parameters": {"lr": katib.search.double(min=0.1, max=0.2)}}, "objective"),
        ({"algorithm_name": "bayesianoptimization"}, "algorithm_name"),
        ({"objective_goal": 0.5}, "objective_goal"),
        ({"algorithm_settings": {"n_startup_trials": 5}}, "algorithm_settings['n_startup_trials']"),
        ({"resources_per_trial": {"cpu": 1}}, "resources_per_trial"),
        ({"metrics_collector_config": {"kind": "Push"}}, "metrics_collector_config"),
    ):
        with pytest.raises(UnsupportedParameter) as e:
            spec_from_tune(**guide_call(**over))
        assert e.value.field == field, (over, str(e.value))
        assert "\n" not in str(e.value)

    # a search value in a field no spec field carries one to one, and a distribution Optuna cannot sample
    beta = katib.search.double(min=0.8, max=0.95)
    normal = katib.search.double(min=1e-5, max=5e-5)
    normal.feasible_space.distribution = "normal"
    trainer = HuggingFaceTrainerParams(
        training_parameters=transformers.TrainingArguments(output_dir="r", adam_beta1=beta, learning_rate=normal),
        lora_config=LoraConfig(r=8),
    )
    with pytest.raises(UnsupportedParameter) as e:
        spec_from_tune(**guide_call(trainer_parameters=trainer))
    assert e.value.field == (  # in TrainingArguments' field order
        "trainer_parameters.training_parameters.learning_rate, trainer_parameters.training_parameters.adam_beta1"
    )
    assert "learning_rate" in str(e.value) and "normal distribution" in str(e.value)

    with pytest.raises(UnsupportedParameter) as e:
        KatibClient(backend="local").tune(**guide_call())  # 2 nodes on one machine
    assert e.value.field == "resources_per_trial.num_workers"


def test_the_translated_spec_carries_the_search_under_the_spec_paths():
    spec = spec_from_tune(
        **guide_call(
            algorithm_name="tpe",
            algorithm_settings=[katib.models.V1beta1AlgorithmSetting(name="random_state", value="7")],
            trainer_parameters=HuggingFaceTrainerParams(
                training_parameters=transformers.TrainingArguments(
                    output_dir="results",
                    per_device_train_batch_size=katib.search.categorical([8, 16]),
                    learning_rate=katib.search.double(min=1e-5, max=1e-3, step=1e-5),
                ),
                lora_config=LoraConfig(r=8, lora_dropout=katib.search.double(min=0.0, max=0.2)),
            ),
        )
    )
    assert spec["tune"] == {
        "space": {
            "training.batch_size": {"type": "choice", "values": [8, 16]},
            "training.learning_rate": {"type": "float", "low": 1e-5, "high": 1e-3, "step": 1e-5},
            "lora.dropout": {"type": "float", "low": 0.0, "high": 0.2},
        },
        "objective": "train_loss",
        "direction": "minimize",
        "algorithm": "tpe",
        "trials": 10,
        "parallel": 2,
        "seed": 7,
    }
    assert (spec["task"], spec["model"]["uri"], spec["distributed"]["nodes"]) == (
        "causal-lm",
        "hf://meta-llama/Llama-3.2-1B",
        2,
    )


def test_the_client_takes_the_sdks_arguments_and_hands_all_of_them_on():
    """KatibClient.tune has the SDK's parameters, in its order (a call written for the SDK, positional or by name,
    means the same), and passes each by name to spec_from_tune, which has the same ones."""
    import inspect

    from kubeflow.katib import KatibClient as SDKClient

    sdk = [p for p in inspect.signature(SDKClient.tune).parameters if p != "self"]
    ours = [p for p in inspect.signature(KatibClient.tune).parameters if p not in ("self", "overrides")]
    assert ours == sdk
    assert list(inspect.signature(spec_from_tune).parameters) == sdk
