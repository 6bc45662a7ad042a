"""Issue 45, row 8: every file kubetune reads on an operator's or a model's behalf is a regular file of
bounded size (``kubetune.paths.read_regular``), or one line says what it is instead: a token file
(`serve --token-file`, ``KUBEFLOW_TRAINER_SERVER_TOKEN`` and its CA), and a model folder's config,
tokenizer and weight files at `run` (the base model) and at `predict`/`serve` load time.

The hostile files are real: /dev/zero, links to it, FIFOs, 2 GB sparse files. Before the fix a read of
/dev/zero grew without end and a FIFO blocked forever, so the calls run in ONE child process capped at
1 GiB of data and a wall-clock limit: there the old code ends in a MemoryError or a timeout, never
eats the machine, and the whole file stays fast (one interpreter for every case)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kubetune.errors import KubetuneError

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "src" / "kubetune" / "assets" / "tiny-llama"
SPARSE = 2 << 30  # a 2 GB sparse file: nothing written to disk, 2 GB to stat and to read
SERVE_FIX = "pass a regular file that holds just the token, or set $KUBETUNE_SERVE_TOKEN"
MODEL_FIX = "replace it with the file save_pretrained wrote"

# The child: each case's code runs in turn; it prints what the case said (warnings logged, the error
# raised) as one JSON line, flushed, so a case that hangs still leaves the earlier cases' answers.
CHILD = r"""
import json, logging, resource, sys
resource.setrlimit(resource.RLIMIT_DATA, (1 << 30, 1 << 30))
said = []
class Keep(logging.Handler):
    def emit(self, record):
        said.append(record.getMessage())
logging.getLogger().addHandler(Keep())
logging.getLogger().setLevel(logging.WARNING)
from kubetune.errors import KubetuneError
for name, code in json.loads(sys.argv[1]):
    said.clear()
    try:
        exec(code, {})
    except KubetuneError as e:
        said.append(f"error: {e}")
    except BaseException as e:
        said.append(f"{type(e).__name__}: {e}")
    print(json.dumps({"case": name, "said": list(said)}), flush=True)
"""
CHILD_TIMEOUT_S = 90  # generous for a loaded machine; the fixed code answers every case in seconds


def _model(root: Path, name: str) -> Path:
    """A copy of the packaged tiny Llama (config, tokenizer, weights), to damage."""
    d = root / name
    shutil.copytree(LLAMA, d)
    return d


def _fifo(path: Path) -> Path:
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


def _sparse(path: Path, size: int = SPARSE) -> Path:
    path.unlink(missing_ok=True)
    with path.open("wb") as f:
        f.truncate(size)
    return path


def _zero_link(path: Path) -> Path:
    path.unlink(missing_ok=True)
    path.symlink_to("/dev/zero")
    return path


def _serve(path: Path) -> str:
    return f"from pathlib import Path\nfrom kubetune.cli.serve import _token\n_token(Path({str(path)!r}))"


def _status(token: Path, ca: Path) -> str:
    """The reporter as a worker builds it, from the Trainer controller's variables; one update, closed."""
    env = {
        "KUBEFLOW_TRAINER_SERVER_URL": "https://127.0.0.1:9/apis/trainer.kubeflow.org/v1alpha1/x",
        "KUBEFLOW_TRAINER_SERVER_CA_CERT": str(ca),
        "KUBEFLOW_TRAINER_SERVER_TOKEN": str(token),
    }
    return (
        "from kubetune.training.trainer_status import Endpoint, StatusReporter\n"
        f"r = StatusReporter(Endpoint.from_env({env!r}), interval_s=60).start()\n"
        "r.update({'step': 1, 'total_steps': 2})\n"
        "r.close(wait_s=3)"
    )


def _run(model: Path, out: Path) -> str:
    """What `kubetune run` does with the base model before any worker starts."""
    spec = {"name": "t", "model": {"uri": str(model)}, "data": {"train": "t.csv"}, "output": {"uri": str(out)}}
    return f"from kubetune import artifacts\nfrom kubetune.config import parse_spec\nartifacts.resolve_model(parse_spec({spec!r}))"


def _predict(model: Path) -> str:
    """What `kubetune predict` and `serve` check before transformers reads the model."""
    return (
        f"from pathlib import Path\nfrom kubetune.inference.model import check_model\ncheck_model(Path({str(model)!r}))"
    )


