"""The arguments of Katib's LLM ``KatibClient.tune`` translated into one kubetune job spec with a ``tune`` section
(:func:`spec_from_tune`, a pure function). The model, dataset and trainer parameter objects go through the same
translation as ``TrainingClient.train``'s (``compat.kubeflow.translate``), once every ``katib.search.*`` value in
them has been set aside: each becomes a dimension of the spec's search space, under the spec path its field fills.
What the spec cannot carry is refused by name, every problem in one line."""

from __future__ import annotations

import copy
import dataclasses
import math
import typing
from typing import Any

from kubetune.compat.kubeflow.errors import Problems
from kubetune.compat.kubeflow.training_arguments import RULES, Copy
from kubetune.compat.kubeflow.translate import SDK_DEFAULT_STORAGE, spec_from_train
from kubetune.config.tune import TuneSpec
from kubetune.errors import short

# The SDK's defaults for the arguments the LLM form does not use (kubeflow.katib 0.19 tune()'s signature)
SDK_BASE_IMAGE = "docker.io/pytorch/pytorch:2.2.1-cuda12.1-cudnn8-runtime"
SDK_PIP_INDEX = ["https://pypi.org/simple"]
SDK_COLLECTOR = {"kind": "StdOut"}
# Katib's algorithm names -> the spec's (the ones both have)
ALGORITHMS = typing.get_args(TuneSpec.model_fields["algorithm"].annotation)  # Katib's names are the spec's
# TrainingArguments fields a search value may stand in: the ones a spec field carries one to one
SEARCHABLE = {names[0]: f"training.{rule.key}" for names, rule in RULES if isinstance(rule, Copy)} | {
    "num_train_epochs": "training.epochs",
    "warmup_ratio": "training.warmup_ratio",
    "max_grad_norm": "training.max_grad_norm",
}
LORA_SEARCHABLE = {"r": "lora.r", "lora_alpha": "lora.alpha", "lora_dropout": "lora.dropout"}


def is_search(value: Any) -> bool:
    """Whether ``value`` is a ``katib.search.double|int|categorical`` value (Katib's V1beta1ParameterSpec)."""
    return hasattr(value, "parameter_type") and hasattr(value, "feasible_space")


def _number(text: Any) -> Any:
    """A value of a Katib feasible space (strings for ranges, as given for lists) as the spec takes it."""
    if not isinstance(text, str):
        return text
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def dimension(value: Any, field: str, problems: Problems) -> tuple[dict | None, Any]:
    """The tune.space entry for the search value ``value`` of ``field``, and a value that stands in for it while
    the rest of the call is translated."""
    kind, space = value.parameter_type, value.feasible_space
    distribution = getattr(space, "distribution", None) or "uniform"
    if kind in ("categorical", "discrete"):
        # kubeflow-katib 0.19's katib.search.categorical(list) passes the list positionally to
        # V1beta1FeasibleSpace, whose first parameter is `distribution`: the values arrive there, not in `list`
        listed = space.list or (distribution if isinstance(distribution, list) else None)
        values = [_number(v) for v in (listed or [])]
        if not values:
            problems.add(field, "a categorical search with no values", "give katib.search.categorical([...])")
            return None, None
        return {"type": "choice", "values": values}, values[0]
    if kind not in ("double", "int"):
        problems.add(field, f"a search of parameter_type {kind!r}", "use katib.search.double, int or categorical")
        return None, None
    if distribution not in ("uniform", "logUniform"):
        problems.add(
            field,
            f"a {distribution} distribution is not supported",
            "use a uniform or logUniform range (Optuna samples those)",
        )
        return None, None
    low, high = (_bound(getattr(space, key), kind, key, field, problems) for key in ("min", "max"))
    step = None if space.step is None else _bound(space.step, kind, "step", field, problems)
    if low is None or high is None or (space.step is not None and step is None):
        return None, None
    entry = {"type": "int" if kind == "int" else "float", "low": low, "high": high}
    if distribution == "logUniform":
        entry["log"] = True
    if step is not None:
        entry["step"] = step
    return entry, low


def _bound(text: Any, kind: str, key: str, field: str, problems: Problems) -> int | float | None:
    """A range's bound or step (``key``: min, max, step) as the spec takes it: a whole number for an int search, a
    finite number for a double; None, with the problem added, for anything else (``min="abc"``, ``int(min=8.5)``,
    infinity)."""
    value = _finite(_number(text))
    if value is not None and kind == "int" and value == int(value):
        return int(value)
    if value is not None and kind == "double":
        return float(value)
    what = "a whole number" if kind == "int" else "a finite number"
    problems.add(
        field,
        f"katib.search.{kind}({key}={short(repr(text), 40)}): {key} is not {what}",
        f"give {key} as {what}, e.g. katib.search.{kind}(min=1, max=8)",
    )
    return None


