"""deploy/cloud/nebius against a FAKE `nebius` CLI (no Nebius account is reachable from CI):
every name and ID comes from the environment, a missing one is a one-line error, a dry run
prints the create commands with the filesystem attached and mounted by cloud-init, and teardown
deletes nothing without --yes. The scripts read the CLI's output through its own
`--format jsonpath=...`; jq is not on the tests' PATH, so a jq call would fail here."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import stat
import subprocess
import sys

import pytest
import yaml
from deploy_support import DEPLOY, make_bin

NEBIUS = DEPLOY / "cloud" / "nebius"
_FAKE_NEBIUS = r"""
import json, os, re, sys
argv = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps(["nebius", *argv]) + "\n")
existing = set(filter(None, os.environ.get("FAKE_NEBIUS_EXISTING", "").split(",")))

def emit(obj):
    # --format json, or the CLI's kubectl-style --format jsonpath={.a.b[0].c} (the subset the
    # scripts use: fields and list indexes; a missing one is an error, as in kubectl)
    fmt = argv[argv.index("--format") + 1] if "--format" in argv else "yaml"
    if fmt == "json":
        print(json.dumps(obj))
        return
    m = re.fullmatch(r"jsonpath=\{((?:\.\w+(?:\[\d+\])?)+)\}", fmt)
    if not m:
        print(f"Error: fake nebius does not know --format {fmt}", file=sys.stderr)
        sys.exit(2)
    for name, index in re.findall(r"\.(\w+)(?:\[(\d+)\])?", m.group(1)):
        try:
            obj = obj[name] if not index else obj[name][int(index)]
        except (KeyError, IndexError, TypeError):
            print(f"Error: {fmt}: {name} is not found", file=sys.stderr)
            sys.exit(1)
    print(obj)

if argv[:2] == ["iam", "whoami"]:
    emit({"user_profile": {"id": "useraccount-fake"}})
elif "get-by-name" in argv:
    kind = argv[1]  # cluster, node-group, filesystem, service-account
    if kind not in existing:
        print(f"Error: {kind} not found", file=sys.stderr)
        sys.exit(1)
    emit({"metadata": {"id": os.environ.get("FAKE_NEBIUS_ID", f"{kind}-fakeid")}})
elif argv[:3] == ["vpc", "subnet", "list"]:
    subnets = [] if os.environ.get("FAKE_NEBIUS_NO_SUBNET") else [{"metadata": {"id": "vpcsubnet-fakeid"}}]
    emit({"items": subnets})
