"""`kubetune serve` for real: the CLI started as a user starts it, on 127.0.0.1, over HTTP.

The causal LMs are the session's tiny-chat SFT run and its DPO example run (LoRA) on the SFT model (served
merged, and as base + adapter); the classifier is the session's MiniLM run. Greedy completions (raw and
chat, streaming and not) equal `kubetune predict`'s token for token, the classifier's KServe v1 and v2
answers equal predict's labels and scores; the OpenAI Python client talks to it unchanged; bad input is
a 4xx with one message and the server goes on; a bearer token is required where set; under load (200
requests, 16 clients, a small queue) no request is lost, the 429s are counted, and /metrics agrees.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT, _free_port, kubetune

pytestmark = pytest.mark.integration
PROMPTS = [
    "What is the sentiment of this review? The crew was lovely",
    "What is the sentiment of this review? My flight was delayed for six hours",
    "What is the sentiment of this review? The car has four wheels",
]
TEXTS = ["I love how smooth this ride is", "I would never trust a self-driving car with my kids", "It is a car"]
TOKEN = "serve-test-token-0123"


class Server:
    def __init__(self, model: Path, *args: str, env: dict | None = None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kubetune", "serve", str(model), "--port", str(self.port), *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
        )

    def wait(self, timeout: float = 120) -> Server:
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.proc.poll() is None, self.proc.communicate()[1][-3000:]
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=2):
                    return self
            except OSError:
                time.sleep(0.2)
        raise AssertionError("the server did not become ready")

    def call(self, path: str, body=None, token: str | None = None, raw: bytes | None = None) -> tuple[int, dict]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.url + path, data=data, method="POST" if data is not None else "GET")
        req.add_header("content-type", "application/json")
        if token:
            req.add_header("authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                text = r.read().decode()
                return r.status, json.loads(text) if text.startswith("{") else {"text": text}
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read().decode())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()


@pytest.fixture(scope="module")
def servers(tiny_chat_sft, dpo_example, minilm_run, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("serve-token") / "token"
    token_file.write_text(TOKEN + "\n")
    started = {
        "sft": Server(tiny_chat_sft[0], "--token-file", str(token_file)),
        # also the one under load and bad input: a small queue, small batches, a 64 KiB body bound
        "dpo": Server(dpo_example[0], "--max-queue", "4", "--max-batch", "4", "--max-request-kb", "64"),
        "dpo-adapter": Server(dpo_example[0], "--adapter", "--name", "dpo-adapter"),
        "minilm": Server(minilm_run[0], "--name", "minilm"),
    }
    try:
        yield {name: s.wait() for name, s in started.items()}
    finally:
        for s in started.values():
            s.stop()


def _predict(model: Path, *args: str) -> list[dict]:
    r = kubetune("predict", str(model), *args, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def _sse(server: Server, path: str, body: dict, token: str | None = None) -> tuple[str, str]:
    """The streamed text and finish reason of a server-sent-events answer."""
    req = urllib.request.Request(server.url + path, data=json.dumps({**body, "stream": True}).encode(), method="POST")
    req.add_header("content-type", "application/json")
    if token:
        req.add_header("authorization", f"Bearer {token}")
    text, finish = "", None
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.read().decode().splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice.get("text") or choice.get("delta", {}).get("content") or ""
            finish = choice["finish_reason"] or finish
    return text, finish


@pytest.mark.parametrize("which", ["sft", "dpo"])
def test_greedy_completions_equal_predict_token_for_token(servers, tiny_chat_sft, dpo_example, which):
    server, model = servers[which], {"sft": tiny_chat_sft[0], "dpo": dpo_example[0]}[which]
    token = TOKEN if which == "sft" else None
    chat = _predict(model, *PROMPTS, "--max-new-tokens", "24")
    raw = _predict(model, *PROMPTS, "--max-new-tokens", "24", "--no-chat")
    for prompt, want_chat, want_raw in zip(PROMPTS, chat, raw):
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0}
        status, out = server.call("/v1/chat/completions", body, token)
        assert status == 200, out
        assert out["choices"][0]["message"]["content"] == want_chat["completion"]
        assert _sse(server, "/v1/chat/completions", body, token) == (
            want_chat["completion"],
            out["choices"][0]["finish_reason"],
        )
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
        status, out = server.call("/v1/completions", body, token)
        assert status == 200 and out["choices"][0]["text"] == want_raw["completion"], out
        assert _sse(server, "/v1/completions", body, token)[0] == want_raw["completion"]
        assert out["usage"]["completion_tokens"] <= 24


def test_a_lora_export_serves_as_base_plus_adapter(servers):
    status, out = servers["dpo-adapter"].call(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[0]}], "temperature": 0}
    )
    assert status == 200 and out["model"] == "dpo-adapter", out
    assert out["choices"][0]["message"]["content"].strip() in {"negative", "neutral", "positive"}, out


def test_the_classifier_answers_kserve_v1_and_v2_as_predict_does(servers, minilm_run):
    want = _predict(minilm_run[0], *TEXTS)
    server = servers["minilm"]
    status, v1 = server.call("/v1/models/minilm:predict", {"instances": TEXTS})
    assert status == 200, v1
    assert [p["label"] for p in v1["predictions"]] == [w["label"] for w in want]
    assert [p["score"] for p in v1["predictions"]] == pytest.approx([w["score"] for w in want], abs=1e-5)
    body = {"id": "r1", "inputs": [{"name": "text", "shape": [3], "datatype": "BYTES", "data": TEXTS}]}
    status, v2 = server.call("/v2/models/minilm/infer", body)
    assert status == 200 and v2["id"] == "r1" and v2["model_name"] == "minilm", v2
    labels, scores = v2["outputs"]
    assert labels["data"] == [w["label"] for w in want] and labels["shape"] == [3]
    assert scores["data"] == pytest.approx([w["score"] for w in want], abs=1e-5)
    assert server.call("/v2/models/minilm/ready")[1]["ready"] is True
    assert server.call("/v2/health/ready")[0] == 200


def test_the_openai_client_talks_to_it_unchanged(servers):
    import openai

    client = openai.OpenAI(base_url=servers["sft"].url + "/v1", api_key=TOKEN)
    [model] = [m.id for m in client.models.list()]
    done = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert done.choices[0].finish_reason in ("stop", "length") and done.usage.completion_tokens <= 8
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=8, temperature=0
    )
    streamed = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=8, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=servers["sft"].url + "/v1", api_key="wrong").models.list()


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/v1/completions", b"{not json", 400, "JSON"),
        ("/v1/completions", {"prompt": 7}, 400, "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 10**9}, 400, "over this server's limit"),
        ("/v1/completions", {"prompt": "word " * 4000, "max_tokens": 8}, 400, "context"),
        ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "'gpt-4' is not served here"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 30}, 400, "logprobs"),
        ("/v1/completions", {"prompt": [[5, 99999]]}, 400, "token id 99999 is outside this model's vocabulary"),
        ("/v1/completions", {"prompt": [[]]}, 400, "prompt"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 1, "stream": True}, 400, "without stream"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ],
)
def test_bad_input_is_a_4xx_with_one_message_and_the_server_goes_on(servers, path, body, status, message):
    server = servers["dpo"]
    raw = body if isinstance(body, bytes) else None
    got, out = server.call(path, None if raw else body, raw=raw)
    assert got == status, out
    assert message in out["error"]["message"] and "\n" not in out["error"]["message"], out
    assert server.call("/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 0})[0] == 200


def test_a_token_is_required_where_set_and_a_body_is_bounded(servers):
    sft = servers["sft"]
    status, out = sft.call("/v1/models")
    assert status == 401 and "bearer token" in out["error"]["message"]
    assert sft.call("/v1/models", token="wrong")[0] == 401
    assert sft.call("/health")[0] == 200  # probes need no token
    big = {"prompt": "x" * (100 << 10)}
    assert servers["dpo"].call("/v1/completions", big)[0] == 413


def test_under_load_no_request_is_lost_and_429s_are_counted(servers):
    server = servers["dpo"]
    body = {"prompt": "The seats were", "max_tokens": 8, "temperature": 0}

    def one(_):
        t = time.perf_counter()
        status, out = server.call("/v1/completions", body)
        return status, time.perf_counter() - t, out

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(200)))
    statuses = [s for s, _, _ in results]
    assert len(results) == 200 and set(statuses) <= {200, 429}, set(statuses)
    ok, rejected = statuses.count(200), statuses.count(429)
    assert ok > 0 and rejected > 0  # 16 clients against a queue of 4
    texts = {out["choices"][0]["text"] for s, _, out in results if s == 200}
    assert len(texts) == 1  # greedy: every answered request the same completion
    metrics = server.call("/metrics")[1]["text"]
    counted = {
        code: sum(
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("kubetune_requests_total{")
            and '"/v1/completions"' in line
            and f'status="{code}"' in line
        )
        for code in ("200", "429")
    }
    assert counted["429"] >= rejected and counted["200"] >= ok
    assert "kubetune_batch_size_bucket" in metrics and "kubetune_queue_depth" in metrics
    print(f"serve under load: {ok} answered, {rejected} answered 429")


def test_echo_and_logprobs_score_token_id_prompts_as_the_model_does(servers, tiny_chat_sft):
    """What evaluation clients send (lm-eval's local-completions): prompts as token-id lists, several at once,
    ``echo`` with ``logprobs``, ``max_tokens`` 0 or 1. Each prompt token's log-probability (after the first,
    which has none) is the model's own log-softmax at the position before it; the token made last; the top
    alternative of a greedy token is that token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tiny_chat_sft[0] / "model"
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = [tok.encode(p) for p in PROMPTS[:2]]
    status, out = servers["sft"].call(
        "/v1/completions",
        {"prompt": prompts, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True},
        TOKEN,
    )
    assert status == 200, out
    for ids, choice in zip(prompts, sorted(out["choices"], key=lambda c: c["index"])):
        with torch.no_grad():
            want = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
        for t in range(1, len(ids)):
            assert abs(lp["token_logprobs"][t] - want[t - 1, ids[t]].item()) < 1e-4
        made = lp["token_logprobs"][-1]
        assert abs(made - want[-1].max().item()) < 1e-4  # greedy: the most likely token
        assert made == max(lp["top_logprobs"][-1].values())
        assert choice["text"].startswith(tok.decode(ids, skip_special_tokens=True))
    status, out = servers["sft"].call(
        "/v1/completions", {"prompt": prompts[0], "max_tokens": 0, "echo": True, "logprobs": 0}, TOKEN
    )
    assert status == 200, out
    lp = out["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(prompts[0]) and out["usage"]["completion_tokens"] == 0
