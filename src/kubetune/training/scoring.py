"""lm-evaluation-harness inside a training run (the spec's ``evaluation`` section): the tasks scored on the model
being trained, before the first step, every N steps and after training (``Harness``, one of the trainer's hooks,
holding its own task registry and per-sample log), and where the scores go (``lm_eval`` events: history.jsonl,
TensorBoard, MLflow, progress, the log line)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kubetune.training.events import Event
from kubetune.training.hooks import Hook, Metrics, Run

if TYPE_CHECKING:
    from kubetune.config.schema import EvaluationSpec

log = logging.getLogger(__name__)


class Harness(Hook):
    """The spec's lm-evaluation-harness tasks (``evaluation``) scored during training: the base model before the
    first step (``on_start``, not on resume), every ``every`` steps (the last step's left to the final scoring when
    ``after``), and after training (``after``: into the final metrics, with the per-sample log in the artifact
    when ``log_samples``). Not training time."""

    def __init__(self, spec: EvaluationSpec):
        self.spec = spec
        self.tasks: Any = None  # the harness's task registry, built at the first scoring
        self.samples: dict[str, Any] | None = None  # the final scoring's per-sample log (log_samples)

    def on_train_start(self, run: Run) -> None:
        if self.spec.on_start and run.state.global_step == 0:  # the base model's score (not on resume)
            run.state.epoch_started = time.perf_counter()
            self.score(run, 0.0)

    def on_step_end(self, run: Run) -> None:
        ev, s = self.spec, run.state
        if ev.every and s.global_step % ev.every == 0 and (s.global_step < run.layout.total_steps or not ev.after):
            self.score(run, s.training_time())

    def on_train_end(self, run: Run, metrics: Metrics) -> None:
        if self.spec.after and not run.strategy.sharded:  # every rank its share, before the export
            self.final(run, metrics, None)

    def on_exported(self, run: Run, metrics: Metrics, model: torch.nn.Module | None) -> None:
        if self.spec.after and run.strategy.sharded and run.strategy.is_writer:
            self.final(run, metrics, model)  # the writer alone, on the gathered model

    def on_artifacts(self, run: Run, staged: Path) -> None:
        if self.samples is not None:
            write_samples(staged / "lm_eval_samples", self.samples)

    def score(
        self, run: Run, train_s: float, model: torch.nn.Module | None = None, final: bool = False
    ) -> dict[str, Any] | None:
        """The tasks on the model as it is now: every rank its share of the requests, or the writer alone on
        ``model`` (a sharded run's exported model, after training; ``final``: the scoring after training). Rank 0
        emits the scores (an ``lm_eval`` event) and returns the harness's results; None elsewhere."""
        import copy

        from kubetune.artifacts.report import harness_scalars
        from kubetune.evaluation import harness

        s, ev, env = run.state, self.spec, run.env
        t_eval = time.perf_counter()
        if self.tasks is None:
            from kubetune.providers import S3Settings

            self.tasks = harness.task_manager(
                ev.include_path, ev.tasks, field="evaluation", s3=S3Settings.from_spec(run.spec)
            )
        target = model if model is not None else run.model
        target.eval()
        with run.autocast:
            results = harness.run(
                target,
                copy.deepcopy(run.tokenizer),  # the harness may set a pad token: not on the tokenizer exported
                ev.tasks,
                self.tasks,
                num_fewshot=ev.num_fewshot,
                limit=ev.limit,
                batch_size=ev.batch_size,
                chat=ev.chat,
                gen_kwargs=ev.gen_kwargs,
                log_samples=final and ev.log_samples,
                seed=run.spec.training.seed,
                rank=0 if model is not None else env.rank,
                world_size=1 if model is not None else env.world_size,
                field="evaluation.tasks",
                quiet=True,
            )
        run.wrapped.train()
        s.epoch_started += time.perf_counter() - t_eval
        if results is None:
            return None
        values = harness_scalars(harness.scores(results))
        run.events.emit(Event("lm_eval", s.global_step, values, run.eval_context(train_s, t_eval)))
        return results

    def final(self, run: Run, metrics: Metrics, model: torch.nn.Module | None) -> None:
        """After training: the scores into ``metrics`` (``lm_eval``: per task, under the harness's own metric
        names, and the harness's version), the per-sample log kept for the artifact (``log_samples``)."""
        from kubetune.evaluation import harness

        results = self.score(run, run.state.train_time, model, final=True)
        if results is None:
            return
        metrics["lm_eval"] = harness.scores(results)
        metrics["lm_eval_harness"] = harness.version()
        if self.spec.log_samples:
            self.samples = results.get("samples") or {}


def write_samples(dest: Path, samples: dict[str, Any]) -> None:
    """The harness's per-sample log: one JSONL file per task, as ``lm_eval --log_samples`` keeps it, each in
    ``dest`` whatever the task's name (``sample_file``)."""
    from kubetune.paths import safe_join

    dest.mkdir()
    for task, rows in samples.items():
        with safe_join(dest, sample_file(task), what="evaluation.log_samples").open("x") as f:
            for row in rows:
                f.write(json.dumps(row, default=str, ensure_ascii=False) + "\n")


def sample_file(task: str) -> str:
    """The file of a task's samples: ``<task>.jsonl``. A task's name is whatever its YAML says (``../../x`` too),
    so what is not a plain file name character is %-encoded (one path component, never ``..``; distinct names stay
    distinct), and a name too long for a file system is cut and completed with its hash."""
    import hashlib
    from urllib.parse import quote

    name = quote(task, safe="")
    if len(name) > 200:  # file names stop at 255 bytes
        name = f"{name[:180]}-{hashlib.sha256(task.encode()).hexdigest()[:16]}"
    return f"{name}.jsonl"
