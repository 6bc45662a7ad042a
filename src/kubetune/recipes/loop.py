"""The training loop both recipes share: DDP, AdamW, warmup, accumulation, checkpoint/resume.

Read top to bottom: set-up, data, model, optimizer, resume, the loop, evaluation, export. What
differs per task (data preparation, the model, the loss of a micro-batch, evaluation, export)
comes in a ``Task``: a record of plain functions, defined in ``classify.py`` and ``causal_lm.py``.
One loop instead of one per task, because everything a checkpoint needs to continue exactly
(epoch, step in epoch, global step, model/optimizer/scheduler state, every rank's RNG) and the
agreement between ranks on stopping must stay identical across tasks.
"""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from safetensors import SafetensorError
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from kubetune import artifacts, checkpoint, distributed, providers
from kubetune.artifacts import output
from kubetune.config import JobSpec
from kubetune.data import batches
from kubetune.data.sharding import epoch_order, rank_plan, steps_per_epoch
from kubetune.distributed import DistEnv
from kubetune.errors import KubetuneError
from kubetune.recipes.common import build_optimizer, load_tokenizer, resolve_precision, seed_everything, to_device

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """A task's tokenized data, as the loop needs it."""

    train_ds: Any
    eval_ds: Any
    collate: Callable  # indices -> micro-batch dict (with "weight" and "index")
    train_rows: int
    eval_rows: int
    units: np.ndarray | None = None  # loss units per train example (tokens for causal-LM); None = 1 each
    labels: list[str] = field(default_factory=list)  # class names (classification); part of the fingerprint
    dropped: dict[str, int] = field(default_factory=dict)
    info: dict = field(default_factory=dict)  # task facts for metrics.json (e.g. the data format)
    raw: Any = None  # the task's own frames (for the baseline, the export)


@dataclass
class Task:
    """What one task plugs into the loop; every field is a plain function."""

    name: str
    prepare: Callable[[JobSpec, DistEnv, Path, Any], Prepared]  # (spec, env, model_dir, tokenizer)
    build_model: Callable[[JobSpec, Path, Prepared, torch.device, torch.dtype], torch.nn.Module]
    loss: Callable[[torch.nn.Module, dict, Any], tuple[torch.Tensor, torch.Tensor]]  # -> (loss sum, units) of a micro-batch
    evaluate: Callable[..., dict]  # (model, prepared, env, device, autocast, batch_size) -> metrics
    export: Callable[[JobSpec, torch.nn.Module, Any, Prepared, Path, dict], None]  # rank 0, adds to metrics
    headline: tuple[str, ...]  # metrics for the per-epoch and final log lines


def train(spec: JobSpec, env: DistEnv, task: Task) -> dict:
    """Fine-tune as described by ``spec``; rank 0 exports the artifacts.

    Returns:
        The final metrics (identical on every rank).
    """
    # Log lines go through tqdm.write so they never land in the middle of the progress bar.
    with logging_redirect_tqdm(), contextlib.ExitStack() as cleanup:
        return _train(spec, env, task, cleanup)


