"""Issue 63, Katib rows, against the FAKE Kubernetes API server (tests/fakes/kube_api.py) over real HTTP with the
real `kubernetes` client: no Katib can run here. The fake admits Experiments through Katib v0.19.0's webhook rules
and plays its trial controller (run_trial: the trial template with the trial's values put in as text, as
generator.go's applyParameters does, then admitted through the job's CRD and webhook); the tests play its
experiment controller with tests/fakes/katib.py's controller_status (status_util.go's summary and conditions).

Row 17: the script of Katib's LLM guide ("How to Optimize Hyperparameters of LLMs with Kubeflow", kubeflow/website
content/en/docs/components/katib/user-guides/llm-hp-optimization.md) runs unchanged but for its import: tune(),
then wait_for_experiment_condition(name=exp_name), then print(get_optimal_hyperparameters(exp_name)); the calls
users make next answer in Katib's models; retain_trials reaches the trial template. Row 9: hostile but carriable
choices reach each trial's `kubetune fetch --set` as one whole argument, PyTorchJob and TrainJob; an injection is
refused before anything is created."""

from __future__ import annotations

import json
import shlex
import threading
import time

import kubeflow.katib as katib
import pytest
import yaml
from fakes import katib as fake_katib
from fakes.kube_api import FakeKubeAPI
from kubeflow.storage_initializer.hugging_face import (
    HuggingFaceDatasetParams,
    HuggingFaceModelParams,
    HuggingFaceTrainerParams,
)
from kubeflow_katib_api import models as kt
from peft import LoraConfig
from transformers import AutoModelForSequenceClassification, TrainingArguments
from typer.testing import CliRunner

from kubetune.cli import app

pytestmark = pytest.mark.integration
EXP = ("kubeflow.org/v1beta1", "experiments")


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """A cluster with Katib, reached as the guide's notebook reaches it: through $KUBECONFIG."""
    with FakeKubeAPI(katib="v0.19.0") as server:
        server.kubeconfig = str(server.write_kubeconfig(tmp_path / "kubeconfig", namespace="team-a"))
        monkeypatch.setenv("KUBECONFIG", server.kubeconfig)
        server.namespace_labels["kubeflow"] = dict([fake_katib.INJECTION_LABEL])
        yield server


def guide_script(retain_trials: bool | None = None) -> str:
    """The guide's code example, as users copy it (its one change: kubetune's KatibClient), up to its tune() call;
    returns the client and the experiment's name. ``retain_trials``: passed to tune() when not None."""
    from kubetune.compat.katib import KatibClient  # was: from kubeflow.katib import KatibClient

    hf_model = HuggingFaceModelParams(
        model_uri="hf://meta-llama/Llama-3.2-1B",
        transformer_type=AutoModelForSequenceClassification,
    )
    hf_dataset = HuggingFaceDatasetParams(
        repo_id="imdb",
        split="train[:1000]",
    )
    hf_tuning_parameters = HuggingFaceTrainerParams(
        training_parameters=TrainingArguments(
            output_dir="results",
            save_strategy="no",
            learning_rate=katib.search.double(min=1e-05, max=5e-05),
            num_train_epochs=3,
        ),
        lora_config=LoraConfig(
            r=katib.search.int(min=8, max=32),
            lora_alpha=8,
            lora_dropout=0.1,
            bias="none",
        ),
    )
    cl = KatibClient(namespace="kubeflow")
    exp_name = "llama"
    cl.tune(
        name=exp_name,
        model_provider_parameters=hf_model,
        dataset_provider_parameters=hf_dataset,
        trainer_parameters=hf_tuning_parameters,
        objective_metric_name="train_loss",
        objective_type="minimize",
        algorithm_name="random",
        max_trial_count=10,
        parallel_trial_count=2,
        resources_per_trial=katib.TrainerResources(
            num_workers=2,
            num_procs_per_worker=2,
            resources_per_worker={"gpu": 2, "cpu": 4, "memory": "10G"},
        ),
        **({} if retain_trials is None else {"retain_trials": retain_trials}),
    )
    return cl, exp_name


def _trial(i: int) -> dict:
    """Trial i as Katib's suggestion gives it (its values), running."""
    values = {"training-learning_rate": f"{1e-05 + i * 4e-06:.6g}", "lora-r": str(8 + 2 * i)}
    return {"name": f"llama-t{i:02d}", "state": "Running", "assignments": values, "metrics": []}


def _observation(i: int) -> list[dict]:
    """Trial i's observation once it has succeeded, as Katib's StdOut collector reports its train_loss."""
    loss = f"{1.0 + abs(i - 6) / 10:.2f}"  # trial 6 is the best
    return [{"name": "train_loss", "latest": loss, "min": loss, "max": loss}]


