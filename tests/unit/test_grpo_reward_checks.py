"""What a GRPO reward function may return and how long it may take (issue 45, rows 9, 10 and 12), in
process: a value too large for a float, a string (which has a length) or a string per completion are the
one-line reward error; a call that outlasts grpo.reward_timeout_s is that error too, naming the function,
the timeout and the fix; a stop signal during a call gives the call up at once; a step in which no
completion got any reward warns once for the run. Also: an invalid reward in `validate` is that
reward's error only."""

from __future__ import annotations

import logging
import random
import signal
import sys
import threading
import time

import numpy as np
import pytest
import torch
from conftest import make_reward_model

from kubetune.config.load import parse_spec
from kubetune.errors import KubetuneError, SpecError
from kubetune.tasks.grpo import GRPOSpec, Reward
from kubetune.tasks.grpo import rewards as R
from kubetune.tasks.grpo.rollout import Rollouts, Sampled

MODULE = "test_grpo_reward_checks_fns"  # this module, importable by that name as a reward's module:function


def huge(prompts, completions, completion_ids, **columns):
    return [10**400] * len(completions)


def huger(prompts, completions, completion_ids, **columns):
    return [10**5000] * len(completions)  # past str()'s digit limit too


def digits(prompts, completions, completion_ids, **columns):
    return "1" * len(completions)  # a str of the right length: list() of it is ['1', '1']


def strings(prompts, completions, completion_ids, **columns):
    return ["1" for _ in completions]


def mapping(prompts, completions, completion_ids, **columns):
    return {i: 1.0 for i in range(len(completions))}


def nothing(prompts, completions, completion_ids, **columns):
    return None


def numbers(prompts, completions, completion_ids, **columns):
    # what TRL accepts: floats, ints, bools, numpy scalars and arrays, 0-d tensors, None
    return [np.float32(0.5), 2, True, None, torch.tensor(1.5)][: len(completions)]


def array(prompts, completions, completion_ids, **columns):
    return np.arange(len(completions), dtype=np.float64)


def sleeps(prompts, completions, completion_ids, **columns):
    time.sleep(30)
    return [1.0] * len(completions)


def draws_then_sleeps(prompts, completions, completion_ids, **columns):
    random.random(), np.random.rand(), torch.rand(1)  # a reward that samples (e.g. a judge's tie-breaks)
    time.sleep(30)
    return [1.0] * len(completions)


def sets_a_signal(prompts, completions, completion_ids, **columns):
    import signal

    signal.signal(signal.SIGALRM, lambda *a: None)  # what math_verify's own timeout does
    return [1.0] * len(completions)


@pytest.fixture(autouse=True)
def _importable():
    sys.modules.setdefault(MODULE, sys.modules[__name__])


def _score(name: str, n: int = 2, **kwargs) -> np.ndarray:
    scorers = R.scorers([Reward(function=f"{MODULE}:{name}")])
    completions = [f"c{i}" for i in range(n)]
    return R.score(scorers, ["p"] * n, completions, [[0]] * n, {}, 5, **kwargs)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "huge",  # row 9: OverflowError tracebacks on both ranks
            "reward function huge returned '1000000000000000000000000000000000000000...' for completion 0 at step 5: "
            "too large for a float",
        ),
        ("huger", "reward function huger returned '<int>' for completion 0 at step 5: too large for a float"),
        # row 12: trained on silently
        ("digits", "reward function digits returned a str ('11') for 2 completions at step 5"),
        ("strings", "reward function strings returned '1' for completion 0 at step 5: a str, not a number"),
        ("mapping", "reward function mapping returned a dict ({0: 1.0, 1: 1.0}) for 2 completions at step 5"),
        ("nothing", "reward function nothing returned None for 2 completions at step 5"),
    ],
)
def test_a_reward_value_that_is_not_a_number_is_one_line_naming_the_function(name, expected):
    with pytest.raises(KubetuneError) as e:
        _score(name)
    message = str(e.value)
    assert message.startswith(f"grpo.rewards[0].function: {expected}"), message
    assert "\n" not in message and " — return " in message


