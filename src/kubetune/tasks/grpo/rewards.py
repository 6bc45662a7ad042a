"""GRPO's reward functions: the built-ins that need no code, a user's ``module:function`` with TRL's
signature, and the weighted total, with every failure of a function (it raises, runs past
grpo.reward_timeout_s, returns other than one finite number or None per completion) made one line naming
it and the step. Each call runs in a helper thread, so that its wait is bounded and a stop signal gives it
up at once.

A user's function is the user's code: it is imported and called in every training process, with the
job's rights, as TRL calls it."""

from __future__ import annotations

import importlib
import math
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kubetune.errors import KubetuneError
from kubetune.providers import S3Settings
from kubetune.tasks.grpo import Reward


@dataclass(frozen=True)
class Scorer:
    """One reward function, ready to call: f(prompts, completions, completion_ids, **columns)."""

    label: str
    weight: float
    fn: Callable[..., Sequence]
    where: str  # its spec field, for messages


def scorers(specs: list[Reward], chat: bool = False, s3: S3Settings = S3Settings()) -> list[Scorer]:
    """The spec's reward functions, a user's imported now and a reward model loaded (at the start of the run, not
    at the first step); ``chat``: the prompts are message lists (a reward model renders them with its template).

    Raises:
        KubetuneError: a module that cannot be imported or has no such function; a reward model that cannot be
            had, is not one, or cannot render the policy's chat.
    """
    out = []
    for i, r in enumerate(specs):
        where = f"grpo.rewards[{i}].function"
        if r.function == "model":
            assert r.model is not None  # the section's checks require it
            fn = model_reward(r.model, f"grpo.rewards[{i}].model", chat, s3)
        else:
            fn = _builtin(r) if ":" not in r.function else _import(r.function, where)
        out.append(Scorer(r.label, r.weight, fn, where))
    return out


def model_reward(uri: str, where: str, chat: bool, s3: S3Settings, batch_size: int = 16) -> Callable:
    """A trained reward model (a kubetune reward-model export) as a reward function: each prompt + completion
    tokenized as the reward model's training tokenized a pair's answer (``tasks.reward_models.answer_ids``), cut to its
    context (keeping the start), scored in batches of ``batch_size`` on the calling thread's device (the rank's GPU,
    else the CPU).

    Raises:
        KubetuneError: no such model, not a reward model, or one trained on the other format than the policy's
            prompts (chat or text), or without a chat template for chat prompts (one line naming ``where``).
    """
    import torch
    from transformers import AutoModelForSequenceClassification

    from kubetune.inference.model import context_length, expect, load_model, load_tokenizer, model_path
    from kubetune.tasks.reward_models import INPUT, answer_ids, is_reward_model, score_ids

    try:
        path = model_path(uri, s3)
        expect(path, is_reward_model, "reward model (the output of a `task: reward-model` run)")
    except KubetuneError as e:
        raise KubetuneError(str(e), field=where, fix=e.fix) from None
    tokenizer = load_tokenizer(path)
    model = load_model(AutoModelForSequenceClassification, path).eval()
    trained = getattr(model.config, INPUT, None)
    if trained is not None and (trained == "chat") != chat:
        raise KubetuneError(
            f"the reward model {uri} was trained on {trained} pairs, and the policy's prompts are "
            f"{'chat' if chat else 'text'}: it would score sequences unlike any it learned from",
            field=where,
            fix="train the reward model on pairs in the policy's format (data.format), or give the policy prompts in "
            "the reward model's",
        )
    if chat and not getattr(tokenizer, "chat_template", None):
        raise KubetuneError(
            f"the reward model {uri} has no chat template, so it cannot encode the policy's chat prompts",
            field=where,
            fix="train the reward model on chat pairs (its export keeps the template it rendered them with), or "
            "give the policy text prompts",
        )
    limit = context_length(model.config, tokenizer)

    @torch.no_grad()
    def reward_model(prompts, completions, completion_ids, **columns):
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        if next(model.parameters()).device != device:
            model.to(device)
        seqs = [answer_ids(tokenizer, p, c)[:limit] for p, c in zip(prompts, completions)]
        return score_ids(model, seqs, batch_size)

    return reward_model


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
        assert r.pattern is not None  # the section's checks require it
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


class Abandoned(Exception):
    """A stop signal (SIGTERM, SIGINT) came while a reward function ran: the call was given up unfinished."""


# How often a wait for a reward call looks at the stop signal: a stop is answered within this.
_POLL_S = 0.1


def score(
    scorers_: list[Scorer],
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict,
    step: int,
    *,
    timeout_s: float | None = None,
    stop: threading.Event | None = None,
    thread_setup: Callable[[], None] | None = None,
) -> np.ndarray:
    """Every function's rewards of a batch of completions: (N, functions) float64, NaN where a function
    returned None (TRL: it does not apply to that completion).

    Each call runs in a helper thread, so that it can be bounded: the caller waits at most ``timeout_s``
    (None: for ever), and gives the call up as soon as ``stop`` is set; ``thread_setup`` runs first in
    the helper thread (the rank's CUDA device, which is per thread).

    Raises:
        KubetuneError: a function raised, ran past ``timeout_s``, returned other than N values, or a value
            neither a finite number nor None.
        Abandoned: ``stop`` was set while a function ran.
    """
    n = len(completions)
    at = f"at step {step}" if step >= 0 else "in evaluation"
    out = np.full((n, len(scorers_)), np.nan)
    kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns}
    for j, s in enumerate(scorers_):
        values = _call(s, kwargs, at, n, timeout_s, stop, thread_setup)
        out[:, j] = _values(s, values, n, at)
    return out


