"""How a run's data is laid out over ranks and steps (``Layout``, built by ``training.build``), and a plan whose
steps repeat (``Repeated``: an online task's iterations over one generation)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, overload

import numpy as np

from kubetune.data.sharding import Step, epoch_order, rank_plan, token_micro_batches, token_plan

if TYPE_CHECKING:
    from kubetune.config.schema import TrainSpec
    from kubetune.distributed import DistEnv
    from kubetune.tasks.base import Prepared


Plan = Sequence[Step]  # a rank's steps of an epoch (``sharding.RankPlan``, a token plan's list, ``Repeated``)


@dataclass
class Layout:
    """How the run's data is laid out over ranks and steps (built by ``training.build``)."""

    grad_accum: int  # micro-batches per rank per optimizer step (a resumed run's may differ from the spec's)
    group_unit: int  # the length-grouping unit of the data order (the global micro-batch of the run's start)
    token_budget: int | None  # data.max_tokens_per_batch: micro-batches by tokens (packing)
    train_lengths: np.ndarray[Any, np.dtype[np.int64]]  # tokens per training example
    workers: int  # data loader processes
    epoch_steps: Sequence[int] = field(default_factory=list)  # optimizer steps of each epoch (streamed: at most)
    total_steps: int = 0
    streamed: bool = False  # data.streaming: the epochs' steps are known only once read
    repeat: int = 1  # optimizer steps per step of the data plan (an online task's num_iterations)

    def plan(self, epoch: int, cfg: TrainSpec, data: Prepared, env: DistEnv) -> Plan:
        """This rank's steps of ``epoch``: a pure function of the seed, the epoch and the layout."""
        plan = self._plan(epoch, cfg, data, env)
        return plan if self.repeat == 1 else Repeated(plan, self.repeat)

    def _plan(self, epoch: int, cfg: TrainSpec, data: Prepared, env: DistEnv) -> Plan:
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
class Repeated(Sequence[Step]):
    """A plan with each step ``times`` times in a row (lazy, as the plan it wraps)."""

    plan: Plan
    times: int

    def __len__(self) -> int:
        return len(self.plan) * self.times

    @overload
    def __getitem__(self, k: int) -> Step: ...

    @overload
    def __getitem__(self, k: slice) -> Sequence[Step]: ...

    def __getitem__(self, k: int | slice) -> Step | Sequence[Step]:
        if isinstance(k, slice):  # a Sequence's; the loader asks for steps one by one
            return [self[i] for i in range(*k.indices(len(self)))]
        if not 0 <= k < len(self):
            raise IndexError(k)
        return self.plan[k // self.times]
