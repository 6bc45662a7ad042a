"""S3 / MinIO storage against moto's standalone server on 127.0.0.1: real HTTP, real boto3.
(No MinIO binary is reachable here; the code path is the same: endpoint_url + path-style.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import boto3
import pytest
from conftest import MINILM, ROOT, kubetune, tiny_spec, write_spec

from kubetune.artifacts.output import Output
from kubetune.errors import KubetuneError
from kubetune.providers import S3Settings, s3_upload
from kubetune.providers import s3 as s3p

pytestmark = pytest.mark.integration
BUCKET = "kubeflow-examples"
FAKE_SECRET = "moto-secret-value-0123456789"  # a credential value that must never be printed
ENV = S3Settings()  # nothing from a spec: the environment (S3_ENDPOINT_URL: the moto server) decides


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Moto:
    """A ThreadedMotoServer that can be stopped and started again on the same port (its data
    lives in this process, so it survives a restart, like a MinIO server restarting)."""

    def __init__(self):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = None

    def start(self):
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()

    def stop(self):
        self.server.stop()

    def set_auth(self, enabled: bool):
        """moto's own admin endpoint: authenticate every request from now on (or stop doing so)."""
        req = urllib.request.Request(
            f"{self.url}/moto-api/reset-auth",
            data=b"0" if enabled else b"inf",
            method="POST",
            headers={"Content-Type": "text/plain"},
        )  # a form content type would hide the body
        urllib.request.urlopen(req).read()


@pytest.fixture(scope="module")
def moto():
    env = {
        "AWS_ACCESS_KEY_ID": "AKIAKUBETUNETEST",
        "AWS_SECRET_ACCESS_KEY": FAKE_SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in [*env, "S3_ENDPOINT_URL", "KUBETUNE_S3_MAX_ATTEMPTS"]}
    server = Moto()
    server.start()
    os.environ.update(env, S3_ENDPOINT_URL=server.url)
    boto3.client("s3", endpoint_url=server.url).create_bucket(Bucket=BUCKET)
    yield server
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def s3(moto):
    return boto3.client("s3", endpoint_url=moto.url)


def _minilm_dir() -> Path:
    from kubetune import providers

    return providers.resolve(MINILM, kind="model", field="model.uri")


def test_model_directory_round_trip_and_no_second_download(moto, s3, tmp_path, monkeypatch):
    src = _minilm_dir()
    manifest = s3_upload.upload_dir(src, f"s3://{BUCKET}/models/minilm", settings=ENV)
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="models/minilm/")["Contents"]}
    assert f"models/minilm/{s3p.MANIFEST}" in keys and "models/minilm/model.safetensors" in keys
    assert manifest["files"]["model.safetensors"]["size"] == (src / "model.safetensors").stat().st_size
    from kubetune import providers

    local = providers.resolve(f"s3://{BUCKET}/models/minilm", kind="model", field="model.uri")
    for rel, meta in manifest["files"].items():
        assert s3p.sha256_file(local / rel) == meta["sha256"]
    monkeypatch.setattr(s3p, "_download", lambda *a, **k: (_ for _ in ()).throw(AssertionError("downloaded again")))
    assert providers.resolve(f"s3://{BUCKET}/models/minilm", kind="model", field="model.uri") == local


def test_dataset_prefix_and_single_object(moto, s3, small_csv):
    import pandas as pd

    from kubetune.tasks.classify import ClassificationData
    from kubetune.tasks.classify.data import load_frames

    df = pd.read_csv(small_csv)
    for i, part in enumerate((df.iloc[:80], df.iloc[80:])):
        s3.put_object(Bucket=BUCKET, Key=f"datasets/sentiment/part-{i}.csv", Body=part.to_csv(index=False).encode())
    f = load_frames(
        ClassificationData(train=f"s3://{BUCKET}/datasets/sentiment/", label_column="sentiment", eval_fraction=0.25),
        seed=0,
    )
    assert len(f.train) + len(f.eval) == 160
    f = load_frames(
        ClassificationData(
            train=f"s3://{BUCKET}/datasets/sentiment/part-1.csv", label_column="sentiment", eval_fraction=0.25
        ),
        seed=0,
    )
    assert len(f.train) + len(f.eval) == 80


