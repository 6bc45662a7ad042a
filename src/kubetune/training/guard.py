"""The finite guard: a diverged run (a non-finite gradient norm, loss or weight) stops on every rank at the same
step, with its checkpoints kept and nothing exported (``FiniteGuard``, ``Diverged``, ``check_weights_finite``)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kubetune import distributed
from kubetune.checkpoint.store import CheckpointStore
from kubetune.errors import KubetuneError


class FiniteGuard:
    """Stops a diverged run: a non-finite gradient norm (or logged loss) ends training on every
    rank at the same step, with the checkpoints written before it kept and nothing exported.

    Without a host sync per step: a fused optimizer (adamw, sgd) takes a ``found_inf`` flag on the
    device (the mechanism GradScaler uses) and skips a non-finite update there, and the first such
    step is remembered on the device; the ranks compare it where they synchronize anyway (a log step,
    before a checkpoint, at the end of an epoch). Another optimizer (adamw_foreach, adamw_8bit) refuses
    or ignores the flag, so it is not handed one: its non-finite update is applied, and the run still
    stops at the next comparison, before any checkpoint or export holds that update.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, enabled: bool) -> None:
        self.optimizer, self.enabled = optimizer, enabled
        self.skips = bool(optimizer.defaults.get("fused"))  # torch's non-fused kernels assert found_inf is None
        self.first_bad = torch.full((), -1, dtype=torch.long, device=device)

    def after_backward(self, norm: torch.Tensor | None, grad_norm: Callable[[], torch.Tensor], step: int) -> None:
        """``norm``: the step's gradient norm if clipping computed it; ``grad_norm()`` computes it otherwise."""
        if not self.enabled:
            return
        if norm is None:
            norm = grad_norm()
        nonfinite = ~torch.isfinite(norm)
        if self.skips:
            # read by torch's fused AdamW/SGD step (GradScaler's mechanism), an attribute torch does not declare
            self.optimizer.found_inf = nonfinite.float()  # type: ignore[attr-defined]
        self.first_bad = torch.where(nonfinite & (self.first_bad < 0), step, self.first_bad)

    def check(self, step: int, store: CheckpointStore, loss: float | None = None) -> None:
        """All ranks, at the same step."""
        if not self.enabled:
            return
        bad = int(distributed.all_reduce_max(self.first_bad.clone()).item())
        if bad >= 0 or (loss is not None and not math.isfinite(loss)):
            at = f"step {bad}" if bad >= 0 else f"the steps up to {step} (mean loss {loss})"
            raise Diverged(at, store)


class Diverged(KubetuneError):
    """The loss or gradients became non-finite; the run stops without exporting."""

    agreed = True  # every rank raises it at the same step

    def __init__(self, at: str, store: CheckpointStore) -> None:
        steps = store.local_steps()
        kept = f"the checkpoint of step {steps[-1]} is kept" if steps else "no checkpoint had been written"
        super().__init__(
            (
                f"the loss or the gradient norm became non-finite (nan/inf) at {at}; training stopped on every rank "
                f"and nothing was exported ({kept})"
            ),
            field="training",
            fix=(
                "lower training.learning_rate or training.weight_decay, keep training.max_grad_norm set, or try "
                "precision: fp32"
            ),
        )


def check_weights_finite(model: torch.nn.Module, step: int, store: CheckpointStore) -> None:
    """The export's last check: ``Diverged`` when a trainable weight is not finite."""
    bad = next((n for n, p in model.named_parameters() if p.requires_grad and not torch.isfinite(p).all()), None)
    if bad is not None:
        raise Diverged(f"or before step {step} (weight {bad} is not finite)", store)