def _finite(value: Any) -> int | float | None:
    """``value`` when it is a finite int or float (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return value if math.isfinite(value) else None
    except OverflowError:  # an int beyond any float
        return None


def _set_aside(obj: Any, field: str, searchable: dict[str, str], space: dict, problems: Problems) -> Any:
    """A copy of the dataclass ``obj`` with each search value replaced by a stand-in, its dimension put into
    ``space`` under the spec path of its field (refused for a field no spec path carries)."""
    if obj is None or not dataclasses.is_dataclass(obj):
        return obj
    found = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if is_search(getattr(obj, f.name, None))}
    if not found:
        return obj
    obj = copy.copy(obj)  # the caller's object is left as it was
    for name, value in found.items():
        where = f"{field}.{name}"
        path = searchable.get(name)
        if path is None:
            problems.add(
                where,
                "a katib.search value here cannot be carried (no spec field takes it one to one)",
                f"search one of {', '.join(sorted(searchable))}, or write a kubetune spec with a tune section",
            )
            continue
        entry, stand_in = dimension(value, where, problems)
        if entry is not None:
            space[path] = entry
            object.__setattr__(obj, name, stand_in)
    return obj


def spec_from_tune(
    name: str | None,
    model_provider_parameters: Any = None,
    dataset_provider_parameters: Any = None,
    trainer_parameters: Any = None,
    storage_config: dict | None = None,
    objective: Any = None,
    base_image: str = SDK_BASE_IMAGE,
    parameters: Any = None,
    namespace: str | None = None,
    env_per_trial: Any = None,
    algorithm_name: str = "random",
    algorithm_settings: Any = None,
    objective_metric_name: str | None = None,
    additional_metric_names: list | None = None,
    objective_type: str = "maximize",
    objective_goal: float | None = None,
    max_trial_count: int | None = None,
    parallel_trial_count: int | None = None,
    max_failed_trial_count: int | None = None,
    resources_per_trial: Any = None,
    retain_trials: bool = False,
    packages_to_install: list | None = None,
    pip_index_urls: list | None = None,
    metrics_collector_config: dict | None = None,
    trial_active_deadline_seconds: int | None = None,
) -> dict:
    """Translate the arguments of Katib's LLM ``KatibClient.tune`` into a kubetune job spec with a tune section.

    Args: those of ``kubeflow.katib.KatibClient.tune`` (0.19), its LLM form (model, dataset and trainer
        parameters with ``katib.search.*`` values in the TrainingArguments and the LoraConfig). ``retain_trials``
        is no part of the spec: ``KatibClient.tune`` sets it on the Experiment's trial template (a local study
        keeps every trial's output anyway).

    Returns:
        The spec as a dict (``kubetune.config.parse_spec`` validates it).

    Raises:
        UnsupportedParameter: every argument the spec cannot carry, named in one line.
    """
    problems = Problems()
    _check_search(objective, parameters, objective_metric_name, objective_type, algorithm_name, problems)
    seed = _seed(algorithm_settings, problems)
    _refuse_changed(
        problems,
        objective_goal=objective_goal,
        additional_metric_names=list(additional_metric_names or []),
        base_image=base_image,
        packages_to_install=packages_to_install,
        pip_index_urls=pip_index_urls,
        metrics_collector_config=metrics_collector_config,
    )
    workers = _trainer_resources(resources_per_trial, problems)
    trainer, space = _search_space(trainer_parameters, problems)
    problems.raise_any()

    spec = spec_from_train(
        name,
        namespace=namespace,
        num_workers=workers[0],
        num_procs_per_worker=workers[1],
        resources_per_worker=workers[2],
        model_provider_parameters=model_provider_parameters,
        dataset_provider_parameters=dataset_provider_parameters,
        trainer_parameters=trainer,
        env_vars=env_per_trial,
        storage_config=SDK_DEFAULT_STORAGE if storage_config is None else storage_config,
    )
    if trial_active_deadline_seconds is not None:
        spec.setdefault("kubernetes", {})["active_deadline_seconds"] = int(trial_active_deadline_seconds)
    tune: dict[str, Any] = {
        "space": space,
        "objective": objective_metric_name,
        "direction": objective_type,
        "algorithm": algorithm_name,
    }
    for key, value in (
        ("trials", max_trial_count),
        ("parallel", parallel_trial_count),
        ("max_failed", max_failed_trial_count),
        ("seed", seed),
    ):
        if value is not None:
            tune[key] = value
    spec["tune"] = tune
    return spec


def _check_search(
    objective: Any, parameters: Any, metric: str | None, direction: str, algorithm: str, problems: Problems
) -> None:
    """The form of the call (the LLM one), its objective and its algorithm."""
    if objective is not None or parameters is not None:
        problems.add(
            "objective" if objective is not None else "parameters",
            "the custom objective function form of tune() is not supported",
            "use the LLM form: model_provider_parameters, dataset_provider_parameters and trainer_parameters with "
            "katib.search values in its TrainingArguments and LoraConfig",
        )
    if not metric:
        problems.add("objective_metric_name", "is required", "name the metric to optimize, e.g. 'train_loss'")
    if direction not in ("minimize", "maximize"):
        problems.add("objective_type", f"{direction!r} is not supported", "use 'minimize' or 'maximize'")
    if algorithm not in ALGORITHMS:
        problems.add(
            "algorithm_name",
            f"{algorithm!r} is not supported",
            f"use one of {', '.join(ALGORITHMS)} (kubetune runs them with Optuna locally, Katib on a cluster)",
        )


# The arguments a kubetune study has no use for: each is refused when it differs from the SDK's default
_UNUSED = {
    "objective_goal": (None, "remove it: a kubetune study runs max_trial_count trials"),
    "additional_metric_names": ([], "remove them: every trial keeps all its metrics (metrics.json, history.jsonl)"),
    "base_image": (
        SDK_BASE_IMAGE,
        "remove it: the trials run kubetune's trainer image (overrides=['kubernetes.image=...'] changes it)",
    ),
    "packages_to_install": (None, "remove it: install what trials need into the image"),
    "pip_index_urls": (SDK_PIP_INDEX, "remove it: install what trials need into the image"),
    "metrics_collector_config": (SDK_COLLECTOR, "remove it: Katib reads kubetune's metrics from the trial's log"),
}


def _refuse_changed(problems: Problems, **given: Any) -> None:
    for field, value in given.items():
        default, fix = _UNUSED[field]
        if value is not None and value != default:
            problems.add(field, f"{value!r} is not supported", fix)


def _search_space(trainer: Any, problems: Problems) -> tuple[Any, dict[str, dict]]:
    """A copy of the trainer parameters with each search value set aside, and the space they make."""
    space: dict[str, dict] = {}
    if trainer is None or not hasattr(trainer, "training_parameters"):
        return trainer, space  # spec_from_train says what it takes
    trainer = copy.copy(trainer)
    field = "trainer_parameters"
    trainer.training_parameters = _set_aside(
        trainer.training_parameters, f"{field}.training_parameters", SEARCHABLE, space, problems
    )
    trainer.lora_config = _set_aside(trainer.lora_config, f"{field}.lora_config", LORA_SEARCHABLE, space, problems)
    if not space and not problems.items:
        problems.add(
            field,
            "has no katib.search value to tune",
            "put katib.search.double/int/categorical values into its TrainingArguments or LoraConfig",
        )
    return trainer, space


def _seed(settings: Any, problems: Problems) -> int | None:
    """algorithm_settings: Katib's ``random_state`` is the spec's seed; no other setting is carried."""
    if not settings:
        return None
    pairs = settings.items() if isinstance(settings, dict) else [(s.name, s.value) for s in settings]
    seed = None
    for key, value in pairs:
        if key == "random_state":
            try:
                seed = int(str(value))
            except ValueError:
                problems.add("algorithm_settings['random_state']", f"{value!r} is not a whole number", "give one")
        else:
            problems.add(
                f"algorithm_settings[{key!r}]",
                "is not supported",
                "remove it: only random_state (the sampler's seed) is carried",
            )
    return seed


def _trainer_resources(res: Any, problems: Problems) -> tuple[int, int, Any]:
    """(nodes, processes per node, resources per worker) of ``resources_per_trial``: the LLM form takes a
    ``katib.TrainerResources``."""
    if res is None or not all(hasattr(res, k) for k in ("num_workers", "num_procs_per_worker")):
        problems.add(
            "resources_per_trial",
            "is required as katib.TrainerResources in the LLM form",
            "pass katib.TrainerResources(num_workers=1, num_procs_per_worker=1, resources_per_worker={...})",
        )
        return 1, 1, None
    counts = [
        _count(getattr(res, k), f"resources_per_trial.{k}", problems) for k in ("num_workers", "num_procs_per_worker")
    ]
    return counts[0], counts[1], getattr(res, "resources_per_worker", None)


def _count(value: Any, field: str, problems: Problems) -> int:
    """A TrainerResources count (workers, processes per worker): a whole number of at least 1 (its text too)."""
    number = _finite(_number(value))
    if number is not None and number == int(number) and number >= 1:
        return int(number)
    problems.add(
        field,
        f"{short(repr(value), 40)} is not a whole number of at least 1",
        f"give one, e.g. {field.split('.')[1]}=1",
    )
    return 1
