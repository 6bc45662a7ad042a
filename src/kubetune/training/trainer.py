"""The trainer every task shares: set-up, resume, the outer loop, one optimizer step, evaluation,
checkpoints and the export.

What differs per task (data preparation, the model, the loss of a micro-batch, evaluation,
export) comes in a ``Task``; how the model is spread over ranks comes in a ``Strategy``; where
metrics go comes in ``Loggers``; where the run is lives in one ``TrainState``. One loop for every
task, because everything a checkpoint needs to continue exactly and the ranks' agreement on
stopping must stay identical across tasks.
"""

from __future__ import annotations

import contextlib
import logging
import math
import resource
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from kubetune import artifacts, checkpoint, distributed
from kubetune.artifacts.output import Output
from kubetune.checkpoint.store import CheckpointStore
from kubetune.config import JobSpec
from kubetune.data import Batch, StepBatch, batches
from kubetune.data.sharding import (
    epoch_order,
    plan_epochs,
    rank_plan,
    steps_per_epoch,
    token_micro_batches,
    token_plan,
)
from kubetune.distributed import DistEnv
from kubetune.errors import AgreedError, KubetuneError
from kubetune.tasks import base
from kubetune.tasks.base import Task
from kubetune.tasks.common import build_optimizer, load_tokenizer, resolve_precision, seed_everything
from kubetune.training import strategy as strategies
from kubetune.training.loggers import JSONLLogger, Loggers, ProgressLogger, TensorBoardLogger
from kubetune.training.state import TrainState
from kubetune.training.strategy import Strategy

log = logging.getLogger(__name__)


def train(spec: JobSpec, env: DistEnv, task: Task, stop: threading.Event | None = None) -> dict:
    """Fine-tune as described by ``spec``; rank 0 exports the artifacts. ``stop``, once set (by
    the signal handlers ``distributed.install_signal_handlers`` installed), ends the run after a
    checkpoint at the next step boundary.

    Returns:
        The final metrics (identical on every rank).
    """
    # Log lines go through tqdm.write so they never land in the middle of the progress bar.
    with logging_redirect_tqdm(), contextlib.ExitStack() as cleanup:
        trainer = Trainer(spec, env, task, cleanup, stop=stop)
        return trainer.finished if trainer.finished is not None else trainer.train()


