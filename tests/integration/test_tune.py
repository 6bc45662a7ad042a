"""`kubetune tune` as a user runs it: a study of MiniLM trials on the small real corpus (Optuna, random
sampling over the learning rate and the LoRA rank, median early stopping, MLflow), its table, tune.json,
status, report, nested MLflow runs and best.yaml; and (e2e) a study killed with SIGKILL during a trial and
run again: the requested trials, none twice, the interrupted one resumed from its checkpoint to the same
weights as an uninterrupted run, and best.yaml trained again to the best trial's metric exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, kubetune, tiny_spec, wait_for_checkpoint, write_spec
from safetensors.torch import load_file

pytestmark = pytest.mark.integration


def _study(train: Path, out: Path, **tune) -> dict:
    spec = tiny_spec(train, out, training={"epochs": 1, "batch_size": 8, "eval_every": 3, "seed": 7, "log_every": 3})
    spec["distributed"] = {"nodes": 1, "procs_per_node": 1}
    spec["output"]["report_baseline"] = False
    spec["tune"] = {
        "space": {
            "training.learning_rate": {"type": "float", "low": 1e-5, "high": 1e-3, "log": True},
            "lora.r": {"type": "choice", "values": [4, 8]},
        },
        "objective": "eval_accuracy",
        "algorithm": "random",
        "trials": 3,
        "seed": 1,
        **tune,
    }
    return spec


@pytest.mark.e2e  # 40-70 s: make test checks the tune section's checks and the Katib render (tests/unit)
def test_a_study_stops_poor_trials_tracks_them_in_mlflow_and_writes_its_best_spec(small_csv, tmp_path, mlflow_server):
    spec = _study(small_csv, tmp_path / "study", early_stopping={"min_trials": 1}, trials=2)
    spec["tracking"] = {"mlflow": {"uri": mlflow_server, "experiment": "tune-test"}}
    path = write_spec(tmp_path / "job.yaml", spec)
    r = kubetune("tune", str(path), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "study"
    data = json.loads((out / "tune.json").read_text())
    states = [t["state"] for t in data["trials"]]
    assert len(states) == 2 and set(states) <= {"complete", "pruned"} and "complete" in states, states
    for t in data["trials"]:
        assert t["intermediate"], t  # every trial reported its evaluations to the pruner
        if t["state"] == "pruned":  # stopped within one evaluation of the decision, its partial metrics kept
            last = max(int(s) for s in t["intermediate"])
            assert t["stopped_at"] == last and (Path(t["dir"]) / "history.jsonl").exists()
    best = data["best"]
    assert best["value"] == max(t["value"] for t in data["trials"] if t["state"] == "complete")
    assert f"best: trial {best['number']}" in r.stdout and "eval_accuracy" in r.stdout
    assert (out / "report.html").stat().st_size > 0 and (out / "plots" / "optimization_history.png").exists()
    shown = kubetune("tune", str(path), "--status", "--json")
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert [t["state"] for t in json.loads(shown.stdout)["trials"]] == states
    # MLflow: the study's run, every trial's run nested under it, the best value on the parent
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("tune-test").experiment_id
    runs = client.search_runs([experiment])
    parents = [r for r in runs if r.info.run_name == "tiny-tune"]
    assert len(parents) == 1, [r.info.run_name for r in runs]
    parent = parents[0]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.info.run_name for r in children) == [f"tiny-trial-{n:03d}" for n in range(2)]
    assert parent.data.metrics["best_eval_accuracy"] == best["value"]
    assert parent.data.tags["kubetune.best_trial"] == str(best["number"])
    best_spec = yaml.safe_load((out / "best.yaml").read_text())
    assert best_spec["output"]["uri"] == str(out / "best") and "tune" not in best_spec
    assert best_spec["training"]["learning_rate"] == best["params"]["training.learning_rate"]


@pytest.mark.e2e
def test_a_study_killed_during_a_trial_continues_and_resumes_that_trial(small_csv, tmp_path):
    out = tmp_path / "study"
    spec = _study(small_csv, out, trials=2)
    spec["training"]["checkpoint_every"] = 3
    path = write_spec(tmp_path / "job.yaml", spec)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kubetune", "tune", str(path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ,
    )
    wait_for_checkpoint(out / "trials" / "trial-000", 3, proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    r = kubetune("tune", str(path), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "trial 0 was interrupted: it runs again in trial-000" in r.stderr, r.stderr[-3000:]
    data = json.loads((out / "tune.json").read_text())
    states = {t["number"]: t["state"] for t in data["trials"]}
    assert sorted(states.values()) == ["complete", "complete", "interrupted"], states
    params = [json.dumps(t["params"], sort_keys=True) for t in data["trials"] if t["state"] == "complete"]
    assert len(set(params)) == 2, params  # none run twice
    log = (out / "logs" / "trial-000.log").read_text()
    assert "resumed from checkpoint step" in log, log[-3000:]
    # the resumed trial's weights equal an uninterrupted run of the same trial spec
    ref = kubetune("run", str(out / "specs" / "trial-000.yaml"), "--set", f"output.uri={tmp_path / 'ref'}")
    assert ref.returncode == 0, ref.stderr[-3000:]
    a = load_file(out / "trials" / "trial-000" / "adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "ref" / "adapter" / "adapter_model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0
    # best.yaml trains the best trial again, to its metric exactly
    again = kubetune("run", str(out / "best.yaml"), timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((out / "best" / "metrics.json").read_text())["eval_accuracy"] == data["best"]["value"]
