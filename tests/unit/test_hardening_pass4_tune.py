"""Issue 63, `kubetune tune`'s output directory and study.db, without running a trial: a directory holding the
user's files or a kubetune run is refused as `kubetune run` refuses it (one line, nothing written, --overwrite the
escape); a study.db that is random bytes, a FIFO, another program's SQLite database or a directory is one line, for
a session and for --status. (A study's own directory, continued, renamed, or rerun with another objective, and a
failed trial's line: tests/integration/test_hardening_pass4_tune_study.py, which runs a trial.)"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kubetune import tune
from kubetune.cli import app
from kubetune.config.load import parse_spec
from kubetune.errors import KubetuneError
from kubetune.tune import space, storage, study


def _raw(out: Path, **tune_section) -> dict:
    return {
        "name": "search",
        "task": "sequence-classification",
        # no such model: should a check below let a study through, its trial fails at once instead of training
        "model": {"uri": str(out.parent / "no-such-model")},
        "data": {"train": str(out.parent / "reviews.csv")},
        "training": {"eval_every": 10},
        "distributed": {"procs_per_node": 1},
        "output": {"uri": str(out)},
        "tune": {
            "space": {"training.learning_rate": {"type": "float", "low": 1e-5, "high": 1e-3, "log": True}},
            "trials": 1,
            **tune_section,
        },
    }


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every entry under ``root``: a file's bytes, None for a directory."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _users_files(out: Path) -> None:
    (out / "best.yaml").write_text("# my best spec\n")
    (out / "report.html").write_text("<p>my report</p>\n")
    (out / "tune.json").write_text('{"mine": true}\n')


def _finished_run(out: Path) -> None:
    (out / ".kubetune-output").write_text('{"format": "kubetune-output/1", "job": "run"}\n')
    (out / "metrics.json").write_text('{"eval_loss": 0.5}\n')
    (out / "report.html").write_text("<p>the run's report</p>\n")
    (out / "model").mkdir()
    (out / "model" / "config.json").write_text("{}\n")


@pytest.mark.parametrize(
    "make, says",
    [
        (_users_files, "is not empty and was not created by kubetune tune (3 entries: 'best.yaml', 'report.html'"),
        (_finished_run, "is the output of a kubetune run, not a study's (4 entries: '.kubetune-output'"),
    ],
    ids=["users-files", "finished-run"],
)
def test_tune_into_someone_elses_output_is_refused_before_anything_is_written(tmp_path, make, says):
    out = tmp_path / "out"
    out.mkdir()
    make(out)
    before = _tree(out)
    with pytest.raises(KubetuneError) as e:
        tune.run(parse_spec(_raw(out)))
    text = str(e.value)
    assert e.value.field == "output.uri" and says in text and "\n" not in text, text
    assert e.value.fix == "pick a new output.uri, or pass --overwrite (output.overwrite: true)"
    assert _tree(out) == before  # not one file written or replaced
    # the command line: the same line, exit 2, nothing on stdout
    spec = tmp_path / "job.yaml"
    spec.write_text(json.dumps(_raw(out)))
    result = CliRunner().invoke(app, ["tune", str(spec)])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [f"error: {text}"]
    assert _tree(out) == before


@pytest.mark.parametrize(
    "entries, overwrite, allowed",
    [
        ({}, False, None),  # new
        ({"sub": None}, False, "error"),  # anything of the user's
        ({"sub": None}, True, "--overwrite: writing the study into"),
        ({".kubetune-study": b"{}"}, False, None),  # a study's own
        ({".tune.lock": b"", "study.db": b""}, False, None),  # a study of a version that wrote no marker
        ({".tune.lock": b""}, False, "error"),  # a lock alone: left by a refused --overwrite, not a study
        ({".kubetune-output": b"{}", "metrics.json": b"{}"}, True, "--overwrite: writing the study into"),
    ],
    ids=["empty", "users", "users-overwrite", "study", "study-before-marker", "lock-alone", "run-overwrite"],
)
def test_which_directories_a_study_may_write_into(tmp_path, entries, overwrite, allowed):
    out = tmp_path / "out"
    out.mkdir()
    for name, content in entries.items():
        (out / name).mkdir() if content is None else (out / name).write_bytes(content)
    raw = _raw(out)
    raw["output"]["overwrite"] = overwrite
    spec = parse_spec(raw)
    if allowed == "error":
        with pytest.raises(KubetuneError) as e:
            storage.check_output(spec, out)
        assert e.value.field == "output.uri" and "--overwrite" in e.value.fix
    elif allowed is None:
        assert storage.check_output(spec, out) is None
        assert storage.check_output(parse_spec(_raw(tmp_path / "new" / "dir")), tmp_path / "new" / "dir") is None
    else:
        assert storage.check_output(spec, out).startswith(allowed)
    (tmp_path / "file").write_text("x")
    with pytest.raises(KubetuneError) as e:  # a file where the directory should be, --overwrite or not
        storage.check_output(spec, tmp_path / "file")
    assert "exists and is not a directory" in str(e.value)


def _random_bytes(db: Path) -> None:
    db.write_bytes(os.urandom(4096))


def _fifo(db: Path) -> None:
    os.mkfifo(db)


def _other_database(db: Path) -> None:
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE accounts (id INTEGER, owner TEXT)")


def _directory(db: Path) -> None:
    db.mkdir()


def _dangling_link(db: Path) -> None:
    db.symlink_to("/nonexistent/study.db")  # Optuna would make a database there


@pytest.mark.parametrize(
    "make, says",
    [
        (_random_bytes, "study.db is not a study's database (file is not a database)"),
        (_fifo, "study.db is a FIFO, not a study's database"),
        (_other_database, "study.db is an SQLite database, not an Optuna study's (its tables: accounts)"),
        (_directory, "study.db is a directory, not a study's database"),
        (_dangling_link, "study.db is a symbolic link to '/nonexistent/study.db', which does not exist"),
    ],
    ids=["random-bytes", "fifo", "another-database", "directory", "dangling-link"],
)
def test_a_study_db_that_is_not_a_studys_is_one_line_for_a_session_and_for_status(tmp_path, make, says):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".kubetune-study").write_text('{"format": "kubetune-study/1"}\n')  # the study's own directory
    make(out / "study.db")
    before = _tree(out)
    spec = tmp_path / "job.yaml"
    spec.write_text(json.dumps(_raw(out)))
    for extra in ([], ["--status"]):
        result = CliRunner().invoke(app, ["tune", str(spec), *extra])
        assert result.exit_code == 2 and result.stdout == "", (extra, result.output, result.exception)
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith(f"error: output.uri: {out / 'study.db'}") and says.split("study.db", 1)[1] in line
        assert "move it away" in line, line
    after = _tree(out)
    assert after.pop(".tune.lock", b"") == b"" and after == before  # only the session's lock taken, the file as it was


def test_overwrite_lets_a_study_into_a_directory_it_did_not_make(tmp_path):
    """--overwrite reaches the check (here the directory's study.db, random bytes, is what stops it), and without
    it the directory is refused as someone else's."""
    out = tmp_path / "out"
    out.mkdir()
    _users_files(out)
    _random_bytes(out / "study.db")
    spec = tmp_path / "job.yaml"
    spec.write_text(json.dumps(_raw(out)))
    plain = CliRunner().invoke(app, ["tune", str(spec)])
    assert plain.exit_code == 2 and "was not created by kubetune tune (4 entries" in plain.stderr, plain.stderr
    forced = CliRunner().invoke(app, ["tune", str(spec), "--overwrite"])
    assert forced.exit_code == 2 and "study.db is not a study's database" in forced.stderr, forced.stderr
    assert (out / "best.yaml").read_text() == "# my best spec\n"


def test_a_trial_spec_does_not_inherit_the_studys_overwrite(tmp_path):
    raw = _raw(tmp_path / "out")
    raw["output"]["overwrite"] = True
    trial = space.trial_spec(raw, {"training.learning_rate": 1e-4}, str(tmp_path / "out" / "trials" / "t"))
    assert parse_spec(trial).output.overwrite is False and raw["output"]["overwrite"] is True


@pytest.mark.parametrize(
    "metrics, says",
    [
        ('{"eval_loss": NaN}', "the run's eval_loss is nan, not a finite number"),
        ('{"eval_loss": -Infinity}', "the run's eval_loss is -inf, not a finite number"),
        ('{"eval_loss": true}', "the run's eval_loss is True, not a finite number"),
        ('{"train_loss": 0.5}', "the run reported no eval_loss (metrics.json has ['train_loss'])"),
    ],
)
def test_a_trial_without_a_finite_objective_fails_with_its_reason(tmp_path, metrics, says):
    """Said by the study in its one line: Optuna, handed a NaN, would fail the trial with a warning of its own (which
    the study no longer prints)."""
    (tmp_path / "metrics.json").write_text(metrics)
    with pytest.raises(study.TrialFailed) as e:
        study.final_value(tmp_path, "eval_loss")
    assert str(e.value) == says
