"""`kubetune serve`'s pieces without a server (issue 45): the batcher queues a request all or none, hands each
item its own error and tells the engine when an item is given up; the engine stops a given-up generation at
its next token and a classifier text that fails fails alone; the open inference protocol v2 codec takes and
gives what Triton's reference client sends and reads (its own encoder and decoder are used here); a bad
request is one line naming where. (tests/integration/test_serve_hardening.py runs the real server.)"""

from __future__ import annotations

import asyncio
import json
import struct
import threading
from pathlib import Path

import pytest

from kubetune.inference.server import protocol as api
from kubetune.inference.server import v2
from kubetune.inference.server.batcher import Batcher, QueueFull

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "src" / "kubetune" / "assets" / "tiny-llama"
TEXTS = ["I love it", "It is a car", "Never again ünïcödé"]

# ---------------------------------------------------------------- batcher


def _blocked_batcher(max_batch: int = 1, **kw) -> tuple[Batcher, threading.Event, list]:
    """A batcher (no wait, 3 queued at most) whose engine call waits for the event, recording each batch;
    it answers p * 10 for a payload p, and its own error for the payload 2."""
    release, seen = threading.Event(), []

    def run(payloads):
        seen.append(list(payloads))
        release.wait(10)
        return [ValueError(f"bad {p}") if p == 2 else p * 10 for p in payloads]

    return Batcher(run, max_batch=max_batch, max_wait_s=0, max_queue=3, **kw), release, seen


def test_a_request_is_queued_all_or_none():
    async def main():
        batcher, release, seen = _blocked_batcher()
        try:
            first = batcher.enqueue([(1, None)])
            while batcher.running == 0:  # the worker holds it; the queue is empty again
                await asyncio.sleep(0.01)
            waiting = batcher.enqueue([(3, None), (4, None)])
            with pytest.raises(QueueFull):
                batcher.enqueue([(5, None), (6, None)])  # room for one: neither is queued
            assert batcher.depth == 2
            release.set()
            assert await asyncio.gather(*first, *waiting) == [10, 30, 40]
            assert seen == [[1], [3], [4]]
        finally:
            release.set()
            batcher.close()

    asyncio.run(main())


def test_each_item_gets_its_own_error_and_a_given_up_item_is_not_computed():
    async def main():
        cancelled = []
        batcher, release, seen = _blocked_batcher(max_batch=3, on_cancel=cancelled.append)
        try:
            running = batcher.enqueue([(0, None)])
            while batcher.running == 0:
                await asyncio.sleep(0.01)
            items = batcher.enqueue([(1, None), (2, None), (3, None)])
            items[2].cancel()  # its request timed out while it waited
            await asyncio.sleep(0)
            assert cancelled == [3]
            release.set()
            assert await running[0] == 0 and await items[0] == 10
            with pytest.raises(ValueError, match="bad 2"):
                await items[1]  # its own error; 1, in its batch, was answered
            assert seen == [[0], [1, 2]]  # 3 was never computed
        finally:
            release.set()
            batcher.close()

    asyncio.run(main())


# ---------------------------------------------------------------- engine


def test_a_given_up_generation_stops_at_its_next_token_and_its_batch_goes_on():
    from kubetune.inference.causal import Generation, Generator

    engine = Generator(LLAMA)
    ids = engine.encode("The seats were")
    gone, kept = Generation(ids, 12), Generation(ids, 12)
    gone.on_token = lambda token: len(gone.tokens) == 3 and gone.cancelled.set()
    engine.run([gone, kept])
    assert len(gone.tokens) == 3
    alone = Generation(ids, 12)
    engine.run([alone])
    assert kept.tokens == alone.tokens and len(alone.tokens) > 3  # the other row went on to its own end
    everyone = [Generation(ids, 12) for _ in range(2)]
    for g in everyone:
        g.cancelled.set()
    engine.run(everyone)  # all given up before their first token: nothing kept
    assert [g.tokens for g in everyone] == [[], []]


def test_a_text_the_classifier_cannot_take_fails_alone():
    from kubetune.inference.classifier import Classifier

    def pipe(texts, **kw):
        if any("\ud800" in t for t in texts):
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, ...]")
        return [{"label": "pos", "score": 0.5} for _ in texts]

    engine = Classifier.__new__(Classifier)  # the pipeline replaced: only the batch-splitting is under test
    engine.pipe, engine.context, engine._lock = pipe, 16, threading.Lock()
    out = engine.run(["fine", "a\ud800", "good"])
    assert out[0] == out[2] == {"label": "pos", "score": 0.5} and isinstance(out[1], TypeError)


