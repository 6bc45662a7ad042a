"""The trainer every task shares: the outer loop, one optimizer step, evaluation, checkpoints and
the export. ``build.py`` makes a ``Trainer`` (set-up and resume); the worker sets up the process
group and claims the output before.

What differs per task (data preparation, the model, the loss of a micro-batch, evaluation,
export) comes in a ``Task``; how the model is spread over ranks comes in a ``Strategy``; where
metrics go comes in ``Loggers``; where the run is lives in one ``TrainState``. One loop for every
task, because everything a checkpoint needs to continue exactly and the ranks' agreement on
stopping must stay identical across tasks.
"""

from __future__ import annotations

import logging
import math
import resource
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError

from kubetune import artifacts, distributed, tasks
from kubetune.artifacts.output import Output
from kubetune.checkpoint.store import CheckpointStore
from kubetune.config import JobSpec
from kubetune.data import StepBatch, batches
from kubetune.data.sharding import (
    epoch_order,
    rank_plan,
    token_micro_batches,
    token_plan,
)
from kubetune.distributed import DistEnv
from kubetune.errors import AgreedError, KubetuneError
from kubetune.tasks import base
from kubetune.tasks.base import Prepared, Task
from kubetune.training import scoring
from kubetune.training.loggers import Loggers, ProgressLogger
from kubetune.training.state import Contents, TrainState
from kubetune.training.strategy import Strategy
from kubetune.training.trace import Trace

log = logging.getLogger(__name__)


@dataclass
class Layout:
    """How the run's data is laid out over ranks and steps (built by ``training.build``)."""

    grad_accum: int  # micro-batches per rank per optimizer step (a resumed run's may differ from the spec's)
    group_unit: int  # the length-grouping unit of the data order (the global micro-batch of the run's start)
    token_budget: int | None  # data.max_tokens_per_batch: micro-batches by tokens (packing)
    train_lengths: np.ndarray  # tokens per training example
    workers: int  # data loader processes
    epoch_steps: list[int] = field(default_factory=list)  # optimizer steps of each epoch (streamed: at most)
    total_steps: int = 0
    streamed: bool = False  # data.streaming: the epochs' steps are known only once read
    repeat: int = 1  # optimizer steps per step of the data plan (an online task's num_iterations)

    def plan(self, epoch: int, cfg, data: Prepared, env: DistEnv):
        """This rank's steps of ``epoch``: a pure function of the seed, the epoch and the layout."""
        plan = self._plan(epoch, cfg, data, env)
        return plan if self.repeat == 1 else Repeated(plan, self.repeat)

    def _plan(self, epoch: int, cfg, data: Prepared, env: DistEnv):
        if self.token_budget:  # packed: lengths cost no padding, so the order is not grouped by length
            order = epoch_order(data.train_rows, epoch, cfg.seed)
            micros = token_micro_batches(order, self.train_lengths, self.token_budget)
            return token_plan(micros, rank=env.rank, world_size=env.world_size, grad_accum=self.grad_accum)
        lengths = self.train_lengths if cfg.group_by_length else None
        order = epoch_order(data.train_rows, epoch, cfg.seed, lengths, self.group_unit)
        return rank_plan(
            order, rank=env.rank, world_size=env.world_size, batch_size=cfg.batch_size, grad_accum=self.grad_accum
        )