class Trainer:
    """One rank's training run. ``__init__`` sets everything up (resuming from the newest
    checkpoint); ``train()`` is the outer loop over ``train_step()``."""

    def __init__(
        self,
        spec: JobSpec,
        env: DistEnv,
        task: Task,
        cleanup: contextlib.ExitStack | None = None,
        strategy: Strategy | None = None,
        stop: threading.Event | None = None,
    ):
        self.t_start = time.perf_counter()
        self.spec, self.env, self.task, self.cfg = spec, env, task, spec.training
        self.device = device = distributed.pick_device(env)
        self.control_group = distributed.setup(env, device, spec.distributed.backend, spec.distributed.timeout_minutes)
        self.stop = stop if stop is not None else threading.Event()  # once set: a checkpoint, then stop
        self.dtype = resolve_precision(self.cfg.precision, device)
        # Rank 0 checks the destination (refusing someone else's directory or a finished run), marks
        # it as kubetune's, and logs whether this run resumes or starts over; every rank then reads
        # checkpoints from the same place.
        # The output location, resolved once: the staging directory, the checkpoint store, the publisher.
        self.dest = Output.for_spec(spec)
        self.out = self.dest.local
        plan = self.dest.claim(spec) if env.is_main else None
        # this job already finished into this output: nothing to train
        self.finished = distributed.broadcast_object(
            self.dest.finished_metrics() if plan and plan.action == "done" else None
        )
        if self.finished is not None:
            return
        precision = self.cfg.precision if self.cfg.precision != "auto" else str(self.dtype).removeprefix("torch.")
        log.info(
            "job %s (%s): world size %d, device %s, precision %s",
            spec.name,
            spec.task,
            env.world_size,
            device,
            precision,
        )
        # Found before the set-up: a checkpoint of another number of processes changes the layout.
        found = _find_checkpoint(self.dest, env) if self.cfg.resume == "auto" else None
        # The data layout: the spec's, or a resumed run's on another number of processes (same global batch).
        self.grad_accum, self.group_unit = checkpoint.layout(
            checkpoint.saved_fingerprint(found) if found else None,
            env.world_size,
            self.cfg.batch_size,
            self.cfg.grad_accum,
            str(found.path) if found else "",
        )
        self._build(strategy, found)
        if task.setup is not None:  # before the checkpoint's weights replace the base's
            task.setup(spec, self.model, self.data, env, device, self.autocast, self.strategy.sharded)
        self._resume(found)
        self._start_logging(found, cleanup)

    # ---- set-up ----
    def _build(self, strategy: Strategy | None, found: checkpoint.Found | None) -> None:
        spec, env, cfg, device = self.spec, self.env, self.cfg, self.device
        # data: read and split on every rank (cheap, deterministic); tokenize once per node
        self.model_dir = artifacts.resolve_model(spec)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.data = self.task.prepare(spec, env, self.model_dir, self.tokenizer)
        self.train_lengths = np.asarray(self.data.train_ds["length"])
        # model: identical initialization on every rank (same seed), built and wrapped by the strategy

        def make(where: torch.device) -> torch.nn.Module:
            return self.task.build_model(spec, self.model_dir, self.data, device, self.dtype, where)

        seed_everything(cfg.seed)
        resumed = checkpoint.saved_fingerprint(found).get("strategy", "ddp") if found else None
        strategy = strategy or strategies.for_job(spec, env, device, self.dtype, make, resumed)
        strategies.allocator_policy(strategy.name, device)  # before the model's first allocation
        self.model = strategy.build(make)
        if cfg.compile:
            log.info("training.compile: compiled %d transformer blocks", strategies.compile_blocks(self.model))
        self.strategy = strategy
        self.wrapped = strategy.wrap(self.model)
        # Dropout differs per rank; the stream is still a pure function of (seed, rank).
        seed_everything(cfg.seed + 1000 * (env.rank + 1))
        self.token_budget = getattr(spec.data, "max_tokens_per_batch", None)
        if self.token_budget:  # micro-batches by tokens: each epoch's order cuts into its own number of steps
            self.epoch_steps, self.total_steps = plan_epochs(
                cfg.epochs, cfg.max_steps, steps_of=lambda e: len(self._plan(e))
            )
        else:
            n_steps = steps_per_epoch(self.data.train_rows, env.world_size, cfg.batch_size, self.grad_accum)
            self.epoch_steps, self.total_steps = plan_epochs(cfg.epochs, cfg.max_steps, n_steps=n_steps)
        self.per_epoch = self.epoch_steps[0]  # training.epochs >= 1
        self.optimizer, self.scheduler = build_optimizer(self.model, cfg, self.total_steps, device)
        self.scaler = torch.amp.GradScaler(device.type, enabled=(self.dtype == torch.float16))
        # fp16: the grad scaler skips overflowing steps itself
        self.guard = _FiniteGuard(self.optimizer, device, enabled=not self.scaler.is_enabled())
        self.autocast = torch.autocast(device.type, dtype=self.dtype, enabled=self.dtype != torch.float32)
        self.fingerprint = checkpoint.fingerprint(
            spec,
            self.data.labels,
            env.world_size,
            self.data.train_rows,
            self.grad_accum,
            self.group_unit,
            strategy.name,
        )
        # On a GPU, building batches in the training process leaves the GPU idle meanwhile (+20% samples/s
        # with 2 workers, BERT-base); on a CPU the workers would take cores from the compute.
        self.workers = (
            cfg.dataloader_workers if cfg.dataloader_workers is not None else (2 if device.type == "cuda" else 0)
        )
        self.trace = _Trace(env.rank)  # records trained row ids when KUBETUNE_TRACE_DIR is set (tests)

    def _resume(self, found: checkpoint.Found | None) -> None:
        """The newest complete checkpoint restores weights, optimizer, schedule, position and RNG."""
        self.state = TrainState.fresh(self.device, len(self.task.train_metrics))
        if not found:
            return
        saved = checkpoint.load(found)
        checkpoint.check_compatible(saved["fingerprint"], self.fingerprint, str(found.path))
        self.strategy.load(found.path, saved, self.optimizer)
        self.scheduler.load_state_dict(saved["scheduler"])
        self.scaler.load_state_dict(saved["scaler"])
        self.state = TrainState.from_state_dict(saved, self.env.rank, self.env.world_size, self.device)
        if self.env.rank < len(saved["rng"]):
            checkpoint.set_rng_state(saved["rng"][self.env.rank])
        elif self.env.rank == len(saved["rng"]):
            log.info(
                "ranks from %d on had no RNG state in the checkpoint; they keep their seeded streams (dropout only)",
                len(saved["rng"]),
            )
        s = self.state
        log.info(
            "resumed from checkpoint step %d (epoch %d, step %d of %d in the epoch): %s",
            s.global_step,
            s.epoch + 1,
            s.step_in_epoch,
            self.per_epoch,
            found.path,
        )

    def _start_logging(self, found: checkpoint.Found | None, cleanup: contextlib.ExitStack | None) -> None:
        resume_step = self.state.global_step if found else None
        writers: list = []
        self.progress = self.mlflow = None
        self._tokens_seen = torch.zeros(1, dtype=torch.float64, device=self.device)
        if self.env.is_main:
            self.progress = ProgressLogger(self.out, self.total_steps, self.cfg.epochs, self.state.global_step)
            writers = [
                JSONLLogger(self.out, resume_step, found.path / "history.jsonl" if found else None),
                TensorBoardLogger(self.out, resume_step),
                self.progress,
            ]
            if self.spec.tracking.mlflow:
                from kubetune.training.tracking import MLflowLogger
                from kubetune.version import __version__

                facts = {
                    "world_size": self.env.world_size,
                    "device": self.device.type,
                    "precision": str(self.dtype).removeprefix("torch."),
                    "strategy": self.strategy.name,
                    "version": __version__,
                }
                # its run id goes into the trainer state, so the next checkpoint carries it to a resumed run
                self.mlflow = MLflowLogger(self.spec, self.state.logger_runs, facts)
                writers.append(self.mlflow)
        self.loggers = Loggers(writers)
        # The bar on a terminal only: elsewhere (a pod's log, a file) it would redraw with \r into the
        # log lines; the progress lines say the same there.
        self.bar = tqdm(
            total=self.total_steps,
            initial=self.state.global_step,
            desc="train",
            unit="step",
            disable=not (self.env.is_main and _tty()),
            dynamic_ncols=True,
            mininterval=1.0,
        )
        if cleanup is not None:
            cleanup.callback(self.bar.close)  # however training ends, the bar's line ends before an error is printed
            # However training ends: TensorBoard's writer thread is not a daemon, and left open after
            # an error it kept rank 0's process from exiting until the launcher's teardown SIGKILLed
            # it 30 s later (the diverged-run test then saw a killed rank, exit 1, not the user error).
            cleanup.callback(self.loggers.close)
        cfg = self.cfg
        n_micro = self.grad_accum * self.env.world_size
        if self.token_budget:
            epoch, batch = "in the first epoch", f"{n_micro} micro-batches of up to {self.token_budget} tokens"
        else:
            epoch, batch = "per epoch", str(cfg.batch_size * n_micro)
        log.info(
            "training: %d steps (%d %s), global batch %s, %d trainable / %d parameters",
            self.total_steps,
            self.per_epoch,
            epoch,
            batch,
            *_param_counts(self.model),
        )

    # ---- the outer loop ----
    def train(self) -> dict:
        s, cfg, env = self.state, self.cfg, self.env
        eval_metrics: dict = {}
        last_checkpoint = time.monotonic()
        start_epoch, start_step = s.epoch, s.step_in_epoch
        for epoch in range(start_epoch, len(self.epoch_steps)):
            s.epoch, s.step_in_epoch = epoch, start_step if epoch == start_epoch else 0
            self.wrapped.train()
            self.t_epoch = time.perf_counter()
            for step in self._batches(epoch):
                if s.global_step >= self.total_steps:
                    break
                self.train_step(step)
                if s.global_step % cfg.log_every == 0 or s.global_step == self.total_steps:
                    self._log_train()
                # Before the checkpoint, so that a resumed run's history holds this evaluation too.
                if (
                    cfg.eval_every
                    and s.global_step % cfg.eval_every == 0
                    and s.step_in_epoch < self.epoch_steps[epoch]
                    and s.global_step < self.total_steps
                ):
                    eval_metrics = self.evaluate(s.train_time + time.perf_counter() - self.t_epoch)
                # Every rank must agree, at the same step, on stopping and on checkpointing.
                timed = (
                    bool(cfg.checkpoint_minutes)
                    and env.is_main
                    and time.monotonic() - last_checkpoint >= 60 * cfg.checkpoint_minutes
                )
                stop, timed = distributed.any_rank(
                    self.stop.is_set(), timed, device=self.device, group=self.control_group
                )
                if stop or timed or (cfg.checkpoint_every and s.global_step % cfg.checkpoint_every == 0):
                    # a checkpoint holds only weights trained on finite gradients
                    self.guard.check(s.global_step, self.dest.checkpoints)
                    self.save_checkpoint()
                    last_checkpoint = time.monotonic()
                if stop:
                    self._preempted()
            s.train_time += time.perf_counter() - self.t_epoch
            self.guard.check(s.global_step, self.dest.checkpoints)
            eval_metrics = self.evaluate(s.train_time)
            if s.global_step >= self.total_steps:
                break
        self.bar.close()
        return self._finish(eval_metrics)

    def _plan(self, epoch: int):
        """This rank's steps of ``epoch``: a pure function of the seed, the epoch and the layout."""
        cfg, env = self.cfg, self.env
        if self.token_budget:  # packed: lengths cost no padding, so the order is not grouped by length
            order = epoch_order(self.data.train_rows, epoch, cfg.seed)
            micros = token_micro_batches(order, self.train_lengths, self.token_budget)
            return token_plan(micros, rank=env.rank, world_size=env.world_size, grad_accum=self.grad_accum)
        lengths = self.train_lengths if cfg.group_by_length else None
        order = epoch_order(self.data.train_rows, epoch, cfg.seed, lengths, self.group_unit)
        return rank_plan(
            order, rank=env.rank, world_size=env.world_size, batch_size=cfg.batch_size, grad_accum=self.grad_accum
        )

    def _batches(self, epoch: int):
        pin = self.device.type == "cuda" and self.workers > 0
        plan = self._plan(epoch)
        return batches(plan, self.data.collate, self.workers, start=self.state.step_in_epoch, pin_memory=pin)

    # ---- one optimizer step ----
    def train_step(self, step: StepBatch) -> dict:
        """One optimizer step over ``step``'s micro-batches (all ranks together).

        Returns:
            The step's stats: ``units`` (the loss denominator) and ``grad_norm`` (None unclipped).
        """
        s, env = self.state, self.env
        # The loss denominator: loss units (examples, or target tokens) in the whole global step.
        data = self.data
        step_units = float(data.units[step.indices].sum()) if data.units is not None else float(step.global_count)
        step_ids = [m.inputs["input_ids"] for m in step.micro]
        for i, micro in enumerate(step.micro):
            # Counted on the CPU copy (no device sync).
            real, computed = micro.tokens
            s.tokens[0] += micro.weight * real
            s.tokens[1] += micro.weight * computed
            self.trace.add(s.epoch, s.global_step + 1, micro)
            micro = micro.to(self.device)
            # Gradients are reduced only on the last micro-batch of the step.
            with self.strategy.no_sync(last=i == len(step.micro) - 1):
                out = self.task.loss(self.wrapped, micro, self.autocast)
                loss_sum, units = out.loss_sum * micro.weight, out.units * micro.weight  # weight 0: an empty share
                # Times world size because DDP averages over ranks: the gradient is the exact
                # mean over the global step's units.
                self.scaler.scale(loss_sum * env.world_size / max(step_units, 1.0)).backward()
            s.log_loss[0] += loss_sum.detach().double()
            s.log_loss[1] += units.double()
            if out.metrics is not None:  # the task's train_metrics sums
                s.log_loss[2:] += out.metrics.detach().double() * micro.weight
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
        distributed.all_reduce_sum(s.log_loss)
        means = (s.log_loss / s.log_loss[1].clamp(min=1)).tolist()
        loss, extra = means[0], dict(zip(self.task.train_metrics, means[2:]))
        s.log_loss.zero_()
        self.guard.check(s.global_step, self.dest.checkpoints, loss)
        # every rank's real tokens so far, for the progress line's tokens/s (one small reduction per log
        # line), into a buffer that lives as long as the trainer: a temporary one could be freed last by
        # gloo's thread, which needs the GIL for that (see worker._exit_now)
        self._tokens_seen.fill_(s.tokens[0])
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
        time and samples so far, and its own duration. Its time is not training time (``t_epoch`` moves
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
            " ".join(f"{k} {metrics[k]:.4f}" for k in ("eval_loss", *self.task.headline)),
        )
        # Scalars only: a per-class matrix at every evaluation would grow the file with the classes squared.
        scalars = {k: v for k, v in metrics.items() if not isinstance(v, (list, dict))}
        self.loggers.log(
            "eval",
            s.global_step,
            scalars,
            {
                "epoch": s.epoch + 1,
                "samples": s.samples_seen,
                "train_s": round(train_s, 3),
                "eval_s": round(time.perf_counter() - t_eval, 3),
            },
        )
        self.wrapped.train()
        self.t_epoch += time.perf_counter() - t_eval
        return metrics

    def save_checkpoint(self) -> None:
        """All ranks: gather every rank's RNG state and accumulators; the strategy saves the model and
        optimizer (a sharded one: every rank its shard, into the directory the writer stages); the
        writer rank completes the checkpoint."""
        s, writer = self.state, self.strategy.is_writer
        per_rank = distributed.all_gather_object((checkpoint.rng_state(), s.log_loss.tolist(), list(s.tokens)))
        staged, entries, uploaded = self._save_model_state()
        if writer:
            state = {
                **entries,
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(),
                **s.state_dict(s.train_time + (time.perf_counter() - self.t_epoch), per_rank),
                "fingerprint": self.fingerprint,
            }
            path = self.dest.checkpoints.save(
                state, self.spec, s.global_step, self.cfg.keep_checkpoints, staged, uploaded
            )
            log.info("checkpoint at step %d: %s", s.global_step, path)
        distributed.barrier()

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

    def _preempted(self) -> None:
        self.bar.close()
        if self.progress:
            self.progress.finish("stopped")
        if self.mlflow:
            self.mlflow.finish(self.out, status="KILLED")
        if self.env.is_main:
            log.warning(
                "stopped on signal after step %d; checkpoint written — run the same job again to resume",
                self.state.global_step,
            )
        raise Preempted(self.state.global_step)

    # ---- the end: metrics and artifacts ----
    def _finish(self, eval_metrics: dict) -> dict:
        s, data, env = self.state, self.data, self.env
        tail = s.logged_losses[-max(1, len(s.logged_losses) // 10) :]
        real, padded = distributed.all_reduce_sum(
            torch.tensor(s.tokens, device=self.device, dtype=torch.float64)
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
            "epochs_completed": s.epoch + int(s.step_in_epoch >= self.epoch_steps[s.epoch]),
            "train_rows": data.train_rows,
            "eval_rows": data.eval_rows,
            "dropped_rows": data.dropped,
            **data.info,
        }
        # every rank's peak resident host memory (ru_maxrss is in KiB on Linux)
        peaks = distributed.all_gather_object(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
        metrics["peak_host_memory_gib"] = [round(p, 3) for p in peaks]
        metrics["strategy"] = self.strategy.name
        if self.device.type == "cuda":
            metrics["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30  # rank 0's device
        # Training is over: AdamW's moments (8 bytes per trainable parameter, on every rank) make room
        # for the export's full copy of the model; the checkpoints on disk still hold them.
        self.optimizer.state.clear()
        model = self.strategy.export_model()  # collective where sharded
        if self.strategy.is_writer:
            self._export(model, metrics)
        distributed.barrier()
        return metrics

    def _export(self, model: torch.nn.Module, metrics: dict) -> None:
        spec, out = self.spec, self.out
        _check_weights_finite(model, self.state.global_step, self.dest.checkpoints)
        self.loggers.close()
        # Everything final is built aside and swapped in at the end: a failure here (export, the
        # baseline, the report) leaves the previous state of the output, never half of this run's.
        staged = self.dest.staging()
        try:
            self.task.export(spec, model, self.tokenizer, self.data, staged, metrics)
            metrics["total_runtime_s"] = time.perf_counter() - self.t_start
            artifacts.finish(spec, metrics, staged, out / "history.jsonl", self.task.present)
            self.dest.commit(staged)
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
        headline = ", ".join(f"{k} {metrics[k]:.4f}" for k in self.task.headline)
        log.info(
            "done: %s, %.1f samples/s; artifacts in %s", headline, metrics["train_samples_per_second"], spec.output.uri
        )


class _FiniteGuard:
    """Stops a diverged run: a non-finite gradient norm (or logged loss) ends training on every
    rank at the same step, with the checkpoints written before it kept and nothing exported.

    Without a host sync per step: the fused AdamW takes a ``found_inf`` flag on the device (the
    mechanism GradScaler uses) and skips a non-finite update there, and the first such step is
    remembered on the device; the ranks compare it where they synchronize anyway (a log step,
    before a checkpoint, at the end of an epoch).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, enabled: bool):
        self.optimizer, self.enabled = optimizer, enabled
        self.first_bad = torch.full((), -1, dtype=torch.long, device=device)

    def after_backward(self, norm: torch.Tensor | None, grad_norm, step: int) -> None:
        """``norm``: the step's gradient norm if clipping computed it; ``grad_norm()`` computes it otherwise."""
        if not self.enabled:
            return
        if norm is None:
            norm = grad_norm()
        nonfinite = ~torch.isfinite(norm)
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


def _find_checkpoint(dest: Output, env: DistEnv) -> checkpoint.Found | None:
    """Rank 0 picks the newest complete checkpoint; every rank then reads that same step."""
    found = dest.checkpoints.latest() if env.is_main else None
    step = distributed.broadcast_object(found.step if found else None)
    if step is None:
        return None
    if found is None or found.step != step:
        found = dest.checkpoints.latest()
        if found is None or found.step != step:
            raise KubetuneError(
                f"rank {env.rank} cannot see checkpoint step {step} under {dest.uri}",
                field="output.uri",
                fix="put the output on storage every node can read (a shared PVC or s3://)",
            )
    return found


class _Trace:
    """Appends ``{"epoch", "step", "rows", "tokens"}`` lines (one per micro-batch) to
    ``$KUBETUNE_TRACE_DIR/rank<R>.jsonl``: the proof that every example is trained on exactly once
    per epoch across ranks, and at which global step."""

    def __init__(self, rank: int):
        import os

        root = os.environ.get("KUBETUNE_TRACE_DIR")
        self.path = None
        if root:
            Path(root).mkdir(parents=True, exist_ok=True)
            self.path = Path(root) / f"rank{rank}.jsonl"

    def add(self, epoch: int, step: int, batch: Batch) -> None:
        if self.path is None:
            return
        import json

        rows = batch.index.tolist() if batch.weight > 0 else []
        tokens = int(batch.tokens[0]) if batch.weight > 0 else 0
        with self.path.open("a") as f:
            f.write(json.dumps({"epoch": epoch, "step": step, "rows": rows, "tokens": tokens}) + "\n")


def _param_counts(model) -> tuple[int, int]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def _tty() -> bool:
    import sys

    return sys.stderr.isatty()