def test_end_to_end_s3_in_s3_out_then_predict_and_pull(moto, s3, tmp_path, small_csv):
    s3_upload.upload_dir(_minilm_dir(), f"s3://{BUCKET}/models/minilm-e2e", settings=ENV)
    s3.upload_file(str(small_csv), BUCKET, "datasets/small.csv")
    spec = tiny_spec(
        f"s3://{BUCKET}/datasets/small.csv",
        f"s3://{BUCKET}/runs/tiny",
        model={"uri": f"s3://{BUCKET}/models/minilm-e2e"},
        training={"max_steps": 3, "batch_size": 8, "log_every": 1},
    )
    spec["s3"] = {"endpoint_url": moto.url}
    proc = kubetune("run", str(write_spec(tmp_path / "job.yaml", spec)), env={"S3_ENDPOINT_URL": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert FAKE_SECRET not in proc.stdout + proc.stderr
    keys = {
        o["Key"].removeprefix("runs/tiny/") for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="runs/tiny/")["Contents"]
    }
    assert {s3p.MANIFEST, "metrics.json", "report.html", "model/config.json", "model/model.safetensors"} <= keys
    pred = kubetune("predict", f"s3://{BUCKET}/runs/tiny", "what a great idea", "--json", "--endpoint-url", moto.url)
    assert pred.returncode == 0, pred.stderr
    assert json.loads(pred.stdout)[0]["label"] in {"negative", "neutral", "positive"}
    inner = kubetune(
        "predict", f"s3://{BUCKET}/runs/tiny/model", "what a great idea", "--json", "--endpoint-url", moto.url
    )  # the model/ inside
    assert inner.returncode == 0, inner.stderr
    assert json.loads(inner.stdout) == json.loads(pred.stdout)
    pulled = kubetune("pull", f"s3://{BUCKET}/runs/tiny", str(tmp_path / "pulled"), "--endpoint-url", moto.url)
    assert pulled.returncode == 0, pulled.stderr
    assert json.loads((tmp_path / "pulled" / "metrics.json").read_text())["global_step"] == 3


def test_each_call_reaches_the_endpoint_its_settings_name(moto, s3, tmp_path, monkeypatch):
    """The settings are passed, not set for the process: the endpoint they name wins over the
    environment's, and a call with other settings in between changes nothing for the next one."""
    from kubetune import providers

    s3.put_object(Bucket=BUCKET, Key="settings/a.csv", Body=b"text,label\nhi,a\n")
    dead = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    monkeypatch.setenv("S3_ENDPOINT_URL", dead)
    monkeypatch.setenv("KUBETUNE_S3_MAX_ATTEMPTS", "1")
    spec = S3Settings(endpoint_url=moto.url)
    uri = f"s3://{BUCKET}/settings/a.csv"
    assert s3p.read_text(uri, field="data.train", settings=spec) == "text,label\nhi,a\n"
    with pytest.raises(KubetuneError, match=f"cannot reach the S3 endpoint to read from bucket '{BUCKET}' at {dead}"):
        s3p.read_text(uri, field="data.train", settings=ENV)
    local = providers.resolve(uri, kind="dataset", field="data.train", s3=spec)
    assert local.read_bytes() == b"text,label\nhi,a\n"


def test_reader_refuses_an_artifact_without_manifest(moto, s3, tmp_path):
    s3.put_object(Bucket=BUCKET, Key="runs/partial/model/config.json", Body=b"{}")
    with pytest.raises(KubetuneError, match="has no _kubetune_manifest.json: the artifact is incomplete"):
        s3p.download(f"s3://{BUCKET}/runs/partial/", tmp_path / "p", field="MODEL", settings=ENV, require_manifest=True)


def test_server_stopped_mid_upload_errors_after_retries_and_leaves_no_manifest(moto, s3, tmp_path, monkeypatch):
    src = tmp_path / "artifact"
    src.mkdir()
    for i in range(40):
        (src / f"shard-{i:02d}.bin").write_bytes(os.urandom(256 * 1024))
    # A complete older artifact at the same place: it must stop looking complete.
    s3.put_object(Bucket=BUCKET, Key=f"runs/crash/{s3p.MANIFEST}", Body=b'{"files": {}}')
    monkeypatch.setenv("KUBETUNE_S3_MAX_ATTEMPTS", "3")
    stopped = threading.Event()

    def stop_after_first_objects():
        probe = boto3.client("s3", endpoint_url=moto.url)
        while probe.list_objects_v2(Bucket=BUCKET, Prefix="runs/crash/shard").get("KeyCount", 0) < 3:
            time.sleep(0.01)
        moto.stop()
        stopped.set()

    threading.Thread(target=stop_after_first_objects, daemon=True).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(KubetuneError) as e:
            s3_upload.upload_dir(src, f"s3://{BUCKET}/runs/crash", settings=ENV)
    finally:
        stopped.wait(10)
        moto.start()  # same port, same in-process data: as if the server came back
    assert (
        f"output.uri: cannot reach the S3 endpoint to upload to bucket '{BUCKET}' at {moto.url} (after retries)"
        in str(e.value)
    )
    assert time.monotonic() - t0 < 120
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="runs/crash/").get("Contents", [])}
    assert f"runs/crash/{s3p.MANIFEST}" not in keys
    assert 0 < len(keys) < 40  # a partial upload, which readers refuse:
    with pytest.raises(KubetuneError, match="incomplete"):
        s3p.download(f"s3://{BUCKET}/runs/crash/", tmp_path / "r", field="MODEL", settings=ENV, require_manifest=True)