def _cases(d: Path) -> dict[str, tuple[str, str]]:
    """case -> (the code the child runs, the one line it must say). The cases that blocked or read
    without end on the old code come last, so the earlier ones still answer there."""
    zero, big, fifo = Path("/dev/zero"), _sparse(d / "big"), _fifo(d / "fifo")
    link = _zero_link(d / "token-link")
    good_token = d / "token"
    good_token.write_text("t0k3n\n")
    models = {name: _model(d, name) for name in ("r1", "r2", "r3", "r4", "r5", "p1", "p2", "p3", "p4")}
    _zero_link(models["r1"] / "config.json")
    _fifo(models["r2"] / "config.json")
    _zero_link(models["r3"] / "tokenizer.json")
    _sparse(models["r4"] / "tokenizer.json")
    _fifo(models["r5"] / "model.safetensors")
    _zero_link(models["p1"] / "tokenizer.json")
    _fifo(models["p2"] / "tokenizer_config.json")
    _zero_link(models["p3"] / "config.json")
    _fifo(models["p4"] / "config.json")
    status = "trainer status: the {} file {} — "
    return {
        "serve: --token-file a 2 GB sparse file": (
            _serve(big),
            f"error: --token-file: {big} is too large: {SPARSE:,} bytes, limit 65,536 — {SERVE_FIX}",
        ),
        "trainer status: the token file a 2 GB sparse file": (
            _status(big, good_token),
            status.format("token", f"{big} is too large: {SPARSE:,} bytes, limit 65,536"),
        ),
        "run: tokenizer.json a 2 GB sparse file": (
            _run(models["r4"], d / "o4"),
            f"error: model.uri: {models['r4']}/tokenizer.json is too large: {SPARSE:,} bytes, "
            f"limit 134,217,728 — {MODEL_FIX}",
        ),
        "run: config.json a link to /dev/zero": (
            _run(models["r1"], d / "o1"),
            f"error: model.uri: {models['r1']}/config.json (a link to /dev/zero) is a character device, "
            f"not a regular file — {MODEL_FIX}",
        ),
        "run: config.json a FIFO": (
            _run(models["r2"], d / "o2"),
            f"error: model.uri: {models['r2']}/config.json is a FIFO (named pipe), not a regular file — {MODEL_FIX}",
        ),
        "run: tokenizer.json a link to /dev/zero": (
            _run(models["r3"], d / "o3"),
            f"error: model.uri: {models['r3']}/tokenizer.json (a link to /dev/zero) is a character device, "
            f"not a regular file — {MODEL_FIX}",
        ),
        "run: model.safetensors a FIFO": (
            _run(models["r5"], d / "o5"),
            f"error: model.uri: {models['r5']}/model.safetensors is a FIFO (named pipe), not a regular file "
            f"— {MODEL_FIX}",
        ),
        "predict: tokenizer.json a link to /dev/zero": (
            _predict(models["p1"]),
            f"error: MODEL: {models['p1']}/tokenizer.json (a link to /dev/zero) is a character device, "
            f"not a regular file — {MODEL_FIX}",
        ),
        "predict: tokenizer_config.json a FIFO": (
            _predict(models["p2"]),
            f"error: MODEL: {models['p2']}/tokenizer_config.json is a FIFO (named pipe), not a regular file "
            f"— {MODEL_FIX}",
        ),
        "serve: --token-file /dev/zero": (
            _serve(zero),
            f"error: --token-file: /dev/zero is a character device, not a regular file — {SERVE_FIX}",
        ),
        "serve: --token-file a link to /dev/zero": (
            _serve(link),
            f"error: --token-file: {link} (a link to /dev/zero) is a character device, not a regular file "
            f"— {SERVE_FIX}",
        ),
        "trainer status: the token file /dev/zero": (
            _status(zero, good_token),
            status.format("token", "/dev/zero is a character device, not a regular file"),
        ),
        "predict: config.json a link to /dev/zero": (
            _predict(models["p3"]),
            f"error: MODEL: {models['p3']}/config.json (a link to /dev/zero) is a character device, "
            f"not a regular file — {MODEL_FIX}",
        ),
        "trainer status: the token file a FIFO": (
            _status(fifo, good_token),
            status.format("token", f"{fifo} is a FIFO (named pipe), not a regular file"),
        ),
        "trainer status: the CA file a FIFO": (
            _status(good_token, fifo),
            status.format("CA", f"{fifo} is a FIFO (named pipe), not a regular file"),
        ),
        "predict: config.json a FIFO": (
            _predict(models["p4"]),
            f"error: MODEL: {models['p4']}/config.json is a FIFO (named pipe), not a regular file — {MODEL_FIX}",
        ),
        "serve: --token-file a FIFO": (
            _serve(fifo),
            f"error: --token-file: {fifo} is a FIFO (named pipe), not a regular file — {SERVE_FIX}",
        ),
    }


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> dict[str, tuple[str, list[str] | None]]:
    """case -> (what it must say, what it said; None where the child was stopped before it answered)."""
    cases = _cases(tmp_path_factory.mktemp("hostile-files"))
    payload = json.dumps([(name, code) for name, (code, _) in cases.items()])
    try:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, payload], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S
        ).stdout
    except subprocess.TimeoutExpired as e:  # a case blocked: the answers before it stand
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
    said = {}
    for line in out.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            said[rec["case"]] = rec["said"]
    return {name: (expected, said.get(name)) for name, (_, expected) in cases.items()}


