"""A run's phases (``training.events.phases``: start-up, data, training, export, total), the clocks they are read
from, and the report's rows for them."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kubetune.artifacts.report import _phase_rows
from kubetune.training.events import PHASES, RUN_STARTED_ENV, phases, process_started, run_started

MARKS = {"started": 100.0, "worker": 104.0, "built": 110.0, "first_step": 111.5, "last_step": 121.5, "end": 124.0}


@pytest.mark.parametrize(
    ("marks", "expected"),
    [
        # without the build's data marks: data is the wait for the first batch only
        (
            MARKS,
            {"startup_s": 10.0, "data_s": 1.5, "training_s": 10.0, "export_s": 2.5, "total_s": 24.0, "launcher_s": 4.0},
        ),
        # reading and tokenizing inside the build move from start-up to data
        (
            {**MARKS, "data_start": 105.0, "data_end": 108.0},
            {"startup_s": 7.0, "data_s": 4.5, "training_s": 10.0, "export_s": 2.5, "total_s": 24.0, "launcher_s": 4.0},
        ),
        # a worker started on its own (no launcher mark): no launcher share
        (
            {k: v for k, v in MARKS.items() if k != "worker"},
            {"startup_s": 10.0, "data_s": 1.5, "training_s": 10.0, "export_s": 2.5, "total_s": 24.0},
        ),
        # clocks of two processes a hair apart never give a negative phase
        ({**MARKS, "built": 99.9995}, {"startup_s": 0.0}),
    ],
)
def test_the_phases_split_the_whole_run_from_its_milestones(marks, expected):
    got = phases(marks)
    assert {k: got[k] for k in expected} == expected
    assert set(PHASES) <= got.keys()
    if "data_start" in marks or marks["built"] > marks["started"]:
        # start-up, data, training and export add up to the whole run
        parts = got["startup_s"] + got["data_s"] + got["training_s"] + got["export_s"]
        assert parts == pytest.approx(got["total_s"], abs=0.005)


def test_a_process_start_is_read_from_proc_to_within_a_clock_tick():
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        after = time.time()
        started = process_started(child.pid)
    finally:
        child.kill()
        child.wait()
    assert before - 0.05 <= started <= after + 0.05  # /proc counts in 10 ms ticks, its uptime in 10 ms
    assert process_started() <= time.time()


@pytest.mark.parametrize(
    ("environ", "from_env"),
    [({RUN_STARTED_ENV: "1700000000.25"}, True), ({RUN_STARTED_ENV: "soon"}, False), ({}, False)],
)
def test_the_run_counts_from_its_launcher_when_one_says_when_it_started(environ, from_env):
    got = run_started(environ)
    assert got == 1700000000.25 if from_env else got == pytest.approx(process_started(), abs=0.05)


def test_the_report_shows_each_phase_it_has_in_order():
    rows = _phase_rows({"total_s": 24.0, "startup_s": 10.0, "launcher_s": 4.0})
    assert rows == [("start-up: process start to model built (s)", 10.0), ("whole run (s)", 24.0)]
    assert _phase_rows({}) == []
