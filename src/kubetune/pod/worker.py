"""The worker entry point: what each training process runs, locally and in Kubernetes pods.

    torchrun --nnodes N --nproc-per-node P ... -m kubetune.pod.worker job.yaml

Reads the distributed environment once (RANK, WORLD_SIZE, ... as set by torchrun and the
Training Operator), runs the trainer on the spec's task, and exits 0; 2 on a user error (one line, no
traceback); 143 when SIGTERM/SIGINT stopped it after writing a checkpoint.
"""

from __future__ import annotations

import os
import signal
import sys


def _stop_before_training(signum, frame):
    # SIGINT/SIGTERM while the worker is still starting (importing torch takes seconds): there is
    # nothing to save yet, so exit at once with the "stopped" code, without a KeyboardInterrupt
    # traceback. install_signal_handlers() replaces this once training can stop gracefully.
    raise SystemExit(143)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, _stop_before_training)
    signal.signal(signal.SIGTERM, _stop_before_training)
    from kubetune.lifetime import PARENT_PID_ENV, die_with_parent

    # Before anything else (importing torch takes seconds): a launcher killed outright takes its workers
    # with it, never leaving them to train on into an output a new run resumes into.
    die_with_parent(int(os.environ.get(PARENT_PID_ENV, 0)) or None)

import logging  # noqa: E402
import warnings  # noqa: E402

from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from kubetune import distributed  # noqa: E402
from kubetune.config import JobSpec, load_spec  # noqa: E402
from kubetune.errors import USER_ERROR_EXIT, KubetuneError, exit_now  # noqa: E402

log = logging.getLogger("kubetune.pod.worker")


def run_worker(spec: JobSpec) -> dict:
    """Run ``spec`` in this process as one rank of the job: set up the process group, claim the
    output (rank 0), build the trainer and train.

    Returns:
        The final metrics (identical on every rank).
    """
    from kubetune import tasks

    task = tasks.get(spec.task)
    env = distributed.read_env()
    distributed.setup_logging(env)
    stop = distributed.install_signal_handlers()
    _limit_threads(spec, env)
    # peft reads transformers' deprecated `is_gradient_checkpointing` alias inside
    # get_peft_model; the FutureWarning is about peft's code, not the user's job.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    try:
        metrics = _train(spec, env, task, stop)
    except BaseException as e:
        from kubetune.pod.launch import is_infrastructure

        # After a lost peer, destroying the process group waits on gloo's pending work over the
        # broken connection, which can abort the process (SIGABRT) before the error is recorded:
        # leave the group to the process's exit.
        if not is_infrastructure(f"{type(e).__name__}: {e}"):
            distributed.teardown()
        raise
    distributed.teardown()
    return metrics


def _train(spec: JobSpec, env: distributed.DistEnv, task, stop) -> dict:
    import contextlib
    from pathlib import Path

    from tqdm.contrib.logging import logging_redirect_tqdm

    from kubetune.artifacts.output import Output
    from kubetune.training.build import build_trainer
    from kubetune.training.trainer_status import Endpoint

    device = distributed.pick_device(env)
    control = distributed.setup(env, device, spec.distributed.backend, spec.distributed.timeout_minutes)
    # The output, resolved once and passed down. Rank 0 checks it (refusing someone else's directory
    # or a finished run), marks it as kubetune's and logs whether this run resumes or starts over;
    # every rank then reads checkpoints from the same place.
    dest = Output.for_spec(spec)
    plan = dest.claim(spec) if env.is_main else None
    finished = distributed.broadcast_object(dest.finished_metrics() if plan and plan.action == "done" else None)
    if finished is not None:  # this job already finished into this output: nothing to train
        return finished
    trace = os.environ.get("KUBETUNE_TRACE_DIR")  # tests: the rows every micro-batch trained on
    # Log lines go through tqdm.write so they never land in the middle of the progress bar.
    with logging_redirect_tqdm(), contextlib.ExitStack() as cleanup:
        trainer = build_trainer(
            spec,
            env,
            task,
            dest,
            device,
            control_group=control,
            stop=stop,
            cleanup=cleanup,
            trace_dir=Path(trace) if trace else None,
            # Kubeflow Trainer's TrainJobStatus variables (absent elsewhere: nothing is sent)
            status_endpoint=Endpoint.from_env(os.environ),
        )
        return trainer.train()


def _limit_threads(spec: JobSpec, env: distributed.DistEnv) -> None:
    import torch

    if spec.distributed.threads_per_proc:
        torch.set_num_threads(spec.distributed.threads_per_proc)
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, env.local_world_size)))


@record
def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kubetune.pod.worker SPEC.yaml", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)
    from kubetune.training.trainer import Preempted

    try:
        run_worker(load_spec(args[0]))
    except Preempted:
        sys.exit(distributed.EXIT_PREEMPTED)
    except KubetuneError as e:
        rank = os.environ.get("RANK", "0")
        lines = e.lines() if hasattr(e, "lines") else [str(e)]
        # An error every rank reached together (they agreed on it) is said once, by rank 0.
        if rank == "0" or not getattr(e, "agreed", False):
            for line in lines:
                print(f"[rank {rank}] error: {line}", file=sys.stderr, flush=True)
        sys.exit(USER_ERROR_EXIT)


def _exit_now(code) -> None:
    """Leave without the interpreter's finalization. Why: at exit, freeing DDP's Reducer drops the
    last reference to the gloo process group, whose destructor (holding the GIL) waits for gloo's
    worker thread, which may at that moment be freeing a finished collective's tensors and need the
    GIL: a deadlock, until the launcher's teardown SIGKILLs the rank 30 s later (seen in the
    diverged-run test: a killed rank 0 instead of its user error). Everything the run writes is
    closed by then; only the standard streams are flushed here."""
    code = 0 if code is None else code if isinstance(code, int) else 1
    logging.shutdown()
    note_exit()
    exit_now(code)


if __name__ == "__main__":
    from kubetune.pod.launch import note_exit, note_start

    note_start()  # its launcher can tell this rank's exit from an early os._exit in code it runs
    try:
        main()
    except SystemExit as e:
        _exit_now(e.code)
    except BaseException:  # what @record wrote to the error file, also on stderr as Python would print it
        import traceback

        traceback.print_exc()
        _exit_now(1)
    _exit_now(0)