class Katib(threading.Thread):
    """Katib's controllers for one Experiment: `parallel` trials at a time, each trial's job made by the trial
    controller, then ended in its state of `states`; the experiment controller's status written after every
    change (tests/fakes/katib.py's controller_status)."""

    def __init__(self, cluster, ns: str, experiment: str, states: list[str], parallel: int = 2, pause: float = 0.05):
        super().__init__(daemon=True)
        self.cluster, self.ns, self.experiment = cluster, ns, experiment
        self.states, self.parallel, self.pause = states, parallel, pause
        self.error: BaseException | None = None

    def _write(self, trials: list[dict]) -> None:
        exp = self.cluster.get_obj(*EXP, self.ns, self.experiment)
        self.cluster.set_status(*EXP, self.ns, self.experiment, fake_katib.controller_status(exp, trials))
        time.sleep(self.pause)

    def run(self) -> None:
        try:
            trials: list[dict] = []
            self._write(trials)
            for start in range(0, len(self.states), self.parallel):
                batch = list(range(start, min(start + self.parallel, len(self.states))))
                for i in batch:
                    trials.append(_trial(i))
                    self.cluster.run_trial(self.ns, self.experiment, trials[i]["name"], trials[i]["assignments"])
                self._write(trials)
                for i in batch:
                    trials[i]["state"] = self.states[i]
                    if self.states[i] == "Succeeded":
                        trials[i]["metrics"] = _observation(i)
                self._write(trials)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


def test_the_guides_script_and_the_calls_after_it_work_unchanged(cluster, capsys):
    cl, exp_name = guide_script()
    katib_controllers = Katib(cluster, "kubeflow", exp_name, ["Succeeded"] * 10)
    katib_controllers.start()
    began = time.monotonic()

    # the guide's next lines
    finished = cl.wait_for_experiment_condition(name=exp_name)
    print(cl.get_optimal_hyperparameters(exp_name))

    waited = time.monotonic() - began
    katib_controllers.join(30)
    assert katib_controllers.error is None, katib_controllers.error
    # the SDK sleeps its polling_interval (15 s) between looks; kubetune follows the Experiment and answers at once
    assert waited < 14, waited
    assert isinstance(finished, kt.V1beta1Experiment)
    assert [(c.type, c.status) for c in finished.status.conditions] == [
        ("Created", "True"),
        ("Running", "False"),
        ("Succeeded", "True"),
    ]
    assert finished.status.conditions[-1].reason == "ExperimentMaxTrialsReached"
    assert (finished.status.trials, finished.status.trials_succeeded) == (10, 10)
    out = capsys.readouterr().out.splitlines()
    assert out[-2].startswith("Experiment Trials status: 10 Trials, 0 Pending Trials, 0 Running Trials, 10 Succeeded")
    assert out[-1].startswith("best_trial_name='llama-t06'") and "latest='1.00'" in out[-1], out[-1]

    # what users call next, in Katib's own models
    optimal = cl.get_optimal_hyperparameters(exp_name)
    assert isinstance(optimal, kt.V1beta1OptimalTrial)
    assert {a.name: a.value for a in optimal.parameter_assignments} == _trial(6)["assignments"]
    assert optimal.observation.metrics[0].name == "train_loss" and optimal.observation.metrics[0].latest == "1.00"
    exp = cl.get_experiment(exp_name)
    assert isinstance(exp, kt.V1beta1Experiment) and exp.metadata.name == exp_name
    assert (exp.spec.objective.type, exp.spec.objective.objective_metric_name) == ("minimize", "train_loss")
    assert exp.spec.trial_template.retain is None  # retain_trials=False: Katib deletes a finished trial's job
    assert (cl.is_experiment_created(exp_name), cl.is_experiment_running(exp_name)) == (True, False)
    assert (cl.is_experiment_succeeded(exp_name), cl.is_experiment_failed(exp_name)) == (True, False)
    assert cl.is_experiment_succeeded(exp_name, experiment=exp) is True  # the SDK's experiment= form
    assert [c.type for c in cl.get_experiment_conditions(exp_name)] == ["Created", "Running", "Succeeded"]
    cluster.put(*EXP, "kubeflow", {"apiVersion": EXP[0], "kind": "Experiment", "metadata": {"name": "other"}})
    assert sorted(e.metadata.name for e in cl.list_experiments()) == ["llama", "other"]  # as the SDK: every one
    assert cl.list_experiments(namespace="team-a") == []
    cl.delete_experiment(exp_name)
    assert cluster.get_obj(*EXP, "kubeflow", exp_name) is None
    with pytest.raises(RuntimeError) as e:  # the SDK's exception type
        cl.get_experiment(exp_name)
    assert "experiments.kubeflow.org 'llama' not found in namespace 'kubeflow'" in str(e.value)


