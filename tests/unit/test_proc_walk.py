"""The tests' walk of a process tree (conftest.descendants, worker_pid) while threads and processes come and go.

The e2e SIGKILL tests find the worker to kill by walking /proc/PID/task/*/children; a thread that ended between
the listing and the read raised FileNotFoundError (a red `make test-e2e` once in 48 runs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import descendants, environ_of, is_worker, worker_pid


def _task(proc: Path, pid: int, tid: int, children: list[int] | None) -> None:
    """A task directory; ``children=None``: the thread ended after the listing (no children file to read)."""
    d = proc / str(pid) / "task" / str(tid)
    d.mkdir(parents=True)
    if children is not None:
        (d / "children").write_text(" ".join(map(str, children)) + ("\n" if children else ""))


def _process(proc: Path, pid: int, env: dict[str, str] | None = None, cmdline: str = "python") -> None:
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in (env or {}).items()))
    (proc / str(pid) / "cmdline").write_bytes(cmdline.encode().replace(b" ", b"\0"))


def test_a_thread_or_process_that_vanishes_mid_walk_is_skipped_and_the_rest_is_found(tmp_path):
    proc = tmp_path / "proc"
    # the launcher 100: thread 101 ended (no children file), thread 102 holds the elastic agent 200
    _process(proc, 100)
    _task(proc, 100, 100, [])
    _task(proc, 100, 101, None)
    _task(proc, 100, 102, [200])
    _process(proc, 200)
    _task(proc, 200, 200, [300, 301, 302])
    _task(proc, 200, 201, None)
    # workers: 300 rank 0, 301 rank 1, 302 exited after its parent listed it (no /proc/302 at all)
    _process(proc, 300, {"RANK": "0", "LOCAL_RANK": "0"}, "python -m kubetune.pod.worker job.yaml")
    _task(proc, 300, 300, [])
    _process(proc, 301, {"RANK": "1", "LOCAL_RANK": "1"}, "python -m kubetune.pod.worker job.yaml")
    _task(proc, 301, 301, [])

    assert descendants(100, proc) == [200, 300, 301, 302]
    assert worker_pid(100, 1, proc) == 301
    assert worker_pid(100, 0, proc) == 300
    assert environ_of(302, proc) == {} and not is_worker(302, proc)
    assert descendants(999, proc) == []


def test_rank_is_matched_exactly_not_as_a_substring(tmp_path):
    proc = tmp_path / "proc"
    _process(proc, 100)
    _task(proc, 100, 100, [300, 301])
    # rank 10's environment holds "RANK=10" and "LOCAL_RANK=1": neither is rank 1
    _process(proc, 300, {"LOCAL_RANK": "1", "RANK": "10"}, "python -m kubetune.pod.worker j.yaml")
    _task(proc, 300, 300, [])
    _process(proc, 301, {"LOCAL_RANK": "0", "RANK": "1"}, "python -m kubetune.pod.worker j.yaml")
    _task(proc, 301, 301, [])
    assert worker_pid(100, 1, proc) == 301


# A real process whose threads end all the time, with one child process that lives throughout.
_CHURN = """
import subprocess, sys, threading
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
while True:
    threads = [threading.Thread(target=lambda: None) for _ in range(16)]
    for t in threads: t.start()
    for t in threads: t.join()
"""


def test_the_walk_of_a_real_process_whose_threads_churn_always_finds_its_child():
    parent = subprocess.Popen([sys.executable, "-c", _CHURN], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 1.5
        walks = 0
        while time.monotonic() < deadline:
            assert child in descendants(parent.pid)
            walks += 1
        assert walks > 100
    finally:
        os.kill(child, signal.SIGKILL)
        parent.kill()
        parent.wait()
