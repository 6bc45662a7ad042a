"""The seam between a task and inference: ``Inference`` (what a task says about its export: how it is
recognized, predicted with and served), the protocols it can be served over (``Routes``: ``OPENAI``,
``KSERVE``) and what `kubetune serve` asks of the engine behind them (``Engine``). Plain values: no web
framework is imported here (every task names its inference when it is imported; a training worker never
serves). Ready-made inferences for the common exports: ``kinds``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


class Engine(Protocol):
    """What a task's ``Inference.serve`` returns: the loaded model, computing a batch of the protocol's items
    (``server.batcher``) in one call. Optional: ``cancel(item)`` (a request given up: stop its work at the
    next step), ``generated(items) -> int`` (tokens made, for /metrics), ``outputs`` (KServe v2's output
    names and datatypes)."""

    path: Path  # the model directory it was loaded from

    def run(self, items: list) -> list | None:
        """Compute ``items`` (one batch); a list of results (an exception for an item that failed on its
        own) or None where the results went into the items themselves."""


@dataclass(frozen=True)
class Routes:
    """A protocol family: the routes it adds to the app, how they read in a 404's line, and the shape of
    its errors (OpenAI's ``{"error": {...}}`` outside /v2, else KServe's ``{"error": "..."}``)."""

    name: str  # how `kubetune serve` names it in its first line
    add: Callable[..., None]  # (app, engine, name, limits, runner) -> None
    listing: Callable[[str], str]  # the model's name -> the routes it serves
    openai_errors: bool = False


def _add_openai(app: Any, engine: Any, name: str, limits: Any, runner: Any) -> None:
    from kubetune.inference.server import openai_routes  # FastAPI: imported only to serve

    openai_routes.add_routes(app, engine, name, limits, runner)


def _add_kserve(app: Any, engine: Any, name: str, limits: Any, runner: Any) -> None:
    from kubetune.inference.server import kserve_routes  # FastAPI: imported only to serve

    kserve_routes.add_routes(app, engine, name, runner)


# The OpenAI API for a generating engine (``causal.Generator``): completions, chat completions, models.
OPENAI = Routes(
    "OpenAI", _add_openai, lambda name: "/v1/completions, /v1/chat/completions, /v1/models", openai_errors=True
)
# KServe's v1 and the open inference protocol v2 for an engine that maps texts to named outputs
# (``classifier.Classifier``: label and score; a task's own engine: its own ``outputs``).
KSERVE = Routes("KServe v1/v2", _add_kserve, lambda name: f"/v1/models/{name}:predict, /v2")


@dataclass(frozen=True)
class Inference:
    """A task's inference: how a model it exported is recognized, predicted with and served. `kubetune
    predict` and `kubetune serve` reach it through the task registry (``tasks.for_model``) and nothing else."""

    noun: str  # what its exports are, in messages ("causal LM", "text classifier")
    # (a checked config.json) -> is a model that no run names the task of this task's kind
    claims: Callable[[dict], bool]
    # `kubetune predict`: (model directory, checked by `tasks.for_model`: not checked again; texts, the options given
    # by name, warn) -> JSON-able results;
    # the option names it takes (the CLI's, without -- and with _); one result as text.
    predict: Callable[[str, list[str], dict[str, Any], Callable[[str], None]], list[dict]]
    predict_options: tuple[str, ...] = ()
    show: Callable[[dict], str] = str
    # `kubetune serve`: (model directory, its LoRA adapter's directory or None) -> the engine
    # (``Engine``), served over ``routes``; None: the export is not served. The directory is checked already
    # (``model.check_model``: `kubetune serve` checks a model once) and is this task's kind.
    serve: Callable[[Path, Path | None], Any] | None = None
    routes: Routes | None = None
    adapters: bool = False  # a LoRA export may be served as its base model plus adapter/ (serve --adapter)