# ---------------------------------------------------------------- protocol: one line naming where


@pytest.mark.parametrize(
    ("model", "body", "message"),
    [
        (api.CompletionRequest, {"prompt": "hi", "temperature": 1e-300}, "temperature: 1e-300 is too small"),
        (api.CompletionRequest, {"prompt": "hi", "seed": 2**70}, "seed: 1180591620717411303424 is outside"),
        (api.CompletionRequest, {"prompt": "hi", "seed": -(2**63) - 1}, "seed: "),
        (api.CompletionRequest, {"prompt": ["a", "b\ud800"]}, "prompt[1]: a lone surrogate '\\ud800' at character 1"),
        (api.CompletionRequest, {"prompt": 7}, "prompt: Input should be a valid string"),
        (api.CompletionRequest, {"prompt": "x", "logprobs": 21}, "logprobs: Input should be less than or equal to 20"),
        (api.CompletionRequest, {"prompt": "x", "top_logprobs": 2}, "top_logprobs: not a field this server implements"),
        (api.CompletionRequest, {"prompt": "x", "max_tokens": -1}, "max_tokens: Input should be greater than or equal"),
        (api.CompletionRequest, [1], "body: must be a JSON object"),
        (api.ChatRequest, {"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs: not a field"),
        (api.ChatRequest, {"messages": [{"role": "user", "content": "\udfff"}]}, "messages[0].content: a lone"),
        (api.ChatRequest, {"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role: Input should be"),
        (api.V1Request, {"instances": [{"text": "a\udc00"}]}, "instances[0].text: a lone surrogate"),
    ],
)
def test_a_bad_request_is_one_line_naming_where(model, body, message):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    line = api.describe(e.value.errors())
    assert line.startswith(message) and "\n" not in line, line


def test_sampling_values_inside_the_bounds_are_taken():
    req = api.CompletionRequest.model_validate({"prompt": "\U0001f600 ok", "temperature": 0.01, "seed": 2**64 - 1})
    assert (req.temperature, req.seed) == (0.01, 2**64 - 1)
    assert api.CompletionRequest.model_validate({"prompt": "x", "temperature": 0}).temperature == 0


def test_fastapi_json_errors_are_one_line():
    errors = [{"type": "json_invalid", "loc": ("body", 1), "msg": "JSON decode error", "ctx": {"error": "Expecting"}}]
    assert api.describe(errors) == "body: not valid JSON (Expecting at character 1)"


# ---------------------------------------------------------------- open inference protocol v2


def _triton_request(texts, binary: bool, outputs=None):
    import numpy as np
    import tritonclient.http as triton

    tensor = triton.InferInput("text", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array(texts, dtype=object), binary_data=binary)
    body, json_size = triton.InferenceServerClient.generate_request_body([tensor], outputs=outputs, request_id="r")
    return body, None if json_size is None else str(json_size)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_v2_takes_what_the_reference_client_sends_and_answers_what_it_reads(binary):
    import tritonclient.http as triton

    request, texts = v2.parse(*_triton_request(TEXTS, binary))
    assert texts == TEXTS and request.id == "r"
    results = [{"label": f"l{k}", "score": 0.25 * k} for k in range(3)]
    body, json_length = v2.response("m", request, results)  # the client asks for binary outputs by default
    assert json_length is not None and json.loads(body[:json_length])["outputs"][0]["parameters"]
    got = triton.InferenceServerClient.parse_response_body(body, header_length=json_length)
    assert [x.decode() for x in got.as_numpy("label")] == ["l0", "l1", "l2"]
    assert got.as_numpy("score").tolist() == [0.0, 0.25, 0.5]
    wanted = [triton.InferRequestedOutput("score", binary_data=False)]
    request, _ = v2.parse(*_triton_request(TEXTS, binary, wanted))
    body, json_length = v2.response("m", request, results)
    assert json_length is None and json.loads(body)["outputs"] == [
        {"name": "score", "datatype": "FP32", "shape": [3], "data": [0.0, 0.25, 0.5]}
    ]


def _bytes(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(x)) + x for x in items)


TENSOR = {"name": "text", "shape": [2], "datatype": "BYTES", "data": ["a", "b"]}


def _json(inputs=None, **tensor) -> tuple[bytes, None]:
    """A JSON request of ``inputs`` (default: TENSOR changed by ``tensor``; a None value drops the key)."""
    changed = {k: v for k, v in {**TENSOR, **tensor}.items() if v is not None}
    return json.dumps({"inputs": inputs or [changed]}).encode(), None


def _binary(raw: bytes, size: int | None = None) -> tuple[bytes, str]:
    """A request with the binary extension: TENSOR's JSON without data, then ``raw``."""
    tensor = {**TENSOR, "shape": [1], "parameters": {"binary_data_size": len(raw) if size is None else size}}
    del tensor["data"]
    head = json.dumps({"inputs": [tensor]}).encode()
    return head + raw, str(len(head))


EXTRA = {"name": "extra", "shape": [1], "datatype": "BYTES", "data": ["x"]}


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (_json(shape=[3]), "inputs[0] (text): shape [3] does not hold the data's 2 elements; give shape [2]"),
        (_json(shape=[1, 2]), None),
        (_json(data=[["a"], ["b"]], shape=[2, 1]), None),
        (_json(datatype="FP32"), "inputs[0] (text): datatype 'FP32'; this model takes texts"),
        (_json(data=["a", 3]), "inputs[0] (text).data[1]: a BYTES element is a string, not int"),
        (_json(data=None), "inputs[0] (text): no data"),
        (_json(data=["a", "b\ud800"]), "inputs[0].data[1]: a lone surrogate"),
        (_json(inputs=[EXTRA, TENSOR]), "inputs: this model takes one BYTES input ('text'); remove 'extra'"),
        (_json(inputs=[TENSOR, {"name": "extra"}]), "inputs[1].shape: Field required"),
        ((json.dumps({"inputs": [TENSOR], "outputs": [{"name": "logits"}]}).encode(), None), "outputs: this model"),
        (_binary(_bytes(b"ok")), None),
        (_binary(_bytes(b"o\xff")), "inputs[0] (text): element 0 is not UTF-8 text"),
        (_binary(_bytes(b"ok") + b"\x09"), "inputs[0] (text): element 1 runs past the tensor's bytes"),
        (_binary(_bytes(b"ok"), size=99), "inputs[0] (text): binary_data_size 99 with 6 bytes after the JSON"),
        ((b'{"inputs": []}', "x"), "Inference-Header-Content-Length: 'x' is not a length"),
        ((b"{bad", None), "body: not valid JSON (Expecting property name"),
        ((b"[]", None), "body: must be a JSON object"),
    ],
)
def test_a_v2_request_is_checked_and_refused_with_where(request_, message):
    if message is None:
        assert v2.parse(*request_)[1]
        return
    with pytest.raises(v2.ProtocolError) as e:
        v2.parse(*request_)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