def test_retain_trials_keeps_the_trials_jobs_as_katibs_sdk_asks(cluster):
    cl, exp_name = guide_script(retain_trials=True)
    stored = cluster.get_obj(*EXP, "kubeflow", exp_name)
    assert stored["spec"]["trialTemplate"]["retain"] is True  # the SDK's tune(): trial_template.retain
    assert fake_katib.validate(stored) == []
    assert cl.get_experiment(exp_name).spec.trial_template.retain is True


def test_waiting_ends_as_the_sdks_wait_ends(cluster):
    cl, exp_name = guide_script()
    # more failed trials than maxFailedTrialCount (the spec's tune.max_failed, 0): Katib marks the Experiment Failed
    max_failed = cluster.get_obj(*EXP, "kubeflow", exp_name)["spec"]["maxFailedTrialCount"]
    failing = Katib(cluster, "kubeflow", exp_name, ["Failed"] * max(1, max_failed), parallel=1, pause=0)
    failing.run()
    assert failing.error is None, failing.error
    with pytest.raises(RuntimeError) as e:
        cl.wait_for_experiment_condition(name=exp_name)
    line = str(e.value)
    assert "\n" not in line and line.startswith("Experiment kubeflow/llama is Failed: ExperimentFailed"), line
    assert "max failed count has reached" in line
    with pytest.raises(RuntimeError):  # Failed first, as the SDK looks: it never becomes Created again
        cl.wait_for_experiment_condition(exp_name, expected_condition="Created")
    assert cl.wait_for_experiment_condition(exp_name, expected_condition="Failed").status.trials_failed == max(
        1, max_failed
    )
    with pytest.raises(ValueError) as e:
        cl.wait_for_experiment_condition(exp_name, expected_condition="Done")
    assert e.value.field == "expected_condition" and "Created, Running, Restarting, Succeeded, Failed" in str(e.value)

    cl.delete_experiment(exp_name)
    cl, exp_name = guide_script()
    running = Katib(cluster, "kubeflow", exp_name, ["Running"] * 2, pause=0)
    running.run()
    assert running.error is None, running.error
    began = time.monotonic()
    with pytest.raises(TimeoutError) as e:
        cl.wait_for_experiment_condition(exp_name, timeout=1, polling_interval=1)
    assert time.monotonic() - began < 10
    assert "timeout waiting for Experiment kubeflow/llama to reach Succeeded (1 s)" in str(e.value)

    cl.delete_experiment(exp_name)
    cl, exp_name = guide_script()
    finished = Katib(cluster, "kubeflow", exp_name, ["Succeeded"] * 10, pause=0)
    finished.run()
    assert finished.error is None, finished.error
    with pytest.raises(TimeoutError) as e:  # a finished Experiment never becomes Running again: no waiting
        cl.wait_for_experiment_condition(exp_name, expected_condition="Running", timeout=600)
    assert "ended Succeeded without reaching Running" in str(e.value)


# Row 9: what Katib's text substitution puts into a trial's command
SPEC = {
    "name": "chat",
    "task": "causal-lm",
    "model": {"uri": "hf://org/base"},
    "data": {"train": "hf://org/chat", "system_prompt": "x"},
    "s3": {"endpoint_url": "http://minio.minio.svc:9000"},
    "output": {"uri": "s3://bucket/runs/chat"},
    "kubernetes": {"secrets": {"s3": "s3-keys"}, "storage": {"mode": "pvc", "size": "20Gi"}},
    "tune": {"space": {}, "objective": "eval_loss", "trials": 4},
}
HOSTILE = ["$(id)", "`id`", "a; rm -rf / && echo", "$HOME ${HOME}", "--set model.uri=s3://x", "100% <b>é 😀</b>"]


def _stage_command(job: dict) -> list[str]:
    if job["kind"] == "TrainJob":
        return shlex.split(job["spec"]["trainer"]["command"][-1])  # as the pod's shell reads its one line
    return job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["initContainers"][0]["command"]


