"""What a task plugs into the trainer (training/trainer.py): its prepared data and its functions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kubetune import distributed
from kubetune.config import JobSpec
from kubetune.distributed import DistEnv


@dataclass
class Prepared:
    """A task's tokenized data, as the trainer needs it."""

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
    """What one task plugs into the trainer; every field is a plain function."""

    prepare: Callable[[JobSpec, DistEnv, Path, Any], Prepared]  # (spec, env, model_dir, tokenizer)
    build_model: Callable[[JobSpec, Path, Prepared, torch.device, torch.dtype], torch.nn.Module]
    loss: Callable[
        [torch.nn.Module, dict, Any], tuple[torch.Tensor, torch.Tensor]
    ]  # -> (loss sum, units) of a micro-batch
    evaluate: Callable[..., dict]  # (model, prepared, env, device, autocast, batch_size) -> metrics
    export: Callable[[JobSpec, torch.nn.Module, Any, Prepared, Path, dict], None]  # rank 0, adds to metrics
    headline: tuple[str, ...]  # metrics for the per-epoch and final log lines


def tokenize_on_node(env: DistEnv, build) -> Any:
    """Run ``build(create)`` on local rank 0 first (create=True: tokenize on a cache miss), then
    on the node's other ranks (create=False: load the cache rank 0 wrote)."""
    result = build(True) if env.is_local_main else None
    distributed.barrier()
    if not env.is_local_main:
        result = build(False)
    return result
