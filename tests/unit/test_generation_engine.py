"""The generation engine (``inference.generation``) on the packaged tiny Llama (random init, so a greedy
completion never ends early): continuous batching gives each request what it gets alone and what
transformers' ``generate`` gives it; requests join a batch in flight; a shared prompt is prefilled once;
a seeded sample does not depend on its batch; a sharded model's ranks stay in lockstep; the cache is
written in place (no copy per step)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from kubetune.inference.generation import Engine, Generation, draw

LLAMA = Path(__file__).resolve().parents[2] / "src" / "kubetune" / "assets" / "tiny-llama"
PROMPTS = ["The crew was lovely", "My flight was delayed for six hours and nobody said why", "Quiet", "Best ride"]


@pytest.fixture(scope="module")
def lm():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(LLAMA)
    model = AutoModelForCausalLM.from_pretrained(LLAMA).eval()
    return model, [tokenizer(p)["input_ids"] for p in PROMPTS]


def _reference(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def test_a_continuous_batch_gives_each_request_what_generate_gives_it_alone(lm):
    model, prompts = lm
    gens = [Generation(ids, 12) for ids in prompts * 3]  # more requests than slots: they join as others end
    Engine(model, set(), slots=5).generate(gens)
    for g in gens:
        assert g.tokens == _reference(model, g.ids, 12) and g.finish_reason == "length"


def test_requests_of_different_lengths_join_and_leave_the_batch_in_flight(lm):
    model, prompts = lm
    engine, steps = Engine(model, set(), slots=4), []
    engine.on_step = steps.append
    gens = [Generation(prompts[k % 4], n) for k, n in enumerate([3, 20, 7, 20, 5, 9])]
    engine.generate(gens)
    assert [len(g.tokens) for g in gens] == [3, 20, 7, 20, 5, 9]
    assert all(g.tokens == _reference(model, g.ids, len(g.tokens)) for g in gens)
    # the fifth and sixth requests took the slots of the ones that ended: never more than 4 in a step, and no
    # step waited for the batch's longest (a static batch of 4 then one of 2 would take 20 + 9 steps)
    assert max(steps) == 4 and len(steps) < 20 + 9 - 1


@pytest.mark.parametrize("mode", ["flat", "packed", "plain"])
def test_a_shared_prompt_is_prefilled_once(lm, monkeypatch, mode):
    """Packed steps (the Llama family; ``flat``: transformers' Llama with its operations called directly): the
    first forward is one row of the two distinct prompts' tokens, every later one a token per request. Plain
    steps (any other model): one prefill of two right-padded rows."""
    import dataclasses

    model, prompts = lm
    rows = []
    forward = type(model).forward

    def counting(self, input_ids=None, **kw):
        rows.append(tuple(input_ids.shape))
        return forward(self, input_ids=input_ids, **kw)

    def counting_flat(model, input_ids, *args, **kw):
        rows.append(tuple(input_ids.shape))
        return flat(model, input_ids, *args, **kw)

    monkeypatch.setattr(type(model), "forward", counting)
    gens = [Generation(prompts[1], 6) for _ in range(8)] + [Generation(prompts[0], 6) for _ in range(8)]
    engine = Engine(model, set(), slots=16)
    assert engine._packs and engine._flat is not None  # the tiny Llama runs flat; the other steps are forced below
    flat = engine._flat.forward
    engine._packs = mode != "plain"
    engine._flat = dataclasses.replace(engine._flat, forward=counting_flat) if mode == "flat" else None
    engine.generate(gens)
    if mode != "plain":
        assert rows == [(1, len(prompts[1]) + len(prompts[0]))] + [(1, 16)] * 5
    else:
        assert [shape for shape in rows if shape[1] > 1] == [(2, len(prompts[1]))]  # one prefill row per prompt
    assert {tuple(g.tokens) for g in gens[:8]} == {tuple(_reference(model, prompts[1], 6))}
    assert {tuple(g.tokens) for g in gens[8:]} == {tuple(_reference(model, prompts[0], 6))}


@pytest.mark.parametrize("swapped", [False, True], ids=["f-linear", "swapped"])
def test_the_flat_llama_forward_gives_transformers_logits_bit_for_bit(lm, monkeypatch, swapped):
    """The Llama family's flat forward (``families.llama.forward``) against the model's own forward on the same packed step (requests in flight and new
    prompts, each through the step's attention and a cache of its own, the logits of 3 positions kept): the same
    logits, bit for bit, with every linear layer on ``F.linear`` and with the swapped GEMM on (the tiny model's
    weights let in by a threshold of 0: the step's rows are swapped, the head's 3 rows are not, in both); and a
    model with a hook, or in training, does not run flat."""
    from kubetune.inference import kernels as K
    from kubetune.inference import step as S
    from kubetune.inference.families import llama

    model, prompts = lm
    assert llama.runs(model)
    if swapped:
        monkeypatch.setattr(K, "GEMM_MIN_WEIGHT", 0)
    pos, new = [3, 7, 5], [prompts[0], prompts[2]]
    ids = torch.tensor([[11, 12, 13] + prompts[0] + prompts[2]])
    assert K.GEMM_ROWS[0] <= ids.shape[1] <= K.GEMM_ROWS[1]
    keep = torch.tensor([0, 2, ids.shape[1] - 1])
    logits, products = [], []
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda *a: products.append(a[0].shape) or mm(*a))
    for flat in (True, False):
        cache = S.SlotCache(5, 32)
        for layer in range(model.config.num_hidden_layers):  # the rows in flight: something cached before
            g = torch.Generator().manual_seed(layer)
            shape = (5, model.config.num_key_value_heads, 32, model.config.head_dim)
            cache.keys.append(torch.randn(shape, generator=g))
            cache.values.append(torch.randn(shape, generator=g))
        step = S.layout(pos, [len(p) for p in new], torch.float32, torch.device("cpu"))
        with torch.no_grad(), S.packed_forward(model, step):
            if flat:
                logits.append(llama.forward(model, ids, step.where[None], cache, keep))
            else:
                with K.swapped_gemm(torch.device("cpu"), K.large_linears(model)):
                    out = model(input_ids=ids, attention_mask=torch.zeros(1, 1, 1, 1), position_ids=step.where[None],
                                past_key_values=cache, use_cache=True, logits_to_keep=keep)  # fmt: skip
                logits.append(out.logits)
    assert logits[0].shape == (1, 3, model.config.vocab_size)
    assert torch.equal(logits[0], logits[1])
    # swapped: every block's 7 products and no head's, in each of the two forwards
    layers = model.config.num_hidden_layers
    assert len(products) == (2 * 7 * layers if swapped else 0)
    assert model.lm_head.weight.shape not in products
    handle = model.model.layers[0].register_forward_hook(lambda *a: None)
    try:
        assert not llama.runs(model)
    finally:
        handle.remove()
    model.train()
    try:
        assert not llama.runs(model)
    finally:
        model.eval()
    assert llama.runs(model)


def test_packed_steps_equal_generate_under_eager_attention_and_score_prompts():
    """A packed step runs the model's own attention for each group: under ``eager`` (what a bf16 model on a CPU
    loads with) too. Requests joining a batch in flight get what ``generate`` gives them alone, and a prompt's
    log-probabilities (echo) equal a plain forward's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(LLAMA)
    model = AutoModelForCausalLM.from_pretrained(LLAMA, attn_implementation="eager").eval()
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    gens = [Generation(ids, n) for ids, n in zip(prompts * 2, [9, 3, 14, 5, 7, 11, 2, 6])]
    scored = Generation(prompts[1], 4, prompt_logprobs=True, logprobs=0)
    engine = Engine(model, set(), slots=3)
    assert engine._packs
    engine.generate([*gens, scored])
    for g in [*gens, scored]:
        assert g.tokens == _reference(model, g.ids, len(g.tokens))
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([prompts[1]])).logits[0, :-1].float(), -1)
    want = want.gather(-1, torch.tensor(prompts[1][1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(scored.prompt_token_logprobs), want, atol=1e-5)
    assert model.config._attn_implementation == "eager"  # the model's own, restored after each step


def test_a_seeded_sample_is_the_same_whatever_else_is_in_flight(lm):
    model, prompts = lm
    alone = Generation(prompts[0], 10, temperature=1.0, top_p=0.9, seed=7)
    Engine(model, set(), slots=4).generate([alone])
    crowd = [Generation(p, 10, temperature=0.7) for p in prompts[1:]]
    again = Generation(prompts[0], 10, temperature=1.0, top_p=0.9, seed=7)
    Engine(model, set(), slots=4).generate([*crowd, again])
    assert again.tokens == alone.tokens
    other = Generation(prompts[0], 10, temperature=1.0, top_p=0.9, seed=8)
    Engine(model, set(), slots=4).generate([other])
    assert other.tokens != alone.tokens
    top1 = Generation(prompts[0], 10, temperature=1.0, top_k=1, seed=3)  # top-k 1 is greedy
    Engine(model, set(), slots=4).generate([top1])
    assert top1.tokens == _reference(model, prompts[0], 10)


def test_an_end_token_ends_a_request_and_is_reported(lm):
    model, prompts = lm
    first = _reference(model, prompts[2], 4)
    g = Generation(prompts[2], 10)
    Engine(model, {first[2]}, slots=2).generate([g])
    assert g.tokens == first[:2] and g.finish_reason == "stop" and g.end_token == first[2]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
def test_lockstep_makes_as_many_forwards_as_the_busiest_rank(lm, monkeypatch, packed):
    model, prompts = lm
    calls = []
    forward = type(model).forward
    monkeypatch.setattr(type(model), "forward", lambda self, **kw: calls.append(1) or forward(self, **kw))
    other_rank_steps = 30  # the other rank's generation makes 30 forwards
    seen = []

    def lockstep(busy: bool) -> bool:
        seen.append(busy)
        return busy or len(seen) <= other_rank_steps

    g = Generation(prompts[0], 5)
    engine = Engine(model, set(), slots=1)
    engine._packs, engine._flat = packed, None  # a sharded model never runs flat (FSDP changes its classes)
    engine.generate([g], lockstep=lockstep)
    # one forward per round on every rank (plain steps: the first round makes the prefill and the first decode),
    # this rank's last ones on an idle row
    assert len(g.tokens) == 5 and len(calls) == other_rank_steps + (0 if packed else 1)


def test_the_server_mode_answers_requests_submitted_while_others_run(lm):
    model, prompts = lm
    engine = Engine(model, set(), slots=3)
    engine.start()
    try:
        done, events = {}, [threading.Event() for _ in range(6)]
        for k in range(6):
            g = Generation(prompts[k % 4], 8 + k)
            engine.submit(g, lambda g, k=k: (done.__setitem__(k, g), events[k].set()))
        assert all(e.wait(60) for e in events)
        assert all(done[k].tokens == _reference(model, prompts[k % 4], 8 + k) for k in range(6))
        gone = Generation(prompts[0], 200)
        stopped = threading.Event()
        gone.on_token = lambda token: len(gone.tokens) == 2 and gone.cancelled.set()
        engine.submit(gone, lambda g: stopped.set())
        assert stopped.wait(60) and len(gone.tokens) == 2
    finally:
        engine.close()


def test_the_cache_is_written_in_place_not_copied_per_step(lm):
    model, prompts = lm
    engine = Engine(model, set(), slots=2)
    engine.generate([Generation(prompts[1], 40)])  # the cache sized for what follows
    keys = engine._cache.keys[0]
    pointer = keys.data_ptr()
    engine.generate([Generation(prompts[1], 20), Generation(prompts[3], 20)])
    assert engine._cache.keys[0].data_ptr() == pointer  # the same storage: nothing reallocated or concatenated


def test_the_swapped_gemm_computes_f_linear_on_its_rows_and_leaves_the_rest_alone():
    """``swapped_gemm`` (a CPU step of ``GEMM_ROWS`` rows): a large fp32 linear layer runs as ``(W @ x.T).T`` —
    the same product within float rounding, bias and leading dimensions kept — and exactly as before outside
    those rows, for small weights, for other dtypes, on other devices, and after the step."""
    from kubetune.inference.kernels import GEMM_MIN_WEIGHT, GEMM_ROWS, large_linears, swapped_gemm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(96, 96), torch.nn.Linear(512, 1024))
    model[2].to(torch.bfloat16)
    big, small, bf16 = model
    assert big.weight.numel() >= GEMM_MIN_WEIGHT and large_linears(model) == [big, bf16]
    calls = []
    mm = torch.mm

    def counting_mm(*args):
        calls.append(args[0].shape)
        return mm(*args)

    cpu = torch.device("cpu")
    for rows, device, swapped in (
        (GEMM_ROWS[0], cpu, True),
        (GEMM_ROWS[1], cpu, True),
        (GEMM_ROWS[0] - 1, cpu, False),
        (GEMM_ROWS[1] + 1, cpu, False),
        (GEMM_ROWS[0], torch.device("meta"), False),
    ):
        x = torch.randn(rows, 1, 512)
        calls.clear()
        torch.mm = counting_mm
        try:
            with swapped_gemm(device, large_linears(model)):
                got = big(x)
        finally:
            torch.mm = mm
        want = torch.nn.functional.linear(x, big.weight, big.bias)
        assert got.shape == want.shape == (rows, 1, 1024)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-5)
        assert (calls == [big.weight.shape]) is swapped, (rows, calls)
        if not swapped:
            assert torch.equal(got, want)
    x, xb = torch.randn(16, 96), torch.randn(16, 512).to(torch.bfloat16)
    with swapped_gemm(cpu, large_linears(model)):
        inside = small(x), bf16(xb)  # a small weight, a bf16 one: F.linear itself
    assert torch.equal(inside[0], torch.nn.functional.linear(x, small.weight, small.bias))
    assert torch.equal(inside[1], torch.nn.functional.linear(xb, bf16.weight, bf16.bias))
    assert "forward" not in big.__dict__  # the layer's own forward again after the step


