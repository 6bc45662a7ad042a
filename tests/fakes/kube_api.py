"""A FAKE of the Kubernetes API server, for tests.

No real kube-apiserver (nor etcd, kubelet or controllers) can run on this machine, so tests point the
official `kubernetes` Python client at this fake through a kubeconfig file. It speaks the real REST
protocol over real HTTP on 127.0.0.1, but implements only what kubetune uses: create (with
``dryRun=All``), get, list, replace, merge-patch and delete of a fixed set of resources, watches,
pod logs, the garbage collector's cascading delete, and RBAC-style 403 answers that a test asks for.

Kubeflow and KServe resources are admitted as a real cluster would admit them: the upstream CRD of
the release the fake "runs" (``operator=`` training-operator v1.8.1/v1.9.0, ``trainer=`` Trainer
v2.3.0, or v2.1.0/v2.2.0 derived from it by removing the fields those releases lack, ``kserve=``
KServe v0.20.0's InferenceService) prunes unknown fields and validates schema and CEL rules
(tests/fakes/crds.py), then the operators' and KServe's webhook rules run (tests/fakes/webhooks.py).
``operator=None``, ``trainer=None`` or ``kserve=None`` (the default: KServe is opt-in) serves no such
CRD. A cluster with Trainer serves the ClusterTrainingRuntimes a default v2.3.0 install creates.

Nothing runs pods: a test drives object status and container logs through the control methods
(put, set_status, append_log, ...). Standard library, PyYAML and cel-python.
"""

from __future__ import annotations

import bisect
import copy
import json
import re
import socket
import socketserver
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any, Self
from urllib.parse import parse_qs, urlsplit

from fakes.crds import TRAINER_RELEASES

Obj = dict[str, Any]

DEFAULT_USER = "system:serviceaccount:team-a:jupyter"
VERBS = frozenset({"create", "get", "list", "watch", "update", "patch", "delete"})
TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


@dataclass(frozen=True)
class Resource:
    group_version: str  # "v1" for the core group
    plural: str
    kind: str
    has_status: bool  # a /status subresource: writes to the main resource leave .status alone
    returns_object_on_delete: bool = False  # pods, services and PVCs answer DELETE with the object
    namespaced: bool = True

    @property
    def group(self) -> str:
        return self.group_version.rpartition("/")[0]

    @property
    def qualified(self) -> str:
        """The name the apiserver uses in messages: `configmaps`, `pytorchjobs.kubeflow.org`."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def builtin(self) -> bool:
        # custom resources do not accept strategic merge patches
        return self.group in ("", "apps")


RESOURCES: dict[tuple[str, str], Resource] = {
    (r.group_version, r.plural): r
    for r in (
        Resource("v1", "configmaps", "ConfigMap", has_status=False),
        Resource(
            "v1", "persistentvolumeclaims", "PersistentVolumeClaim", has_status=True, returns_object_on_delete=True
        ),
        Resource("v1", "secrets", "Secret", has_status=False),
        Resource("v1", "serviceaccounts", "ServiceAccount", has_status=False),
        Resource("v1", "services", "Service", has_status=True, returns_object_on_delete=True),
        Resource("v1", "pods", "Pod", has_status=True, returns_object_on_delete=True),
        Resource("v1", "events", "Event", has_status=False),
        Resource("apps/v1", "deployments", "Deployment", has_status=True),
        Resource("kubeflow.org/v1", "pytorchjobs", "PyTorchJob", has_status=True),
        Resource("trainer.kubeflow.org/v1alpha1", "trainjobs", "TrainJob", has_status=True),
        Resource("serving.kserve.io/v1beta1", "inferenceservices", "InferenceService", has_status=True),
        Resource("kubeflow.org/v1beta1", "experiments", "Experiment", has_status=True),
        Resource(
            "trainer.kubeflow.org/v1alpha1",
            "clustertrainingruntimes",
            "ClusterTrainingRuntime",
            has_status=False,
            namespaced=False,
        ),
    )
}
PODS = RESOURCES[("v1", "pods")]
PYTORCHJOBS = RESOURCES[("kubeflow.org/v1", "pytorchjobs")]
TRAINJOBS = RESOURCES[("trainer.kubeflow.org/v1alpha1", "trainjobs")]
RUNTIMES = RESOURCES[("trainer.kubeflow.org/v1alpha1", "clustertrainingruntimes")]
INFERENCESERVICES = RESOURCES[("serving.kserve.io/v1beta1", "inferenceservices")]
EXPERIMENTS = RESOURCES[("kubeflow.org/v1beta1", "experiments")]
OPERATOR_RELEASES = ("v1.8.1", "v1.9.0")
KSERVE_RELEASES = ("v0.20.0",)
KATIB_RELEASES = ("v0.19.0",)
KATIB_WEBHOOK = "validator.experiment.katib.kubeflow.org"


def resource(group_version: str, plural: str) -> Resource:
    try:
        return RESOURCES[(group_version, plural)]
    except KeyError:
        raise ValueError(f"the fake does not serve {plural} in {group_version}") from None


# ---------------------------------------------------------------------------------------------- errors

_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


class ApiError(Exception):
    """An error answer, carried as the apiserver's Status object."""

    def __init__(self, code: int, message: str, reason: str | None = None, details: Obj | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason if reason is not None else _REASONS.get(code, "")
        self.details = details

    def status(self) -> Obj:
        body: Obj = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
        }
        if self.details:
            body["details"] = self.details
        body["code"] = self.code
        return body


