"""Issue 63, Katib rows, the pure parts. Row 9: a string choice that Katib's text substitution cannot carry to the
trial intact (it puts each value into the trial template's JSON as text, generator.go's applyParameters, and
`kubetune fetch --set` then reads it as YAML) is refused by the render in one line, for PyTorchJob and TrainJob
trials. Row 16: `katib.search` bounds and `TrainerResources` counts that are not numbers are one line naming the
argument, the value and the fix, not a traceback. (The substitution itself, through the fake API server that
plays Katib's trial controller, and row 17: tests/integration/test_hardening_pass4_katib_cluster.py.)"""

from __future__ import annotations

import kubeflow.katib as katib
import pytest
import transformers
from fakes import katib as fake_katib
from kubeflow.storage_initializer.hugging_face import (
    HuggingFaceDatasetParams,
    HuggingFaceModelParams,
    HuggingFaceTrainerParams,
)
from peft import LoraConfig

from kubetune.backends.kubeflow.manifests import render_tune
from kubetune.compat.katib import spec_from_tune
from kubetune.compat.kubeflow import UnsupportedParameter
from kubetune.config.load import parse_spec
from kubetune.errors import KubetuneError

PATH = "data.system_prompt"


def _spec(values: list):
    """A causal-LM study on a cluster whose choice is a free-text field (any string is a valid system prompt)."""
    return parse_spec(
        {
            "name": "chat",
            "task": "causal-lm",
            "model": {"uri": "hf://org/base"},
            "data": {"train": "hf://org/chat", "system_prompt": "x"},
            "output": {"uri": "s3://bucket/runs/chat"},
            "s3": {"endpoint_url": "http://minio.minio.svc:9000"},
            "kubernetes": {"secrets": {"s3": "s3-keys"}, "storage": {"mode": "pvc", "size": "20Gi"}},
            "tune": {"space": {PATH: {"type": "choice", "values": ["Be brief.", *values]}}, "objective": "eval_loss"},
        }
    )


INJECTION = 'x", "--set", "model.uri=s3://attacker/model'


@pytest.mark.parametrize("target", ["pytorchjob", "trainjob"])
@pytest.mark.parametrize(
    "value,why",
    [
        (INJECTION, 'a " (double quote)'),  # ends the JSON string: 2 more arguments in the trial's command
        ('say "hi"', 'a " (double quote)'),  # breaks every trial's JSON
        ("C:\\temp", "a \\ (backslash)"),  # starts a JSON escape
        ("two\nlines", "a control character ('\\n')"),  # not valid in a JSON string
        ("tab\there", "a control character ('\\t')"),
        ("see ${trialParameters.trialName}", "a ${trialParameters. reference"),  # substituted in turn
        ("yes", "YAML that `kubetune fetch --set` would read as True"),
        ("8", "YAML that `kubetune fetch --set` would read as 8"),
        ("answer: short", "YAML that `kubetune fetch --set` would read as {'answer': 'short'}"),
        ("Be brief. #1", "YAML that `kubetune fetch --set` would read as 'Be brief.'"),
        (" Be brief.", "YAML that `kubetune fetch --set` would read as 'Be brief.'"),
    ],
    ids=["injection", "quotes", "backslash", "newline", "tab", "reference", "yes", "8", "mapping", "comment", "space"],
)
def test_a_choice_katib_cannot_carry_intact_is_one_line(target, value, why):
    with pytest.raises(KubetuneError) as e:
        render_tune(_spec([value]), "team-a", target)
    line = str(e.value)
    assert "\n" not in line and e.value.field == f"tune.space.{PATH}", line
    assert f"the choice {value!r} holds {why}, which Katib's text substitution" in line, line
    assert "drop that from the value" in line


def test_a_quote_is_refused_for_the_trainjob_shell_line_only():
    spec = _spec(["It's short."])
    with pytest.raises(KubetuneError) as e:
        render_tune(spec, "team-a", "trainjob")
    assert "holds a ' (quote)" in str(e.value) and "use --target pytorchjob" in str(e.value)
    assert fake_katib.validate(render_tune(spec, "team-a", "pytorchjob").experiment) == []


# Katib's LLM guide's call (kubeflow/website, "How to Optimize Hyperparameters of LLMs with Kubeflow"), by argument
def _call(learning_rate=None, r=None, resources=None) -> dict:
    return {
        "name": "llama",
        "model_provider_parameters": HuggingFaceModelParams(
            model_uri="hf://meta-llama/Llama-3.2-1B", transformer_type=transformers.AutoModelForSequenceClassification
        ),
        "dataset_provider_parameters": HuggingFaceDatasetParams(repo_id="imdb", split="train[:1000]"),
        "trainer_parameters": HuggingFaceTrainerParams(
            training_parameters=transformers.TrainingArguments(
                output_dir="results",
                save_strategy="no",
                learning_rate=learning_rate or katib.search.double(min=1e-05, max=5e-05),
                num_train_epochs=3,
            ),
            lora_config=LoraConfig(r=r or katib.search.int(min=8, max=32), lora_alpha=8, lora_dropout=0.1, bias="none"),
        ),
        "objective_metric_name": "train_loss",
        "objective_type": "minimize",
        "algorithm_name": "random",
        "max_trial_count": 10,
        "parallel_trial_count": 2,
        "resources_per_trial": resources
        or katib.TrainerResources(
            num_workers=2, num_procs_per_worker=2, resources_per_worker={"gpu": 2, "cpu": 4, "memory": "10G"}
        ),
    }


LR = "trainer_parameters.training_parameters.learning_rate"
R = "trainer_parameters.lora_config.r"


def _workers(workers, procs=1):
    return {
        "resources": katib.TrainerResources(num_workers=workers, num_procs_per_worker=procs, resources_per_worker={})
    }


