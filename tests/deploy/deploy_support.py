"""Helpers for the deploy/ tests: rendering the kustomizations, strict validation of every kind
they hold, and FAKE kubectl / helm / git commands for running deploy/install.sh.

The fakes stand in for a cluster, which cannot run here: they log their arguments (one JSON
array per call), answer the read-only questions install.sh asks (versions, context, /version),
and record what reaches them through files and pipes (Secret values, a helm values file) in a
separate log, so a test can tell "delivered" apart from "shown on a command line".
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

# Every kustomization we ship. Each renders from local files only: CI has no network, so
# upstream pieces (the Training Operator's and Kubeflow Trainer's remote kustomizations, the
# OpenEBS and JupyterHub charts) are applied by install.sh from pinned refs and are not rendered here.
KUSTOMIZATIONS = sorted(p.parent.relative_to(DEPLOY).as_posix() for p in DEPLOY.rglob("kustomization.yaml"))
OVERLAYS = sorted(p.name for p in (DEPLOY / "overlays").iterdir() if (p / "kustomization.yaml").exists())

# kind -> OpenAPI model for the kinds deploy/ renders beyond those kubetune.backends.cluster.strict knows.
EXTRA_KINDS = {
    "Namespace": "V1Namespace",
    "ServiceAccount": "V1ServiceAccount",
    "Role": "V1Role",
    "RoleBinding": "V1RoleBinding",
    "ClusterRole": "V1ClusterRole",
    "ClusterRoleBinding": "V1ClusterRoleBinding",
    "Job": "V1Job",
    "Secret": "V1Secret",
    "StorageClass": "V1StorageClass",
    "PersistentVolume": "V1PersistentVolume",
    "NetworkPolicy": "V1NetworkPolicy",
    "DaemonSet": "V1DaemonSet",
    "Pod": "V1Pod",
}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "StorageClass", "PersistentVolume"}


def render(path: str) -> list[dict]:
    """`kubectl kustomize deploy/<path>` as a list of objects."""
    proc = subprocess.run(["kubectl", "kustomize", str(DEPLOY / path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"kubectl kustomize deploy/{path} failed:\n{proc.stderr}"
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def validate(obj: dict) -> list[str]:
    """Strict validation against the official typed models: unknown fields and wrong types are
    problems. Reuses kubetune's walker; adds the kinds it was not written for."""
    from kubetune.backends.cluster import strict

    kind = obj.get("kind")
    if kind in EXTRA_KINDS:
        problems = strict._check_openapi(obj, EXTRA_KINDS[kind], kind)
    else:
        problems = strict.validate(obj)
    meta = obj.get("metadata") or {}
    if not meta.get("name"):
        problems.append(f"{kind}: metadata.name is missing")
    if kind not in CLUSTER_SCOPED and not meta.get("namespace"):
        # install.sh applies without -n: every namespaced object must say where it goes.
        problems.append(f"{kind}/{meta.get('name')}: metadata.namespace is missing")
    if not obj.get("apiVersion"):
        problems.append(f"{kind}/{meta.get('name')}: apiVersion is missing")
    return problems


# ---------------------------------------------------------------- fake commands

