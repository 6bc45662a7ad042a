"""The task seam: what one task plugs into the trainer (``training/trainer.py``), the artifacts and
the CLI, and what every task shares (the evaluation loop, tokenizing on a node, the artifact files of
a registered task)."""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from kubetune import distributed
from kubetune.artifacts.presentation import Presentation
from kubetune.config import JobSpec
from kubetune.data import Batch, StepBatch
from kubetune.data.feed import Feed
from kubetune.data.rows import agreed, column
from kubetune.distributed import DistEnv
from kubetune.inference.seam import Inference
from kubetune.providers import S3Settings


@dataclass
class Prepared:
    """A task's tokenized data, as the trainer needs it."""

    train_ds: Any
    eval_ds: Any
    collate: Callable[[np.ndarray], Batch]  # train dataset row ids -> micro-batch
    collate_eval: Callable[[np.ndarray], Batch]  # eval dataset row ids -> micro-batch
    train_rows: int
    eval_rows: int
    units: np.ndarray | None = None  # loss units per train example (tokens for causal-LM); None = 1 each
    labels: list[str] = field(default_factory=list)  # class names (classification); part of the fingerprint
    dropped: dict[str, int] = field(default_factory=dict)
    info: dict = field(default_factory=dict)  # task facts for metrics.json (e.g. the data format)
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

    def step(self, model: torch.nn.Module, step: StepBatch, global_step: int, autocast, stop=None) -> StepBatch:
        """Every rank, at ``global_step``: the step trained on, made from the plan's ``step`` by ``model``
        (the unwrapped model); its ``units`` is the global step's loss units over every rank. ``stop``: the
        run's stop event (a ``threading.Event``); a step whose work could outlast a stopped pod's grace
        period watches it and raises ``distributed.StepAbandoned`` on every rank together, having changed
        nothing, so the trainer checkpoints the step before."""

    def state_dict(self) -> dict:
        """This rank's state for a checkpoint (plain tensors and values)."""

    def load_state_dict(self, states: list[dict] | None, world_size: int, global_step: int) -> None:
        """Every rank: its state from a checkpoint's (one per rank that wrote it)."""


class LossOutput(NamedTuple):
    """One micro-batch's loss, as ``Task.loss`` returns it."""

    loss_sum: torch.Tensor  # the loss summed over the micro-batch's units
    units: torch.Tensor  # how many units (examples, target tokens, pairs) it sums over
    metrics: torch.Tensor | None = None  # the sums of the task's ``train_metrics`` over the units, in order


@dataclass(frozen=True)
class Task:
    """A task's training half; every field is a plain value or function. The task's ``TaskEntry``
    (``config.tasks``, its spec half) names it in ``runtime``; ``tasks.get(name)`` imports it."""

    # (data spec, seed, S3Settings) -> the checked tables (preflight, prepare)
    load_frames: Callable[[Any, int, S3Settings], Any]
    prepare: Callable[[JobSpec, DistEnv, Path, Any], Prepared]  # (spec, env, model_dir, tokenizer)
    # (spec, model dir, data, training device, compute dtype, where the weights go: None = the device;
    # meta = the modules without weights)
    build_model: Callable[..., torch.nn.Module]
    loss: Callable[[torch.nn.Module, Batch, Any], LossOutput]  # (model, micro-batch, autocast)
    # Evaluation, run by ``evaluate`` below: one batch's statistics (a dict of tensors); the statistics
    # of this rank's batches -> named float64 totals (each summed over ranks); the sums -> metrics.
    eval_step: Callable[[torch.nn.Module, Batch, Any], dict]
    eval_totals: Callable[[list[dict], Prepared, torch.device], dict[str, torch.Tensor]]
    eval_metrics: Callable[[dict[str, np.ndarray], Prepared], dict]
    export: Callable[[JobSpec, torch.nn.Module, Any, Prepared, Path, dict], None]  # rank 0, adds to metrics
    headline: tuple[str, ...]  # metrics for the per-epoch and final log lines
    present: Presentation  # how the results read: report, model card, summary
    # Training metrics beyond the loss: ``loss`` then returns their sums over the micro-batch's units
    # (``LossOutput.metrics``); the log lines report each sum over the units since the last line.
    train_metrics: tuple[str, ...] = ()
    # The files ``export`` writes into the output beside kubetune's own (model/, metrics.json, ...), plain
    # names (e.g. GRPO's completions.jsonl): swapped in with them when a run finishes, and owned, so a run
    # that replaces this one removes them (``artifacts.output.Output.commit``).
    artifact_files: tuple[str, ...] = ()
    # (spec, model, data, env, device, autocast, lockstep) -> None, on every rank once the model is built
    # and before a checkpoint is loaded (the model still holds the base weights): e.g. the DPO reference.
    setup: Callable[..., None] | None = None
    # How its export is predicted with and served (`kubetune predict`, `kubetune serve`); None: neither.
    inference: Inference | None = None


def rank_batches(lengths, env: DistEnv, batch_size: int, lockstep: bool) -> tuple[list[np.ndarray], int]:
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
    task: Task, model, data: Prepared, env: DistEnv, device, autocast, batch_size: int, lockstep: bool = False
) -> dict:
    """The shared evaluation loop: the eval set split by ``rank_batches``, the task's statistics
    summed over ranks, then its metrics."""
    model.eval()
    batches, extra = rank_batches(column(data.eval_ds, "length"), env, batch_size, lockstep)
    stats = []
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
    sums, start = {}, 0
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


def tokenize_on_node(env: DistEnv, build) -> Any:
    """Run ``build(create)`` on local rank 0 first (create=True: tokenize on a cache miss), then
    on the node's other ranks (create=False: load the cache rank 0 wrote)."""
    result = build(True) if env.is_local_main else None
    distributed.barrier()
    if not env.is_local_main:
        result = build(False)
    return result
