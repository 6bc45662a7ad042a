"""Issue 63, evaluation without scoring anything: the per-sample log of a task named `../../../x` stays in the
run; `kubetune eval`'s settings, processes and `--output` are checked before the model is even looked at (one
line, exit 2); a task directory's YAML that is latin-1 or a FIFO, and an adapter_config.json that is not an object
naming its base model, are one line; the guide says that a task folder runs Python and what a stop signal during
an evaluation waits for. (What needs the harness to score or load tasks: tests/integration/
test_hardening_pass4_eval_harness.py.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import ROOT, kubetune
from typer.testing import CliRunner

from kubetune.cli import app
from kubetune.config.load import parse_spec
from kubetune.errors import KubetuneError, SpecError
from kubetune.evaluation.suites import stage
from kubetune.inference.model import adapter_beside
from kubetune.training.scoring import write_samples

ROWS = [{"doc_id": 0, "target": "positive", "resps": [["positive"]]}, {"doc_id": 1, "target": "négatif"}]


@pytest.mark.parametrize("task", ["../../../x", "a/b", "..", "ABSOLUTE", "arc_easy"])
def test_the_samples_of_any_task_name_stay_inside_the_runs_folder(tmp_path, task):
    run = tmp_path / "a" / "b" / "c" / "run"
    run.mkdir(parents=True)
    task = str(tmp_path / "x") if task == "ABSOLUTE" else task  # an absolute name, which a plain join would follow
    write_samples(run / "lm_eval_samples", {task: ROWS})
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    (only,) = written  # one file, and it is in lm_eval_samples itself, not beside or above it
    assert only.parent == run / "lm_eval_samples", written
    assert [json.loads(line) for line in only.read_text().splitlines()] == ROWS
    if task == "arc_easy":
        assert only.name == "arc_easy.jsonl"  # a plain name is kept as it is


def _eval(*args: str):
    """`kubetune eval ARGS` in this process (the real process: the --seed cases, which click answers)."""
    r = CliRunner().invoke(app, ["eval", *args])
    return r.exit_code, r.stdout, r.stderr, r.exception


def _one_line(r, *fragments: str) -> str:
    if not isinstance(r, tuple):  # a CompletedProcess
        r = (r.returncode, r.stdout, r.stderr, None)
    code, out, err, exception = r
    assert code == 2, (code, out[-500:], err[-2000:], repr(exception))
    (line,) = err.strip().splitlines()
    assert line.startswith("error: ") and all(f in line for f in fragments), line
    return line


# Each refused before the model is looked at: the model given does not exist, and the error is not about it.
@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--limit", "0"], ["--limit: got 0.0", "greater than 0"]),
        (["--limit", "inf"], ["--limit: got inf", "finite number"]),
        (["--limit", "nan"], ["--limit", "finite number"]),
        (["--limit", "1e30"], ["--limit: got 1e+30", "less than or equal to 1000000000"]),
        (["--num-fewshot", "1000000000"], ["--num-fewshot: got 1000000000", "less than or equal to 1000"]),
        (["--num-fewshot", "-1"], ["--num-fewshot: got -1", "greater than or equal to 0"]),
        (["--batch-size", "0"], ["--batch-size: got 0"]),
        (["--seed", "-1"], ["'--seed'", "greater than or equal to 0"]),
        (["--seed", "4294967296"], ["'--seed'", "less than or equal to 4294967295"]),
        (["--procs", str((os.cpu_count() or 1) + 1)], ["--procs:", "set --procs to at most"]),
        (["--procs", "64"], ["--procs: 64 processes need 64", "set --procs to at most"]),
    ],
)
def test_eval_settings_out_of_bounds_are_one_line_before_the_model_is_read(tmp_path, args, fragments):
    if args[:2] == ["--procs", "64"] and (os.cpu_count() or 1) >= 64:
        args = ["--procs", "100000"]
        fragments = ["--procs: 100000 processes need 100000", "set --procs to at most"]
    model = str(tmp_path / "no-model")
    if args[0] == "--seed":  # click's own range check: through kubetune's main, as a user meets it
        r = kubetune("eval", model, "--tasks", "arc_easy", *args)
    else:
        r = _eval(model, "--tasks", "arc_easy", *args)
    line = _one_line(r, *fragments)
    assert "no-model" not in line


def test_eval_output_is_checked_before_the_model_is_read(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "mine.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    os.mkfifo(tmp_path / "fifo")
    cases = [
        (tmp_path / "dir", ["is a directory", f"e.g. --output {tmp_path / 'dir' / 'results.json'}"]),
        (tmp_path / "missing" / "deeper" / "r.json", ["the folder", "does not exist, nor its parent", "mkdir -p"]),
        (tmp_path / "file" / "r.json", [f"{tmp_path / 'file'} is not a directory"]),
        (tmp_path / "fifo", ["is a FIFO (named pipe), not a regular file"]),
        (Path("/dev/null"), ["/dev/null is a character device, not a regular file"]),
        (Path("/proc/kubetune-results.json"), ["cannot write in /proc"]),
    ]
    for output, fragments in cases:
        line = _one_line(
            _eval(str(tmp_path / "no-model"), "--tasks", "arc_easy", "--output", str(output)), "--output", *fragments
        )
        assert "no-model" not in line
    # nothing was written, replaced or left behind
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["dir", "fifo", "file", "mine.txt"]
    assert (tmp_path / "file").read_text() == "mine" and (tmp_path / "dir" / "mine.txt").read_text() == "mine"
    assert Path("/dev/null").is_char_device()
    # a missing folder whose parent exists is made for the results, and removed again when nothing is written
    r = _eval(
        str(tmp_path / "m"),
        "--tasks",
        "t",
        "--include-path",
        str(tmp_path / "none"),
        "-o",
        str(tmp_path / "new" / "r.json"),
    )
    _one_line(r, "--include-path:", "is not a directory")
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize(
    "name, content, fragments",
    [
        ("other.yaml", b"task: caf\xe9\n", ["other.yaml is not UTF-8 text (byte 0xe9 at offset 9)", "iconv"]),
        ("deep/other.yml", b"task: \xff\n", ["other.yml is not UTF-8 text (byte 0xff at offset 6)"]),
        ("zz.yaml", None, ["zz.yaml is a FIFO (named pipe), not a regular file", "remove it"]),
    ],
)
def test_a_task_yaml_that_is_not_utf8_or_not_a_file_is_one_line(tmp_path, name, content, fragments):
    """The harness opens every *.yaml of the directory when it indexes it: a FIFO held `kubetune eval` for ever."""
    (tmp_path / "tasks" / "deep").mkdir(parents=True)
    (tmp_path / "tasks" / "mine.yaml").write_text("task: mine\ndataset_path: json\n")
    if content is None:
        os.mkfifo(tmp_path / "tasks" / name)
    else:
        (tmp_path / "tasks" / name).write_bytes(content)
    with pytest.raises(KubetuneError) as e:
        stage(str(tmp_path / "tasks"), field="--include-path")
    assert str(e.value).startswith("--include-path: the task YAML ") and "\n" not in str(e.value)
    assert all(f in str(e.value) for f in fragments), str(e.value)


@pytest.mark.parametrize(
    "content, fragments",
    [
        (b'{"base_model_name_or_path": ', ["is not valid JSON (Expecting value at line 1"]),
        (b"[]", ["holds a JSON list, not an object"]),
        (b'{"base_model_name_or_path": 3}', ["names no base model (base_model_name_or_path)"]),
        (b'{"r": 8}', ["names no base model"]),
        (b"\xff\xfe{}", ["is not UTF-8 text"]),
        (b'{"base_model_name_or_path": " "}', ["names no base model"]),
    ],
)
def test_an_adapter_config_that_names_no_base_model_is_one_line(tmp_path, content, fragments):
    (tmp_path / "model").mkdir()
    (tmp_path / "adapter").mkdir()
    config = tmp_path / "adapter" / "adapter_config.json"
    config.write_bytes(content)
    with pytest.raises(KubetuneError) as e:
        adapter_beside(tmp_path / "model")
    assert str(e.value).startswith("--adapter: ") and "\n" not in str(e.value)
    assert all(f in str(e.value) for f in fragments) and "drop --adapter" in str(e.value), str(e.value)


@pytest.mark.parametrize("limit", [float("inf"), float("nan"), 1e30])
def test_a_limit_the_harness_cannot_take_is_refused_in_the_spec(limit):
    spec = {
        "name": "scored",
        "task": "causal-lm",
        "model": {"uri": "/models/llama"},
        "data": {"train": "chat.jsonl", "format": "chat"},
        "output": {"uri": "/tmp/runs/scored"},
        "evaluation": {"tasks": ["arc_easy"], "limit": limit},
    }
    with pytest.raises(SpecError) as e:
        parse_spec(spec)
    assert "evaluation.limit" in str(e.value), str(e.value)


def test_the_guide_says_a_task_folder_runs_python_and_what_a_stop_waits_for():
    """As the GRPO guide says of reward functions: where the code runs, with which rights, s3:// too; and, as
    grpo.reward_timeout_s does, the grace period a stop signal during an evaluation needs."""
    guide = (ROOT / "docs" / "guides" / "evaluation.md").read_text()
    paragraphs = [" ".join(p.split()) for p in guide.split("\n\n")]
    (code,) = [p for p in paragraphs if "A task folder is code" in p]
    for said in ("`!function utils.process_docs`", "with the job's rights", "s3://", "every training process"):
        assert said in code, said
    (stop,) = [p for p in paragraphs if "A stop signal during an evaluation" in p]
    assert "termination_grace_period_seconds" in stop and "30 s" in stop
    from kubetune.config.schema import EvaluationSpec

    assert "grace period" in EvaluationSpec.model_fields["every"].description
