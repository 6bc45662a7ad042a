"""Processes that end with the process that started them: a worker dies with its launcher.

torch's elastic agent stops its workers when it exits or catches a signal, but a launcher killed outright
(``kill -9``, the OOM killer) cannot: its workers (each in a session of its own) went on training as orphans,
writing history and checkpoints into an output that a second run then resumed into beside them. Linux's
parent-death signal (``prctl(PR_SET_PDEATHSIG)``, what ``torchrun``'s own workers lack) ends them with it;
elsewhere a watchdog thread notices the new parent. The same holds one level down: a worker's tokenizer pool.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

__all__ = ["PARENT_PID_ENV", "die_with_parent"]

# Set by kubetune's launchers for their workers: the pid they must not outlive, read by the worker entry points
# at their start (nothing else reads it: a worker's own children are armed with the worker's pid, if at all).
PARENT_PID_ENV = "KUBETUNE_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_POLL_S = 0.5  # the watchdog's period where there is no parent-death signal


def die_with_parent(parent: int | None = None) -> None:
    """From now on, SIGKILL this process as soon as its parent exits; at once if ``parent`` (the pid the
    caller knows started it; default: the current parent) is no longer its parent, i.e. it already exited
    between starting this process and this call.

    The signal is tied to the parent *thread* that started this process (Linux): call it only in a process
    started from a thread that lives as long as its process (torch's agent and ``ProcessPoolExecutor`` start
    theirs from the thread that runs them).
    """
    parent = os.getppid() if parent is None else parent
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            _watch(parent)  # a kernel that refuses it (seccomp): fall back to watching
    else:
        _watch(parent)
    if os.getppid() != parent:  # gone before the signal was armed: it will never come
        os.kill(os.getpid(), signal.SIGKILL)


def _watch(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_POLL_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()
