"""Bad input through the real CLI: one line naming field, value and fix; exit 2; no traceback;
nothing written to the output directory."""

from __future__ import annotations

import pytest
from conftest import kubetune, tiny_spec, write_spec

pytestmark = pytest.mark.integration


def _case_unknown_field(tmp, csv):
    s = tiny_spec(csv, tmp / "out")
    s["training"]["batchsize"] = 8
    return s, "training.batchsize: unknown key — did you mean 'training.batch_size'?"


def _case_mistyped(tmp, csv):
    s = tiny_spec(csv, tmp / "out")
    s["training"]["epochs"] = "many"
    return s, "training.epochs: Input should be a valid integer, unable to parse string as an integer (got 'many')"


def _case_missing_file(tmp, csv):
    return tiny_spec(
        tmp / "nope.csv", tmp / "out"
    ), f"data.train: data file or directory '{tmp / 'nope.csv'}' does not exist"


def _case_missing_column(tmp, csv):
    s = tiny_spec(csv, tmp / "out")
    s["data"]["text_column"] = "review"
    return s, "data.text_column: column 'review' not found in"


def _case_empty_dataset(tmp, csv):
    (tmp / "empty.csv").write_text("text,sentiment\n")
    return tiny_spec(tmp / "empty.csv", tmp / "out"), "has no rows"


def _case_single_class(tmp, csv):
    (tmp / "one.csv").write_text("text,sentiment\n" + "".join(f"row {i},positive\n" for i in range(20)))
    return tiny_spec(tmp / "one.csv", tmp / "out"), "data.label_column: only one class ('positive')"


def _case_model_missing(tmp, csv):
    s = tiny_spec(csv, tmp / "out")
    s["model"]["uri"] = str(tmp / "no-model")
    return s, f"model.uri: model directory '{tmp / 'no-model'}' does not exist"


def _case_model_not_cached(tmp, csv):
    s = tiny_spec(csv, tmp / "out")
    s["model"]["uri"] = "hf://google-bert/bert-base-cased"
    return s, "model.uri: hf://google-bert/bert-base-cased is not in the local Hugging Face cache"


CASES = [
    _case_unknown_field,
    _case_mistyped,
    _case_missing_file,
    _case_missing_column,
    _case_empty_dataset,
    _case_single_class,
    _case_model_missing,
    _case_model_not_cached,
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__.removeprefix("_case_"))
def test_bad_input_one_line_exit_2(tmp_path, small_csv, case):
    spec, expected = case(tmp_path, small_csv)
    proc = kubetune("run", str(write_spec(tmp_path / "job.yaml", spec)))
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and expected in lines[-1], proc.stderr
    assert sum(line.startswith("error: ") for line in lines) == 1
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing written before the input was checked


def test_broken_yaml(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("name: x\ntraining:\n  epochs: 1\n   batch_size: 2\n")
    for cmd in ("run", "validate"):
        proc = kubetune(cmd, str(path))
        assert proc.returncode == 2
        assert proc.stderr.strip().startswith(f"error: spec: {path} line 4 column")
        assert "fix the YAML syntax" in proc.stderr and "Traceback" not in proc.stderr


def test_validate_ok_and_all_errors(tmp_path, small_csv):
    good = write_spec(tmp_path / "good.yaml", tiny_spec(small_csv, tmp_path / "out"))
    proc = kubetune("validate", str(good))
    assert (proc.returncode, proc.stdout.strip()) == (0, "ok")
    proc = kubetune("validate", str(good), "--set", "training.learnig_rate=1", "--set", "distributed.nodes=0")
    assert proc.returncode == 2
    errors = proc.stderr.splitlines()
    assert len(errors) == 2  # both problems, reported together
    assert any(
        e.startswith("error: distributed.nodes: Input should be greater than or equal to 1 (got 0)") for e in errors
    )
    assert "error: training.learnig_rate: unknown key — did you mean 'training.learning_rate'?" in errors


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["predict", "x", "--temperature", "-1", "hi"],
            "error: Invalid value for '--temperature': Input should be greater than or equal to 0 — see `kubetune predict --help`",
        ),
        (["run"], "error: Missing argument 'SPEC'. — see `kubetune run --help`"),
        (["runn", "x"], "error: No such command 'runn'. Did you mean 'run'? — see `kubetune --help`"),
        (["run", "job.yaml", "--bogus"], "error: No such option: --bogus — see `kubetune run --help`"),
    ],
)
def test_usage_errors_are_one_line(args, expected):
    """click would draw a multi-line box around these; kubetune says them in one line (exit 2)."""
    proc = kubetune(*args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [expected]