def test_wrong_credentials_one_line(moto, tmp_path, small_csv):
    spec = write_spec(tmp_path / "job.yaml", tiny_spec(small_csv, f"s3://{BUCKET}/runs/denied"))
    moto.set_auth(True)
    try:
        proc = kubetune(
            "run",
            str(spec),
            env={"AWS_ACCESS_KEY_ID": "AKIAWRONGWRONGWRONG", "AWS_SECRET_ACCESS_KEY": "wrong-secret-value"},
        )
    finally:
        moto.set_auth(False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: output.uri: S3 refused to write to bucket '{BUCKET}' at {moto.url} (403) — check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the bucket policy"
    ]
    assert "wrong-secret-value" not in proc.stderr and "AKIAWRONG" not in proc.stderr


def test_missing_bucket_one_line(moto, tmp_path, small_csv):
    spec = write_spec(tmp_path / "job.yaml", tiny_spec(small_csv, "s3://no-such-bucket/runs/x"))
    proc = kubetune("run", str(spec))
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == f"error: output.uri: bucket 'no-such-bucket' at {moto.url} does not exist — create it (e.g. `mc mb local/no-such-bucket`) or fix the URI"
    )
    proc = kubetune("predict", "s3://no-such-bucket/runs/x", "hi")
    assert proc.returncode == 2 and f"bucket 'no-such-bucket' at {moto.url} does not exist" in proc.stderr


