"""The task seam: what one task plugs into the trainer (``training/trainer.py``), the artifacts and
the CLI, and what every task shares (the evaluation loop, tokenizing on a node, the artifact files of
a registered task)."""

from __future__ import annotations

import ctypes
import functools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt
import torch

from kubetune import distributed
from kubetune.artifacts.presentation import Presentation
from kubetune.config import JobSpec
from kubetune.data import Batch, StepBatch
from kubetune.data.feed import Feed
from kubetune.data.rows import RowSplit, agreed, column
from kubetune.distributed import DistEnv
from kubetune.inference.seam import Inference
from kubetune.providers import S3Settings

RowIds = npt.NDArray[np.int64]  # dataset row ids, as the data plan hands them to a collate


@dataclass
class Prepared:
    """A task's tokenized data, as the trainer needs it."""

    train_ds: Any  # a datasets.Dataset (or a task's own table), indexed by row ids
    eval_ds: Any
    collate: Callable[[RowIds], Batch]  # train dataset row ids -> micro-batch
    collate_eval: Callable[[RowIds], Batch]  # eval dataset row ids -> micro-batch
    train_rows: int
    eval_rows: int
    units: npt.NDArray[Any] | None = None  # loss units per train example (tokens for causal-LM); None = 1 each
    labels: list[str] = field(default_factory=list)  # class names (classification); part of the fingerprint
    dropped: dict[str, int] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)  # task facts for metrics.json (e.g. the data format)
    raw: Any = None  # the task's own frames (for the baseline, the export)
    # a key of the training rows' content (their tokens' cache key): a resume on other data is refused
    content: str = ""
    stream: Feed | None = None  # data.streaming: the training data as a stream (train_ds, collate, units unused)
    # An online task's rollouts (GRPO): each step of the data plan is turned into the step trained on
    # (``Online``), and their state goes into the checkpoint.
    online: Online | None = None
    metric_names: tuple[str, ...] | None = None  # the task's train_metrics for this spec, where they depend on it


class Online(Protocol):
    """An online task's rollouts (``Prepared.online``): what the trainer calls at each optimizer step."""

    @property
    def repeat(self) -> int:
        """Optimizer steps per step of the data plan (each plan step is trained on this many times)."""

    def step(
        self,
        model: torch.nn.Module,
        step: StepBatch,
        global_step: int,
        autocast: torch.autocast,
        stop: threading.Event | None = None,
    ) -> StepBatch:
        """Every rank, at ``global_step``: the step trained on, made from the plan's ``step`` by ``model``
        (the unwrapped model); its ``units`` is the global step's loss units over every rank. ``stop``: the
        run's stop event (a ``threading.Event``); a step whose work could outlast a stopped pod's grace
        period watches it and raises ``distributed.StepAbandoned`` on every rank together, having changed
        nothing, so the trainer checkpoints the step before."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's state for a checkpoint (plain tensors and values)."""

    def load_state_dict(self, states: list[dict[str, Any]] | None, world_size: int, global_step: int) -> None:
        """Every rank: its state from a checkpoint's (one per rank that wrote it)."""


class LossOutput(NamedTuple):
    """One micro-batch's loss, as ``Task.loss`` returns it."""

    loss_sum: torch.Tensor  # the loss summed over the micro-batch's units
    units: torch.Tensor  # how many units (examples, target tokens, pairs) it sums over
    metrics: torch.Tensor | None = None  # the sums of the task's ``train_metrics`` over the units, in order


# ---------------------------------------------------------------- the task's functions, as the trainer calls them
# Their parameters are positional-only: the trainer passes them in this order, and a task names its own as it likes
# (``spec`` or ``data``, ``where`` or ``place``). A micro-batch is typed ``Any`` where the task's own ``Batch``
# subclass comes back to it: its collate made it, the trainer hands it back unseen.


class LoadFrames(Protocol):
    """Read and check the tables of a data section (preflight runs it before any worker starts; ``prepare`` too)."""

    def __call__(self, data: Any, seed: int, s3: S3Settings, /) -> RowSplit:
        """``data``: the spec's data section, the task's own model (``TaskEntry.data``); ``seed``: the split's;
        ``s3``: how s3:// data is reached. Returns the checked tables, split into train and eval."""
        ...