# ---------------------------------------------------------------- the body's arrival


def test_a_body_that_does_not_arrive_in_time_is_a_408_and_after_it_receive_passes_through():
    from kubetune.inference.server.app import _in_time
    from kubetune.inference.server.compute import HTTPError

    async def main():
        messages = asyncio.Queue()
        bounded = _in_time(messages.get, 0.05)
        messages.put_nowait({"type": "http.request", "body": b"{", "more_body": True})
        assert (await bounded())["body"] == b"{"
        with pytest.raises(HTTPError) as e:
            await bounded()  # the rest never comes
        assert e.value.status == 408 and "within 0.05 s" in e.value.message
        whole = _in_time(messages.get, 0.05)
        messages.put_nowait({"type": "http.request", "body": b"{}", "more_body": False})
        await whole()
        waiting = asyncio.ensure_future(whole())  # after the body: waits for the disconnect, however long
        await asyncio.sleep(0.1)
        messages.put_nowait({"type": "http.disconnect"})
        assert (await waiting)["type"] == "http.disconnect"

    asyncio.run(main())


def test_v2_packs_every_numeric_output_a_task_engine_declares():
    outputs = {"value": "FP64", "count": "INT64", "ok": "BOOL"}
    request, _ = v2.parse(
        json.dumps(
            {
                "inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": ["a", "b"]}],
                "parameters": {"binary_data_output": True},
            }
        ).encode(),
        None,
        outputs,
    )
    results = [{"value": 0.25, "count": 3, "ok": True}, {"value": -1.5, "count": -7, "ok": False}]
    body, json_length = v2.response("m", request, results, outputs)
    head = json.loads(body[:json_length])
    assert [(o["name"], o["datatype"], o["parameters"]["binary_data_size"]) for o in head["outputs"]] == [
        ("value", "FP64", 16),
        ("count", "INT64", 16),
        ("ok", "BOOL", 2),
    ]
    tail = body[json_length:]
    assert struct.unpack("<2d", tail[:16]) == (0.25, -1.5) and struct.unpack("<2q", tail[16:32]) == (3, -7)
    assert struct.unpack("<2?", tail[32:]) == (True, False)
