"""The output destination: kubetune refuses someone else's directory, never removes a finished run
without --overwrite, and deletes or replaces only its own entries."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from kubetune.artifacts import output
from kubetune.artifacts.output import Output
from kubetune.config import parse_spec
from kubetune.errors import KubetuneError


def _spec(out: Path, overwrite: bool = False, resume: str = "auto"):
    return parse_spec(
        {
            "name": "t",
            "model": {"uri": "hf://o/m"},
            "data": {"train": "t.csv"},
            "training": {"resume": resume},
            "output": {"uri": str(out), "overwrite": overwrite},
        }
    )


def _finished(out: Path) -> None:
    """A directory as a finished kubetune run leaves it."""
    (out / "model").mkdir(parents=True)
    (out / "model" / "model.safetensors").write_text("old weights")
    for name in ("metrics.json", "job.yaml", "history.jsonl", "report.html"):
        (out / name).write_text("{}")
    (out / output.MARKER).write_text("{}")


def _checkpoints(out: Path, *steps: int) -> None:
    for step in steps:
        d = out / "checkpoints" / f"step-{step:08d}"
        d.mkdir(parents=True)
        (d / "COMPLETE").write_text("{}")
    (out / output.MARKER).write_text("{}")


def _foreign(out: Path) -> None:
    (out / "model").mkdir(parents=True)
    (out / "model" / "thesis.tex").write_text("three years of work")


# (case, set-up, overwrite, resume, expected action or the error fragment)
CASES = [
    ("new directory", lambda out: None, False, "auto", "new"),
    ("empty directory", lambda out: out.mkdir(), False, "auto", "new"),
    (
        "someone else's directory",
        _foreign,
        False,
        "auto",
        "is not empty and was not created by kubetune (1 entry: 'model') — pick a new output.uri, or pass --overwrite",
    ),
    ("someone else's directory, --overwrite", _foreign, True, "auto", "adopt"),
    (
        "a finished run",
        _finished,
        False,
        "auto",
        "holds a finished run (metrics.json, model/) — pick a new output.uri, or pass --overwrite",
    ),
    ("a finished run, --overwrite", _finished, True, "auto", "replace"),
    ("an interrupted run", lambda out: _checkpoints(out, 3, 6), False, "auto", "resume"),
    ("an interrupted run, --no-resume", lambda out: _checkpoints(out, 3, 6), False, "never", "restart"),
    (
        "a failed run without checkpoints",
        lambda out: (out.mkdir(), (out / output.MARKER).write_text("{}"), (out / "history.jsonl").write_text("")),
        False,
        "auto",
        "restart",
    ),
    ("a file", lambda out: out.write_text("x"), False, "auto", "exists and is not a directory"),
]


@pytest.mark.parametrize("case, setup, overwrite, resume, expected", CASES, ids=[c[0] for c in CASES])
def test_what_a_run_may_do_with_its_output(tmp_path, case, setup, overwrite, resume, expected):
    out = tmp_path / "out"
    setup(out)
    before = _snapshot(tmp_path)
    spec = _spec(out, overwrite, resume)
    if " " in expected:
        with pytest.raises(KubetuneError) as e:
            Output.for_spec(spec).inspect(spec)
        assert str(e.value).startswith("output.uri: ") and expected in str(e.value) and "\n" not in str(e.value)
        assert _snapshot(tmp_path) == before  # refused: nothing touched
        return
    assert Output.for_spec(spec).inspect(spec).action == expected
    assert _snapshot(tmp_path) == before  # inspecting writes nothing
    dest = Output.resolve(spec.output.uri)
    plan = dest.claim(spec)
    assert dest.local == out and plan.action == expected and (out / output.MARKER).exists()
    if expected == "restart" and resume == "never":
        assert not (out / "checkpoints").exists()  # the earlier run's checkpoints, and only those
    if expected in ("replace", "adopt"):
        assert (out / "model").exists()  # the old model stays until the new run has finished


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def test_commit_replaces_only_kubetunes_entries_and_keeps_the_users(tmp_path):
    out = tmp_path / "out"
    _finished(out)
    (out / "adapter").mkdir()  # from an earlier LoRA run: stale after a full fine-tune
    (out / "notes.txt").write_text("mine")
    (out / "plots-of-mine").mkdir()
    staged = Output.resolve(str(out)).staging()
    (staged / "model").mkdir()
    (staged / "model" / "model.safetensors").write_text("new weights")
    (staged / "metrics.json").write_text(json.dumps({"eval_accuracy": 1.0}))
    Output.resolve(str(out)).commit(staged)
    assert (out / "model" / "model.safetensors").read_text() == "new weights"
    assert json.loads((out / "metrics.json").read_text()) == {"eval_accuracy": 1.0}
    assert not (out / "adapter").exists() and not staged.exists()
    assert (out / "notes.txt").read_text() == "mine" and (out / "plots-of-mine").is_dir()


def test_a_tasks_artifact_files_are_swapped_in_and_owned_and_no_other(tmp_path):
    """A task's own files (``Task.artifact_files``), named by the caller: this run's arrive, the replaced
    run's (its task's, named too) go; a file of the same kind that no task names is the user's and stays."""
    out = tmp_path / "out"
    _finished(out)
    for name in ("completions.jsonl", "residuals.csv", "samples.jsonl"):
        (out / name).write_text("old")
    staged = Output.resolve(str(out)).staging()
    (staged / "metrics.json").write_text("{}")
    (staged / "residuals.csv").write_text("new")
    Output.resolve(str(out)).commit(staged, ("residuals.csv", "completions.jsonl"))
    assert (out / "residuals.csv").read_text() == "new" and not (out / "completions.jsonl").exists()
    assert (out / "samples.jsonl").read_text() == "old" and (out / "metrics.json").read_text() == "{}"