def _large_download_peak_rss(moto, s3, tmp_path, size_mb: int) -> tuple[int, int]:
    """Upload a generated object of ``size_mb`` and download it in a child process; returns
    (object bytes, the child's peak RSS in bytes)."""
    key = f"big/object-{size_mb}.bin"
    blob = tmp_path / "src.bin"
    with blob.open("wb") as f:
        chunk = os.urandom(1 << 20)
        for _ in range(size_mb):
            f.write(chunk)
    s3.upload_file(str(blob), BUCKET, key, Config=s3p.transfer_config())
    blob.unlink()
    # Peak memory from the child's own VmHWM: getrusage's ru_maxrss survives exec on Linux and
    # would report this (large, moto-holding) parent's peak instead.
    script = (
        "import re, sys; from pathlib import Path; from kubetune.providers import S3Settings, s3\n"
        f"p = s3.download('s3://{BUCKET}/{key}', Path(sys.argv[1]), field='data.train', settings=S3Settings())\n"
        "hwm = int(re.search(r'VmHWM:\\s+(\\d+) kB', Path('/proc/self/status').read_text()).group(1)) * 1024\n"
        "print(p.stat().st_size, hwm)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "dl" / "object.bin")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout
    size, rss = map(int, out.split())
    return size, rss


@pytest.mark.e2e  # the download path itself runs in every s3 test of make test
def test_large_download_memory_is_bounded(moto, s3, tmp_path):
    """Peak memory is a constant (~50 MiB interpreter + in-flight parts), not a share of the object."""
    size, rss = _large_download_peak_rss(moto, s3, tmp_path, 384)
    assert size == 384 << 20
    assert rss < 0.6 * size, f"peak RSS {rss >> 20} MiB for a {size >> 20} MiB object"


@pytest.mark.slow
def test_one_gigabyte_download_memory(moto, s3, tmp_path):
    size, rss = _large_download_peak_rss(moto, s3, tmp_path, 1024)
    print(f"\n1 GiB object: peak RSS of the downloading process {rss / 2**20:.0f} MiB ({rss / size:.1%} of the object)")
    assert size == 1 << 30
    assert rss < 0.25 * size


# ---- hostile listings and manifests: nothing is written outside the destination ----------------

ESCAPES = ["../../../../{tmp}/escaped", "/{tmp}/escaped", "./escaped", "a/../../escaped"]


@pytest.mark.parametrize("suffix", ESCAPES, ids=["dotdot", "double-slash", "dot", "inner-dotdot"])
def test_hostile_keys_under_a_downloaded_prefix_are_refused(moto, s3, tmp_path, suffix):
    """Someone with write access to the bucket adds a key under the prefix a job downloads."""
    from kubetune import providers

    prefix = f"hostile/{tmp_path.name}/data"
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/part-0.csv", Body=b"text,label\nhi,a\n")
    key = f"{prefix}/" + suffix.format(tmp=str(tmp_path).strip("/"))
    s3.put_object(Bucket=BUCKET, Key=key, Body=b"pwned")
    assert key in {
        o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]
    }  # the server kept it verbatim
    with pytest.raises(KubetuneError) as e:
        providers.resolve(f"s3://{BUCKET}/{prefix}/", kind="dataset", field="data.train")
    line = str(e.value)
    assert (
        line.startswith(f"data.train: bucket '{BUCKET}', key '{key}'") and "would write outside its destination" in line
    )
    assert not list(tmp_path.rglob("escaped")) and not (tmp_path / "escaped").exists()


def _artifact_with_manifest(s3, prefix: str, files: dict[str, bytes], listed: dict[str, bytes] | None = None) -> None:
    import hashlib

    for rel, body in files.items():
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{rel}", Body=body)
    listed = files if listed is None else listed
    manifest = {
        "format": "kubetune-artifact/1",
        "files": {rel: {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()} for rel, b in listed.items()},
    }
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{s3p.MANIFEST}", Body=json.dumps(manifest).encode())


def test_a_manifest_listing_a_path_outside_is_refused_by_pull_and_predict(moto, s3, tmp_path):
    rel = "../" * 12 + str(tmp_path).strip("/") + "/escaped"
    prefix = f"hostile/{tmp_path.name}/run"
    _artifact_with_manifest(s3, prefix, {"model/config.json": b"{}", rel: b"pwned"})
    for args in (
        ["pull", f"s3://{BUCKET}/{prefix}", str(tmp_path / "pulled")],
        ["predict", f"s3://{BUCKET}/{prefix}", "hi"],
    ):
        proc = kubetune(*args, "--endpoint-url", moto.url)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert (
            f"bucket '{BUCKET}'" in proc.stderr
            and "'../../" in proc.stderr
            and "would write outside its destination" in proc.stderr
        )
    # A manifest entry alone (no such key in the listing) is refused the same way, before any download.
    _artifact_with_manifest(
        s3, prefix + "-2", {"model/config.json": b"{}"}, listed={"model/config.json": b"{}", rel: b"pwned"}
    )
    with pytest.raises(KubetuneError, match=f"_kubetune_manifest.json of bucket '{BUCKET}' lists: the name '../../"):
        s3p.download(
            f"s3://{BUCKET}/{prefix}-2/", tmp_path / "pulled2", field="MODEL", settings=ENV, require_manifest=True
        )
    assert (
        not (tmp_path / "escaped").exists()
        and not (tmp_path / "pulled").exists()
        and not (tmp_path / "pulled2").exists()
    )


