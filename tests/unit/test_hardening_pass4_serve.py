"""`kubetune serve`, the generation engine and GRPO's rollouts hardened (issue 63, rows 10, 11, 12 and 15), in
process: the real app (``build_app`` over the packaged tiny Llama's ``Generator``) called through ASGI, the real
engine, real rollouts.

- Row 10: echo's ``text_offset`` indexes the returned text (the BOS token, whose text the answer omits, and the
  bytes of a character split over tokens take no room), as OpenAI's and vLLM's do.
- Row 11: a prompt's log-probabilities (echo) never hold every position's logits: the peak memory of scoring a
  640-token prompt of a 128k vocabulary stays within a few chunks' (a fifth of its full logits), and the chunked
  values equal the model's own log-softmax on every engine path.
- Row 12: a body of more prompts than the queue holds is a 413 before any prompt is tokenized.
- Row 15: a non-streaming ``stop`` ends the generation at the token that completes the stop sequence, not at
  ``max_tokens``; a stop signal during a GRPO step's generation gives the step up at the engine's next forward,
  leaving nothing of it, so the step run again samples what an uninterrupted one does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from test_generation_engine import _reference  # transformers' greedy generate, the engine's reference

from kubetune.inference import scoring
from kubetune.inference.generation import Engine, Generation

LLAMA = Path(__file__).resolve().parents[2] / "src" / "kubetune" / "assets" / "tiny-llama"
PROMPT = "café ☕ naïve The crew was lovely"  # ☕ and ï are split over byte tokens by the tiny Llama's tokenizer


# ---------------------------------------------------------------- the app, called through ASGI


def _call(app, path: str, body: dict) -> tuple[int, dict]:
    """One POST of ``body`` as JSON to ``app``, as an HTTP server hands it over: (status, parsed answer)."""
    raw, sent, out = json.dumps(body).encode(), [], []

    async def receive():
        if not sent:
            sent.append(True)
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.Event().wait()  # the client stays until the answer
        return {"type": "http.disconnect"}

    async def send(message):
        out.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
    }
    asyncio.run(app(scope, receive, send))
    return out[0]["status"], json.loads(b"".join(m.get("body", b"") for m in out[1:]))


@pytest.fixture(scope="module")
def served():
    """(app, generator) of the tiny Llama, with a queue of 4 (serve's other bounds as by default)."""
    from kubetune.inference.causal import Generator
    from kubetune.inference.seam import OPENAI
    from kubetune.inference.server.app import Limits, build_app

    generator = Generator(LLAMA)
    app = build_app(generator, "tiny", OPENAI, Limits(max_queue=4))
    yield app, generator
    generator.close()


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------- row 10: text_offset


@pytest.mark.parametrize("max_tokens", [0, 6], ids=["prompt-scored", "with-completion"])
def test_echo_text_offsets_index_the_returned_text(served, max_tokens):
    app, generator = served
    tok = generator.tokenizer
    ids = tok(PROMPT)["input_ids"]
    assert ids[0] == tok.bos_token_id and "<|bos|>" not in _decode(tok, ids)
    status, out = _call(
        app, "/v1/completions", {"prompt": ids, "max_tokens": max_tokens, "echo": True, "logprobs": 1, "temperature": 0}
    )
    assert status == 200, out
    choice = out["choices"][0]
    text, offsets, tokens = choice["text"], choice["logprobs"]["text_offset"], choice["logprobs"]["tokens"]
    assert len(offsets) == len(tokens) == len(ids) + max_tokens
    prompt_text = _decode(tok, ids)
    made = _reference(generator.model, ids, max_tokens) if max_tokens else []
    assert text == prompt_text + _decode(tok, made)
    assert offsets[:2] == [0, 0]  # BOS has no text in the answer: the first word starts where it does
    assert offsets == sorted(offsets) and offsets[-1] <= len(text)
    for i, at in enumerate(offsets):
        # where token i starts: after the text of the tokens before it, wherever that ends on a whole character
        before = _decode(tok, ids[:i]) if i <= len(ids) else prompt_text + _decode(tok, made[: i - len(ids)])
        if not before.endswith("\ufffd"):
            assert text[:at] == before, (i, tokens[i], at)
    # each whole word's token starts where the word does ("☕" is three tokens; " n" follows them)
    assert text[offsets[tokens.index(" n")] :].startswith(" naïve")


def test_text_offsets_of_a_completion_cut_at_its_stop_end_at_the_cut():
    from transformers import AutoTokenizer

    from kubetune.inference.server import protocol as api

    tok = AutoTokenizer.from_pretrained(LLAMA)
    made = tok(" was lovely. Then", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    cut = " was lovely"
    offsets = api.text_offsets([([tok.bos_token_id], ""), (made, cut)], lambda t: _decode(tok, t))
    assert offsets[0] == 0 and offsets[1:3] == [0, len(" was")]
    assert offsets[-3:] == [len(cut)] * 3  # ".", " Then" and the end token lie past the cut


# ---------------------------------------------------------------- row 11: echo's memory


def _peak_bytes(fn) -> int:
    """The peak of the CPU memory that torch allocated during ``fn()`` above what it held before."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    changes = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage)
    peak = held = 0
    for _, change in changes:
        held += change
        peak = max(peak, held)
    return peak


def test_scoring_a_long_prompt_of_a_128k_vocabulary_holds_a_few_chunks_of_logits_not_all():
    """lm-eval's local-completions scores every prompt (echo, logprobs): a 640-token prompt of Llama 3's vocabulary
    has 320 MB of fp32 logits, and their log-softmax as much again; the engine holds a chunk's at a time."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=131072, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=1024, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (640,), generator=torch.Generator().manual_seed(1)).tolist()
    g = Generation(ids, 0, logprobs=1, prompt_logprobs=True)
    engine = Engine(model, set(), slots=2)
    peak = _peak_bytes(lambda: engine.generate([g]))
    full = len(ids) * config.vocab_size * 4
    print(f"scoring 640 positions of a 128k vocabulary: peak {peak / 2**20:.0f} MiB (full logits {full / 2**20:.0f})")
    # a chunk's logits and their log-softmax (64 MiB each: 128 positions of this vocabulary), and a little; not
    # every position's logits and their log-softmax (640 MiB)
    assert peak < 192 * 2**20 < full
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([ids]), logits_to_keep=torch.tensor([0, 300, 638])).logits[0], -1)
    got = [g.prompt_token_logprobs[k] for k in (0, 300, 638)]
    assert torch.allclose(torch.tensor(got), want.gather(-1, torch.tensor([[ids[1]], [ids[301]], [ids[639]]]))[:, 0])
    assert len(g.prompt_token_logprobs) == len(g.prompt_top_logprobs) == len(ids) - 1


