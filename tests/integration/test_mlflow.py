"""MLflow tracking against a real `mlflow server` (sqlite backend store, local artifact root) on
127.0.0.1: conftest's mlflow_server, started in the background once collection shows these tests
will run; the run is read back through MLflow's own client."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import yaml
from conftest import kubetune, start_run, tiny_spec, wait_for_checkpoint, write_spec

from kubetune.training.tracking import MLflowLogger

pytestmark = pytest.mark.integration
SECRET = "S3CRETpw9"  # a password in MLFLOW_TRACKING_URI: must not reach any log, file or the MLflow run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spec(small_csv, out: Path, uri: str, experiment: str) -> dict:
    """2 epochs of 4 steps (a global batch of 32 of the 120 training rows), every step logged, evaluated
    every 2 steps, a checkpoint every 3."""
    spec = tiny_spec(
        small_csv,
        out,
        training={"epochs": 2, "batch_size": 16, "log_every": 1, "checkpoint_every": 3, "seed": 5, "eval_every": 2},
    )
    spec["output"]["report_baseline"] = False
    spec["tracking"] = {"mlflow": {"uri": uri, "experiment": experiment, "tags": {"team": "nlp"}}}
    return spec


def _logger_spec(name: str, uri: str, output: str, **mlflow):
    """A spec for MLflowLogger alone (no training): the server, an experiment named after the job."""
    from kubetune.config import parse_spec

    return parse_spec(
        {
            "name": name,
            "model": {"uri": "m"},
            "data": {"train": "t.csv"},
            "output": {"uri": output},
            "tracking": {"mlflow": {"uri": uri, "experiment": name, **mlflow}},
        }
    )


def _history(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]


def test_a_run_stopped_by_sigterm_and_resumed_is_one_mlflow_run_with_every_step_once(
    mlflow_server, tmp_path, small_csv, minilm_killed
):
    """Started with --no-resume into a copy of conftest.minilm_killed's output (another job's
    checkpoints, which it must not resume: it clears them and starts over), stopped by SIGTERM after a
    checkpoint, run again: it resumes, and MLflow holds one run with every step once."""
    from mlflow.tracking import MlflowClient

    out = tmp_path / "out"
    shutil.copytree(minilm_killed.copy, out)
    old = sorted(p.name for p in (out / "checkpoints").glob("step-*") if (p / "COMPLETE").exists())
    assert old
    raw = _spec(small_csv, out, mlflow_server, "resume")
    del raw["tracking"]["mlflow"]["uri"]  # the server from the environment, with credentials in its URL
    spec = write_spec(tmp_path / "job.yaml", raw)
    host = mlflow_server.removeprefix("http://")
    env = {"MLFLOW_TRACKING_URI": f"http://alice:{SECRET}@{host}"}
    proc = start_run(spec, env, "--no-resume")
    wait_for_checkpoint(out, 3, proc)
    os.kill(proc.pid, signal.SIGTERM)  # preemption: a checkpoint at the next step, exit 143
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert f"starting over (--no-resume): removing the earlier run's {len(old)} checkpoint(s)" in err
    assert "resumed" not in err
    assert "stopped:" in err and "run the same command again to resume" in err  # `kubetune run`'s stop message
    again = kubetune("run", str(spec), env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "MLflow: continuing run" in again.stderr
    assert f"(http://***@{host}/#/experiments/runs/" in again.stderr  # the run's address, its password left out
    # The password is nowhere: not in the log, any file the run wrote, or the MLflow run.
    assert SECRET not in err + again.stdout + again.stderr
    assert not [p for p in out.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]

    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("resume")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1  # the resumed run continued the same MLflow run
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny"
    history = _history(out)
    train = {h["step"]: h for h in history if h["type"] == "train"}
    evals = {h["step"]: h for h in history if h["type"] == "eval"}
    losses = client.get_metric_history(run.info.run_id, "train/loss")
    steps = [m.step for m in losses]
    assert sorted(steps) == list(range(1, 9)) == sorted(train)  # no gap, no duplicate
    # history.jsonl too: this run's steps, once each (nothing of the run --no-resume replaced)
    assert [h["step"] for h in history if h["type"] == "train"] == list(range(1, 9))
    assert not (out / "checkpoints").exists()  # a finished run clears its checkpoints
    assert all(abs(m.value - train[m.step]["loss"]) < 1e-9 for m in losses)
    lrs = client.get_metric_history(run.info.run_id, "train/lr")
    assert sorted(m.step for m in lrs) == steps
    accuracy = client.get_metric_history(run.info.run_id, "eval/accuracy")
    assert sorted(m.step for m in accuracy) == sorted(evals) and len(evals) >= 3
    assert all(abs(m.value - evals[m.step]["eval_accuracy"]) < 1e-9 for m in accuracy)
    params, tags = run.data.params, run.data.tags
    resolved = yaml.safe_load((out / "job.yaml").read_text())  # the resolved spec, flattened into params
    assert float(params["training.learning_rate"]) == resolved["training"]["learning_rate"]
    assert params["distributed.procs_per_node"] == "2" and params["task"] == "sequence-classification"
    assert tags["kubetune.world_size"] == "2" and tags["kubetune.device"] == "cpu" and tags["team"] == "nlp"
    assert tags["kubetune.output_uri"] == str(out)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"metrics.json", "job.yaml", "report.html", "plots"} <= artifacts
    local = client.download_artifacts(run.info.run_id, "metrics.json", str(tmp_path))
    assert json.loads(Path(local).read_text()) == json.loads((out / "metrics.json").read_text())
    recorded = json.dumps([run.data.params, run.data.tags, run.data.metrics, run.info.to_proto().__str__()])
    downloaded = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / "all")))
    assert SECRET not in recorded
    assert not [p for p in downloaded.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]


class _Refusing(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(401)
        self.send_header("WWW-Authenticate", 'Basic realm="mlflow"')
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_POST = do_GET

    def log_message(self, *args):
        pass


def test_a_server_that_is_down_or_refuses_the_credentials_is_one_line_before_training(tmp_path, small_csv):
    """Down: a port nothing listens on. Refusing: a stand-in answering 401 as an MLflow server
    with basic auth does (its auth app needs a user database set up; the client sees only the 401)."""
    down = f"http://127.0.0.1:{_free_port()}"
    spec = write_spec(tmp_path / "down.yaml", _spec(small_csv, tmp_path / "out1", down, "x"))
    r = kubetune("run", str(spec))
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith(f"error: tracking.mlflow.uri: cannot reach the MLflow server at {down}")
    assert not (tmp_path / "out1").exists()  # nothing written: it failed before the workers started

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        uri = f"http://127.0.0.1:{server.server_address[1]}"
        spec = write_spec(tmp_path / "refused.yaml", _spec(small_csv, tmp_path / "out2", uri, "x"))
        r = kubetune("run", str(spec), env={"MLFLOW_TRACKING_USERNAME": "u", "MLFLOW_TRACKING_PASSWORD": "s3cr3t-pw"})
    finally:
        server.shutdown()
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert f"the MLflow server at {uri} refused the credentials (HTTP 401)" in lines[0]
    assert "MLFLOW_TRACKING_PASSWORD" in lines[0] and "s3cr3t-pw" not in r.stderr


def test_a_server_lost_mid_run_does_not_stop_training_and_the_gap_is_reported(mlflow_server, tmp_path):
    """The logger alone (rank 0's), against the real server, which then goes away: each failed
    send costs no retries, training goes on, and the end says which steps are missing."""
    import logging

    spec = _logger_spec("lost", mlflow_server, str(tmp_path / "out"))
    runs: dict = {}
    logger = MLflowLogger(spec, runs, {"world_size": 1})
    logger.log("train", 1, {"loss": 1.0, "lr": 0.1}, {})
    from mlflow.tracking import MlflowClient

    # the server goes away: its address answers nothing from now on
    logger.client = MlflowClient(tracking_uri=f"http://127.0.0.1:{_free_port()}")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("kubetune.training.tracking").addHandler(handler)
    try:
        t = time.perf_counter()
        for step in (2, 3, 4):
            logger.log("train", step, {"loss": 0.5, "lr": 0.1}, {})
        assert time.perf_counter() - t < 10  # no retries with back-off
        logger.finish(tmp_path, status="FINISHED")
    finally:
        logging.getLogger("kubetune.training.tracking").removeHandler(handler)
    said = [r.getMessage() for r in records]
    assert any("could not send the metrics of step 2" in m for m in said), said
    assert any("the metrics of 3 log steps (2..4) did not reach" in m for m in said), said
    kept = MlflowClient(tracking_uri=mlflow_server).get_metric_history(runs["mlflow"], "train/loss")
    assert [m.step for m in kept] == [1]


def test_the_model_is_registered_by_its_output_uri(mlflow_server, tmp_path):
    """tracking.mlflow.register_model: a registry version whose source is the s3:// output (the
    model is referenced where it is, not copied); a local output is refused by the spec."""
    from mlflow.tracking import MlflowClient

    from kubetune.config import parse_spec
    from kubetune.errors import SpecError

    raw = {
        "name": "reg",
        "model": {"uri": "m"},
        "data": {"train": "t.csv"},
        "output": {"uri": "s3://models/reg"},
        "tracking": {"mlflow": {"uri": mlflow_server, "experiment": "reg", "register_model": "reg-model"}},
    }
    runs: dict = {}
    logger = MLflowLogger(parse_spec(raw), runs, {"world_size": 1})
    logger.finish(tmp_path)  # nothing to upload in tmp_path: the registration and the run's end only
    client = MlflowClient(tracking_uri=mlflow_server)
    versions = client.search_model_versions("name='reg-model'")
    assert [(v.version, v.source, v.run_id) for v in versions] == [("1", "s3://models/reg", runs["mlflow"])]
    assert client.get_run(runs["mlflow"]).info.status == "FINISHED"
    with pytest.raises(SpecError) as e:
        parse_spec({**raw, "output": {"uri": str(tmp_path / "out")}})
    assert "tracking.mlflow.register_model needs output.uri on s3://" in " ".join(e.value.lines())


def test_a_checkpoints_run_that_the_server_no_longer_has_starts_a_new_one(mlflow_server, tmp_path):
    from mlflow.tracking import MlflowClient

    spec = _logger_spec("gone", mlflow_server, str(tmp_path / "out"))
    client = MlflowClient(tracking_uri=mlflow_server)
    first: dict = {}
    MLflowLogger(spec, first, {}).finish(tmp_path, status="KILLED")
    client.delete_run(first["mlflow"])  # someone deleted it in the UI before the job resumed
    runs = dict(first)
    MLflowLogger(spec, runs, {})
    assert runs["mlflow"] != first["mlflow"] and client.get_run(runs["mlflow"]).info.status == "RUNNING"
    runs = {"mlflow": "0" * 32}  # never on this server
    MLflowLogger(spec, runs, {})
    assert runs["mlflow"] != "0" * 32
