"""deploy/install.sh and deploy/secrets.sh against FAKE kubectl / helm / git (deploy_support):
no cluster can run here. The fakes log every call, so these tests check the order of the steps,
that a re-run repeats the same idempotent commands (apply, helm upgrade --install), the one-line
prerequisite failures, and that no secret from .env reaches a command line or the output; and the
opt-in Kubeflow Trainer step (--with trainer): its commands, their order (JobSet and the Trainer
ready before the runtimes), idempotence, and the refusals before any change."""

from __future__ import annotations

import pytest
from deploy_support import make_bin, run_script

CANARIES = {
    "MINIO_ROOT_USER": "rootcanary7",
    "MINIO_ROOT_PASSWORD": "pwcanary-5f1e0c2b9a",
    "AWS_ACCESS_KEY_ID": "keycanary8",
    "AWS_SECRET_ACCESS_KEY": "secretcanary-77a3d1e0",
    "HF_TOKEN": "hf_tokencanary9c4b",
    "JUPYTERHUB_PASSWORD": "hubcanary-3e9f",
}
# The user names are not secret, but they are credentials too: they must not be printed either.
SECRET_VALUES = list(CANARIES.values())


@pytest.fixture
def env_file(tmp_path):
    path = tmp_path / "test.env"
    lines = ["# a test .env: every value is a canary that must never be shown"]
    lines += [f'{k}="{v}"' if k == "MINIO_ROOT_PASSWORD" else f"{k}={v}" for k, v in CANARIES.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def install(tmp_path, *args, env=None, path=None):
    return run_script("install.sh", *args, tmp=tmp_path, env=env, path=path)


def _index(calls, predicate, what):
    for i, argv in enumerate(calls):
        if predicate(argv):
            return i
    raise AssertionError(f"no {what} call in {calls}")


STEPS = {
    "openebs": lambda a: a[:3] == ["helm", "upgrade", "--install"] and "openebs-localpv/localpv-provisioner" in a,
    "minio": lambda a: a[:2] == ["kubectl", "apply"] and "kubetune.io/component=minio" in a,
    "training-operator": lambda a: (
        a[:3] == ["kubectl", "apply", "--server-side"] and any("training-operator.git" in x for x in a)
    ),
    "trainer": lambda a: (
        a[:3] == ["kubectl", "apply", "--server-side"]
        and any("kubeflow/trainer.git/manifests/overlays/manager" in x for x in a)
    ),
    "jupyterhub": lambda a: a[:3] == ["helm", "upgrade", "--install"] and "jupyterhub/jupyterhub" in a,
    "tensorboard": lambda a: a[:2] == ["kubectl", "apply"] and "kubetune.io/component=tensorboard" in a,
    "mlflow": lambda a: a[:2] == ["kubectl", "apply"] and "kubetune.io/component=mlflow" in a,
}


def _assert_no_secret(text, where):
    for value in SECRET_VALUES:
        assert value not in text, f"a secret from .env appears in {where}"


def test_installs_in_order_idempotently_and_never_shows_a_secret(tmp_path, env_file):
    runs = []
    for _ in range(2):
        proc, calls, delivered = install(tmp_path, env={"KUBETUNE_ENV_FILE": str(env_file)})
        assert proc.returncode == 0, proc.stderr
        runs.append((proc, calls, delivered))
    (first, calls, delivered), (second, calls2, _) = runs

    order = [
        _index(calls, STEPS[s], s)
        for s in ("openebs", "minio", "training-operator", "jupyterhub", "tensorboard", "mlflow")
    ]
    assert order == sorted(order), order
    # namespaces and Secrets before anything that needs them
    assert (
        _index(calls, lambda a: "kubetune.io/component=namespaces" in a, "namespaces")
        < _index(calls, lambda a: "create" in a, "secret")
        < order[0]
    )
    # RBAC (the user servers' ServiceAccount) before the JupyterHub release that uses it
    assert _index(calls, lambda a: "kubetune.io/component=rbac" in a, "rbac") < order[3]
    # the Training Operator is a pinned release, applied server-side
    to = calls[order[2]]
    assert any(x.endswith("overlays/standalone?ref=v1.8.1") for x in to)
    # Kubeflow Trainer (and JobSet) only when asked for: --with trainer
    assert not [a for a in calls if any("kubeflow/trainer.git" in x or "jobset" in x for x in a)]
    assert "==> 4/6 RBAC for notebooks, then JupyterHub" in first.stdout and "--target trainjob" not in first.stdout

    # idempotent: the second run makes exactly the same calls, all of them re-runnable. (The two
    # ends of a `create --dry-run | apply -f -` pipe start together and log in either order.)
    piped = ["kubectl", "apply", "-f", "-"]
    assert [a for a in calls2 if a != piped] == [a for a in calls if a != piped]
    assert calls2.count(piped) == calls.count(piped) == 5
    for argv in calls:
        tool, verb = argv[0], [a for a in argv[1:] if not a.startswith("-")][:1]
        if tool == "kubectl" and "create" in argv:
            assert "--dry-run=client" in argv, argv  # only to render a Secret for `apply -f -`
        if tool == "kubectl" and "delete" in argv:
            assert "--ignore-not-found" in argv, argv
        if tool == "helm":
            assert verb in (["version"], ["repo"], ["upgrade"]), argv
            if "upgrade" in argv:
                assert "--install" in argv
            if "repo" in argv:
                assert "--force-update" in argv

    # secrets: delivered through files and pipes, never on a command line, never printed
    for value in SECRET_VALUES:
        assert value in delivered, "a .env value did not reach the cluster"
    _assert_no_secret("\n".join(" ".join(a) for a in calls), "a command line")
    _assert_no_secret(first.stdout + first.stderr + second.stdout + second.stderr, "the output")
    assert "secret kubetune/hf-secrets HF_TOKEN=" in delivered
    assert "secret jupyterhub/minio-credentials AWS_ENDPOINT_URL=http://minio.minio.svc.cluster.local:9000" in delivered

    # how to reach each service
    for forward in (
        "-n minio port-forward svc/minio 9000:9000",
        "-n minio port-forward svc/minio 9001:9001",
        "-n jupyterhub port-forward svc/proxy-public 8080:80",
        "-n kubetune port-forward svc/tensorboard 6006:6006",
        "-n kubetune port-forward svc/mlflow 5000:5000",
    ):
        assert f"kubectl {forward}" in first.stdout


def test_dry_run_changes_nothing_and_prints_the_plan_in_order(tmp_path, env_file):
    proc, calls, delivered = install(
        tmp_path, "--dry-run", "--overlay", "nebius", env={"KUBETUNE_ENV_FILE": str(env_file)}
    )
    assert proc.returncode == 0, proc.stderr
    # only read-only calls reached the tools
    for argv in calls:
        assert (
            argv[1:3] in (["version", "--client"], ["version", "--short"], ["config", "current-context"])
            or "--raw=/version" in argv
        ), argv
    assert delivered == ""
    plan = [line for line in proc.stdout.splitlines() if line.startswith("[dry-run] ")]
    positions = [
        next(i for i, line in enumerate(plan) if needle in line)
        for needle in (
            "localpv-provisioner",
            "kubetune.io/component=minio",
            "training-operator.git",
            "jupyterhub/jupyterhub",
            "kubetune.io/component=tensorboard",
            "kubetune.io/component=mlflow",
        )
    ]
    assert positions == sorted(positions)
    assert any("overlays/nebius" in line for line in plan)
    assert "[dry-run] apply Secret minio/minio-root (keys: MINIO_ROOT_USER MINIO_ROOT_PASSWORD)" in plan
    _assert_no_secret(proc.stdout + proc.stderr, "the dry-run output")


def test_skip_leaves_a_step_out(tmp_path, env_file):
    proc, calls, _ = install(
        tmp_path, "--skip", "openebs", "--skip", "training-operator", env={"KUBETUNE_ENV_FILE": str(env_file)}
    )
    assert proc.returncode == 0, proc.stderr
    assert not any(STEPS["openebs"](a) or STEPS["training-operator"](a) for a in calls)
    assert any(STEPS["jupyterhub"](a) for a in calls)


def _one_error_line(proc):
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and " — " in lines[0]  # what is wrong — the fix
    return lines[0]


def _nothing_changed(calls):
    assert not [a for a in calls if any(v in a for v in ("apply", "upgrade", "create", "delete"))]


@pytest.mark.parametrize("missing", ["kubectl", "helm", "git"])
def test_missing_tool_is_one_line_and_nothing_runs(tmp_path, env_file, missing):
    path = make_bin(tmp_path, **{missing: False})
    proc, calls, _ = install(tmp_path, env={"KUBETUNE_ENV_FILE": str(env_file)}, path=path)
    line = _one_error_line(proc)
    assert line.startswith(f"error: {missing} not found on PATH — install ")
    _nothing_changed(calls)


def test_unreachable_cluster_is_one_line_naming_the_context(tmp_path, env_file):
    proc, calls, _ = install(
        tmp_path, env={"KUBETUNE_ENV_FILE": str(env_file), "FAKE_UNREACHABLE": "1", "FAKE_CONTEXT": "lab-cluster"}
    )
    line = _one_error_line(proc)
    assert line == (
        "error: cannot reach the Kubernetes API server of context 'lab-cluster' (Unable to connect to the server: "
        "dial tcp 10.9.8.7:6443: i/o timeout) — check the cluster is running and 'kubectl cluster-info' works, "
        "or pick another with --context"
    )
    _nothing_changed(calls)


def test_no_current_context_and_unknown_context(tmp_path, env_file):
    proc, calls, _ = install(tmp_path, env={"KUBETUNE_ENV_FILE": str(env_file), "FAKE_CONTEXT": ""})
    assert "kubectl has no current context" in _one_error_line(proc)
    _nothing_changed(calls)
    proc, calls, _ = install(tmp_path, "--context", "typo-ctx", env={"KUBETUNE_ENV_FILE": str(env_file)})
    assert _one_error_line(proc).startswith("error: kubectl context 'typo-ctx' is not in the kubeconfig")
    _nothing_changed(calls)


def test_old_kubectl_and_bad_arguments(tmp_path, env_file):
    proc, _, _ = install(tmp_path, env={"KUBETUNE_ENV_FILE": str(env_file), "FAKE_KUBECTL_MINOR": "24"})
    assert _one_error_line(proc).startswith("error: kubectl is 1.24, older than 1.28 — upgrade kubectl")
    proc, _, _ = install(tmp_path, "--overlay", "gke")
    assert _one_error_line(proc).startswith("error: overlay 'gke' not found")
    proc, _, _ = install(tmp_path, "--skip", "minIO")
    assert _one_error_line(proc).startswith("error: --skip 'minIO' is not a step")


def test_without_env_file_uses_existing_secrets_or_says_how_to_make_them(tmp_path):
    absent = str(tmp_path / "absent.env")
    proc, calls, _ = install(tmp_path, env={"KUBETUNE_ENV_FILE": absent})
    line = _one_error_line(proc)
    assert line.startswith(f"error: env file {absent} not found and Secrets minio/minio-root, ")
    assert line.endswith("copy deploy/.env.example to deploy/.env, fill it in, and run again")
    assert not any(STEPS["openebs"](a) for a in calls)
    proc, calls, _ = install(tmp_path, env={"KUBETUNE_ENV_FILE": absent, "FAKE_SECRETS_EXIST": "1"})
    assert proc.returncode == 0, proc.stderr
    assert not any("create" in a for a in calls)
    assert "JupyterHub accepts any password" in proc.stderr


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("MINIO_ROOT_PASSWORD", "short1", "MINIO_ROOT_PASSWORD in {env} is 6 characters, fewer than 8"),
        (
            "MINIO_ROOT_PASSWORD",
            "has space$1x",
            "MINIO_ROOT_PASSWORD in {env} (12 characters) holds characters other than",
        ),
        ("AWS_SECRET_ACCESS_KEY", "", "AWS_SECRET_ACCESS_KEY is empty or missing in {env}"),
        ("AWS_ACCESS_KEY_ID", CANARIES["MINIO_ROOT_USER"], "AWS_ACCESS_KEY_ID in {env} equals MINIO_ROOT_USER"),
        ("HF_TOKEN", "hf_bad/token", "HF_TOKEN in {env} (12 characters) is not a Hugging Face token"),
    ],
)
def test_secrets_sh_rejects_bad_values_without_showing_them(tmp_path, env_file, key, value, message):
    text = (
        env_file.read_text()
        .replace(f"{key}={CANARIES[key]}", f"{key}={value}")
        .replace(f'{key}="{CANARIES[key]}"', f'{key}="{value}"')
    )
    env_file.write_text(text)
    proc, calls, delivered = run_script("secrets.sh", "--env-file", str(env_file), tmp=tmp_path)
    line = _one_error_line(proc)
    assert line.startswith("error: " + message.format(env=env_file))
    if value:
        assert value not in line
    _assert_no_secret(proc.stderr + proc.stdout, "the error")
    assert delivered == ""


