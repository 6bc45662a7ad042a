"""Building a ``Trainer`` from its parts: the checkpoint to resume from and the data layout it
implies, the tokenized data, the model wrapped by its strategy, the optimizer and schedule (picked
by the spec, ``recipe``), the run's state and checkpoint contents (fresh or resumed, ``state``) and
its loggers. The worker has set up the process group and claimed the output before
(``pod.worker.run_worker``); the ``Trainer`` itself only holds what it is given (torchtune's
``setup(cfg)``, torchtitan's TrainSpec: built, not self-assembling)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from kubetune import artifacts, checkpoint, distributed
from kubetune.artifacts.output import Output
from kubetune.config import JobSpec
from kubetune.config.schema import TrainSpec
from kubetune.data.rows import column
from kubetune.data.sharding import plan_epochs, steps_per_epoch, stream_epochs
from kubetune.distributed import DistEnv
from kubetune.errors import KubetuneError
from kubetune.tasks.base import Prepared, Task
from kubetune.tasks.common import load_tokenizer
from kubetune.training import runtime, trainer_status
from kubetune.training import strategy as strategies
from kubetune.training.events import LOG_EVENTS_ENV, EventBus, EventFile, HumanLog, Subscriber
from kubetune.training.guard import FiniteGuard
from kubetune.training.hooks import Checkpointing, Evaluation, Hook
from kubetune.training.layout import Layout
from kubetune.training.loggers import JSONLLogger, ProgressLogger, TensorBoardLogger
from kubetune.training.recipe import build_optimizer, check_available, resolve_precision, seed_everything
from kubetune.training.scoring import Harness
from kubetune.training.state import Contents, TrainState
from kubetune.training.state import contents as checkpointed
from kubetune.training.strategy import Strategy
from kubetune.training.trace import Trace
from kubetune.training.trainer import Trainer

log = logging.getLogger(__name__)


def build_trainer(
    spec: JobSpec,
    env: DistEnv,
    task: Task,
    dest: Output,
    device: torch.device,
    *,
    control_group: Any = None,
    stop: threading.Event | None = None,
    cleanup: contextlib.ExitStack | None = None,
    strategy: Strategy | None = None,
    trace_dir: Path | None = None,
    status_endpoint: trainer_status.Endpoint | None = None,
    extra_hooks: list[Hook] | None = None,
) -> Trainer:
    """Every rank: build this rank's trainer for ``spec``, resumed from the newest complete checkpoint
    in ``dest`` when ``training.resume`` is auto.

    Args:
        dest: the run's output, already claimed by rank 0.
        device: this rank's device; the process group is set up on it.
        control_group: the CPU group for the ranks' small agreements (``distributed.setup``).
        stop: once set (a stop signal), the run checkpoints and stops at the next step boundary.
        cleanup: closes the progress bar and the loggers however training ends.
        strategy: how the model is spread over ranks (default: ``strategy.for_job``).
        trace_dir: where to record the rows each micro-batch trained on (tests; None: nowhere).
        status_endpoint: where rank 0 sends its progress for the TrainJob's ``status.trainerStatus``
            (the Trainer controller's variables, ``trainer_status.Endpoint.from_env``; None: nowhere).
        extra_hooks: duties beyond the run's own (``hooks``), called after them at each point.
    """
    cfg = spec.training
    dtype = resolve_precision(cfg.precision, device)
    check_available(cfg, device)  # before the data and the model are set up
    _log_job(spec, env, device, dtype)
    # Found before the set-up: a checkpoint of another number of processes changes the layout.
    found, saved, grad_accum, group_unit = _start(dest, env, cfg)
    # data: read and split on every rank (cheap, deterministic); tokenize once per node
    model_dir, tokenizer, data, marks = _data(spec, env, task)

    strategy, model, wrapped = _model(spec, env, task, data, model_dir, device, dtype, strategy, saved)
    layout = _layout(spec, env, data, grad_accum, group_unit, device)
    optimizer, scheduler = build_optimizer(model, cfg, layout.total_steps, device)
    scaler = torch.amp.GradScaler(device.type, enabled=(dtype == torch.float16))
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    if task.setup is not None:  # before the checkpoint's weights replace the base's
        task.setup(spec, model, data, env, device, autocast, strategy.sharded)
    fingerprint = checkpoint.fingerprint(
        spec, data.labels, env.world_size, data.train_rows, grad_accum, group_unit, strategy.name, data.content
    )
    state = TrainState.fresh(device, len(data.metric_names or task.train_metrics))
    where = str(found.path) if found else ""
    contents = checkpointed(state, scheduler, scaler, fingerprint, env, data.stream, data.online, where)
    if found:
        _resume(found, contents, strategy, optimizer, state, layout)
    events = _events(
        spec,
        env,
        dest,
        found,
        state,
        layout.total_steps,
        device,
        dtype,
        strategy,
        task.headline,
        status_endpoint,
        cleanup,
    )
    trainer = Trainer(
        marks=marks,
        spec=spec,
        env=env,
        task=task,
        dest=dest,
        device=device,
        dtype=dtype,
        tokenizer=tokenizer,
        data=data,
        model=model,
        strategy=strategy,
        wrapped=wrapped,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        # fp16: the grad scaler skips overflowing steps itself
        guard=FiniteGuard(optimizer, device, enabled=not scaler.is_enabled()),
        autocast=autocast,
        layout=layout,
        contents=contents,
        state=state,
        events=events,
        hooks=[*hooks(spec), *(extra_hooks or [])],
        bar=_bar(env, layout, state, events, cleanup),
        control_group=control_group,
        stop=stop if stop is not None else threading.Event(),
        trace=Trace(trace_dir, env.rank),
    )
    _log_plan(trainer)
    return trainer


def _data(spec: JobSpec, env: DistEnv, task: Task) -> tuple[Path, Any, Prepared, dict[str, float]]:
    """The base model's directory, its tokenizer and the task's data, with the wall-clock marks around reading and
    tokenizing the data (the data phase of metrics.json's "phases"; fetching the model is start-up)."""
    model_dir = artifacts.resolve_model(spec)
    tokenizer = load_tokenizer(model_dir)
    marks = {"data_start": time.time()}
    data = task.prepare(spec, env, model_dir, tokenizer)
    marks["data_end"] = time.time()
    return model_dir, tokenizer, data, marks


def _log_job(spec: JobSpec, env: DistEnv, device: torch.device, dtype: torch.dtype) -> None:
    chosen = spec.training.precision
    precision = chosen if chosen != "auto" else str(dtype).removeprefix("torch.")
    log.info(
        "job %s (%s): world size %d, device %s, precision %s", spec.name, spec.task, env.world_size, device, precision
    )


def _start(
    dest: Output, env: DistEnv, cfg: TrainSpec
) -> tuple[checkpoint.Found | None, dict[str, Any] | None, int, int]:
    """Where the run starts: the checkpoint to resume from (training.resume auto; None: a fresh start),
    its fingerprint, and the data layout (grad_accum, length-grouping unit): the spec's, or a resumed
    run's on another number of processes (the same global batch)."""
    found = _find_checkpoint(dest, env) if cfg.resume == "auto" else None
    saved = checkpoint.saved_fingerprint(found) if found else None
    grad_accum, group_unit = checkpoint.layout(
        saved, env.world_size, cfg.batch_size, cfg.grad_accum, str(found.path) if found else ""
    )
    return found, saved, grad_accum, group_unit


def _model(
    spec: JobSpec,
    env: DistEnv,
    task: Task,
    data: Prepared,
    model_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    strategy: Strategy | None,
    saved: dict[str, Any] | None,
) -> tuple[Strategy, torch.nn.Module, torch.nn.Module]:
    """The strategy, the model (identical initialization on every rank: same seed) and the model as
    the strategy trains it; then each rank's own dropout stream."""
    cfg = spec.training

    def make(where: torch.device) -> torch.nn.Module:
        return task.build_model(spec, model_dir, data, device, dtype, where)

    seed_everything(cfg.seed)
    resumed = saved.get("strategy", "ddp") if saved else None
    strategy = strategy or strategies.for_job(spec, env, device, dtype, make, resumed)
    runtime.allocator_policy(strategy.name, device)  # before the model's first allocation
    model = strategy.build(make)
    if cfg.compile:
        # In place (nn.Module.compile), so under fsdp as well, after fully_shard: a compiled block keeps its
        # FSDP2 hooks, which run outside the graph (torch._dynamo.config.skip_fsdp_hooks), as torchtitan's blocks
        # compiled before sharding do.
        log.info("training.compile: compiled %d transformer blocks", runtime.compile_blocks(model))
    wrapped = strategy.wrap(model)
    # Dropout differs per rank; the stream is still a pure function of (seed, rank).
    seed_everything(cfg.seed + 1000 * (env.rank + 1))
    return strategy, model, wrapped


def hooks(spec: JobSpec) -> list[Hook]:
    """The run's periodic duties, in the order they run at a step's end: its own evaluation, lm-evaluation-harness's
    scores (the ``evaluation`` section), then the checkpoint (and a stop)."""
    harness: list[Hook] = [Harness(spec.evaluation)] if spec.evaluation else []
    return [Evaluation(), *harness, Checkpointing()]


def _bar(
    env: DistEnv, layout: Layout, state: TrainState, events: EventBus, cleanup: contextlib.ExitStack | None
) -> tqdm[Any]:
    """The progress bar, on a terminal only: elsewhere (a pod's log, a file) it would redraw with \\r
    into the log lines; the progress lines say the same there."""
    bar = tqdm(
        total=layout.total_steps,
        initial=state.global_step,
        desc="train",
        unit="step",
        disable=not (env.is_main and sys.stderr.isatty()),
        dynamic_ncols=True,
        mininterval=1.0,
    )
    if cleanup is not None:
        cleanup.callback(bar.close)  # however training ends, the bar's line ends before an error is printed
        # However training ends: TensorBoard's writer thread is not a daemon, and left open after
        # an error it kept rank 0's process from exiting until the launcher's teardown SIGKILLed
        # it 30 s later (the diverged-run test then saw a killed rank, exit 1, not the user error).
        cleanup.callback(events.close)
    return bar


def _workers(cfg: TrainSpec, data: Prepared, device: torch.device) -> int:
    """The data loader's worker processes.

    On a GPU, building batches in the training process leaves the GPU idle meanwhile (+20% samples/s with
    2 workers, BERT-base); on a CPU the workers would take cores from the compute. An online task (GRPO)
    has none, whatever ``training.dataloader_workers`` says: its prompt batches carry the live rollouts
    (the model and its generation engine), which a worker process would pickle back to the trainer as a
    copy. The first GPU run found that path failing on CUDA; on a CPU it hung at the first step.
    """
    if data.online is not None:
        if cfg.dataloader_workers:
            log.info(
                "training.dataloader_workers=%d: not used by an online task (its prompts are built here)",
                cfg.dataloader_workers,
            )
        return 0
    return cfg.dataloader_workers if cfg.dataloader_workers is not None else (2 if device.type == "cuda" else 0)


def _layout(
    spec: JobSpec, env: DistEnv, data: Prepared, grad_accum: int, group_unit: int, device: torch.device
) -> Layout:
    """How the run's data is laid out: the global batch, each epoch's steps, the loader's workers."""
    cfg = spec.training
    token_budget = getattr(spec.data, "max_tokens_per_batch", None)
    streamed = data.stream is not None
    layout = Layout(
        grad_accum=grad_accum,
        group_unit=group_unit,
        token_budget=token_budget,
        train_lengths=column(data.train_ds, "length") if not streamed else np.zeros(0, dtype=np.int64),
        streamed=streamed,
        repeat=data.online.repeat if data.online is not None else 1,
        workers=_workers(cfg, data, device),
    )
    if streamed:  # a stream's epochs are as long as it turns out to be
        # data.streaming needs training.max_steps (the spec's cross-checks, config.checks)
        assert cfg.max_steps is not None
        layout.epoch_steps, layout.total_steps = stream_epochs(cfg.epochs, cfg.max_steps)
    elif token_budget:  # micro-batches by tokens: each epoch's order cuts into its own number of steps
        layout.epoch_steps, layout.total_steps = plan_epochs(
            cfg.epochs, cfg.max_steps, steps_of=lambda e: len(layout.plan(e, cfg, data, env))
        )
    else:
        n_steps = steps_per_epoch(data.train_rows, env.world_size, cfg.batch_size, grad_accum) * layout.repeat
        layout.epoch_steps, layout.total_steps = plan_epochs(cfg.epochs, cfg.max_steps, n_steps=n_steps)
    return layout


def _resume(
    found: checkpoint.Found,
    contents: Contents,
    strategy: Strategy,
    optimizer: torch.optim.Optimizer,
    state: TrainState,
    layout: Layout,
) -> None:
    """Every rank: continue from the checkpoint ``found`` (its fingerprint checked first): the weights, the
    optimizer, and every part of ``contents`` (the schedule, the position, the RNG; a stream's position and
    an online task's rollouts)."""
    contents.load_state_dict(checkpoint.load(found), strategy, found.path, optimizer)
    log.info(
        "resumed from checkpoint step %d (epoch %d, step %d of %s in the epoch): %s",
        state.global_step,
        state.epoch + 1,
        state.step_in_epoch,
        "a stream's" if layout.streamed else layout.epoch_steps[0],
        found.path,
    )


def _events(
    spec: JobSpec,
    env: DistEnv,
    dest: Output,
    found: checkpoint.Found | None,
    state: TrainState,
    total_steps: int,
    device: torch.device,
    dtype: torch.dtype,
    strategy: Strategy,
    headline: tuple[str, ...],
    status_endpoint: trainer_status.Endpoint | None = None,
    cleanup: contextlib.ExitStack | None = None,
) -> EventBus:
    """Rank 0's renderings of the trainer's events, in the order they get each: the human log lines,
    events.jsonl, history.jsonl, TensorBoard, the progress (its line, progress.json, the event lines
    ``kubetune status`` reads from a pod's log) and MLflow; none elsewhere. With a ``status_endpoint``,
    progress.json's records also go to the TrainJob's ``status.trainerStatus`` (``trainer_status``),
    whose reporter ``cleanup`` closes."""
    if not env.is_main:
        return EventBus([])
    resume_step = state.global_step if found else None
    status = None
    if status_endpoint is not None:
        status = trainer_status.StatusReporter(status_endpoint, spec.kubernetes.status_interval_s).start()
        if cleanup is not None:
            # last, however training ends: the final update goes after the export (loggers close before it)
            cleanup.callback(status.close)
    log_events = os.environ.get(LOG_EVENTS_ENV) == "1"  # a cluster pod's workers (kubetune launch)
    progress = ProgressLogger(dest.local, total_steps, spec.training.epochs, state.global_step, status, log_events)
    writers: list[Subscriber] = [
        HumanLog(headline),
        EventFile(dest.local, resumed=found is not None),
        JSONLLogger(dest.local, resume_step, found.path / "history.jsonl" if found else None),
        TensorBoardLogger(dest.local, resume_step),
        progress,
    ]
    if spec.tracking.mlflow:
        from kubetune.training.tracking import MLflowLogger
        from kubetune.version import __version__

        facts = {
            "world_size": env.world_size,
            "device": device.type,
            "precision": str(dtype).removeprefix("torch."),
            "strategy": strategy.name,
            "version": __version__,
        }
        # its run id goes into the trainer state, so the next checkpoint carries it to a resumed run
        writers.append(MLflowLogger(spec, state.logger_runs, facts, dest.local))
    return EventBus(writers)


def _log_plan(trainer: Trainer) -> None:
    cfg, layout = trainer.spec.training, trainer.layout
    n_micro = layout.grad_accum * trainer.env.world_size
    if layout.streamed:
        epoch, batch = "at most, streamed", str(cfg.batch_size * n_micro)
    elif layout.token_budget:
        epoch, batch = "in the first epoch", f"{n_micro} micro-batches of up to {layout.token_budget} tokens"
    else:
        epoch, batch = "per epoch", str(cfg.batch_size * n_micro)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    log.info(
        "training: %d steps (%d %s), global batch %s, %d trainable / %d parameters",
        layout.total_steps,
        layout.epoch_steps[0],
        epoch,
        batch,
        trainable,
        sum(p.numel() for p in trainer.model.parameters()),
    )


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
