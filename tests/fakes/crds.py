"""What a kube-apiserver does with a custom resource on create, driven by the real upstream CRD.

No kube-apiserver can run on this machine, so this module does its CRD work for the tests and for
the fake API server (tests/fakes/kube_api.py): given a CustomResourceDefinition copied unchanged
from upstream (tests/data/kubeflow-crds/, see its README), it

- prunes fields the structural schema does not know (what the real server does silently; the
  fields are reported, so a test can call them errors),
- validates the rest against the openAPIV3Schema (types, int-or-string, required, enum, pattern,
  lengths, bounds, formats, list-map keys, anyOf),
- evaluates the CEL ``x-kubernetes-validations`` rules with cel-python (transition rules, which
  use ``oldSelf``, do not run on create, as on a real server),
- and checks ObjectMeta as the server does for every object (DNS-1123 subdomain name, label keys
  and values, annotation size).

Messages follow the apiserver's field.Error wording (``spec.x: Invalid value: ...``). Why our own
walker: jsonschema knows neither pruning nor the Kubernetes extensions, and pruning is the very
thing the tests must see. Standard library + PyYAML + cel-python.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

CRD_DIR = Path(__file__).resolve().parents[1] / "data" / "kubeflow-crds"
CRD_FILES = {
    ("pytorchjobs", "v1.8.1"): CRD_DIR / "pytorchjobs-v1.8.1.yaml",
    ("pytorchjobs", "v1.9.0"): CRD_DIR / "pytorchjobs-v1.9.0.yaml",
    ("trainjobs", "v2.3.0"): CRD_DIR / "trainer-v2.3.0" / "trainer.kubeflow.org_trainjobs.yaml",
    ("clustertrainingruntimes", "v2.3.0"): CRD_DIR
    / "trainer-v2.3.0"
    / "trainer.kubeflow.org_clustertrainingruntimes.yaml",
}
RUNTIMES_DIR = CRD_DIR / "trainer-v2.3.0" / "runtimes"
# KServe (tests/data/kserve-crds/, see its README): the InferenceService `kubetune render --serve` makes.
KSERVE_DIR = Path(__file__).resolve().parents[1] / "data" / "kserve-crds" / "v0.20.0"
CRD_FILES.update(
    {
        (plural, "v0.20.0"): KSERVE_DIR / f"serving.kserve.io_{plural}.yaml"
        for plural in ("inferenceservices", "servingruntimes", "clusterservingruntimes")
    }
)

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
_TOTAL_ANNOTATION_BYTES = 256 * 1024


def _q(value: Any) -> str:
    """A value as the apiserver quotes it in messages."""
    return json.dumps(value) if not isinstance(value, (dict, list)) else json.dumps(value, sort_keys=True)[:200]


def _type_of(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "null"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# ------------------------------------------------------------------------------------------- metadata


def _label_errors(value: str, pattern: re.Pattern, rule: str) -> list[str]:
    """apimachinery's IsDNS1123Label / IsDNS1035Label: at most 63 characters, and the pattern."""
    return (["must be no more than 63 characters"] if len(value) > 63 else []) + (
        [] if pattern.match(value) else [rule]
    )


def dns1123_label_errors(value: str) -> list[str]:
    return _label_errors(
        value,
        _DNS1123_LABEL,
        "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
        "and must start and end with an alphanumeric character",
    )


def dns1035_label_errors(value: str) -> list[str]:
    return _label_errors(
        value,
        _DNS1035_LABEL,
        "a DNS-1035 label must consist of lower case alphanumeric characters or '-', "
        "start with an alphabetic character, and end with an alphanumeric character",
    )


def qualified_name_errors(key: str) -> list[str]:
    """Label and annotation keys: an optional DNS subdomain prefix and a name (k8s IsQualifiedName)."""
    prefix, _, name = key.rpartition("/")
    out = []
    if "/" in key and not prefix:
        out.append("prefix part must be non-empty")
    if prefix and (len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix)):
        out.append(
            "prefix part a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.'"
        )
    if not name or len(name) > 63 or not _QUALIFIED_NAME.match(name):
        out.append(
            "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (63 characters at most)"
        )
    return out