@pytest.mark.parametrize(
    "name, problem",
    [
        ("../escape.csv", "is not a plain file name"),
        ("sub/file.csv", "is not a plain file name"),
        ("", "is not a plain file name"),
        ("..", "is not a plain file name"),
        ("checkpoints", "is one of kubetune's own names"),
        ("metrics.json", "is one of kubetune's own names"),
        (output.MARKER, "is one of kubetune's own names"),
        ("_kubetune_manifest.json", "is one of kubetune's own names"),
        ("residuals.csv", None),
    ],
)
def test_a_tasks_artifact_file_is_a_plain_name_of_its_own(tmp_path, name, problem):
    assert output.artifact_file_problem(name) == problem
    if problem:
        out = tmp_path / "out"
        _finished(out)
        staged = Output.resolve(str(out)).staging()
        with pytest.raises(ValueError, match=f"artifact file {name!r} of the task {problem}"):
            Output.resolve(str(out)).commit(staged, (name,))
        assert (out / "metrics.json").exists()  # refused before anything moved


def test_the_replaced_runs_task_names_the_files_it_leaves(tmp_path, caplog):
    from kubetune import tasks

    out = tmp_path / "out"
    dest = Output.resolve(str(out))
    assert dest.replaced_task() is None  # no output yet
    _finished(out)
    assert dest.replaced_task() is None  # metrics.json without a task (or unreadable): nothing known
    (out / "metrics.json").write_text(json.dumps({"task": "grpo", "eval_reward": 0.5}))
    assert dest.replaced_task() == "grpo" and tasks.artifact_files("grpo") == ("completions.jsonl",)
    assert tasks.artifact_files("sequence-classification") == () and tasks.artifact_files(None) == ()
    (out / "metrics.json").write_text(json.dumps({"task": "gone-plugin"}))
    with caplog.at_level("WARNING"):
        assert tasks.artifact_files(dest.replaced_task()) == ()  # its files are unknown: they stay
    assert "task 'gone-plugin', which does not load here (" in caplog.text


