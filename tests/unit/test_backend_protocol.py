"""The backend seam: every registered backend answers the Backend protocol's calls with the
protocol's parameters, and the CLI and the Python client pick backends from the one registry."""

from __future__ import annotations

import importlib
import inspect

import pytest

from kubetune.backends import base
from kubetune.client import Client
from kubetune.errors import KubetuneError

METHODS = ["submit", "status", "logs", "wait", "delete", "list", "spec_of"]


def _cls(name: str):
    module, _, cls = base.REGISTRY[name].partition(":")
    return getattr(importlib.import_module(module), cls)


@pytest.mark.parametrize("name", sorted(base.REGISTRY))
@pytest.mark.parametrize("method", METHODS)
def test_every_backend_implements_the_protocol(name, method):
    want = inspect.signature(getattr(base.Backend, method))
    have = inspect.signature(getattr(_cls(name), method))
    takes_any = any(p.kind is p.VAR_KEYWORD for p in have.parameters.values())
    for pname, param in want.parameters.items():
        if param.kind is param.VAR_KEYWORD:
            continue
        assert pname in have.parameters or takes_any, f"{name}.{method} lacks {pname}"
        if pname in have.parameters and param.default is not param.empty:
            assert have.parameters[pname].default == param.default, f"{name}.{method}({pname}=...)"
    # nothing beyond the protocol is required: a caller of the protocol can call every backend
    required = [
        p
        for p in have.parameters.values()
        if p.default is p.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"
    ]
    assert {p.name for p in required} <= set(want.parameters), f"{name}.{method} requires more: {required}"


def test_an_unknown_backend_is_one_line():
    with pytest.raises(KubetuneError) as e:
        base.get("slurm")
    assert str(e.value) == "--target: unknown backend 'slurm' — use one of local, pytorchjob, trainjob"


@pytest.mark.parametrize("backend", ["pytorchjob", "trainjob"])
def test_the_client_names_cluster_backends_from_the_registry(backend):
    # No cluster is contacted until a call: the options are what the registry's backend gets.
    assert Client(backend, namespace="team-a").options == {"namespace": "team-a", "target": backend}


def test_the_local_backend_knows_only_its_own_runs():
    with pytest.raises(KubetuneError, match="no local run named 'ghost' was started from this Python process"):
        base.get("local").status("ghost")