def _call(s: Scorer, kwargs: dict, at: str, n: int, timeout_s, stop, thread_setup) -> object:
    """``s.fn(**kwargs)`` in a daemon thread, waited for as ``score`` says. A call given up keeps running
    until the process exits, which it is about to: a timeout stops the run, a stop checkpoints and exits.
    Why a thread of our own rather than concurrent.futures: its pool's threads are joined at exit, so a
    call given up would hold the exit (and the pod's grace period) until it returned."""
    box: dict = {}
    done = threading.Event()

    def run() -> None:
        try:
            if thread_setup is not None:
                thread_setup()
            box["value"] = s.fn(**kwargs)
        except BaseException as e:  # noqa: BLE001 -- the user's code: any failure (sys.exit too) is theirs to see
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name=f"reward {s.label}", daemon=True).start()
    deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
    while not done.wait(min(_POLL_S, max(0.0, deadline - time.monotonic()))):
        if stop is not None and stop.is_set():
            raise Abandoned(s.label)
        if time.monotonic() >= deadline:
            raise KubetuneError(
                f"reward function {s.label} did not return within grpo.reward_timeout_s {timeout_s:g} s {at} "
                f"({n} completions)",
                field=s.where,
                fix="make it faster (one call scores this process's completions of a step), or raise "
                "grpo.reward_timeout_s, and keep it well below the grace period a stopped pod gets "
                "(kubernetes.termination_grace_period_seconds): a stop signal waits for a running call",
            )
    if "error" in box:
        e = box["error"]
        raise KubetuneError(
            f"reward function {s.label} raised {type(e).__name__}: {str(e)[:200]} {at}",
            field=s.where,
            fix=_THREAD_FIX
            if isinstance(e, ValueError) and "main thread" in str(e)
            else "fix the function (it is called with prompts, completions, completion_ids and the data's "
            "columns by name)",
        ) from None
    return box["value"]


# Python sets signal handlers in the main thread only, and a reward call runs in a helper thread.
_THREAD_FIX = (
    "reward functions run in a helper thread (so that grpo.reward_timeout_s can bound them), where a signal "
    "handler cannot be set: turn the function's own signal-based timeout off (math_verify: parsing_timeout=None, "
    "timeout_seconds=None); grpo.reward_timeout_s bounds the call"
)


def _values(s: Scorer, values, n: int, at: str) -> np.ndarray:
    """A function's return value as N float64 (NaN for None).

    Raises:
        KubetuneError: not a sequence of N values (a str is one, of characters), or a value neither a
            finite number nor None.
    """
    got = None
    if not isinstance(values, (str, bytes, Mapping)) and values is not None:
        try:
            got = list(values)
        except TypeError:
            pass
    if got is None or len(got) != n:
        what = f"{len(got)} values" if got is not None else "None" if values is None else _kind(values)
        raise KubetuneError(
            f"reward function {s.label} returned {what} for {n} completions {at}",
            field=s.where,
            fix="return a list of one float (or None) per completion",
        )
    out = np.full(n, np.nan)
    for i, v in enumerate(got):
        if v is None:
            continue
        f, why = _number(v)
        if why:
            raise KubetuneError(
                f"reward function {s.label} returned {_show(v)} for completion {i} {at}: {why}",
                field=s.where,
                fix="return a finite number (or None where the function does not apply)",
            )
        out[i] = f
    return out


def _number(v) -> tuple[float, str]:
    """``v`` as a float, or why it is not a finite number ("" when it is)."""
    if isinstance(v, (str, bytes)):  # float("1") would take it: a number must be a number
        return math.nan, f"a {type(v).__name__}, not a number"
    try:
        f = float(v)
    except OverflowError:  # an int past float's range
        return math.nan, "too large for a float"
    except (TypeError, ValueError):
        return math.nan, f"a {type(v).__name__}, not a number"
    return (f, "") if math.isfinite(f) else (f, "not finite")


def _show(v) -> str:
    """A value, quoted and cut to 40 characters, for a message."""
    try:
        text = str(v)
    except ValueError:  # an int past str()'s digit limit
        text = f"<{type(v).__name__}>"
    return repr(text if len(text) <= 40 else text[:40] + "...")


def _kind(v) -> str:
    """What a return value that is no sequence of values is: its type, and itself (a str quoted)."""
    return f"a {type(v).__name__} ({_show(v) if isinstance(v, (str, bytes)) else _show(v)[1:-1]})"


def total(per_function: np.ndarray, scorers_: list[Scorer]) -> np.ndarray:
    """The weighted sum of each completion's rewards, a None (NaN) counting as nothing (TRL's nansum)."""
    weights = np.asarray([s.weight for s in scorers_], dtype=np.float64)
    return np.nansum(per_function * weights, axis=1)
