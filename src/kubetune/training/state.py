"""TrainState: where a run is, and everything a checkpoint needs to continue it exactly."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch


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

    def state_dict(self, train_time: float, per_rank: list[tuple[Any, list[float], list[float]]]) -> dict:
        """The checkpoint's ``progress`` and ``rng`` entries.

        Args:
            train_time: training seconds up to now (the epoch in progress included).
            per_rank: every rank's (RNG state, ``accumulated()`` as a list, [tokens_real, tokens_computed]), gathered.
        """
        progress = {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "global_step": self.global_step,
            "samples_seen": self.samples_seen,
            "train_time": train_time,
            "logged_losses": list(self.logged_losses),
            "log_loss": [loss for _, loss, _ in per_rank],
            "tokens": [t for _, _, t in per_rank],
            "logger_runs": dict(self.logger_runs),
        }
        return {"progress": progress, "rng": [rng for rng, _, _ in per_rank]}

    @classmethod
    def fresh(cls, device: torch.device, metrics: int = 0) -> TrainState:
        """A new run's state; ``metrics``: how many training metrics the task sums beside the loss."""
        return cls(loss_sum=_zero(device), loss_units=_zero(device), metric_sums=_zero(device, (metrics,)))

    @classmethod
    def from_state_dict(cls, state: dict, rank: int, world_size: int, device: torch.device) -> TrainState:
        """This rank's state from a checkpoint's ``progress`` (the RNG is restored separately).
        Written by another number of ranks: rank 0 takes the sums of every rank's accumulators."""
        p = state["progress"]
        losses, tokens = p["log_loss"], p.get("tokens", [[0.0, 0.0]] * len(p["log_loss"]))
        if len(losses) != world_size:
            losses = [[sum(x) for x in zip(*losses)]] + [[0.0] * len(losses[0])] * (world_size - 1)
            tokens = [[sum(x) for x in zip(*tokens)]] + [[0.0, 0.0]] * (world_size - 1)
        mine = torch.tensor(losses[rank], device=device, dtype=torch.float64)
        return cls(
            epoch=p["epoch"],
            step_in_epoch=p["step_in_epoch"],
            global_step=p["global_step"],
            samples_seen=p["samples_seen"],
            train_time=p["train_time"],
            logged_losses=list(p["logged_losses"]),
            loss_sum=mine[0].clone(),
            loss_units=mine[1].clone(),
            metric_sums=mine[2:].clone(),
            tokens_real=float(tokens[rank][0]),
            tokens_computed=float(tokens[rank][1]),
            logger_runs=dict(p.get("logger_runs", {})),
        )
