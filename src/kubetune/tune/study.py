"""A durable Optuna study whose trials are ``kubetune run`` processes.

The study lives in the output directory (Optuna's RDB storage on SQLite, ``study.db``), one study to a
directory, so the same command continues it after any interruption, a ``kill -9`` included: finished trials are
not run again, and a trial that was running is run again in its own directory, where ``kubetune run`` resumes it
from its last checkpoint. Each trial's run gets SIGTERM when this process dies (Linux's parent-death signal), so
it writes that checkpoint and stops rather than running on unwatched.

Why Optuna's own ``optimize`` loop: its samplers, pruners and storage are the well-kept pieces; what kubetune
adds is the trial (a subprocess, its intermediate evaluations read from the run's ``history.jsonl`` and
reported to the pruner, SIGTERM when the pruner says stop) and the bookkeeping of an interrupted study.

The directory is taken as ``kubetune run`` takes its output (``artifacts.output``): a new or empty one, or one that
this study's earlier sessions marked (``.kubetune-study``); anything else only with ``--overwrite``. A study whose
name, objective or direction differs from the one stored there is refused, never continued under other settings
(``tune.storage`` decides both).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from kubetune.config import JobSpec
from kubetune.config.tune import TuneSpec
from kubetune.errors import KubetuneError
from kubetune.paths import write_atomic
from kubetune.tune import devices, space
from kubetune.tune.storage import LOCK, MARKER, check_output, open_study

POLL_S = 0.5  # how often a running trial's history is read
_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the child between fork and exec only calls it


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class TrialFailed(Exception):
    """A trial's run exited with an error (not stopped early): Optuna records the trial as failed."""


class _QuietFailedTrials(logging.Filter):
    """Drops Optuna's warnings about a trial that failed for a reason the study has said in one line (``say``):
    Optuna's would repeat it with the traceback of this process, which says nothing about the trial's run."""

    def filter(self, record: logging.LogRecord) -> bool:
        if " failed with " not in record.getMessage():
            return True
        error = record.exc_info[1] if record.exc_info else None
        return not (error is None or isinstance(error, (TrialFailed, KubetuneError)))


def say(line: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} tune: {line}", file=sys.stderr, flush=True)


