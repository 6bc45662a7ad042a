"""The job spec's model: the typed base ``JobSpec`` and its registered completion ``spec_model()``.

Code annotates with ``JobSpec``; a spec is validated and dumped with ``spec_model()``, a subclass.

``JobSpec`` declares every common section (the data section as ``DataCommon``, the fields every task has);
a task's own section is reached typed through ``JobSpec.section(<its model>)``, its own data fields through
``JobSpec.data_as(<its data model>)``. The tasks are entry points (``config.tasks``), read on first use, not
on import: ``spec_model()`` subclasses ``JobSpec`` with the registered tasks' names in ``task``, their data
models in ``data`` and their own sections as fields.

The key names are a public contract (docs, tools and the Kubernetes ConfigMap rely on them).
Unknown keys are errors; every field carries help text in ``description``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal, Self, TypeVar, Union

from pydantic import Field, create_model, field_validator, model_validator

from kubetune.config.base import DataCommon, Section
from kubetune.config.checks import CROSS_SEPARATOR, INVALID, cross_problems
from kubetune.config.cluster import KubernetesSpec, ResourcesSpec
from kubetune.config.sections import (
    DistributedSpec,
    EvaluationSpec,
    FastPathSpec,
    FSDPSpec,
    LoraSpec,
    MLflowSpec,
    ModelSpec,
    OutputSpec,
    S3Spec,
    TrackingSpec,
    TrainSpec,
    output_uri_problem,
)
from kubetune.config.serving import ServingSpec
from kubetune.config.tasks import DATA_SPECS, TASK_SECTIONS, default_task, registered
from kubetune.config.tune import TuneSpec

# Where these names were defined before the sections and the cross checks had modules of their own: callers
# import them from here.
__all__ = [
    "CROSS_SEPARATOR",
    "DATA_SPECS",
    "INVALID",
    "TASK_SECTIONS",
    "DataSpec",
    "DistributedSpec",
    "EvaluationSpec",
    "FastPathSpec",
    "FSDPSpec",
    "JobSpec",
    "KubernetesSpec",
    "LoraSpec",
    "MLflowSpec",
    "ModelSpec",
    "OutputSpec",
    "ResourcesSpec",
    "S3Spec",
    "ServingSpec",
    "TrackingSpec",
    "TrainSpec",
    "TuneSpec",
    "cross_problems",
    "output_uri_problem",
    "spec_model",
]

# The data section as code sees it: the fields every task has. A validated spec holds its task's own model
# (``DATA_SPECS``), a subclass, which a task's code narrows to with ``JobSpec.data_as``.
DataSpec = DataCommon

S = TypeVar("S", bound=Section)
D = TypeVar("D", bound=DataCommon)

_DOC = "A job spec: the model, the data, the task, the training recipe, where it runs and what it writes."


class _JobHead(Section):
    """The fields a dumped spec lists before the tasks' own sections: what is trained."""

    name: str = Field(
        description="Job name: lowercase letters, digits and '-', a letter first, at most 52 characters "
        "(used for Kubernetes objects).",
    )
    task: str = Field(default="", description="What to fine-tune for: a registered task's name.")
    model: ModelSpec = Field(description="The base model.")
    data: DataCommon = Field(description="Training and evaluation data.")
    lora: LoraSpec | None = Field(default=None, description="LoRA settings; absent = full fine-tune.")


class _JobTail(Section):
    """The fields a dumped spec lists after the tasks' own sections: how it trains, where it runs and writes."""

    training: TrainSpec = Field(default_factory=TrainSpec, description="The training recipe.")
    distributed: DistributedSpec = Field(default_factory=DistributedSpec, description="Nodes × processes per node.")
    output: OutputSpec = Field(description="Where the exported model, metrics and report are written.")
    evaluation: EvaluationSpec | None = Field(
        default=None, description="lm-evaluation-harness tasks on the model being trained; absent: none."
    )
    tune: TuneSpec | None = Field(
        default=None, description="A hyperparameter search over this spec's fields (`kubetune tune`); absent: none."
    )
    tracking: TrackingSpec = Field(default_factory=TrackingSpec, description="Experiment trackers (MLflow).")
    s3: S3Spec = Field(
        default_factory=S3Spec,
        description="S3 / MinIO connection settings (credentials come from the environment, never the spec).",
    )
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec, description="Per-node (pod) resources on Kubernetes."
    )
    kubernetes: KubernetesSpec = Field(default_factory=KubernetesSpec, description="How the job runs on Kubernetes.")
    serving: ServingSpec = Field(
        default_factory=ServingSpec,
        description="How `kubetune render --serve` serves the finished job's export on KServe.",
    )