def object_meta_errors(meta: dict, namespaced: bool) -> list[str]:
    """ObjectMeta checks every object gets (apimachinery ValidateObjectMeta), names as for CRs."""
    errs = []
    name = meta.get("name") or ""
    if name and (len(name) > 253 or not _DNS1123_SUBDOMAIN.match(name)):
        errs.append(
            f"metadata.name: Invalid value: {_q(name)}: a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character"
        )
    ns = meta.get("namespace")
    if namespaced and ns:
        errs += [f"metadata.namespace: Invalid value: {_q(ns)}: {e}" for e in dns1123_label_errors(ns)]
    for key, value in (meta.get("labels") or {}).items():
        errs += [f"metadata.labels: Invalid value: {_q(key)}: {e}" for e in qualified_name_errors(key)]
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            errs.append(
                f"metadata.labels: Invalid value: {_q(value)}: a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (63 characters at most)"
            )
    annotations = meta.get("annotations") or {}
    for key in annotations:
        errs += [f"metadata.annotations: Invalid value: {_q(key)}: {e}" for e in qualified_name_errors(key)]
    if sum(len(k) + len(str(v)) for k, v in annotations.items()) > _TOTAL_ANNOTATION_BYTES:
        errs.append("metadata.annotations: Too long: must have at most 262144 bytes")
    return errs


# --------------------------------------------------------------------------------------------- schema


@dataclass
class Outcome:
    """What the server makes of one object: the object it would store, and why it would refuse."""

    stored: dict
    errors: list[str] = field(default_factory=list)
    pruned: list[str] = field(default_factory=list)  # paths of unknown fields the server drops


class CRD:
    """One served version of a CustomResourceDefinition, read from its upstream YAML."""

    def __init__(self, doc: dict, version: str | None = None):
        self.doc = doc
        spec = doc["spec"]
        self.group = spec["group"]
        self.kind = spec["names"]["kind"]
        self.plural = spec["names"]["plural"]
        self.namespaced = spec["scope"] == "Namespaced"
        versions = [v for v in spec["versions"] if v.get("served")]
        chosen = (
            next((v for v in versions if v["name"] == version), None)
            if version
            else next(v for v in versions if v.get("storage"))
        )
        if chosen is None:
            raise ValueError(f"{self.plural}.{self.group} does not serve {version}")
        self.version = chosen["name"]
        self.schema = chosen["schema"]["openAPIV3Schema"]

    @classmethod
    def load(cls, path: str | Path, version: str | None = None) -> CRD:
        # libyaml's loader where PyYAML has it: the InferenceService CRD is 2 MB (6 s in pure Python)
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        docs = [d for d in yaml.load_all(Path(path).read_text(), Loader=loader) if d]
        return cls(docs[0], version)

    @property
    def qualified_kind(self) -> str:
        return f"{self.kind}.{self.group}"

    def without(self, *paths: str) -> CRD:
        """A copy whose schema lacks the given properties (dotted paths through `properties`,
        `[]` for array items): an older release that never had them, derived from this one."""
        doc = copy.deepcopy(self.doc)
        clone = CRD(doc, self.version)
        for path in paths:
            node = clone.schema
            parts = path.split(".")
            for part in parts[:-1]:
                node = node["items"] if part == "[]" else node["properties"][part]
            node["properties"].pop(parts[-1])
        return clone

    def admit(self, obj: dict, *, old: dict | None = None) -> Outcome:
        """Prune, validate the schema, run CEL, check metadata: the apiserver's create path."""
        stored = copy.deepcopy(obj)
        pruned: list[str] = []
        # apiVersion, kind and metadata are the server's, never pruned by the CRD schema
        for key in list(stored):
            if key not in ("apiVersion", "kind", "metadata") and key not in (self.schema.get("properties") or {}):
                pruned.append(key)
                del stored[key]
        errors: list[str] = []
        for key, sub in (self.schema.get("properties") or {}).items():
            if key in ("apiVersion", "kind", "metadata") or key not in stored:
                continue
            stored[key] = _prune(stored[key], sub, key, pruned)
            _validate(stored[key], sub, key, errors)
        errors += object_meta_errors(stored.get("metadata") or {}, self.namespaced)
        if not errors:  # CEL runs on a schema-valid object, as on the server
            _run_rules(stored, self.schema, "", errors, old)
        return Outcome(stored, errors, pruned)


