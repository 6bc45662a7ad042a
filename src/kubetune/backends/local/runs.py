"""The local backend (``LocalBackend``, registered as ``local``): jobs on this machine behind the
``Backend`` protocol. The Python client's runs are `kubetune run` in a background process
(``_LocalRun``, one per run started from this Python process); `kubetune run` itself, in the
foreground, is the backend's ``run`` (its launcher is ``backends/local/launcher.py``) and leaves a record
that ``LocalBackend(recorded=True)`` reads from another shell (`kubetune status`, `list`)."""

from __future__ import annotations

import json
import os
import re
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

from kubetune.artifacts.output import Output
from kubetune.backends.status import JobStatus, WaitTimeout
from kubetune.config import JobSpec, dump_spec
from kubetune.errors import KubetuneError
from kubetune.paths import BrokenRecord, read_bounded_json

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
_LOCAL_JOBS: dict[str, _LocalRun] = {}


def run_command(spec_file: Path) -> list[str]:
    """Pure: the command a local job runs (the CLI, so exit codes and messages are the CLI's)."""
    return [sys.executable, "-m", "kubetune", "run", str(spec_file)]


class _LocalRun:
    """A `kubetune run` in a background process on this machine (its own process group): what the
    local backend keeps of each run it started. Not a handle: handles are ``kubetune.client.Job``,
    which hold ``backend`` (the local backend bound to this run)."""

    def __init__(self, spec: JobSpec, proc: subprocess.Popen, log_path: Path):
        self.spec, self.name, self._proc, self.log_path = spec, spec.name, proc, log_path
        self.created = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.backend = _RunBackend(self)

    @classmethod
    def start(cls, spec: JobSpec, replace: bool = False) -> _LocalRun:
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
            rank: node rank; a local run is one node, 0 (the argument is the cluster backends').
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
            from kubetune.backends.local.launcher import SHUTDOWN_GRACE_S

            timeout = SHUTDOWN_GRACE_S + 10
        self._proc.terminate()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            # The process group start() created: the launcher and every worker it spawned.
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()

    @property
    def output(self) -> Path:
        return Output.for_spec(self.spec).local


class LocalBackend:
    """The ``Backend`` protocol on this machine, by job name: the runs started from this Python
    process (``submit`` starts `kubetune run` in the background); with ``recorded``, ``status``,
    ``list`` and ``output_dir`` answer from the records every `kubetune run` on this machine leaves
    instead (what a command line in another shell reads: `kubetune status`, `list --target local`).

    Beside the protocol, ``run``, ``record_run`` and ``end_run`` are `kubetune run` itself: the
    job in the foreground, and its record."""

    def __init__(self, recorded: bool = False):
        self.recorded = recorded

    def _run(self, name: str) -> _LocalRun:
        if name not in _LOCAL_JOBS:
            started = ", ".join(sorted(_LOCAL_JOBS)) or "none"
            raise KubetuneError(
                f"no local run named '{name}' was started from this Python process (started: {started})",
                fix="check the name with Client('local').list()",
            )
        return _LOCAL_JOBS[name]

    def submit(self, spec: JobSpec, replace: bool = False) -> str:
        return _LocalRun.start(spec, replace=replace).name

    def for_job(self, name: str) -> LocalBackend:
        """The backend bound to run ``name``: it answers for that run also after another run of
        the same name replaced it, or after it was deleted.

        Raises:
            KubetuneError: no run of that name was started from this process.
        """
        return self._run(name).backend

    def has(self, name: str) -> bool:
        """Whether there is a run of that name (``recorded``: a record of it on this machine).

        Raises:
            KubetuneError: ``recorded``, and ``name`` is not a job name or its record is broken.
        """
        return _record(name) is not None if self.recorded else name in _LOCAL_JOBS

    def status(self, name: str) -> JobStatus:
        if not self.recorded:
            return self._run(name).status()
        status = recorded_status(name)
        if status is None:
            raise _not_recorded(name)
        return status

    def logs(self, name: str, follow: bool = False, tail: int | None = None, **options: Any) -> Iterator[str]:
        return self._run(name).logs(follow=follow, tail=tail, **options)  # rank/all_ranks checked by the run

    def wait(self, name: str, timeout: float | None = None) -> JobStatus:
        return self._run(name).wait(timeout)

    def delete(self, name: str, timeout: float | None = None, **_: object) -> list[str]:
        run = self._run(name)
        run.delete(timeout)  # a local run's output is never deleted (no storage option here)
        return [f"its output and checkpoints stay in {run.output}"]

    def list(self) -> list[dict]:
        if self.recorded:
            return recorded_runs()
        return [{"name": r.name, "phase": r.status().phase, "created": r.created} for r in _LOCAL_JOBS.values()]

    def spec_of(self, name: str) -> JobSpec | None:
        try:
            return self._run(name).spec
        except KubetuneError:
            return None

    def output_dir(self, name: str) -> Path:
        """Where run ``name`` writes its output on this machine (the staging directory of an
        s3:// or hf:// output)."""
        if not self.recorded:
            return self._run(name).output
        record = _record(name)
        if record is None:
            raise _not_recorded(name)
        return Path(record["local"])

    # ---- `kubetune run`: the job in the foreground, and its record ----
    def run(self, spec: JobSpec, local_addr: str | None = None) -> dict[int, object]:
        """Run ``spec`` on this machine under torch elastic; blocks until the workers finish.

        Raises:
            KubetuneError: a worker stopped on a user error.
            Stopped: SIGTERM/SIGINT stopped the run after a checkpoint.
            WorkerFailed: a worker crashed or was killed (names the rank and its exit code).
        """
        from kubetune.backends.local import launcher as local  # torch's elastic launcher: imported only to run

        return local.run(spec, local_addr=local_addr)

    def record_run(self, spec: JobSpec) -> Path | None:
        """Record that this process runs ``spec`` (what `kubetune status NAME` reads from another
        shell); returns the record's path, None where the state directory cannot be written."""
        return record_run(spec)

    def end_run(self, record: Path, code: int) -> None:
        """Note in ``record`` that the run exited with ``code``."""
        end_run(record, code)


class _RunBackend(LocalBackend):
    """The local backend bound to one run: what a handle on that run holds (``for_job``)."""

    def __init__(self, run: _LocalRun):
        super().__init__()
        self._own = run

    def _run(self, name: str) -> _LocalRun:
        return self._own if name == self._own.name else super()._run(name)


def _not_recorded(name: str) -> KubetuneError:
    return KubetuneError(
        f"no `kubetune run` of job {name!r} on this machine",
        field="name",
        fix=f"check the name (the spec's `name`), or look in {runs_dir()}",
    )


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
    from kubetune.paths import write_atomic

    path = runs_dir() / f"{spec.name}.json"
    record = {
        "name": spec.name,
        "pid": os.getpid(),
        "started": time.time(),
        "output": spec.output.uri,
        "local": str(Output.for_spec(spec).local),
        "exit_code": None,
    }
    try:
        write_atomic(path, json.dumps(record) + "\n")
    except OSError:
        return None
    return path


def end_run(path: Path, code: int) -> None:
    from kubetune.paths import write_atomic

    try:
        record = read_bounded_json(path)
        if (
            isinstance(record, dict) and record.get("pid") == os.getpid()
        ):  # a later run of the same name owns the record now
            write_atomic(path, json.dumps({**record, "exit_code": code, "ended": time.time()}) + "\n")
    except (OSError, BrokenRecord):
        pass


# Records and progress files are data from disk, which anyone who can write the state directory
# (or the output) shapes: read as regular files of bounded size, checked field by field.
_PID_MAX = 1 << 22  # Linux's PID_MAX_LIMIT
_JOB_NAME = re.compile(r"[a-z]([-a-z0-9]{0,50}[a-z0-9])?")  # the spec's name rule (config/schema.py)


def check_job_name(name: str) -> None:
    """Raises KubetuneError unless ``name`` is a job name (what names a record: never a path)."""
    if not _JOB_NAME.fullmatch(name):
        raise KubetuneError(
            f"{name[:60]!r} is not a job name (1-52 lowercase letters, digits or '-', a letter first)",
            field="name",
            fix="give the job's name, the `name` of its spec",
        )


def _record(name: str) -> dict | None:
    """Run ``name``'s record, checked; None if there is none.

    Raises:
        KubetuneError: the name is not a job name, or the record is broken (one line that names it).
    """
    check_job_name(name)
    path = runs_dir() / f"{name}.json"
    try:
        record = read_bounded_json(path)
        problem = _record_problem(record)
    except FileNotFoundError:
        return None
    except BrokenRecord as e:
        problem = str(e)
    if problem:
        raise KubetuneError(
            f"the record of `kubetune run` {name} ({path}) is broken: {problem}",
            field="name",
            fix=f"delete {path} (kubetune writes it again on the next run; the run's output is not in it)",
        )
    return record


def _record_problem(record: Any) -> str | None:
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    pid, code = record.get("pid"), record.get("exit_code")
    if type(pid) is not int or not 0 < pid < _PID_MAX:
        return f"pid {str(pid)[:30]} is not a process id"
    if code is not None and (type(code) is not int or not -255 <= code <= 255):
        return f"exit_code {str(code)[:30]} is not an exit code"
    for key in ("local", "output"):
        if not isinstance(record.get(key), str) or not record[key] or len(record[key]) > 4096:
            return f"{key} is not a path"
    return None


def recorded_status(name: str) -> JobStatus | None:
    """The status of the newest `kubetune run` of job ``name`` on this machine, with its progress
    (the run's ``progress.json``) and, once it succeeded, its headline metrics; None if none ran.

    Raises:
        KubetuneError: ``name`` is not a job name, or its record is broken.
    """
    from kubetune.training.loggers import read_progress

    record = _record(name)
    if record is None:
        return None
    phase, code = _phase(record)
    status = JobStatus(name=name, namespace="", kind=LOCAL_KIND, phase=phase, output=record["output"])
    if code not in (None, 0):
        status.reason = _EXIT_REASONS.get(code, "Error")
        status.message = f"kubetune run exited with code {code}" if code > 0 else "kubetune run was killed"
    out = Path(record["local"])
    status.progress = read_progress(out)
    if phase == "Succeeded":
        try:
            metrics = read_bounded_json(out / "metrics.json", 1 << 20)
            status.metrics = {k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bool))}
        except (OSError, BrokenRecord, AttributeError):
            pass
    return status