class JobSpec(_JobTail, _JobHead):
    """A job spec as code sees it: every common section, typed; the data section as ``DataCommon`` (a validated
    spec holds its task's own data model); a task's own section through ``section``.

    A spec is made by ``load_spec`` / ``parse_spec`` (an instance of ``spec_model()``, a subclass): this base
    alone lacks the tasks' fields and refuses to validate.
    """

    def section(self, kind: type[S]) -> S | None:
        """This spec's task section of model ``kind`` (a task's own section, ``TaskEntry.section``), None where
        the spec has none: the typed way to a task's section (its field exists per registered task).

        Raises:
            KeyError: no registered task has a section of model ``kind``.
        """
        for name, model in TASK_SECTIONS.items():
            if model is kind:
                value = getattr(self, name)
                assert value is None or isinstance(value, kind)
                return value
        raise KeyError(f"no registered task has a section of model {kind.__name__}")

    def data_as(self, kind: type[D]) -> D:
        """This spec's data section as model ``kind`` (a task's own data model, ``TaskEntry.data``): the typed
        way to a task's data fields (a validated spec holds its task's model).

        Raises:
            TypeError: the data section is of another model (another task's spec).
        """
        if not isinstance(self.data, kind):
            raise TypeError(f"the spec's data section is a {type(self.data).__name__}, not a {kind.__name__}")
        return self.data

    def __reduce__(self) -> tuple[Callable[[dict[Any, Any]], JobSpec], tuple[dict[Any, Any]]]:
        # pickle finds a class by its module and name, and spec_model()'s class is no module's attribute (it is
        # built on first use): a pickled spec names the function that makes one again instead.
        return _unpickle, (self.__getstate__(),)

    @field_validator("name")
    @classmethod
    def _dns_name(cls, v: str) -> str:
        # DNS-1035: the PyTorchJob webhook and the TrainJob CRD both require a letter first.
        if not re.fullmatch(r"[a-z]([-a-z0-9]{0,50}[a-z0-9])?", v):
            raise ValueError(
                "must be 1-52 lowercase letters, digits or '-', starting with a letter "
                "and ending with a letter or digit "
                "(it names Kubernetes objects, and the Training Operator and Trainer require a DNS-1035 name), "
                "e.g. 'sentiment-minilm'"
            )
        return v

    @model_validator(mode="before")
    @classmethod
    def _registered_only(cls, raw: Any) -> Any:
        if cls is JobSpec:  # its data field is the common base, which refuses every task's own keys
            raise TypeError("JobSpec is the typed base of a job spec: validate with parse_spec or spec_model()")
        return raw

    @model_validator(mode="before")
    @classmethod
    def _data_for_task(cls, raw: Any) -> Any:
        # The data section's model is the task's (DATA_SPECS): its hidden `task` tag selects it.
        if isinstance(raw, dict) and isinstance(raw.get("data"), dict):
            task = raw.get("task", default_task())
            known = isinstance(task, str) and task in DATA_SPECS  # a list or a mapping: the task field's own error
            raw = {**raw, "data": {**raw["data"], "task": task if known else ""}}
        return raw

    @model_validator(mode="after")
    def _cross_checks(self) -> Self:
        own = {name: getattr(self, name) for name in TASK_SECTIONS}
        problems = cross_problems(
            self.data,
            self.distributed,
            self.kubernetes,
            self.output,
            self.tracking,
            own,
            self.training,
            self.lora,
            self.evaluation,
        )
        if problems:
            raise ValueError(CROSS_SEPARATOR.join(problems))  # parse_spec reports each on its own line
        return self


@functools.cache
def spec_model() -> type[JobSpec]:
    """The model a spec is validated and dumped with: ``JobSpec`` completed by the registered tasks (their names
    in ``task``, their data models in ``data``, told apart by ``task``; their own sections as fields, absent:
    None). Built once per process, on first use.

    Raises:
        KubetuneError: no task is registered (kubetune is not installed).
    """
    tasks = registered()
    # The fields' types are made here from the registry, which no checker sees: Any is what they are to it.
    models = tuple(DATA_SPECS.values())
    data: Any = Annotated[Union[models], Field(discriminator="task")] if len(models) > 1 else models[0]  # noqa: UP007
    names: Any = Literal[tuple(DATA_SPECS)]
    sections: dict[str, Any] = {
        name: (
            model | None,
            Field(default=None, description=f"task {name}: {model.__doc__ or ''} Absent: its defaults."),
        )
        for name, model in TASK_SECTIONS.items()
    }
    # A dumped spec (job.yaml, the ConfigMap, `kubetune schema`) lists the tasks' own sections after lora.
    # pydantic orders inherited fields by the reversed MRO, which is _JobHead, these sections, _JobTail here.
    own = create_model("TaskSections", __base__=_JobHead, __module__=__name__, **sections)
    summaries = "; ".join(f"{name} ({entry.summary})" for name, entry in tasks.items())
    built = create_model(
        "JobSpec",
        __base__=(JobSpec, own),
        __module__=__name__,
        __doc__=_DOC,
        task=(names, Field(default=default_task(), description=f"What to fine-tune for: {summaries}.")),
        data=(data, Field(description="Training and evaluation data.")),
    )
    assert issubclass(built, JobSpec)
    return built


def _unpickle(state: dict[Any, Any]) -> JobSpec:
    """A spec made again from its pickled state (``JobSpec.__reduce__``)."""
    model = spec_model()
    spec = model.__new__(model)
    spec.__setstate__(state)
    return spec
