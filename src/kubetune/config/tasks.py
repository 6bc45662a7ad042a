"""The task registry: which tasks exist, as Python entry points of the group ``kubetune.tasks``.

Each entry point names a ``TaskEntry``: the light half of a task (pydantic models and plain
functions, no torch), which is all the spec needs; its ``runtime`` names the half that trains
(``kubetune.tasks.base.Task``), imported only when a job runs. The built-in tasks are declared in
pyproject.toml; a task installed from another distribution (or a ``*.dist-info`` directory on
``sys.path``) is found the same way, so a new task is one module plus one registry line and
nothing in kubetune names it. Entry points rather than a table in ``kubetune.tasks``: the spec
(this layer) is built from the registry, and a table there would be an import up the layers.
"""

from __future__ import annotations

import functools
import re
import textwrap
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from importlib import metadata, resources
from types import MappingProxyType
from typing import Any, TypeVar

import yaml

from kubetune.config.base import DataCommon, Section
from kubetune.errors import KubetuneError

GROUP = "kubetune.tasks"


def _no_problems(data: Any, section: Any) -> list[str]:
    return []


@dataclass(frozen=True)
class KServeRuntime:
    """How KServe's Hugging Face runtime serves a task's export (`kubetune render|submit --serve`)."""

    task: str  # the runtime's --task (kserve python/huggingfaceserver, MLTask): text_generation, ...
    adapters: bool = False  # it serves a LoRA adapter on its base model (through the runtime's vLLM backend)


@dataclass(frozen=True)
class TaskEntry:
    """A task as the spec sees it.

    Attributes:
        data: the model of the spec's ``data`` section for this task (a ``DataCommon`` whose ``task``
            field is ``Literal[<the task's name>]``).
        summary: one line for the ``task`` field's help and ``kubetune init``.
        runtime: ``"module:attribute"`` of the task's ``Task`` (imported on first use: torch).
        starter: ``"package:resource"`` of the commented starter job spec `kubetune init` writes for the
            task, a file inside the task's own package (shipped as its package data); None: `init` writes
            one built from the registry (``starter_text``).
        section: the model of the task's own top-level spec section, keyed by the task's name (absent
            from a spec: None, meaning its defaults); None when the task has none.
        checks: (data section, own section or None) -> the problems between them, one line each.
        default: the task of a spec that names none (one task only).
        order: where the task comes in listings (lower first); then by name.
        auto_model: the ``transformers`` Auto class a Kubeflow SDK call names for this task, if any.
        peft_task_type: the ``peft.TaskType`` name a Kubeflow SDK LoRA config implies for it, if any.
        streaming_needs_lora: ``data.streaming`` only with a ``lora`` section (the full fine-tune needs
            something of the whole training set before the first step).
        fsdp_needs_lora: ``distributed.strategy: fsdp`` only with a ``lora`` section (the full fine-tune keeps
            a copy of the model that FSDP cannot make).
        render_warnings: (the job spec) -> what a render must tell about the pods that it cannot check,
            one line each (e.g. the user's code the trainer image must hold).
        kserve: how KServe's Hugging Face runtime serves the task's export (`render --serve`, without
            importing torch); None: the runtime does not serve it, and a render refuses.
        language_model: the task trains and exports a causal LM, so lm-evaluation-harness can score it
            (the spec's ``evaluation`` section).
    """

    data: type[DataCommon]
    summary: str
    runtime: str
    starter: str | None = None
    section: type[Section] | None = None
    checks: Callable[[Any, Any], list[str]] = _no_problems
    default: bool = False
    order: int = 100
    auto_model: str | None = None
    peft_task_type: str | None = None
    streaming_needs_lora: bool = False
    fsdp_needs_lora: bool = False
    render_warnings: Callable[[Any], list[str]] = lambda spec: []
    kserve: KServeRuntime | None = None
    language_model: bool = False


@functools.cache
def entries() -> Mapping[str, TaskEntry]:
    """Every registered task by name, in listing order (read once per process: installed
    distributions do not change while it runs).

    Raises:
        TypeError: an entry point of the group names something that is not a ``TaskEntry``.
    """
    found: dict[str, TaskEntry] = {}
    for point in metadata.entry_points(group=GROUP):
        entry = point.load()
        if not isinstance(entry, TaskEntry):
            raise TypeError(f"entry point {point.name} = {point.value} of {GROUP} is not a kubetune TaskEntry")
        found.setdefault(point.name, entry)  # the first on sys.path wins, as for imports
    ordered = sorted(found.items(), key=lambda item: (item[1].order, item[0]))
    return MappingProxyType(dict(ordered))


def registered() -> Mapping[str, TaskEntry]:
    """``entries()``, which a spec's validation needs: there must be at least one task.

    Raises:
        KubetuneError: no task is registered (kubetune is not installed, so its entry points are missing).
    """
    found = entries()
    if not found:
        raise KubetuneError(
            f"no kubetune task is registered (entry points of {GROUP}): kubetune is not installed",
            fix="pip install -e . (or pip install kubetune)",
        )
    return found


V = TypeVar("V")