def test_clearing_checkpoints_removes_only_checkpoints(tmp_path):

    out = tmp_path / "out"
    _checkpoints(out, 3, 6)
    (out / "checkpoints" / ".step-00000009-abc").mkdir()  # a checkpoint being written when the run died
    (out / "checkpoints" / "README.txt").write_text("the user's")
    Output.resolve(str(out)).checkpoints.clear()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["README.txt"]


@pytest.mark.parametrize(
    "dest_setup, overwrite, expected",
    [
        (lambda d: None, False, None),
        (lambda d: d.mkdir(), False, None),
        (
            lambda d: (d.mkdir(), (d / "thesis.tex").write_text("x")),
            False,
            "DEST: {d} is not empty and was not written by kubetune (1 entry: 'thesis.tex') — pick a new directory, or pass --overwrite",
        ),
        (lambda d: (d.mkdir(), (d / "thesis.tex").write_text("x")), True, None),
        (
            lambda d: (d.mkdir(), (d / output.MARKER).write_text("{}"), (d / "config.json").write_text("{}")),
            False,
            None,
        ),  # an earlier pull
    ],
)
def test_pull_destination(tmp_path, dest_setup, overwrite, expected):
    dest = tmp_path / "pulled"
    dest_setup(dest)
    if expected is None:
        output.check_pull_dest(dest, overwrite)
    else:
        with pytest.raises(KubetuneError) as e:
            output.check_pull_dest(dest, overwrite)
        assert str(e.value) == expected.format(d=dest)


def test_a_read_only_mount_is_one_line(tmp_path):
    """A real read-only tmpfs mount (needs root, as the multi-node tests' namespaces do)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8) to mount a read-only tmpfs")
    mnt = tmp_path / "ro"
    mnt.mkdir()
    probe = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {probe.stderr.strip()}")
    try:
        for uri in (mnt, mnt / "run"):
            with pytest.raises(KubetuneError) as e:
                Output.for_spec(_spec(uri)).inspect(_spec(uri))
            assert "not writable" in str(e.value) and str(e.value).startswith("output.uri: ")
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_an_output_of_a_kubetune_without_markers_is_recognised(tmp_path):
    """Earlier kubetune versions wrote no marker: their finished run is still protected, their
    checkpoints still resume."""
    out = tmp_path / "out"
    _finished(out)
    (out / output.MARKER).unlink()
    (out / "model" / "config.json").write_text("{}")
    with pytest.raises(KubetuneError, match="holds a finished run"):
        Output.for_spec(_spec(out)).inspect(_spec(out))
    other = tmp_path / "other"
    _checkpoints(other, 5)
    (other / output.MARKER).unlink()
    assert Output.for_spec(_spec(other)).inspect(_spec(other)).action == "resume"


def test_the_same_job_finished_is_done_and_another_is_refused(tmp_path):
    """A pod restarted after its run had exported finds nothing to do; another job is refused."""
    from kubetune.config import dump_spec

    out = tmp_path / "out"
    _finished(out)
    (out / "job.yaml").write_text(dump_spec(_spec(out)))
    plan = Output.for_spec(_spec(out)).inspect(_spec(out))
    assert plan.action == "done" and "nothing to train (pass --overwrite to train it again)" in plan.detail
    other = _spec(out, resume="never")
    with pytest.raises(KubetuneError, match="holds a finished run"):
        Output.for_spec(other).inspect(other)
    assert Output.for_spec(_spec(out, overwrite=True)).inspect(_spec(out, overwrite=True)).action == "replace"


@pytest.mark.parametrize(
    "uri, pod, remote",
    [
        ("runs/a", "/workspace/runs/a", False),
        ("file://runs/a", "/workspace/runs/a", False),
        ("/mnt/out/a", "/mnt/out/a", False),
        ("file:///mnt/out/a", "/mnt/out/a", False),
        ("s3://bucket/runs/a", None, True),
        ("hf://org/repo", None, True),
    ],
)
def test_the_pods_view_of_an_output_comes_from_the_output_object(uri, pod, remote):
    out = Output.resolve(uri)
    assert (out.pod_path("/workspace"), out.remote) == (pod, remote)
