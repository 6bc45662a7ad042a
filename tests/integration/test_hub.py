"""hf:// output: a real run pushes to a FAKE Hugging Face Hub (tests/fakes/hf_hub.py) on
127.0.0.1, with huggingface_hub pointed at it through HF_ENDPOINT; the real Hub is unreachable."""

from __future__ import annotations

import json

import pytest
from conftest import MINILM, kubetune, tiny_spec, write_spec
from fakes.hf_hub import FakeHub

pytestmark = pytest.mark.integration


@pytest.fixture
def hub():
    with FakeHub() as server:
        yield server


def _hub_env(hub, token=None):
    # HF_HUB_OFFLINE=0: pushing needs the (fake) Hub. Xet off: the fake speaks plain LFS for big files.
    return {"HF_ENDPOINT": hub.url, "HF_TOKEN": token or hub.token, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1"}


def _local_model() -> str:
    from kubetune import providers

    return str(providers.resolve(MINILM, kind="model", field="model.uri"))  # online mode would ask the fake Hub for it


def test_push_model_tokenizer_and_card_then_pull_and_predict(hub, tmp_path, small_csv):
    spec = tiny_spec(
        small_csv,
        "hf://kubetune-bot/sentiment-tiny",
        model={"uri": _local_model()},
        training={"max_steps": 2, "batch_size": 8, "log_every": 1},
    )
    spec["output"].update(hf_private=True, commit_message="first fine-tune")
    proc = kubetune("run", str(write_spec(tmp_path / "job.yaml", spec)), env=_hub_env(hub))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert hub.token not in proc.stdout + proc.stderr
    files = hub.files("kubetune-bot/sentiment-tiny")
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "README.md",
        "kubetune/metrics.json",
        "kubetune/job.yaml",
    } <= set(files)
    assert hub.repo("kubetune-bot/sentiment-tiny")["private"] is True
    assert [c["message"] for c in hub.commits("kubetune-bot/sentiment-tiny")][-1] == "first fine-tune"
    card = files["README.md"].decode()
    assert "pipeline_tag: text-classification" in card and "eval_accuracy" in card and "name: tiny" in card
    assert json.loads(files["config.json"])["id2label"] == {"0": "negative", "1": "neutral", "2": "positive"}

    pulled = kubetune("pull", "hf://kubetune-bot/sentiment-tiny", str(tmp_path / "pulled"), env=_hub_env(hub))
    assert pulled.returncode == 0, pulled.stderr
    assert (tmp_path / "pulled" / "model.safetensors").read_bytes() == files["model.safetensors"]
    pred = kubetune("predict", str(tmp_path / "pulled"), "this is great", "--json")
    assert pred.returncode == 0 and json.loads(pred.stdout)[0]["label"] in {"negative", "neutral", "positive"}


def test_rejected_token_fails_before_training(hub, tmp_path, small_csv):
    spec = tiny_spec(small_csv, "hf://kubetune-bot/x", model={"uri": _local_model()})
    proc = kubetune(
        "run", str(write_spec(tmp_path / "job.yaml", spec)), env=_hub_env(hub, token="hf_wrong_token_value")
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: output.uri: the Hub at {hub.url} rejected the token (401) — check HF_TOKEN"
    assert "hf_wrong_token_value" not in proc.stderr


def test_offline_mode_and_missing_token_are_one_line(tmp_path, small_csv):
    spec = write_spec(tmp_path / "job.yaml", tiny_spec(small_csv, "hf://kubetune-bot/x", model={"uri": _local_model()}))
    proc = kubetune("run", str(spec))  # the suite runs with HF_HUB_OFFLINE=1
    assert proc.returncode == 2 and "HF_HUB_OFFLINE=1 is set, so nothing can be pushed" in proc.stderr
    proc = kubetune("run", str(spec), env={"HF_HUB_OFFLINE": "0", "HF_TOKEN": "", "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert proc.returncode == 2 and "needs a Hugging Face token — set HF_TOKEN" in proc.stderr
