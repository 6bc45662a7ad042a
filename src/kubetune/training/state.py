"""TrainState: where a run is; and ``Contents``, a checkpoint's ``state.pt`` declared once (entry name ->
the part that saves and loads it), which ``Trainer.save_checkpoint`` writes and ``training.build`` reads back."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kubetune import checkpoint, distributed
from kubetune.checkpoint.writer import snapshot

if TYPE_CHECKING:
    from kubetune.data.feed import Feed
    from kubetune.distributed import DistEnv
    from kubetune.tasks.base import Online
    from kubetune.training.strategy import Strategy

log = logging.getLogger(__name__)


def _zero(device: torch.device | str = "cpu", size: tuple[int, ...] = ()) -> torch.Tensor:
    return torch.zeros(size, dtype=torch.float64, device=device)


@dataclass
class TrainState:
    """The run's position, counters and accumulators: every piece of the loop's state, by name.
    Live accumulators are this rank's; a checkpoint holds every rank's (``state_dict`` takes them
    gathered).

    Attributes:
        epoch: the epoch in progress (0-based).
        step_in_epoch: optimizer steps done in that epoch.
        global_step: optimizer steps done in the run.
        samples_seen: training examples consumed (all ranks).
        train_time: seconds spent training in finished epochs (evaluation excluded).
        logged_losses: the loss of every log line so far (the final train_loss is their tail's mean).
        loss_sum: this rank's summed loss since the last log line (float64, on the device).
        loss_units: the units (examples, target tokens, pairs) that sum is over.
        metric_sums: this rank's sums of the task's ``train_metrics`` over those units, in order.
        tokens_real: this rank's real (non-pad) tokens trained on.
        tokens_computed: this rank's tokens computed on, padding included.
        logger_runs: run ids of the metric loggers that have one, so a resumed run continues them.
        epoch_started: this process's clock (``time.perf_counter``) when the epoch's training time
            started counting; evaluation moves it forward. A checkpoint holds the training time it
            gives (``train_time`` plus the epoch's part), not the clock.
        last_checkpoint_at: this process's clock (``time.monotonic``) at the last checkpoint, for
            ``training.checkpoint_minutes``; a resumed run counts from its start.
    """

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    samples_seen: int = 0
    train_time: float = 0.0
    logged_losses: list[float] = field(default_factory=list)
    loss_sum: torch.Tensor = field(default_factory=_zero)
    loss_units: torch.Tensor = field(default_factory=_zero)
    metric_sums: torch.Tensor = field(default_factory=lambda: _zero(size=(0,)))
    tokens_real: float = 0.0
    tokens_computed: float = 0.0
    logger_runs: dict[str, str] = field(default_factory=dict)
    epoch_started: float = field(default_factory=time.perf_counter)
    last_checkpoint_at: float = field(default_factory=time.monotonic)

    def accumulated(self) -> torch.Tensor:
        """[loss sum, loss units, metric sums...] as one float64 vector (one reduction; the
        checkpoint's ``log_loss`` entry)."""
        return torch.cat([self.loss_sum.view(1), self.loss_units.view(1), self.metric_sums])

    def reset_accumulators(self) -> None:
        """Zero the loss and metric sums (after a log line)."""
        self.loss_sum.zero_()
        self.loss_units.zero_()
        self.metric_sums.zero_()

    def training_time(self) -> float:
        """Seconds of training so far: the finished epochs' and the running epoch's."""
        return self.train_time + (time.perf_counter() - self.epoch_started)

    def state_dict(self, train_time: float, per_rank: list[tuple[list[float], list[float]]]) -> dict[str, Any]:
        """The checkpoint's ``progress`` entry.

        Args:
            train_time: training seconds up to now (the epoch in progress included).
            per_rank: every rank's (``accumulated()`` as a list, [tokens_real, tokens_computed]), gathered.
        """
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "global_step": self.global_step,
            "samples_seen": self.samples_seen,
            "train_time": train_time,
            "logged_losses": list(self.logged_losses),
            "log_loss": [loss for loss, _ in per_rank],
            "tokens": [t for _, t in per_rank],
            "logger_runs": dict(self.logger_runs),
        }

    @classmethod
    def fresh(cls, device: torch.device, metrics: int = 0) -> TrainState:
        """A new run's state; ``metrics``: how many training metrics the task sums beside the loss."""
        return cls(loss_sum=_zero(device), loss_units=_zero(device), metric_sums=_zero(device, (metrics,)))

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], rank: int, world_size: int, device: torch.device) -> TrainState:
        """This rank's state from a checkpoint's ``progress`` (the RNG is restored separately)."""
        restored = cls.fresh(device)
        restored.load_state_dict(state["progress"], rank, world_size)
        return restored

    def load_state_dict(self, progress: dict[str, Any], rank: int, world_size: int) -> None:
        """Continue from a checkpoint's ``progress`` entry, this rank's part of it (the accumulators on this
        state's device). Written by another number of ranks: rank 0 takes the sums of every rank's accumulators."""
        p = progress
        losses, tokens = p["log_loss"], p.get("tokens", [[0.0, 0.0]] * len(p["log_loss"]))
        if len(losses) != world_size:
            losses = [[sum(x) for x in zip(*losses)]] + [[0.0] * len(losses[0])] * (world_size - 1)
            tokens = [[sum(x) for x in zip(*tokens)]] + [[0.0, 0.0]] * (world_size - 1)
        mine = torch.tensor(losses[rank], device=self.loss_sum.device, dtype=torch.float64)
        self.epoch, self.step_in_epoch, self.global_step = p["epoch"], p["step_in_epoch"], p["global_step"]
        self.samples_seen, self.train_time = p["samples_seen"], p["train_time"]
        self.logged_losses = list(p["logged_losses"])
        self.loss_sum, self.loss_units, self.metric_sums = mine[0].clone(), mine[1].clone(), mine[2:].clone()
        self.tokens_real, self.tokens_computed = float(tokens[rank][0]), float(tokens[rank][1])
        self.logger_runs = dict(p.get("logger_runs", {}))


