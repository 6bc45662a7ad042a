"""Issue 63, `kubetune tune` run again over its output: one real study whose trial's `kubetune run` fails at once (its
model directory is missing, so no trial trains and the module takes seconds), then that study continued, rerun with
another objective or direction, renamed, or started over beside its old trials. A failed trial is one line naming
why (Optuna's warning and traceback are not printed); a changed objective, direction or name is refused in one line;
a new study's trials never take an earlier one's folders. (The directory checks that need no trial:
tests/unit/test_hardening_pass4_tune.py; a study that trains, killed and continued: tests/integration/test_tune.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import optuna
import pytest
from conftest import kubetune, write_spec
from typer.testing import CliRunner

from kubetune import tune
from kubetune.cli import app
from kubetune.config.load import parse_spec
from kubetune.errors import KubetuneError

pytestmark = pytest.mark.integration


def _raw(out: Path, **tune_section) -> dict:
    return {
        "name": "tiny",
        "task": "sequence-classification",
        "model": {"uri": str(out.parent / "no-such-model")},  # the trial's run stops at its preflight
        "data": {"train": str(out.parent / "reviews.csv"), "text_column": "text", "label_column": "sentiment"},
        "training": {"epochs": 1, "eval_every": 3},
        "distributed": {"nodes": 1, "procs_per_node": 1},
        "output": {"uri": str(out)},
        "tune": {
            "space": {"training.learning_rate": {"type": "float", "low": 1e-5, "high": 1e-3, "log": True}},
            "objective": "eval_loss",
            "algorithm": "random",
            "trials": 1,
            "max_failed": 1,
            **tune_section,
        },
    }


@pytest.fixture(scope="module")
def failed_study(tmp_path_factory):
    """A study of one trial, run by the real command line; its trial failed. Returns (its directory, the run)."""
    root = tmp_path_factory.mktemp("study")
    out = root / "study"
    r = kubetune("tune", str(write_spec(root / "job.yaml", _raw(out))), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r


def _copy(failed_study, tmp_path: Path) -> Path:
    out = tmp_path / "study"
    shutil.copytree(failed_study[0], out)
    return out


def test_a_failed_trial_is_one_line_naming_why_without_optunas_traceback(failed_study):
    out, r = failed_study
    lines = r.stderr.splitlines()
    failed = [line for line in lines if "failed" in line.lower()]
    assert len(failed) == 1, r.stderr[-3000:]
    assert failed[0].split(" ", 1)[1].startswith("tune: trial 0 failed (exit 2): error: model.uri: model directory")
    assert "no-such-model' does not exist" in failed[0]
    assert "Traceback" not in r.stderr and not [line for line in lines if line.startswith("[W ")], r.stderr[-3000:]
    (trial,) = json.loads((out / "tune.json").read_text())["trials"]
    assert trial["state"] == "fail" and "does not exist" in trial["error"]


def test_the_same_study_run_again_continues_in_its_own_output(failed_study, tmp_path):
    out = _copy(failed_study, tmp_path)
    data, where = tune.run(parse_spec(_raw(out)))
    assert where == out.resolve() and [t["state"] for t in data["trials"]] == ["fail"]  # nothing run again
    assert (data["study"], data["objective"], data["direction"]) == ("tiny", "eval_loss", "minimize")
    shown = CliRunner().invoke(app, ["tune", str(write_spec(tmp_path / "job.yaml", _raw(out))), "--status", "--json"])
    assert shown.exit_code == 0, shown.output
    assert [t["state"] for t in json.loads(shown.stdout)["trials"]] == ["fail"]


@pytest.mark.parametrize(
    "change, field, says",
    [
        ({"objective": "train_loss"}, "tune.objective", "optimizes eval_loss (minimize), and tune.objective is "),
        ({"objective": "eval_accuracy"}, "tune.objective", "set tune.objective: eval_loss to continue that study"),
        ({"direction": "maximize"}, "tune.direction", "is set to minimize eval_loss, and the spec says maximize"),
    ],
)
def test_a_rerun_with_another_objective_or_direction_is_refused_in_one_line(
    failed_study, tmp_path, change, field, says
):
    out = _copy(failed_study, tmp_path)
    before = (out / "tune.json").read_bytes()
    with pytest.raises(KubetuneError) as e:
        tune.run(parse_spec(_raw(out, **change)))
    text = str(e.value)
    assert e.value.field == field and says in text and "\n" not in text, text
    assert "give output.uri a new directory" in e.value.fix
    assert (out / "tune.json").read_bytes() == before  # no report under the other objective's name
    stored = optuna.load_study(study_name="tiny", storage=f"sqlite:///{out / 'study.db'}")
    assert stored.direction.name == "MINIMIZE" and len(stored.trials) == 1


def test_a_renamed_study_in_the_same_output_is_refused(failed_study, tmp_path):
    out = _copy(failed_study, tmp_path)
    spec_before = (out / "specs" / "trial-000.yaml").read_bytes()
    raw = _raw(out)
    raw["name"] = "tiny-2"
    with pytest.raises(KubetuneError) as e:
        tune.run(parse_spec(raw))
    assert e.value.field == "name" and f"{out.resolve()} holds study 'tiny', not 'tiny-2'" in str(e.value)
    assert e.value.fix == "set name: tiny to continue that study, or give output.uri a new directory"
    assert sorted(p.name for p in (out / "trials").iterdir()) == ["trial-000"]
    assert (out / "specs" / "trial-000.yaml").read_bytes() == spec_before
    assert optuna.get_all_study_names(f"sqlite:///{out / 'study.db'}") == ["tiny"]


def test_a_new_study_beside_an_earlier_ones_trials_takes_folders_of_its_own(failed_study, tmp_path):
    """The user removed study.db to start over: the earlier trial's folder, spec and log stay as they were, and the
    new trial 0 runs in trial-000.2."""
    out = _copy(failed_study, tmp_path)
    (out / "study.db").unlink()
    (out / "trials" / "trial-000").mkdir(exist_ok=True)
    (out / "trials" / "trial-000" / "metrics.json").write_text('{"eval_loss": 0.125}\n')  # as if it had finished
    old = {
        p: p.read_bytes()
        for p in (
            out / "specs" / "trial-000.yaml",
            out / "logs" / "trial-000.log",
            out / "trials" / "trial-000" / "metrics.json",
        )
    }
    data, _ = tune.run(parse_spec(_raw(out)))
    (trial,) = data["trials"]
    assert trial["number"] == 0 and trial["dir"] == str(out.resolve() / "trials" / "trial-000.2"), trial
    assert trial["state"] == "fail" and trial["value"] is None  # not the earlier trial's 0.125
    assert {p: p.read_bytes() for p in old} == old
    assert (out / "specs" / "trial-000.2.yaml").is_file() and (out / "logs" / "trial-000.2.log").is_file()