"""

ENV = {
    "NB_PROJECT_ID": "project-fake0000",
    "NB_CLUSTER_NAME": "ft-cluster",
    "NB_NODE_GROUP_NAME": "ft-gpus",
    "NB_FS_NAME": "ft-shared",
    "NB_NODE_SA_NAME": "ft-node-sa",
}


def run(tmp_path, script, *args, env=None):
    path = make_bin(tmp_path)
    fake = tmp_path / "fakebin" / "nebius"
    fake.write_text(f"#!{sys.executable}\n{_FAKE_NEBIUS}")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    tools = tmp_path / "tools"
    for tool in ("awk", "wc"):
        if not (tools / tool).exists():
            (tools / tool).symlink_to(shutil.which(tool))
    log = tmp_path / "fake.log"
    log.write_text("")
    full_env = {
        "PATH": path,
        "HOME": str(tmp_path),
        "FAKE_LOG": str(log),
        "FAKE_DELIVERED": str(tmp_path / "d.log"),
        **(env or {}),
    }
    proc = subprocess.run(
        [shutil.which("bash"), str(NEBIUS / script), *args], capture_output=True, text=True, env=full_env, timeout=60
    )
    return proc, [json.loads(line) for line in log.read_text().splitlines()]


def _one_error_line(proc):
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and " — " in lines[0], proc.stderr
    return lines[0]


@pytest.mark.parametrize("missing", ["NB_PROJECT_ID", "NB_CLUSTER_NAME", "NB_NODE_GROUP_NAME", "NB_FS_NAME"])
def test_every_name_comes_from_the_environment(tmp_path, missing):
    env = {k: v for k, v in ENV.items() if k != missing}
    proc, calls = run(tmp_path, "01-cluster.sh", "--dry-run", env=env)
    assert _one_error_line(proc).startswith(f"error: {missing} is not set — ")
    assert not [c for c in calls if "create" in c]


def test_bad_values_are_one_line(tmp_path):
    proc, _ = run(tmp_path, "01-cluster.sh", "--dry-run", env={**ENV, "NB_CLUSTER_NAME": "My_Cluster"})
    assert (
        _one_error_line(proc)
        == "error: NB_CLUSTER_NAME is 'My_Cluster', not a lowercase DNS label (letters, digits, '-') — choose another name"
    )
    proc, _ = run(tmp_path, "01-cluster.sh", "--dry-run", env={**ENV, "NB_NODE_COUNT": "two"})
    assert _one_error_line(proc).startswith("error: NB_NODE_COUNT is 'two', not a positive integer")
    proc, _ = run(tmp_path, "01-cluster.sh", "--dry-run", env=ENV)  # the named service account does not exist
    assert _one_error_line(proc).startswith("error: service account 'ft-node-sa' not found in project project-fake0000")


def test_dry_run_prints_the_creates_with_the_shared_filesystem(tmp_path):
    proc, calls = run(tmp_path, "01-cluster.sh", "--dry-run", env={**ENV, "FAKE_NEBIUS_EXISTING": "service-account"})
    assert proc.returncode == 0, proc.stderr
    assert not [c for c in calls if any(v in c for v in ("create", "delete", "get-credentials"))]  # printed, not run
    out = proc.stdout
    assert (
        "[dry-run] nebius compute filesystem create --parent-id project-fake0000 --name ft-shared --size-gibibytes 2000 --type network_ssd"
        in out
    )
    assert (
        "[dry-run] nebius mk8s cluster create --parent-id project-fake0000 --name ft-cluster "
        "--control-plane-subnet-id vpcsubnet-fakeid --control-plane-endpoints-public-endpoint=true --format json"
    ) in out
    # the printed command is valid shell: split it back into its arguments
    start = out.index("[dry-run] nebius mk8s node-group create") + len("[dry-run] ")
    argv = shlex.split(out[start : out.index("[dry-run]", start)])
    opt = {a: b for a, b in zip(argv, argv[1:]) if a.startswith("--")}
    assert {
        k: opt[k]
        for k in (
            "--fixed-node-count",
            "--template-resources-platform",
            "--template-resources-preset",
            "--template-gpu-settings-drivers-preset",
            "--template-service-account-id",
        )
    } == {
        "--fixed-node-count": "2",
        "--template-resources-platform": "gpu-h100-sxm",
        "--template-resources-preset": "1gpu-16vcpu-200gb",
        "--template-gpu-settings-drivers-preset": "cuda12",
        "--template-service-account-id": "service-account-fakeid",
    }
    assert json.loads(opt["--template-filesystems"]) == [
        {"attach_mode": "READ_WRITE", "mount_tag": "csi-storage", "existing_filesystem": {"id": "<new filesystem id>"}}
    ]
    cloud_init = yaml.safe_load(opt["--template-cloud-init-user-data"])
    assert cloud_init["runcmd"][:2] == ["mkdir -p /mnt/data", "mount -t virtiofs csi-storage /mnt/data"]
    assert cloud_init["runcmd"][2].endswith("echo 'csi-storage /mnt/data virtiofs defaults,nofail 0 2' >> /etc/fstab")
    assert "[dry-run] nebius mk8s cluster get-credentials --id '<new cluster id>' --external --force" in out


def test_existing_resources_are_not_created_again(tmp_path):
    proc, _ = run(
        tmp_path,
        "01-cluster.sh",
        "--dry-run",
        env={**ENV, "NB_K8S_VERSION": "1.31", "FAKE_NEBIUS_EXISTING": "service-account,filesystem,cluster,node-group"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "create" not in proc.stdout.replace("created", "")
    assert "filesystem ft-shared exists (filesystem-fakeid)" in proc.stdout
    assert "[dry-run] nebius mk8s cluster get-credentials --id cluster-fakeid --external --force" in proc.stdout


def test_teardown_deletes_nothing_without_yes_and_keeps_the_filesystem(tmp_path):
    existing = {"FAKE_NEBIUS_EXISTING": "cluster,node-group,filesystem"}
    proc, calls = run(tmp_path, "99-teardown.sh", env={**ENV, **existing})
    assert proc.returncode == 0, proc.stderr
    assert not [c for c in calls if "delete" in c]
    out = proc.stdout
    assert out.index("[dry-run] nebius mk8s node-group delete --id node-group-fakeid") < out.index(
        "[dry-run] nebius mk8s cluster delete --id cluster-fakeid"
    )
    assert "keeping filesystem ft-shared" in out and "run again with --yes" in out
    proc, calls = run(tmp_path, "99-teardown.sh", "--yes", "--delete-filesystem", env={**ENV, **existing})
    assert proc.returncode == 0, proc.stderr
    deletes = [c for c in calls if "delete" in c]
    assert [c[1:3] for c in deletes] == [["mk8s", "node-group"], ["mk8s", "cluster"], ["compute", "filesystem"]]


def test_no_account_specific_ids_or_names_in_deploy():
    # Names and IDs in the seed documents are examples; nothing in deploy/ may carry one.
    pattern = re.compile(
        r"\b(project|tenant|mk8scluster|mk8snodegroup|computefilesystem|vpcsubnet|serviceaccount)-[a-z0-9]{12,}\b|reza"
    )
    offenders = [
        f"{p.relative_to(DEPLOY)}: {m.group(0)}"
        for p in DEPLOY.rglob("*")
        if p.is_file() and p.name != ".env"
        for m in [pattern.search(p.read_text(errors="replace"))]
        if m
    ]
    assert offenders == []


def test_no_subnet_and_a_malformed_id_are_one_line(tmp_path):
    env = {**ENV, "FAKE_NEBIUS_EXISTING": "service-account"}
    proc, _ = run(tmp_path, "01-cluster.sh", "--dry-run", env={**env, "FAKE_NEBIUS_NO_SUBNET": "1"})
    assert (
        _one_error_line(proc)
        == "error: project project-fake0000 has no VPC subnet — create one in the console, or set NB_SUBNET_ID"
    )
    # An ID goes into the --template-filesystems JSON: anything not shaped like one stops the script.
    proc, calls = run(tmp_path, "01-cluster.sh", "--dry-run", env={**env, "FAKE_NEBIUS_ID": 'x", "evil": "1'})
    assert _one_error_line(proc).startswith("error: nebius iam service-account get-by-name")
    assert "not a resource ID" in proc.stderr and not [c for c in calls if "create" in c]


def test_scripts_need_no_jq():
    # CI machines and laptops may lack jq; the CLI's --format jsonpath does the same job.
    offenders = [
        f"{p.relative_to(DEPLOY)}:{n}"
        for p in DEPLOY.rglob("*.sh")
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"(^|[|;&(`$\s])jq(\s|$)", line.split("#", 1)[0])
    ]
    assert offenders == []