CASE_NAMES = [
    *(f"serve: --token-file {w}" for w in ("/dev/zero", "a link to /dev/zero", "a FIFO", "a 2 GB sparse file")),
    *(f"trainer status: the token file {w}" for w in ("/dev/zero", "a FIFO", "a 2 GB sparse file")),
    "trainer status: the CA file a FIFO",
    "run: config.json a link to /dev/zero",
    "run: config.json a FIFO",
    "run: tokenizer.json a link to /dev/zero",
    "run: tokenizer.json a 2 GB sparse file",
    "run: model.safetensors a FIFO",
    "predict: config.json a link to /dev/zero",
    "predict: config.json a FIFO",
    "predict: tokenizer.json a link to /dev/zero",
    "predict: tokenizer_config.json a FIFO",
]


@pytest.mark.parametrize("case", CASE_NAMES)
def test_a_hostile_file_is_one_line_never_read_whole_never_waited_on(answers, case):
    expected, said = answers[case]
    assert said is not None, "no answer: the child was stopped (a FIFO blocked it, or it ran out of time)"
    assert len(said) == 1, said
    if expected.startswith("trainer status: "):  # then the fix and the retry interval
        assert said[0].startswith(expected), said
    else:
        assert said[0] == expected


# ------------------------------------------------------------------------------------ the helper itself


def test_read_regular_reads_a_regular_file_and_follows_links(tmp_path):
    from kubetune.paths import read_regular

    (tmp_path / "f").write_bytes(b"x" * 10)
    (tmp_path / "l").symlink_to(tmp_path / "f")
    assert read_regular(tmp_path / "l", field="F", limit=10, fix="fix") == b"x" * 10
    assert read_regular(tmp_path / "f", field="F", limit=100, fix="fix") == b"x" * 10


@pytest.mark.parametrize(
    "make, said",
    [
        (lambda d: _fifo(d / "p"), "F: {d}/p is a FIFO (named pipe), not a regular file — fix it"),
        (lambda d: _zero_link(d / "z"), "F: {d}/z (a link to /dev/zero) is a character device, not a regular file"),
        (lambda d: _sparse(d / "s", 11), "F: {d}/s is too large: 11 bytes, limit 10 — fix it"),
    ],
)
def test_read_regular_refuses_in_one_line(tmp_path, make, said):
    from kubetune.paths import check_regular, read_regular

    path = make(tmp_path)
    for call in (read_regular, check_regular):
        with pytest.raises(KubetuneError) as e:
            call(path, field="F", limit=10, fix="fix it")
        assert str(e.value).startswith(said.format(d=tmp_path))


def test_read_regular_leaves_missing_files_and_directories_to_the_caller(tmp_path):
    from kubetune.paths import read_regular

    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "missing", field="F", limit=10, fix="fix")
    with pytest.raises(OSError) as e:
        read_regular(tmp_path, field="F", limit=10, fix="fix")
    assert e.value.errno == errno.EISDIR


def test_a_weight_file_has_no_size_bound_and_a_hub_snapshot_passes(tmp_path):
    """Weights are large by nature: only their kind is checked. Links that resolve to regular files
    (a Hub snapshot's, into its blob store) are what a model folder usually is."""
    from kubetune.artifacts import check_model_files

    model = tmp_path / "snapshot"
    model.mkdir()
    for f in LLAMA.iterdir():
        (model / f.name).symlink_to(f)
    (model / "model.safetensors").unlink()
    _sparse(model / "model.safetensors", SPARSE)
    (model / "onnx").mkdir()  # folders are not read as model files
    _fifo(model / "onnx" / "model.onnx")
    check_model_files(model, field="model.uri")


def test_serves_name_never_reads_a_huge_or_special_job_yaml(tmp_path):
    """`kubetune serve` names the model from job.yaml beside model/: a 2 GB (sparse) job.yaml there was read
    whole; it, a FIFO and a link to /dev/zero now fall back to the directory's name without being read."""
    import tracemalloc

    from kubetune.cli.serve import _job_name

    model = tmp_path / "run" / "model"
    model.mkdir(parents=True)
    job = tmp_path / "run" / "job.yaml"
    job.write_text("name: mine\n")
    assert _job_name(model) == "mine"
    with job.open("r+b") as f:
        f.truncate(2 << 30)
    tracemalloc.start()
    try:
        assert _job_name(model) == "run"
        assert tracemalloc.get_traced_memory()[1] < 64 << 20  # was: 2 GiB read into memory
    finally:
        tracemalloc.stop()
    job.unlink()
    os.mkfifo(job)
    assert _job_name(model) == "run"
    job.unlink()
    job.symlink_to("/dev/zero")
    assert _job_name(model) == "run"
