"""Starting points after `pip install`: init, explain, --version, --help's grouping, relative data paths."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from kubetune.cli import app
from kubetune.config import load_spec, parse_spec
from kubetune.config import tasks as task_registry
from kubetune.config.base import DataCommon
from kubetune.config.load import resolve_data_paths
from kubetune.config.tasks import entries, starter_text
from kubetune.version import __version__


def cli(*args):
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("task", list(task_registry.entries()))  # every registered task, new ones too
def test_init_writes_a_commented_starter_that_validates_and_never_overwrites(tmp_path, task):
    path = tmp_path / "job.yaml"
    code, out, _ = cli("init", task, "-o", str(path))
    assert code == 0 and f"wrote {path}" in out
    text = path.read_text()
    assert text.startswith("# A starter job spec") and text.count("#") > 10
    spec = load_spec(path)
    assert spec.task == task
    path.write_text("mine\n")
    code, _, err = cli("init", task, "-o", str(path))
    assert code == 2 and err.strip() == f"error: --output: {path} already exists — pass another path with --output"
    assert path.read_text() == "mine\n"
    code, _, err = cli("init", "rlhf", "-o", str(tmp_path / "x.yaml"))
    assert code == 2 and "no task 'rlhf'" in err and "sequence-classification, causal-lm, dpo" in err


def test_each_task_ships_its_starter_in_its_own_package():
    for name, entry in entries().items():
        package, _, resource = entry.starter.partition(":")
        assert package == entry.runtime.partition(":")[0].rsplit(".", 1)[0] and resource == "starter.yaml", name
        assert f"`kubetune init {name}`" in starter_text(name), name


@pytest.mark.parametrize("task", list(entries()))
def test_a_task_without_a_starter_gets_one_built_from_the_registry(tmp_path, monkeypatch, task):
    """A task that ships no starter (a plugin's, say): `init` writes one from its registry entry, which
    validates once model.uri and data.train (and any required field of its own section) are filled."""
    bare = {name: dataclasses.replace(entry, starter=None) for name, entry in entries().items()}
    monkeypatch.setattr(task_registry, "entries", lambda: bare)
    path = tmp_path / "job.yaml"
    code, out, _ = cli("init", task, "-o", str(path))
    assert code == 0 and out.startswith(f"wrote {path}: fill in model.uri and data.train, then check it")
    text = path.read_text()
    assert (
        "the task ships no starter of its own" in text.replace("\n# ", " ")
        and max(len(line) for line in text.splitlines()) <= 120
    )
    code, _, err = cli("validate", str(path))
    assert code == 2 and "model.uri: Input should be a valid string (got None)" in err and "data.train:" in err
    raw = yaml.safe_load(text)
    assert raw["task"] == task and raw["name"] == f"my-{task}" and raw["output"] == {"uri": f"runs/my-{task}"}
    own = {k for k in entries()[task].data.model_fields if k not in DataCommon.model_fields and k != "task"}
    assert own and own <= set(raw["data"])  # the task's own data fields, with their defaults
    raw["model"]["uri"], raw["data"]["train"] = "hf://org/model", "train.csv"
    if task == "grpo":  # its own section has a required field: written out, empty, to fill in
        assert raw["grpo"]["rewards"] is None and "rewards:  # required: fill in" in text
        raw["grpo"]["rewards"] = [{"function": "regex", "pattern": "x"}]
    assert parse_spec(raw).task == task


def test_a_starter_its_package_does_not_hold_is_one_line(tmp_path, monkeypatch):
    broken = {**entries(), "dpo": dataclasses.replace(entries()["dpo"], starter="kubetune.tasks.dpo:gone.yaml")}
    monkeypatch.setattr(task_registry, "entries", lambda: broken)
    code, _, err = cli("init", "dpo", "-o", str(tmp_path / "job.yaml"))
    assert code == 2 and err.strip() == (
        "error: task: task 'dpo' names the starter 'kubetune.tasks.dpo:gone.yaml', which its package does not hold "
        "(FileNotFoundError) — reinstall the task's distribution (the starter is its package data), or tell its authors"
    )
    assert not (tmp_path / "job.yaml").exists()


def test_version_explain_and_help_groups():
    code, out, _ = cli("--version")
    assert code == 0 and out.strip() == f"kubetune {__version__}"
    code, out, _ = cli("explain", "training")
    keys = [line.split()[0] for line in out.splitlines()]
    assert code == 0 and "training.learning_rate" in keys and all(k.startswith("training") for k in keys)
    code, _, err = cli("explain", "trainin")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "one of: data, distributed" in err
    code, out, _ = cli("--help")
    user, internal = out.split("Internal (what pods and the launcher run)")
    assert "worker" in internal and "launch" in internal and " run " in user and " worker " not in user


def test_relative_data_paths_resolve_against_the_given_directory(tmp_path):
    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "job.yaml"
    path.write_text(
        "name: j\nmodel: {uri: m}\noutput: {uri: runs/j}\n"
        "data: {train: data/train.csv, eval: s3://b/eval.csv, text_column: t, label_column: l}\n"
    )
    spec = resolve_data_paths(load_spec(path), path.parent)
    assert spec.data.train == str(tmp_path / "sub" / "data" / "train.csv")
    assert spec.data.eval == "s3://b/eval.csv" and spec.output.uri == "runs/j" and spec.model.uri == "m"
    absolute = resolve_data_paths(spec, Path("/elsewhere"))
    assert absolute.data.train == spec.data.train  # absolute already: unchanged


def test_explain_names_every_type_as_a_user_writes_it():
    """data.eval printed `Annotated | null` (its URL type is a validated str); no internal name is shown."""
    code, out, _ = cli("explain", "data.eval")
    assert code == 0 and out.split()[1:4] == ["str", "|", "null"]
    code, out, _ = cli("explain")
    assert code == 0 and not any(word in out for word in ("Annotated", "typing.", "<class", "ForwardRef"))
