"""One live run per output: the lock a run's rank 0 holds on its local output directory until it exits.

Why a lock and not a record of the run: a lock held by a process is released by the kernel however the
process ends (``kill -9``, the OOM killer, a lost node's pod), so a dead run never blocks the next one and a
live one always does; a record would have to be guessed stale. ``flock`` on a file of the output itself
(``.kubetune-lock``) rather than in a cache: every process that writes the output, on this machine or a
pod sharing its volume, sees it. The file stays (removing a lock file races with its next taker); it holds
who holds it, for the message. An ``s3://`` or ``hf://`` output is locked through its local staging
directory: that guards the runs of one machine, not two machines writing one prefix.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path

from kubetune.errors import KubetuneError

NAME = ".kubetune-lock"
# A probe (``check``) holds the lock shared for microseconds: a run taking it meanwhile tries again this long.
_RETRY_S = 5.0
# The outputs this process holds: open until it exits, when the kernel releases them.
_HELD: dict[Path, int] = {}
_FIX = "wait for that run to end (or stop it: kubetune delete NAME, or kill PID), or pick another output.uri"


def check(directory: Path, field: str = "output.uri") -> None:
    """Refuse ``directory`` when a live run holds it; takes nothing (a run that starts later is
    refused by ``take``).

    Raises:
        KubetuneError: naming the run that holds it.
    """
    if directory in _HELD:
        return
    try:
        fd = _open(directory / NAME, os.O_RDONLY)
    except OSError:  # none yet, or one that ``take`` refuses in its own words
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _in_use(directory, fd, field) from None
    finally:
        os.close(fd)  # releases the probe's shared lock


def take(directory: Path, job: str, field: str = "output.uri") -> None:
    """Hold ``directory`` for this process until it exits (``directory`` exists; idempotent).

    Raises:
        KubetuneError: another live run holds it, or the lock file cannot be made.
    """
    if directory in _HELD:
        return
    try:
        fd = _open(directory / NAME, os.O_RDWR | os.O_CREAT)
    except OSError as e:
        raise KubetuneError(
            f"cannot lock {directory}: {e.strerror or e}", field=field, fix="choose a writable directory"
        ) from None
    deadline = time.monotonic() + _RETRY_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                error = _in_use(directory, fd, field)
                os.close(fd)
                raise error from None
            time.sleep(0.1)
    holder = {
        "job": job,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    _HELD[directory] = fd


def _open(path: Path, flags: int) -> int:
    """The lock file's descriptor: never through a symbolic link, never blocking on a FIFO put there."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise KubetuneError(
            f"{path} is not a regular file", field="output.uri", fix=f"remove {path.name} from the output directory"
        )
    return fd


def _in_use(directory: Path, fd: int, field: str) -> KubetuneError:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        holder = {}
    who = (
        f"job {holder.get('job')!r}, pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('since')}"
        if isinstance(holder, dict) and holder.get("pid")
        else "a run that is starting"
    )
    return KubetuneError(f"{directory} is in use by another run that is still going ({who})", field=field, fix=_FIX)
