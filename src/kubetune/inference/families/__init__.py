"""Model-family fast paths, chosen by architecture: the generation engine is generic (``model(...)`` under the
packed step's attention, ``inference.step``) and asks ``family_of`` whether a family module offers a faster
forward for the model as loaded (``base.Family``). Registered: the Llama family (``llama``: transformers' Llama
run as its operations called directly, with the greedy head, ``greedy``). Every other architecture, and a
Llama its family does not take (hooks, training mode, another class), runs the generic path.

How to add a family: a module beside ``llama`` whose ``FAMILY`` (a ``base.Family``) names its model types, and
its line in ``FAMILIES``; a test that its forward gives the model's own logits bit for bit."""

from __future__ import annotations

from typing import Any

from kubetune.inference.families import llama
from kubetune.inference.families.base import Family

# The families with a fast path, by config ``model_type``.
FAMILIES: dict[str, Family] = {t: f for f in (llama.FAMILY,) for t in f.model_types}


def family_of(model: Any) -> Family | None:
    """The family whose fast path runs ``model`` as loaded: registered for its config's ``model_type`` and
    taking it (``Family.runs``); None: the generic path."""
    family = FAMILIES.get(getattr(getattr(model, "config", None), "model_type", None) or "")
    return family if family is not None and family.runs(model) else None