def _aggregate(errors: list[str]) -> str:
    """apimachinery's aggregate error text: one error as is, several in brackets."""
    return errors[0] if len(errors) == 1 else f"[{', '.join(errors)}]"


def _details(res: Resource, name: str) -> Obj:
    # Go's omitempty drops an empty name and the core group's empty group
    return {k: v for k, v in (("name", name), ("group", res.group), ("kind", res.plural)) if v}


def _not_found(res: Resource, name: str) -> ApiError:
    return ApiError(404, f'{res.qualified} "{name}" not found', "NotFound", _details(res, name))


def _already_exists(res: Resource, name: str) -> ApiError:
    return ApiError(409, f'{res.qualified} "{name}" already exists', "AlreadyExists", _details(res, name))


def _stale(res: Resource, name: str) -> ApiError:
    return ApiError(
        409,
        f'Operation cannot be fulfilled on {res.qualified} "{name}": the object has been modified; '
        "please apply your changes to the latest version and try again",
        "Conflict",
        _details(res, name),
    )


def _forbidden(res: Resource, subresource: str | None, name: str, verb: str, namespace: str, user: str) -> ApiError:
    target = f'{res.qualified} "{name}"' if name else res.qualified
    rbac_resource = f"{res.plural}/{subresource}" if subresource else res.plural
    return ApiError(
        403,
        f'{target} is forbidden: User "{user}" cannot {verb} resource "{rbac_resource}" '
        f'in API group "{res.group}" in the namespace "{namespace}"',
        "Forbidden",
        _details(res, name),
    )


def _unknown_path() -> ApiError:
    return ApiError(404, "the server could not find the requested resource", "NotFound")


# ------------------------------------------------------------------------------------------- selectors

_FIELD_PATHS = ("metadata.name", "metadata.namespace")


@dataclass(frozen=True)
class _Requirement:
    key: str
    op: str  # "=", "!=", "exists", "!exists"
    value: str = ""

    def matches(self, actual: str | None) -> bool:
        if self.op == "exists":
            return actual is not None
        if self.op == "!exists":
            return actual is None
        return (actual == self.value) == (self.op == "=")


def _parse_requirements(text: str, *, existence: bool) -> tuple[_Requirement, ...]:
    """Equality (`a=b`, `a==b`, `a!=b`) and, for labels, existence (`a`, `!a`) terms."""
    requirements = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        if "(" in term:
            raise ApiError(
                400, f"unable to parse requirement: set-based selector {term!r} is not supported by this fake"
            )
        for token, op in (("!=", "!="), ("==", "="), ("=", "=")):
            if token in term:
                key, _, value = term.partition(token)
                requirements.append(_Requirement(key.strip(), op, value.strip()))
                break
        else:
            if not existence:
                raise ApiError(400, f"invalid selector: {term!r}; can't understand '{term}'")
            negated = term.startswith("!")
            requirements.append(_Requirement(term.lstrip("!").strip(), "!exists" if negated else "exists"))
    return tuple(requirements)


@dataclass(frozen=True)
class Selector:
    labels: tuple[_Requirement, ...] = ()
    fields: tuple[_Requirement, ...] = ()

    @classmethod
    def from_query(cls, query: dict[str, str]) -> Selector:
        fields = _parse_requirements(query.get("fieldSelector", ""), existence=False)
        for req in fields:
            if req.key not in _FIELD_PATHS:
                raise ApiError(
                    400, f'"{req.key}" is not a known field selector: only "metadata.name", "metadata.namespace"'
                )
        return cls(_parse_requirements(query.get("labelSelector", ""), existence=True), fields)

    def matches(self, obj: Obj) -> bool:
        meta = obj.get("metadata") or {}
        labels = meta.get("labels") or {}
        return all(r.matches(labels.get(r.key)) for r in self.labels) and all(
            r.matches(meta.get(r.key.split(".", 1)[1])) for r in self.fields
        )


# ----------------------------------------------------------------------------------------------- store


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    merged = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = _merge_patch(merged.get(key), value)
    return merged


def _owner_uids(obj: Obj) -> set[str]:
    return {ref.get("uid", "") for ref in obj["metadata"].get("ownerReferences") or []}


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


_Key = tuple[Resource, str, str]  # (resource, namespace, name)


@dataclass(frozen=True)
class _Event:
    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    resource: Resource
    namespace: str
    obj: Obj  # never mutated after the event is recorded


