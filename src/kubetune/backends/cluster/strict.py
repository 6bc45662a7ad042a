"""Strict validation of rendered objects against the official typed models.

The API server rejects unknown fields only with ``--validate=strict`` against live OpenAPI
schemas, which needs a cluster. These walkers check the same thing offline from the models the
manifests were built with: every key must be a field of its model and every value of its type.
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any

_GENERIC = re.compile(r"^(list)\[(.+)\]$|^(dict)\(str, (.+)\)$")

# kind → (OpenAPI-generator model class name, module) for the objects we render
_KINDS = {
    "ConfigMap": "V1ConfigMap",
    "PersistentVolumeClaim": "V1PersistentVolumeClaim",
    "Deployment": "V1Deployment",
    "Service": "V1Service",
    "PyTorchJob": "KubeflowOrgV1PyTorchJob",
}


def validate(obj: dict) -> list[str]:
    """Every problem in one rendered object (``[]`` when it is valid)."""
    kind = obj.get("kind")
    if kind == "TrainJob":
        from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

        return _check_pydantic(obj, TrainerV1alpha1TrainJob, kind)
    if kind not in _KINDS:
        return [f"{kind}: no typed model to validate against"]
    return _check_openapi(obj, _KINDS[kind], kind)


def check_model(value: Any, type_name: str, path: str) -> list[str]:
    """Problems in ``value`` (a serialized, camelCase object) as the typed model ``type_name``
    (e.g. ``V1Affinity``) sees it: unknown fields and wrong types."""
    return _check_openapi(value, type_name, path)


def _openapi_class(name: str):
    from kubeflow.training import models as kf
    from kubernetes.client import models as k8s

    return getattr(k8s, name, None) or getattr(kf, name, None)


def _check_openapi(value: Any, type_name: str, path: str) -> list[str]:
    m = _GENERIC.match(type_name)
    if m and m.group(1):
        if not isinstance(value, list):
            return [f"{path}: expected a list, got {type(value).__name__}"]
        return [p for i, v in enumerate(value) for p in _check_openapi(v, m.group(2), f"{path}[{i}]")]
    if m and m.group(3):
        if not isinstance(value, dict):
            return [f"{path}: expected a mapping, got {type(value).__name__}"]
        return [p for k, v in value.items() for p in _check_openapi(v, m.group(4), f"{path}.{k}")]
    scalars: dict[str, type | tuple[type, ...]] = {"str": str, "int": int, "bool": bool, "float": (int, float)}
    scalar = scalars.get(type_name)
    if scalar is not None:
        ok = isinstance(value, scalar) and not (type_name == "int" and isinstance(value, bool))
        return [] if ok else [f"{path}: expected {type_name}, got {value!r}"]
    if type_name in ("object", "datetime", "date"):
        return []
    cls = _openapi_class(type_name)
    if cls is None:
        return [f"{path}: unknown model {type_name}"]
    if not isinstance(value, dict):
        return [f"{path}: expected an object ({type_name}), got {type(value).__name__}"]
    by_json = {j: a for a, j in cls.attribute_map.items()}
    problems = []
    for key, v in value.items():
        attr = by_json.get(key)
        if attr is None:
            problems.append(f"{path}.{key}: unknown field for {type_name}")
            continue
        problems += _check_openapi(v, cls.openapi_types[attr], f"{path}.{key}")
    return problems


def _check_pydantic(value: Any, annotation: Any, path: str) -> list[str]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return [] if value is None else _check_pydantic(value, args[0], path)
    if origin is list:
        if not isinstance(value, list):
            return [f"{path}: expected a list"]
        (item,) = typing.get_args(annotation)
        return [p for i, v in enumerate(value) for p in _check_pydantic(v, item, f"{path}[{i}]")]
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{path}: expected a mapping"]
        _, item = typing.get_args(annotation)
        return [p for k, v in value.items() for p in _check_pydantic(v, item, f"{path}.{k}")]
    fields = getattr(annotation, "model_fields", None)
    if fields is None:
        return []  # scalars: the model's own validation (from_dict) checked them
    if "actual_instance" in fields:  # an OpenAPI oneOf wrapper, e.g. Quantity = float | str
        ok = isinstance(value, (str, int, float)) and not isinstance(value, bool)
        return [] if ok else [f"{path}: expected a {annotation.__name__} (string or number), got {value!r}"]
    if not isinstance(value, dict):
        return [f"{path}: expected an object ({annotation.__name__})"]
    by_alias = {(f.alias or name): f for name, f in fields.items()}
    problems = []
    for key, v in value.items():
        field = by_alias.get(key)
        if field is None:
            problems.append(f"{path}.{key}: unknown field for {annotation.__name__}")
        else:
            problems += _check_pydantic(v, field.annotation, f"{path}.{key}")
    return problems