def _prune(value: Any, schema: dict, path: str, pruned: list[str]) -> Any:
    if (
        schema.get("x-kubernetes-preserve-unknown-fields")
        and "properties" not in schema
        and "additionalProperties" not in schema
    ):
        return value
    if isinstance(value, dict) and (
        schema.get("type") == "object" or "properties" in schema or "additionalProperties" in schema
    ):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        out = {}
        for key, sub_value in value.items():
            sub_path = _join(path, key)
            if props is not None and key in props:
                out[key] = _prune(sub_value, props[key], sub_path, pruned)
            elif isinstance(extra, dict):
                out[key] = _prune(sub_value, extra, sub_path, pruned)
            elif extra is True or schema.get("x-kubernetes-preserve-unknown-fields"):
                out[key] = sub_value
            elif props is None and extra is None and schema.get("x-kubernetes-embedded-resource"):
                out[key] = sub_value
            else:
                pruned.append(sub_path)
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_prune(v, schema["items"], f"{path}[{i}]", pruned) for i, v in enumerate(value)]
    return value


def _type_errors(value: Any, schema: dict, path: str) -> list[str]:
    if schema.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            return [
                f'{path}: Invalid value: "{_type_of(value)}": {path} in body must be of type int-or-string: {_q(value)}'
            ]
        return []
    want = schema.get("type")
    if want is None:
        return []
    got = _type_of(value)
    if got == "null" and schema.get("nullable"):
        return []
    if want == got or (want == "number" and got == "integer"):
        return []
    return [f'{path}: Invalid value: "{got}": {path} in body must be of type {want}: {_q(value)}']


def _validate(value: Any, schema: dict, path: str, errors: list[str]) -> None:
    type_errors = _type_errors(value, schema, path)
    if type_errors:
        errors += type_errors
        return
    if value is None:
        return
    if "enum" in schema and value not in schema["enum"]:
        supported = ", ".join(_q(v) for v in schema["enum"])
        errors.append(f"{path}: Unsupported value: {_q(value)}: supported values: {supported}")
    if isinstance(value, str):
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{path}: Invalid value: {_q(value)}: {path} in body should match '{schema['pattern']}'")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(f"{path}: Too long: may not be more than {schema['maxLength']} bytes")
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(
                f"{path}: Invalid value: {_q(value)}: {path} in body should be at least {schema['minLength']} chars long"
            )
        if schema.get("format") == "date-time":
            try:
                datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                errors.append(
                    f"{path}: Invalid value: {_q(value)}: {path} in body must be of type date-time: {_q(value)}"
                )
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        low_high = _INT_RANGES.get(schema.get("format", ""))
        if low_high and isinstance(value, int) and not low_high[0] <= value <= low_high[1]:
            errors.append(f"{path}: Invalid value: {value}: {path} in body must be of type {schema['format']}")
        if "minimum" in schema and (
            value <= schema["minimum"] if schema.get("exclusiveMinimum") else value < schema["minimum"]
        ):
            errors.append(
                f"{path}: Invalid value: {value}: {path} in body should be greater than or equal to {schema['minimum']}"
            )
        if "maximum" in schema and (
            value >= schema["maximum"] if schema.get("exclusiveMaximum") else value > schema["maximum"]
        ):
            errors.append(
                f"{path}: Invalid value: {value}: {path} in body should be less than or equal to {schema['maximum']}"
            )
    if "anyOf" in schema and not schema.get("x-kubernetes-int-or-string"):
        if not any(not _collect(value, sub, path) for sub in schema["anyOf"]):
            errors.append(f"{path}: Invalid value: {_q(value)}: {path} in body must match at least one schema in anyOf")
    if isinstance(value, dict):
        for key in schema.get("required") or []:
            if key not in value:
                errors.append(f"{_join(path, key)}: Required value")
        if "minProperties" in schema and len(value) < schema["minProperties"]:
            errors.append(
                f"{path}: Invalid value: {len(value)}: {path} in body should have at least {schema['minProperties']} properties"
            )
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:
            errors.append(f"{path}: Too many: {len(value)}: must have at most {schema['maxProperties']} items")
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, sub_value in value.items():
            sub = props.get(key) if key in props else (extra if isinstance(extra, dict) else None)
            if sub is not None:
                _validate(sub_value, sub, _join(path, key), errors)
    if isinstance(value, list):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(f"{path}: Too many: {len(value)}: must have at most {schema['maxItems']} items")
        if "minItems" in schema and len(value) < schema["minItems"]:
            errors.append(
                f"{path}: Invalid value: {len(value)}: {path} in body should have at least {schema['minItems']} items"
            )
        list_type = schema.get("x-kubernetes-list-type")
        if list_type == "set":
            seen = set()
            for i, v in enumerate(value):
                key = json.dumps(v, sort_keys=True)
                if key in seen:
                    errors.append(f"{path}[{i}]: Duplicate value: {_q(v)}")
                seen.add(key)
        elif list_type == "map":
            keys = schema.get("x-kubernetes-list-map-keys") or []
            seen = set()
            for i, v in enumerate(value):
                if isinstance(v, dict):
                    key = tuple(json.dumps(v.get(k)) for k in keys)
                    if key in seen:
                        errors.append(f"{path}[{i}]: Duplicate value: {_q({k: v.get(k) for k in keys})}")
                    seen.add(key)
        if isinstance(schema.get("items"), dict):
            for i, v in enumerate(value):
                _validate(v, schema["items"], f"{path}[{i}]", errors)