def test_numbers_of_every_kind_trl_accepts_are_kept():
    assert _score("numbers", n=5)[:, 0].tolist()[:3] == [0.5, 2.0, 1.0]
    assert np.isnan(_score("numbers", n=5)[3, 0]) and _score("numbers", n=5)[4, 0] == 1.5
    assert _score("array", n=3)[:, 0].tolist() == [0.0, 1.0, 2.0]


def test_a_reward_call_past_its_timeout_is_one_line_naming_the_function_the_timeout_and_the_fix():
    started = time.monotonic()
    with pytest.raises(KubetuneError) as e:
        _score("sleeps", timeout_s=0.3)
    assert time.monotonic() - started < 10  # not the function's 30 s
    assert str(e.value) == (
        "grpo.rewards[0].function: reward function sleeps did not return within grpo.reward_timeout_s 0.3 s at step 5 "
        "(2 completions) — make it faster (one call scores this process's completions of a step), or raise "
        "grpo.reward_timeout_s, and keep it well below the grace period a stopped pod gets "
        "(kubernetes.termination_grace_period_seconds): a stop signal waits for a running call"
    )


def test_a_stop_signal_during_a_reward_call_gives_the_call_up_at_once():
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    with pytest.raises(R.Abandoned):
        _score("sleeps", timeout_s=60, stop=stop)
    assert time.monotonic() - started < 10


def test_a_step_given_up_on_a_stop_signal_leaves_the_random_state_as_before_it():
    """The trainer then checkpoints the last completed step: its RNG states must be that step's, not moved by
    the reward calls of the step given up, or the resumed step would draw other numbers."""
    from kubetune.data import StepBatch
    from kubetune.distributed import StepAbandoned
    from kubetune.tasks.grpo.data import PromptBatch

    g = GRPOSpec(rewards=[Reward(function=f"{MODULE}:draws_then_sleeps")], num_generations=2)
    r = Rollouts(g, type("T", (), {"pad_token_id": 0})(), R.scorers(g.rewards), 0, 0, False, [1])
    r._sample = lambda model, prompts, global_step: _sampled(2)  # no model: the completions as sampled
    prompt = PromptBatch({}, torch.zeros(0), 1.0, torch.tensor([7]), [{"prompt": "p", "columns": {}}])
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    with pytest.raises(StepAbandoned):
        r.step(None, StepBatch([prompt], 1, np.array([7])), 4, None, stop=stop)
    assert random.getstate() == before[0] and (np.random.get_state()[1] == before[1]).all()
    assert torch.equal(torch.get_rng_state(), before[2])
    assert list(r.samples) == [] and r.cache == []  # nothing of the step is kept


def test_a_function_that_sets_a_signal_handler_is_told_how_to_run_under_the_timeout():
    with pytest.raises(KubetuneError) as e:
        _score("sets_a_signal", timeout_s=5)
    assert "reward function sets_a_signal raised ValueError: signal only works in main thread" in str(e.value)
    assert "math_verify: parsing_timeout=None" in str(e.value)


def test_the_reward_timeout_is_a_spec_field_with_a_default_below_kubernetes_grace():
    g = GRPOSpec(rewards=[Reward(function="regex", pattern="a")])
    assert g.reward_timeout_s == 10.0
    with pytest.raises(ValueError, match="reward_timeout_s"):
        GRPOSpec(rewards=[Reward(function="regex", pattern="a")], reward_timeout_s=0)