class Search:
    """One ``kubetune tune`` session over the study in ``out``."""

    def __init__(self, base: dict, spec: JobSpec, out: Path, gpus: list[str] | None = None):
        self.base, self.spec, self.out = base, spec, out
        tune = spec.tune
        assert tune is not None  # kubetune.tune.run's require: a study's spec has one
        self.tune: TuneSpec = tune
        self.parent: tuple[Any, str] | None = None  # the MLflow client and the study's run (tracking.mlflow)
        # on GPUs (``devices.visible_gpus``), each running trial's processes get devices of their own
        self.gpus = devices.GpuPool(gpus, spec.distributed.procs_per_node) if gpus else None

    # ---- the study ----
    def run(self) -> Any:
        """Run (or continue) the study to ``tune.trials``; returns Optuna's study.

        Raises:
            KubetuneError: the output is not this study's to write (see ``storage.check_output``), another session runs
                the study, its study.db is unreadable or holds another study or objective, more trials failed than
                tune.max_failed.
        """
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        adopted = check_output(self.spec, self.out)
        self.out.mkdir(parents=True, exist_ok=True)
        lock = open(self.out / LOCK, "w")  # noqa: SIM115 - held for the whole session
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise KubetuneError(
                f"another kubetune tune is running the study in {self.out}",
                field="output.uri",
                fix="wait for it to finish, or stop it (it continues where it stopped when run again)",
            ) from None
        study = open_study(self.spec, self.out, create=True)
        if adopted:
            say(adopted)
        if not (self.out / MARKER).exists():
            created = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            write_atomic(self.out / MARKER, json.dumps({"format": "kubetune-study/1", "created": created}) + "\n")
        for sub in ("trials", "specs", "logs"):
            (self.out / sub).mkdir(exist_ok=True)
        # a new session's sampler continues from a seed of its own: the same seed again would draw the values
        # of the first session's first trials again
        study.sampler = space.sampler(self.tune, offset=len(study.get_trials(deepcopy=False)))
        self.parent = self._mlflow_parent(study)
        self._resume_interrupted(study)
        remaining = self.tune.trials - len(counted(study))
        if self.tune.algorithm == "grid":
            combos = 1
            for values in space.grid_values(self.tune).values():
                combos *= len(values)
            remaining = min(remaining, combos - len(counted(study)))
        if remaining > 0:
            say(
                f"study {self.spec.name}: {remaining} of {self.tune.trials} trials to run, {self.tune.parallel} at "
                f"once, {self.tune.algorithm}, {'minimize' if self.tune.minimize() else 'maximize'} "
                f"{self.tune.objective}"
            )
            quiet, optimizing = _QuietFailedTrials(), logging.getLogger("optuna.study._optimize")
            optimizing.addFilter(quiet)
            try:
                study.optimize(
                    self._objective,
                    n_trials=remaining,
                    n_jobs=self.tune.parallel,
                    catch=(TrialFailed,),
                    callbacks=[self._after_trial],
                )
            finally:
                optimizing.removeFilter(quiet)
        self._mlflow_finish(study)
        failed = genuinely_failed(study)
        if len(failed) > self.tune.max_failed:
            raise KubetuneError(
                f"{len(failed)} trials failed (trial {failed[0].number}: {failed[0].user_attrs.get('error', '?')})",
                field="tune.max_failed",
                fix=f"read the trial's log under {self.out / 'logs'}; raise tune.max_failed to go on past failures",
            )
        return study

    def _mlflow_parent(self, study) -> tuple[Any, str] | None:
        """With tracking.mlflow: the study's parent run (made once, its id kept in the study), under which every
        trial's own run is nested (the ``mlflow.parentRunId`` tag); None without."""
        cfg = self.spec.tracking.mlflow
        if cfg is None:
            return None
        from kubetune.training import tracking

        client = tracking.connect(self.spec)
        run_id = study.user_attrs.get("mlflow_run")
        if run_id is None:
            experiment = client.get_experiment_by_name(cfg.experiment)
            experiment_id = experiment.experiment_id if experiment else client.create_experiment(cfg.experiment)
            tags = {"kubetune.job": self.spec.name, "kubetune.study": str(self.out), **cfg.tags}
            run_id = client.create_run(
                experiment_id, run_name=f"{cfg.run_name or self.spec.name}-tune", tags=tags
            ).info.run_id
            study.set_user_attr("mlflow_run", run_id)
            for path, p in self.tune.space.items():
                client.log_param(run_id, f"tune.space.{path}", json.dumps(p.model_dump(exclude_none=True)))
            for key in ("objective", "algorithm", "trials", "parallel", "seed"):
                client.log_param(run_id, f"tune.{key}", str(getattr(self.tune, key)))
        say(f"MLflow: study run {run_id}, each trial's run nested under it")
        return client, run_id

    def _mlflow_finish(self, study) -> None:
        if self.parent is None:
            return
        client, run_id = self.parent
        try:
            best = study.best_trial
        except ValueError:
            return
        client.log_metric(run_id, f"best_{self.tune.objective}", best.value)
        client.set_tag(run_id, "kubetune.best_trial", str(best.number))
        for path, value in best.params.items():
            client.set_tag(run_id, f"best.{path}", str(value))
        client.set_terminated(run_id)

    def _resume_interrupted(self, study) -> None:
        """Trials left running by a session that died: each marked failed and queued again with its values and
        its directory, where its run resumes from its checkpoint (after the old run has stopped)."""
        from optuna.trial import TrialState

        queued = {t.user_attrs.get("resumes") for t in study.get_trials(deepcopy=False)}
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            _wait_gone(t.user_attrs.get("pid"), t.user_attrs.get("spec"))
            study.tell(t.number, state=TrialState.FAIL)
            if t.number not in queued:
                study.enqueue_trial(t.params, user_attrs={"dir": t.user_attrs.get("dir"), "resumes": t.number})
                say(
                    f"trial {t.number} was interrupted: it runs again in {t.user_attrs.get('dir')}, from its checkpoint"
                )

    def _after_trial(self, study, trial) -> None:
        if len(genuinely_failed(study)) > self.tune.max_failed:
            study.stop()

    # ---- one trial ----
    def _objective(self, trial) -> float:
        values = {path: space.suggest(trial, path, p) for path, p in self.tune.space.items()}
        name = self._trial_dir(trial)
        trial.set_user_attr("dir", name)  # before its run starts: a session killed now resumes it there
        out, spec_path, log_path = self.out / "trials" / name, self.out / "specs" / f"{name}.yaml", self.out / "logs"
        nested = None
        threads = space.threads_per_trial(self.spec)
        if threads is not None:  # the cores shared out among the trials running at once
            values = {**values, "distributed.threads_per_proc": threads}
        if self.parent is not None:  # the trial's MLflow run under the study's, named after the trial
            nested = {"mlflow.parentRunId": self.parent[1]}
            values = {**values, "tracking.mlflow.run_name": f"{self.spec.name}-{name}"}
        trial_raw = space.trial_spec(self.base, values, str(out), nested)
        spec_path.write_text(yaml.safe_dump(trial_raw, sort_keys=False))
        values = {k: v for k, v in values.items() if k in self.tune.space}
        lease: contextlib.AbstractContextManager[list[str]] = (
            self.gpus.lease() if self.gpus else contextlib.nullcontext([])
        )
        with lease as gpus:
            return self._run_trial(trial, name, spec_path, out, log_path, values, gpus)

    def _trial_dir(self, trial) -> str:
        """The trial's name: its directory under trials/, its spec under specs/ and its log under logs/. An
        interrupted trial's own (its run resumes there); else ``trial-NNN``, or ``trial-NNN.2``, ... where an
        earlier study left that name (its study.db removed, or a directory taken with --overwrite): made with
        mkdir, so that no two trials share a directory, a spec or a log."""
        if trial.user_attrs.get("dir"):
            return trial.user_attrs["dir"]
        first, k = f"trial-{trial.number:03d}", 1
        while True:
            name = first if k == 1 else f"{first}.{k}"
            k += 1
            if (self.out / "specs" / f"{name}.yaml").exists() or (self.out / "logs" / f"{name}.log").exists():
                continue
            try:
                (self.out / "trials" / name).mkdir()
            except FileExistsError:
                continue
            return name

    def _run_trial(self, trial, name: str, spec_path: Path, out: Path, log_path: Path, values: dict, gpus) -> float:
        """The trial's ``kubetune run`` (on ``gpus`` where the study has GPUs), its evaluations reported to the
        pruner as they come; returns the objective of the finished run."""
        import optuna

        env = dict(os.environ)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        with open(log_path / f"{name}.log", "a") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kubetune", "run", str(spec_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - only prctl, on a library loaded before the fork
            )
        trial.set_user_attr("spec", str(spec_path))
        trial.set_user_attr("pid", proc.pid)
        shown = ", ".join(f"{p}={v:.3g}" if isinstance(v, float) else f"{p}={v}" for p, v in values.items())
        say(
            f"trial {trial.number} started: {shown}"
            + (f" on GPU {','.join(gpus)}" if gpus else "")
            + (" (resumed)" if "resumes" in trial.user_attrs else "")
        )
        reported: set[int] = set()
        while True:
            done = proc.poll() is not None
            for step, value in intermediate(out, self.tune.objective):
                if step in reported:
                    continue
                reported.add(step)
                trial.report(value, step)
                say(f"trial {trial.number} step {step}: {self.tune.objective} {value:.4f}{self._best_text(trial)}")
                if not done and trial.should_prune():
                    proc.send_signal(signal.SIGTERM)  # the run stops at its next step boundary, checkpointed
                    proc.wait()
                    trial.set_user_attr("stopped_at", step)
                    say(f"trial {trial.number} stopped early at step {step} (below the median of earlier trials)")
                    raise optuna.TrialPruned()
            if done:
                break
            time.sleep(POLL_S)
        if proc.returncode != 0:
            error = _last_error(log_path / f"{name}.log")
            trial.set_user_attr("error", error)
            say(f"trial {trial.number} failed (exit {proc.returncode}): {error}")
            raise TrialFailed(error)
        try:
            value = final_value(out, self.tune.objective)
        except TrialFailed as e:
            trial.set_user_attr("error", str(e))
            say(f"trial {trial.number} failed: {e}")
            raise
        say(f"trial {trial.number} finished: {self.tune.objective} {value:.4f}{self._best_text(trial)}")
        return value

    def _best_text(self, trial) -> str:
        try:
            best = trial.study.best_trial
        except ValueError:  # none finished yet
            return ""
        return f" (best so far {best.value:.4f}, trial {best.number})"


