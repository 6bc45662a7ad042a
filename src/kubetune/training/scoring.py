"""lm-evaluation-harness inside a training run (the spec's ``evaluation`` section): the tasks scored on the model
being trained, before the first step, every N steps and after training, and where the scores go. ``trainer``:
the run's ``training.trainer.Trainer`` (not imported: it imports this module)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def evaluate(trainer, train_s: float, model: torch.nn.Module | None = None, final: bool = False) -> dict | None:
    """The spec's lm-evaluation-harness tasks (``evaluation``) on the model as it is now: every rank its
    share of the requests, or the writer alone on ``model`` (a sharded run's exported model, after training;
    ``final``: the evaluation after training). Rank 0 logs the scores (``lm_eval`` records: history.jsonl,
    TensorBoard, MLflow, progress) and returns the harness's results; None elsewhere. Not training time."""
    import copy

    from kubetune.artifacts.report import harness_scalars
    from kubetune.evaluation import harness

    s, ev, env = trainer.state, trainer.spec.evaluation, trainer.env
    t_eval = time.perf_counter()
    if trainer.harness_tasks is None:
        from kubetune.providers import S3Settings

        trainer.harness_tasks = harness.task_manager(
            ev.include_path, ev.tasks, field="evaluation", s3=S3Settings.from_spec(trainer.spec)
        )
    target = model if model is not None else trainer.model
    target.eval()
    with trainer.autocast:
        results = harness.run(
            target,
            copy.deepcopy(trainer.tokenizer),  # the harness may set a pad token: not on the tokenizer exported
            ev.tasks,
            trainer.harness_tasks,
            num_fewshot=ev.num_fewshot,
            limit=ev.limit,
            batch_size=ev.batch_size,
            chat=ev.chat,
            gen_kwargs=ev.gen_kwargs,
            log_samples=final and ev.log_samples,
            seed=trainer.cfg.seed,
            rank=0 if model is not None else env.rank,
            world_size=1 if model is not None else env.world_size,
            field="evaluation.tasks",
            quiet=True,
        )
    trainer.wrapped.train()
    s.epoch_started += time.perf_counter() - t_eval
    if results is None:
        return None
    values = harness_scalars(harness.scores(results))
    log.info("step %d: lm_eval %s", s.global_step, ", ".join(f"{k} {v:.4f}" for k, v in values.items()))
    trainer.loggers.log("lm_eval", s.global_step, values, trainer.eval_context(train_s, t_eval))
    return results


def final(trainer, metrics: dict, model: torch.nn.Module | None) -> None:
    """After training (``evaluation.after``): the scores into ``metrics`` (``lm_eval``: per task, under the
    harness's own metric names, and the harness's version), the per-sample log kept for the export
    (``log_samples``)."""
    from kubetune.evaluation import harness

    results = evaluate(trainer, trainer.state.train_time, model, final=True)
    if results is None:
        return
    metrics["lm_eval"] = harness.scores(results)
    metrics["lm_eval_harness"] = harness.version()
    if trainer.spec.evaluation.log_samples:
        trainer.harness_samples = results.get("samples") or {}


def write_samples(dest: Path, samples: dict) -> None:
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
