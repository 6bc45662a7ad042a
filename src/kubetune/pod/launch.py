"""The pod's main process: torch's elastic launcher, configured exactly as ``torchrun`` configures
it from the Training Operator's environment, exiting with codes the operator's restart policy acts on.

    kubetune launch /workspace/stage/<job>/job.yaml          (or: python -m kubetune.pod.launch ...)

Why not torchrun itself: under ``restartPolicy: ExitCode`` the Training Operator restarts a pod
only when its ``pytorch`` container exits with a code >= 128 and fails the job on any other code
(``IsRetryableExitCode`` in kubeflow/training-operator ``pkg/util/train/train_util.go``, the same
in v1.7, v1.8.1 and v1.9.0; applied in ``pkg/controller.v1/common/pod.go``). torchrun exits 1
whenever a worker fails, whatever the reason, so a preempted pod, whose workers wrote a checkpoint
and exited 143, failed the whole job instead of resuming. This launcher runs the very same code
(torch's parser over the ``PET_*`` variables, ``torch.distributed.run.run``, ``elastic_launch``)
and only maps how it ended:

    =====  ===========================================================  =========================
    exit   what happened                                                ExitCode policy
    =====  ===========================================================  =========================
    0      the job finished                                             Succeeded
    143    SIGTERM (eviction, preemption, node drain): the workers      pod restarted; resumes
           finished their step and wrote a checkpoint (128 + signal:    from the checkpoint
           130 for SIGINT)
    128+N  a worker was killed by signal N: 137 SIGKILL (the OOM        pod restarted (up to
           killer), 134 SIGABRT (NCCL's watchdog), 135 SIGBUS,          backoffLimit)
           139 SIGSEGV
    200    ``EXIT_INFRASTRUCTURE``: the cluster failed the job, not      pod restarted (up to
           its code: a peer was lost or a collective timed out (a       backoffLimit)
           torch.distributed error, a gloo transport error, a broken
           connection), or the rendezvous or its store was unreachable
    1      retrying cannot help: a user error (a worker exited 2: the   job Failed
           spec, the data, credentials) or a crash in the code itself
    =====  ===========================================================  =========================

200 lies above every ``128 + signal`` code (Linux signals end at 64), so it is never mistaken for
a signal. The pieces that turn torch's failures into these outcomes (``root_failure``,
``translated_failures``) are shared with ``kubetune run`` (``kubetune.backends.local.launcher``).
"""

from __future__ import annotations

import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from kubetune.errors import USER_ERROR_EXIT, KubetuneError
from kubetune.lifetime import PARENT_PID_ENV
from kubetune.training.events import LOG_EVENTS_ENV, RUN_STARTED_ENV, process_started

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

WORKER_MODULE = "kubetune.pod.worker"
EXIT_FAILED = 1  # not retryable: the operator fails the job
EXIT_INFRASTRUCTURE = 200  # retryable: an infrastructure failure that is not a signal

# Exception types (as torch's error files name them: ``f"{type(e).__name__}: {e}"``) that say the
# cluster failed, not the code: torch.distributed's communication errors (a lost peer, a collective
# or store timeout: NCCL's errors are DistBackendError), the elastic rendezvous's errors, and
# broken connections.
INFRASTRUCTURE_ERRORS = frozenset(
    {
        "DistError",
        "DistBackendError",
        "DistNetworkError",
        "DistStoreError",
        "RendezvousError",
        "RendezvousClosedError",
        "RendezvousTimeoutError",
        "RendezvousConnectionError",
        "RendezvousStateError",
        "ConnectionError",
        "ConnectionResetError",
        "ConnectionRefusedError",
        "ConnectionAbortedError",
        "BrokenPipeError",
        "TimeoutError",
    }
)
# gloo reports a lost peer or a collective timeout as a plain RuntimeError naming its transport's
# source file, e.g. "[.../gloo/transport/tcp/pair.cc:537] Read error ...: Connection reset by peer".
_GLOO_TRANSPORT = "gloo/transport/"