def test_env_file_syntax_error_names_the_line_not_its_content(tmp_path, env_file):
    env_file.write_text(env_file.read_text() + "oops-not-a-pair pwcanary-5f1e0c2b9a\n")
    proc, _, _ = run_script("secrets.sh", "--env-file", str(env_file), tmp=tmp_path)
    line = _one_error_line(proc)
    assert line == f"error: {env_file} line 8 is not KEY=VALUE — fix or comment out that line (see deploy/.env.example)"


def test_secrets_sh_needs_the_namespaces(tmp_path, env_file):
    # A fake where `get namespace` fails: secrets.sh run on its own before install.sh.
    path = make_bin(tmp_path)
    kubectl = tmp_path / "fakebin" / "kubectl"
    kubectl.write_text(kubectl.read_text() + '\nif args[:2] == ["get", "namespace"]:\n    sys.exit(1)\n')
    proc, calls, _ = run_script("secrets.sh", "--env-file", str(env_file), tmp=tmp_path, path=path)
    assert _one_error_line(proc).startswith("error: namespace 'minio' does not exist — run deploy/install.sh")
    assert not any("create" in a for a in calls)


# ---------------------------------------------------------------- --with trainer (Kubeflow Trainer v2)

TRAINER_MANAGER = "https://github.com/kubeflow/trainer.git/manifests/overlays/manager?ref=v2.3.0"
TRAINER_RUNTIMES = "https://github.com/kubeflow/trainer.git/manifests/overlays/runtimes?ref=v2.3.0"
# The trainer step, in order: upstream's manager overlay (CRDs, controller, webhooks, JobSet v0.12.0),
# its CRDs established, JobSet's then the Trainer's controller ready (readyz: webhook certificates
# issued and the webhook server listening), and only then the runtimes, objects of those CRDs.
TRAINER_STEP = [
    ["kubectl", "apply", "--server-side", "-k", TRAINER_MANAGER],
    [
        "kubectl",
        "wait",
        "--for=condition=established",
        "crd/jobsets.jobset.x-k8s.io",
        "crd/trainjobs.trainer.kubeflow.org",
        "crd/trainingruntimes.trainer.kubeflow.org",
        "crd/clustertrainingruntimes.trainer.kubeflow.org",
        "--timeout=2m",
    ],
    ["kubectl", "-n", "kubeflow-system", "rollout", "status", "deployment/jobset-controller-manager", "--timeout=5m"],
    [
        "kubectl",
        "-n",
        "kubeflow-system",
        "rollout",
        "status",
        "deployment/kubeflow-trainer-controller-manager",
        "--timeout=5m",
    ],
    ["kubectl", "apply", "--server-side", "-k", TRAINER_RUNTIMES],
]
# What `kubectl get validatingwebhookconfigurations -o jsonpath=...` prints (name|managed-by|service
# namespaces|API groups), as checked against real kubectl output for Trainer v2.3.0's and Training
# Operator v1.8.1's rendered manifests: a cluster where install.sh already installed both.
OWN_WEBHOOKS = (
    "jobset-validating-webhook-configuration|kustomize|kubeflow-system kubeflow-system|jobset.x-k8s.io \n"
    "validator.trainer.kubeflow.org||kubeflow-system kubeflow-system kubeflow-system|trainer.kubeflow.org trainer.kubeflow.org trainer.kubeflow.org\n"
    "validator.training-operator.kubeflow.org||kubeflow kubeflow kubeflow kubeflow kubeflow|kubeflow.org kubeflow.org kubeflow.org kubeflow.org kubeflow.org\n"
)