@dataclass(frozen=True)
class Repeated:
    """A plan with each step ``times`` times in a row (lazy, as the plan it wraps)."""

    plan: Any
    times: int

    def __len__(self) -> int:
        return len(self.plan) * self.times

    def __getitem__(self, k: int):
        if not 0 <= k < len(self):
            raise IndexError(k)
        return self.plan[k // self.times]


@dataclass
class Trainer:
    """One rank's training run, holding what ``training.build.build_trainer`` made for it (the
    constructor does nothing else); ``train()`` is the outer loop over ``train_step()``."""

    spec: JobSpec
    env: DistEnv
    task: Task
    dest: Output  # the run's output: staging, checkpoints, publishing
    device: torch.device
    dtype: torch.dtype
    tokenizer: Any
    data: Prepared
    model: torch.nn.Module  # the model as built (what is exported)
    strategy: Strategy
    wrapped: torch.nn.Module  # the model as the strategy trains it
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    guard: FiniteGuard
    autocast: Any
    layout: Layout
    contents: Contents  # what a checkpoint holds beside the model and optimizer (its fingerprint among it)
    state: TrainState
    loggers: Loggers
    bar: Any  # the tqdm progress bar
    progress: ProgressLogger | None = None  # rank 0's progress.json
    mlflow: Any = None  # rank 0's MLflow logger, if tracking.mlflow
    control_group: Any = None  # the CPU group of the ranks' agreements (None: the default group)
    stop: threading.Event = field(default_factory=threading.Event)  # set by a stop signal
    trace: Trace | None = None
    t_start: float = field(default_factory=time.perf_counter)
    _epoch_ended: bool = False  # the running epoch's data ran out (not cut short by the step limit)
    _saved_step: int | None = None  # the step of the checkpoint this run wrote or resumed from last
    harness_tasks: Any = None  # lm-evaluation-harness's task registry (evaluation section), built once
    harness_samples: dict | None = None  # the final harness evaluation's per-sample log (evaluation.log_samples)

    def __post_init__(self) -> None:
        # every rank's real tokens so far, for the progress line's tokens/s, in a buffer that lives as
        # long as the trainer: a temporary one could be freed last by gloo's thread, which needs the
        # GIL for that (see worker._exit_now)
        self._tokens_seen = torch.zeros(1, dtype=torch.float64, device=self.device)

    @property
    def cfg(self):
        return self.spec.training

    @property
    def out(self) -> Path:
        return self.dest.local

    # ---- the outer loop ----
    def train(self) -> dict:
        s, cfg, env = self.state, self.cfg, self.env
        eval_metrics: dict = {}
        s.last_checkpoint_at = time.monotonic()
        self._saved_step = s.global_step or None  # a run past step 0 here resumed from that step's checkpoint
        start_epoch, start_step = s.epoch, s.step_in_epoch
        if cfg.eval_on_start and s.global_step == 0:
            s.epoch_started = time.perf_counter()
            eval_metrics = self.evaluate(0.0)
        harness = self.spec.evaluation
        if harness and harness.on_start and s.global_step == 0:  # the base model's score (not on resume)
            s.epoch_started = time.perf_counter()
            scoring.evaluate(self, 0.0)
        for epoch in range(start_epoch, len(self.layout.epoch_steps)):
            s.epoch, s.step_in_epoch = epoch, start_step if epoch == start_epoch else 0
            self.wrapped.train()
            s.epoch_started = time.perf_counter()
            self._epoch_ended = False
            for step in self.epoch_batches(epoch):
                if s.global_step >= self.layout.total_steps:
                    break
                try:
                    self.train_step(step)
                except distributed.StepAbandoned:
                    self._stop_inside_step()
                if s.global_step % cfg.log_every == 0 or s.global_step == self.layout.total_steps:
                    self._log_train()
                # Before the checkpoint, so that a resumed run's history holds this evaluation too.
                if (
                    cfg.eval_every
                    and s.global_step % cfg.eval_every == 0
                    and s.step_in_epoch < self.layout.epoch_steps[epoch]
                    and s.global_step < self.layout.total_steps
                ):
                    eval_metrics = self.evaluate(s.training_time())
                if (
                    harness
                    and harness.every
                    and s.global_step % harness.every == 0
                    and (s.global_step < self.layout.total_steps or not harness.after)
                ):
                    scoring.evaluate(self, s.training_time())
                # Every rank must agree, at the same step, on stopping and on checkpointing.
                timed = (
                    bool(cfg.checkpoint_minutes)
                    and env.is_main
                    and time.monotonic() - s.last_checkpoint_at >= 60 * cfg.checkpoint_minutes
                )
                stop, timed = distributed.any_rank(
                    self.stop.is_set(), timed, device=self.device, group=self.control_group
                )
                if stop or timed or (cfg.checkpoint_every and s.global_step % cfg.checkpoint_every == 0):
                    # a checkpoint holds only weights trained on finite gradients
                    self.guard.check(s.global_step, self.dest.checkpoints)
                    self.save_checkpoint()
                    s.last_checkpoint_at = time.monotonic()
                if stop:
                    self._preempted()
            else:
                self._epoch_ended = True
            s.train_time += time.perf_counter() - s.epoch_started
            self.guard.check(s.global_step, self.dest.checkpoints)
            eval_metrics = self.evaluate(s.train_time)
            if s.global_step >= self.layout.total_steps:
                break
        self.bar.close()
        return self._finish(eval_metrics)

    def epoch_batches(self, epoch: int):
        """This rank's steps of ``epoch`` from where the run stands, as batches (a loader's workers build them)."""
        if self.data.stream is not None:  # read and tokenized here, step by step: the checkpoint holds its position
            return self.data.stream.steps(
                epoch,
                rank=self.env.rank,
                world_size=self.env.world_size,
                batch_size=self.cfg.batch_size,
                grad_accum=self.layout.grad_accum,
                all_reduce=lambda t: distributed.all_reduce_sum(t.to(self.device)),
            )
        workers = self.layout.workers
        pin = self.device.type == "cuda" and workers > 0
        plan = self.layout.plan(epoch, self.cfg, self.data, self.env)
        return batches(plan, self.data.collate, workers, start=self.state.step_in_epoch, pin_memory=pin)

    # ---- one optimizer step ----
    def train_step(self, step: StepBatch) -> dict:
        """One optimizer step over ``step``'s micro-batches (all ranks together).

        Returns:
            The step's stats: ``units`` (the loss denominator) and ``grad_norm`` (None unclipped).
        """
        s, env = self.state, self.env
        data = self.data
        if data.online is not None:  # the plan's prompts become the completions trained on
            step = data.online.step(self.model, step, s.global_step, self.autocast, stop=self.stop)
        # The loss denominator: loss units (examples, or target tokens) in the whole global step.
        if step.units is not None:
            step_units = step.units
        else:
            step_units = float(data.units[step.indices].sum()) if data.units is not None else float(step.global_count)
        step_ids = [m.inputs["input_ids"] for m in step.micro]
        for i, micro in enumerate(step.micro):
            # Counted on the CPU copy (no device sync).
            real, computed = micro.tokens
            s.tokens_real += micro.weight * real
            s.tokens_computed += micro.weight * computed
            if self.trace is not None:
                self.trace.add(s.epoch, s.global_step + 1, micro)
            micro = micro.to(self.device)
            # Gradients are reduced only on the last micro-batch of the step.
            with self.strategy.no_sync(last=i == len(step.micro) - 1):
                out = self.task.loss(self.wrapped, micro, self.autocast)
                loss_sum, units = out.loss_sum * micro.weight, out.units * micro.weight  # weight 0: an empty share
                # Times world size because DDP averages over ranks: the gradient is the exact
                # mean over the global step's units.
                self.scaler.scale(loss_sum * env.world_size / max(step_units, 1.0)).backward()
            s.loss_sum += loss_sum.detach().double()
            s.loss_units += units.double()
            if out.metrics is not None:  # the task's train_metrics sums
                s.metric_sums += out.metrics.detach().double() * micro.weight
        self.strategy.after_backward(step_ids)
        norm = None
        if self.cfg.max_grad_norm:
            self.scaler.unscale_(self.optimizer)
            norm = self.strategy.clip(self.cfg.max_grad_norm)
        self.guard.after_backward(norm, self.strategy.grad_norm, s.global_step + 1)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        s.global_step += 1
        s.step_in_epoch += 1
        s.samples_seen += step.global_count
        self.bar.update(1)
        return {"units": step_units, "grad_norm": norm}

    def _log_train(self) -> None:
        s = self.state
        sums = distributed.all_reduce_sum(s.accumulated())
        means = (sums / sums[1].clamp(min=1)).tolist()
        loss, extra = means[0], dict(zip(self.data.metric_names or self.task.train_metrics, means[2:]))
        s.reset_accumulators()
        self.guard.check(s.global_step, self.dest.checkpoints, loss)
        # every rank's real tokens so far, for the progress line's tokens/s (one small reduction per log
        # line), into a buffer that lives as long as the trainer: a temporary one could be freed last by
        # gloo's thread, which needs the GIL for that (see worker._exit_now)
        self._tokens_seen.fill_(s.tokens_real)
        tokens = distributed.all_reduce_sum(self._tokens_seen)
        s.logged_losses.append(loss)
        lr = self.scheduler.get_last_lr()[0]
        self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
        self.loggers.log(
            "train",
            s.global_step,
            {"loss": loss, "lr": lr, **extra},
            {"epoch": s.epoch + 1, "samples": s.samples_seen, "tokens": int(tokens.item())},
        )

    # ---- evaluation and checkpoints ----
    def evaluate(self, train_s: float) -> dict:
        """All ranks: evaluate, then back to training mode; rank 0 logs and records it with the training
        time and samples so far, and its own duration. Its time is not training time (``epoch_started`` moves
        past it)."""
        s, cfg = self.state, self.cfg
        t_eval = time.perf_counter()
        metrics = base.evaluate(
            self.task,
            self.model,
            self.data,
            self.env,
            self.device,
            self.autocast,
            cfg.eval_batch_size or 2 * cfg.batch_size,
            lockstep=self.strategy.sharded,
        )
        log.info(
            "epoch %d, step %d: %s",
            s.epoch + 1,
            s.global_step,
            " ".join(f"{k} {metrics[k]:.4f}" for k in ("eval_loss", *self.task.headline) if k in metrics),
        )
        # Scalars only: a per-class matrix at every evaluation would grow the file with the classes squared.
        scalars = {k: v for k, v in metrics.items() if not isinstance(v, (list, dict))}
        self.loggers.log("eval", s.global_step, scalars, self.eval_context(train_s, t_eval))
        self.wrapped.train()
        s.epoch_started += time.perf_counter() - t_eval
        return metrics

    def eval_context(self, train_s: float, t_eval: float) -> dict:
        """An evaluation record's bookkeeping (the run's own, the harness's): where training stands, and the
        evaluation's duration since ``t_eval``."""
        s = self.state
        return {
            "epoch": s.epoch + 1,
            "samples": s.samples_seen,
            "train_s": round(train_s, 3),
            "eval_s": round(time.perf_counter() - t_eval, 3),
        }

    def save_checkpoint(self) -> None:
        """All ranks: the checkpoint's contents (``Contents``: every rank's RNG state and accumulators
        gathered), then the strategy saves the model and optimizer (a sharded one: every rank its shard,
        into the directory the writer stages); the writer rank completes the checkpoint."""
        s, writer = self.state, self.strategy.is_writer
        parts = self.contents.state_dict()
        staged, entries, uploaded = self._save_model_state()
        if writer:
            path = self.dest.checkpoints.save(
                {**entries, **parts}, self.spec, s.global_step, self.cfg.keep_checkpoints, staged, uploaded
            )
            log.info("checkpoint at step %d: %s", s.global_step, path)
        distributed.barrier()
        self._saved_step = s.global_step

    def _save_model_state(self) -> tuple[Path | None, dict, dict | None]:
        """All ranks: the strategy saves the model and optimizer. A sharded strategy writes every
        rank's shard into a directory the writer stages, each rank uploads its own shards to an
        s3:// output (the nodes need not share a disk), and the writer checks that every rank's
        shard is in the checkpoint, here or uploaded.

        Returns:
            The staged directory (None unless sharded), the entries for ``state.pt``, and the
            manifest entries of the shards the ranks uploaded.
        """
        s, writer = self.state, self.strategy.is_writer
        if not self.strategy.sharded:
            return None, self.strategy.save(None, self.optimizer), None
        made = str(self.dest.checkpoints.staging(s.global_step)) if writer else None
        staged = Path(distributed.broadcast_object(made))
        staged.mkdir(parents=True, exist_ok=True)  # a node without the writer's filesystem
        entries = self.strategy.save(staged, self.optimizer)
        own = self.strategy.shard_files(staged)
        parts = distributed.all_gather_object(
            (
                [p.relative_to(staged).as_posix() for p in own],
                self.dest.checkpoints.upload_shards(staged, s.global_step, own),
            )
        )
        uploaded = {k: v for _, part in parts for k, v in part.items()}
        lost = sorted(
            {r for r, (names, _) in enumerate(parts) for n in names if n not in uploaded and not (staged / n).exists()}
        )
        lost = distributed.broadcast_object(lost if writer else None)  # the writer's view
        if lost:  # every rank stops
            raise AgreedError(
                f"the checkpoint shards of ranks {lost} are not in {staged}: those ranks write to another node's disk",
                field="output.uri",
                fix="on several nodes, put the output on storage every node shares (a ReadWriteMany PVC) or s3://",
            )
        return staged, entries, uploaded

    def _stop_inside_step(self) -> None:
        """Every rank gave the running step up on a stop signal (``StepAbandoned``: a slow reward call would
        outlast the pod's grace period) before it changed anything: the last completed step's checkpoint is
        exact, written unless this run holds it already (none at step 0: nothing was trained)."""
        s = self.state
        if s.global_step and self._saved_step != s.global_step:
            self.guard.check(s.global_step, self.dest.checkpoints)
            self.save_checkpoint()
        self._preempted()

    def _preempted(self) -> None:
        self.bar.close()
        if self.progress:
            self.progress.finish("stopped")
        if self.mlflow:
            self.mlflow.finish(self.out, status="KILLED")
        if self.env.is_main:
            s = self.state
            done = "checkpoint written — run the same job again to resume" if s.global_step else "nothing trained"
            log.warning("stopped on signal after step %d; %s", s.global_step, done)
        raise Preempted(self.state.global_step)

    # ---- the end: metrics and artifacts ----
    def _finish(self, eval_metrics: dict) -> dict:
        s, data, env = self.state, self.data, self.env
        tail = s.logged_losses[-max(1, len(s.logged_losses) // 10) :]
        real, padded = distributed.all_reduce_sum(
            torch.tensor([s.tokens_real, s.tokens_computed], device=self.device, dtype=torch.float64)
        ).tolist()
        t = s.train_time
        metrics = {
            "task": self.spec.task,
            **eval_metrics,
            "train_loss": float(np.mean(tail)) if tail else None,  # mean of the last 10% of logged losses
            "train_samples": s.samples_seen,
            "train_samples_per_second": s.samples_seen / t if t else 0.0,
            "train_runtime_s": t,
            "train_tokens": int(real),  # non-pad tokens of the trained examples (all epochs)
            "train_padded_tokens": int(padded),  # tokens computed on, padding included
            "padding_fraction": 1 - real / padded if padded else 0.0,
            "train_tokens_per_second": real / t if t else 0.0,
            "total_runtime_s": None,
            "world_size": env.world_size,
            "global_step": s.global_step,
            # an epoch cut short by training.max_steps is not a completed one
            "epochs_completed": s.epoch
            + int(self._epoch_ended if self.layout.streamed else s.step_in_epoch >= self.layout.epoch_steps[s.epoch]),
            "train_rows": data.train_rows if data.stream is None else None,  # a stream's: not known
            "eval_rows": data.eval_rows,
            "dropped_rows": self._dropped(),
            **data.info,
        }
        # every rank's peak resident host memory (ru_maxrss is in KiB on Linux)
        peaks = distributed.all_gather_object(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
        metrics["peak_host_memory_gib"] = [round(p, 3) for p in peaks]
        metrics["strategy"] = self.strategy.name
        if self.scaler.is_enabled():  # fp16: each skipped (overflowing) step halved it from 2**16
            metrics["fp16_grad_scale"] = self.scaler.get_scale()
        if self.device.type == "cuda":
            metrics["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30  # rank 0's device
        # Training is over: AdamW's moments (8 bytes per trainable parameter, on every rank) make room
        # for the export's full copy of the model; the checkpoints on disk still hold them.
        self.optimizer.state.clear()
        harness = self.spec.evaluation
        if harness and harness.after and not self.strategy.sharded:  # every rank its share, before the export
            scoring.final(self, metrics, None)
        model = self.strategy.export_model()  # collective where sharded
        if harness and harness.after and self.strategy.sharded and self.strategy.is_writer:
            scoring.final(self, metrics, model)  # the writer alone, on the gathered model
        if self.strategy.is_writer:
            self._export(model, metrics)
        distributed.barrier()
        return metrics

    def _dropped(self) -> dict[str, int]:
        """The rows left out: the data's, and a stream's rows with nothing to learn (every rank's,
        since this process started: a resumed run counts from its resume)."""
        feed = self.data.stream
        if feed is None:
            return self.data.dropped
        n = int(distributed.all_reduce_sum(torch.tensor([float(feed.dropped)], device=self.device)).item())
        return {**self.data.dropped, **({feed.drop: n} if n else {})}

    def _export(self, model: torch.nn.Module, metrics: dict) -> None:
        spec, out = self.spec, self.out
        _check_weights_finite(model, self.state.global_step, self.dest.checkpoints)
        self.loggers.close()
        # Everything final is built aside and swapped in at the end: a failure here (export, the
        # baseline, the report) leaves the previous state of the output, never half of this run's.
        staged = self.dest.staging()
        try:
            self.task.export(spec, model, self.tokenizer, self.data, staged, metrics)
            if self.harness_samples is not None:
                scoring.write_samples(staged / "lm_eval_samples", self.harness_samples)
            metrics["total_runtime_s"] = time.perf_counter() - self.t_start
            artifacts.finish(spec, metrics, staged, out / "history.jsonl", self.task.present)
            self.dest.commit(staged, self.task.artifact_files + tasks.artifact_files(self.dest.replaced_task()))
        except (OSError, SafetensorError) as e:  # a full disk, a quota: the output keeps its previous state
            reason = getattr(e, "strerror", None) or str(e).rsplit(": ", 1)[-1].split(" (os error")[0]
            raise KubetuneError(
                f"cannot write the artifacts to {out}: {reason}",
                field="output.uri",
                fix="free space or choose another output.uri; nothing there was changed, and the checkpoints are kept",
            ) from None
        finally:
            shutil.rmtree(staged, ignore_errors=True)
        self.dest.publish(spec, metrics, self.task.present)
        if self.progress:
            self.progress.finish(
                "succeeded", metrics={k: metrics[k] for k in self.task.headline}, output=spec.output.uri
            )
        if self.mlflow:
            self.mlflow.finish(out)
        # Only now that the artifact is safely in place: a failed upload can still resume. A rerun
        # then starts a new run, and predict/pull never fetch optimizer state.
        self.dest.checkpoints.clear()
        # the headline, and train_loss (a search's objective can be either: Katib reads them from this line)
        shown = [*self.task.headline, *(["train_loss"] if metrics.get("train_loss") is not None else [])]
        headline = ", ".join(f"{k} {metrics[k]:.4f}" for k in dict.fromkeys(shown))
        log.info(
            "done: %s, %.1f samples/s; artifacts in %s", headline, metrics["train_samples_per_second"], spec.output.uri
        )


class FiniteGuard:
    """Stops a diverged run: a non-finite gradient norm (or logged loss) ends training on every
    rank at the same step, with the checkpoints written before it kept and nothing exported.

    Without a host sync per step: a fused optimizer (adamw, sgd) takes a ``found_inf`` flag on the
    device (the mechanism GradScaler uses) and skips a non-finite update there, and the first such
    step is remembered on the device; the ranks compare it where they synchronize anyway (a log step,
    before a checkpoint, at the end of an epoch). Another optimizer (adamw_foreach, adamw_8bit) refuses
    or ignores the flag, so it is not handed one: its non-finite update is applied, and the run still
    stops at the next comparison, before any checkpoint or export holds that update.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, enabled: bool):
        self.optimizer, self.enabled = optimizer, enabled
        self.skips = bool(optimizer.defaults.get("fused"))  # torch's non-fused kernels assert found_inf is None
        self.first_bad = torch.full((), -1, dtype=torch.long, device=device)

    def after_backward(self, norm: torch.Tensor | None, grad_norm, step: int) -> None:
        """``norm``: the step's gradient norm if clipping computed it; ``grad_norm()`` computes it otherwise."""
        if not self.enabled:
            return
        if norm is None:
            norm = grad_norm()
        nonfinite = ~torch.isfinite(norm)
        if self.skips:
            self.optimizer.found_inf = nonfinite.float()
        self.first_bad = torch.where(nonfinite & (self.first_bad < 0), step, self.first_bad)

    def check(self, step: int, store: CheckpointStore, loss: float | None = None) -> None:
        """All ranks, at the same step."""
        if not self.enabled:
            return
        bad = int(distributed.all_reduce_max(self.first_bad.clone()).item())
        if bad >= 0 or (loss is not None and not math.isfinite(loss)):
            at = f"step {bad}" if bad >= 0 else f"the steps up to {step} (mean loss {loss})"
            raise Diverged(at, store)


class Diverged(KubetuneError):
    """The loss or gradients became non-finite; the run stops without exporting."""

    agreed = True  # every rank raises it at the same step

    def __init__(self, at: str, store: CheckpointStore):
        steps = store.local_steps()
        kept = f"the checkpoint of step {steps[-1]} is kept" if steps else "no checkpoint had been written"
        super().__init__(
            (
                f"the loss or the gradient norm became non-finite (nan/inf) at {at}; training stopped on every rank "
                f"and nothing was exported ({kept})"
            ),
            field="training",
            fix=(
                "lower training.learning_rate or training.weight_decay, keep training.max_grad_norm set, or try "
                "precision: fp32"
            ),
        )


def _check_weights_finite(model: torch.nn.Module, step: int, store: CheckpointStore) -> None:
    bad = next((n for n, p in model.named_parameters() if p.requires_grad and not torch.isfinite(p).all()), None)
    if bad is not None:
        raise Diverged(f"or before step {step} (weight {bad} is not finite)", store)


class Preempted(Exception):
    """Training stopped on SIGTERM/SIGINT after writing a checkpoint (exit code 143)."""

    def __init__(self, step: int):
        super().__init__(f"stopped after step {step}; checkpoint written")
        self.step = step