def test_a_tampered_file_never_takes_its_name(moto, s3, tmp_path):
    prefix = f"hostile/{tmp_path.name}/tampered"
    _artifact_with_manifest(s3, prefix, {"model/config.json": b"{}"}, listed={"model/config.json": b'{"x": 1}'})
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/model/config.json", Body=b'{"y": 2}')  # same size, other content
    with pytest.raises(KubetuneError, match="sha256 does not match the artifact's manifest"):
        s3p.download(f"s3://{BUCKET}/{prefix}/", tmp_path / "dl", field="MODEL", settings=ENV, require_manifest=True)
    assert not (tmp_path / "dl" / "model" / "config.json").exists()


def test_the_model_directory_inside_an_artifact_is_accepted(moto, s3, tmp_path):
    prefix = f"runs/{tmp_path.name}"
    _artifact_with_manifest(
        s3, prefix, {"model/config.json": b'{"a": 1}', "model/tokenizer.json": b"{}", "metrics.json": b"{}"}
    )
    got = s3p.download(
        f"s3://{BUCKET}/{prefix}/model/", tmp_path / "m", field="MODEL", settings=ENV, require_manifest=True
    )
    assert sorted(p.name for p in got.iterdir() if not p.name.startswith(".")) == [
        "_kubetune_manifest.json",
        "config.json",
        "tokenizer.json",
    ]
    assert (got / "config.json").read_bytes() == b'{"a": 1}'


def test_remote_checkpoint_clearing_deletes_only_what_its_manifest_lists(moto, s3, tmp_path):

    out = f"s3://{BUCKET}/ckpt/{tmp_path.name}"
    step = f"ckpt/{tmp_path.name}/checkpoints/step-00000003"
    _artifact_with_manifest(s3, step, {"state.pt": b"state", "COMPLETE": b"{}"})
    s3.put_object(Bucket=BUCKET, Key=f"{step}/notes-of-a-colleague.txt", Body=b"keep me")
    assert Output(out, "s3", tmp_path / "local", ENV).checkpoints.remote_steps() == [3]
    Output(out, "s3", tmp_path / "local").checkpoints.clear()
    left = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"ckpt/{tmp_path.name}/").get("Contents", [])}
    assert left == {f"{step}/notes-of-a-colleague.txt"}


def test_a_checkpoint_manifest_listing_a_path_outside_is_refused(moto, s3, tmp_path):

    out = f"s3://{BUCKET}/ckpt-evil/{tmp_path.name}"
    step = f"ckpt-evil/{tmp_path.name}/checkpoints/step-00000005"
    _artifact_with_manifest(s3, step, {"COMPLETE": b"{}", "../../../escaped": b"x"})
    with pytest.raises(KubetuneError, match="would write outside its destination"):
        Output(out, "s3", tmp_path / "local").checkpoints.latest()
    assert not list(tmp_path.rglob("escaped"))