def _trainer_calls(calls):
    """The trainer step's calls, in order: from the manager apply to the runtimes apply."""
    start = _index(calls, STEPS["trainer"], "trainer manager apply")
    end = _index(
        calls,
        lambda a: any("kubeflow/trainer.git/manifests/overlays/runtimes" in x for x in a),
        "trainer runtimes apply",
    )
    return calls[start : end + 1]


def test_with_trainer_installs_jobset_trainer_then_runtimes_in_order_idempotently(tmp_path, env_file):
    runs = []
    for webhooks in ("", OWN_WEBHOOKS):  # a fresh cluster, then the re-run on what the first run installed
        proc, calls, _ = install(
            tmp_path, "--with", "trainer", env={"KUBETUNE_ENV_FILE": str(env_file), "FAKE_WEBHOOKS": webhooks}
        )
        assert proc.returncode == 0, proc.stderr
        runs.append((proc, calls))
    (first, calls), (second, calls2) = runs

    assert _trainer_calls(calls) == TRAINER_STEP
    # after the Training Operator, before the notebooks' RBAC and JupyterHub
    order = [
        _index(calls, STEPS[s], s)
        for s in ("openebs", "minio", "training-operator", "trainer", "jupyterhub", "tensorboard", "mlflow")
    ]
    assert order == sorted(order), order
    assert _index(calls, lambda a: "crd/pytorchjobs.kubeflow.org" in a, "TO crd wait") < order[3]
    # before any change: the cluster's version, and which Trainer / JobSet webhooks exist already
    first_change = _index(calls, lambda a: "apply" in a, "first apply")
    reads = [a for a in calls[:first_change] if "validatingwebhookconfigurations" in a or "--raw=/version" in a]
    assert len(reads) == 3, reads  # check_reachable's /version, the Trainer's version check, the webhooks
    # the steps are numbered for this run's plan; the end says how to submit a TrainJob
    titles = [line for line in first.stdout.splitlines() if line.startswith("==> ") and "/7 " in line]
    assert [t.split(" ", 2)[1] for t in titles] == ["1/7", "2/7", "3/7", "4/7", "5/7", "6/7", "7/7"]
    assert "==> 4/7 Kubeflow Trainer v2.3.0 with the JobSet it ships, then its ClusterTrainingRuntimes" in titles
    assert "--target trainjob" in first.stdout and "kubetune runtimes" in first.stdout

    # idempotent: the re-run, on a cluster holding what the first run installed, makes the same calls
    piped = ["kubectl", "apply", "-f", "-"]
    assert [a for a in calls2 if a != piped] == [a for a in calls if a != piped]
    assert second.stderr == first.stderr == ""