_FAKE_KUBECTL = r"""
import base64, json, os, sys

argv = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps(["kubectl", *argv]) + "\n")

def delivered(line):
    with open(os.environ["FAKE_DELIVERED"], "a") as f:
        f.write(line + "\n")

args = list(argv)
context = None
if args[:1] == ["--context"]:
    context, args = args[1], args[2:]
ns = None
if args[:1] == ["-n"]:
    ns, args = args[1], args[2:]

if args[:2] == ["version", "--client"]:
    minor = os.environ.get("FAKE_KUBECTL_MINOR", "32")
    print(json.dumps({"clientVersion": {"major": "1", "minor": minor, "gitVersion": f"v1.{minor}.0"}}, indent=2))
elif args[:2] == ["config", "current-context"]:
    ctx = os.environ.get("FAKE_CONTEXT", "fake-ctx")
    if not ctx:
        print("error: current-context is not set", file=sys.stderr)
        sys.exit(1)
    print(ctx)
elif args[:2] == ["config", "get-contexts"]:
    print(os.environ.get("FAKE_CONTEXT", "fake-ctx"))
elif args[:1] == ["get"] and any(a.startswith("--raw") for a in args):
    if os.environ.get("FAKE_UNREACHABLE"):
        print("E0101 00:00:00.000000 memcache.go:265] couldn't get current server API group list", file=sys.stderr)
        print("Unable to connect to the server: dial tcp 10.9.8.7:6443: i/o timeout", file=sys.stderr)
        sys.exit(1)
    minor = os.environ.get("FAKE_SERVER_MINOR", "31")
    print(f'{{"major": "1", "minor": "{minor}", "gitVersion": "v1.{minor.rstrip("+")}.0-fake"}}')
elif args[:2] == ["get", "validatingwebhookconfigurations"]:
    # install.sh --with trainer asks which webhooks exist (jsonpath: one tab-separated line each)
    print(os.environ.get("FAKE_WEBHOOKS", ""), end="")
elif args[:2] == ["get", "crd"] and args[2] in os.environ.get("FAKE_MISSING_CRDS", "").split():
    print(f'Error from server (NotFound): customresourcedefinitions.apiextensions.k8s.io "{args[2]}" not found',
          file=sys.stderr)
    sys.exit(1)
elif args[:2] == ["get", "secret"]:
    if not os.environ.get("FAKE_SECRETS_EXIST"):
        print(f'Error from server (NotFound): secrets "{args[2]}" not found', file=sys.stderr)
        sys.exit(1)
elif args[:3] == ["create", "secret", "generic"]:
    name = args[3]
    env_file = next(a.split("=", 1)[1] for a in args if a.startswith("--from-env-file="))
    data = {}
    with open(env_file) as f:
        for line in f.read().splitlines():
            key, _, value = line.partition("=")
            data[key] = value
            delivered(f"secret {ns}/{name} {key}={value}")
    print("apiVersion: v1\nkind: Secret\nmetadata:\n  name: %s\n  namespace: %s\ndata:" % (name, ns))
    for key, value in data.items():
        print(f"  {key}: {base64.b64encode(value.encode()).decode()}")
elif args[:3] == ["apply", "-f", "-"]:
    body = sys.stdin.read()
    delivered("applied from stdin: " + " ".join(l.strip() for l in body.splitlines() if l.startswith(("kind:", "  name:"))))
    print("secret/x configured")
elif args[:1] == ["apply"]:
    # a local kustomization install.sh wrote (--trainjob-status): what reached kubectl through it
    if "-k" in args and os.path.isdir(args[args.index("-k") + 1]):
        with open(os.path.join(args[args.index("-k") + 1], "kustomization.yaml")) as f:
            delivered("kustomization: " + f.read().replace("\n", "\\n"))
    print("configured (fake)")
"""

_FAKE_HELM = r"""
import json, os, sys

argv = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps(["helm", *argv]) + "\n")
args = list(argv)
if "version" in args:
    print(os.environ.get("FAKE_HELM_VERSION", "v3.16.2+g13654a5"))
elif "upgrade" in args:
    for i, a in enumerate(args[:-1]):
        # a values file on a pipe (process substitution): record what came through it
        if a in ("--values", "-f") and args[i + 1].startswith(("/dev/fd/", "/proc/")):
            with open(args[i + 1]) as f, open(os.environ["FAKE_DELIVERED"], "a") as out:
                out.write("helm values: " + f.read().replace("\n", " ") + "\n")
    print("Release has been upgraded. Happy Helming!")
"""

_FAKE_GIT = r"""
import sys
print("git version 2.43.0")
"""

# What install.sh needs besides kubectl/helm/git; the tests' PATH holds only these and the fakes,
# so "kubectl is missing" really is missing.
TOOLS = ("bash", "dirname", "sed", "head", "tail", "cut", "grep", "tr", "cat", "env", "mktemp", "rm")


def make_bin(tmp: Path, *, kubectl: bool = True, helm: bool = True, git: bool = True) -> str:
    """A PATH of fake kubectl/helm/git plus symlinks to the real basic tools."""
    fake, tools = tmp / "fakebin", tmp / "tools"
    fake.mkdir(exist_ok=True)
    tools.mkdir(exist_ok=True)
    for name, body, wanted in (
        ("kubectl", _FAKE_KUBECTL, kubectl),
        ("helm", _FAKE_HELM, helm),
        ("git", _FAKE_GIT, git),
    ):
        path = fake / name
        if wanted:
            path.write_text(f"#!{sys.executable}\n{body}")
            path.chmod(path.stat().st_mode | stat.S_IXUSR)
        elif path.exists():
            path.unlink()
    for tool in TOOLS:
        target = shutil.which(tool)
        assert target, f"{tool} is needed to run deploy/install.sh in tests"
        link = tools / tool
        if not link.exists():
            link.symlink_to(target)
    return f"{fake}{os.pathsep}{tools}"


def run_script(
    script: str, *args: str, tmp: Path, env: dict | None = None, path: str | None = None
) -> tuple[subprocess.CompletedProcess, list[list[str]], str]:
    """Run deploy/<script> against the fakes. Returns the process, the logged command lines
    (one argv per call) and what reached the fakes through files and pipes."""
    log, delivered = tmp / "fake.log", tmp / "delivered.log"
    for f in (log, delivered):
        f.write_text("")
    full_env = {
        "PATH": path or make_bin(tmp),
        "HOME": str(tmp),
        "FAKE_LOG": str(log),
        "FAKE_DELIVERED": str(delivered),
        "LANG": "C.UTF-8",
        **(env or {}),
    }
    proc = subprocess.run(
        [shutil.which("bash"), str(DEPLOY / script), *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=60,
        cwd=tmp,
    )
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return proc, calls, delivered.read_text()