def counted(study) -> list:
    """The trials that count towards ``tune.trials``: finished, stopped early, or failed (not the interrupted
    ones, which run again)."""
    from optuna.trial import TrialState

    done = (TrialState.COMPLETE, TrialState.PRUNED)
    return [t for t in study.get_trials(deepcopy=False) if t.state in done] + genuinely_failed(study)


def genuinely_failed(study) -> list:
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    resumed = {t.user_attrs.get("resumes") for t in trials}
    return [t for t in trials if t.state == TrialState.FAIL and t.number not in resumed]


def intermediate(out: Path, objective: str) -> list[tuple[int, float]]:
    """The run's evaluations of ``objective`` so far (step, value), from its history.jsonl."""
    path = out / "history.jsonl"
    if not path.exists():
        return []
    kind = "lm_eval" if "/" in objective else "eval"
    points = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line being written
            continue
        value = record.get(objective)
        if record.get("type") == kind and isinstance(value, (int, float)) and record.get("step"):
            points.append((int(record["step"]), float(value)))
    return points


def final_value(out: Path, objective: str) -> float:
    """The objective in the finished run's metrics.json (an lm-eval score from its ``lm_eval``)."""
    metrics = json.loads((out / "metrics.json").read_text())
    if "/" in objective:
        from kubetune.artifacts.report import harness_scalars

        metrics = harness_scalars(metrics.get("lm_eval") or {})
    value = metrics.get(objective)
    if value is None:
        raise TrialFailed(f"the run reported no {objective} (metrics.json has {sorted(metrics)[:12]})")
    # said here, in the trial's line: Optuna would fail the trial on a NaN with a warning of its own
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise TrialFailed(f"the run's {objective} is {value!r}, not a finite number")
    return float(value)


def _last_error(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error") or " ERROR " in line or "Error" in line]
    return (errors or lines or ["no output"])[-1][-300:]


def _wait_gone(pid, spec: str | None, timeout: float = 300.0) -> None:
    """Until the run of an interrupted trial (``pid``, started on ``spec``) has stopped: its parent-death
    SIGTERM makes it write a checkpoint first, which the trial's next run resumes from."""
    if not pid or not spec:
        return
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return
        if spec not in cmdline:  # the pid is another process's now
            return
        time.sleep(0.2)