@pytest.mark.parametrize("mode", ["flat", "packed", "plain", "packed-logits", "plain-logits"])
def test_chunked_prompt_log_probabilities_equal_the_models_own(monkeypatch, mode):
    """Every engine path (the flat Llama, the packed step, the plain prefill; ``plain-logits``: a model whose
    logits may be more than its head's, scored from its logits) in chunks of 7 positions, beside requests that
    generate: the same log-probabilities and most likely tokens as the model's log-softmax, and the same tokens
    as when no prompt is scored."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(LLAMA)
    model = AutoModelForCausalLM.from_pretrained(LLAMA).eval()
    monkeypatch.setattr(scoring, "SCORE_ELEMENTS", 7 * model.config.vocab_size)
    if mode.endswith("-logits"):
        monkeypatch.setattr(scoring, "PLAIN_HEAD", frozenset())
    prompts = [tok(p)["input_ids"] for p in (PROMPT, "My flight was delayed for six hours and nobody said why")]

    def run(scored: bool) -> list[Generation]:
        gens = [Generation(prompts[0], 5), Generation(prompts[1], 3, logprobs=3, prompt_logprobs=scored)]
        engine = Engine(model, set(), slots=4)
        engine._packs = mode in ("flat", "packed", "packed-logits")
        engine._flat = engine._flat if mode == "flat" else None
        engine.generate(gens)
        return gens

    gens, alone = run(True), run(False)
    assert [g.tokens for g in gens] == [g.tokens for g in alone]
    ids = prompts[1]
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1], -1)
    g = gens[1]
    assert torch.allclose(torch.tensor(g.prompt_token_logprobs), want.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0])
    values, top = want.topk(3, dim=-1)
    assert [[t for t, _ in row] for row in g.prompt_top_logprobs] == top.tolist()
    assert torch.allclose(torch.tensor([[v for _, v in row] for row in g.prompt_top_logprobs]), values)


# ---------------------------------------------------------------- row 12: prompts counted before tokenized


@pytest.mark.parametrize(
    "prompt",
    [["a"] * 20_000, [[5]] * 20_000, ["a"] * 5],
    ids=["texts", "token-ids", "one-over-the-queue"],
)
def test_more_prompts_than_the_queue_holds_are_refused_before_any_is_tokenized(served, monkeypatch, prompt):
    app, generator = served
    encoded = []
    encode = generator.encode
    monkeypatch.setattr(generator, "encode", lambda text: encoded.append(text) or encode(text))
    status, out = _call(app, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert status == 413, out
    assert out["error"]["message"] == (
        f"the request holds {len(prompt)} prompts; this server queues at most 4 (kubetune serve --max-queue); "
        "send fewer at a time"
    )
    assert encoded == []  # 200,000 of them took 6.8 s to tokenize before their 413, /health waiting


# ---------------------------------------------------------------- row 15: stop sequences, and a stop signal


def test_a_non_streaming_stop_sequence_ends_the_generation_where_it_appears(served):
    app, generator = served
    tok = generator.tokenizer
    ids = tok("The crew was lovely")["input_ids"]
    made = _reference(generator.model, ids, 40)
    text = _decode(tok, made)
    # a stop sequence inside the 40 tokens: the first word of two characters or more after the fourth token
    stop = next(w for t in range(4, 30) if len(w := _decode(tok, made[t : t + 1]).strip()) > 1)
    ends = next(j for j in range(1, 41) if stop in _decode(tok, made[:j]))  # the token that completes it
    status, out = _call(app, "/v1/completions", {"prompt": ids, "max_tokens": 400, "temperature": 0, "stop": stop})
    assert status == 200, out
    choice = out["choices"][0]
    assert choice["text"] == text[: text.index(stop)] and choice["finish_reason"] == "stop"
    # the engine stopped at the token that completed the stop sequence (it made 400 before the cut before)
    assert out["usage"]["completion_tokens"] == ends


@pytest.fixture(scope="module")
def policy():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(LLAMA), AutoTokenizer.from_pretrained(LLAMA)


def _rollouts(tok, lockstep: bool):
    from kubetune.tasks.grpo import GRPOSpec, Reward
    from kubetune.tasks.grpo import rewards as R
    from kubetune.tasks.grpo.rollout import Rollouts

    g = GRPOSpec(rewards=[Reward(function="regex", pattern="a")], num_generations=2, max_completion_length=200)
    return Rollouts(g, tok, R.scorers(g.rewards), seed=3, rank=0, chat=False, eos_ids=[], lockstep=lockstep)


def _prompts(tok):
    from kubetune.data import StepBatch
    from kubetune.tasks.grpo.data import PromptBatch

    ids = torch.tensor([tok("The crew was lovely")["input_ids"]])
    batch = PromptBatch(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, torch.zeros(0), 1.0, torch.tensor([0]),
        [{"prompt": "The crew was lovely", "columns": {}}],
    )  # fmt: skip
    return StepBatch([batch], 1, np.array([0]))


@pytest.mark.parametrize("lockstep", [False, True], ids=["ddp", "sharded"])
def test_a_stop_signal_during_a_grpo_generation_gives_the_step_up_at_the_next_forward(
    policy, monkeypatch, caplog, lockstep
):
    """SIGTERM during a step's rollouts (200 new tokens a completion here; thousands in a real run, minutes on a
    pod that gets 30 s): every rank gives the step up at its engine's next forward, with nothing of it left (the
    weights, the random state, the kept samples), and the step run again samples what an uninterrupted one does."""
    from kubetune.distributed import StepAbandoned

    model, tok = policy
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    steps, stop = [], threading.Event()
    step = Engine._step

    def counted(self, *args):
        steps.append(1)
        if len(steps) == 3:  # the signal arrives during the third forward
            stop.set()
        return step(self, *args)

    monkeypatch.setattr(Engine, "_step", counted)
    r = _rollouts(tok, lockstep)
    torch.manual_seed(1)
    rng = torch.get_rng_state()
    with caplog.at_level(logging.WARNING, logger="kubetune.tasks.grpo.rollout"):
        with pytest.raises(StepAbandoned):
            r.step(model, _prompts(tok), 4, contextlib.nullcontext(), stop=stop)
    assert len(steps) == 3  # none after the signal (200 before the fix, then the reward call given up)
    assert [rec.getMessage() for rec in caplog.records] == [
        "stop signal during the generation at step 5: every process gives the step up"
    ]
    assert model.training and torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert list(r.samples) == [] and r.cache == []
    monkeypatch.setattr(Engine, "_step", step)
    again = r.step(model, _prompts(tok), 4, contextlib.nullcontext(), stop=threading.Event())
    fresh = _rollouts(tok, lockstep).step(model, _prompts(tok), 4, contextlib.nullcontext(), stop=threading.Event())
    assert torch.equal(again.micro[0].inputs["input_ids"], fresh.micro[0].inputs["input_ids"])
    assert again.micro[0].inputs["input_ids"].shape[1] == len(tok("The crew was lovely")["input_ids"]) + 200