# ---- a checkpoint's contents, declared once ----
class Stateful(Protocol):
    """One entry of a checkpoint's ``state.pt``."""

    def state_dict(self) -> Any:
        """Every rank, at a checkpoint (it may gather over the ranks); the writer's is written."""

    def load_state_dict(self, state: Any) -> None:
        """Every rank, on resume: continue from the entry as written (None where the checkpoint has none)."""


@dataclass
class Contents:
    """A checkpoint's ``state.pt``: the strategy's model and optimizer entries (``Strategy.save``; a sharded
    strategy's shards beside it), then ``parts`` (entry name -> the part that writes and reads it, in the order
    written). ``Trainer.save_checkpoint`` writes through ``state_dict`` and ``training.build`` reads back through
    ``load_state_dict``, so what is saved is what is loaded."""

    parts: dict[str, Stateful]

    def state_dict(self) -> dict[str, Any]:
        """Every rank, in the same order (parts gather over the ranks): the parts' entries, as copies that the
        run's next steps do not change (an asynchronous checkpoint writes them while it trains)."""
        return {name: snapshot(part.state_dict()) for name, part in self.parts.items()}

    def load_state_dict(
        self, saved: dict[str, Any], strategy: Strategy, directory: Path, optimizer: torch.optim.Optimizer
    ) -> None:
        """Every rank: continue from the checkpoint in ``directory`` (``saved``: its ``state.pt``). Its fingerprint
        is checked first, so nothing is restored from another run's checkpoint; then the model and optimizer, then
        every part in order (the progress before the parts that read its step)."""
        gate = self.parts[FINGERPRINT]
        gate.load_state_dict(saved[FINGERPRINT])
        strategy.load(directory, saved, optimizer)
        for name, part in self.parts.items():
            if part is not gate:
                part.load_state_dict(saved.get(name))


FINGERPRINT = "fingerprint"


def contents(
    state: TrainState,
    scheduler: Stateful,
    scaler: torch.amp.GradScaler,
    fingerprint: dict[str, Any],
    env: DistEnv,
    stream: Feed | None = None,
    online: Online | None = None,
    where: str = "",
) -> Contents:
    """A run's checkpoint contents (``where``: the checkpoint it resumes from, for messages).

    ``state.pt`` holds, beside the strategy's entries: ``scheduler`` and ``scaler`` (their own state
    dicts), ``progress`` (``TrainState``, every rank's accumulators), ``rng`` (every rank's random
    states), ``fingerprint`` (what a resume must match), and where the run has them ``stream``
    (data.streaming's position) and ``online`` (every rank's rollouts)."""
    parts: dict[str, Stateful] = {
        "scheduler": scheduler,
        "scaler": scaler,
        "progress": _Progress(state, env),
        "rng": _Rng(env),
        FINGERPRINT: _Fingerprint(fingerprint, where),
    }
    if stream is not None:
        parts["stream"] = _Stream(stream)
    if online is not None:
        parts["online"] = _Online(online, env, state)
    return Contents(parts)


@dataclass
class _Progress:
    state: TrainState
    env: DistEnv

    def state_dict(self) -> dict[str, Any]:
        s = self.state
        per_rank = distributed.all_gather_object((s.accumulated().tolist(), [s.tokens_real, s.tokens_computed]))
        return s.state_dict(s.training_time(), per_rank)

    def load_state_dict(self, progress: dict[str, Any]) -> None:
        self.state.load_state_dict(progress, self.env.rank, self.env.world_size)


@dataclass
class _Rng:
    env: DistEnv

    def state_dict(self) -> list[dict[str, Any]]:
        return distributed.all_gather_object(checkpoint.rng_state())

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        rank = self.env.rank
        if rank < len(states):
            checkpoint.set_rng_state(states[rank])
        elif rank == len(states):
            log.info(
                "ranks from %d on had no RNG state in the checkpoint; they keep their seeded streams (dropout only)",
                len(states),
            )


@dataclass
class _Fingerprint:
    current: dict[str, Any]
    where: str

    def state_dict(self) -> dict[str, Any]:
        return self.current

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        checkpoint.check_compatible(saved, self.current, self.where)


@dataclass
class _Stream:
    feed: Feed

    def state_dict(self) -> dict[str, Any]:
        return self.feed.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:  # a streamed run's checkpoint always has it
        self.feed.resume(state)  # a changed listing is refused now, before any step


@dataclass
class _Online:
    online: Online
    env: DistEnv
    state: TrainState  # restored before: its step says where in a generation the checkpoint is

    def state_dict(self) -> list[dict[str, Any]]:
        return distributed.all_gather_object(self.online.state_dict())

    def load_state_dict(self, states: list[dict[str, Any]] | None) -> None:
        self.online.load_state_dict(states, self.env.world_size, self.state.global_step)