@pytest.mark.parametrize(("timeout", "grace", "warned"), [(10, 30, False), (15, 30, False), (16, 30, True)])
def test_render_warns_when_the_reward_timeout_leaves_a_stopped_pod_too_little_grace(timeout, grace, warned):
    from kubetune.backends.kubeflow import checks

    spec = parse_spec(
        {
            "name": "g",
            "task": "grpo",
            "model": {"uri": "pkg://kubetune/assets/tiny-llama"},
            "data": {"train": "s3://b/x.jsonl"},
            "grpo": {"rewards": [{"function": "regex", "pattern": "a"}], "reward_timeout_s": timeout},
            "kubernetes": {"termination_grace_period_seconds": grace},
            "output": {"uri": "s3://b/out"},
        }
    )
    found = [w for w in checks.warnings_for(spec) if w.startswith("grpo.reward_timeout_s")]
    assert found == (
        [
            f"grpo.reward_timeout_s: {timeout} s is over half of kubernetes.termination_grace_period_seconds 30: "
            "after a stop signal a pod waits for its running reward call, and may be killed before it writes its "
            "checkpoint — raise the grace period, or lower the timeout"
        ]
        if warned
        else []
    )


def _rollouts() -> Rollouts:
    g = GRPOSpec(rewards=[Reward(function="regex", pattern="a")], num_generations=2)
    return Rollouts(g, type("T", (), {"pad_token_id": 0})(), R.scorers(g.rewards), 0, 0, False, [1])


def _sampled(n: int) -> Sampled:
    return Sampled([[5]] * n, [[9, 1]] * n, np.zeros(n, bool), [""] * n, ["p"] * n, {})


def test_a_step_without_any_reward_warns_once_for_the_run(caplog):
    r, n = _rollouts(), 4
    real = np.ones(n, bool)
    none = np.full((n, 1), np.nan)
    with caplog.at_level(logging.WARNING, logger="kubetune.tasks.grpo.rollout"):
        for step in (0, 1, 2):
            r._statistics(np.zeros(n), none, _sampled(n), real, step)
        some = none.copy()
        some[1, 0] = 1.0
        r._statistics(np.nan_to_num(some[:, 0]), some, _sampled(n), real, 3)
    lines = [rec.getMessage() for rec in caplog.records]
    assert lines == [
        "grpo.rewards: no reward function returned a number for any completion of step 1 (every value was None): "
        "the step's advantages are all 0 and it trains on nothing — return a number for the completions a function "
        "applies to (said once; later steps like it are not reported)"
    ]


def test_validate_shows_an_invalid_rewards_own_error_only():
    spec = {
        "name": "g",
        "task": "grpo",
        "model": {"uri": "pkg://kubetune/assets/tiny-llama"},
        "data": {"train": "x.jsonl"},
        "grpo": {"rewards": [{"function": "not a function"}]},
        "output": {"uri": "runs/g"},
    }
    with pytest.raises(SpecError) as e:
        parse_spec(spec)
    assert len(e.value.problems) == 1, e.value.problems
    assert e.value.problems[0].startswith("grpo.rewards.0.function: 'not a function' is neither a built-in")


def test_raising_the_reward_timeout_keeps_the_checkpoint_resumable():
    from kubetune import checkpoint

    base = {
        "name": "g",
        "task": "grpo",
        "model": {"uri": "pkg://kubetune/assets/tiny-llama"},
        "data": {"train": "x.jsonl"},
        "grpo": {"rewards": [{"function": "regex", "pattern": "a"}]},
        "output": {"uri": "runs/g"},
    }
    saved = checkpoint.fingerprint(parse_spec(base), [], 2)
    raised = parse_spec({**base, "grpo": {**base["grpo"], "reward_timeout_s": 30}})
    checkpoint.check_compatible(saved, checkpoint.fingerprint(raised, [], 2), "runs/g")
    older = {**saved, "grpo": {k: v for k, v in saved["grpo"].items() if k != "beta"}}  # a key it lacked: not checked
    checkpoint.check_compatible(older, checkpoint.fingerprint(raised, [], 2), "runs/g")
    changed = parse_spec({**base, "grpo": {**base["grpo"], "beta": 0.5}})  # a trajectory key is still compared
    with pytest.raises(KubetuneError, match=r"grpo\.beta 0\.0.*this run has 0\.5"):
        checkpoint.check_compatible(saved, checkpoint.fingerprint(changed, [], 2), "runs/g")