def pod_command(staged_spec_path: str) -> list[str]:
    """Pure: the command of a pod's main (``pytorch``) container for the staged spec.

    The ``kubetune`` console script rather than ``python``: it exists wherever kubetune is
    installed, with kubetune's interpreter, in any image.
    """
    return ["kubetune", "launch", staged_spec_path]


def torchrun_args(staged_spec_path: str):
    """The arguments ``torchrun -m kubetune.pod.worker SPEC`` would run with, parsed by torch's own
    parser: every option it leaves out comes from its ``PET_*`` variable (PET_NNODES "N" or
    "MIN:MAX", PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR/PORT, PET_RDZV_BACKEND/ENDPOINT/
    ID/CONF, PET_MAX_RESTARTS, PET_STANDALONE, ...), as the Training Operator sets them.

    Returns:
        argparse.Namespace: for ``torch.distributed.run.run``.
    """
    from torch.distributed import run as torchrun

    return torchrun.parse_args(["-m", WORKER_MODULE, staged_spec_path])


def main(argv: list[str] | None = None) -> int:
    """``kubetune launch STAGED_SPEC``: returns the pod's exit code (see the module's table)."""
    # Until torch's launcher installs its own handlers (when the workers start), a stop signal
    # ends the launch at once: nothing to save yet. In a container the launcher is PID 1, which
    # ignores a signal it has no handler for: without these the kubelet's SIGKILL would end it.
    signal.signal(signal.SIGTERM, _stop_before_launch)
    signal.signal(signal.SIGINT, _stop_before_launch)
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(
            "usage: kubetune launch STAGED_SPEC.yaml (in a pod, with the Training Operator's PET_* environment)",
            file=sys.stderr,
        )
        return EXIT_FAILED
    return run(args[0])


def run(staged_spec_path: str) -> int:
    """Run this node's workers as ``torchrun -m kubetune.pod.worker STAGED_SPEC`` would, with the same
    code (``torch.distributed.run.run`` over ``torchrun_args``); returns the exit code for how it
    ended, after one line on stderr saying why when it is not 0.

    Raises:
        Exception: a crash of the launcher itself (not of a worker), with its traceback.
    """
    import shutil
    import tempfile

    # torch keeps each run's error files in a /tmp/torchelastic_* directory it never removes.
    workdir = tempfile.mkdtemp(prefix="kubetune-launch-")
    try:
        from torch.distributed import run as torchrun

        args = torchrun_args(staged_spec_path)
        args.log_dir = args.log_dir or workdir
        os.environ[PARENT_PID_ENV] = str(os.getpid())  # the workers die with this launcher (kubetune.lifetime)
        os.environ[LOG_EVENTS_ENV] = "1"  # the workers' events go into the log, where `kubetune status` reads them
        os.environ[RUN_STARTED_ENV] = repr(process_started())  # the workers' phases count from the pod's start
        with translated_failures():
            torchrun.run(args)
    except BaseException as e:  # noqa: BLE001 -- every way out becomes an exit code
        code = exit_code(e)
        print(f"kubetune launch: {describe(e)} — exit {code} ({_policy(code)})", file=sys.stderr, flush=True)
        if code == EXIT_FAILED and not isinstance(e, (KubetuneError, WorkerFailed, SystemExit)):
            raise  # a bug in the launcher: its traceback, and Python's exit code 1
        return code
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def exit_code(e: BaseException) -> int:
    """Pure: the pod's exit code for how the launch ended (the module's table)."""
    if isinstance(e, Stopped):
        return 128 + e.signum
    if isinstance(e, KubetuneError):
        return EXIT_FAILED
    if isinstance(e, WorkerFailed):
        if is_infrastructure(e.message):
            # The worker recorded a communication error (a lost peer) before it ended, by exiting
            # or by a signal: gloo can abort the process (SIGABRT) while it exits with pending
            # work on the broken connection. Either way the cluster failed, not the code.
            return EXIT_INFRASTRUCTURE
        if e.exitcode < 0:
            return 128 - e.exitcode
        return EXIT_FAILED
    if isinstance(e, SystemExit):  # torch's parser on a bad PET_* value (argparse said why)
        return EXIT_FAILED
    return EXIT_INFRASTRUCTURE if is_infrastructure(f"{type(e).__name__}: {e}") else EXIT_FAILED


