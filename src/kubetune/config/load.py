"""Load a job spec from YAML, apply ``--set`` overrides, and report every problem at once."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from kubetune.config.schema import JobSpec
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
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError([f"spec: file '{path}' not found — check the path"], str(path)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError([f"spec: cannot read '{path}': {e} — pass a UTF-8 YAML file"], str(path)) from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpecError([f"spec: {path}{where}: {problem} — fix the YAML syntax"], str(path)) from None
    return parse_spec(raw if raw is not None else {}, overrides, source=str(path))


def parse_spec(raw: Any, overrides: list[str] | None = None, source: str = "spec") -> JobSpec:
    """Validate a spec given as a mapping (e.g. from a notebook), after applying overrides."""
    if isinstance(raw, JobSpec):
        raw = raw.model_dump(mode="json", exclude_none=True)
    if not isinstance(raw, dict):
        raise SpecError([f"spec: top level must be a mapping of sections, got {type(raw).__name__} — see examples/"], source)
    raw = _deep_copy(raw)
    problems: list[str] = []
    for item in overrides or []:
        try:
            _apply_override(raw, item)
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise SpecError(problems, source)
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as e:
        raise SpecError([_format_error(err) for err in e.errors()], source) from None


def dump_spec(spec: JobSpec) -> str:
    """The resolved spec as YAML (defaults filled in), as written to job.yaml and the ConfigMap."""
    return yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)


def _deep_copy(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _deep_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_deep_copy(v) for v in obj]
    return obj


def _apply_override(raw: dict, item: str) -> None:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. --set training.epochs=2")
    parts = key.strip().split(".")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
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


def _format_error(err: dict) -> str:
    loc = [str(p) for p in err["loc"]]
    # A key typed by the user may hold anything (newlines, spaces): quote it so the
    # problem stays one readable line.
    field = ".".join(p if p.isidentifier() or p.isdigit() else repr(p) for p in loc) or "spec"
    kind = err["type"]
    got = err.get("input")
    if kind == "extra_forbidden":
        hint = _suggest(loc)
        fix = f"did you mean '{hint}'?" if hint else "remove it (see `kubetune validate --help` for the schema)"
        return f"{field}: unknown key — {fix}"
    if kind == "missing":
        desc = _describe(loc)
        return f"{field}: required but missing — add it{': ' + desc if desc else ''}"
    msg = err["msg"].removeprefix("Value error, ")
    if field == "spec" or not loc:
        return f"spec: {msg}"
    if kind == "value_error":  # our own validators already say what to do
        return f"{field}: {msg} (got {_short(got)})"
    return f"{field}: {msg} (got {_short(got)}) — {_fix_for(loc)}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _model_at(loc: list[str]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = JobSpec
    for part in loc:
        if model is None:
            return None
        field = model.model_fields.get(part)
        if field is None:
            return None
        model = _submodel(field.annotation)
    return model


def _submodel(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _suggest(loc: list[str]) -> str | None:
    parent = _model_at(loc[:-1])
    if parent is None:
        return None
    match = difflib.get_close_matches(loc[-1], list(parent.model_fields), n=1, cutoff=0.6)
    return ".".join(loc[:-1] + match) if match else None


def _describe(loc: list[str]) -> str:
    parent = _model_at(loc[:-1])
    field = parent.model_fields.get(loc[-1]) if parent else None
    return (field.description or "") if field else ""


def _fix_for(loc: list[str]) -> str:
    desc = _describe(loc)
    return f"expected: {desc}" if desc else "see the schema in README.md"


def field_reference() -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, help) for every spec field, in schema order."""
    from pydantic_core import PydanticUndefined

    rows: list[tuple[str, str, str, str]] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            sub = _submodel(field.annotation)
            if field.default is PydanticUndefined and field.default_factory is None:
                default = "(required)"
            elif field.default_factory is not None:
                default = "(section)"
            else:
                default = repr(field.default) if field.default is not None else "null"
            type_ = "section" if sub else _type_name(field.annotation)
            rows.append((prefix + name, type_, default, field.description or ""))
            if sub is not None:
                walk(sub, f"{prefix}{name}.")

    walk(JobSpec, "")
    return rows


def _type_name(annotation: Any) -> str:
    import typing

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
