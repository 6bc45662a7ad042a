"""Load a job spec from YAML, apply ``--set`` overrides, and report every problem at once."""

from __future__ import annotations

import difflib
import reprlib
from pathlib import Path
from typing import Any, TypeGuard, TypeVar

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from kubetune.config.base import Section
from kubetune.config.checks import CROSS_SEPARATOR, INVALID, cross_problems
from kubetune.config.cluster import KubernetesSpec
from kubetune.config.schema import JobSpec, spec_model
from kubetune.config.sections import DistributedSpec, EvaluationSpec, LoraSpec, OutputSpec, TrackingSpec, TrainSpec
from kubetune.config.tasks import DATA_SPECS, TASK_SECTIONS, default_task
from kubetune.errors import SpecError


def load_spec(path: str | Path, overrides: list[str] | None = None) -> JobSpec:
    """Read, override and validate a job spec file.

    Args:
        path: YAML file.
        overrides: ``KEY=VALUE`` strings with dotted keys; values are parsed as YAML scalars.

    Returns:
        The validated spec.

    Raises:
        SpecError: the file is missing or not YAML, an override is malformed, or validation failed
            (all problems are collected).
    """
    path = Path(path)
    try:
        if not path.is_file() and path.exists():
            raise SpecError([f"spec: '{path}' is not a regular file — pass a YAML file"], str(path))
        with path.open("rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)
        if len(data) > MAX_SPEC_BYTES:
            raise SpecError(
                [
                    f"spec: '{path}' is larger than {MAX_SPEC_BYTES // 1024} KiB; "
                    "a job spec is a few hundred lines — pass the spec, not data"
                ],
                str(path),
            )
        text = data.decode("utf-8")
    except FileNotFoundError:
        raise SpecError([f"spec: file '{path}' not found — check the path"], str(path)) from None
    except UnicodeDecodeError as e:
        raise SpecError([f"spec: '{path}' is not UTF-8 (byte {e.start}) — pass a UTF-8 YAML file"], str(path)) from None
    except OSError as e:
        raise SpecError(
            [f"spec: cannot read '{path}': {e.strerror or e} — check the path and its permissions"], str(path)
        ) from None
    raw = load_yaml(text, str(path))
    return parse_spec(raw if raw is not None else {}, overrides, source=str(path))


_S = TypeVar("_S", bound=Section)

MAX_SPEC_BYTES = 1 << 20
# The most values a spec may hold once its aliases are expanded. A real spec has a few hundred; a
# YAML "billion laughs" of nine aliases nested nine deep has 9⁹ (and hung `validate` at 2.7 GB).
MAX_SPEC_NODES = 100_000
# The deepest nesting a spec may have: a real one is 4 levels deep. Why a bound: 1,000 nested
# mappings in a 2 KB spec (or a --set value) ended in RecursionError, a traceback.
MAX_SPEC_DEPTH = 32
_TOO_DEEP = f"is nested deeper than {MAX_SPEC_DEPTH} levels; a job spec is a few levels deep — write it out flat"


class _SpecLoader(yaml.SafeLoader):
    """PyYAML's safe loader, plus two refusals: a key repeated in one mapping (YAML says keys are
    unique; PyYAML silently keeps the last), and aliases that expand past ``MAX_SPEC_NODES``."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key; the base class reports it
                break
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {_short(key)} (first on line {first.line + 1}); YAML keys must be unique",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
        return mapping


def _expanded_size(node: yaml.Node, memo: dict[int, int], active: set[int], depth: int = 0) -> int:
    """Values in the node once aliases are expanded; shared nodes are counted once per use, each
    computed once (so a bomb is measured in microseconds)."""
    key = id(node)
    if key in memo:
        return memo[key]
    if key in active:
        raise _Recursive()
    if depth > MAX_SPEC_DEPTH:
        raise _TooDeep()
    active.add(key)
    if isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded_size(v, memo, active, depth + 1) for v in node.value)
    elif isinstance(node, yaml.MappingNode):
        size = 1 + sum(
            _expanded_size(k, memo, active, depth + 1) + _expanded_size(v, memo, active, depth + 1)
            for k, v in node.value
        )
    else:
        size = 1
    active.discard(key)
    memo[key] = min(size, MAX_SPEC_NODES + 1)
    return memo[key]


class _Recursive(Exception):
    pass


class _TooDeep(Exception):
    pass


def load_yaml(text: str, source: str) -> Any:
    """Parse one YAML document of a spec (or a --set value) with the refusals of ``_SpecLoader``.

    Raises:
        SpecError: a YAML syntax error, a duplicate key, or aliases that expand too far.
    """
    loader = _SpecLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        try:
            size = _expanded_size(node, {}, set())
        except _TooDeep:
            raise SpecError([f"spec: {source} {_TOO_DEEP}"], source) from None
        except _Recursive:
            raise SpecError(
                [
                    f"spec: {source}: an alias refers to a node that contains it "
                    "(a recursive structure) — write the values out"
                ],
                source,
            ) from None
        if size > MAX_SPEC_NODES:
            raise SpecError(
                [
                    f"spec: {source}: its aliases expand to more than {MAX_SPEC_NODES:,} values "
                    "— write the values out, or use fewer aliases"
                ],
                source,
            )
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpecError([f"spec: {source}{where}: {_clip(problem, 200)} — fix the YAML syntax"], source) from None
    except RecursionError:  # PyYAML's composer recurses per level, before the depth above is measured
        raise SpecError([f"spec: {source} {_TOO_DEEP}"], source) from None
    except (ValueError, OverflowError) as e:  # e.g. an integer of more than 4,300 digits
        raise SpecError(
            [f"spec: {source}: a value cannot be read: {_clip(str(e).splitlines()[0], 120)} — fix the value"], source
        ) from None
    finally:
        loader.dispose()


def parse_spec(raw: Any, overrides: list[str] | None = None, source: str = "spec") -> JobSpec:
    """Validate a spec given as a mapping (e.g. from a notebook), after applying overrides."""
    if isinstance(raw, JobSpec):
        # exclude_unset: what the user set stays distinguishable from a default (model_fields_set).
        raw = raw.model_dump(mode="json", exclude_unset=True)
    if not isinstance(raw, dict):
        raise SpecError(
            [f"spec: top level must be a mapping of sections, got {type(raw).__name__} — see examples/"], source
        )
    try:
        raw = _deep_copy(raw)
    except _TooDeep:
        raise SpecError([f"spec: {source} {_TOO_DEEP}"], source) from None
    problems: list[str] = []
    for item in overrides or []:
        try:
            _apply_override(raw, item)
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise SpecError(problems, source)
    model = spec_model()  # before the try: no registered task is an error of its own (KubetuneError)
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            if not err["loc"] and err["type"] == "value_error":  # the cross checks: one line each
                msg = err["msg"].removeprefix("Value error, ")
                problems += [f"spec: {line}" for line in msg.split(CROSS_SEPARATOR)]
            elif (line := _format_error(err)) is not None:
                problems.append(line)
        if not any(p.startswith("spec: ") for p in problems):
            # field errors stop pydantic before the cross checks: run them on the sections that are valid
            problems += [f"spec: {line}" for line in _cross_problems_of(raw)]
        raise SpecError(problems, source) from None


def _cross_problems_of(raw: dict[str, Any]) -> list[str]:
    """``checks.cross_problems`` of the sections of ``raw`` that validate on their own."""

    def section(model: type[_S], value: Any) -> _S | None:
        try:
            return model.model_validate(value if value is not None else {})
        except (ValidationError, ValueError, TypeError):
            return None

    task = raw.get("task", default_task())
    data = raw.get("data")
    known = isinstance(task, str) and task in DATA_SPECS  # a list or a mapping is the task field's own error
    data = section(DATA_SPECS[task], {**data, "task": task}) if known and isinstance(data, dict) else None
    return cross_problems(
        data,
        section(DistributedSpec, raw.get("distributed")),
        section(KubernetesSpec, raw.get("kubernetes")),
        section(OutputSpec, raw.get("output")) if raw.get("output") is not None else None,
        section(TrackingSpec, raw.get("tracking")),
        {
            name: (section(model, raw[name]) or INVALID) if raw.get(name) is not None else None
            for name, model in TASK_SECTIONS.items()
        },
        section(TrainSpec, raw.get("training")),
        section(LoraSpec, raw.get("lora")) if raw.get("lora") is not None else None,
        section(EvaluationSpec, raw.get("evaluation")) if raw.get("evaluation") is not None else None,
    )


def resolve_data_paths(spec: JobSpec, base: Path) -> JobSpec:
    """``spec`` with its relative local paths (data.train, data.eval, evaluation.include_path) made absolute
    against ``base``: the spec file's directory for `kubetune run`, so a spec and its data move together
    and run from any directory; the working directory for a spec object from Python. Not in a pod:
    there a relative path is on the workspace claim (README, "Paths")."""

    def relative(value: object) -> TypeGuard[str]:
        return isinstance(value, str) and bool(value) and "://" not in value and not value.startswith(("/", "~"))

    values = {key: getattr(spec.data, key, None) for key in ("train", "eval")}
    update = {key: str(base.resolve() / value) for key, value in values.items() if relative(value)}
    if update:
        spec = spec.model_copy(update={"data": spec.data.model_copy(update=update)})
    evaluation = spec.evaluation
    if evaluation is not None and relative(evaluation.include_path):  # the harness's task YAML directory too
        resolved = str(base.resolve() / evaluation.include_path)
        spec = spec.model_copy(update={"evaluation": evaluation.model_copy(update={"include_path": resolved})})
    return spec


def dump_spec(spec: JobSpec) -> str:
    """The resolved spec as YAML (defaults filled in), as written to job.yaml and the ConfigMap."""
    text: str = yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)
    return text


def _deep_copy(obj: Any, depth: int = 0) -> Any:
    if depth > MAX_SPEC_DEPTH:
        raise _TooDeep()
    if isinstance(obj, dict):
        return {k: _deep_copy(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_deep_copy(v, depth + 1) for v in obj]
    return obj


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. --set training.epochs=2")
    parts = key.strip().split(".")
    try:
        parsed = load_yaml(value, f"--set {key.strip()}") if value.strip() else ""
    except SpecError as e:
        if any(word in e.problems[0] for word in ("aliases", "recursive", "nested deeper")):
            raise ValueError(e.problems[0]) from None
        parsed = value
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise ValueError(f"--set {item!r}: '{where}' is a value, not a section — set '{where}' itself")
        node = child
    node[parts[-1]] = parsed


def _format_error(err: ErrorDetails) -> str | None:
    loc = [str(p) for p in err["loc"]]
    kind = err["type"]
    if kind == "union_tag_invalid":  # the data section of an unknown task: the `task` error says it
        return None
    task = None
    if len(loc) > 1 and loc[0] == "data" and loc[1] in DATA_SPECS:  # the union's tag: the job's task
        task = loc.pop(1)
    if kind == "extra_forbidden" and task and len(loc) == 2:
        owners = [t for t, model in DATA_SPECS.items() if loc[1] in model.model_fields and t != task]
        if owners:
            return (
                f"data.{loc[1]}: applies to task {' or '.join(owners)}, and this job's task is {task} "
                f"— remove it, or set task: {owners[0]}"
            )
    # A key typed by the user may hold anything (newlines, spaces): quote it so the
    # problem stays one readable line.
    field = ".".join(_clip(p, 60) if p.isidentifier() or p.isdigit() else _short(p) for p in loc) or "spec"
    got = err.get("input")
    if kind == "extra_forbidden":
        hint = _suggest(loc, task)
        where = f"kubetune explain {loc[0]}" if len(loc) > 1 else "kubetune explain"
        fix = f"did you mean '{hint}'?" if hint else f"remove it (`{where}` lists the valid keys)"
        return f"{field}: unknown key — {fix}"
    if kind == "missing":
        desc = _describe(loc, task)
        return f"{field}: required but missing — add it{': ' + desc if desc else ''}"
    msg = err["msg"].removeprefix("Value error, ")
    if field == "spec" or not loc:
        return f"spec: {msg}"
    if kind == "value_error":  # our own validators already say what to do
        return f"{field}: {msg} (got {_short(got)})"
    hint = _yaml_number_hint(got) if kind in ("int_parsing", "float_parsing") else ""
    return f"{field}: {msg} (got {_short(got)}){hint} — {_fix_for(loc, task)}"


def _yaml_number_hint(value: Any) -> str:
    """YAML 1.1 (PyYAML) reads ``1e9`` and ``1e-4`` as strings: a float needs a dot and a signed
    exponent (``1.0e+9``). Say so, since the value looks like a number to the user."""
    import re

    if isinstance(value, str) and re.fullmatch(r"[-+]?[0-9][0-9_]*(\.[0-9_]*)?[eE][-+]?[0-9]+", value.strip()):
        return "; YAML reads this as a string (write 1000000000, or 1.0e+9 with a dot and a signed exponent)"
    return ""


_REPR = reprlib.Repr()  # keyword arguments only from Python 3.12
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxtuple, _REPR.maxset = 2, 4, 4, 4, 4
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 50, 50, 40


def _short(value: Any) -> str:
    # reprlib stops at a few items per level: a huge value (or one with many shared parts) is never
    # rendered in full just to be cut to 60 characters.
    return _clip(_REPR.repr(value), 60)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _model_at(loc: list[str], task: str | None = None) -> type[BaseModel] | None:
    """The section model at ``loc``; under ``data``, the data model of ``task`` (default: the spec's default task)."""
    spec = spec_model()
    model: type[BaseModel] = spec
    for part in loc:
        field = model.model_fields.get(part)
        if field is None:
            return None
        if model is spec and part == "data":
            model = DATA_SPECS[task or default_task()]
        else:
            sub = next(iter(_submodels(field.annotation)), None)
            if sub is None:  # a value, not a section
                return None
            model = sub
    return model


def _submodels(annotation: Any) -> list[type[BaseModel]]:
    """The section models a field holds: the model itself, or each model of a union."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [a for a in getattr(annotation, "__args__", ()) or () if isinstance(a, type) and issubclass(a, BaseModel)]


def _suggest(loc: list[str], task: str | None = None) -> str | None:
    parent = _model_at(loc[:-1], task)
    if parent is None:
        return None
    match = difflib.get_close_matches(loc[-1], list(parent.model_fields), n=1, cutoff=0.6)
    return ".".join(loc[:-1] + match) if match else None


def _describe(loc: list[str], task: str | None = None) -> str:
    parent = _model_at(loc[:-1], task)
    field = parent.model_fields.get(loc[-1]) if parent else None
    return (field.description or "") if field else ""


def _fix_for(loc: list[str], task: str | None = None) -> str:
    desc = _describe(loc, task)
    return f"expected: {desc}" if desc else "see the schema in README.md"


def json_schema() -> dict[str, Any]:
    """The spec's JSON Schema for editors (yaml-language-server). The data section is one model per
    task, told apart by the job's top-level ``task``, which JSON Schema's discriminator cannot read
    (it wants the tag inside ``data``): there the section may be any task's (``anyOf``), and
    ``kubetune validate`` checks that it is the job's task's."""
    schema = spec_model().model_json_schema()
    data = schema["properties"]["data"]
    data.pop("discriminator", None)
    data["anyOf"] = data.pop("oneOf")
    for ref in data["anyOf"]:
        schema["$defs"][ref["$ref"].rsplit("/", 1)[-1]]["properties"].pop("task", None)  # internal tag
    return schema


def field_reference() -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, help) for every spec field, in schema order."""
    from pydantic_core import PydanticUndefined

    rows: list[tuple[str, str, str, str]] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            key = prefix + name
            if field.exclude or key in seen:  # internal (the data union's tag), or a key another task's section shares
                continue
            seen.add(key)
            subs = _submodels(field.annotation)
            if field.default is PydanticUndefined and field.default_factory is None:
                default = "(required)"
            elif field.default_factory is not None:
                default = "(section)"
            else:
                default = repr(field.default) if field.default is not None else "null"
            rows.append((key, "section" if subs else _type_name(field.annotation), default, field.description or ""))
            for sub in subs:  # the data section: every task's model, its shared keys once
                walk(sub, f"{key}.")

    seen: set[str] = set()
    walk(spec_model(), "")
    return rows


def _type_name(annotation: Any) -> str:
    import typing

    if typing.get_origin(annotation) is typing.Annotated:  # a validated type (Uri): name the type it validates
        return _type_name(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) is typing.Literal:
        return "|".join(str(a) for a in typing.get_args(annotation))
    args = typing.get_args(annotation)
    if args and typing.get_origin(annotation) in (typing.Union, __import__("types").UnionType):
        return " | ".join(_type_name(a) for a in args)
    if typing.get_origin(annotation) is list:
        return f"list[{_type_name(args[0])}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", None) or str(annotation)