@pytest.mark.parametrize(
    "setup, overwrite, expected",
    [
        (
            "foreign",
            False,
            "holds 1 objects that kubetune did not write (no .kubetune-output), e.g. 'thesis.tex' — pick a new output.uri, or pass --overwrite",
        ),
        ("foreign", True, "adopt"),
        ("finished", False, "holds a finished run (metrics.json, model/) — pick a new output.uri, or pass --overwrite"),
        ("finished", True, "replace"),
        ("empty", False, "new"),
    ],
)
def test_s3_output_prefix_ownership(moto, s3, tmp_path, setup, overwrite, expected):
    from kubetune.artifacts import output
    from kubetune.config import parse_spec

    prefix = f"owned/{tmp_path.name}"
    if setup == "foreign":
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/thesis.tex", Body=b"mine")
    elif setup == "finished":
        _artifact_with_manifest(s3, prefix, {"model/config.json": b"{}", "metrics.json": b"{}"})
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{output.MARKER}", Body=b"{}")
    spec = parse_spec(
        {
            "name": "t",
            "model": {"uri": "hf://o/m"},
            "data": {"train": "t.csv"},
            "output": {"uri": f"s3://{BUCKET}/{prefix}", "overwrite": overwrite},
        }
    )
    if " " in expected:
        with pytest.raises(KubetuneError) as e:
            Output.for_spec(spec).inspect(spec)
        assert expected in str(e.value) and str(e.value).startswith("output.uri: ")
    else:
        assert Output.for_spec(spec).inspect(spec).action == expected
    if setup == "foreign":
        assert s3.get_object(Bucket=BUCKET, Key=f"{prefix}/thesis.tex")["Body"].read() == b"mine"


@pytest.mark.e2e  # make test's S3 run: s3 in, s3 out, predict and pull above; the checkpoint store's s3 side below
def test_fsdp_checkpoint_shards_uploaded_by_every_rank_resume_on_a_new_machine(moto, s3, tmp_path):
    """FSDP with an s3:// output: every rank uploads its own shard, the manifest (written last by
    rank 0) lists them all, and a run whose local staging is gone resumes from the bucket."""
    import shutil
    import signal
    import subprocess
    import sys
    import time

    uri = f"s3://{BUCKET}/fsdp/{tmp_path.name}"
    spec = {
        "name": "fsdp-s3",
        "task": "causal-lm",
        "model": {"uri": "pkg://kubetune/assets/tiny-llama"},
        "data": {
            "train": "pkg://kubetune/assets/sentiment/sentiment-chat.jsonl",
            "format": "chat",
            "max_train_samples": 160,
        },
        "training": {"max_steps": 10, "batch_size": 4, "precision": "fp32", "checkpoint_every": 2, "log_every": 1},
        "distributed": {"procs_per_node": 2, "strategy": "fsdp"},
        "output": {"uri": uri},
    }
    path = write_spec(tmp_path / "job.yaml", spec)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kubetune", "run", str(path)],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    key = f"fsdp/{tmp_path.name}/checkpoints/step-00000002/{s3p.MANIFEST}"
    deadline = time.time() + 240
    while "Contents" not in s3.list_objects_v2(Bucket=BUCKET, Prefix=key):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    manifest = json.loads(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    assert {"shards/__0_0.distcp", "shards/__1_0.distcp", "shards/.metadata", "state.pt", "COMPLETE"} <= set(
        manifest["files"]
    )
    shutil.rmtree(Output.resolve(uri).local)  # a new pod: nothing local
    again = kubetune("run", str(path))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from checkpoint step" in again.stderr
    assert "Contents" not in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"fsdp/{tmp_path.name}/checkpoints/")


def _suite_on_s3(s3, tmp_path: Path) -> tuple[Path, str]:
    """The test task YAML (tests/data/lm_eval_tasks) over 12 reviews, locally and as s3://BUCKET/suite whose YAML
    names its data by s3:// URI: (the local directory, the data's URI)."""
    from conftest import lm_eval_tasks

    (tmp_path / "local").mkdir()
    local = lm_eval_tasks((tmp_path / "local").resolve(), 12)
    data = f"s3://{BUCKET}/suite/data/reviews.jsonl"
    s3.put_object(Bucket=BUCKET, Key="suite/data/reviews.jsonl", Body=(local / "reviews.jsonl").read_bytes())
    for f in sorted(local.glob("*.yaml")):
        text = f.read_text().replace(str(local / "reviews.jsonl"), data)
        assert data in text
        s3.put_object(Bucket=BUCKET, Key=f"suite/{f.name}", Body=text.encode())
    return local, data