def test_a_draw_follows_each_rows_distribution_and_never_takes_a_token_of_probability_zero():
    """``draw`` (the engine's sampler, in place of torch.multinomial) by inverting the cumulative distribution:
    frequencies within 1% of the probabilities over 200,000 rows, the zero-probability tokens (a top-k or
    top-p cut, and the first and last token, where an off-by-one would show) never drawn, unnormalised
    weights read as their shares, and the same draws from the same seed."""
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]]).expand(200_000, 6).contiguous()
    rng = torch.Generator().manual_seed(0)
    tokens = torch.tensor(draw(probs * 7.0, rng))
    counts = torch.bincount(tokens, minlength=6).double() / len(tokens)
    assert counts[[0, 2, 5]].tolist() == [0.0, 0.0, 0.0]
    assert torch.allclose(counts[[1, 3, 4]], torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64), atol=0.01)
    again = draw(probs * 7.0, torch.Generator().manual_seed(0))
    assert again == tokens.tolist()
    one_hot = torch.zeros(3, 5)
    one_hot[torch.arange(3), torch.tensor([0, 4, 2])] = 1.0
    assert draw(one_hot, torch.Generator().manual_seed(1)) == [0, 4, 2]


def test_only_models_that_attend_through_the_cache_and_interface_run_packed_steps(lm):
    """``packs``: the Llama family with its own attention (sdpa, eager, or kubetune's packed training attention
    over them); not a sliding window, soft-capping, another attention, or another architecture. A model that
    wrote its cache without attending through the step's attention stops the step with the count, not with a
    wrong answer."""
    from types import SimpleNamespace

    from kubetune.inference.step import Packed, layout, packed_forward, packs
    from kubetune.tasks.attention import register

    model, _ = lm
    assert packs(model)

    def config(**kw):
        return SimpleNamespace(config=SimpleNamespace(**{"model_type": "llama", "_attn_implementation": "sdpa", **kw}))

    assert packs(config(_attn_implementation="eager")) and packs(config(_attn_implementation=register("eager")))
    assert packs(config(_attn_implementation=register()))
    for refused in (
        config(model_type="gpt2"),
        config(sliding_window=4096),
        config(attn_logit_softcapping=50.0),
        config(_attn_implementation="flash_attention_2"),
    ):
        assert not packs(refused), refused.config

    class Bypass(torch.nn.Module):  # writes the cache, never calls the attention interface
        config = model.config

        def forward(self, cache):
            cache.update(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4), 0)

    from kubetune.inference.step import SlotCache

    step = layout([], [1], torch.float32, torch.device("cpu"))
    assert isinstance(step, Packed)
    with pytest.raises(RuntimeError, match="attended 0 time.*1 cache write"):
        with packed_forward(Bypass(), step):
            Bypass()(SlotCache(1, 4))
    assert model.config._attn_implementation == "sdpa"  # restored after the failed step too


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
def test_a_prompt_of_no_tokens_gets_its_own_error_and_the_others_go_on(lm, packed):
    """An empty prompt (a tokenizer that adds no BOS, an empty text): that request ends with its own error;
    the requests beside it complete as they would alone."""
    model, prompts = lm
    engine = Engine(model, set(), slots=4)
    engine._packs = packed
    gens = [Generation(prompts[0], 5), Generation([], 5), Generation(prompts[2], 5)]
    engine.generate(gens)
    assert isinstance(gens[1].error, ValueError) and "no tokens" in str(gens[1].error) and gens[1].tokens == []
    assert gens[0].tokens == _reference(model, prompts[0], 5) and gens[2].tokens == _reference(model, prompts[2], 5)