@dataclass
class _Store:
    """Objects, the event history that watches replay, and container logs, behind one Condition.

    Stored dicts are replaced, never mutated, so events can share them; callers get deep copies.
    Every change bumps the global resourceVersion and wakes all waiting streams.
    """

    cond: threading.Condition = field(default_factory=threading.Condition)
    stopping: bool = False
    rv: int = 0
    objects: dict[_Key, Obj] = field(default_factory=dict)
    events: list[_Event] = field(default_factory=list)
    logs: dict[tuple[str, str, str], list[str]] = field(default_factory=dict)

    # -- reads

    def get(self, res: Resource, namespace: str, name: str) -> Obj:
        with self.cond:
            return copy.deepcopy(self._require(res, namespace, name))

    def select(self, res: Resource, namespace: str, selector: Selector) -> tuple[list[Obj], int]:
        with self.cond:
            items = [
                copy.deepcopy(obj)
                for (r, ns, _), obj in sorted(self.objects.items(), key=lambda kv: kv[0][2])
                if r == res and ns == namespace and selector.matches(obj)
            ]
            return items, self.rv

    def _require(self, res: Resource, namespace: str, name: str) -> Obj:
        obj = self.objects.get((res, namespace, name))
        if obj is None:
            raise _not_found(res, name)
        return obj

    # -- writes

    def create(self, res: Resource, namespace: str, body: Obj, dry_run: bool = False) -> Obj:
        meta = dict(body.get("metadata") or {})
        if meta.get("namespace", namespace) != namespace:
            raise ApiError(400, "the namespace of the provided object does not match the namespace sent on the request")
        name = meta.get("name") or (meta["generateName"] + uuid.uuid4().hex[:5] if meta.get("generateName") else "")
        if not name:
            kind = f"{res.kind}.{res.group}" if res.group else res.kind
            raise ApiError(
                422, f'{kind} "" is invalid: metadata.name: Required value: name or generateName is required'
            )
        with self.cond:
            if (res, namespace, name) in self.objects:
                raise _already_exists(res, name)
            meta.pop("resourceVersion", None)
            meta.update(name=name, namespace=namespace, uid=str(uuid.uuid4()), creationTimestamp=_now())
            obj = {**body, "apiVersion": res.group_version, "kind": res.kind, "metadata": meta}
            if not res.namespaced:
                meta.pop("namespace", None)
            if res.has_status:
                # a create never sets status; the pod strategy starts every pod Pending
                obj.pop("status", None)
                if res == PODS:
                    obj["status"] = {"phase": "Pending"}
            if dry_run:  # everything a create does, nothing stored
                return copy.deepcopy(obj)
            return self._commit(res, namespace, obj, "ADDED")

    def update(self, res: Resource, namespace: str, name: str, body: Obj, subresource: str | None) -> Obj:
        if (body.get("metadata") or {}).get("name") != name:
            got = (body.get("metadata") or {}).get("name")
            raise ApiError(400, f"the name of the object ({got}) does not match the name on the URL ({name})")
        with self.cond:
            return self._write(res, namespace, name, body, subresource)

    def patch(self, res: Resource, namespace: str, name: str, patch: Obj, subresource: str | None) -> Obj:
        with self.cond:
            merged = _merge_patch(self._require(res, namespace, name), patch)
            return self._write(res, namespace, name, merged, subresource)

    def _write(self, res: Resource, namespace: str, name: str, body: Obj, subresource: str | None) -> Obj:
        old = self._require(res, namespace, name)
        wanted_rv = (body.get("metadata") or {}).get("resourceVersion")
        if wanted_rv and wanted_rv != old["metadata"]["resourceVersion"]:
            raise _stale(res, name)
        if subresource == "status":
            new = {**old, "status": copy.deepcopy(body.get("status"))}
        else:
            new = copy.deepcopy(body)
            if res.has_status:
                new["status"] = old.get("status")
            identity = {k: old["metadata"][k] for k in ("name", "namespace", "uid", "creationTimestamp")}
            new["metadata"] = {**(body.get("metadata") or {}), **identity}
        if new.get("status") is None:
            new.pop("status", None)
        new.update(apiVersion=res.group_version, kind=res.kind)
        new["metadata"] = dict(new["metadata"])  # _commit stamps resourceVersion on it
        return self._commit(res, namespace, new, "MODIFIED")

    def delete(self, res: Resource, namespace: str, name: str, cascade: bool) -> Obj:
        with self.cond:
            gone = self._remove((res, namespace, name), self._require(res, namespace, name))
            if cascade:
                self._collect_dependents(namespace, gone["metadata"]["uid"])
            return gone

    def _remove(self, key: _Key, obj: Obj) -> Obj:
        return self._commit(key[0], key[1], {**obj, "metadata": dict(obj["metadata"])}, "DELETED")

    def _collect_dependents(self, namespace: str, owner_uid: str) -> None:
        """What the garbage collector does after a background delete: remove every object in the
        namespace that the deleted one owned and that has no other live owner, then their dependents."""
        pending = [owner_uid]
        while pending:
            gone = pending.pop()
            live = {o["metadata"]["uid"] for (_, ns, _), o in self.objects.items() if ns == namespace}
            for key, obj in list(self.objects.items()):
                owners = _owner_uids(obj)
                if key[1] == namespace and gone in owners and not owners & live:
                    pending.append(self._remove(key, obj)["metadata"]["uid"])

    def put(self, res: Resource, namespace: str, obj: Obj) -> Obj:
        new = copy.deepcopy(obj)
        meta = new.setdefault("metadata", {})
        with self.cond:
            old = self.objects.get((res, namespace, meta["name"]))
            if res.namespaced:
                meta["namespace"] = namespace
            meta.setdefault("uid", old["metadata"]["uid"] if old else str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", old["metadata"]["creationTimestamp"] if old else _now())
            new.update(apiVersion=res.group_version, kind=res.kind)
            return self._commit(res, namespace, new, "MODIFIED" if old else "ADDED")

    def set_status(self, res: Resource, namespace: str, name: str, status: Obj) -> Obj:
        with self.cond:
            old = self._require(res, namespace, name)
            new = {**old, "metadata": dict(old["metadata"]), "status": copy.deepcopy(status)}
            return self._commit(res, namespace, new, "MODIFIED")

    def _commit(self, res: Resource, namespace: str, obj: Obj, event_type: str) -> Obj:
        """Record a change; the caller holds the lock and hands over a dict nobody else references."""
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        key = (res, namespace, obj["metadata"]["name"])
        if event_type == "DELETED":
            del self.objects[key]
        else:
            self.objects[key] = obj
        self.events.append(_Event(self.rv, event_type, res, namespace, obj))
        self.cond.notify_all()
        return copy.deepcopy(obj)

    def append_log(self, namespace: str, pod: str, container: str, lines: tuple[str, ...]) -> None:
        with self.cond:
            self.logs.setdefault((namespace, pod, container), []).extend(lines)
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()

    # -- streams

    def initial_events(self, res: Resource, namespace: str, selector: Selector) -> tuple[list[tuple[str, Obj]], int]:
        """What a watch without a resourceVersion starts with: ADDED for every existing match."""
        items, rv = self.select(res, namespace, selector)
        return [("ADDED", obj) for obj in items], rv

    def wait_events(
        self, res: Resource, namespace: str, selector: Selector, cursor: int, deadline: float | None
    ) -> tuple[list[tuple[str, Obj]], int, bool]:
        """Block until something changes after `cursor`, the deadline passes or the server stops.
        Returns the matching events, the new cursor, and whether the stream should end."""
        with self.cond:
            self.cond.wait_for(lambda: self.stopping or self.rv > cursor, timeout=_remaining(deadline))
            start = bisect.bisect_right(self.events, cursor, key=lambda e: e.rv)
            batch = [
                (e.type, e.obj)
                for e in self.events[start:]
                if e.resource == res and e.namespace == namespace and selector.matches(e.obj)
            ]
            ended = self.stopping or (deadline is not None and time.monotonic() >= deadline)
            return batch, self.rv, ended

    def log_container(self, namespace: str, pod: str, container: str | None) -> str:
        """The container a log request reads, chosen the way the kubelet's log endpoint does."""
        with self.cond:
            spec = self._require(PODS, namespace, pod).get("spec") or {}
        names = [c["name"] for c in spec.get("containers") or []]
        init_names = [c["name"] for c in spec.get("initContainers") or []]
        if container is not None:
            if container not in names + init_names:
                raise ApiError(400, f"container {container} is not valid for pod {pod}")
            return container
        if len(names) == 1:
            return names[0]
        raise ApiError(400, f"a container name must be specified for pod {pod}, choose one of: [{' '.join(names)}]")

    def read_log(
        self, namespace: str, pod: str, container: str, cursor: int, block: bool
    ) -> tuple[list[str], int, bool]:
        """Lines after `cursor`, waiting for some if `block`. The log ends once the pod has finished
        (Succeeded/Failed), is gone, or the server stops; lines appended before that are still returned."""
        with self.cond:
            # setdefault: the list must be the one later append_log calls extend
            lines = self.logs.setdefault((namespace, pod, container), [])

            def finished() -> bool:
                obj = self.objects.get((PODS, namespace, pod))
                return self.stopping or obj is None or (obj.get("status") or {}).get("phase") in TERMINAL_PHASES

            if block:
                self.cond.wait_for(lambda: len(lines) > cursor or finished())
            return lines[cursor:], len(lines), finished()


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _truthy(value: str | None) -> bool:
    # the values Go's strconv.ParseBool takes as true; the Python client sends "True"
    return value in ("1", "t", "T", "true", "TRUE", "True")


def _tail(lines: list[str], count: int | None) -> list[str]:
    return lines if count is None else lines[max(len(lines) - count, 0) :]


# ------------------------------------------------------------------------------------------------ HTTP

_PATH = re.compile(
    r"^/(?:api/(?P<core>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
    r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)(?:/(?P<name>[^/]+)(?:/(?P<sub>[^/]+))?)?$"
)
_MERGE_PATCH = "application/merge-patch+json"
_STRATEGIC_PATCH = "application/strategic-merge-patch+json"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive and chunked streams, as the client expects
    disable_nagle_algorithm = True  # headers and body go out in separate writes; Nagle would hold the body ~40 ms
    server: _HTTPServer

    def setup(self) -> None:
        super().setup()
        self.server.track(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.untrack(self.connection)

    def log_message(self, format: str, *args: Any) -> None:
        """Silent: tests assert on FakeKubeAPI.requests instead of reading an access log."""

    def do_GET(self) -> None:
        self._serve()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_GET

    # -- request handling

    def _serve(self) -> None:
        api = self.server.api
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        # read the body first so an error answer leaves the keep-alive connection in step
        self._raw_body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        api._record(self.command, url.path, query, self._raw_body)
        self._streaming = False
        try:
            api._admit(self.headers.get("Authorization"))
            self._route(url.path, query)
        except ApiError as err:
            self._send_json(err.code, err.status())
        except OSError:  # the client hung up mid-stream
            self.close_connection = True
        except Exception as exc:
            traceback.print_exc()
            if self._streaming:
                self.close_connection = True
            else:
                self._send_json(500, ApiError(500, f"fake apiserver failed: {exc!r}").status())
        if api._store.stopping:
            self.close_connection = True

    def _route(self, path: str, query: dict[str, str]) -> None:
        if path.rstrip("/") in ("/version", "/api", "/apis") and self.command == "GET":  # the client asks for /version/
            self._send_json(200, self.server.api._discovery(path.rstrip("/")))
            return
        match = _PATH.match(path)
        if match is None:
            raise _unknown_path()
        gv = match["core"] or f"{match['group']}/{match['version']}"
        res = RESOURCES.get((gv, match["plural"]))
        if res is None or not self.server.api._serves(res):
            raise _unknown_path()
        ns, name, sub = match["ns"] or "", match["name"], match["sub"]
        if res.namespaced != bool(ns):
            raise _unknown_path()
        verb = _verb(self.command, name, query)
        if sub is not None and not (
            (sub == "status" and res.has_status and verb in ("get", "update", "patch"))
            or (sub == "log" and res == PODS and verb == "get")
        ):
            raise _unknown_path()
        self.server.api._authorize(verb, res, sub, ns, name or "")
        self._dispatch(verb, res, ns, name, sub, query)

    def _dispatch(
        self, verb: str, res: Resource, ns: str, name: str | None, sub: str | None, query: dict[str, str]
    ) -> None:
        store = self.server.api._store
        if verb == "watch":
            self._watch(res, ns, query)
        elif verb == "list":
            items, rv = store.select(res, ns, Selector.from_query(query))
            self._send_json(
                200,
                {
                    "kind": f"{res.kind}List",
                    "apiVersion": res.group_version,
                    "metadata": {"resourceVersion": str(rv)},
                    "items": items,
                },
            )
        elif verb == "create":
            body, warnings = self.server.api._admit_create(res, ns, self._json_body())
            dry_run = query.get("dryRun")
            if dry_run not in (None, "All"):
                raise ApiError(400, f"Invalid dry run value: {dry_run}")
            created = store.create(res, ns, body, dry_run=dry_run == "All")
            self._send_json(201, created, warnings)
        else:
            assert name is not None  # _verb only gives the item verbs a name
            if verb == "get" and sub == "log":
                self._log(ns, name, query)
            elif verb == "get":
                self._send_json(200, store.get(res, ns, name))
            elif verb == "update":
                self._send_json(200, store.update(res, ns, name, self._json_body(), sub))
            elif verb == "patch":
                self._send_json(200, store.patch(res, ns, name, self._patch_body(res), sub))
            else:
                self._delete(res, ns, name, query)

    def _delete(self, res: Resource, ns: str, name: str, query: dict[str, str]) -> None:
        options = self._json_body() if self._raw_body else {}
        policy = query.get("propagationPolicy") or options.get("propagationPolicy") or "Background"
        gone = self.server.api._store.delete(res, ns, name, cascade=policy != "Orphan")
        if res.returns_object_on_delete:
            self._send_json(200, gone)
        else:
            details = {**_details(res, name), "uid": gone["metadata"]["uid"]}
            self._send_json(
                200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": details}
            )

    def _watch(self, res: Resource, ns: str, query: dict[str, str]) -> None:
        store = self.server.api._store
        selector = Selector.from_query(query)
        timeout = query.get("timeoutSeconds")
        deadline = time.monotonic() + float(timeout) if timeout else None
        since = query.get("resourceVersion", "")
        if since in ("", "0"):
            batch, cursor = store.initial_events(res, ns, selector)
        elif since.isdigit():
            batch, cursor = [], int(since)
        else:
            raise ApiError(400, f"invalid resource version: {since}")
        self._start_chunked("application/json")
        ended = False
        while True:
            for event_type, obj in batch:
                self._write_chunk(json.dumps({"type": event_type, "object": obj}).encode() + b"\n")
            if ended:
                break
            batch, cursor, ended = store.wait_events(res, ns, selector, cursor, deadline)
        self._end_chunked()

    def _log(self, ns: str, pod: str, query: dict[str, str]) -> None:
        store = self.server.api._store
        container = store.log_container(ns, pod, query.get("container"))
        tail = int(query["tailLines"]) if query.get("tailLines") else None
        lines, cursor, ended = store.read_log(ns, pod, container, 0, block=False)
        lines = _tail(lines, tail)
        if not _truthy(query.get("follow")):
            self._send(200, "text/plain", "".join(f"{line}\n" for line in lines).encode())
            return
        self._start_chunked("text/plain")
        while True:
            if lines:
                self._write_chunk("".join(f"{line}\n" for line in lines).encode())
            if ended:
                break
            lines, cursor, ended = store.read_log(ns, pod, container, cursor, block=True)
        self._end_chunked()

    # -- bodies

    def _json_body(self) -> Obj:
        try:
            body = json.loads(self._raw_body or b"null")
        except ValueError as exc:
            raise ApiError(400, f"the body of the request is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body of the request must be a JSON object")
        return body

    def _patch_body(self, res: Resource) -> Obj:
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
        accepted = [_MERGE_PATCH, _STRATEGIC_PATCH] if res.builtin else [_MERGE_PATCH]
        if content_type not in accepted:
            raise ApiError(
                415,
                f"the body of the request was in an unknown format - accepted media types include: {', '.join(accepted)}",
            )
        # strategic merge is served as a plain merge patch: lists are replaced, not merged by key
        return self._json_body()

    # -- responses

    def _send(self, code: int, content_type: str, payload: bytes, warnings: list[str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        for warning in warnings or []:  # what the server says of pruned fields (fieldValidation=Warn, the default)
            self.send_header("Warning", f'299 - "{warning}"')
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _send_json(self, code: int, body: Obj, warnings: list[str] | None = None) -> None:
        self._send(code, "application/json", json.dumps(body).encode(), warnings)

    def _start_chunked(self, content_type: str) -> None:
        self._streaming = True
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):X}\r\n".encode() + data + b"\r\n")

    def _end_chunked(self) -> None:
        self.wfile.write(b"0\r\n\r\n")


def _verb(method: str, name: str | None, query: dict[str, str]) -> str:
    """The RBAC verb of a request, as the apiserver's request-info resolver names it."""
    if method == "GET":
        return "get" if name else ("watch" if _truthy(query.get("watch")) else "list")
    verb = {
        ("POST", False): "create",
        ("PUT", True): "update",
        ("PATCH", True): "patch",
        ("DELETE", True): "delete",
    }.get((method, bool(name)))
    if verb is None:
        raise ApiError(405, "the server does not allow this method on the requested resource")
    return verb


class _HTTPServer(ThreadingHTTPServer):
    # non-daemon handler threads, so server_close() joins them and no thread outlives the fake
    daemon_threads = False

    def __init__(self, api: FakeKubeAPI) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.api = api
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        self._hung_up = False

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host's FQDN, which can stall on a machine without DNS
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

    def track(self, conn: socket.socket) -> None:
        with self._connections_lock:
            self._connections.add(conn)
            if self._hung_up:
                self._hang_up(conn)

    def untrack(self, conn: socket.socket) -> None:
        with self._connections_lock:
            self._connections.discard(conn)

    def hang_up_readers(self) -> None:
        """Wake handlers that wait on a keep-alive connection for a next request that will not come."""
        with self._connections_lock:
            self._hung_up = True
            for conn in self._connections:
                self._hang_up(conn)

    @staticmethod
    def _hang_up(conn: socket.socket) -> None:
        try:
            # only the read side: a stream that is ending can still write its last chunk
            conn.shutdown(socket.SHUT_RD)
        except OSError:
            pass  # already closed by the peer


# ------------------------------------------------------------------------------------------ public API


class FakeKubeAPI:
    """A fake kube-apiserver on 127.0.0.1, plus thread-safe controls for tests.

    Use as `with FakeKubeAPI() as server: ...`; point a client at it with `server.write_kubeconfig(path)`.
    """

    def __init__(
        self,
        *,
        user: str = DEFAULT_USER,
        token: str = "fake-token",
        operator: str | None = "v1.8.1",
        trainer: str | None = "v2.3.0",
        kserve: str | None = None,
        katib: str | None = None,
        validate: bool = True,
    ) -> None:
        """`operator`/`trainer`/`kserve`/`katib`: the releases whose CRDs and webhook rules admit jobs,
        InferenceServices and Experiments (None: not installed, so not served). `validate=False` stores
        Kubeflow, KServe and Katib objects as sent."""
        if operator not in (None, *OPERATOR_RELEASES):
            raise ValueError(f"operator release {operator!r}: one of {OPERATOR_RELEASES} or None")
        if trainer not in (None, *TRAINER_RELEASES):
            raise ValueError(f"trainer release {trainer!r}: one of {sorted(TRAINER_RELEASES)} or None")
        if kserve not in (None, *KSERVE_RELEASES):
            raise ValueError(f"kserve release {kserve!r}: one of {KSERVE_RELEASES} or None")
        if katib not in (None, *KATIB_RELEASES):
            raise ValueError(f"katib release {katib!r}: one of {KATIB_RELEASES} or None")
        self.user = user  # who the bearer token authenticates as, for 403 messages
        self.token = token
        self.operator = operator
        self.trainer = trainer
        self.kserve = kserve
        self.katib = katib
        # namespace -> its labels, for Katib's webhook (which admits Experiments only in a namespace labelled
        # for its metrics collector); a namespace not listed here has that label
        self.namespace_labels: dict[str, dict[str, str]] = {}
        self.validate = validate
        self._store = _Store()
        if trainer is not None:
            from fakes.crds import shipped_runtimes

            for runtime in shipped_runtimes():
                self._store.put(RUNTIMES, "", runtime)
        self._lock = threading.Lock()
        self._requests: list[tuple[str, str, dict[str, str]]] = []
        self._bodies: list[tuple[str, str, bytes]] = []
        self._denied: set[tuple[str, str, str]] = set()
        self._failures: list[int] = []
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle

    def start(self) -> Self:
        if self._store.stopping:
            raise RuntimeError("a FakeKubeAPI serves once; make a new one")
        self._httpd = _HTTPServer(self)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-kube-api", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """End open watch and log streams, then stop serving and join every handler thread."""
        if self._httpd is None or self._thread is None:
            return
        self._store.close()
        self._httpd.shutdown()
        self._httpd.hang_up_readers()
        self._httpd.server_close()
        self._thread.join()
        self._httpd = self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("FakeKubeAPI is not running")
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def write_kubeconfig(self, path: str | Path, namespace: str = "team-a", context: str = "fake") -> Path:
        """A kubeconfig whose current context talks to this server as `user`. JSON is valid YAML."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": context, "cluster": {"server": self.url}}],
            "users": [{"name": context, "user": {"token": self.token}}],
            "contexts": [{"name": context, "context": {"cluster": context, "user": context, "namespace": namespace}}],
            "current-context": context,
        }
        path = Path(path)
        path.write_text(json.dumps(config, indent=2))
        return path

    # -- controls: each change bumps resourceVersion and wakes watchers

    def put(self, group_version: str, plural: str, namespace: str, obj: Obj) -> Obj:
        """Insert or replace an object as given (status included), bypassing the API's rules."""
        return self._store.put(resource(group_version, plural), namespace, obj)

    def get_obj(self, group_version: str, plural: str, namespace: str, name: str) -> Obj | None:
        try:
            return self._store.get(resource(group_version, plural), namespace, name)
        except ApiError:
            return None

    def objects(self, group_version: str, plural: str, namespace: str) -> list[Obj]:
        return self._store.select(resource(group_version, plural), namespace, Selector())[0]

    def set_status(self, group_version: str, plural: str, namespace: str, name: str, status: Obj) -> Obj:
        """Replace .status, as a controller would; emits MODIFIED. KeyError if there is no such object."""
        try:
            return self._store.set_status(resource(group_version, plural), namespace, name, status)
        except ApiError as err:
            raise KeyError(err.message) from None

    def append_log(self, namespace: str, pod: str, container: str, *lines: str) -> None:
        """Add lines to a container's log and wake followers. Logs are not API objects, so no
        resourceVersion changes."""
        self._store.append_log(namespace, pod, container, lines)

    def deny(self, verb: str, plural: str, namespace: str) -> None:
        """Answer later `verb` requests on `plural` (or `plural/subresource`) in `namespace` with 403."""
        if verb not in VERBS:
            raise ValueError(f"unknown verb {verb!r}; one of {sorted(VERBS)}")
        with self._lock:
            self._denied.add((verb, plural, namespace))

    def fail_next(self, status_code: int, times: int = 1) -> None:
        """Answer the next `times` requests, whatever they are, with `status_code` and a Status body."""
        with self._lock:
            self._failures.extend([status_code] * times)

    @property
    def requests(self) -> list[tuple[str, str, dict[str, str]]]:
        """(method, path, query) of every request so far, oldest first."""
        with self._lock:
            return list(self._requests)

    @property
    def bodies(self) -> list[tuple[str, str, bytes]]:
        """(method, path, body) of every request that carried a body, oldest first."""
        with self._lock:
            return list(self._bodies)

    # -- used by the request handler

    def _record(self, method: str, path: str, query: dict[str, str], body: bytes = b"") -> None:
        with self._lock:
            self._requests.append((method, path, query))
            if body:
                self._bodies.append((method, path, body))

    def _admit(self, authorization: str | None) -> None:
        """Authenticate the bearer token, then apply any failure injected with fail_next."""
        if authorization != f"Bearer {self.token}":
            raise ApiError(401, "Unauthorized")
        with self._lock:
            code = self._failures.pop(0) if self._failures else None
        if code is not None:
            raise ApiError(code, f"injected by FakeKubeAPI.fail_next({code})")

    def _serves(self, res: Resource) -> bool:
        if res == PYTORCHJOBS:
            return self.operator is not None
        if res in (TRAINJOBS, RUNTIMES):
            return self.trainer is not None
        if res == INFERENCESERVICES:
            return self.kserve is not None
        if res == EXPERIMENTS:
            return self.katib is not None
        return True

    def crd(self, res: Resource):
        """The CRD this fake admits `res` with (None for built-in kinds)."""
        from fakes import crds

        if res == PYTORCHJOBS and self.operator:
            return crds.crd("pytorchjobs", self.operator)
        if res == TRAINJOBS and self.trainer:
            return crds.crd("trainjobs", self.trainer)
        if res == INFERENCESERVICES and self.kserve:
            return crds.crd("inferenceservices", self.kserve)
        return None

    def _admit_create(self, res: Resource, namespace: str, body: Obj) -> tuple[Obj, list[str]]:
        """The apiserver's create path for a custom resource: prune and validate against the CRD
        (422 Invalid), then the validating webhook (403, as controller-runtime denies). Returns
        the body to store and the warnings for pruned fields."""
        if res == EXPERIMENTS and self.validate:
            return self._admit_experiment(namespace, body), []
        definition = self.crd(res) if self.validate else None
        if definition is None:
            return body, []
        from fakes import webhooks

        body = {**body, "metadata": {**(body.get("metadata") or {}), "namespace": namespace}}
        name = body["metadata"].get("name", "")
        outcome = definition.admit(body)
        if outcome.errors:
            raise ApiError(
                422,
                f'{definition.qualified_kind} "{name}" is invalid: {_aggregate(outcome.errors)}',
                "Invalid",
                {**_details(res, name), "causes": [{"message": e} for e in outcome.errors]},
            )
        if res == PYTORCHJOBS:
            hook, errors = webhooks.PYTORCHJOB_WEBHOOK, webhooks.pytorchjob_errors(outcome.stored, self.operator or "")
        elif res == INFERENCESERVICES:
            hook, errors = webhooks.ISVC_WEBHOOK, webhooks.inferenceservice_errors(outcome.stored)
        else:
            runtimes = {r["metadata"]["name"]: r for r in self._store.select(RUNTIMES, "", Selector())[0]}
            hook, errors = webhooks.TRAINJOB_WEBHOOK, webhooks.trainjob_errors(outcome.stored, runtimes)
        if errors:
            raise ApiError(403, f'admission webhook "{hook}" denied the request: {_aggregate(errors)}', "Forbidden")
        return outcome.stored, [f'unknown field "{p}"' for p in outcome.pruned]

    def _admit_experiment(self, namespace: str, body: Obj) -> Obj:
        """Katib's webhooks: its CRD has no schema (nothing pruned or validated by the apiserver); its
        mutating webhook sets the defaults, its validating webhook refuses (tests/fakes/katib.py)."""
        from fakes import katib

        body = katib.defaults(copy.deepcopy(body))
        body["metadata"] = {**(body.get("metadata") or {}), "namespace": namespace}
        errors = katib.validate(body, self.namespace_labels.get(namespace))
        if errors:  # validation_webhook.go answers admission.Errored(http.StatusBadRequest, ...)
            raise ApiError(
                400, f'admission webhook "{KATIB_WEBHOOK}" denied the request: {_aggregate(errors)}', "BadRequest"
            )
        return body

    def run_trial(self, namespace: str, experiment: str, trial: str, assignments: dict[str, str]) -> Obj:
        """What Katib's trial controller does for one trial: the Experiment's trialTemplate with the trial's
        parameter values (``assignments``: parameter name -> value) and meta references put in, named after the
        trial, created through this API's admission (the job's CRD and webhook). ApiError when refused."""
        exp = self._store.get(EXPERIMENTS, namespace, experiment)
        template = exp["spec"]["trialTemplate"]
        meta = {"${trialSpec.Name}": trial, "${trialSpec.Namespace}": namespace}
        text = json.dumps(template["trialSpec"])
        for p in template["trialParameters"]:
            value = meta.get(p["reference"], assignments.get(p["reference"]))
            if value is None:
                raise ValueError(f"no value for trial parameter {p['name']} ({p['reference']})")
            text = text.replace("${trialParameters." + p["name"] + "}", str(value))
        job = json.loads(text)
        job["metadata"] = {**(job.get("metadata") or {}), "name": trial, "namespace": namespace}
        job["metadata"]["ownerReferences"] = [
            {
                "apiVersion": EXPERIMENTS.group_version,
                "kind": "Experiment",
                "name": experiment,
                "uid": exp["metadata"]["uid"],
                "controller": True,
            }
        ]  # fmt: skip (the Trial object in between is not modelled: deleting the Experiment removes its jobs)
        res = next(
            (r for r in RESOURCES.values() if r.group_version == job.get("apiVersion") and r.kind == job.get("kind")),
            None,
        )
        if res is None or not self._serves(res):
            raise ApiError(404, f"the server could not find the requested resource ({job.get('kind')})")
        body, _ = self._admit_create(res, namespace, job)
        return self._store.create(res, namespace, body)

    def _authorize(self, verb: str, res: Resource, sub: str | None, namespace: str, name: str) -> None:
        rbac_resource = f"{res.plural}/{sub}" if sub else res.plural
        with self._lock:
            denied = (verb, rbac_resource, namespace) in self._denied
        if denied:
            raise _forbidden(res, sub, name, verb, namespace, self.user)

    def _discovery(self, path: str) -> Obj:
        if path == "/version":
            return {
                "major": "1",
                "minor": "31",
                "gitVersion": "v1.31.0-fake",
                "gitCommit": "fake",
                "gitTreeState": "clean",
                "buildDate": "2024-08-13T00:00:00Z",
                "goVersion": "go1.22.5",
                "compiler": "gc",
                "platform": "linux/amd64",
            }
        address = [{"clientCIDR": "0.0.0.0/0", "serverAddress": self.url.removeprefix("http://")}]
        if path == "/api":
            return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": address}
        versions: dict[str, list[Obj]] = {}
        for gv in dict.fromkeys(r.group_version for r in RESOURCES.values() if r.group and self._serves(r)):
            group, version = gv.split("/")
            versions.setdefault(group, []).append({"groupVersion": gv, "version": version})
        groups = [{"name": g, "versions": v, "preferredVersion": v[0]} for g, v in versions.items()]
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}
