"""`kubetune run` (the local backend's foreground run, with its preflight checks), and what pods
run: `launch`, `worker`, `fetch`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from kubetune.cli.common import (
    INTERNAL,
    Interrupted,
    SetOpt,
    SpecArg,
    _fail,
    app,
)
from kubetune.cli.spec import _check_this_machine
from kubetune.errors import KubetuneError


@app.command()
def run(
    spec: SpecArg,
    set_: SetOpt = None,
    preflight: Annotated[bool, typer.Option(help="Check model and data before starting workers.")] = True,
    resume: Annotated[bool, typer.Option(help="Continue from the newest complete checkpoint under output.uri.")] = True,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help=(
                "Write into a non-empty output that kubetune did not create, or replace a finished run there once "
                "this one finishes (only kubetune's own files are replaced)."
            ),
        ),
    ] = False,
    local_addr: Annotated[
        str | None, typer.Option("--local-addr", help="Multi-node: this node's address as the other nodes reach it.")
    ] = None,
) -> None:
    """Run the job on this machine: nodes × procs_per_node workers under torch elastic.

    Exit codes: 0 done; 1 a worker crashed; 2 bad input; 143 stopped by SIGTERM/SIGINT after a
    checkpoint (run the same command again to resume)."""
    import time

    from kubetune.backends import base
    from kubetune.config import load_spec
    from kubetune.config.load import resolve_data_paths
    from kubetune.pod.launch import Stopped, WorkerFailed

    started = time.time()
    job = record = None
    backend = base.foreground()  # `kubetune run` is the local backend's run, in the foreground
    try:
        job = load_spec(
            spec,
            [
                *(set_ or []),
                *([] if resume else ["training.resume=never"]),
                *(["output.overwrite=true"] if overwrite else []),
            ],
        )
        job = resolve_data_paths(job, spec.parent)  # relative data paths: next to the spec file
        record = backend.record_run(job)  # what `kubetune status NAME` reads from another shell
        if preflight and _checked_aside(job) == "done":
            return
        backend.run(job, local_addr=local_addr)
    except KubetuneError as e:
        _fail(e)
    except Interrupted:
        # Ctrl-C before the workers started (reading the spec, checking model and data); once they
        # run, the elastic launcher takes the signal and the workers stop at a step boundary.
        typer.echo(
            (
                f"interrupted before training started; nothing was written{_where(job)} — run the same command again "
                "to start"
            ),
            err=True,
        )
        raise typer.Exit(130) from None
    except WorkerFailed as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    except Stopped as e:
        typer.echo(f"stopped: {e} — {_after_stop(job, started)}", err=True)
        raise typer.Exit(143) from None
    finally:
        if record is not None:
            ended = sys.exc_info()[1]
            code = 0 if ended is None else ended.exit_code if isinstance(ended, typer.Exit) else 1
            backend.end_run(record, code)


def _where(job) -> str:
    return f" to {job.output.uri}" if job is not None else ""


def _after_stop(job, started: float) -> str:
    """What a user can do after a stop signal, from the state the output is in now."""
    from kubetune.artifacts.output import Output

    try:
        state = Output.for_spec(job).state_after_stop(started)
    except Exception:  # the stop message must not fail on a broken output
        return "run the same command again to resume"
    return {
        "finished": f"the run had already finished: its artifacts in {job.output.uri} are complete",
        "checkpoint": "run the same command again to resume from the last checkpoint",
        "nothing": "no checkpoint was written yet, so running the same command again starts over",
    }[state]


def _checked_aside(job) -> str:
    """``_preflight`` in a child process, while this one imports torch's elastic launcher (seconds, in parallel);
    returns its plan's action. Why a child: the checks import pandas, datasets and transformers and read the whole
    data, which this process would otherwise hold (hundreds of MB) for the whole run while it only waits for its
    workers. The child says its own error (one line, passed on through this process's stderr) and dies with this
    process however it ends.

    Raises:
        typer.Exit: the checks failed (2: a user error, said by the child; 1: a crash, its traceback above).
    """
    import os
    import subprocess
    import tempfile

    from kubetune.config import dump_spec
    from kubetune.lifetime import PARENT_PID_ENV

    with tempfile.TemporaryDirectory(prefix="kubetune-preflight-") as tmp:
        spec_file = Path(tmp) / "job.yaml"
        spec_file.write_text(dump_spec(job))
        child = subprocess.Popen(
            [sys.executable, "-c", "from kubetune.cli.run import _preflight_main; _preflight_main()", str(spec_file)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,  # said again through this process: a caller that captures it (a test) sees it
            text=True,
            env={**os.environ, PARENT_PID_ENV: str(os.getpid())},
        )
        try:
            import kubetune.backends.local.launcher  # noqa: F401 -- torch, imported while the child checks

            out, errors = child.communicate()
            said = out.splitlines()
        finally:
            if child.poll() is None:  # interrupted while it checked
                child.kill()
                child.wait()
    if errors.strip():
        typer.echo(errors.rstrip("\n"), err=True)
    if child.returncode == 0:
        for line in said[:-1]:  # anything the checks printed (a library's notice) before their answer, the last line
            typer.echo(line)
        return said[-1].strip() if said else ""
    if child.returncode == 130:
        raise Interrupted()
    if child.returncode != 2:  # not a user error (the child said that one): a crash, its traceback above
        typer.echo(f"error: the checks before the run failed with exit code {child.returncode}", err=True)
    raise typer.Exit(2 if child.returncode == 2 else 1)


def _preflight_main() -> None:
    """The child of ``_checked_aside``: ``_preflight`` on the spec file in ``sys.argv[1]``; prints the action on
    stdout and exits 0, or says the error on one line and exits 2 (130 on Ctrl-C)."""
    import os

    from kubetune.config import load_spec
    from kubetune.lifetime import PARENT_PID_ENV, die_with_parent

    die_with_parent(int(os.environ.get(PARENT_PID_ENV, 0)) or None)
    try:
        print(_preflight(load_spec(Path(sys.argv[1]))), flush=True)
    except KubetuneError as e:
        try:
            _fail(e)
        except typer.Exit as done:
            sys.exit(done.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)


def _preflight(job) -> str:
    """Fail fast, before any worker starts, on a bad model path, data or output; returns what the
    run will do with its output (``done``: this job already finished there)."""
    from kubetune import artifacts, providers, tasks
    from kubetune.artifacts.output import Output

    _check_this_machine(job)
    # The output first (a directory listing): another live run there, someone else's files or a finished run is
    # said before seconds go into the model and the data; a finished run of this very job has nothing to check.
    plan = Output.for_spec(job).check(job)
    if plan.action == "done":
        typer.echo(f"output {job.output.uri}: {plan.detail}", err=True)
        return plan.action
    if job.tracking.mlflow:  # the tracking server is up and takes the credentials (one line if not)
        from kubetune.training import tracking

        tracking.connect(job)
    s3 = providers.S3Settings.from_spec(job)
    harness_tasks = None
    if job.evaluation:  # the harness, its tasks and their data before anything is downloaded or any worker starts
        from kubetune.evaluation import harness

        ev = job.evaluation
        manager = harness.task_manager(ev.include_path, ev.tasks, field="evaluation", s3=s3)
        harness.check_tasks(ev.tasks, manager, field="evaluation.tasks")
        harness_tasks = harness.check_data(ev.tasks, manager, field="evaluation.tasks")
    model = artifacts.resolve_model(job)
    frames = tasks.get(job.task).load_frames(job.data, job.training.seed, s3)
    if harness_tasks is not None:  # and whether their requests fit the model, with the tokenizer training will have
        from kubetune.tasks.common import load_tokenizer, prepare_tokenizer

        tokenizer = load_tokenizer(model)
        # as the language-model tasks prepare it: a template for anything but plain text (data.chat_template first)
        prepare_tokenizer(
            tokenizer, getattr(frames, "format", "text") != "text", getattr(job.data, "chat_template", None)
        )
        harness.check_fit(
            harness_tasks,
            tokenizer,
            model,
            num_fewshot=ev.num_fewshot,
            limit=ev.limit,
            chat=ev.chat,
            gen_kwargs=ev.gen_kwargs,
            seed=job.training.seed,
            field="evaluation",
        )
    return plan.action


@app.command(rich_help_panel=INTERNAL)
def launch(spec: SpecArg) -> None:
    """Run this pod's workers as torchrun would, from the operator's PET_* environment.

    What a Kubernetes pod's main container runs. Exit codes, for restartPolicy
    ExitCode: 0 done; 143 stopped by SIGTERM after a checkpoint; 128+N a worker
    killed by signal N (137: the OOM killer); 200 an infrastructure failure (a
    lost peer, a timeout): the operator restarts the pod, which resumes from
    the last checkpoint. 1: a user error or a crash, and the job fails."""
    from kubetune.pod.launch import main as launch_main

    raise typer.Exit(launch_main([str(spec)]))


@app.command(rich_help_panel=INTERNAL)
def worker(spec: SpecArg) -> None:
    """Run one worker process (what torchrun starts in each pod; reads RANK, WORLD_SIZE, ...)."""
    from kubetune.pod.worker import main as worker_main

    worker_main([str(spec)])


@app.command(rich_help_panel=INTERNAL)
def fetch(
    spec: SpecArg,
    dest: Annotated[Path, typer.Option("--dest", help="Directory to stage into (a pod's workspace).")],
    set_: SetOpt = None,
) -> None:
    """Stage a job's model and data into DEST (the init container's command); idempotent."""
    import logging

    from kubetune.config import load_spec
    from kubetune.pod.stage import stage

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        staged = stage(load_spec(spec, set_), dest)
    except KubetuneError as e:
        _fail(e)
    typer.echo(str(staged))
