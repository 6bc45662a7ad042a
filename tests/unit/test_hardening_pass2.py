"""Issue 30's remaining cases, each one line or bounded: a billion epochs, a symbolic-link loop or a
dangling link as output.uri, `schema -o` onto what is not a file, a 50 MB config.json as the base
model. (The spec cases are in test_hostile_spec.py, the state directory's in test_state_records.py.)"""

from __future__ import annotations

import os
import tracemalloc

import pytest
from typer.testing import CliRunner

from kubetune.errors import KubetuneError


def test_a_billion_epochs_plan_only_the_epochs_a_run_reaches():
    from kubetune.data.sharding import plan_epochs

    tracemalloc.start()
    try:
        steps, total = plan_epochs(1_000_000_000, 2, n_steps=8)  # built a list of a billion counts: 8.9 GB
        assert (len(steps), total) == (1, 2)
        steps, total = plan_epochs(2**31 - 1, None, n_steps=8)  # no max_steps: all of them, still no list
        assert (len(steps), total, steps[2**31 - 2]) == (2**31 - 1, 8 * (2**31 - 1), 8)
        planned = []
        steps, total = plan_epochs(2**31 - 1, 20, steps_of=lambda e: planned.append(e) or 7)  # by tokens
        assert (list(steps), total, planned) == ([7, 7, 7], 20, [0, 1, 2])
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()
    with pytest.raises(IndexError):
        plan_epochs(3, None, n_steps=8)[0][3]


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda p: p.symlink_to(p), "is a symbolic link to '{p}', which is a loop of links"),
        (lambda p: p.symlink_to(p.parent / "missing"), "is a symbolic link to '{d}/missing', which does not exist"),
    ],
    ids=["loop", "dangling"],
)
def test_an_output_that_is_a_broken_symbolic_link_is_one_line(tmp_path, make, expected):
    from kubetune.artifacts.output import refuse_special

    link = tmp_path / "out"
    make(link)
    for uri in (str(link), f"file://{link}"):
        with pytest.raises(KubetuneError) as e:
            refuse_special(uri)
        assert str(e.value) == (
            f"output.uri: {uri!r} "
            + expected.format(p=link, d=tmp_path)
            + " — point output.uri at a directory (or a link to an existing one)"
        )
    if "loop" in expected:  # a path beneath the loop
        with pytest.raises(KubetuneError, match="lies under a loop of symbolic links"):
            refuse_special(str(link / "run"))


@pytest.mark.parametrize("where", ["a directory", "under a file", "/proc"])
def test_schema_output_onto_what_is_not_a_writable_file_is_one_line(tmp_path, where):
    from kubetune.cli import app

    (tmp_path / "f").write_text("mine")
    target = {"a directory": tmp_path, "under a file": tmp_path / "f" / "schema.json", "/proc": "/proc/x.json"}[where]
    r = CliRunner().invoke(app, ["schema", "-o", str(target)])
    assert r.exit_code == 2, (r.exit_code, r.exception)
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception  # no traceback
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith(f"error: --output: cannot write {target}: ")
    assert (tmp_path / "f").read_text() == "mine"


def test_a_base_model_with_a_50_mb_config_is_refused_before_training(tmp_path):
    """predict refuses such an export; run trained and exported it before."""
    from kubetune import artifacts
    from kubetune.config import parse_spec

    model = tmp_path / "model"
    model.mkdir()
    with (model / "config.json").open("wb") as f:
        f.truncate(50 << 20)  # sparse: 50 MB to stat, nothing to write
    (model / "model.safetensors").write_bytes(b"")
    spec = parse_spec(
        {"name": "t", "model": {"uri": str(model)}, "data": {"train": "t.csv"}, "output": {"uri": str(tmp_path / "o")}}
    )
    with pytest.raises(KubetuneError) as e:
        artifacts.resolve_model(spec)
    assert str(e.value) == (
        f"model.uri: the config.json of {str(model)!r} is {50 << 20:,} bytes; a model config is a few KB "
        "— point it at a model saved with save_pretrained"
    )
    assert os.path.getsize(model / "config.json") == 50 << 20
