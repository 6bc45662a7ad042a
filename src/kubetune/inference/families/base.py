"""What a model family's fast path gives the generation engine (``Family``): a forward of a packed step written
for that family's exact classes (a flat forward: its operations called directly, without the per-call
machinery of ``model(...)``), which may stop before the head so that a greedy step's tokens come from the
greedy head (``families.greedy``). A family is chosen by the model's architecture (``families.family_of``);
a model of no registered family, or one its family does not take as loaded, runs the generic path."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kubetune.inference.step import SlotCache


class FlatForward(Protocol):
    """A family's forward of a packed step (inside ``step.packed_forward``): the logits at positions ``keep``
    (None: every position), or with ``head`` False the final norm's output there, for the caller's head. It
    writes the cache through ``cache.update`` and attends through ``step.step_attention``, layer by layer, as
    the model's own forward does, and gives the same logits bit for bit."""

    def __call__(
        self,
        model: Any,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: SlotCache,
        keep: torch.Tensor | None,
        head: bool = True,
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class Family:
    """A model family's fast path for the engine's packed step.

    Attributes:
        name: the family, in messages and tests.
        model_types: the config ``model_type`` values it is registered for (``families.family_of``).
        runs: whether a loaded model may run ``forward`` (its exact classes, in eval mode, with no hooks):
            asked once per engine; False sends the model to the generic path.
        forward: the packed step's forward (``FlatForward``).
        project: the logits of ``forward``'s output with ``head`` False, as ``forward`` would make them.
        head: the output projection ``forward`` leaves out with ``head`` False (what the greedy head screens).
    """

    name: str
    model_types: frozenset[str]
    runs: Callable[[Any], bool]
    forward: FlatForward
    project: Callable[[Any, torch.Tensor], torch.Tensor]
    head: Callable[[Any], torch.nn.Linear]