@pytest.mark.e2e  # 2 processes of the harness: about 30 s
def test_kubetune_eval_on_two_processes_reads_an_s3_task_directory_through_its_endpoint_option(moto, s3, tmp_path):
    """`kubetune eval --procs 2 --include-path s3://... --endpoint-url URL`, with no S3 endpoint in the environment:
    the directory and its data are fetched once through the option, and both ranks score the local copy; the
    scores equal the local directory's."""
    local, _ = _suite_on_s3(s3, tmp_path)
    model = str(ROOT / "src" / "kubetune" / "assets" / "tiny-llama")
    common = ["eval", model, "--tasks", "kubetune_sentiment_mc", "--limit", "6", "--json"]
    env = {"S3_ENDPOINT_URL": "", "AWS_ENDPOINT_URL": "", "KUBETUNE_CACHE": str(tmp_path / "cache")}
    remote = kubetune(*common, "--include-path", f"s3://{BUCKET}/suite", "--procs", "2", "--endpoint-url", moto.url,
                      env=env)  # fmt: skip
    assert remote.returncode == 0, remote.stderr[-3000:]
    here = kubetune(*common, "--include-path", str(local), env=env)
    assert here.returncode == 0, here.stderr[-3000:]
    assert json.loads(remote.stdout)["results"] == json.loads(here.stdout)["results"]


def test_an_lm_eval_task_directory_on_s3_with_its_data_on_s3(moto, s3, tmp_path, monkeypatch):
    """evaluation.include_path / --include-path as an s3:// prefix whose task YAML names its data by s3:// URI:
    the harness reads local copies (a copy of the directory, in kubetune's cache, names them); nothing of the
    prefix or of its cached copy changes, and a second job fetches nothing again."""
    from kubetune.evaluation import harness

    monkeypatch.setenv("KUBETUNE_CACHE", str(tmp_path / "cache"))
    tasks = ["kubetune_sentiment_mc", "kubetune_sentiment_gen"]
    local, data = _suite_on_s3(s3, tmp_path)

    def docs(manager) -> dict[str, list]:
        loaded = manager.load(tasks)["tasks"]
        return {t.config.task: list(t.eval_docs) for t in loaded.values()}

    remote = harness.task_manager(f"s3://{BUCKET}/suite", tasks, field="evaluation", s3=ENV)
    assert docs(remote) == docs(harness.task_manager(str(local), tasks)) and len(docs(remote)[tasks[0]]) == 12
    staged = Path(remote.include_path[0] if isinstance(remote.include_path, list) else remote.include_path)
    assert staged.is_relative_to(tmp_path / "cache" / "lm_eval_tasks")
    assert "s3://" not in (staged / "kubetune_sentiment_mc.yaml").read_text()
    cached_prefix = tmp_path / "cache" / "s3" / BUCKET / "suite"
    assert data in (cached_prefix / "kubetune_sentiment_mc.yaml").read_text()  # the fetched prefix as it is
    monkeypatch.setattr(s3p, "_download", lambda *a, **k: (_ for _ in ()).throw(AssertionError("fetched again")))
    again = harness.task_manager(f"s3://{BUCKET}/suite", tasks, field="evaluation", s3=ENV)
    assert again.include_path == remote.include_path

    missing = f"s3://{BUCKET}/suite2/kubetune_sentiment_mc.yaml"
    text = (local / "kubetune_sentiment_mc.yaml").read_text().replace(str(local / "reviews.jsonl"), data + ".gone")
    s3.put_object(Bucket=BUCKET, Key=missing.split(f"{BUCKET}/", 1)[1], Body=text.encode())
    monkeypatch.undo()
    monkeypatch.setenv("KUBETUNE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(KubetuneError) as e:
        harness.task_manager(f"s3://{BUCKET}/suite2", tasks[:1], field="evaluation", s3=ENV)
    assert e.value.field == "evaluation.include_path" and "reviews.jsonl.gone" in str(e.value)
    assert "\n" not in str(e.value)
