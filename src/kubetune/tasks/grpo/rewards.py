"""GRPO's reward functions: the built-ins that need no code, a user's ``module:function`` with TRL's
signature, and the weighted total, with every failure of a function (it raises, returns the wrong
number of values, or a non-finite one) made one line naming it and the step.

A user's function is the user's code: it is imported and called in every training process, with the
job's rights, as TRL calls it."""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kubetune.errors import KubetuneError
from kubetune.tasks.grpo import Reward


@dataclass(frozen=True)
class Scorer:
    """One reward function, ready to call: f(prompts, completions, completion_ids, **columns)."""

    label: str
    weight: float
    fn: Callable[..., Sequence]
    where: str  # its spec field, for messages


def scorers(specs: list[Reward]) -> list[Scorer]:
    """The spec's reward functions, a user's imported now (at the start of the run, not at the first step).

    Raises:
        KubetuneError: a module that cannot be imported or has no such function.
    """
    out = []
    for i, r in enumerate(specs):
        where = f"grpo.rewards[{i}].function"
        fn = _builtin(r) if ":" not in r.function else _import(r.function, where)
        out.append(Scorer(r.label, r.weight, fn, where))
    return out


def _import(name: str, where: str) -> Callable:
    module, attr = name.split(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise KubetuneError(
            f"reward function {name}: cannot import module {module!r} ({e})",
            field=where,
            fix="install the module where the job runs, or put its directory on PYTHONPATH (on Kubernetes: in the "
            "image, or a directory on the workspace claim)",
        ) from None
    except AttributeError:
        raise KubetuneError(
            f"reward function {name}: module {module!r} has no {attr!r}",
            field=where,
            fix="name a function the module defines",
        ) from None
    if not callable(fn):
        raise KubetuneError(f"reward function {name} is not callable", field=where, fix="name a function")
    return fn


def _text(completion) -> str:
    """A completion's text: the string, or a conversational completion's (last) message content."""
    if isinstance(completion, list):
        return str(completion[-1]["content"]) if completion else ""
    return str(completion)


def _builtin(r: Reward) -> Callable:
    if r.function == "exact_match":
        pattern = re.compile(r.pattern, re.DOTALL) if r.pattern else None
        column = r.column

        def exact_match(prompts, completions, completion_ids, **columns):
            out = []
            for c, want in zip(completions, columns[column]):
                text = _text(c)
                if pattern is not None:
                    m = pattern.search(text)
                    text = (m.group(1) if m.groups() else m.group(0)) if m else None
                out.append(float(text is not None and text.strip() == str(want).strip()))
            return out

        return exact_match
    if r.function == "regex":
        rx = re.compile(r.pattern, re.DOTALL)
        match = rx.fullmatch if r.full else rx.search
        if r.share:

            def regex_share(prompts, completions, completion_ids, **columns):
                out = []
                for c in completions:
                    text = _text(c)
                    inside = sum(len(m.group().replace(" ", "")) for m in rx.finditer(text))
                    out.append(inside / max(1, len("".join(text.split()))))
                return out

            return regex_share

        def regex(prompts, completions, completion_ids, **columns):
            return [float(match(_text(c)) is not None) for c in completions]

        return regex
    limit, soft = r.max_tokens, r.cache_tokens

    def length(prompts, completions, completion_ids, **columns):
        # DAPO's soft overlong punishment (TRL's get_soft_overlong_punishment), in completion tokens
        out = []
        for ids in completion_ids:
            n = len(ids)
            out.append(0.0 if n <= limit - soft else (limit - soft - n) / soft if n <= limit else -1.0)
        return out

    return length


def score(
    scorers_: list[Scorer], prompts: list, completions: list, completion_ids: list[list[int]], columns: dict, step: int
) -> np.ndarray:
    """Every function's rewards of a batch of completions: (N, functions) float64, NaN where a function
    returned None (TRL: it does not apply to that completion).

    Raises:
        KubetuneError: a function raised, returned other than N values, or a value neither a finite
            number nor None.
    """
    n = len(completions)
    out = np.full((n, len(scorers_)), np.nan)
    for j, s in enumerate(scorers_):
        at = f"at step {step}" if step >= 0 else "in evaluation"
        try:
            values = s.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as e:  # the user's code: any failure is theirs to see, in one line
            raise KubetuneError(
                f"reward function {s.label} raised {type(e).__name__}: {str(e)[:200]} {at}",
                field=s.where,
                fix="fix the function (it is called with prompts, completions, completion_ids and the data's "
                "columns by name)",
            ) from None
        try:
            values = list(values)
        except TypeError:
            values = None
        if values is None or len(values) != n:
            got = "not a list" if values is None else f"{len(values)} values"
            raise KubetuneError(
                f"reward function {s.label} returned {got} for {n} completions {at}",
                field=s.where,
                fix="return one float (or None) per completion",
            )
        for i, v in enumerate(values):
            if v is None:
                continue
            try:
                f = float(v)
            except (TypeError, ValueError):
                f = math.nan
            if not math.isfinite(f):
                raise KubetuneError(
                    f"reward function {s.label} returned {str(v)[:40]!r} for completion {i} {at}",
                    field=s.where,
                    fix="return a finite number (or None where the function does not apply)",
                )
            out[i, j] = f
    return out


def total(per_function: np.ndarray, scorers_: list[Scorer]) -> np.ndarray:
    """The weighted sum of each completion's rewards, a None (NaN) counting as nothing (TRL's nansum)."""
    weights = np.asarray([s.weight for s in scorers_], dtype=np.float64)
    return np.nansum(per_function * weights, axis=1)