@pytest.mark.parametrize(
    "over,field,shown",
    [
        ({"learning_rate": katib.search.double(min="abc", max=5e-05)}, LR, "katib.search.double(min='abc'): min is"),
        ({"learning_rate": katib.search.double(min=1e-05, max="inf")}, LR, "katib.search.double(max='inf'): max is"),
        ({"learning_rate": katib.search.double(min=1e-05, max=float("nan"))}, LR, "(max='nan'): max is not a finite"),
        ({"r": katib.search.int(min=8.5, max=32)}, R, "katib.search.int(min='8.5'): min is not a whole number"),
        ({"r": katib.search.int(min=8, max=32, step="x")}, R, "katib.search.int(step='x'): step is not a whole"),
        ({"r": katib.search.int(min=8, max=[32])}, R, "katib.search.int(max='[32]'): max is not a whole number"),
        (_workers("two"), "resources_per_trial.num_workers", "'two' is not a whole number of at least 1"),
        (_workers(1.5), "resources_per_trial.num_workers", "1.5 is not a whole number of at least 1"),
        (_workers(None), "resources_per_trial.num_workers", "None is not a whole number of at least 1"),
        (_workers(True), "resources_per_trial.num_workers", "True is not a whole number of at least 1"),
        (_workers(1, 0), "resources_per_trial.num_procs_per_worker", "0 is not a whole number of at least 1"),
        (_workers(1, "2 GPUs"), "resources_per_trial.num_procs_per_worker", "'2 GPUs' is not a whole number"),
    ],
    ids=["min-abc", "max-inf", "max-nan", "int-8.5", "step-x", "max-list", "two", "1.5", "none", "bool", "0", "text"],
)
def test_a_search_bound_or_a_count_that_is_not_a_number_is_one_line(over, field, shown):
    with pytest.raises(UnsupportedParameter) as e:
        spec_from_tune(**_call(**over))
    line = str(e.value)
    assert "\n" not in line and e.value.field == field, line
    assert shown in line and " — give " in line, line


def test_whole_numbers_in_any_form_the_sdk_stores_them_are_taken():
    """The SDK keeps bounds as text (str(min)): 8.0 for an int search is 8; workers as text are counted."""
    raw = spec_from_tune(
        **_call(r=katib.search.int(min=8.0, max="32", step=2), resources=_workers("2", 2.0)["resources"])
    )
    assert raw["tune"]["space"]["lora.r"] == {"type": "int", "low": 8, "high": 32, "step": 2}
    assert (raw["distributed"]["nodes"], raw["distributed"]["procs_per_node"]) == (2, 2)
    parse_spec(raw)


def test_a_local_study_that_failed_answers_as_a_failed_experiment(tmp_path, monkeypatch):
    """Row 17, locally: the calls after tune() answer from the study this client ran (here one its checks refused
    before any trial: an objective the task never reports), in Katib's models and exceptions."""
    from kubeflow_katib_api import models as kt

    from kubetune.compat.katib import KatibClient

    monkeypatch.chdir(tmp_path)
    cl = KatibClient(backend="local")
    call = _call(resources=_workers(1)["resources"])
    with pytest.raises(RuntimeError) as e:
        cl.tune(**{**call, "objective_metric_name": "eval_acuracy"})
    assert "objective 'eval_acuracy' is not a metric task sequence-classification reports" in str(e.value)
    exp = cl.get_experiment("llama")
    assert isinstance(exp, kt.V1beta1Experiment) and exp.spec.objective.objective_metric_name == "eval_acuracy"
    assert [(c.type, c.status) for c in exp.status.conditions][-1] == ("Failed", "True")
    assert cl.is_experiment_failed("llama") and not cl.is_experiment_succeeded("llama")
    assert [e.metadata.name for e in cl.list_experiments()] == ["llama"]
    assert cl.get_optimal_hyperparameters("llama") is None
    with pytest.raises(RuntimeError) as e:
        cl.wait_for_experiment_condition(name="llama")
    assert str(e.value).startswith("Experiment local/llama is Failed: ExperimentFailed tune.objective: objective")
    assert cl.wait_for_experiment_condition("llama", expected_condition="Failed").status.trials == 0
    assert not (tmp_path / "results").exists()  # refused before the study began


def test_a_spec_the_call_makes_that_is_invalid_names_every_problem_in_one_line(tmp_path, monkeypatch):
    """Every problem of the translated spec (here two overrides), not a count ("2 problems in spec")."""
    from kubetune.compat.katib import KatibClient

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as e:
        KatibClient(backend="local").tune(
            **_call(resources=_workers(1)["resources"]), overrides=["training.epochs=0", "training.batch_size=-1"]
        )
    line = str(e.value)
    assert "\n" not in line and line.startswith("tune(): "), line
    assert "training.epochs" in line and "training.batch_size" in line and "(got 0)" in line and "(got -1)" in line


def test_overrides_that_drop_the_tune_section_are_refused_before_a_study_is_kept(tmp_path, monkeypatch):
    """`overrides=["tune=null"]` leaves a spec without a search: refused in one line naming tune, and no study
    is kept that get_experiment would then fail to describe (it raised an AttributeError before)."""
    from kubetune.compat.katib import KatibClient

    monkeypatch.chdir(tmp_path)
    cl = KatibClient(backend="local")
    with pytest.raises(RuntimeError) as e:
        cl.tune(**_call(resources=_workers(1)["resources"]), overrides=["tune=null"])
    line = str(e.value)
    assert "\n" not in line and "tune" in line and "no tune section" in line, line
    with pytest.raises(RuntimeError, match="llama"):
        cl.get_experiment("llama")
