"""kubetune.lifetime: a process armed with die_with_parent ends as soon as its parent does (kill -9 included), and
at once when its parent is already gone by the time it arms; a worker's tokenizer pool goes with the worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# A parent that starts a child armed with die_with_parent (the way a launcher starts its workers: the child
# in a session of its own, so that no signal to the parent's group reaches it), prints its pid, then waits.
_PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)
print(child.pid, flush=True)
child.wait()
"""
_ARMED_CHILD = """
import os, time
from kubetune.lifetime import PARENT_PID_ENV, die_with_parent
die_with_parent(int(os.environ.pop(PARENT_PID_ENV, 0)) or None)
time.sleep(120)
"""
# A parent whose pool (as data/rows.py makes it for tokenization) holds busy processes.
_POOL_PARENT = """
import concurrent.futures, multiprocessing, os, time
from kubetune.lifetime import die_with_parent
if __name__ == "__main__":
    pool = concurrent.futures.ProcessPoolExecutor(
        2, mp_context=multiprocessing.get_context("spawn"), initializer=die_with_parent, initargs=(os.getpid(),)
    )
    for _ in range(2):
        pool.submit(time.sleep, 120)
    while len(multiprocessing.active_children()) < 2:
        time.sleep(0.05)
    time.sleep(1)  # the pool's processes have run their initializer
    print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
    time.sleep(120)
"""


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(_running(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_child_dies_with_its_parent_killed_outright():
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, _ARMED_CHILD], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        time.sleep(1.5)  # armed (importing kubetune.lifetime takes milliseconds)
        assert _running(child)
        parent.kill()
        parent.wait()
        assert _gone_within([child], 5), "the child outlived its parent"
    finally:
        _kill([child])


def test_a_child_whose_parent_is_gone_before_it_arms_ends_at_once():
    # The launcher's pid as the launcher passes it, but this child's parent is another process: as when the
    # launcher died between starting the child and the child arming itself.
    env = {**os.environ, "KUBETUNE_PARENT_PID": str(os.getpid() + 10_000_000)}
    child = subprocess.run([sys.executable, "-c", _ARMED_CHILD], env=env, timeout=60)
    assert child.returncode == -signal.SIGKILL


def test_a_pool_dies_with_the_process_that_made_it():
    parent = subprocess.Popen([sys.executable, "-c", _POOL_PARENT], stdout=subprocess.PIPE, text=True)
    pool = [int(p) for p in parent.stdout.readline().split()]
    try:
        assert len(pool) == 2 and all(_running(p) for p in pool)
        parent.kill()
        parent.wait()
        assert _gone_within(pool, 5), "the pool outlived its parent"
    finally:
        _kill(pool)
