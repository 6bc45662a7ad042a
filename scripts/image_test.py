"""`make image-test`: build the trainer image for real with podman and run it as a cluster would.

1. Tools: podman, buildah, runc and debootstrap (apt-get install when missing, as root), and a
   CONTAINERS_CONF for this kind of host: runc (crun refuses a cgroup v1 hybrid host) and explicit
   ulimits (without CAP_SYS_RESOURCE podman's default nofile limit fails).
2. The base: docker/base/make-base.sh debootstraps Debian bookworm with Python (Docker Hub, where
   the production base python:3.11-slim-bookworm lives, cannot be reached from here).
3. The CPU image, built from docker/Dockerfile with BASE_IMAGE and TORCH_INDEX build arguments, pip
   seeing what this host's pip sees (its CA bundle and `pip config list` settings, mounted into the
   build) and tagged as rendered manifests name it (ghcr.io/kubetune/trainer:<version>-cpu).
4. Smoke test as uid 1000 with no network: `kubetune --help`, `validate` of every example, a 2-step
   training run and `predict` on its output.
5. The CUDA build's check: VARIANT=cuda where only the CPU wheel can be had must fail the build with
   its one-line error (a CPU wheel never ships under a -cuda tag).
6. Pods as containers: a 2-node PyTorchJob rendered by kubetune runs exactly as rendered, each pod
   its init container then its main container, on an --internal network where the containers reach
   each other by name and nothing else: the ConfigMap's job.yaml mounted where the pod mounts it, a
   workspace directory per pod for its emptyDir, the container env plus the environment the Training
   Operator injects (PET_*, MASTER_ADDR/PORT, WORLD_SIZE, RANK). Both finish with world size 2. Then a
   longer job: SIGTERM to the Worker container during training gives exit 143 (>= 128: the operator's
   restart policy restarts it), the checkpoint it wrote is there, and restarted pods resume from it.

Prints a summary (times, image size and layers, exit codes); exit 1 on the first failure, with the
reason on one line. Usage: python scripts/image_test.py [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
ENGINE = os.environ.get("ENGINE", "podman")
BASE = os.environ.get("BASE_IMAGE", "localhost/kubetune-base:bookworm")
TORCH_VERSION = "2.13.0"  # docker/Dockerfile's TORCH_VERSION
PACKAGES = ("podman", "runc", "debootstrap")  # podman builds with buildah's library, not its command
CONTAINERS_CONF = """[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
"""
EXIT_PREEMPTED = 143
summary: list[str] = []


class Failed(Exception):
    pass


def run(*cmd: str, check: bool = True, timeout: float | None = 1800, log: Path | None = None, **kw):
    if log is not None:
        with log.open("w") as f:
            r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, timeout=timeout, **kw)
        if check and r.returncode:
            tail = log.read_text().splitlines()[-15:]
            raise Failed(f"{' '.join(cmd[:3])} ... exited {r.returncode} (log {log}):\n" + "\n".join(tail))
        return r
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode:
        raise Failed(f"{' '.join(cmd[:4])} ... exited {r.returncode}: {(r.stderr or r.stdout)[-2000:]}")
    return r


def note(line: str) -> None:
    print(line, flush=True)
    summary.append(line)


# ---------------------------------------------------------------- 1. tools


def ensure_tools(work: Path) -> None:
    missing = [p for p in PACKAGES if not shutil.which(p)]
    if missing:
        if os.geteuid() != 0:
            raise Failed(f"{', '.join(missing)} missing and not root: apt-get install {' '.join(PACKAGES)}")
        t = time.monotonic()
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        # not checked: a third-party list that cannot be fetched fails `update`, not the install below
        run("apt-get", "update", "-q", env=env, log=work / "apt-update.log", check=False)
        run("apt-get", "install", "-y", "-q", *PACKAGES, env=env, log=work / "apt-install.log")
        note(f"tools: installed {' '.join(missing)} in {time.monotonic() - t:.0f} s")
    if "CONTAINERS_CONF" not in os.environ:
        conf = work / "containers.conf"
        conf.write_text(CONTAINERS_CONF)
        os.environ["CONTAINERS_CONF"] = str(conf)


# ---------------------------------------------------------------- 2-3. base and build


def make_base() -> None:
    t = time.monotonic()
    r = run(str(ROOT / "docker" / "base" / "make-base.sh"), BASE, env={**os.environ, "ENGINE": ENGINE})
    note(f"{r.stdout.strip().splitlines()[-1]} ({time.monotonic() - t:.0f} s)")


def pip_mounts(work: Path) -> list[str]:
    """Build-time volumes that make the build's pip see what this host's pip sees: a pip.conf with
    this host's effective settings, the CA bundle, and every local path those settings name."""
    out = run(sys.executable, "-m", "pip", "config", "list").stdout
    settings: dict[str, str] = {}
    # the files' settings first, then PIP_* (":env:"), which pip lets override them
    for line in sorted(out.splitlines(), key=lambda line: line.startswith(":env:")):
        key, _, value = line.partition("=")
        name = key.split(".", 1)[-1]
        if name and name not in ("disable-pip-version-check",):
            settings[name] = value.strip().strip("'\"")
    cert = settings.get("cert") or os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt"
    settings["cert"] = cert
    conf = work / "pip.conf"
    conf.write_text("[global]\n" + "".join(f"{k} = {v}\n" for k, v in sorted(settings.items())))
    paths = {cert}
    for key in ("constraint", "find-links", "index-url", "extra-index-url", "requirement"):
        for item in settings.get(key, "").split():
            path = item.removeprefix("file://")
            if path.startswith("/"):
                # a file:// index's root: its parent directory of "simple"
                paths.add(str(Path(path).parent) if path.rstrip("/").endswith("/simple") else path)
    mounts = [f"{conf}:/etc/pip.conf:ro"]
    mounts += [f"{p}:{p}:ro" for p in sorted(paths) if Path(p).exists()]
    local_cpu = any(
        Path(d).is_dir() and any(Path(d).glob(f"torch-{TORCH_VERSION}+cpu-*.whl"))
        for d in settings.get("find-links", "").replace("file://", "").split()
    )
    return [arg for m in mounts for arg in ("-v", m)], local_cpu


def torch_index(local_cpu: bool) -> str:
    """$TORCH_INDEX, else: with torch's +cpu wheel in this host's find-links, the host's default index
    (the local wheel wins by version order, and pip makes no 75 s of retries of an unreachable
    PyTorch index); without it, the PyTorch CPU index, as production builds."""
    return os.environ.get("TORCH_INDEX") or (
        "https://pypi.org/simple" if local_cpu else "https://download.pytorch.org/whl/cpu"
    )


def build(variant: str, tag: str, work: Path, mounts: list[str], index: str, check: bool = True):
    args = [
        ENGINE,
        "build",
        "-f",
        str(ROOT / "docker" / "Dockerfile"),
        "--build-arg",
        f"BASE_IMAGE={BASE}",
        "--build-arg",
        f"VARIANT={variant}",
        "--build-arg",
        f"TORCH_INDEX={index}",
        *mounts,
        "-t",
        tag,
        str(ROOT),
    ]
    t = time.monotonic()
    r = run(*args, check=check, log=work / f"build-{variant}.log")
    return r, time.monotonic() - t


def image_facts(tag: str) -> str:
    size, layers = run(ENGINE, "image", "inspect", tag, "--format", "{{.Size}} {{len .RootFS.Layers}}").stdout.split()
    return f"{int(size) / 1e9:.2f} GB, {layers} layers"


# ---------------------------------------------------------------- 4. smoke test


def smoke(tag: str) -> None:
    examples = sorted((ROOT / "examples").glob("*.yaml"))
    base = [ENGINE, "run", "--rm", "--network", "none", "--user", "1000", "--shm-size", "1g"]
    base += ["-v", f"{ROOT / 'examples'}:/examples:ro", tag]
    r = run(*base, "kubetune", "--help")
    assert_(("Usage: kubetune" in r.stdout), "kubetune --help in the image printed no usage")
    script = " && ".join(f"kubetune validate /examples/{p.name}" for p in examples)
    r = run(*base, "sh", "-c", script)
    assert_(r.stdout.split() == ["ok"] * len(examples), f"validate in the image: {r.stdout[-500:]}")
    t = time.monotonic()
    train = (
        "id -u && kubetune run /examples/causal-tiny-chat.yaml --set training.max_steps=2 "
        "--set data.max_train_samples=64 --set output.uri=/workspace/out "
        "&& kubetune predict /workspace/out 'What is the sentiment of this review? Great crew' "
        "--json --max-new-tokens 4 "
        # the image serves too: kubetune serve on the container's loopback, one chat completion
        "&& (kubetune serve /workspace/out --port 8123 >/dev/null 2>&1 &) && python -c " + shlex.quote(SERVE_CHECK)
    )
    r = run(*base, "sh", "-c", train, check=False)
    out = r.stdout
    assert_(r.returncode == 0, f"training in the image exited {r.returncode}: {r.stderr[-1500:]}")
    assert_(out.splitlines()[0] == "1000", "the container did not run as uid 1000")
    result = json.loads(out[out.index("[") : out.index("SERVED ")])
    assert_("completion" in result[0], f"predict gave {result}")
    served = json.loads(out[out.index("SERVED ") + 7 :].splitlines()[0])
    want = result[0]["completion"]
    assert_(served["choices"][0]["message"]["content"] == want, f"kubetune serve gave {served}, predict {want!r}")
    note(
        f"smoke test (uid 1000, --network none): --help, validate of {len(examples)} examples, a 2-step "
        f"training run, predict, and kubetune serve answering as predict ({time.monotonic() - t:.0f} s)"
    )


# Run inside the container: waits for `kubetune serve` to be ready, asks for predict's completion (greedy,
# 4 tokens, the same prompt as a user turn) and prints the answer after "SERVED ".
SERVE_CHECK = """
import json, time, urllib.request as u
for _ in range(600):
    try:
        u.urlopen("http://127.0.0.1:8123/ready", timeout=2)
        break
    except OSError:
        time.sleep(0.2)
body = {"messages": [{"role": "user", "content": "What is the sentiment of this review? Great crew"}],
        "max_tokens": 4, "temperature": 0}
req = u.Request("http://127.0.0.1:8123/v1/chat/completions", data=json.dumps(body).encode(),
                headers={"content-type": "application/json"})
print("SERVED " + u.urlopen(req, timeout=120).read().decode())
"""


def assert_(ok: bool, why: str) -> None:
    if not ok:
        raise Failed(why)


# ---------------------------------------------------------------- 6. pods as containers


class Pods:
    """A rendered PyTorchJob's Master and Worker pods as containers on an internal network."""

    def __init__(self, spec: dict, work: Path, tag: str):
        from kubetune.backends.kubeflow import manifests
        from kubetune.config import load_spec

        self.work = work / spec["name"]
        self.work.mkdir()
        path = self.work / "job.yaml"
        path.write_text(yaml.safe_dump(spec))
        loaded = load_spec(path)
        rendered = manifests.render(loaded, "default", "pytorchjob")
        self.name, self.output_uri = loaded.name, loaded.output.uri
        self.job = rendered.job
        self.etc = self.work / "etc"  # the ConfigMap, as the volume mounts it
        self.etc.mkdir()
        for key, text in rendered.config_map["data"].items():
            (self.etc / key).write_text(text)
        self.net = f"kt-{self.name}"
        self.replicas = self.job["spec"]["pytorchReplicaSpecs"]
        nodes = sum(r["replicas"] for r in self.replicas.values())
        nproc = self.job["spec"]["nprocPerNode"]
        self.pods = []  # (container name, node rank, pod spec, workspace)
        for role in ("Master", "Worker"):
            for i in range(self.replicas.get(role, {}).get("replicas", 0)):
                rank = len(self.pods)
                pod = self.replicas[role]["template"]["spec"]
                main = pod["containers"][0]
                assert_(main["image"] == tag, f"the manifest runs {main['image']}, not the built {tag}")
                ws = self.work / f"{role.lower()}-{i}"
                ws.mkdir()
                os.chown(ws, 1000, 1000)  # the emptyDir, writable under fsGroup 1000
                self.pods.append((f"{self.name}-{role.lower()}-{i}", rank, pod, ws))
        master = f"{self.name}-master-0"
        # what the operator reads from the manifest: the replicas, nprocPerNode and the Master's port
        ports = self.replicas["Master"]["template"]["spec"]["containers"][0].get("ports", [])
        port = str(next(p["containerPort"] for p in ports if p["name"] == "pytorchjob-port"))
        # What the Training Operator injects (pkg/controller.v1/pytorch/envvar.go, elastic off: PET_* for
        # torchrun); tests/integration/test_pod_exit_codes.py sets the same for processes
        self.operator_env = lambda rank: {
            "MASTER_ADDR": master,
            "MASTER_PORT": port,
            "WORLD_SIZE": str(nodes * int(nproc)),
            "RANK": str(rank),
            "PET_MASTER_ADDR": master,
            "PET_MASTER_PORT": port,
            "PET_NNODES": str(nodes),
            "PET_NPROC_PER_NODE": str(nproc),
            "PET_NODE_RANK": str(rank),
        }
        # last: a failure above leaves nothing to remove (close() runs only for a constructed Pods); a
        # network a killed earlier test left behind is replaced
        run(ENGINE, "network", "rm", "-f", self.net, check=False)
        run(ENGINE, "network", "create", "--internal", self.net)

    def _args(self, name: str, container: dict, pod: dict, ws: Path, rank: int | None) -> list[str]:
        user = pod.get("securityContext", {}).get("runAsUser", 1000)
        args = ["--name", name, "--hostname", name, "--network", self.net, "--user", str(user)]
        for mount in container.get("volumeMounts", []):
            volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
            if "configMap" in volume:
                args += ["-v", f"{self.etc}:{mount['mountPath']}:ro"]
            elif volume.get("emptyDir", {}).get("medium") == "Memory":
                args += ["--shm-size", "2g"] if mount["mountPath"] == "/dev/shm" else ["--tmpfs", mount["mountPath"]]
            elif "persistentVolumeClaim" in volume:  # one claim, every pod's (ReadWriteMany)
                claim = self.work / f"claim-{volume['persistentVolumeClaim']['claimName']}"
                if not claim.exists():
                    claim.mkdir()
                    os.chown(claim, 1000, 1000)
                args += ["-v", f"{claim}:{mount['mountPath']}"]
            else:  # an emptyDir: the pod's own
                args += ["-v", f"{ws}:{mount['mountPath']}"]
        env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
        if rank is not None:
            env.update(self.operator_env(rank))
        for k, v in env.items():
            args += ["-e", f"{k}={v}"]
        if container.get("workingDir"):
            args += ["--workdir", container["workingDir"]]
        return args

    def start(self, init: bool = True) -> None:
        """Every pod's init container to completion (``init``), then every main container, detached.
        Without ``init``: the main containers restarted in their pods (restartPolicy OnFailure: the
        init containers do not run again, and the emptyDir keeps what the containers wrote)."""
        for name, rank, pod, ws in self.pods if init else ():
            first = pod["initContainers"][0]
            run(ENGINE, "rm", "-f", f"{name}-init", check=False)
            run(
                ENGINE,
                "run",
                "--rm",
                *self._args(f"{name}-init", first, pod, ws, None),
                first["image"],
                *first["command"],
            )
        for name, rank, pod, ws in self.pods:
            main = pod["containers"][0]
            run(ENGINE, "rm", "-f", name, check=False)
            run(ENGINE, "run", "-d", *self._args(name, main, pod, ws, rank), main["image"], *main["command"])

    def wait(self, timeout: float = 600) -> dict[str, int]:
        codes = {}
        for name, *_ in self.pods:
            r = run(ENGINE, "wait", name, timeout=timeout)
            codes[name] = int(r.stdout.strip())
        return codes

    def logs(self, name: str) -> str:
        r = run(ENGINE, "logs", name, check=False)
        return r.stdout + r.stderr

    def output(self) -> Path:
        """The output directory on the Master pod's workspace, or on the claim (output.uri is relative
        to /workspace)."""
        claims = list(self.work.glob("claim-*"))
        return (claims[0] if claims else self.pods[0][3]) / self.output_uri

    def running(self, name: str) -> bool:
        return run(ENGINE, "inspect", "-f", "{{.State.Running}}", name, check=False).stdout.strip() == "true"

    def close(self) -> None:
        for name, *_ in self.pods:
            (self.work / f"{name}.log").write_text(self.logs(name))  # kept with --keep, or on a failure
            run(ENGINE, "rm", "-f", name, f"{name}-init", check=False)
        run(ENGINE, "network", "rm", "-f", self.net, check=False)


def pods_as_containers(tag: str, work: Path) -> None:
    example = yaml.safe_load((ROOT / "examples" / "causal-tiny-chat.yaml").read_text())
    example["distributed"] = {"nodes": 2, "procs_per_node": 1}
    example["data"]["max_train_samples"] = 96
    example["training"].update(max_steps=4, log_every=1)
    example["kubernetes"] = {"image": tag}

    t = time.monotonic()
    pods = Pods({**example, "name": "pods-demo"}, work, tag)
    try:
        pods.start()
        codes = pods.wait()
        logs = pods.logs("pods-demo-master-0")
        assert_(list(codes.values()) == [0, 0], f"pods exited {codes}: {logs[-1500:]}")
        metrics = json.loads((pods.output() / "metrics.json").read_text())
        assert_(metrics["world_size"] == 2 and metrics["global_step"] == 4, f"metrics: {metrics}")
        # the internal network: the containers reach each other by name, and nothing else
        r = run(ENGINE, "run", "--rm", "--network", pods.net, tag, "python", "-c", _REACH, check=False)
        note(
            f"pods as containers (PyTorchJob Master + Worker, init then main, internal network): exit codes "
            f"{list(codes.values())}, world size {metrics['world_size']}, {metrics['global_step']} steps "
            f"({time.monotonic() - t:.0f} s); outside the network: {r.stdout.strip()}"
        )
        assert_(r.stdout.strip() == "unreachable", f"the internal network reached out: {r.stdout} {r.stderr[-300:]}")
    finally:
        pods.close()

    t = time.monotonic()
    # A checkpoint every pod can read: the output on a shared claim (node-local output is refused on resume).
    example["training"].update(max_steps=40, checkpoint_every=20, log_every=1)
    example["data"]["max_train_samples"] = 800
    example["kubernetes"]["storage"] = {"mode": "pvc", "existing_claim": "shared-runs"}
    pods = Pods({**example, "name": "pods-sigterm"}, work, tag)
    try:
        pods.start()
        # step 3 in the history on the claim (reading a file, not the Master's whole log, and no busy wait)
        history, deadline = pods.output() / "history.jsonl", time.monotonic() + 300
        while not (history.exists() and history.read_text().count('"type": "train"') >= 3):
            assert_(pods.running("pods-sigterm-master-0"), "the Master stopped before step 3")
            assert_(time.monotonic() < deadline, "no training step 3 in the Master's history")
            time.sleep(0.2)
        run(ENGINE, "kill", "--signal", "TERM", "pods-sigterm-worker-0")
        codes = pods.wait()
        for name, *_ in pods.pods:  # the first attempt's logs: the restart recreates the containers
            (pods.work / f"{name}.first.log").write_text(pods.logs(name))
        # every rank stops at the same step after a checkpoint: both exit 143, which the operator retries
        assert_(list(codes.values()) == [EXIT_PREEMPTED] * 2, f"SIGTERM to the Worker: exit codes {codes}")
        steps = sorted(p.name for p in (pods.output() / "checkpoints").glob("step-*") if (p / "COMPLETE").exists())
        assert_(bool(steps), "no complete checkpoint after SIGTERM")
        # restartPolicy OnFailure / ExitCode: the operator restarts both pods' containers (exit >= 128)
        pods.start(init=False)
        again = pods.wait()
        log = pods.logs("pods-sigterm-master-0")
        assert_(list(again.values()) == [0, 0], f"restarted pods exited {again}: {log[-1500:]}")
        assert_(f"resumed from checkpoint step {int(steps[-1][5:])}" in log, "the restarted pods did not resume")
        metrics = json.loads((pods.output() / "metrics.json").read_text())
        note(
            f"SIGTERM to the Worker container at step >= 3: exit codes {list(codes.values())} (Master, Worker), "
            f"checkpoint {steps[-1]}; restarted pods resumed from it and finished {metrics['global_step']} steps "
            f"with exit codes {list(again.values())} ({time.monotonic() - t:.0f} s)"
        )
    finally:
        pods.close()


_REACH = """
import socket
try:
    socket.create_connection(("pypi.org", 443), timeout=5)
    print("reachable")
except OSError:
    print("unreachable")
"""


# ---------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, pod workspaces)")
    args = ap.parse_args()
    from kubetune.config.cluster import default_image

    tag = default_image(0)
    work = Path(tempfile.mkdtemp(prefix="kubetune-image-test-", dir="/var/tmp"))
    t0 = time.monotonic()
    try:
        ensure_tools(work)
        make_base()
        mounts, local_cpu = pip_mounts(work)
        index = torch_index(local_cpu)
        _, seconds = build("cpu", tag, work, mounts, index)
        steps = sum(1 for line in (work / "build-cpu.log").read_text().splitlines() if line.startswith("STEP "))
        note(f"image {tag}: built in {seconds:.0f} s ({steps} Dockerfile steps), {image_facts(tag)}")
        smoke(tag)
        if local_cpu and "TORCH_INDEX" not in os.environ:  # only the CPU wheel can be had: pip takes it silently
            r, seconds = build("cuda", "localhost/kubetune-cuda-check", work, mounts, index, check=False)
            log = (work / "build-cuda.log").read_text().splitlines()
            error = [line for line in log if line.startswith("error: VARIANT")]
            assert_(r.returncode != 0 and bool(error), "the CUDA build with only the CPU wheel did not fail its check")
            note(f"VARIANT=cuda with only the CPU wheel: the build fails ({seconds:.0f} s): {error[0][:110]}...")
        else:  # the build would download the real CUDA wheel (gigabytes), which the check then accepts
            note("VARIANT=cuda check: not run (no local CPU-only torch wheel to make the CUDA build take it)")
        pods_as_containers(tag, work)
    except Exception as e:  # one line and where the logs are, whatever failed
        print(
            f"error: image test: {type(e).__name__ if not isinstance(e, Failed) else ''} {e}".strip(), file=sys.stderr
        )
        print(f"logs in {work}", file=sys.stderr)
        return 1
    print(f"\nimage test passed in {time.monotonic() - t0:.0f} s:")
    for line in summary:
        print(f"  - {line}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