def test_greedy_steps_take_their_tokens_from_the_greedy_head(lm, monkeypatch):
    """With the greedy head on (forced: the tiny model's head is let in by a threshold of 0), steps whose every
    request is greedy and records nothing take their tokens from the screen — the same tokens as ``generate`` —
    and a step with a request asking for log-probabilities runs the full head."""
    import dataclasses

    from kubetune.inference import kernels
    from kubetune.inference.families.greedy import GreedyHead

    model, prompts = lm
    monkeypatch.setattr(kernels, "GEMM_MIN_WEIGHT", 0)
    screened = []
    tokens = GreedyHead.tokens
    monkeypatch.setattr(GreedyHead, "tokens", lambda self, *a: screened.append(tokens(self, *a)) or screened[-1])
    engine = Engine(model, set(), slots=4)
    engine._greedy_head = GreedyHead(enabled=True)
    gens = [Generation(ids, 8) for ids in prompts]
    engine.generate(gens)
    assert len(screened) == 8 and all(s is not None for s in screened)
    assert all(g.tokens == _reference(model, g.ids, 8) for g in gens)
    screened.clear()
    # where the screen steps aside (here: always), the full head runs on the rows the step kept, shared prompts too
    monkeypatch.setattr(GreedyHead, "candidates", lambda *a: None)
    heads, full = [], engine._flat.project
    engine._flat = dataclasses.replace(
        engine._flat, project=lambda model, x: heads.append(x.shape[-2]) or full(model, x)
    )
    shared = [Generation(prompts[1], 8) for _ in range(3)] + [Generation(prompts[2], 8)]
    engine.generate(shared)
    assert screened and not any(screened)
    assert heads[0] == 2  # the two distinct prompts' last positions (as ``model(...)``), not the 4 requests' rows
    assert all(g.tokens == _reference(model, g.ids, 8) for g in shared)
    screened.clear()
    recorded = [Generation(prompts[0], 8), Generation(prompts[1], 8, logprobs=2)]
    engine.generate(recorded)
    assert not screened and len(recorded[1].token_logprobs) == 8
    assert all(g.tokens == _reference(model, g.ids, 8) for g in recorded)