def _collect(value: Any, schema: dict, path: str) -> list[str]:
    out: list[str] = []
    _validate(value, schema, path, out)
    return out


# ------------------------------------------------------------------------------------------------ CEL

_PROGRAMS: dict[str, Any] = {}


def _program(rule: str):
    import celpy  # cel-python: the Common Expression Language the apiserver evaluates

    if rule not in _PROGRAMS:
        env = celpy.Environment()
        _PROGRAMS[rule] = env.program(env.compile(rule))
    return _PROGRAMS[rule]


def _run_rules(value: Any, schema: dict, path: str, errors: list[str], old: Any) -> None:
    import celpy

    for rule in schema.get("x-kubernetes-validations") or []:
        text = rule["rule"]
        if "oldSelf" in text and old is None:
            continue  # a transition rule: only on update
        activation = {"self": celpy.json_to_cel(value)}
        if old is not None:
            activation["oldSelf"] = celpy.json_to_cel(old)
        result = _program(text).evaluate(activation)
        if isinstance(result, Exception) or not bool(result):  # an evaluation error fails the rule too
            where = path or "<nil>"
            message = rule.get("message") or f"failed rule: {text}"
            errors.append(f'{where}: Invalid value: "object": {message}')
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, sub_value in value.items():
            sub = props.get(key) if key in props else (extra if isinstance(extra, dict) else None)
            if sub is not None:
                sub_old = old.get(key) if isinstance(old, dict) else None
                _run_rules(sub_value, sub, _join(path, key), errors, sub_old)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            _run_rules(v, schema["items"], f"{path}[{i}]", errors, None)


# ------------------------------------------------------------------------------------------- loading

# Trainer releases before v2.3.0, as the fields they lack: v2.0/v2.1 call runtimePatches
# podSpecOverrides/podTemplateOverrides; v2.2 has runtimePatches without the pod's
# terminationGracePeriodSeconds. Their CRDs are derived from v2.3.0 by removing those fields.
_POD_IN_PATCH = "spec.runtimePatches.[].trainingRuntimeSpec.template.spec.replicatedJobs.[].template.spec.template.spec"
TRAINER_RELEASES = {
    "v2.1.0": ("spec.runtimePatches",),
    "v2.2.0": (f"{_POD_IN_PATCH}.terminationGracePeriodSeconds",),
    "v2.3.0": (),
}


@functools.cache
def crd(plural: str, release: str) -> CRD:
    """The CRD of ``plural`` as ``release`` ships it, read once (shared: derive with ``without``,
    never change it). TrainJobs of a release before v2.3.0 are derived (``TRAINER_RELEASES``)."""
    if plural == "trainjobs" and release in TRAINER_RELEASES and release != "v2.3.0":
        return crd("trainjobs", "v2.3.0").without(*TRAINER_RELEASES[release])
    if (plural, release) not in CRD_FILES:
        raise ValueError(f"no upstream CRD for {plural} {release}; have {sorted(CRD_FILES)}")
    return CRD.load(CRD_FILES[(plural, release)])


@functools.cache
def _runtimes() -> tuple[dict, ...]:
    out: list[dict] = []
    for path in sorted(RUNTIMES_DIR.glob("*.yaml")):
        out += [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "ClusterTrainingRuntime"]
    return tuple(out)


def shipped_serving_runtimes() -> list[dict]:
    """The ClusterServingRuntimes of KServe v0.20.0's Hugging Face runtime (fresh copies)."""
    out: list[dict] = []
    for path in sorted((KSERVE_DIR / "runtimes").glob("kserve-*.yaml")):
        out += [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == "ClusterServingRuntime"]
    return out


def shipped_runtimes() -> list[dict]:
    """The ClusterTrainingRuntimes a default Trainer v2.3.0 install creates (copies: read once)."""
    return copy.deepcopy(list(_runtimes()))
