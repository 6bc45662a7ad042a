"""The ``tune`` section of the job spec: a hyperparameter search over the spec's own fields (``kubetune tune``
locally with Optuna). ``kubetune run`` ignores it: every trial is a normal run of the spec with the trial's
values in."""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import Field, model_validator

from kubetune.config.base import MAX_SPEC_INT, Section

Scalar = int | float | str | bool


class ParamSpec(Section):
    """One dimension of the search: a spec field by its dotted path and the values it may take."""

    type: Literal["float", "int", "choice"] = Field(
        description="float or int: a range from low to high (log: on a log scale); choice: one of values."
    )
    low: float | None = Field(default=None, description="The smallest value (float, int).")
    high: float | None = Field(default=None, description="The largest value (float, int).")
    log: bool = Field(default=False, description="Sample on a log scale (float, int; low must be above 0).")
    step: float | None = Field(
        default=None, gt=0, description="Only multiples of step above low (float, int; grid needs it)."
    )
    values: list[Scalar] | None = Field(
        default=None, min_length=1, max_length=1000, description="The choices (choice)."
    )

    @model_validator(mode="after")
    def _complete(self) -> Self:
        if self.type == "choice":
            if not self.values or self.low is not None or self.high is not None:
                raise ValueError("a choice takes values: [...] (and no low/high)")
            return self
        if self.values is not None or self.low is None or self.high is None:
            raise ValueError(f"a {self.type} range takes low and high (and no values)")
        if not self.low < self.high:
            raise ValueError(f"low {self.low} must be below high {self.high}")
        if self.log and self.low <= 0:
            raise ValueError(f"a log scale needs low above 0, not {self.low}")
        if self.log and self.step is not None:
            raise ValueError("log and step do not go together (Optuna samples one or the other)")
        if self.type == "int" and any(v is not None and v != int(v) for v in (self.low, self.high, self.step)):
            raise ValueError("an int range takes whole numbers for low, high and step")
        return self

    def candidates(self) -> list[Scalar]:
        """The values whose validity bounds the whole dimension: the choices, or a range's ends."""
        if self.type == "choice":
            return list(self.values or [])
        cast = int if self.type == "int" else float
        low, high = self._ends()
        return [cast(low), cast(high)]

    def grid(self) -> list[Scalar] | None:
        """Every value a grid search tries, or None for a continuous range (no step)."""
        if self.type == "choice":
            return list(self.values or [])
        if self.step is None:
            return None
        cast = int if self.type == "int" else float
        low, high = self._ends()
        n = int((high - low) / self.step + 1e-9) + 1
        return [cast(low + k * self.step) for k in range(n)]

    def _ends(self) -> tuple[float, float]:
        """A range's low and high, which a validated range has (``_complete``)."""
        assert self.low is not None and self.high is not None, "a choice has no ends"
        return self.low, self.high


class EarlyStoppingSpec(Section):
    rule: Literal["median"] = Field(
        default="median",
        description="median: stop a trial whose objective at an evaluation is worse than the median of the "
        "earlier trials' at the same step (Optuna's MedianPruner, Katib's medianstop).",
    )
    min_trials: int = Field(default=2, ge=1, le=1000, description="Trials that finish before any is stopped early.")
    warmup_steps: int = Field(default=0, ge=0, le=MAX_SPEC_INT, description="No trial is stopped before this step.")


class TuneSpec(Section):
    """A hyperparameter search over this spec's fields (``kubetune tune``); ``kubetune run`` ignores it."""

    space: dict[Annotated[str, Field(pattern=r"^[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)+$")], ParamSpec] = Field(
        min_length=1,
        max_length=64,
        description="The search space: a spec field's dotted path (training.learning_rate, lora.r, ...) -> its "
        "values, e.g. {type: float, low: 1.0e-5, high: 1.0e-3, log: true}.",
    )
    objective: str = Field(
        default="eval_loss",
        min_length=1,
        max_length=200,
        description="The metric to optimize: one the run reports in metrics.json (eval_loss, eval_accuracy, the "
        "task's own) or an lm-evaluation-harness score of the evaluation section (task/metric, e.g. arc_easy/acc).",
    )
    direction: Literal["minimize", "maximize"] | None = Field(
        default=None, description="Default: minimize a loss or perplexity, maximize anything else."
    )
    algorithm: Literal["random", "grid", "tpe", "cmaes"] = Field(
        default="tpe",
        description="Optuna's sampler: random, grid (every combination), tpe, cmaes (float and int only).",
    )
    trials: int = Field(default=10, ge=1, le=10000, description="Trials to run (a grid: at most its combinations).")
    parallel: int = Field(default=1, ge=1, le=64, description="Trials at once on this machine (they share its cores).")
    max_failed: int = Field(default=0, ge=0, le=10000, description="Failed trials tolerated before the search stops.")
    seed: int = Field(default=0, ge=0, le=MAX_SPEC_INT, description="The sampler's seed.")
    early_stopping: EarlyStoppingSpec | None = Field(
        default=None,
        description="Stop poor trials from their evaluations during training; absent: every trial runs out.",
    )

    def minimize(self) -> bool:
        """Whether the search minimizes its objective (``direction``, else by the objective's name)."""
        if self.direction is not None:
            return self.direction == "minimize"
        return self.objective.endswith(("loss", "perplexity"))
