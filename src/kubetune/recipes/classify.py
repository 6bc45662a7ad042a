"""Sequence classification: one readable training loop (DDP, AdamW, warmup, accumulation, LoRA).

Read top to bottom: set-up, data, model, optimizer, the loop, evaluation, export.
Everything a checkpoint needs to continue exactly is kept in plain variables
(epoch, step in epoch, global step, model/optimizer/scheduler state, RNG states).
"""

from __future__ import annotations

import contextlib
import logging
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from kubetune import artifacts, checkpoint, distributed, providers
from kubetune.config import JobSpec
from kubetune.errors import KubetuneError
from kubetune.data import Frames, batches, load_frames, tokenized
from kubetune.data.sharding import epoch_order, rank_plan, steps_per_epoch
from kubetune.distributed import DistEnv
from kubetune.recipes.common import (
    build_optimizer,
    load_tokenizer,
    resolve_precision,
    seed_everything,
    to_device,
)

log = logging.getLogger(__name__)


def train(spec: JobSpec, env: DistEnv) -> dict:
    """Fine-tune a sequence classifier as described by ``spec``; rank 0 exports the artifacts.

    Returns:
        The final metrics (identical on every rank).
    """
    # Log lines go through tqdm.write so they never land in the middle of the progress bar.
    with logging_redirect_tqdm():
        return _train(spec, env)