@pytest.mark.parametrize("target", ["pytorchjob", "trainjob"])
def test_each_choice_reaches_its_trial_whole_and_an_injection_is_refused(cluster, tmp_path, target):
    values = HOSTILE + (["It's short."] if target == "pytorchjob" else [])  # no shell line around a PyTorchJob's
    spec = {**SPEC, "tune": {**SPEC["tune"], "space": {"data.system_prompt": {"type": "choice", "values": values}}}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec, allow_unicode=True))
    result = CliRunner().invoke(app, ["submit", "--tune", str(path), "--target", target, "--namespace", "team-a"])
    assert result.exit_code == 0, result.stderr
    for i, value in enumerate(values):
        job = cluster.run_trial("team-a", "chat", f"chat-t{i}", {"data-system_prompt": value})  # admitted
        command = _stage_command(job)
        assert command[:2] == ["kubetune", "fetch"]
        sets = [command[k + 1] for k, word in enumerate(command) if word == "--set"]
        assert sets == [f"data.system_prompt={value}", f"output.uri=s3://bucket/runs/chat/trials/chat-t{i}"], sets

    injected = 'x", "--set", "model.uri=s3://attacker/model'
    spec["name"] = "chat2"
    spec["tune"]["space"]["data.system_prompt"]["values"] = ["Be brief.", injected]
    path.write_text(yaml.safe_dump(spec))
    result = CliRunner().invoke(app, ["submit", "--tune", str(path), "--target", target, "--namespace", "team-a"])
    assert result.exit_code != 0
    errors = [line for line in result.stderr.splitlines() if not line.startswith("warning: ")]
    assert len(errors) == 1 and "tune.space.data.system_prompt" in errors[0] and 'a " (double quote)' in errors[0]
    assert cluster.get_obj(*EXP, "team-a", "chat2") is None


@pytest.mark.e2e  # a real local study (a kubetune run per trial); make test runs the same calls on a cluster above
def test_the_guides_calls_answer_from_a_local_study(tmp_path, hub_dataset, monkeypatch, capsys):
    from conftest import MINILM

    from kubetune.compat.katib import KatibClient
    from kubetune.compat.kubeflow import UnsupportedParameter

    monkeypatch.chdir(tmp_path)  # output_dir="results", as in the guide, relative to where the notebook runs
    cl = KatibClient(backend="local")
    cl.tune(
        name="minilm",
        model_provider_parameters=HuggingFaceModelParams(
            model_uri=MINILM, transformer_type=AutoModelForSequenceClassification
        ),
        dataset_provider_parameters=HuggingFaceDatasetParams(repo_id=hub_dataset, split="train[:120]"),
        trainer_parameters=HuggingFaceTrainerParams(
            training_parameters=TrainingArguments(
                output_dir="results",
                save_strategy="no",
                learning_rate=katib.search.double(min=1e-05, max=5e-05),
                max_steps=2,
                per_device_train_batch_size=8,
            ),
            lora_config=LoraConfig(r=katib.search.int(min=8, max=32), lora_alpha=8, lora_dropout=0.1, bias="none"),
        ),
        objective_metric_name="train_loss",
        objective_type="minimize",
        max_trial_count=1,
        parallel_trial_count=1,
        resources_per_trial=katib.TrainerResources(num_workers=1, num_procs_per_worker=1, resources_per_worker={}),
        retain_trials=True,  # every local trial's output is kept anyway
        overrides=["data.max_length=32"],
    )
    finished = cl.wait_for_experiment_condition(name="minilm")  # the study ended when tune() returned
    assert isinstance(finished, kt.V1beta1Experiment)
    assert [(c.type, c.status) for c in finished.status.conditions] == [
        ("Created", "True"),
        ("Running", "False"),
        ("Succeeded", "True"),
    ]
    assert (finished.status.trials, finished.status.trials_succeeded) == (1, 1)
    assert capsys.readouterr().out.splitlines()[-1].startswith("Experiment Trials status: 1 Trials, 0 Pending")
    data = json.loads((tmp_path / "results" / "tune.json").read_text())
    optimal = cl.get_optimal_hyperparameters("minilm")
    assert optimal.best_trial_name == data["trials"][0]["dir"].rsplit("/", 1)[-1]
    assert optimal.best_trial_name == finished.status.succeeded_trial_list[0]
    assert {a.name for a in optimal.parameter_assignments} == {"training-learning_rate", "lora-r"}
    assert float(optimal.observation.metrics[0].latest) == data["best"]["value"]
    assert [e.metadata.name for e in cl.list_experiments()] == ["minilm"]
    assert cl.is_experiment_succeeded("minilm") and not cl.is_experiment_running("minilm")
    exp = cl.get_experiment("minilm")
    assert exp.spec.max_trial_count == 1 and [p.name for p in exp.spec.parameters] == [
        "training-learning_rate",
        "lora-r",
    ]
    with pytest.raises(TimeoutError):  # a finished study never runs again
        cl.wait_for_experiment_condition("minilm", expected_condition="Running")
    with pytest.raises(RuntimeError) as e:
        cl.get_experiment("other")
    assert "no study 'other' was run by this client" in str(e.value)
    with pytest.raises(UnsupportedParameter):
        cl.delete_experiment("minilm")  # a local study is its output directory, which kubetune never deletes
