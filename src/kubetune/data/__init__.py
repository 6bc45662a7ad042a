"""Data: table loading and column mapping, tokenization cache, exactly-once sharding, batching."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch

from kubetune.data.sharding import Step
from kubetune.data.tables import read_table
from kubetune.data.tokenize import tokenized

__all__ = ["Batch", "Carried", "StepBatch", "batches", "read_table", "tokenized"]


@dataclass
class Carried:
    """Tensors built on the host with a micro-batch that travel with it (a packed row's attention layout, the
    loss's targets): ``Batch.to`` and ``pin_memory`` move every tensor among its fields, also inside lists and
    tuples; other values (Python numbers) stay. A subclass is a plain dataclass; it pickles (DataLoader workers)."""

    def moved(self, move: Callable[[torch.Tensor], torch.Tensor]) -> Carried:
        """A copy with ``move`` applied to every tensor among the fields."""
        return replace(self, **{f.name: _moved(getattr(self, f.name), move) for f in fields(self) if f.init})


def _moved(value, move: Callable[[torch.Tensor], torch.Tensor]):
    if isinstance(value, torch.Tensor):
        return move(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_moved(v, move) for v in value)
    return value


@dataclass
class Batch:
    """One micro-batch: the model's inputs, and beside them its targets and what only the trainer reads."""

    inputs: dict[str, torch.Tensor]  # passed to the model as keyword arguments
    labels: torch.Tensor  # class ids (classification) or token ids with IGNORE (causal-LM)
    weight: float = 1.0  # 0.0: a rank's empty share of the last, partial step (computed, contributes nothing)
    index: torch.Tensor | None = None  # dataset row ids, for tracing; stays on the CPU
    # Built on the host by the collate so that the step makes no device->host sync to work them out (issue 65):
    # a packed row's attention layout (``tasks.attention.PackedLayout``) and the loss's targets
    # (``tasks.common.Targets``). Keyword-only: the subclasses' positional fields keep their places. Each refers
    # to the tensor it was built from (the position ids, the labels) and is used only while that is still the
    # batch's own: moving a batch keeps shared tensors shared (``_map``), a replaced one orphans it.
    layout: Carried | None = field(default=None, kw_only=True)
    targets: Carried | None = field(default=None, kw_only=True)

    def to(self, device: torch.device) -> Batch:
        """A copy with every tensor field (and the inputs) on ``device``, the same object on the CPU. A
        subclass's fields come along (``dataclasses.replace``): GPU run 3 found a hand-written copy that
        dropped one (GRPO's evaluation lost its rollouts). ``index`` stays on the CPU."""
        if device.type == "cpu":
            return self
        return self._map(lambda t: t.to(device, non_blocking=True))

    def pin_memory(self) -> Batch:
        """Page-locked copies (the DataLoader's pinning thread calls this), for asynchronous copies to a GPU."""
        return self._map(lambda t: t.pin_memory())

    def _map(self, fn) -> Batch:
        done: dict[int, torch.Tensor] = {}

        def move(t: torch.Tensor) -> torch.Tensor:
            # once per tensor: one referred to from two fields (the labels and their targets) stays one
            if id(t) not in done:
                done[id(t)] = fn(t)
            return done[id(t)]

        changes: dict = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "index":
                continue
            if isinstance(value, torch.Tensor):
                changes[f.name] = move(value)
            elif f.name == "inputs":
                changes[f.name] = {k: move(v) for k, v in value.items()}
            elif isinstance(value, Carried):
                changes[f.name] = value.moved(move)
        return replace(self, **changes)

    @property
    def tokens(self) -> tuple[float, float]:
        """(real tokens, computed tokens): padding is what a micro-batch computes on beyond its real tokens."""
        ids = self.inputs["input_ids"]
        mask = self.inputs.get("attention_mask")
        return float(mask.sum() if mask is not None else ids.numel()), float(ids.numel())


@dataclass
class StepBatch:
    micro: list[Batch]
    global_count: int
    indices: np.ndarray
    units: float | None = None  # the step's loss units over every rank, where the rows' units are not known up front

    def pin_memory(self) -> StepBatch:
        """Called by the DataLoader's pinning thread (pin_memory=True): page-locked tensors copy to the GPU
        asynchronously."""
        return StepBatch([m.pin_memory() for m in self.micro], self.global_count, self.indices, self.units)


class _StepDataset(torch.utils.data.Dataset):
    def __init__(self, plan: Sequence[Step], collate_fn, start: int = 0):
        self.plan, self.collate_fn, self.start = plan, collate_fn, start

    def __len__(self) -> int:
        return max(len(self.plan) - self.start, 0)

    def __getitem__(self, k: int) -> StepBatch:
        step = self.plan[self.start + k]
        return StepBatch([self.collate_fn(m) for m in step.micro], step.global_count, step.indices)


def _identity(x):
    return x


def batches(plan: Sequence[Step], collate_fn, workers: int = 0, start: int = 0, pin_memory: bool = False):
    """Iterate this rank's steps from step ``start``, each micro-batch made by ``collate_fn(indices)``
    (workers > 0 prefetch in background; ``pin_memory`` for a CUDA device)."""
    loader = torch.utils.data.DataLoader(
        _StepDataset(plan, collate_fn, start),  # the plan may build its steps on demand: not sliced into a list
        batch_size=None,
        shuffle=False,
        num_workers=workers,
        collate_fn=_identity,
        persistent_workers=False,
        pin_memory=pin_memory,
        # Its own generator: each new iterator draws a seed from it, and drawing from the global
        # one would shift the dropout stream of a resumed run (exact resume needs it untouched).
        generator=torch.Generator().manual_seed(0),
    )
    return iter(loader)