def _train(spec: JobSpec, env: DistEnv) -> dict:
    t_start = time.perf_counter()
    cfg = spec.training
    device = distributed.pick_device(env)
    distributed.setup(env, device, spec.distributed.backend, spec.distributed.timeout_minutes)
    dtype = resolve_precision(cfg.precision, device)
    providers.configure(spec)
    out = artifacts.local_output_dir(spec.output.uri)  # every rank: checkpoints are read from here
    log.info("job %s: world size %d, device %s, precision %s", spec.name, env.world_size, device, cfg.precision if cfg.precision != "auto" else str(dtype).removeprefix("torch."))

    # ---- data: read and split on every rank (cheap, deterministic); tokenize once per node ----
    model_dir = artifacts.resolve_model(spec)
    frames: Frames = load_frames(spec.data, cfg.seed)
    tokenizer = load_tokenizer(model_dir)
    if env.is_local_main:
        train_ds, hit = tokenized(frames.train, tokenizer, spec.data.max_length, build=True)
        eval_ds, _ = tokenized(frames.eval, tokenizer, spec.data.max_length, build=True)
        log.info("data: %d train / %d eval rows, %d classes %s; tokenization cache %s", len(frames.train), len(frames.eval), len(frames.labels), frames.labels, "hit" if hit else "miss (tokenized and cached)")
    distributed.barrier()
    if not env.is_local_main:
        train_ds, _ = tokenized(frames.train, tokenizer, spec.data.max_length, build=False)
        eval_ds, _ = tokenized(frames.eval, tokenizer, spec.data.max_length, build=False)
    train_lengths = np.asarray(train_ds["length"])

    # ---- model: identical initialization on every rank (same seed), then DDP ----
    seed_everything(cfg.seed)
    model = build_model(spec, model_dir, frames.labels).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None) if env.distributed else model
    # Dropout differs per rank; the stream is still a pure function of (seed, rank).
    seed_everything(cfg.seed + 1000 * (env.rank + 1))

    per_epoch = steps_per_epoch(len(train_ds), env.world_size, cfg.batch_size, cfg.grad_accum)
    total_steps = min(per_epoch * cfg.epochs, cfg.max_steps or 10**12)
    optimizer, scheduler = build_optimizer(model, cfg, total_steps, device)
    scaler = torch.amp.GradScaler(device.type, enabled=(dtype == torch.float16))
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    # ---- resume: the newest complete checkpoint restores weights, optimizer, schedule, position and RNG ----
    fingerprint = checkpoint.fingerprint(spec, frames.labels, env.world_size, len(frames.train))
    if cfg.resume == "never" and env.is_main:
        checkpoint.clear(spec.output.uri, out)  # an old run's checkpoints must not be resumed later
    distributed.barrier()
    progress = {"epoch": 0, "step_in_epoch": 0, "global_step": 0, "samples_seen": 0, "train_time": 0.0, "logged_losses": [],
                "log_loss": [[0.0, 0.0]] * env.world_size}
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
    log_loss = torch.tensor(progress["log_loss"][env.rank], device=device)  # this rank's [loss sum, example count] since last log
    history = artifacts.History(out, resume_step=global_step if found else None, saved=found.path / "history.jsonl" if found else None) if env.is_main else None
    tb = artifacts.tensorboard_writer(out, purge_step=global_step if found else None) if env.is_main else None
    bar = tqdm(total=total_steps, initial=global_step, desc="train", unit="step", disable=not env.is_main, dynamic_ncols=True, mininterval=1.0 if _tty() else 30.0)
    log.info("training: %d steps (%d per epoch), global batch %d, %d trainable / %d parameters", total_steps, per_epoch, cfg.batch_size * cfg.grad_accum * env.world_size, *_param_counts(model))

    def save_checkpoint(epoch: int, step_in_epoch: int) -> None:
        """All ranks: gather every rank's RNG state; rank 0 writes the checkpoint."""
        per_rank = distributed.all_gather_object((checkpoint.rng_state(), log_loss.tolist()))
        if env.is_main:
            state = {
                "model": checkpoint.trainable_state(model),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(),
                "progress": {"epoch": epoch, "step_in_epoch": step_in_epoch, "global_step": global_step, "samples_seen": samples_seen,
                             "train_time": train_time + (time.perf_counter() - t_epoch), "logged_losses": logged_losses,
                             "log_loss": [loss for _, loss in per_rank]},
                "rng": [rng for rng, _ in per_rank],
                "fingerprint": fingerprint,
            }
            path = checkpoint.save(state, spec, spec.output.uri, out, global_step, cfg.keep_checkpoints)
            log.info("checkpoint at step %d: %s", global_step, path)
        distributed.barrier()

    trace = _Trace(env.rank)  # records trained row ids when KUBETUNE_TRACE_DIR is set (tests)
    eval_metrics: dict = {}
    last_checkpoint = time.monotonic()
    epoch = progress["epoch"]
    for epoch in range(progress["epoch"], cfg.epochs):
        order = epoch_order(len(train_ds), epoch, cfg.seed, train_lengths if cfg.group_by_length else None, cfg.batch_size * env.world_size)
        plan = rank_plan(order, rank=env.rank, world_size=env.world_size, batch_size=cfg.batch_size, grad_accum=cfg.grad_accum)
        step_in_epoch = progress["step_in_epoch"] if epoch == progress["epoch"] else 0
        ddp.train()
        t_epoch = time.perf_counter()
        for step in batches(plan, train_ds, tokenizer, cfg.dataloader_workers, start=step_in_epoch):
            if global_step >= total_steps:
                break
            for i, micro in enumerate(step.micro):
                # Gradients are all-reduced only on the last micro-batch of the step.
                sync = contextlib.nullcontext() if (i == len(step.micro) - 1 or not env.distributed) else ddp.no_sync()
                micro = to_device(micro, device)
                weight = micro.pop("weight")
                labels = micro.pop("labels")
                trace.add(epoch, micro.pop("index"), weight)
                with sync:
                    with autocast:
                        logits = ddp(**micro).logits
                    losses = F.cross_entropy(logits.float(), labels, reduction="none") * weight
                    # Sum over this rank / examples in the whole global step, times world size
                    # because DDP averages over ranks: the gradient is the exact global-batch mean.
                    scaler.scale(losses.sum() * env.world_size / step.global_count).backward()
                log_loss[0] += losses.detach().sum()
                log_loss[1] += weight.sum()
            if cfg.max_grad_norm:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
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
                logged_losses.append(loss)
                lr = scheduler.get_last_lr()[0]
                bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
                if history:
                    history.write({"type": "train", "step": global_step, "epoch": epoch + 1, "loss": loss, "lr": lr, "samples": samples_seen})
                    tb.add_scalar("train/loss", loss, global_step)
                    tb.add_scalar("train/lr", lr, global_step)

            # Every rank must agree, at the same step, on stopping and on checkpointing.
            timed = bool(cfg.checkpoint_minutes) and env.is_main and time.monotonic() - last_checkpoint >= 60 * cfg.checkpoint_minutes
            stop, timed = distributed.any_rank(distributed.STOP.is_set(), timed, device=device)
            if stop or timed or (cfg.checkpoint_every and global_step % cfg.checkpoint_every == 0):
                save_checkpoint(epoch, step_in_epoch)
                last_checkpoint = time.monotonic()
            if stop:
                bar.close()
                log.warning("stopped on signal after step %d; checkpoint written — run the same job again to resume", global_step)
                raise Preempted(global_step)
        train_time += time.perf_counter() - t_epoch

        eval_metrics = evaluate(model, eval_ds, tokenizer, env, device, autocast, cfg.eval_batch_size or 2 * cfg.batch_size, len(frames.labels))
        log.info("epoch %d: eval_loss %.4f eval_accuracy %.4f eval_f1_macro %.4f", epoch + 1, eval_metrics["eval_loss"], eval_metrics["eval_accuracy"], eval_metrics["eval_f1_macro"])
        if history:
            history.write({"type": "eval", "step": global_step, "epoch": epoch + 1, **eval_metrics})
            for k, v in eval_metrics.items():
                if isinstance(v, float):
                    tb.add_scalar(f"eval/{k.removeprefix('eval_')}", v, global_step)
        if global_step >= total_steps:
            break
    bar.close()

    tail = logged_losses[-max(1, len(logged_losses) // 10):]
    metrics = {
        **eval_metrics,
        "train_loss": float(np.mean(tail)) if tail else None,  # mean of the last 10% of logged losses
        "train_samples": samples_seen,
        "train_samples_per_second": samples_seen / train_time if train_time else 0.0,
        "train_runtime_s": train_time,
        "total_runtime_s": None,
        "world_size": env.world_size,
        "global_step": global_step,
        "epochs_completed": epoch + 1,
        "train_rows": len(frames.train),
        "eval_rows": len(frames.eval),
        "dropped_rows": frames.dropped,
        "labels": frames.labels,
    }
    if env.is_main:
        artifacts.export_classifier(spec, model, tokenizer, frames, out)
        if spec.output.report_baseline:
            metrics["baseline"] = artifacts.tfidf_baseline(frames)
            log.info("baseline (TF-IDF + logistic regression, same split): accuracy %.4f f1_macro %.4f", metrics["baseline"]["accuracy"], metrics["baseline"]["f1_macro"])
        metrics["total_runtime_s"] = time.perf_counter() - t_start
        artifacts.finish(spec, metrics, out)
        checkpoint.clear(spec.output.uri, out)  # finished: a rerun starts a new run, and predict/pull never fetch optimizer state
        artifacts.publish(spec, out, metrics)
        tb.close()
        history.close()
        log.info("done: eval_accuracy %.4f, %.1f samples/s; artifacts in %s", metrics["eval_accuracy"], metrics["train_samples_per_second"], spec.output.uri)
    distributed.barrier()
    return metrics


class Preempted(Exception):
    """Training stopped on SIGTERM/SIGINT after writing a checkpoint (exit code 143)."""

    def __init__(self, step: int):
        super().__init__(f"stopped after step {step}; checkpoint written")
        self.step = step


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


def build_model(spec: JobSpec, model_dir, labels: list[str]):
    """The pretrained encoder with a fresh classification head, wrapped with LoRA when asked."""
    from transformers import AutoModelForSequenceClassification

    from kubetune.recipes.common import load_pretrained

    model = load_pretrained(
        AutoModelForSequenceClassification,
        model_dir,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={name: i for i, name in enumerate(labels)},
    )
    if spec.lora is None:
        return model
    from peft import LoraConfig, TaskType, get_peft_model

    config = LoraConfig(
        task_type=TaskType.SEQ_CLS,  # also makes the classifier head fully trainable (modules_to_save)
        r=spec.lora.r,
        lora_alpha=spec.lora.alpha,
        lora_dropout=spec.lora.dropout,
        target_modules=spec.lora.target_modules,
    )
    return get_peft_model(model, config)


@torch.no_grad()
def evaluate(model, eval_ds, tokenizer, env: DistEnv, device, autocast, batch_size: int, num_labels: int) -> dict:
    """Loss, accuracy and macro-F1 over the whole eval set, each example counted once across ranks."""
    from kubetune.data import collate

    model.eval()
    lengths = np.asarray(eval_ds["length"])
    order = np.argsort(lengths, kind="stable")[env.rank :: env.world_size]  # length-sorted: little padding
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    confusion = torch.zeros(num_labels * num_labels, device=device, dtype=torch.float64)
    for start in range(0, len(order), batch_size):
        batch = to_device(collate(eval_ds, order[start : start + batch_size], tokenizer), device)
        batch.pop("weight")
        batch.pop("index")
        labels = batch.pop("labels")
        with autocast:
            logits = model(**batch).logits
        loss_sum += F.cross_entropy(logits.float(), labels, reduction="sum").double()
        confusion += torch.bincount(labels * num_labels + logits.argmax(-1), minlength=num_labels**2).double()
    totals = distributed.all_reduce_sum(torch.cat([loss_sum.view(1), confusion]))
    model.train()
    cm = totals[1:].view(num_labels, num_labels).cpu().numpy()  # rows: true, cols: predicted
    n = cm.sum()
    tp = np.diag(cm)
    precision = np.divide(tp, cm.sum(0), out=np.zeros_like(tp), where=cm.sum(0) > 0)
    recall = np.divide(tp, cm.sum(1), out=np.zeros_like(tp), where=cm.sum(1) > 0)
    f1 = np.divide(2 * precision * recall, precision + recall, out=np.zeros_like(tp), where=(precision + recall) > 0)
    present = (cm.sum(0) + cm.sum(1)) > 0  # sklearn's macro average: classes that are true or predicted
    return {
        "eval_loss": float(totals[0].item() / max(n, 1)),
        "eval_accuracy": float(tp.sum() / max(n, 1)),
        "eval_f1_macro": float(f1[present].mean()) if present.any() else 0.0,
        "eval_samples": int(n),
        "eval_confusion": cm.astype(int).tolist(),
    }


class _Trace:
    """Appends ``{"epoch", "rows"}`` lines to ``$KUBETUNE_TRACE_DIR/rank<R>.jsonl``: the proof
    that every example is trained on exactly once per epoch across ranks."""

    def __init__(self, rank: int):
        import os

        root = os.environ.get("KUBETUNE_TRACE_DIR")
        self.path = None
        if root:
            from pathlib import Path

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