class Prepare(Protocol):
    """The tokenized data as the trainer takes it."""

    def __call__(self, spec: JobSpec, env: DistEnv, model_dir: Path, tokenizer: Any, /) -> Prepared:
        """Every rank: the spec's data read (``load_frames``), tokenized once per node and cached, and collated."""
        ...


class BuildModel(Protocol):
    """The model to train."""

    def __call__(
        self,
        spec: JobSpec,
        model_dir: Path,
        data: Prepared,
        device: torch.device,
        dtype: torch.dtype,
        where: torch.device | None = None,
        /,
    ) -> torch.nn.Module:
        """From the base model in ``model_dir``, for training on ``device`` in compute ``dtype``; its weights on
        ``where`` (None: ``device``; ``meta``: the modules without weights, for FSDP: rank 0 then broadcasts)."""
        ...


class Loss(Protocol):
    """One micro-batch's loss."""

    def __call__(self, model: torch.nn.Module, batch: Any, autocast: torch.autocast, /) -> LossOutput:
        """``model``: as the strategy wrapped it (DDP, FSDP); ``batch``: the task's collate's, on the device."""
        ...


class EvalStep(Protocol):
    """One evaluation batch's statistics (``evaluate``)."""

    def __call__(self, model: torch.nn.Module, batch: Any, autocast: torch.autocast, /) -> dict[str, Any]:
        """A dict of tensors (or numbers) that ``eval_totals`` sums."""
        ...


class EvalTotals(Protocol):
    """The statistics of this rank's evaluation batches -> named float64 totals, each then summed over ranks."""

    def __call__(
        self, stats: list[dict[str, Any]], data: Prepared, device: torch.device, /
    ) -> dict[str, torch.Tensor]: ...


class EvalMetrics(Protocol):
    """The totals summed over ranks -> the evaluation's metrics (``eval_*`` names)."""

    def __call__(self, totals: dict[str, npt.NDArray[Any]], data: Prepared, /) -> dict[str, Any]: ...


class Export(Protocol):
    """Rank 0, once training is done: write the model (and what else the task exports) into the staging directory."""

    def __call__(
        self,
        spec: JobSpec,
        model: torch.nn.Module,
        tokenizer: Any,
        data: Prepared,
        out: Path,
        metrics: dict[str, Any],
        /,
    ) -> None:
        """``model``: unwrapped; ``out``: the staging directory; ``metrics``: metrics.json's, which it may add to."""
        ...


class Setup(Protocol):
    """On every rank once the model is built, before a checkpoint is loaded (the model still holds the base
    weights): e.g. the reference of DPO, KTO or GRPO (``tasks.reference``)."""

    def __call__(
        self,
        spec: JobSpec,
        model: torch.nn.Module,
        data: Prepared,
        env: DistEnv,
        device: torch.device,
        autocast: torch.autocast,
        lockstep: bool,
        /,
    ) -> None:
        """``model``: unwrapped; ``lockstep``: the model is sharded (its every forward is collective)."""
        ...


class Steps(NamedTuple):
    """A task's training and evaluation steps, the ``Task`` fields of the same names (``common.pair_steps`` makes
    them for a task that learns from pairs)."""

    loss: Loss
    eval_step: EvalStep
    eval_totals: EvalTotals
    eval_metrics: EvalMetrics


@dataclass(frozen=True)
class Task:
    """A task's training half; every field is a plain value or a function of the protocol above it. The task's
    ``TaskEntry`` (``config.tasks``, its spec half) names it in ``runtime``; ``tasks.get(name)`` imports it."""

    load_frames: LoadFrames
    prepare: Prepare
    build_model: BuildModel
    loss: Loss
    # Evaluation, run by ``evaluate`` below: one batch's statistics; this rank's totals; the metrics.
    eval_step: EvalStep
    eval_totals: EvalTotals
    eval_metrics: EvalMetrics
    export: Export
    headline: tuple[str, ...]  # metrics for the per-epoch and final log lines
    present: Presentation  # how the results read: report, model card, summary
    # Training metrics beyond the loss: ``loss`` then returns their sums over the micro-batch's units
    # (``LossOutput.metrics``); the log lines report each sum over the units since the last line.
    train_metrics: tuple[str, ...] = ()
    # The files ``export`` writes into the output beside kubetune's own (model/, metrics.json, ...), plain
    # names (e.g. GRPO's completions.jsonl): swapped in with them when a run finishes, and owned, so a run
    # that replaces this one removes them (``artifacts.output.Output.commit``).
    artifact_files: tuple[str, ...] = ()
    setup: Setup | None = None
    # How its export is predicted with and served (`kubetune predict`, `kubetune serve`); None: neither.
    inference: Inference | None = None