def test_with_trainer_is_independent_of_the_training_operator(tmp_path, env_file):
    proc, calls, _ = install(
        tmp_path, "--with", "trainer", "--skip", "training-operator", env={"KUBETUNE_ENV_FILE": str(env_file)}
    )
    assert proc.returncode == 0, proc.stderr
    assert not any(STEPS["training-operator"](a) for a in calls)
    assert _trainer_calls(calls) == TRAINER_STEP
    assert "==> 3/7 Kubeflow Training Operator" not in proc.stdout  # skipped: no title, but it keeps its number
    assert "==> 4/7 Kubeflow Trainer v2.3.0" in proc.stdout


def test_with_trainer_dry_run_prints_the_step_and_changes_nothing(tmp_path, env_file):
    proc, calls, delivered = install(
        tmp_path, "--dry-run", "--with", "trainer", env={"KUBETUNE_ENV_FILE": str(env_file)}
    )
    assert proc.returncode == 0, proc.stderr
    for argv in calls:  # only questions: versions, the context, the webhooks that exist
        assert (
            argv[1:3]
            in (
                ["version", "--client"],
                ["version", "--short"],
                ["config", "current-context"],
                ["get", "validatingwebhookconfigurations"],
            )
            or "--raw=/version" in argv
        ), argv
    assert delivered == ""
    plan = [line for line in proc.stdout.splitlines() if line.startswith("[dry-run] kubectl")]
    shown = ["[dry-run] " + " ".join(f"'{x}'" if "?" in x else x for x in argv) for argv in TRAINER_STEP]
    start = plan.index(shown[0])
    assert plan[start : start + len(shown)] == shown
    assert plan.index(next(line for line in plan if "training-operator.git" in line)) < start
    assert plan.index(next(line for line in plan if "kubetune.io/component=rbac" in line)) > start + len(shown) - 1


