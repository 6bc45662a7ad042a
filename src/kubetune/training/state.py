"""TrainState: where a run is, and everything a checkpoint needs to continue it exactly."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class TrainState:
    """The run's position and counters. Live accumulators are this rank's; a checkpoint holds
    every rank's (``state_dict`` takes them gathered).

    Attributes:
        epoch: the epoch in progress (0-based).
        step_in_epoch: optimizer steps done in that epoch.
        global_step: optimizer steps done in the run.
        samples_seen: training examples consumed (all ranks).
        train_time: seconds spent training in finished epochs (evaluation excluded).
        logged_losses: the loss of every log line so far (the final train_loss is their tail's mean).
        log_loss: this rank's [loss sum, loss units, the task's train_metrics sums...] since the last log
            line (float64, on the device).
        tokens: this rank's [real, padded] tokens trained on.
        logger_runs: run ids of the metric loggers that have one, so a resumed run continues them.
    """

    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0
    samples_seen: int = 0
    train_time: float = 0.0
    logged_losses: list[float] = field(default_factory=list)
    log_loss: torch.Tensor = field(default_factory=lambda: torch.zeros(2, dtype=torch.float64))
    tokens: list[float] = field(default_factory=lambda: [0.0, 0.0])
    logger_runs: dict[str, str] = field(default_factory=dict)

    def state_dict(self, train_time: float, per_rank: list[tuple[Any, list[float], list[float]]]) -> dict:
        """The checkpoint's ``progress`` and ``rng`` entries.

        Args:
            train_time: training seconds up to now (the epoch in progress included).
            per_rank: every rank's (RNG state, log_loss, tokens), gathered.
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
        return cls(log_loss=torch.zeros(2 + metrics, device=device, dtype=torch.float64))

    @classmethod
    def from_state_dict(cls, state: dict, rank: int, world_size: int, device: torch.device) -> TrainState:
        """This rank's state from a checkpoint's ``progress`` (the RNG is restored separately).
        Written by another number of ranks: rank 0 takes the sums of every rank's accumulators."""
        p = state["progress"]
        losses, tokens = p["log_loss"], p.get("tokens", [[0.0, 0.0]] * len(p["log_loss"]))
        if len(losses) != world_size:
            losses = [[sum(x) for x in zip(*losses)]] + [[0.0] * len(losses[0])] * (world_size - 1)
            tokens = [[sum(x) for x in zip(*tokens)]] + [[0.0, 0.0]] * (world_size - 1)
        return cls(
            epoch=p["epoch"],
            step_in_epoch=p["step_in_epoch"],
            global_step=p["global_step"],
            samples_seen=p["samples_seen"],
            train_time=p["train_time"],
            logged_losses=list(p["logged_losses"]),
            log_loss=torch.tensor(losses[rank], device=device, dtype=torch.float64),
            tokens=list(tokens[rank]),
            logger_runs=dict(p.get("logger_runs", {})),
        )
