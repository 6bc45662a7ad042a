"""A real `kubetune run`: its launcher waits without the checks' libraries (they ran in a child that is gone), and
metrics.json and the report carry the run's phases, which add up to the whole process's time."""

from __future__ import annotations

import json
import time

import pytest
from conftest import descendants, is_worker, start_run, tiny_spec, write_spec

from kubetune.training.events import PHASES

# e2e: a whole run (20 s); tests/unit/test_startup.py covers the phases and the report rows in make test
pytestmark = [pytest.mark.integration, pytest.mark.e2e]
# shared libraries of what the checks before the run import (kubetune.cli.run._preflight): pandas, pyarrow, tokenizers
CHECKS_ONLY = ("pandas/_libs", "pyarrow/lib", "tokenizers/tokenizers")


def _mapped(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return f.read()
    except OSError:
        return ""


def test_the_waiting_launcher_holds_no_data_libraries_and_the_run_reports_its_phases(tmp_path, small_csv):
    out = tmp_path / "out"
    spec = tiny_spec(small_csv, out, training={"max_steps": 2, "batch_size": 8, "log_every": 1})
    spec["distributed"]["procs_per_node"] = 1
    spec_path = write_spec(tmp_path / "job.yaml", spec)
    t0 = time.time()
    run = start_run(spec_path)
    try:
        deadline = time.time() + 300
        while not [p for p in descendants(run.pid) if is_worker(p)]:  # the launcher now only waits
            assert run.poll() is None, run.communicate()[1][-3000:]
            assert time.time() < deadline, "no worker started"
            time.sleep(0.1)
        maps = _mapped(run.pid)
        assert maps, "the launcher is gone"
        assert [lib for lib in CHECKS_ONLY if lib in maps] == []
        _, err = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
    wall = time.time() - t0
    assert run.returncode == 0, err[-3000:]

    got = json.loads((out / "metrics.json").read_text())["phases"]
    assert set(PHASES) | {"launcher_s"} == got.keys()
    parts = got["startup_s"] + got["data_s"] + got["training_s"] + got["export_s"]
    assert parts == pytest.approx(got["total_s"], abs=0.01)
    # counted from the launcher's start: the checks before the first worker are in, the exit's last moments are not
    assert 0 < got["launcher_s"] < got["startup_s"] < got["total_s"] <= wall
    assert got["total_s"] > wall - 10
    assert got["training_s"] > 0
    report = (out / "report.html").read_text()
    assert "whole run (s)" in report and "start-up: process start to model built (s)" in report
