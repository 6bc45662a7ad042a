"""The trainer's one hook interface: every periodic duty of a run (its own evaluation, checkpoints,
lm-evaluation-harness's scores in ``scoring``) is a ``Hook`` the trainer calls at named points, as HF's
``TrainerCallback`` or torchtitan's validator are; what a hook may use of the run is the ``Run`` protocol.

The points, in the order of a run: ``on_train_start`` (before the first step, not on resume for the duties that
score the base model), ``on_step_end`` (after every optimizer step and its log record), ``on_evaluate`` (after each
of the run's own evaluations), ``on_save`` (after each checkpoint), ``on_epoch_end`` (an epoch's data ran out or the
step limit was reached), ``on_train_end`` (training is over, before the model is gathered for the export: every
rank), ``on_exported`` (after it: the writer has the whole model), ``on_artifacts`` (the writer, while the final
artifacts are staged). The trainer calls its hooks in their order at each point; the order of the built-in ones
(evaluation, the harness, checkpoints) is the order those duties always had at a step's end.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from kubetune import distributed

if TYPE_CHECKING:
    import torch

    from kubetune.artifacts.output import Output
    from kubetune.config import JobSpec
    from kubetune.distributed import DistEnv
    from kubetune.training.events import EventBus
    from kubetune.training.guard import FiniteGuard
    from kubetune.training.layout import Layout
    from kubetune.training.state import TrainState
    from kubetune.training.strategy import Strategy

Metrics = dict[str, Any]


class Run(Protocol):
    """What a hook may use of the run (``trainer.Trainer`` is one): its parts, read-only, and the trainer's own
    operations. A hook changes nothing on the trainer; the loop's state (``TrainState``) is the run's record of
    where it is, which the duties that pause the training clock or count checkpoint time update."""

    @property
    def spec(self) -> JobSpec: ...
    @property
    def env(self) -> DistEnv: ...
    @property
    def state(self) -> TrainState: ...
    @property
    def layout(self) -> Layout: ...
    @property
    def strategy(self) -> Strategy: ...
    @property
    def model(self) -> torch.nn.Module: ...
    @property
    def wrapped(self) -> torch.nn.Module: ...
    @property
    def tokenizer(self) -> Any: ...
    @property
    def autocast(self) -> Any: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def dest(self) -> Output: ...
    @property
    def guard(self) -> FiniteGuard: ...
    @property
    def events(self) -> EventBus: ...
    @property
    def stop(self) -> threading.Event: ...
    @property
    def control_group(self) -> Any: ...

    def evaluate(self, train_s: float) -> Metrics:
        """All ranks: the run's own evaluation (logged, recorded, ``on_evaluate`` called)."""
        ...

    def eval_context(self, train_s: float, t_eval: float) -> Metrics:
        """An evaluation record's bookkeeping: where training stands, and the time since ``t_eval``."""
        ...

    def save_checkpoint(self) -> None:
        """All ranks: write a checkpoint of the run as it is (``on_save`` called)."""
        ...

    def preempted(self) -> NoReturn:
        """End the run on a stop signal (after its checkpoint): raises ``Preempted``."""
        ...


class Hook:
    """One periodic duty of a run. Every point does nothing here: a hook overrides the points it needs. Each is
    called on every rank at the same point (collectives inside are safe), unless it says otherwise."""

    def on_train_start(self, run: Run) -> None:
        """Before the first step of this process (a resumed run's too: ``run.state.global_step`` says)."""

    def on_step_end(self, run: Run) -> None:
        """After an optimizer step and, on a log step, its ``train`` event."""

    def on_evaluate(self, run: Run, metrics: Metrics) -> None:
        """After one of the run's own evaluations, with its metrics."""

    def on_save(self, run: Run, step: int) -> None:
        """After the checkpoint of ``step`` is complete."""

    def on_epoch_end(self, run: Run) -> None:
        """After an epoch (its training time counted, the guard checked)."""

    def on_train_end(self, run: Run, metrics: Metrics) -> None:
        """Training is over, before the model is gathered for the export; ``metrics``: the run's final metrics,
        which a hook may add to."""

    def on_exported(self, run: Run, metrics: Metrics, model: torch.nn.Module | None) -> None:
        """After the model is gathered for the export: ``model`` on the writer, None elsewhere."""

    def on_artifacts(self, run: Run, staged: Path) -> None:
        """The writer alone: the final artifacts are being built in ``staged`` (files added here are published)."""


class Evaluation(Hook):
    """The run's own evaluation: before the first step (``training.eval_on_start``), every ``training.eval_every``
    steps inside an epoch (before the checkpoint, so that a resumed run's history holds it too), and after every
    epoch. The trainer keeps the last one's metrics for the final ones."""

    def on_train_start(self, run: Run) -> None:
        if run.spec.training.eval_on_start and run.state.global_step == 0:
            run.state.epoch_started = time.perf_counter()
            run.evaluate(0.0)

    def on_step_end(self, run: Run) -> None:
        s, every, layout = run.state, run.spec.training.eval_every, run.layout
        if (
            every
            and s.global_step % every == 0
            and s.step_in_epoch < layout.epoch_steps[s.epoch]
            and s.global_step < layout.total_steps
        ):
            run.evaluate(s.training_time())

    def on_epoch_end(self, run: Run) -> None:
        run.evaluate(run.state.train_time)


class Checkpointing(Hook):
    """Checkpoints: every ``training.checkpoint_every`` steps, every ``training.checkpoint_minutes`` (rank 0's
    clock), and on a stop signal, after which the run ends. Every rank agrees, at the same step, on stopping and
    on checkpointing (one small collective per step).

    With ``training.checkpoint_async`` a periodic checkpoint is written in the background while the next steps
    train; the next checkpoint waits for it (``CheckpointStore.save``, ``Strategy.save``), and so do a stop signal's
    checkpoint, which the run ends after, and the end of training (``on_train_end``, before the export and before
    the checkpoints are cleared): the process ends only with its checkpoints complete."""

    def __init__(self) -> None:
        self._periodic = False  # inside this hook's own save_checkpoint (one the run goes on after)

    def on_step_end(self, run: Run) -> None:
        s, cfg = run.state, run.spec.training
        minutes = cfg.checkpoint_minutes
        timed = (
            minutes is not None
            and bool(minutes)
            and run.env.is_main
            and time.monotonic() - s.last_checkpoint_at >= 60 * minutes
        )
        stop, timed = distributed.any_rank(run.stop.is_set(), timed, device=run.device, group=run.control_group)
        if stop or timed or (cfg.checkpoint_every and s.global_step % cfg.checkpoint_every == 0):
            # a checkpoint holds only weights trained on finite gradients
            run.guard.check(s.global_step, run.dest.checkpoints)
            self._periodic = not stop
            try:
                run.save_checkpoint()
            finally:
                self._periodic = False
            s.last_checkpoint_at = time.monotonic()
        if stop:  # its checkpoint was settled in on_save
            run.preempted()

    def on_save(self, run: Run, step: int) -> None:
        if not self._periodic:  # a stop signal's (this hook's, or the trainer's inside a step): the run ends after it
            settle(run)

    def on_train_end(self, run: Run, metrics: Metrics) -> None:
        settle(run)


def settle(run: Run) -> None:
    """Every rank: until the checkpoint in flight is complete (this rank's shards; the writer: the whole checkpoint).

    Raises:
        KubetuneError: its background write failed.
    """
    run.strategy.wait_saved()
    if run.strategy.is_writer:
        run.dest.checkpoints.wait()
