"""`kubetune render --tune`: the Katib Experiment of every example (those without a tune section given one),
checked against Katib v0.19.0's admission rules (tests/fakes/katib.py, restated from its webhook: no Katib can
run here), its trial PyTorchJob, once Katib has put a trial's values in, valid against the typed model and
admitted by the upstream PyTorchJob CRDs (schema, pruning, CEL) and the Training Operator's webhook rules, and Katib's metrics collector reading the objective from kubetune's own log lines."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml
from fakes import crds, webhooks
from fakes import katib as fake_katib

from kubetune.backends.cluster import strict
from kubetune.backends.kubeflow.katib import METRICS_FORMAT
from kubetune.backends.kubeflow.manifests import render, render_tune
from kubetune.config import load_spec
from kubetune.config.load import parse_spec
from kubetune.errors import KubetuneError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def _with_tune(path: Path):
    spec = load_spec(path)
    if spec.tune is not None:
        return spec
    raw = spec.model_dump(mode="json", exclude_unset=True)
    raw["tune"] = {
        "space": {"training.learning_rate": {"type": "float", "low": 1e-5, "high": 1e-3, "log": True}},
        "objective": "eval_loss",
        "trials": 4,
        "parallel": 8,  # more than the trials: Katib refuses that, so the render clamps it
        "max_failed": 10,
        "early_stopping": {"min_trials": 2, "warmup_steps": 40},
    }
    if "lora" in raw:
        raw["tune"]["space"]["lora.r"] = {"type": "choice", "values": [4, 8, 16]}
    raw.setdefault("training", {})["eval_every"] = 20
    return parse_spec(raw)


def _substituted(experiment: dict) -> dict:
    """The trial job as Katib makes it: every ${trialParameters.X} replaced, a name and namespace given."""
    template = experiment["spec"]["trialTemplate"]
    values = {p["name"]: (p["feasibleSpace"].get("list") or [p["feasibleSpace"].get("min")])[0]
              for p in experiment["spec"]["parameters"]}  # fmt: skip
    text = json.dumps(template["trialSpec"])
    for tp in template["trialParameters"]:
        value = "trial-abc123" if tp["reference"] == "${trialSpec.Name}" else values[tp["reference"]]
        text = text.replace("${trialParameters." + tp["name"] + "}", str(value))
    job = json.loads(text)
    job["metadata"].update(name="trial-abc123", namespace=experiment["metadata"]["namespace"])
    return job


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_examples_experiment_is_admitted_and_its_trials_are_valid_pytorchjobs(path):
    spec = _with_tune(path)
    rendered = render_tune(spec, spec.kubernetes.namespace or "kubeflow")
    exp = rendered.experiment
    assert fake_katib.validate(exp) == [], exp
    assert exp["spec"]["parallelTrialCount"] <= exp["spec"]["maxTrialCount"]
    job = _substituted(exp)
    assert strict.validate(job) == []  # the typed model; and what the operator's API server does with it:
    for release in ("v1.8.1", "v1.9.0"):  # the upstream CRD (schema, unknown fields pruned, CEL), the webhook
        outcome = crds.crd("pytorchjobs", release).admit(job)
        assert outcome.errors == [] and outcome.pruned == [], (release, outcome)
        assert webhooks.pytorchjob_errors(outcome.stored, release) == []
    pod = next(iter(job["spec"]["pytorchReplicaSpecs"].values()))["template"]["spec"]
    fetch, launch = pod["initContainers"][0]["command"], pod["containers"][0]["command"]
    staged = fetch[fetch.index("--dest") + 1]
    assert staged.endswith("/trial-abc123") and launch[-1] == f"{staged}/job.yaml"  # each trial its own spec
    sets = [fetch[i + 1] for i, arg in enumerate(fetch) if arg == "--set"]
    assert any(s.startswith("training.learning_rate=") for s in sets)
    assert any(s.startswith("output.uri=") and s.endswith("/trials/trial-abc123") for s in sets)
    # the trial's overrides make a valid spec (what `kubetune fetch --set` stages)
    load_spec_raw = yaml.safe_load(rendered.config_map["data"]["job.yaml"])
    assert "tune" not in load_spec_raw or load_spec_raw["tune"] is None
    parse_spec(load_spec_raw, sets)
    for obj in rendered.objects()[:-1]:
        assert strict.validate(obj) == [], obj["kind"]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_examples_trainjob_experiment_is_admitted_and_its_trials_are_valid_trainjobs(path):
    """--target trainjob: the trials are the TrainJob kubetune renders; where the job itself cannot be a TrainJob,
    the Experiment is refused with the job's own reasons."""
    spec = _with_tune(path)
    ns = spec.kubernetes.namespace or "kubeflow"
    try:
        render(spec.model_copy(update={"tune": None}), ns, "trainjob")
    except KubetuneError as refused:
        with pytest.raises(KubetuneError) as e:
            render_tune(spec, ns, "trainjob")
        assert str(e.value) == str(refused)
        return
    exp = render_tune(spec, ns, "trainjob").experiment
    assert fake_katib.validate(exp) == [], exp
    template = exp["spec"]["trialTemplate"]
    assert (template["primaryContainerName"], template["successCondition"]) == (
        "node",
        'status.conditions.#(type=="Complete")#|#(status=="True")#',
    )
    job = _substituted(exp)
    outcome = crds.crd("trainjobs", "v2.3.0").admit(job)
    assert outcome.errors == [] and outcome.pruned == [], outcome
    runtimes = {r["metadata"]["name"]: r for r in crds.shipped_runtimes()}
    assert webhooks.trainjob_errors(outcome.stored, runtimes) == []
    words = shlex.split(job["spec"]["trainer"]["command"][-1])  # as the pod's shell reads the one line
    fetch, launch = words[: words.index("&&")], words[words.index("&&") + 1 :]
    staged = fetch[fetch.index("--dest") + 1]
    assert staged.endswith("/trial-abc123") and launch[-1] == f"{staged}/job.yaml"
    sets = [fetch[i + 1] for i, arg in enumerate(fetch) if arg == "--set"]
    assert any(s.startswith("output.uri=") and s.endswith("/trials/trial-abc123") for s in sets)
    parse_spec(yaml.safe_load(render_tune(spec, ns, "trainjob").config_map["data"]["job.yaml"]), sets)