def _train(spec: JobSpec, env: DistEnv, task: Task, cleanup: contextlib.ExitStack) -> dict:
    t_start = time.perf_counter()
    cfg = spec.training
    device = distributed.pick_device(env)
    distributed.setup(env, device, spec.distributed.backend, spec.distributed.timeout_minutes)
    dtype = resolve_precision(cfg.precision, device)
    providers.configure(spec)
    # Rank 0 checks the destination (refusing someone else's directory or a finished run), marks
    # it as kubetune's, and logs whether this run resumes or starts over; every rank then reads
    # checkpoints from the same place.
    out, plan = output.claim(spec) if env.is_main else (output.local_dir(spec.output.uri), None)
    done = distributed.broadcast_object(output.finished_metrics(spec, out) if plan and plan.action == "done" else None)
    if done is not None:  # this job already finished into this output: nothing to train
        return done
    log.info("job %s (%s): world size %d, device %s, precision %s", spec.name, spec.task, env.world_size, device, cfg.precision if cfg.precision != "auto" else str(dtype).removeprefix("torch."))

    # ---- data: read and split on every rank (cheap, deterministic); tokenize once per node ----
    model_dir = artifacts.resolve_model(spec)
    tokenizer = load_tokenizer(model_dir)
    data = task.prepare(spec, env, model_dir, tokenizer)
    train_lengths = np.asarray(data.train_ds["length"])

    # ---- model: identical initialization on every rank (same seed), then DDP ----
    seed_everything(cfg.seed)
    model = task.build_model(spec, model_dir, data, device, dtype)
    if cfg.compile:
        # In place (nn.Module.compile): parameter names and the exported state dict stay unchanged.
        # dynamic=True: length-grouped batches change the sequence length every step.
        model.compile(dynamic=True)
    embedding_sync = distributed.row_sparse_embedding_sync(model, env)  # before DDP: it takes the embedding out of DDP's buckets
    # gradient_as_bucket_view: gradients live in DDP's all-reduce buckets, saving a copy of every gradient each step.
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True) if env.distributed else model
    # Dropout differs per rank; the stream is still a pure function of (seed, rank).
    seed_everything(cfg.seed + 1000 * (env.rank + 1))

    per_epoch = steps_per_epoch(data.train_rows, env.world_size, cfg.batch_size, cfg.grad_accum)
    total_steps = min(per_epoch * cfg.epochs, cfg.max_steps or 10**12)
    optimizer, scheduler = build_optimizer(model, cfg, total_steps, device)
    scaler = torch.amp.GradScaler(device.type, enabled=(dtype == torch.float16))
    guard = _FiniteGuard(optimizer, device, enabled=not scaler.is_enabled())  # fp16: the grad scaler skips overflowing steps itself
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    # ---- resume: the newest complete checkpoint restores weights, optimizer, schedule, position and RNG ----
    fingerprint = checkpoint.fingerprint(spec, data.labels, env.world_size, data.train_rows)
    progress = {"epoch": 0, "step_in_epoch": 0, "global_step": 0, "samples_seen": 0, "train_time": 0.0, "logged_losses": [],
                "log_loss": [[0.0, 0.0]] * env.world_size, "tokens": [[0.0, 0.0]] * env.world_size}
    found = _find_checkpoint(spec, out, env) if cfg.resume == "auto" else None
    if found:
        state = checkpoint.load(found)
        checkpoint.check_compatible(state["fingerprint"], fingerprint, str(found.path))
        missing = set(checkpoint.trainable_state(model)) - set(state["model"])
        if missing:
            raise KubetuneError(f"checkpoint {found.path} lacks {len(missing)} trainable tensors, e.g. {sorted(missing)[0]}", field="output.uri", fix="pass --no-resume")
        model.load_state_dict(state["model"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        progress = state["progress"]
        checkpoint.set_rng_state(state["rng"][env.rank])
        log.info("resumed from checkpoint step %d (epoch %d, step %d of %d in the epoch): %s", progress["global_step"], progress["epoch"] + 1, progress["step_in_epoch"], per_epoch, found.path)

    global_step, samples_seen, train_time = progress["global_step"], progress["samples_seen"], progress["train_time"]
    logged_losses: list[float] = list(progress["logged_losses"])
    log_loss = torch.tensor(progress["log_loss"][env.rank], device=device, dtype=torch.float64)  # this rank's [loss sum, units] since last log
    tokens = list(progress.get("tokens", [[0.0, 0.0]] * env.world_size)[env.rank])  # this rank's [real, padded] tokens trained on
    history = artifacts.History(out, resume_step=global_step if found else None, saved=found.path / "history.jsonl" if found else None) if env.is_main else None
    tb = artifacts.tensorboard_writer(out, purge_step=global_step if found else None) if env.is_main else None
    bar = tqdm(total=total_steps, initial=global_step, desc="train", unit="step", disable=not env.is_main, dynamic_ncols=True, mininterval=1.0 if _tty() else 30.0)
    cleanup.callback(bar.close)  # however training ends, the bar's line ends before an error is printed
    log.info("training: %d steps (%d per epoch), global batch %d, %d trainable / %d parameters", total_steps, per_epoch, cfg.batch_size * cfg.grad_accum * env.world_size, *_param_counts(model))

    def save_checkpoint(epoch: int, step_in_epoch: int) -> None:
        """All ranks: gather every rank's RNG state; rank 0 writes the checkpoint."""
        per_rank = distributed.all_gather_object((checkpoint.rng_state(), log_loss.tolist(), list(tokens)))
        if env.is_main:
            state = {
                "model": checkpoint.trainable_state(model),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(),
                "progress": {"epoch": epoch, "step_in_epoch": step_in_epoch, "global_step": global_step, "samples_seen": samples_seen,
                             "train_time": train_time + (time.perf_counter() - t_epoch), "logged_losses": logged_losses,
                             "log_loss": [loss for _, loss, _ in per_rank], "tokens": [t for _, _, t in per_rank]},
                "rng": [rng for rng, _, _ in per_rank],
                "fingerprint": fingerprint,
            }
            path = checkpoint.save(state, spec, spec.output.uri, out, global_step, cfg.keep_checkpoints)
            log.info("checkpoint at step %d: %s", global_step, path)
        distributed.barrier()

    def evaluate(epoch: int, train_s: float) -> dict:
        """All ranks: evaluate; rank 0 logs and records it with the training time and samples so far."""
        metrics = task.evaluate(model, data, env, device, autocast, cfg.eval_batch_size or 2 * cfg.batch_size)
        log.info("epoch %d, step %d: %s", epoch + 1, global_step, " ".join(f"{k} {metrics[k]:.4f}" for k in ("eval_loss", *task.headline)))
        if history:
            # Scalars only: a per-class matrix at every evaluation would grow the file with the classes squared.
            scalars = {k: v for k, v in metrics.items() if not isinstance(v, (list, dict))}
            history.write({"type": "eval", "step": global_step, "epoch": epoch + 1, "samples": samples_seen, "train_s": round(train_s, 3), **scalars})
            for k, v in metrics.items():
                if isinstance(v, float):
                    tb.add_scalar(f"eval/{k.removeprefix('eval_')}", v, global_step)
        return metrics

    # On a GPU, building batches in the training process leaves the GPU idle meanwhile (+20% samples/s with 2 workers, BERT-base);
    # on a CPU the workers would take cores from the compute.
    workers = cfg.dataloader_workers if cfg.dataloader_workers is not None else (2 if device.type == "cuda" else 0)
    trace = _Trace(env.rank)  # records trained row ids when KUBETUNE_TRACE_DIR is set (tests)
    eval_metrics: dict = {}
    last_checkpoint = time.monotonic()
    epoch = progress["epoch"]
    for epoch in range(progress["epoch"], cfg.epochs):
        order = epoch_order(data.train_rows, epoch, cfg.seed, train_lengths if cfg.group_by_length else None, cfg.batch_size * env.world_size)
        plan = rank_plan(order, rank=env.rank, world_size=env.world_size, batch_size=cfg.batch_size, grad_accum=cfg.grad_accum)
        step_in_epoch = progress["step_in_epoch"] if epoch == progress["epoch"] else 0
        ddp.train()
        t_epoch = time.perf_counter()
        for step in batches(plan, data.collate, workers, start=step_in_epoch, pin_memory=device.type == "cuda" and workers > 0):
            if global_step >= total_steps:
                break
            # The loss denominator: loss units (examples, or target tokens) in the whole global step.
            step_units = float(data.units[step.indices].sum()) if data.units is not None else float(step.global_count)
            step_ids = [m["input_ids"] for m in step.micro]
            for i, micro in enumerate(step.micro):
                # Gradients are all-reduced only on the last micro-batch of the step.
                sync = contextlib.nullcontext() if (i == len(step.micro) - 1 or not env.distributed) else ddp.no_sync()
                # Counted on the CPU copy (no device sync): padding is what a micro-batch computes on beyond its real tokens.
                w = float(micro["weight"][0])
                tokens[0] += w * float(micro["attention_mask"].sum() if "attention_mask" in micro else micro["input_ids"].numel())
                tokens[1] += w * micro["input_ids"].numel()
                micro = to_device(micro, device)
                weight = micro.pop("weight")
                trace.add(epoch, micro.pop("index"), weight)
                with sync:
                    loss_sum, units = task.loss(ddp, micro, autocast)
                    loss_sum, units = loss_sum * weight[0], units * weight[0]  # weight 0: a rank's empty share
                    # Times world size because DDP averages over ranks: the gradient is the exact
                    # mean over the global step's units.
                    scaler.scale(loss_sum * env.world_size / max(step_units, 1.0)).backward()
                log_loss[0] += loss_sum.detach().double()
                log_loss[1] += units.double()
            if embedding_sync:
                embedding_sync(step_ids)
            if cfg.max_grad_norm:
                scaler.unscale_(optimizer)
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            else:
                norm = None
            guard.after_backward(model, norm, global_step + 1)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            global_step += 1
            step_in_epoch += 1
            samples_seen += step.global_count
            bar.update(1)

            if global_step % cfg.log_every == 0 or global_step == total_steps:
                distributed.all_reduce_sum(log_loss)
                loss = (log_loss[0] / log_loss[1].clamp(min=1)).item()
                log_loss.zero_()
                guard.check(global_step, out, spec, loss)
                logged_losses.append(loss)
                lr = scheduler.get_last_lr()[0]
                bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
                if history:
                    history.write({"type": "train", "step": global_step, "epoch": epoch + 1, "loss": loss, "lr": lr, "samples": samples_seen})
                    tb.add_scalar("train/loss", loss, global_step)
                    tb.add_scalar("train/lr", lr, global_step)

            # Before the checkpoint, so that a resumed run's history holds this evaluation too.
            if cfg.eval_every and global_step % cfg.eval_every == 0 and step_in_epoch < per_epoch and global_step < total_steps:
                t_eval = time.perf_counter()
                eval_metrics = evaluate(epoch, train_time + t_eval - t_epoch)
                ddp.train()
                t_epoch += time.perf_counter() - t_eval  # evaluation time is not training time

            # Every rank must agree, at the same step, on stopping and on checkpointing.
            timed = bool(cfg.checkpoint_minutes) and env.is_main and time.monotonic() - last_checkpoint >= 60 * cfg.checkpoint_minutes
            stop, timed = distributed.any_rank(distributed.STOP.is_set(), timed, device=device)
            if stop or timed or (cfg.checkpoint_every and global_step % cfg.checkpoint_every == 0):
                guard.check(global_step, out, spec)  # a checkpoint holds only weights trained on finite gradients
                save_checkpoint(epoch, step_in_epoch)
                last_checkpoint = time.monotonic()
            if stop:
                bar.close()
                if env.is_main:
                    log.warning("stopped on signal after step %d; checkpoint written — run the same job again to resume", global_step)
                raise Preempted(global_step)
        train_time += time.perf_counter() - t_epoch

        guard.check(global_step, out, spec)
        eval_metrics = evaluate(epoch, train_time)
        if global_step >= total_steps:
            break
    bar.close()

    tail = logged_losses[-max(1, len(logged_losses) // 10):]
    real, padded = distributed.all_reduce_sum(torch.tensor(tokens, device=device, dtype=torch.float64)).tolist()
    metrics = {
        "task": spec.task,
        **eval_metrics,
        "train_loss": float(np.mean(tail)) if tail else None,  # mean of the last 10% of logged losses
        "train_samples": samples_seen,
        "train_samples_per_second": samples_seen / train_time if train_time else 0.0,
        "train_runtime_s": train_time,
        "train_tokens": int(real),  # non-pad tokens of the trained examples (all epochs)
        "train_padded_tokens": int(padded),  # tokens computed on, padding included
        "padding_fraction": 1 - real / padded if padded else 0.0,
        "train_tokens_per_second": real / train_time if train_time else 0.0,
        "total_runtime_s": None,
        "world_size": env.world_size,
        "global_step": global_step,
        "epochs_completed": epoch + 1,
        "train_rows": data.train_rows,
        "eval_rows": data.eval_rows,
        "dropped_rows": data.dropped,
        **data.info,
    }
    if device.type == "cuda":
        metrics["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30  # rank 0's device
    if env.is_main:
        _check_weights_finite(model, global_step, out, spec)
        history.close()
        tb.close()
        # Everything final is built aside and swapped in at the end: a failure here (export, the
        # baseline, the report) leaves the previous state of the output, never half of this run's.
        staged = output.staging(out)
        try:
            task.export(spec, model, tokenizer, data, staged, metrics)
            metrics["total_runtime_s"] = time.perf_counter() - t_start
            artifacts.finish(spec, metrics, staged, out / "history.jsonl")
            output.commit(out, staged)
        except (OSError, SafetensorError) as e:  # a full disk, a quota: the output keeps its previous state
            reason = getattr(e, "strerror", None) or str(e).rsplit(": ", 1)[-1].split(" (os error")[0]
            raise KubetuneError(f"cannot write the artifacts to {out}: {reason}", field="output.uri",
                                fix="free space or choose another output.uri; nothing there was changed, and the checkpoints are kept") from None
        finally:
            shutil.rmtree(staged, ignore_errors=True)
        artifacts.publish(spec, out, metrics)
        # Only now that the artifact is safely in place: a failed upload can still resume. A rerun
        # then starts a new run, and predict/pull never fetch optimizer state.
        checkpoint.clear(spec.output.uri, out)
        log.info("done: %s, %.1f samples/s; artifacts in %s", ", ".join(f"{k} {metrics[k]:.4f}" for k in task.headline), metrics["train_samples_per_second"], spec.output.uri)
    distributed.barrier()
    return metrics


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

    def after_backward(self, model: torch.nn.Module, norm: torch.Tensor | None, step: int) -> None:
        if not self.enabled:
            return
        if norm is None:
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        nonfinite = ~torch.isfinite(norm)
        self.optimizer.found_inf = nonfinite.float()
        self.first_bad = torch.where(nonfinite & (self.first_bad < 0), step, self.first_bad)

    def check(self, step: int, out: Path, spec: JobSpec, loss: float | None = None) -> None:
        """All ranks, at the same step."""
        if not self.enabled:
            return
        bad = int(distributed.all_reduce_max(self.first_bad.clone()).item())
        if bad >= 0 or (loss is not None and not math.isfinite(loss)):
            at = f"step {bad}" if bad >= 0 else f"the steps up to {step} (mean loss {loss})"
            raise Diverged(at, out, spec)


class Diverged(KubetuneError):
    """The loss or gradients became non-finite; the run stops without exporting."""

    agreed = True  # every rank raises it at the same step

    def __init__(self, at: str, out: Path, spec: JobSpec):
        steps = checkpoint.complete_steps(out / "checkpoints")
        kept = f"the checkpoint of step {steps[-1]} is kept" if steps else "no checkpoint had been written"
        super().__init__(f"the loss or the gradient norm became non-finite (nan/inf) at {at}; training stopped on every rank and nothing was exported ({kept})",
                         field="training", fix="lower training.learning_rate or training.weight_decay, keep training.max_grad_norm set, or try precision: fp32")


def _check_weights_finite(model: torch.nn.Module, step: int, out: Path, spec: JobSpec) -> None:
    bad = next((n for n, p in model.named_parameters() if p.requires_grad and not torch.isfinite(p).all()), None)
    if bad is not None:
        raise Diverged(f"or before step {step} (weight {bad} is not finite)", out, spec)


class Preempted(Exception):
    """Training stopped on SIGTERM/SIGINT after writing a checkpoint (exit code 143)."""

    def __init__(self, step: int):
        super().__init__(f"stopped after step {step}; checkpoint written")
        self.step = step


def tokenize_on_node(env: DistEnv, build) -> Any:
    """Run ``build(create)`` on local rank 0 first (create=True: tokenize on a cache miss), then
    on the node's other ranks (create=False: load the cache rank 0 wrote)."""
    result = build(True) if env.is_local_main else None
    distributed.barrier()
    if not env.is_local_main:
        result = build(False)
    return result


def _find_checkpoint(spec: JobSpec, out, env: DistEnv) -> checkpoint.Found | None:
    """Rank 0 picks the newest complete checkpoint; every rank then reads that same step."""
    found = checkpoint.latest(spec.output.uri, out) if env.is_main else None
    step = distributed.broadcast_object(found.step if found else None)
    if step is None:
        return None
    if found is None or found.step != step:
        found = checkpoint.latest(spec.output.uri, out)
        if found is None or found.step != step:
            raise KubetuneError(f"rank {env.rank} cannot see checkpoint step {step} under {spec.output.uri}", field="output.uri",
                                fix="put the output on storage every node can read (a shared PVC or s3://)")
    return found


class _Trace:
    """Appends ``{"epoch", "rows"}`` lines to ``$KUBETUNE_TRACE_DIR/rank<R>.jsonl``: the proof
    that every example is trained on exactly once per epoch across ranks."""

    def __init__(self, rank: int):
        import os

        root = os.environ.get("KUBETUNE_TRACE_DIR")
        self.path = None
        if root:
            Path(root).mkdir(parents=True, exist_ok=True)
            self.path = Path(root) / f"rank{rank}.jsonl"

    def add(self, epoch: int, index: torch.Tensor, weight: torch.Tensor) -> None:
        if self.path is None:
            return
        import json

        rows = index[weight.cpu() > 0].tolist()
        with self.path.open("a") as f:
            f.write(json.dumps({"epoch": epoch, "rows": rows}) + "\n")


def _param_counts(model) -> tuple[int, int]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def _tty() -> bool:
    import sys

    return sys.stderr.isatty()