def test_trainjob_status_turns_the_gate_on_in_the_trainers_own_apply(tmp_path, env_file):
    """--trainjob-status: the manager overlay wrapped in a kustomization that adds the controller flag
    --feature-gates=TrainJobStatus=true, applied in the same single server-side apply (so a re-run
    does not conflict with a patch), the rest of the step unchanged; its temporary directory removed."""
    env = {"KUBETUNE_ENV_FILE": str(env_file), "TMPDIR": str(tmp_path)}
    proc, calls, delivered = install(tmp_path, "--with", "trainer", "--trainjob-status", env=env)
    assert proc.returncode == 0, proc.stderr
    start = _index(
        calls, lambda a: a[:4] == ["kubectl", "apply", "--server-side", "-k"] and "kubetune-trainer." in a[4], "gate"
    )
    assert calls[start][4].startswith(str(tmp_path))
    assert calls[start + 1 : start + len(TRAINER_STEP)] == TRAINER_STEP[1:]
    assert not any(STEPS["trainer"](a) for a in calls)  # the plain overlay is not applied besides
    kustomization = next(line for line in delivered.splitlines() if "kustomization: # made by" in line)
    kustomization = kustomization.removeprefix("kustomization: ").replace("\\n", "\n")
    assert f"resources:\n  - {TRAINER_MANAGER}\n" in kustomization
    assert "name: kubeflow-trainer-controller-manager" in kustomization
    assert (
        "path: /spec/template/spec/containers/0/args/-\n        value: --feature-gates=TrainJobStatus=true"
        in kustomization
    )
    assert not list(tmp_path.glob("kubetune-trainer.*"))  # removed at exit
    assert "TrainJobStatus is on" in proc.stdout
    # the dry run shows the kustomization it would apply
    proc, _, _ = install(tmp_path, "--dry-run", "--with", "trainer", "--trainjob-status", env=env)
    assert proc.returncode == 0 and any(
        line.startswith("[dry-run] ") and line.endswith(" value: --feature-gates=TrainJobStatus=true")
        for line in proc.stdout.splitlines()
    )
    # without the Trainer it installs: one line, nothing done
    proc, calls, _ = install(tmp_path, "--trainjob-status", env=env)
    assert _one_error_line(proc).startswith("error: --trainjob-status turns on a feature gate of the Kubeflow Trainer")
    assert not any("apply" in a for a in calls)
    assert "--trainjob-status" in install(tmp_path, "--help")[0].stdout


