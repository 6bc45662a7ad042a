"""A 2-process `kubetune run` with Kubeflow Trainer v2.3's TrainJobStatus variables set, against the
FAKE status server of tests/fakes/trainer_status.py (real TLS on 127.0.0.1, the v2.3.0 CRD's schema;
no Trainer controller can run here), and `kubetune status` / `list` / the Python client reading
``status.trainerStatus`` back through the FAKE API server of tests/fakes/kube_api.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import MINILM, ROOT, kubetune, start_run, tiny_spec, write_spec
from fakes.kube_api import FakeKubeAPI
from fakes.objects import pod
from fakes.trainer_status import TrainerStatusServer, status_errors

# e2e: two runs reporting to the fake status server; make test covers the sender in process against the
# same server (test_trainer_status_pieces.py, test_trainer_status_hardening.py)
pytestmark = [pytest.mark.integration, pytest.mark.e2e]
NS = "team-a"
TRAINJOBS = ("trainer.kubeflow.org/v1alpha1", "trainjobs")
INTERVAL = 1.0


def _spec(small_csv, out, tmp_path, name: str = "tiny", **training):
    raw = tiny_spec(
        small_csv,
        out,
        training={"epochs": 2, "batch_size": 4, "log_every": 1, "eval_every": 6, "seed": 7, **training},
        kubernetes={"status_interval_s": INTERVAL},
    )
    raw["output"]["report_baseline"] = False
    raw["name"] = name
    return write_spec(tmp_path / f"{name}.yaml", raw)


def _no_token_anywhere(token: str, *texts: str, out=None) -> None:
    for text in texts:
        assert token not in text
    for path in out.rglob("*") if out else ():
        if path.is_file():
            assert token.encode() not in path.read_bytes(), path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, small_csv):
    """Two runs at the same time (each leaves a core idle while it starts): one reporting to a status
    server whose token rotates once the run has sent twice, one to a server that answers 500 three
    times, then 403 to the end. Yields (server, CompletedProcess, output, tokens, wall) for the first
    and (server, CompletedProcess, output, wall) for the second."""
    tmp = tmp_path_factory.mktemp("trainer-status")
    good = TrainerStatusServer(tmp / "server", namespace=NS, name="tiny")
    bad = TrainerStatusServer(tmp / "bad-server", namespace=NS, name="tiny", fail_with=[500] * 3 + [403] * 1000)
    with good, bad:
        first = good.token
        done = threading.Event()

        def rotate() -> None:
            while len(good.bodies()) < 2 and not done.is_set():
                time.sleep(0.05)
            good.rotate("token-1-" + "z" * 40)

        threading.Thread(target=rotate, daemon=True).start()
        # the second job has a name of its own (runs on this machine are recorded by name); both servers
        # are the TrainJob tiny's, as the Trainer names them in the URL
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "kubetune", "run", str(_spec(small_csv, tmp / out, tmp, name, max_steps=steps))],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
                env={**os.environ, **server.env()},
            )
            for server, out, name, steps in ((good, "out", "tiny", 12), (bad, "bad-out", "tiny-bad", 6))
        ]
        done_procs = []
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=600)
            done_procs.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
        done.set()
        yield (good, done_procs[0], tmp / "out", (first, good.token)), (bad, done_procs[1], tmp / "bad-out")


@pytest.fixture(scope="module")
def reported(runs):
    return runs[0]


def test_the_run_sends_start_periodic_and_final_updates(reported):
    server, proc, out, tokens = reported
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert tokens[0] != tokens[1]  # the token rotated during the run
    assert [r.code for r in server.received] == [200] * len(server.received)  # the new token was read
    bodies = server.bodies()
    assert all(status_errors(b) == [] for b in bodies)
    percents = [b["progressPercentage"] for b in bodies]
    assert percents[0] == 0 and percents[-1] == 100 and percents == sorted(percents)
    assert any(0 < p < 100 for p in percents), percents  # periodic ones between
    # the throttle: at most one request per interval, but for the final one
    times = [r.at for r in server.received]
    assert all(b - a >= INTERVAL - 0.05 for a, b in zip(times, times[1:-1])), times
    assert len(times) <= 2 + (times[-1] - times[0]) / INTERVAL
    print(f"{len(times)} requests over {times[-1] - times[0]:.1f} s, percentages {percents}")
    # the final update carries the run's final evaluation, the very numbers of metrics.json
    metrics = json.loads((out / "metrics.json").read_text())
    final = {m["name"]: m["value"] for m in bodies[-1]["metrics"]}
    evals = {k: v for k, v in metrics.items() if k.startswith("eval_") and isinstance(v, float)}
    assert evals and {k: float(final[k]) for k in evals} == evals
    assert final["step"] == final["total_steps"] == str(metrics["global_step"])
    assert bodies[-1]["estimatedRemainingSeconds"] == 0
    assert "trainer status: sending progress to https://127.0.0.1:" in proc.stderr
    assert "trainer status:" not in proc.stderr.replace("trainer status: sending progress", "")  # no failure
    for token in tokens:
        _no_token_anywhere(token, proc.stdout, proc.stderr, out=out)


def test_a_failing_server_neither_fails_nor_stops_the_run(runs):
    """500s, then 403s to the end: one warning line for each kind, the run finishes, exit 0."""
    s, proc, out = runs[1]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "metrics.json").read_text())["global_step"] > 0
    lines = [line for line in proc.stderr.splitlines() if "trainer status: " in line and "sending progress" not in line]
    assert len(lines) == 2, lines
    assert "answered HTTP 500" in lines[0] and "refused the token (HTTP 403" in lines[1]
    assert {r.code for r in s.received} == {500, 403}
    _no_token_anywhere(s.token, proc.stdout, proc.stderr, out=out)
    # not a timing test: benchmarks/trainer_status.py measures the step time against bad servers


# Slow: a resumed logger's first update continuing from its step, and a stop sent at once, are
# tests/unit/test_trainer_status_pieces.py's; SIGTERM's checkpoint and resume are test_pod_exit_codes.py's.
@pytest.mark.slow
def test_after_a_sigterm_and_resume_the_percentages_continue(tmp_path, small_csv):
    """Stopped by SIGTERM after its first updates (a checkpoint at the signal's step), then run again: the
    server sees one sequence of percentages that never goes back, ending at 100."""
    spec = _spec(small_csv, tmp_path / "out", tmp_path, max_steps=12)
    with TrainerStatusServer(tmp_path / "server", namespace=NS, name="tiny") as server:
        proc = start_run(spec, server.env())
        deadline = time.time() + 180
        while not any(0 < b["progressPercentage"] < 100 for b in server.bodies()):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 143, err[-3000:]
        stopped = len(server.bodies())
        again = kubetune("run", str(spec), env=server.env())
        assert again.returncode == 0, again.stderr[-3000:]
        assert "resumed from checkpoint step" in again.stderr
        percents = [b["progressPercentage"] for b in server.bodies()]
    print(f"percentages, stopped then resumed: {percents[:stopped]} | {percents[stopped:]}")
    assert percents == sorted(percents) and percents[-1] == 100
    assert 0 < percents[stopped] < 100  # the resumed run's first update continues where the stop left it


# ---- reading it back ----


@pytest.fixture
def cluster(tmp_path):
    from kubetune.training.events import Event, log_line

    with FakeKubeAPI() as server:
        server.kubeconfig = str(server.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS))
        spec = tmp_path / "cluster.yaml"
        spec.write_text(f"""
name: tiny
model: {{uri: "{MINILM}"}}
data: {{train: hf://acme/reviews, text_column: text, label_column: label}}
distributed: {{nodes: 1, procs_per_node: 2}}
kubernetes: {{storage: {{mode: pvc}}}}
output: {{uri: runs/tiny}}
""")
        proc = kubetune("submit", str(spec), "--target", "trainjob", "--kubeconfig", server.kubeconfig)
        assert proc.returncode == 0, proc.stderr
        server.put("v1", "pods", NS, pod("tiny-node-0-0", "tiny", "node", 0, namespace=NS))
        server.append_log(
            NS,
            "tiny-node-0-0",
            "pytorch",
            "12:00:01 [rank 0] INFO progress: step=10/30 epoch=1/1 loss=1.0986 lr=2.00e-05",
            "12:00:01 [rank 0] INFO "
            + log_line(Event("progress", 10, context={"step": 10, "total_steps": 30, "loss": 1.0986, "lr": 2e-05})),
        )
        yield server


def _status(cluster) -> dict:
    proc = kubetune("status", "tiny", "--json", "--kubeconfig", cluster.kubeconfig)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


RUNNING = {"conditions": [{"type": "Created", "status": "True", "reason": "Created", "message": "x"}]}


def test_status_reads_the_trainjobs_trainer_status_first_and_the_log_without_it(cluster, reported):
    server, _, out, _ = reported
    # without status.trainerStatus (an older Trainer, or the gate off): rank 0's log, as for a PyTorchJob
    cluster.set_status(*TRAINJOBS, NS, "tiny", RUNNING)
    st = _status(cluster)
    assert "source" not in st["progress"] and st["progress"]["step"] == 10
    # with it: what the run sent, percentage and all, without reading any log
    midway = next(b for b in server.bodies() if 0 < b["progressPercentage"] < 100)
    cluster.set_status(*TRAINJOBS, NS, "tiny", {**RUNNING, "trainerStatus": midway})
    st = _status(cluster)
    assert st["progress"]["source"] == "trainerStatus"
    assert st["progress"]["percent"] == midway["progressPercentage"]
    assert st["progress"]["step"] == int(next(m["value"] for m in midway["metrics"] if m["name"] == "step"))
    proc = kubetune("status", "tiny", "--kubeconfig", cluster.kubeconfig)
    assert "% done)" in proc.stdout and "  progress: step=" in proc.stdout
    proc = kubetune("list", "--target", "trainjob", "--kubeconfig", cluster.kubeconfig)
    assert proc.stdout.split()[:2] == ["tiny", "Created"] and proc.stdout.rstrip().endswith(
        f" {midway['progressPercentage']}%"
    )
    # finished: the final update's metrics are the run's metrics.json evaluation, through the Python client
    done = {"conditions": [{"type": "Complete", "status": "True", "reason": "Done", "message": "x"}]}
    cluster.set_status(*TRAINJOBS, NS, "tiny", {**done, "trainerStatus": server.applied})
    from kubetune import Client

    job = Client(backend="kubeflow", kubeconfig=cluster.kubeconfig).get("tiny")
    progress = job.progress()
    assert progress["percent"] == 100 and progress["phase"] == "succeeded"
    metrics = json.loads((out / "metrics.json").read_text())
    assert progress["metrics"] == {k: v for k, v in metrics.items() if k.startswith("eval_") and isinstance(v, float)}
    assert Client(backend="trainjob", kubeconfig=cluster.kubeconfig).list()[0]["progress"] == 100