class FromRegistry(Mapping[str, V]):
    """A read-only mapping made from the registered tasks (``registered()``) when it is first read, not when its
    module is imported: a checkout that is not installed imports the config, and validating a spec then says what
    is missing.

    Raises:
        KubetuneError: on first read, when no task is registered.
    """

    def __init__(self, make: Callable[[Mapping[str, TaskEntry]], Mapping[str, V]]) -> None:
        self._make = make

    @functools.cached_property
    def _mapping(self) -> Mapping[str, V]:
        return MappingProxyType(dict(self._make(registered())))

    def __getitem__(self, key: str) -> V:
        return self._mapping[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._mapping)

    def __len__(self) -> int:
        return len(self._mapping)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self._mapping)!r})"


# The data section's model per task: the spec's `task` values, and the union its `data` is validated as.
DATA_SPECS: Mapping[str, type[DataCommon]] = FromRegistry(lambda tasks: {n: e.data for n, e in tasks.items()})
# The tasks that have a top-level section of their own (``TaskEntry.section``), keyed by the task's name.
TASK_SECTIONS: Mapping[str, type[Section]] = FromRegistry(
    lambda tasks: {name: entry.section for name, entry in tasks.items() if entry.section is not None}
)


def default_task() -> str:
    """The task of a spec that names none."""
    return next((name for name, entry in entries().items() if entry.default), next(iter(entries()), ""))


def starter_text(name: str) -> str:
    """The commented starter job spec of task ``name`` (`kubetune init`): the one the task ships
    (``TaskEntry.starter``), else one built from the registry (``generated_starter``).

    Raises:
        KeyError: no task of that name is registered.
        KubetuneError: the task names a starter its package does not hold (a packaging error).
    """
    entry = entries()[name]
    if entry.starter is None:
        return generated_starter(name, entry)
    package, _, resource = entry.starter.partition(":")
    try:
        return resources.files(package).joinpath(*resource.split("/")).read_text(encoding="utf-8")
    except (ImportError, OSError, ValueError) as e:  # ValueError: no package named, or a namespace package
        raise KubetuneError(
            f"task {name!r} names the starter {entry.starter!r}, which its package does not hold ({type(e).__name__})",
            field="task",
            fix="reinstall the task's distribution (the starter is its package data), or tell its authors",
        ) from None


def generated_starter(name: str, entry: TaskEntry) -> str:
    """A starter job spec for a task that ships none, built from its registry entry: the name, the task,
    placeholders for model.uri and data.train (which `kubetune validate` refuses until they are filled),
    the task's own data fields with their defaults and help, its own section (commented out unless a
    field of it is required), a short training section and the output."""
    job = ("my-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-"))[:52].rstrip("-")
    about = (
        f"A job spec for task {name} ({entry.summary}), written by `kubetune init {name}` from the task's registry "
        "entry (the task ships no starter of its own). Fill in model.uri and data.train, then check it with "
        "`kubetune validate job.yaml`; `kubetune explain SECTION` lists every key of a section."
    )
    lines = [f"# {line}" for line in _wrap(about, 100)]
    lines += [
        f"name: {job}",
        f"task: {_yaml_value(name)}",
        "model:",
        "  uri:                      # fill in: hf://ORG/NAME, s3://bucket/prefix or a local directory",
        "data:",
        "  train:                    # fill in: a CSV, JSON Lines or Parquet file, a directory, s3://... or hf://...",
        "  # eval: PATH              # absent: data.eval_fraction of data.train is held out",
    ]
    own = {key: field for key, field in entry.data.model_fields.items() if key not in DataCommon.model_fields}
    lines += _fields(own, "  ")
    if entry.section is not None:
        fields = entry.section.model_fields
        required = any(field.is_required() for field in fields.values())
        block = [f"{_yaml_value(name)}:  # the task's own section; absent: its defaults"]
        block += _fields(fields, "  ")
        lines += block if required else ["# " + line for line in block]
    lines += [
        "training:",
        "  epochs: 1",
        "  batch_size: 16",
        "  learning_rate: 5.0e-5",
        "output:",
        f"  uri: runs/{job}",
    ]
    return "\n".join(lines) + "\n"


def _fields(fields: Mapping[str, Any], indent: str) -> list[str]:
    """``key: default`` lines, each after its help as comment lines (a required field: empty, to fill in)."""
    lines = []
    for key, field in fields.items():
        if field.exclude:
            continue
        lines += [f"{indent}# {line}" for line in _wrap(field.description or "", 100 - len(indent))]
        if field.is_required():
            lines.append(f"{indent}{key}:  # required: fill in")
        else:
            lines.append(f"{indent}{key}: {_yaml_value(field.get_default(call_default_factory=True))}")
    return lines


def _wrap(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False)


def _yaml_value(value: Any) -> str:
    """``value`` as one line of YAML (flow style)."""
    if hasattr(value, "model_dump"):
        value = value.model_dump(mode="json")
    text: str = yaml.safe_dump(value, default_flow_style=True, width=float("inf"), allow_unicode=True)
    return text.removesuffix("\n").removesuffix("\n...").strip()