def is_infrastructure(message: str) -> bool:
    """Pure: does an error message (``"Type: text"``, as torch's error files hold it) say that the
    cluster failed rather than the code?"""
    kind = message.split(":", 1)[0].strip().rsplit(".", 1)[-1]  # "torch.distributed.DistNetworkError" too
    return kind in INFRASTRUCTURE_ERRORS or _GLOO_TRANSPORT in message


def describe(e: BaseException) -> str:
    """Pure: one line on how the launch ended."""
    if isinstance(e, (Stopped, KubetuneError, WorkerFailed)):
        return str(e)
    if isinstance(e, SystemExit):
        return "torchrun's settings from the PET_* environment are invalid (the parser's message is above)"
    error = f"{type(e).__name__}: {e}"
    return f"{'lost the rendezvous or its peers' if is_infrastructure(error) else 'the launcher failed'}: {error}"


def _policy(code: int) -> str:
    if code >= 128:
        return "retryable: restartPolicy ExitCode restarts the pod, which resumes from the last checkpoint"
    return "not retryable: restartPolicy ExitCode fails the job"


def _stop_before_launch(signum, frame):
    raise Stopped(f"stopped by {signal.Signals(signum).name} before the workers started", signum=signum)


@contextmanager
def translated_failures():
    """Around a run of torch's elastic launcher: its ways of failing, as kubetune's.

    Raises:
        Stopped: the launcher got SIGTERM/SIGINT (torch passed it on to the workers, which
            finished their step and wrote a checkpoint), or the failing worker itself exited 143.
        KubetuneError: the failing worker stopped on a user error (exit 2; it said why).
        WorkerFailed: the failing worker crashed or was killed (``root_failure`` picks which), or a
            worker exited 0 before the job finished and the others failed only for losing it.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from kubetune.distributed import EXIT_PREEMPTED

    try:
        yield
    except SignalException as e:
        raise Stopped(f"stopped by {e.sigval.name}", signum=e.sigval) from None
    except ChildFailedError as e:
        rank, failure = root_failure(e.failures)
        quitter = quit_early(left_notes(e.failures), e.failures, failure)
        if quitter is not None:
            raise WorkerFailed(quitter, 0) from None
        code = failure.exitcode
        if code == USER_ERROR_EXIT:
            raise KubetuneError(f"rank {rank} stopped on a user error (its message is above)") from None
        if code == EXIT_PREEMPTED:
            raise Stopped(f"rank {rank} was stopped by a signal after writing a checkpoint") from None
        raise WorkerFailed(rank, code, error_message(failure)) from None


# A rank that exits 0 before the job ends (user code calling os._exit, a library's sys.exit(0) outside
# kubetune's handling) is no failure to torch's agent, which lists only non-zero exits: its peers then
# fail in their next collective, and torch reports them. So each worker notes its start beside its error
# file (TORCHELASTIC_ERROR_FILE: torch's directory of that rank in this attempt, made anew for every
# attempt) and takes the note back when it leaves through the worker's own exit.
RUNNING_NOTE = "kubetune-running"


def _note(environ) -> Path | None:
    error_file = environ.get("TORCHELASTIC_ERROR_FILE")
    return Path(error_file).with_name(RUNNING_NOTE) if error_file and error_file != os.devnull else None


def note_start(environ=os.environ) -> None:
    """A worker, first thing: note that this rank runs (nothing outside torch's elastic launch)."""
    path = _note(environ)
    if path is not None:
        path.write_text(environ.get("RANK", "0"))


def note_exit(environ=os.environ) -> None:
    """A worker, last thing, however it ends (done, a user error, a crash, a stop): its note goes."""
    path = _note(environ)
    if path is not None:
        path.unlink(missing_ok=True)


def left_notes(failures: dict[int, ProcessFailure]) -> set[int]:
    """The ranks of this node whose workers noted their start and did not leave through their own exit,
    found in the attempt's directory of any failure's error file (empty when none left one)."""
    for failure in failures.values():
        error_file = getattr(failure, "error_file", "<N/A>")
        if error_file in ("<N/A>", "", os.devnull):
            continue
        out = set()
        for note in Path(error_file).parent.parent.glob(f"*/{RUNNING_NOTE}"):
            try:
                out.add(int(note.read_text()))
            except (OSError, ValueError):  # a worker killed while it wrote its note
                pass
        return out
    return set()


def quit_early(left: set[int], failures: dict[int, ProcessFailure], root: ProcessFailure) -> int | None:
    """Pure: the rank that exited 0 before the job finished, when that caused the failure: a rank whose
    note is left and that torch does not list as failed (it lists every non-zero exit), while the root
    failure is only a consequence (a lost peer, the agent's teardown SIGTERM). None otherwise."""
    quitters = sorted(r for r in left if r not in failures)
    consequence = root.exitcode == -signal.SIGTERM or is_infrastructure(error_message(root))
    return quitters[0] if quitters and consequence else None


def root_failure(failures: dict[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """Pure: the failure that most likely caused the others, as ``(rank, ProcessFailure)``.

    torch's ``get_first_failure`` orders by timestamp, but a worker killed by a signal (the OOM
    killer's SIGKILL, a segfault) leaves no error file, so its timestamp is only when the agent
    noticed it, after its peers had already recorded their own collective errors; and the agent's
    teardown then SIGTERMs the survivors. So: a rank killed by a signal other than that teardown
    SIGTERM comes first (lowest rank), then ranks that exited on their own, those whose error is
    not a communication error first (a peer's lost connection is a consequence; timestamps are
    whole seconds, too coarse to tell), earliest timestamp first, then the teardown's SIGTERMs
    (earliest timestamp).
    """

    def cause_order(rank: int) -> tuple:
        failure = failures[rank]
        code = failure.exitcode
        teardown = code == -signal.SIGTERM
        killed = code < 0 and not teardown
        consequence = not killed and not teardown and is_infrastructure(error_message(failure))
        return (not killed, teardown, consequence, 0 if killed else failure.timestamp, rank)

    rank = min(failures, key=cause_order)
    return rank, failures[rank]


def error_message(failure) -> str:
    """Pure: a ProcessFailure's ``"Type: text"`` message ("" when the worker left no error file)."""
    message = getattr(failure, "message", "")
    if isinstance(message, dict):  # torch's structured error file: {"message": ..., "extraInfo": ...}
        message = message.get("message", "")
    return message if isinstance(message, str) and getattr(failure, "error_file", "<N/A>") != "<N/A>" else ""


class Stopped(Exception):
    """The run was stopped by a signal (SIGTERM, SIGINT) after a checkpoint: exit 128 + signal
    (143), and running the job again resumes."""

    def __init__(self, message: str, signum: int = signal.SIGTERM):
        self.signum = int(signum)
        super().__init__(message)


class WorkerFailed(Exception):
    """A worker crashed or was killed (not a user error): ``exitcode`` is the worker's (negative:
    killed by that signal; 0: it quit before the job finished), ``message`` its error (``"Type:
    text"``; "" when it left none)."""

    def __init__(self, rank: int, exitcode: int, message: str = ""):
        self.rank, self.exitcode, self.message = rank, exitcode, message
        super().__init__(
            f"worker rank {rank} exited with code 0 before the job finished, while the others ran: code it ran "
            "(a reward function, a callback) called os._exit or the like — the other ranks' errors above say only "
            "that they lost it"
            if exitcode == 0
            else f"worker rank {rank} failed with exit code {exitcode}{_signal_name(exitcode)} (its error is above)"
        )


def _signal_name(exitcode: int) -> str:
    try:
        return f" ({signal.Signals(-exitcode).name})" if exitcode < 0 else ""
    except ValueError:
        return ""


if __name__ == "__main__":
    sys.exit(main())
