"""A task added from outside src/: tests/toy_task holds a regression task (a number per text)
that no file in src/ names. An entry point of the group ``kubetune.tasks`` (a ``.dist-info``
directory on PYTHONPATH, as an installed plugin distribution has) registers it, and the real CLI
then validates its spec, trains it on 2 processes, exports it, writes its report and predicts
with it, as for a built-in task."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from conftest import MINILM, ROOT, kubetune, kubetune_together, tiny_spec, write_spec

pytestmark = pytest.mark.integration

TOY = ROOT / "tests" / "toy_task"


def _registered(site: Path, entry: str) -> dict:
    """The environment of a process in which the toy task is registered as ``entry`` (of its package)."""
    info = site / "kubetune_toy_regression-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kubetune-toy-regression\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[kubetune.tasks]\nregression = kubetune_toy_regression:{entry}\n")
    path = os.pathsep.join(p for p in (str(site), str(TOY), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path}


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory) -> dict:
    return _registered(tmp_path_factory.mktemp("site"), "ENTRY")


@pytest.fixture(scope="module")
def bare_env(tmp_path_factory) -> dict:
    """The toy task registered by an entry that names no starter."""
    return _registered(tmp_path_factory.mktemp("bare-site"), "BARE")


def _spec(train: Path, out: Path, **extra) -> dict:
    return {
        "name": "toy-regression",
        "task": "regression",
        "model": {"uri": MINILM},
        "data": {"train": str(train), "target_column": "confidence", "eval_fraction": 0.25, "max_length": 32},
        "training": {"epochs": 1, "batch_size": 8, "learning_rate": 1e-4, "log_every": 2, "seed": 7},
        "distributed": {"nodes": 1, "procs_per_node": 2},
        "output": {"uri": str(out)},
        **extra,
    }


def test_nothing_in_src_names_the_toy_task():
    from kubetune.config.tasks import entries

    assert "regression" not in entries()  # this process has no plugin: the task comes only from outside
    for path in (ROOT / "src").rglob("*.py"):
        assert "toy_regression" not in path.read_text(encoding="utf-8"), path


def test_its_spec_is_validated_with_its_own_sections(plugin_env, small_csv, tmp_path):
    good = write_spec(tmp_path / "good.yaml", _spec(small_csv, tmp_path / "out", regression={"target_scale": 2.0}))
    proc = kubetune("validate", str(good), env=plugin_env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    bad = _spec(small_csv, tmp_path / "out", regression={"target_scale": 0})
    bad["data"]["label_column"] = "sentiment"  # a classification key: not the regression task's
    proc = kubetune("validate", str(write_spec(tmp_path / "bad.yaml", bad)), env=plugin_env)
    assert proc.returncode == 2
    assert "regression.target_scale" in proc.stderr and "data.label_column" in proc.stderr, proc.stderr
    # the task's own cross check, and the task unknown without the plugin
    same = _spec(small_csv, tmp_path / "out")
    same["data"]["text_column"] = "confidence"
    proc = kubetune("validate", str(write_spec(tmp_path / "same.yaml", same)), env=plugin_env)
    assert "data.target_column must differ from data.text_column" in proc.stderr, proc.stderr
    proc = kubetune("validate", str(good))
    assert proc.returncode == 2 and "task" in proc.stderr and "regression" in proc.stderr, proc.stderr


def test_init_writes_its_own_starter_or_one_built_from_its_entry(plugin_env, bare_env, small_csv, tmp_path):
    own, built = tmp_path / "own.yaml", tmp_path / "built.yaml"
    first, second = kubetune_together(
        (("init", "regression", "-o", str(own)), plugin_env), (("init", "regression", "-o", str(built)), bare_env)
    )
    assert first.returncode == 0 and second.returncode == 0, first.stderr[-2000:] + second.stderr[-2000:]
    assert own.read_text() == (TOY / "kubetune_toy_regression" / "starter.yaml").read_text()
    assert "fill in model.uri and data.train, then check it" in second.stdout
    text = built.read_text()
    assert "  target_column: target\n" in text and "#   target_scale: 1.0\n" in text  # its data field, its section
    raw = yaml.safe_load(text)
    filled = write_spec(
        tmp_path / "filled.yaml", {**raw, "model": {"uri": MINILM}, "data": {**raw["data"], "train": str(small_csv)}}
    )
    ok, unfilled, filled_ok = kubetune_together(
        (("validate", str(own)), plugin_env),
        (("validate", str(built)), bare_env),
        (("validate", str(filled)), bare_env),
    )
    assert ok.returncode == 0 and filled_ok.returncode == 0, ok.stderr[-2000:] + filled_ok.stderr[-2000:]
    assert unfilled.returncode == 2 and "model.uri:" in unfilled.stderr and "data.train:" in unfilled.stderr


@pytest.mark.e2e  # make test: its spec validated through the registry (above); each shipped task trains there
def test_it_trains_on_two_processes_exports_reports_and_predicts(plugin_env, small_csv, tmp_path):
    out = tmp_path / "out"
    spec = write_spec(tmp_path / "job.yaml", _spec(small_csv, out, regression={"target_scale": 2.0}))
    proc = kubetune("run", str(spec), env=plugin_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["task"] == "regression" and metrics["world_size"] == 2
    assert metrics["eval_mse"] > 0 and metrics["eval_mae"] > 0 and metrics["eval_samples"] == metrics["eval_rows"]
    # the targets (confidence in [0, 1]) were doubled by the task's own section
    assert 2 * 0.3 < metrics["target_mean"] <= 2.0
    saved = yaml.safe_load((out / "job.yaml").read_text())
    assert saved["task"] == "regression" and saved["regression"] == {"target_scale": 2.0}
    assert (out / "model" / "model.safetensors").exists() and (out / "plots" / "eval_metrics.png").exists()
    # the file its export writes beside kubetune's own (Task.artifact_files) arrived with them
    residuals = (out / "residuals.csv").read_text().splitlines()
    assert residuals[0] == "row,target,predicted,residual" and len(residuals) == 1 + metrics["eval_rows"]
    assert "eval MSE" in (out / "report.html").read_text()

    # a prediction, and the task's own options: a generation option is refused for this model (at the same time)
    proc, refused = kubetune_together(
        (("predict", str(out), "--json", "great flight, thanks", "lost my bag again"), plugin_env),
        (("predict", str(out), "--seed", "3", "a text"), plugin_env),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout)
    assert [r["text"] for r in results] == ["great flight, thanks", "lost my bag again"]
    assert all(isinstance(r["value"], float) for r in results)
    assert refused.returncode == 2 and "--seed" in refused.stderr, refused.stderr

    # served as its task's inference says (KServe v1 and v2, its own output), with no line of src/ naming it
    from test_serve import Server

    server = Server(out, "--name", "toy", env=plugin_env).wait()
    try:
        texts = [r["text"] for r in results]
        status, v1 = server.call("/v1/models/toy:predict", {"instances": texts})
        assert status == 200, v1
        assert [p["value"] for p in v1["predictions"]] == pytest.approx([r["value"] for r in results], abs=1e-4)
        tensor = {"name": "text", "shape": [2], "datatype": "BYTES", "data": texts}
        status, v2 = server.call("/v2/models/toy/infer", {"inputs": [tensor]})
        assert status == 200 and [o["name"] for o in v2["outputs"]] == ["value"], v2
        assert v2["outputs"][0]["data"] == pytest.approx([r["value"] for r in results], abs=1e-4)
        status, wrong = server.call("/v2/models/toy/infer", {"inputs": [tensor], "outputs": [{"name": "label"}]})
        assert status == 400 and "its outputs are 'value'" in wrong["error"], wrong
    finally:
        server.stop()

    # replaced by another task's run (--overwrite): the toy task's own file goes with the rest of its run
    clf = write_spec(tmp_path / "clf.yaml", tiny_spec(small_csv, out, output__overwrite=True))
    proc = kubetune("run", str(clf), env=plugin_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "metrics.json").read_text())["task"] == "sequence-classification"
    assert not (out / "residuals.csv").exists() and (out / "model" / "model.safetensors").exists()
