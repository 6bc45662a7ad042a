"""`kubetune status`, `status --json` and `list --target local --json` over a state directory of
broken run records and hostile progress files: one line each, valid JSON, bounded memory, no hang,
and nothing read from outside the state directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

GOOD = {"name": "x", "pid": os.getpid(), "started": 1.7e9, "output": "/o", "local": "/o", "exit_code": 0}

# name -> what its record file is: JSON text, or a callable that makes the file at the path
RECORDS = {
    "a-list": "[1, 2]",
    "a-null": "null",
    "a-number": "42",
    "a-string": '"run"',
    "not-json": "{pid: 1",
    "a-nan": '{"pid": NaN}',
    "code-abc": json.dumps({**GOOD, "exit_code": "abc"}),
    "code-huge": json.dumps({**GOOD, "exit_code": 10**30}),
    "pid-huge": json.dumps({**GOOD, "pid": 1e23}),
    "pid-zero": json.dumps({**GOOD, "pid": 0, "exit_code": None}),
    "pid-negative": json.dumps({**GOOD, "pid": -1, "exit_code": None}),
    "pid-bool": json.dumps({**GOOD, "pid": True, "exit_code": None}),
    "local-list": json.dumps({**GOOD, "local": ["/o"]}),
    "no-output": json.dumps({k: v for k, v in GOOD.items() if k != "output"}),
    "too-big": json.dumps({**GOOD, "pad": "x" * 200_000}),
    "zero-link": lambda p: p.symlink_to("/dev/zero"),
    "a-fifo": lambda p: os.mkfifo(p),
    "a-directory": lambda p: p.mkdir(),
}

# progress.json of a run whose record is good: (file, what status must still show)
PROGRESS = {
    "eta-infinity": '{"step": 3, "total_steps": 10, "eta_s": Infinity, "loss": 0.5}',
    "eta-huge": json.dumps({"step": 3, "total_steps": 10, "eta_s": 1e300, "loss": 0.5}),
    "progress-list": "[1, 2, 3]",
    "no-step": json.dumps({"total_steps": 10, "loss": 0.5, "last_eval": {"eval_loss": 1.0}}),
    "eval-no-step": json.dumps({"step": 3, "total_steps": 10, "last_eval": {"eval_loss": "x"}}),
    "epoch-alone": json.dumps({"step": 3, "total_steps": 10, "epoch": 1}),
    "progress-zero-link": lambda p: p.symlink_to("/dev/zero"),
    "progress-fifo": lambda p: os.mkfifo(p),
}

OUTSIDE = ["../../outside/evil", "/etc/passwd", "..", "x/../../y", "UPPER"]


def _make(path: Path, what) -> None:
    if callable(what):
        what(path)
    else:
        path.write_text(what)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every command over the corpus, in one child process limited to 1 GiB of address space (a
    record that is /dev/zero grew to 2.6 GB in 6 s before); each command has 10 s (a FIFO hung)."""
    tmp = tmp_path_factory.mktemp("state")
    runs = tmp / "state" / "runs"
    runs.mkdir(parents=True)
    for name, what in RECORDS.items():
        _make(runs / f"{name}.json", what)
    # a live process whose command line names kubetune: what a running `kubetune run` is to status
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)  # kubetune run"])
    for name, what in PROGRESS.items():
        out = tmp / "outputs" / name
        out.mkdir(parents=True)
        _make(out / "progress.json", what)
        record = {**GOOD, "name": name, "pid": alive.pid, "exit_code": None, "local": str(out)}
        _make(runs / f"{name}.json", json.dumps(record))
    (tmp / "outside").mkdir()
    (tmp / "outside" / "evil.json").write_text(json.dumps({**GOOD, "exit_code": None}))
    names = [*RECORDS, *PROGRESS, *OUTSIDE]
    script = textwrap.dedent(
        f"""
        import json, resource, signal, sys
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        from typer.testing import CliRunner
        from kubetune.cli import app

        def timeout(*_):
            raise TimeoutError("the command hung")

        signal.signal(signal.SIGALRM, timeout)
        results = {{}}
        for args in [["status", n] for n in {names!r}] + [["status", n, "--json"] for n in {names!r}] + [
            ["list", "--target", "local", "--json"]
        ]:
            signal.alarm(10)
            r = CliRunner().invoke(app, args)
            signal.alarm(0)
            crash = None if r.exception is None or isinstance(r.exception, SystemExit) else repr(r.exception)
            results[" ".join(args)] = {{"code": r.exit_code, "out": r.stdout, "err": r.stderr, "crash": crash}}
        print(json.dumps(results))
        """
    )
    env = {**os.environ, "KUBETUNE_STATE_DIR": str(tmp / "state")}
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp / "state", timeout=300
        )
    finally:
        alive.kill()
        alive.wait()
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(f"{len(names) * 2 + 1} commands in {time.monotonic() - t0:.1f} s")
    return json.loads(proc.stdout)


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("name", list(RECORDS))
def test_a_broken_record_is_one_line(results, name):
    for args in (f"status {name}", f"status {name} --json"):
        r = results[args]
        assert r["crash"] is None, r["crash"]
        lines = r["err"].splitlines()
        assert r["code"] == 2 and len(lines) == 1, r
        assert lines[0].startswith(f"error: name: the record of `kubetune run` {name} (") and "is broken: " in lines[0]
        assert "delete " in lines[0] and r["out"] == ""


@pytest.mark.parametrize("name", list(PROGRESS))
def test_a_hostile_progress_file_leaves_the_rest_of_the_status(results, name):
    r = results[f"status {name}"]
    assert r["crash"] is None and r["code"] == 0 and r["err"] == "", r
    assert r["out"].startswith(f"local run {name}: Running")
    j = results[f"status {name} --json"]
    assert j["crash"] is None and j["code"] == 0, j
    status = _strict(j["out"])  # no bare Infinity or NaN
    assert status["phase"] == "Running" and status["name"] == name
    progress = status["progress"] or {}
    assert all(not isinstance(v, float) or v < 1e300 for v in progress.values())
    if name == "eta-infinity":
        assert progress == {"step": 3, "total_steps": 10, "loss": 0.5}


@pytest.mark.parametrize("name", OUTSIDE)
def test_a_name_that_is_a_path_reads_nothing_outside(results, name):
    r = results[f"status {name}"]
    assert r["crash"] is None and r["code"] == 2, r
    assert r["err"].splitlines() == [
        f"error: name: {name!r} is not a job name (1-52 lowercase letters, digits or "
        "'-', a letter first) — give the job's name, the `name` of its spec"
    ]


def test_list_shows_every_record_and_says_which_are_broken(results):
    r = results["list --target local --json"]
    assert r["crash"] is None and r["code"] == 0, r
    runs = {j["name"]: j for j in _strict(r["out"])}
    assert set(runs) == set(RECORDS) | set(PROGRESS)
    assert all(runs[n]["phase"] == "Unknown" and "is broken" in runs[n]["problem"] for n in RECORDS)
    assert all(runs[n]["phase"] == "Running" for n in PROGRESS)
