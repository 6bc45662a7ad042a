"""The backend seam: every registered backend answers the Backend protocol's calls with the
protocol's parameters and hands back the one handle class (kubetune.client.Job), and the CLI and
the Python client pick backends from the one registry, never branching on a backend's name."""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from pathlib import Path

import pytest
from conftest import MINILM
from fakes.kube_api import FakeKubeAPI

from kubetune.backends import base
from kubetune.backends.local import runs as local_runs
from kubetune.backends.status import JobStatus, WaitTimeout
from kubetune.client import Client, Job
from kubetune.config import JobSpec
from kubetune.errors import KubetuneError

METHODS = ["submit", "status", "logs", "wait", "delete", "list", "spec_of", "for_job", "output_dir"]
SRC = Path(__file__).resolve().parents[2] / "src" / "kubetune"
# A spec every backend takes: the cluster ones refuse paths on this machine for model and data.
SPEC = {
    "name": "demo",
    "model": {"uri": MINILM},
    "data": {"train": "hf://acme/reviews", "text_column": "text", "label_column": "label"},
    "output": {"uri": "runs/demo"},
}


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


@pytest.fixture(params=sorted(base.REGISTRY))
def client(request, monkeypatch, tmp_path):
    """A Client of each registered backend: the cluster ones on the fake API server (a Trainer
    v2.3 beside the Training Operator), the local one with `kubetune run` replaced by a script
    that runs until it is stopped."""
    if request.param not in base.CLUSTER:
        script = tmp_path / "fake_run.py"
        script.write_text("import time\nprint('[rank 0] INFO started', flush=True)\ntime.sleep(60)\n")
        monkeypatch.setattr(local_runs, "run_command", lambda spec_file: [sys.executable, str(script), str(spec_file)])
        monkeypatch.setattr(local_runs, "_LOCAL_JOBS", {})
        yield Client(request.param)
        for run in list(local_runs._LOCAL_JOBS.values()):
            run.delete(timeout=5)
        return
    with FakeKubeAPI(trainer="v2.3.0") as server:
        yield Client(request.param, kubeconfig=str(server.write_kubeconfig(tmp_path / "kubeconfig")))


def test_every_backend_hands_back_the_one_handle_and_answers_the_same_calls(client):
    job = client.train(SPEC)
    assert type(job) is Job and job.name == "demo"
    assert all(callable(getattr(job.backend, method)) for method in METHODS)  # what for_job gave answers it all
    again = client.get("demo")
    assert type(again) is Job and again.name == "demo"
    status = job.status()
    assert isinstance(status, JobStatus) and (status.name, status.done) == ("demo", False)
    assert [j["name"] for j in client.list()] == ["demo"]
    assert isinstance(job.spec, JobSpec) and job.spec.name == "demo"
    assert job.output is None or isinstance(job.output, Path)
    with pytest.raises(WaitTimeout, match="'demo' is still "):
        job.wait(timeout=0.5)
    notes = job.delete()
    assert isinstance(notes, list) and all(isinstance(n, str) for n in notes)
    assert client.list() == []
    with pytest.raises(KubetuneError):
        client.get("demo")


BACKEND_NAMES = {*base.REGISTRY, *base.GROUPS}


def _branches_on_backend_names(tree: ast.AST) -> list[int]:
    """Lines where a backend's name is compared, tested, matched or used as a table key."""
    places: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            places.append(node)
        elif isinstance(node, (ast.If, ast.IfExp, ast.While)):
            places.append(node.test)
        elif isinstance(node, ast.comprehension):
            places += node.ifs
        elif isinstance(node, ast.match_case):
            places.append(node.pattern)
        elif isinstance(node, ast.Dict):
            places += [k for k in node.keys if k is not None]
    return sorted(
        {
            sub.lineno
            for place in places
            for sub in ast.walk(place)
            if isinstance(sub, ast.Constant) and sub.value in BACKEND_NAMES
        }
    )


@pytest.mark.parametrize("module", sorted(str(p.relative_to(SRC)) for p in (SRC / "cli").glob("*.py")) + ["client.py"])
def test_the_cli_and_the_client_never_branch_on_a_backend_name(module):
    tree = ast.parse((SRC / module).read_text())
    assert _branches_on_backend_names(tree) == [], f"{module} branches on a backend's name"
    # and reach the backends through the registry (base), never a backend's own module
    used = {
        # a family's package (``from kubetune.backends.kubeflow import manifests``) imports its modules by name
        alias.name if (SRC / "/".join(node.module.split(".")[1:])).is_dir() else node.module.rpartition(".")[2]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kubetune.backends")
        for alias in node.names
    }
    # a family's manifests are pure builders (no backend behind them), checks and status plain functions; the
    # launcher is the one elastic launch of processes on this machine (`kubetune eval --procs` starts its ranks
    # with it, as the local backend does its workers), not a backend
    assert used <= {"base", "status", "manifests", "checks", "launcher"}, used


def test_the_branch_finder_finds_branches():
    code = 'if t == "local": pass\nx = {"trainjob": 1}\ny = a if b in ("kubeflow",) else c\nz = get("local")\n'
    assert _branches_on_backend_names(ast.parse(code)) == [1, 2, 3]


def test_a_command_line_reaches_the_local_backend_over_the_records_of_this_machine(tmp_path, monkeypatch):
    # What `kubetune status` and `list --target local` read from another shell: the record every
    # `kubetune run` leaves (the connection options mean nothing to a local run).
    from kubetune.config import parse_spec

    monkeypatch.setenv("KUBETUNE_STATE_DIR", str(tmp_path))
    record = local_runs.record_run(parse_spec({**SPEC, "output": {"uri": str(tmp_path / "out")}}))
    local_runs.end_run(record, 0)
    here = base.reach("local", namespace="team-a")
    assert base.recorded("demo") is not None and base.recorded("other") is None
    assert here.status("demo").phase == "Succeeded" and here.output_dir("demo") == tmp_path / "out"
    assert [j["name"] for j in here.list()] == ["demo"]
    with pytest.raises(KubetuneError) as e:
        here.status("other")
    assert str(e.value) == (
        "name: no `kubetune run` of job 'other' on this machine — check the name (the spec's `name`), "
        f"or look in {tmp_path / 'runs'}"
    )