def test_katibs_rules_refuse_what_they_should():
    exp = render_tune(_with_tune(ROOT / "examples" / "sentiment-minilm.yaml"), "kubeflow").experiment
    assert fake_katib.validate(exp, namespace_labels={}) == [
        "the namespace lacks label katib.kubeflow.org/metrics-collector-injection: enabled"
    ]
    bad = json.loads(json.dumps(exp))
    bad["spec"]["trialTemplate"]["trialParameters"].pop(0)
    assert any("not found in trialParameters" in e for e in fake_katib.validate(bad))
    bad = json.loads(json.dumps(exp))
    bad["spec"]["metricsCollectorSpec"]["source"]["filter"]["metricsFormat"] = ["eval_(\\w+)"]
    assert fake_katib.validate(bad) == ["two top subexpressions are required in a metrics format"]
    bad = json.loads(json.dumps(exp))
    bad["spec"]["trialTemplate"]["trialSpec"]["metadata"]["name"] = "x"
    assert "metadata.name and metadata.namespace in spec.trialTemplate must be omitted" in fake_katib.validate(bad)


def test_a_name_katib_refuses_is_one_line_before_anything_is_rendered():
    spec = _with_tune(ROOT / "examples" / "sentiment-minilm.yaml").model_copy(update={"name": "a" * 41})
    with pytest.raises(KubetuneError) as e:
        render_tune(spec, "kubeflow")
    assert e.value.field == "name" and "40 characters" in str(e.value)


def test_katibs_collector_reads_the_objective_from_kubetunes_log_lines():
    """Lines as the trainer writes them (epoch evaluation, lm-eval, the final `done:`), with Katib's parsing: the
    latest value of the objective is the run's final one."""
    lines = [
        "16:03:36 [rank 0] INFO progress: step=10/50 epoch=1/1 loss=1.1048 lr=1.39e-04 eta=51s",
        "16:03:48 [rank 0] INFO epoch 1, step 10: eval_loss 1.1037 eval_accuracy 0.2400 eval_f1_macro 0.2257",
        "16:04:20 [rank 0] INFO epoch 1, step 50: eval_loss 1.0012 eval_accuracy 0.4100 eval_f1_macro 0.3301",
        "16:04:21 [rank 0] INFO step 50: lm_eval arc_easy/acc 0.4120, gsm8k/exact_match/strict-match 0.0500",
        "16:04:22 [rank 0] INFO done: eval_accuracy 0.4100, eval_f1_macro 0.3301, train_loss 0.9875, 55.2 samples/s; "
        "artifacts in runs/x",
    ]
    got = fake_katib.collect(lines, METRICS_FORMAT, ["eval_accuracy", "eval_loss", "arc_easy/acc", "train_loss"])
    assert got == {
        "eval_accuracy": [0.24, 0.41, 0.41],
        "eval_loss": [1.1037, 1.0012],
        "arc_easy/acc": [0.412],
        "train_loss": [0.9875],  # the objective of Katib's LLM tune(): only the done line has it
    }
    assert re.compile(METRICS_FORMAT).groups == 2


def test_what_a_local_study_refuses_the_render_refuses_too():
    """An objective the trials never print would leave every Katib trial without an observation."""
    spec = _with_tune(ROOT / "examples" / "sentiment-minilm.yaml")
    bad = spec.model_copy(update={"tune": spec.tune.model_copy(update={"objective": "eval_acuracy"})})
    with pytest.raises(KubetuneError) as e:
        render_tune(bad, "kubeflow")
    assert e.value.field == "tune.objective" and "eval_accuracy" in str(e.value)


def test_a_target_that_is_neither_kind_is_refused_not_rendered_as_a_trainjob():
    spec = _with_tune(ROOT / "examples" / "sentiment-minilm.yaml")
    for target in ("bogus", "TrainJob"):
        with pytest.raises(KubetuneError) as e:
            render_tune(spec, "kubeflow", target)
        assert e.value.field == "--target" and repr(target) in str(e.value)


def test_a_choice_with_a_quote_is_refused_for_trainjob_trials_only():
    spec = _with_tune(ROOT / "examples" / "sentiment-minilm.yaml")
    raw = spec.model_dump(mode="json", exclude_unset=True)
    raw["tune"]["space"]["data.system_prompt"] = {"type": "choice", "values": ["Be brief.", "It's short."]}
    raw["task"] = "causal-lm"
    raw["data"] = {"train": "hf://org/chat", "system_prompt": "x"}
    quoted = parse_spec(raw)
    with pytest.raises(KubetuneError) as e:
        render_tune(quoted, "kubeflow", "trainjob")
    assert e.value.field == "tune.space.data.system_prompt"
    exp = render_tune(quoted, "kubeflow", "pytorchjob").experiment  # no shell: the value reaches kubetune whole
    assert fake_katib.validate(exp) == []
