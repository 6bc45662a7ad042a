"""The trainer every task shares: the outer loop, one optimizer step, evaluation, checkpoints and
the export. ``build.py`` makes a ``Trainer`` (set-up and resume); the worker sets up the process
group and claims the output before.

What differs per task (data preparation, the model, the loss of a micro-batch, evaluation,
export) comes in a ``Task``; how the model is spread over ranks comes in a ``Strategy``; the
periodic duties (evaluation, checkpoints, lm-eval scores) are ``hooks``; what happened is emitted
as ``events`` that every log, file and tracker renders; where the run is lives in one
``TrainState``. One loop for every task, because everything a checkpoint needs to continue exactly
and the ranks' agreement on stopping must stay identical across tasks.
"""

from __future__ import annotations

import resource
import shutil
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
from safetensors import SafetensorError

from kubetune import artifacts, distributed, tasks
from kubetune.artifacts.output import Output
from kubetune.config import JobSpec
from kubetune.config.schema import TrainSpec
from kubetune.data import StepBatch, batches
from kubetune.distributed import DistEnv
from kubetune.errors import AgreedError, KubetuneError
from kubetune.tasks import base
from kubetune.tasks.base import Prepared, Task
from kubetune.training.events import Event, EventBus, phases, process_started, run_started
from kubetune.training.guard import FiniteGuard, check_weights_finite
from kubetune.training.hooks import Hook, Metrics
from kubetune.training.layout import Layout
from kubetune.training.state import Contents, TrainState
from kubetune.training.strategy import Strategy
from kubetune.training.trace import Trace


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
    tokenizer: Any  # a transformers tokenizer (no types of its own)
    data: Prepared
    model: torch.nn.Module  # the model as built (what is exported)
    strategy: Strategy
    wrapped: torch.nn.Module  # the model as the strategy trains it
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    guard: FiniteGuard
    autocast: torch.autocast
    layout: Layout
    contents: Contents  # what a checkpoint holds beside the model and optimizer (its fingerprint among it)
    state: TrainState
    events: EventBus  # rank 0's renderings of what happens (empty elsewhere)
    hooks: list[Hook]  # the periodic duties, called in order at each point (``training.hooks``)
    bar: Any  # the tqdm progress bar
    control_group: Any = None  # the CPU group of the ranks' agreements (None: the default group)
    stop: threading.Event = field(default_factory=threading.Event)  # set by a stop signal
    trace: Trace | None = None
    t_start: float = field(default_factory=time.perf_counter)
    # wall-clock times of the run's milestones, for its phases (``events.phases``): the builder may mark
    # ``data_start``/``data_end``; the trainer marks the rest
    marks: dict[str, float] = field(default_factory=dict)
    _epoch_ended: bool = False  # the running epoch's data ran out (not cut short by the step limit)
    _saved_step: int | None = None  # the step of the checkpoint this run wrote or resumed from last
    _eval_metrics: Metrics = field(default_factory=dict)  # the last evaluation's (the final metrics hold them)

    def __post_init__(self) -> None:
        # every rank's real tokens so far, for the progress line's tokens/s, in a buffer that lives as
        # long as the trainer: a temporary one could be freed last by gloo's thread, which needs the
        # GIL for that (see worker._exit_now)
        self._tokens_seen = torch.zeros(1, dtype=torch.float64, device=self.device)
        self.marks.setdefault("built", time.time())
        self.marks.setdefault("worker", min(process_started(), self.marks["built"]))
        self.marks.setdefault("started", min(run_started(), self.marks["worker"]))

    @property
    def cfg(self) -> TrainSpec:
        cfg: TrainSpec = self.spec.training
        return cfg

    @property
    def out(self) -> Path:
        return self.dest.local

    # ---- the outer loop ----
    def train(self) -> Metrics:
        """Every rank: train from where the state stands to the end, then export (the writer); the final metrics."""
        s = self.state
        s.last_checkpoint_at = time.monotonic()
        self._saved_step = s.global_step or None  # a run past step 0 here resumed from that step's checkpoint
        start_epoch, start_step = s.epoch, s.step_in_epoch
        self.events.emit(Event("start", s.global_step, context={"epoch": s.epoch + 1, "resumed": bool(s.global_step)}))
        for hook in self.hooks:
            hook.on_train_start(self)
        for epoch in range(start_epoch, len(self.layout.epoch_steps)):
            s.epoch, s.step_in_epoch = epoch, start_step if epoch == start_epoch else 0
            self.wrapped.train()
            s.epoch_started = time.perf_counter()
            self._epoch_ended = False
            for step in self.epoch_batches(epoch):
                if s.global_step >= self.layout.total_steps:
                    break
                self.marks.setdefault("first_step", time.time())  # its batch is in hand
                try:
                    self.train_step(step)
                except distributed.StepAbandoned:
                    self._stop_inside_step()
                self.marks["last_step"] = time.time()
                if s.global_step % self.cfg.log_every == 0 or s.global_step == self.layout.total_steps:
                    self._log_train()
                for hook in self.hooks:  # evaluation, lm-eval scores, then the checkpoint and a stop
                    hook.on_step_end(self)
            else:
                self._epoch_ended = True
            s.train_time += time.perf_counter() - s.epoch_started
            self.guard.check(s.global_step, self.dest.checkpoints)
            for hook in self.hooks:
                hook.on_epoch_end(self)
            if s.global_step >= self.layout.total_steps:
                break
        self.bar.close()
        return self._finish()

    def epoch_batches(self, epoch: int) -> Iterable[StepBatch]:
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
        steps: Iterable[StepBatch] = batches(
            plan, self.data.collate, workers, start=self.state.step_in_epoch, pin_memory=pin
        )
        return steps

    # ---- one optimizer step ----
    def train_step(self, step: StepBatch) -> dict[str, Any]:
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
        context = {"epoch": s.epoch + 1, "samples": s.samples_seen, "tokens": int(tokens.item())}
        self.events.emit(Event("train", s.global_step, {"loss": loss, "lr": lr, **extra}, context))

    # ---- evaluation and checkpoints ----
    def evaluate(self, train_s: float) -> Metrics:
        """All ranks: evaluate, then back to training mode; rank 0 emits it (an ``eval`` event: the log line,
        the records) with the training time and samples so far, and its own duration; then every hook's
        ``on_evaluate``. Its time is not training time (``epoch_started`` moves past it)."""
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
        # Scalars only: a per-class matrix at every evaluation would grow the file with the classes squared.
        scalars = {k: v for k, v in metrics.items() if not isinstance(v, (list, dict))}
        self.events.emit(Event("eval", s.global_step, scalars, self.eval_context(train_s, t_eval)))
        self.wrapped.train()
        s.epoch_started += time.perf_counter() - t_eval
        self._eval_metrics = metrics
        for hook in self.hooks:
            hook.on_evaluate(self, metrics)
        return metrics

    def eval_context(self, train_s: float, t_eval: float) -> Metrics:
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
        into the directory the writer stages); the writer rank completes the checkpoint (a ``checkpoint``
        event); then every hook's ``on_save``."""
        s, writer = self.state, self.strategy.is_writer
        parts = self.contents.state_dict()
        staged, entries, uploaded = self._save_model_state()
        if writer:
            path = self.dest.checkpoints.save(
                {**entries, **parts}, self.spec, s.global_step, self.cfg.keep_checkpoints, staged, uploaded
            )
            self.events.emit(Event("checkpoint", s.global_step, context={"path": str(path)}))
        distributed.barrier()
        self._saved_step = s.global_step
        for hook in self.hooks:
            hook.on_save(self, s.global_step)

    def _save_model_state(self) -> tuple[Path | None, dict[str, Any], dict[str, Any] | None]:
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
        self.preempted()

    def preempted(self) -> NoReturn:
        """End the run on a stop signal, its checkpoint written: a ``stopped`` event, then ``Preempted``."""
        self.bar.close()
        self.events.emit(Event("stopped", self.state.global_step))
        raise Preempted(self.state.global_step)

    # ---- the end: metrics and artifacts ----
    def _finish(self) -> Metrics:
        s, data, env = self.state, self.data, self.env
        tail = s.logged_losses[-max(1, len(s.logged_losses) // 10) :]
        real, padded = distributed.all_reduce_sum(
            torch.tensor([s.tokens_real, s.tokens_computed], device=self.device, dtype=torch.float64)
        ).tolist()
        t = s.train_time
        metrics = {
            "task": self.spec.task,
            **self._eval_metrics,
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
        for hook in self.hooks:
            hook.on_train_end(self, metrics)
        model = self.strategy.export_model()  # collective where sharded
        for hook in self.hooks:
            hook.on_exported(self, metrics, model)
        if model is not None and self.strategy.is_writer:  # export_model gives the writer the whole model
            self._export(model, metrics)
        distributed.barrier()
        return metrics

    def phases(self) -> dict[str, float]:
        """This run's phases until now (``events.phases``; a run that trained no step: nothing in training)."""
        marks = {**self.marks, "end": time.time()}
        marks.setdefault("first_step", marks["built"])
        marks.setdefault("last_step", marks["first_step"])
        return phases(marks)

    def _dropped(self) -> dict[str, int]:
        """The rows left out: the data's, and a stream's rows with nothing to learn (every rank's,
        since this process started: a resumed run counts from its resume)."""
        feed = self.data.stream
        if feed is None:
            return self.data.dropped
        n = int(distributed.all_reduce_sum(torch.tensor([float(feed.dropped)], device=self.device)).item())
        return {**self.data.dropped, **({feed.drop: n} if n else {})}

    def _export(self, model: torch.nn.Module, metrics: Metrics) -> None:
        spec, out = self.spec, self.out
        check_weights_finite(model, self.state.global_step, self.dest.checkpoints)
        self.events.close()
        # Everything final is built aside and swapped in at the end: a failure here (export, the
        # baseline, the report) leaves the previous state of the output, never half of this run's.
        staged = self.dest.staging()
        try:
            self.task.export(spec, model, self.tokenizer, self.data, staged, metrics)
            for hook in self.hooks:
                hook.on_artifacts(self, staged)
            metrics["total_runtime_s"] = time.perf_counter() - self.t_start
            metrics["phases"] = self.phases()
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
        # Only now that the artifact is safely in place: a failed upload can still resume. A rerun
        # then starts a new run, and predict/pull never fetch optimizer state.
        self.dest.checkpoints.clear()
        # the headline, and train_loss (a search's objective can be either: Katib reads them from the done line)
        shown = [*self.task.headline, *(["train_loss"] if metrics.get("train_loss") is not None else [])]
        context = {
            "headline": list(self.task.headline),
            "samples_per_s": metrics["train_samples_per_second"],
            "output": spec.output.uri,
        }
        self.events.emit(Event("done", self.state.global_step, {k: metrics[k] for k in dict.fromkeys(shown)}, context))


class Preempted(Exception):
    """Training stopped on SIGTERM/SIGINT after writing a checkpoint (exit code 143)."""

    def __init__(self, step: int) -> None:
        super().__init__(f"stopped after step {step}; checkpoint written")
        self.step = step
