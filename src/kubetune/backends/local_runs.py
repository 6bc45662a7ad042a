"""The local backend of the Python client and notebooks: a `kubetune run` of a spec in a background
process on this machine, as a handle (``LocalJob``) and behind the ``Backend`` protocol
(``LocalBackend``). The launcher that run uses is ``backends/local.py``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from kubetune.backends.status import JobStatus, WaitTimeout
from kubetune.config import JobSpec, dump_spec
from kubetune.errors import KubetuneError
from kubetune.providers.destination import Output

LOCAL_KIND = "LocalRun"
# Why `kubetune run` exited (its exit codes, README "Exit codes"); a negative code is the signal
# that killed it.
_EXIT_REASONS = {
    1: "WorkerFailed",
    2: "InvalidInput",
    143: "Stopped",
    -signal.SIGTERM: "Stopped",
    -signal.SIGKILL: "Killed",
}
_LOG_TAIL = 20

# Local runs started from this Python process, by job name: what Client.list/get and
# train(replace=...) see on the local backend (a notebook often makes a new Client per cell).
_LOCAL_JOBS: dict[str, LocalJob] = {}


def run_command(spec_file: Path) -> list[str]:
    """Pure: the command a local job runs (the CLI, so exit codes and messages are the CLI's)."""
    return [sys.executable, "-m", "kubetune", "run", str(spec_file)]


class LocalJob:
    """A `kubetune run` in a background process on this machine (its own process group)."""

    def __init__(self, spec: JobSpec, proc: subprocess.Popen, log_path: Path):
        self.spec, self.name, self._proc, self.log_path = spec, spec.name, proc, log_path
        self.created = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

    @classmethod
    def start(cls, spec: JobSpec, replace: bool = False) -> LocalJob:
        """Start ``kubetune run`` on ``spec`` in the background.

        Raises:
            KubetuneError: a run of the same name started from this process is still running and
                ``replace`` is False (two runs would write the same output and checkpoints).
        """
        running = _LOCAL_JOBS.get(spec.name)
        if running is not None and running._proc.poll() is None:
            if not replace:
                raise KubetuneError(
                    f"local run '{spec.name}' is already running (pid {running._proc.pid})",
                    fix="pass replace=True to stop it and start again, or wait for it / delete() it first",
                )
            running.delete()
        workdir = Path(tempfile.mkdtemp(prefix=f"kubetune-{spec.name}-"))
        spec_file, log_path = workdir / "job.yaml", workdir / "job.log"
        from kubetune.config.load import resolve_data_paths

        # the spec file is in a temporary directory: relative data paths are the caller's, from its directory
        spec_file.write_text(dump_spec(resolve_data_paths(spec, Path.cwd())))
        with log_path.open("wb") as log:
            # A session of its own: a notebook's interrupt (SIGINT to the kernel's group) does not
            # stop the run, and delete() can kill the launcher and its workers together.
            proc = subprocess.Popen(
                run_command(spec_file),
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )
        job = cls(spec, proc, log_path)
        _LOCAL_JOBS[spec.name] = job
        return job

    def status(self) -> JobStatus:
        """Running, Succeeded or Failed; a failed run has ``reason`` (WorkerFailed, InvalidInput,
        Stopped, Killed, Error), ``message`` (its last ``error:`` line) and ``log_tail``."""
        code = self._proc.poll()
        phase = "Running" if code is None else "Succeeded" if code == 0 else "Failed"
        status = JobStatus(name=self.name, namespace="", kind=LOCAL_KIND, phase=phase)
        from kubetune.training.loggers import read_progress

        status.progress = read_progress(self.output)
        if code not in (None, 0):
            status.log_tail = list(self.logs(tail=_LOG_TAIL))
            said = [line for line in status.log_tail if line.startswith(("error: ", "stopped: "))]
            status.reason = _EXIT_REASONS.get(code, "Error")
            status.message = f"kubetune run exited with code {code}" + (f": {said[-1]}" if said else "")
        return status

    def wait(self, timeout: float | None = None) -> JobStatus:
        """Block until the run ends; returns its status.

        Raises:
            WaitTimeout: still running after ``timeout`` seconds (the run goes on).
        """
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise WaitTimeout(
                f"local run '{self.name}' is still Running after {timeout:.0f} s", fix="wait longer, or delete() it"
            ) from None
        return self.status()

    def logs(
        self, follow: bool = False, rank: int | None = None, all_ranks: bool = False, tail: int | None = None
    ) -> Iterator[str]:
        """The run's output lines, each worker line naming its ``[rank N]``.

        Args:
            follow: keep yielding new lines until the run ends.
            rank: node rank; a local run is one node, 0 (the argument exists for the kubeflow
                handle's signature).
            all_ranks: accepted for the same reason: the one log already holds every local process.
            tail: start with only the last ``tail`` lines written so far.

        Raises:
            KubetuneError: ``rank`` is not 0, or ``tail`` is negative.
        """
        if rank not in (None, 0):
            raise KubetuneError(
                f"a local run has one node (node rank 0), not {rank}",
                field="rank",
                fix="leave rank unset: the local log holds every process's lines, each prefixed [rank N]",
            )
        if tail is not None and tail < 0:
            raise KubetuneError(
                f"expected a number of lines >= 0, got {tail}", field="tail", fix="pass tail=N or leave it unset"
            )
        return self._read(follow, tail)

    def _read(self, follow: bool, tail: int | None) -> Iterator[str]:
        with self.log_path.open("rb") as f:
            pending = b""
            if tail is not None:
                # Only what is written now counts toward the tail; bounded by a deque, not the file.
                end = os.fstat(f.fileno()).st_size
                last: deque[str] = deque(maxlen=tail)
                while f.tell() < end:
                    pending += f.readline(end - f.tell())
                    if pending.endswith(b"\n"):
                        last.append(_decode(pending))
                        pending = b""
                if not follow:
                    if pending:
                        last.append(_decode(pending))
                    yield from last
                    return
                yield from last
            yield from self._lines(f, follow, pending)

    def _lines(self, f: IO[bytes], follow: bool, pending: bytes = b"") -> Iterator[str]:
        # Lines end at "\n" only, as in pod logs: tqdm's "\r" redraws stay inside one line.
        # A line still being written is held back until it ends, or until the run does.
        while True:
            alive = follow and self._proc.poll() is None  # checked before reading: nothing is missed
            chunk = f.readline()
            if chunk.endswith(b"\n"):
                yield _decode(pending + chunk)
                pending = b""
            elif chunk:
                pending += chunk
            elif alive:
                time.sleep(0.2)
            else:
                if pending:
                    yield _decode(pending)
                return

    def delete(self, timeout: float | None = None) -> None:
        """Stop the run: SIGTERM to `kubetune run`, which passes it to the workers; they finish
        the step and write a checkpoint, so training the same spec again resumes.

        Args:
            timeout: seconds to wait before killing the launcher and its workers; default the
                launcher's own shutdown grace plus 10 s, so the checkpoint can be written.
        """
        if _LOCAL_JOBS.get(self.name) is self:  # deleted jobs leave list(), as on the cluster
            del _LOCAL_JOBS[self.name]
        if self._proc.poll() is not None:
            return
        if timeout is None:
            from kubetune.backends.local import SHUTDOWN_GRACE_S

            timeout = SHUTDOWN_GRACE_S + 10
        self._proc.terminate()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            # The process group start() created: the launcher and every worker it spawned.
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()

    def progress(self) -> dict | None:
        """Rank 0's progress.json (step, total_steps, epoch, loss, lr, rates, eta_s, last_eval), or None."""
        from kubetune.training.loggers import read_progress

        return read_progress(self.output)

    def metrics(self) -> dict | None:
        """The finished run's metrics.json, or None before it succeeded."""
        import json

        if self.status().phase != "Succeeded":  # an earlier run's metrics.json may still be there
            return None
        try:
            return json.loads((self.output / "metrics.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    @property
    def output(self) -> Path:
        return Output.resolve(self.spec.output.uri).local


class LocalBackend:
    """The ``Backend`` protocol over the runs started from this Python process, by job name."""

    def submit(self, spec: JobSpec, replace: bool = False) -> str:
        return LocalJob.start(spec, replace=replace).name

    def job(self, name: str) -> LocalJob:
        """The handle of run ``name``.

        Raises:
            KubetuneError: no run of that name was started from this process.
        """
        if name not in _LOCAL_JOBS:
            started = ", ".join(sorted(_LOCAL_JOBS)) or "none"
            raise KubetuneError(
                f"no local run named '{name}' was started from this Python process (started: {started})",
                fix="check the name with Client('local').list()",
            )
        return _LOCAL_JOBS[name]

    def status(self, name: str) -> JobStatus:
        return self.job(name).status()

    def logs(self, name: str, follow: bool = False, tail: int | None = None, **options: Any) -> Iterator[str]:
        return self.job(name).logs(follow=follow, tail=tail, **options)  # rank/all_ranks checked by the handle

    def wait(self, name: str, timeout: float | None = None) -> JobStatus:
        return self.job(name).wait(timeout)

    def delete(self, name: str, timeout: float | None = None, **_: object) -> list[str]:
        job = self.job(name)
        job.delete(timeout)  # a local run's output is never deleted (no storage option here)
        return [f"its output and checkpoints stay in {job.output}"]

    def list(self) -> list[dict]:
        return [{"name": j.name, "phase": j.status().phase, "created": j.created} for j in _LOCAL_JOBS.values()]


def _decode(line: bytes) -> str:
    return line.removesuffix(b"\n").decode("utf-8", errors="replace")


# ---- `kubetune run`'s record, for `kubetune status NAME` from another shell ----
# Written by every `kubetune run` (the CLI's own process): its pid, its output and, once it
# ends, its exit code. Only the run's own record file is ever replaced.


def runs_dir() -> Path:
    """``$KUBETUNE_STATE_DIR/runs``, else ``$XDG_STATE_HOME/kubetune/runs`` (``~/.local/state``)."""
    base = os.environ.get("KUBETUNE_STATE_DIR")
    if not base:
        base = str(Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "kubetune")
    return Path(base) / "runs"


def record_run(spec: JobSpec) -> Path | None:
    """Note that this process runs ``spec``; None where the state directory cannot be written
    (status then does not know the run; training goes on)."""
    import json

    from kubetune.paths import write_atomic

    path = runs_dir() / f"{spec.name}.json"
    record = {
        "name": spec.name,
        "pid": os.getpid(),
        "started": time.time(),
        "output": spec.output.uri,
        "local": str(Output.resolve(spec.output.uri).local),
        "exit_code": None,
    }
    try:
        write_atomic(path, json.dumps(record) + "\n")
    except OSError:
        return None
    return path


def end_run(path: Path, code: int) -> None:
    import json

    from kubetune.paths import write_atomic

    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        if record.get("pid") == os.getpid():  # a later run of the same name owns the record now
            write_atomic(path, json.dumps({**record, "exit_code": code, "ended": time.time()}) + "\n")
    except (OSError, ValueError):
        pass


def recorded_status(name: str) -> JobStatus | None:
    """The status of the newest `kubetune run` of job ``name`` on this machine, with its progress
    (the run's ``progress.json``) and, once it succeeded, its headline metrics; None if none ran."""
    import json

    from kubetune.training.loggers import read_progress

    try:
        record = json.loads((runs_dir() / f"{name}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    code = record.get("exit_code")
    if code is None and not _alive(record.get("pid")):
        code = -signal.SIGKILL  # gone without saying how it ended
    phase = "Running" if code is None else "Succeeded" if code == 0 else "Failed"
    status = JobStatus(name=name, namespace="", kind=LOCAL_KIND, phase=phase, output=record.get("output"))
    if code not in (None, 0):
        status.reason = _EXIT_REASONS.get(code, "Error")
        status.message = f"kubetune run exited with code {code}" if code > 0 else "kubetune run was killed"
    out = Path(record.get("local", ""))
    status.progress = read_progress(out)
    if phase == "Succeeded":
        try:
            status.metrics = json.loads((out / "metrics.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            pass
    return status


def _alive(pid) -> bool:
    """Whether ``pid`` is still a kubetune process (not another one that reused the number)."""
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, TypeError, ValueError):
        return False
    except PermissionError:
        pass
    try:
        return b"kubetune" in Path(f"/proc/{int(pid)}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc (macOS): trust the signal check