def recorded_runs() -> list[dict]:
    """Every `kubetune run` recorded on this machine: name, phase and when it started; a broken
    record is listed with phase Unknown and what is wrong with it."""
    runs = []
    try:
        names = sorted(p.stem for p in runs_dir().glob("*.json") if _JOB_NAME.fullmatch(p.stem))
    except OSError:
        return []
    for name in names:
        try:
            record = _record(name)  # read once; a listing needs no progress or metrics
        except KubetuneError as e:
            runs.append({"name": name, "phase": "Unknown", "created": None, "problem": str(e)})
            continue
        if record is not None:
            started = record.get("started")
            created = (
                datetime.fromtimestamp(started, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
                if isinstance(started, (int, float)) and 0 <= started < 1e11
                else None
            )
            runs.append({"name": name, "phase": _phase(record)[0], "created": created})
    return runs


def _phase(record: dict) -> tuple[str, int | None]:
    """(phase, exit code) of a checked record; a run gone without saying how it ended was killed."""
    code = record["exit_code"]
    if code is None and not _alive(record["pid"]):
        code = -signal.SIGKILL
    return ("Running" if code is None else "Succeeded" if code == 0 else "Failed"), code


def _alive(pid: int) -> bool:
    """Whether ``pid`` (a checked process id, > 0) is still a kubetune process (not another one
    that reused the number)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"kubetune" in f.read(1 << 16)
    except OSError:
        return True  # no /proc (macOS): trust the signal check