def rank_batches(lengths: npt.ArrayLike, env: DistEnv, batch_size: int, lockstep: bool) -> tuple[list[RowIds], int]:
    """This rank's share of a dataset for a pass without gradients: the rows in length order (little
    padding), each on exactly one rank, cut into batches of row ids; and, with ``lockstep`` (a sharded
    model, whose every forward is collective), how many extra forwards this rank makes so that every
    rank makes as many as the first (repeating one row whose result it drops)."""
    everything = np.argsort(np.asarray(lengths), kind="stable")
    mine = everything[env.rank :: env.world_size]
    batches = [mine[start : start + batch_size] for start in range(0, len(mine), batch_size)]
    most = math.ceil(math.ceil(len(everything) / env.world_size) / batch_size)  # the first rank's count
    return batches, (most - len(batches)) if lockstep else 0


@torch.no_grad()
def evaluate(
    task: Task,
    model: torch.nn.Module,
    data: Prepared,
    env: DistEnv,
    device: torch.device,
    autocast: torch.autocast,
    batch_size: int,
    lockstep: bool = False,
) -> dict[str, Any]:
    """The shared evaluation loop: the eval set split by ``rank_batches``, the task's statistics
    summed over ranks, then its metrics."""
    model.eval()
    batches, extra = rank_batches(column(data.eval_ds, "length"), env, batch_size, lockstep)
    stats: list[dict[str, Any]] = []
    for rows in batches:
        stats.append(task.eval_step(model, data.collate_eval(rows).to(device), autocast))
        if device.type == "cpu":  # the activations were host memory
            trim_heap()
    for _ in range(extra):
        task.eval_step(model, data.collate_eval(np.zeros(1, dtype=np.int64)).to(device), autocast)
    totals = task.eval_totals(stats, data, device)
    # one reduction for every total: concatenated, summed over ranks, cut back into the named parts
    flat = distributed.all_reduce_sum(torch.cat([t.reshape(-1).to(torch.float64) for t in totals.values()]))
    parts = flat.cpu().numpy()
    sums: dict[str, npt.NDArray[Any]] = {}
    start = 0
    for name, t in totals.items():
        sums[name] = parts[start : start + t.numel()].reshape(t.shape)
        start += t.numel()
    model.train()
    return task.eval_metrics(sums, data)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
        return None


def trim_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc's ``malloc_trim``). Why: glibc raises its
    mmap threshold to the largest block freed, so later activations come from the heap, and a batch
    larger than the last cannot reuse the space the last one freed; evaluation in length order grew
    a MiniLM worker's resident memory by 250-300 MiB over 3,000-8,000 rows on the CPU, all of it
    free (with a trim after each batch: none; ``benchmarks/README.md``, "Data at scale")."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def on_node_first(env: DistEnv, fn: Callable[[], Any]) -> Any:
    """``fn()`` on local rank 0 first, then on the node's other ranks (which then find in the cache
    what local rank 0 wrote there, e.g. the normalized rows). Collective: every rank calls it."""
    result = agreed(fn if env.is_local_main else lambda: None)  # a user error on one node stops every rank
    return result if env.is_local_main else fn()


def tokenize_on_node(env: DistEnv, build: Callable[[bool], Any]) -> Any:
    """Run ``build(create)`` on local rank 0 first (create=True: tokenize on a cache miss), then
    on the node's other ranks (create=False: load the cache rank 0 wrote)."""
    result = build(True) if env.is_local_main else None
    distributed.barrier()
    if not env.is_local_main:
        result = build(False)
    return result