def _failure(exitcode: int, message: str = ""):
    error_file = "e.json" if message else "<N/A>"
    return type("F", (), {"exitcode": exitcode, "message": message, "error_file": error_file, "timestamp": 0})()


LOST = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:22418"


@pytest.mark.parametrize(
    ("left", "failures", "expected"),
    [
        ({0, 1}, {0: _failure(1, LOST)}, 1),  # rank 1 quit (os._exit(0)); rank 0 lost it in a collective
        ({0, 1, 2}, {0: _failure(1, LOST), 2: _failure(-signal.SIGTERM)}, 1),  # and rank 2 torn down
        ({0, 1}, {0: _failure(1, "ValueError: a bug of its own")}, None),  # rank 0's own error came first
        ({0, 1}, {0: _failure(2, "SystemExit: 2")}, None),  # a user error
        ({0}, {0: _failure(1, LOST)}, None),  # rank 1 left through the worker's exit: not the cause
        ({0, 1}, {0: _failure(1, LOST), 1: _failure(-9)}, None),  # rank 1 killed: torch lists it
    ],
)
def test_the_rank_that_exited_0_early_is_named_when_the_others_only_lost_it(left, failures, expected):
    """Row 11 (the launcher's side; test_grpo_hardening runs it): rank 1's os._exit(0) was reported as
    rank 0's failure."""
    from kubetune.pod.launch import quit_early, root_failure

    assert quit_early(left, failures, root_failure(failures)[1]) == expected


def test_a_reward_model_scores_each_conversation_as_its_training_tokenized_it(tmp_path):
    """grpo.rewards' `function: model`: a chat prompt + completion through the reward model's own chat template
    (tokenized by it, as the reward-model task's training did), batched with padding: the same scores as one
    conversation at a time; not a reward model, or no template for chat prompts: one line naming the field."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = make_reward_model(tmp_path / "rm", template=True)
    (scorer,) = R.scorers([Reward(function="model", model=str(path), name="rm")], chat=True)
    prompts = [[{"role": "user", "content": f"rate review {i}"}] for i in range(5)]
    completions = [[{"role": "assistant", "content": "4" * (i + 1)}] for i in range(5)]
    got = R.score([scorer], prompts, completions, [[0]] * 5, {}, step=0)[:, 0]
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    for p, c, value in zip(prompts, completions, got):
        ids = tok.apply_chat_template(p + c, tokenize=True, return_dict=True)["input_ids"]
        with torch.no_grad():
            assert value == pytest.approx(model(input_ids=torch.tensor([ids])).logits.item(), abs=1e-5)
    assert len(set(np.round(got, 6))) == 5

    # a reward model trained on text pairs scores prompt + completion + EOS, the tokenizer's special tokens added
    text = make_reward_model(tmp_path / "plain", template=False)
    (scorer,) = R.scorers([Reward(function="model", model=str(text), name="rm")], chat=False)
    got = R.score([scorer], ["rate: great", "rate: awful"], ["5", "1 star"], [[0]] * 2, {}, step=0)[:, 0]
    tok = AutoTokenizer.from_pretrained(text)
    model = AutoModelForSequenceClassification.from_pretrained(text).eval()
    for prompt, completion, value in zip(["rate: great", "rate: awful"], ["5", "1 star"], got):
        ids = tok(prompt + completion + tok.eos_token)["input_ids"]
        with torch.no_grad():
            assert value == pytest.approx(model(input_ids=torch.tensor([ids])).logits.item(), abs=1e-5)

    tiny = __import__("pathlib").Path(R.__file__).resolve().parents[2] / "assets" / "tiny-llama"
    for spec, chat, says in (
        (str(text), True, "was trained on text pairs, and the policy's prompts are chat"),
        (str(path), False, "was trained on chat pairs, and the policy's prompts are text"),
        (str(tiny), False, "not a reward model"),
    ):
        with pytest.raises(KubetuneError) as e:
            R.scorers([Reward(function="model", model=spec)], chat=chat)
        assert e.value.field == "grpo.rewards[0].model" and says in str(e.value), str(e.value)