def test_trainer_ref_picks_the_release_and_refuses_one_kubetune_cannot_use(tmp_path, env_file):
    proc, calls, _ = install(
        tmp_path, "--with", "trainer", env={"KUBETUNE_ENV_FILE": str(env_file), "TRAINER_REF": "v2.4.1"}
    )
    assert proc.returncode == 0, proc.stderr
    step = _trainer_calls(calls)
    assert step[0][-1].endswith("overlays/manager?ref=v2.4.1") and step[-1][-1].endswith("overlays/runtimes?ref=v2.4.1")

    proc, calls, _ = install(
        tmp_path, "--with", "trainer", env={"KUBETUNE_ENV_FILE": str(env_file), "TRAINER_REF": "v2.2.1"}
    )
    assert _one_error_line(proc) == (
        "error: TRAINER_REF=v2.2.1 is older than v2.3.0, the first Kubeflow Trainer kubetune's TrainJob "
        "target works with — unset TRAINER_REF (default v2.3.0) or set v2.3.0 or later"
    )
    assert calls == []  # refused before any tool runs

    # a branch or commit cannot be checked: said once, then installed as asked
    proc, calls, _ = install(
        tmp_path, "--with", "trainer", env={"KUBETUNE_ENV_FILE": str(env_file), "TRAINER_REF": "master"}
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith("warning: TRAINER_REF=master is not a release tag (vX.Y.Z)")
    assert _trainer_calls(calls)[0][-1].endswith("overlays/manager?ref=master")


@pytest.mark.parametrize(
    "env,args,message",
    [
        # Trainer's docs ask for kubectl >= 1.31 and Kubernetes >= 1.31; without --with trainer, 1.28 is enough
        (
            {"FAKE_KUBECTL_MINOR": "30"},
            (),
            "error: kubectl is 1.30, older than the 1.31 that Kubeflow Trainer v2.3.0 asks for — upgrade kubectl",
        ),
        (
            {"FAKE_SERVER_MINOR": "30+"},
            (),
            "error: context 'fake-ctx' runs Kubernetes 1.30, older than the 1.31 that Kubeflow Trainer v2.3.0 needs",
        ),
        ({"FAKE_SERVER_MINOR": ""}, (), "error: cannot read the Kubernetes version of context 'fake-ctx'"),
        # JobSet from its own release (namespace jobset-system): Trainer's manifests would add a second controller
        (
            {
                "FAKE_WEBHOOKS": "jobset-validating-webhook-configuration|kustomize|jobset-system jobset-system|jobset.x-k8s.io \n"
            },
            (),
            "error: JobSet is already installed, served from namespace 'jobset-system' (ValidatingWebhookConfiguration "
            "jobset-validating-webhook-configuration), and Kubeflow Trainer's manifests bring their own into kubeflow-system",
        ),
        # the Kubeflow platform's Trainer (namespace kubeflow): use it, do not install a second one
        (
            {
                "FAKE_WEBHOOKS": "validator.trainer.kubeflow.org||kubeflow kubeflow kubeflow|trainer.kubeflow.org trainer.kubeflow.org trainer.kubeflow.org\n"
            },
            (),
            "error: Kubeflow Trainer is already installed, served from namespace 'kubeflow' (ValidatingWebhookConfiguration "
            "validator.trainer.kubeflow.org) — leave out --with trainer and use it if it is v2.3 or later",
        ),
        # Trainer from its Helm chart in the same namespace: kustomize's apply would fight the release
        (
            {"FAKE_WEBHOOKS": "kubeflow-trainer-validating-webhook|Helm|kubeflow-system|trainer.kubeflow.org\n"},
            (),
            "error: Kubeflow Trainer is installed by Helm in namespace 'kubeflow-system' (ValidatingWebhookConfiguration "
            "kubeflow-trainer-validating-webhook) — upgrade that release",
        ),
    ],
)
def test_with_trainer_refuses_before_any_change(tmp_path, env_file, env, args, message):
    proc, calls, _ = install(tmp_path, "--with", "trainer", *args, env={"KUBETUNE_ENV_FILE": str(env_file), **env})
    line = _one_error_line(proc)
    assert line.startswith(message), line
    assert "--with trainer" in line.split(" — ", 1)[1]  # the fix says how to go on without it
    _nothing_changed(calls)
    # the same cluster without --with trainer installs the rest
    proc, calls, _ = install(tmp_path, *args, env={"KUBETUNE_ENV_FILE": str(env_file), **env})
    assert proc.returncode == 0, proc.stderr
    assert not any(STEPS["trainer"](a) for a in calls)


def test_with_trainer_needs_git_even_when_the_training_operator_is_skipped(tmp_path, env_file):
    path = make_bin(tmp_path, git=False)
    proc, calls, _ = install(
        tmp_path,
        "--with",
        "trainer",
        "--skip",
        "training-operator",
        env={"KUBETUNE_ENV_FILE": str(env_file)},
        path=path,
    )
    assert _one_error_line(proc) == (
        "error: git not found on PATH — install git (kubectl -k fetches the Kubeflow Trainer manifests "
        "with it), or leave out --with trainer"
    )
    _nothing_changed(calls)


def test_with_takes_only_known_components_and_help_shows_it(tmp_path):
    proc, _, _ = install(tmp_path, "--with", "kueue")
    assert _one_error_line(proc) == (
        "error: --with 'kueue' is not an optional component — use trainer, kserve or katib"
    )
    proc, _, _ = install(tmp_path, "--with")
    assert proc.returncode != 0 and proc.stderr.startswith("error: --with needs a COMPONENT (trainer, kserve or katib)")
    proc, calls, _ = install(tmp_path, "--help")
    assert proc.returncode == 0 and calls == []
    assert "[--with trainer|kserve|katib]" in proc.stdout and "TRAINER_REF (v2.3.0, which ships" in proc.stdout
    assert "KSERVE_REF (v0.20.0)" in proc.stdout and "KATIB_REF (v0.19.0)" in proc.stdout
    assert proc.stdout.rstrip().endswith("JUPYTERHUB_CHART_VERSION (4.2.0).")  # the whole header, nothing after it


# ------------------------------------------------------------------------------- --with kserve (KServe)

KSERVE_RELEASE = "https://github.com/kserve/kserve/releases/download/v0.20.0"
# The kserve step, in order: the release manifests (CRDs, controller, webhooks), the CRDs established,
# the controller ready (its webhook certificate issued by cert-manager), then the cluster resources
# (the ClusterServingRuntimes, objects of those CRDs).
KSERVE_STEP = [
    ["kubectl", "apply", "--server-side", "-f", f"{KSERVE_RELEASE}/kserve.yaml"],
    [
        "kubectl",
        "wait",
        "--for=condition=established",
        "crd/inferenceservices.serving.kserve.io",
        "crd/clusterservingruntimes.serving.kserve.io",
        "--timeout=2m",
    ],
    ["kubectl", "-n", "kserve", "rollout", "status", "deployment/kserve-controller-manager", "--timeout=5m"],
    ["kubectl", "apply", "--server-side", "-f", f"{KSERVE_RELEASE}/kserve-cluster-resources.yaml"],
]


def test_with_kserve_installs_kserve_after_the_training_operator_idempotently(tmp_path, env_file):
    runs = [install(tmp_path, "--with", "kserve", env={"KUBETUNE_ENV_FILE": str(env_file)}) for _ in range(2)]
    (proc, calls, _), (_, calls2, _) = runs
    assert proc.returncode == 0, proc.stderr
    start = calls.index(KSERVE_STEP[0])
    assert calls[start : start + len(KSERVE_STEP)] == KSERVE_STEP
    assert (
        _index(calls, STEPS["training-operator"], "training-operator")
        < start
        < _index(calls, STEPS["jupyterhub"], "jupyterhub")
    )
    assert ["kubectl", "get", "crd", "certificates.cert-manager.io"] in calls[:start]  # checked before any change
    assert "==> 4/7 KServe v0.20.0" in proc.stdout and "kubetune render --serve" in proc.stdout
    piped = ["kubectl", "apply", "-f", "-"]
    assert [a for a in calls2 if a != piped] == [a for a in calls if a != piped]


def test_with_kserve_refuses_a_cluster_without_cert_manager_before_any_change(tmp_path, env_file):
    proc, calls, _ = install(
        tmp_path,
        "--with",
        "kserve",
        env={"KUBETUNE_ENV_FILE": str(env_file), "FAKE_MISSING_CRDS": "certificates.cert-manager.io"},
    )
    line = _one_error_line(proc)
    assert line.startswith("error: cert-manager is not installed on context 'fake-ctx'")
    assert line.endswith("or leave out --with kserve")
    _nothing_changed(calls)


# ------------------------------------------------------------------------------- --with katib (Katib)

KATIB_KUSTOMIZE = "github.com/kubeflow/katib.git/manifests/v1beta1/installs/katib-standalone?ref=v0.19.0"
# The katib step, in order: upstream's standalone install, its CRDs established, the DB, the db-manager
# and the controller (whose webhook admits Experiments) ready, then the jobs namespace labelled so that
# Katib's webhook admits Experiments there (`kubetune submit --tune`).
KATIB_STEP = [
    ["kubectl", "apply", "-k", KATIB_KUSTOMIZE],
    [
        "kubectl",
        "wait",
        "--for=condition=established",
        "crd/experiments.kubeflow.org",
        "crd/suggestions.kubeflow.org",
        "crd/trials.kubeflow.org",
        "--timeout=2m",
    ],
    ["kubectl", "-n", "kubeflow", "rollout", "status", "deployment/katib-mysql", "--timeout=5m"],
    ["kubectl", "-n", "kubeflow", "rollout", "status", "deployment/katib-db-manager", "--timeout=5m"],
    ["kubectl", "-n", "kubeflow", "rollout", "status", "deployment/katib-controller", "--timeout=5m"],
    ["kubectl", "label", "namespace", "kubetune", "katib.kubeflow.org/metrics-collector-injection=enabled",
     "--overwrite"],
]  # fmt: skip


def test_with_katib_installs_katib_and_labels_the_jobs_namespace_idempotently(tmp_path, env_file):
    runs = [install(tmp_path, "--with", "katib", env={"KUBETUNE_ENV_FILE": str(env_file)}) for _ in range(2)]
    (proc, calls, _), (_, calls2, _) = runs
    assert proc.returncode == 0, proc.stderr
    start = calls.index(KATIB_STEP[0])
    assert calls[start : start + len(KATIB_STEP)] == KATIB_STEP
    assert (
        _index(calls, STEPS["training-operator"], "training-operator")
        < start
        < _index(calls, STEPS["jupyterhub"], "jupyterhub")
    )
    assert "==> 4/7 Katib v0.19.0" in proc.stdout and "kubetune submit --tune" in proc.stdout
    piped = ["kubectl", "apply", "-f", "-"]
    assert [a for a in calls2 if a != piped] == [a for a in calls if a != piped]


def test_with_katib_needs_git_before_any_change(tmp_path, env_file):
    proc, calls, _ = install(
        tmp_path,
        "--with",
        "katib",
        "--skip",
        "training-operator",
        env={"KUBETUNE_ENV_FILE": str(env_file)},
        path=make_bin(tmp_path, git=False),
    )
    assert _one_error_line(proc) == (
        "error: git not found on PATH — install git (kubectl -k fetches the Katib manifests with it), or leave out "
        "--with katib"
    )
    _nothing_changed(calls)
