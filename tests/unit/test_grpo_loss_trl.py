"""GRPO's loss checked against a peer: on the tiny Llama, one fixed batch (left-padded prompts,
completions of other lengths, one truncated and masked), the same advantages and the same old
log-probabilities, kubetune's functions (``kubetune.tasks.grpo.loss``) give the loss, its gradient
and the logged statistics of TRL 1.16's GRPOTrainer ``_compute_loss``, for every loss type, with and
without the KL penalty (TRL's default importance-weighted KL, and the plain one), on- and
off-policy, for a full fine-tune (TRL's separate reference model) and for LoRA (the adapter
disabled); and the advantages of ``_generate_and_score_completions`` (TRL generating, a fixed reward)
for every ``scale_rewards``.

The gradient is compared as well as the value: on-policy (``num_iterations`` 1) the ratio is 1 in
value, so only the gradient shows that it is e^(logp − logp.detach()) and not a constant. One TRL
trainer per model is built for the module; ``_compute_loss`` reads the loss settings from the
trainer's attributes (``loss_type``, ``beta``, ...), which its ``__init__`` copies from GRPOConfig,
so each case sets them there."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from kubetune.tasks.grpo import loss as grpo

TINY = Path(__file__).resolve().parents[2] / "src" / "kubetune" / "assets" / "tiny-llama"
GROUP = 3  # completions per prompt
PROMPTS = 2
MAX_COMPLETION = 8
TEMPERATURE = 0.7
EPSILON_LOW, EPSILON_HIGH = 0.2, 0.28
PAD, EOS = 2, 1
TOL = 1e-5
# (prompt tokens, completion tokens) of each completion; the fourth is truncated (no EOS within
# MAX_COMPLETION tokens) and masked, as mask_truncated_completions does
LENGTHS = [(5, 8), (5, 5), (5, 1), (3, 8), (3, 3), (3, 6)]
TRUNCATED = 3
ADVANTAGES = [1.2, -0.7, 0.0, -1.5, 0.9, -0.4]


def _trainer(lora: bool, tmp_path, rewards: list):
    import datasets
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    if not lora:  # the policy moved away from the base weights, TRL's reference (beta > 0 loads it again)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
    args = GRPOConfig(
        output_dir=str(tmp_path / ("lora" if lora else "full")),
        per_device_train_batch_size=GROUP * PROMPTS,
        num_generations=GROUP,
        max_completion_length=MAX_COMPLETION,
        temperature=TEMPERATURE,
        beta=0.04,
        epsilon=EPSILON_LOW,
        epsilon_high=EPSILON_HIGH,
        mask_truncated_completions=True,
        report_to=[],
        use_cpu=True,
        bf16=False,
        fp16=False,
        disable_dropout=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: rewards.pop(0),  # the next rewards the test set
        args=args,
        train_dataset=datasets.Dataset.from_list([{"prompt": "a review"}] * PROMPTS),
        processing_class=AutoTokenizer.from_pretrained(TINY),
        peft_config=LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules="all-linear") if lora else None,
    )
    if lora:
        assert trainer.ref_model is None  # TRL's reference: the adapter disabled
        with torch.no_grad():  # a new adapter leaves the model as it was: moved, so the KL is not 0
            for name, p in trainer.model.named_parameters():
                if "lora_" in name:
                    p.copy_(0.05 * torch.randn_like(p))
    else:
        assert trainer.ref_model is not None
    trainer.model.train()
    return trainer


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A 0.4M-parameter model's operations are too small to gain from threads; on a busy 2-core
    machine OpenMP's waiting threads made this module three times slower (35-50 s against 12 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def rewards() -> list:
    return []


@pytest.fixture(scope="module")
def trainers(tmp_path_factory, rewards):
    tmp = tmp_path_factory.mktemp("trl-grpo")
    return {"full": _trainer(False, tmp, rewards), "lora": _trainer(True, tmp, rewards)}


@pytest.fixture(scope="module")
def batch() -> dict:
    g = torch.Generator().manual_seed(4)  # a draw that clips 4 tokens low and 2 high
    width = max(p for p, _ in LENGTHS)
    prompt_ids = torch.full((len(LENGTHS), width), PAD)
    prompt_mask = torch.zeros((len(LENGTHS), width), dtype=torch.long)
    completion_ids = torch.full((len(LENGTHS), MAX_COMPLETION), PAD)
    completion_mask = torch.zeros((len(LENGTHS), MAX_COMPLETION), dtype=torch.long)
    for row, (p, c) in enumerate(LENGTHS):
        prompt_ids[row, width - p :] = torch.randint(3, 2048, (p,), generator=g)  # left-padded
        prompt_mask[row, width - p :] = 1
        completion_ids[row, :c] = torch.randint(3, 2048, (c,), generator=g)
        if row != TRUNCATED:
            completion_ids[row, c - 1] = EOS
            completion_mask[row, :c] = 1
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor(ADVANTAGES),
        "num_items_in_batch": completion_mask.sum(),
        # what the old policy's log-probabilities differ by (off-policy cases): enough to clip both ways
        "old_shift": 0.3 * torch.randn((len(LENGTHS), MAX_COMPLETION), generator=g),
    }


def _configure(trainer, loss_type: str, beta: float, kl_correction: bool, accumulation=1, steps_per_generation=1):
    trainer.model.train()  # TRL's "train" mode: the accumulation steps and steps per generation apply
    trainer.loss_type, trainer.beta = loss_type, beta
    trainer.args.use_bias_correction_kl = kl_correction
    trainer.current_gradient_accumulation_steps = accumulation  # set by transformers' training loop
    trainer.args.steps_per_generation = steps_per_generation


def _reference(trainer):
    """The reference model and the context it is used in: TRL's own reference model (full), or the
    policy with its adapter disabled (LoRA)."""
    if trainer.ref_model is not None:
        return trainer.ref_model, contextlib.nullcontext()
    return trainer.model, trainer.model.disable_adapter()


def _trl_inputs(trainer, batch, beta: float, iterations: int) -> dict:
    """The batch as ``_generate_and_score_completions`` hands it over: the reference's log-probabilities
    and (``num_iterations`` > 1: the policy has moved since it sampled) the old policy's, both computed
    by TRL itself; the old ones are TRL's current ones shifted by ``old_shift``."""
    inputs = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")}
    inputs["num_items_in_batch"] = batch["num_items_in_batch"]
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    width = batch["completion_ids"].size(1)
    with torch.no_grad():
        if iterations > 1:
            current, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attention, width)
            inputs["old_per_token_logps"] = current + batch["old_shift"]
        if beta:
            model, context = _reference(trainer)
            with context:
                inputs["ref_per_token_logps"], _, _ = trainer._get_per_token_logps_and_entropies(
                    model, ids, attention, width
                )
    return inputs


def _trl(trainer, inputs):
    trainer._metrics["train"].clear()
    loss = trainer.compute_loss(trainer.model, inputs)
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


def _logits(model, batch):
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    width = batch["prompt_ids"].size(1)
    # position P - 1 + t predicts completion token t
    return model(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, width - 1 : -1]


def _kubetune(trainer, batch, inputs, loss_type: str, beta: float, kl_correction: bool, normalizer=None):
    logits = _logits(trainer.model, batch)
    logps = grpo.token_logps(logits, batch["completion_ids"], TEMPERATURE)
    ref = None
    if beta:
        model, context = _reference(trainer)
        with torch.no_grad(), context:
            ref = grpo.token_logps(_logits(model, batch), batch["completion_ids"], TEMPERATURE)
    loss, stats = grpo.policy_loss(
        logps,
        inputs.get("old_per_token_logps"),  # the same old log-probabilities as TRL's
        ref,
        batch["advantages"],
        batch["completion_mask"],
        loss_type=loss_type,
        epsilon_low=EPSILON_LOW,
        epsilon_high=EPSILON_HIGH,
        beta=beta,
        max_completion_length=MAX_COMPLETION,
        use_bias_correction_kl=kl_correction,
        normalizer=normalizer,
    )
    mask = batch["completion_mask"].bool()
    entropy = grpo.token_entropy(logits, TEMPERATURE)[mask].mean()
    return loss, stats, entropy


def _gradients(model, loss) -> dict[str, torch.Tensor]:
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


CASES = [
    (model, loss_type, beta, kl_correction, iterations)
    for model in ("full", "lora")
    for loss_type in grpo.LOSS_TYPES
    for beta, kl_correction in ((0.0, True), (0.04, True), (0.04, False))  # TRL's default corrects the KL
    for iterations in (1, 2)
]


@pytest.mark.parametrize("model,loss_type,beta,kl_correction,iterations", CASES)
def test_loss_gradient_and_metrics_equal_trl(trainers, batch, model, loss_type, beta, kl_correction, iterations):
    trainer = trainers[model]
    _configure(trainer, loss_type, beta, kl_correction)
    inputs = _trl_inputs(trainer, batch, beta, iterations)
    t_loss, t = _trl(trainer, inputs)
    t_grads = _gradients(trainer.model, t_loss)
    k_loss, stats, entropy = _kubetune(trainer, batch, inputs, loss_type, beta, kl_correction)
    k_grads = _gradients(trainer.model, k_loss)

    k_loss, t_loss = float(k_loss.detach()), float(t_loss.detach())
    assert t_grads.keys() == k_grads.keys() and t_grads
    scale = max(float(g.abs().max()) for g in t_grads.values())
    worst = max(float((k_grads[n] - g).abs().max()) for n, g in t_grads.items())
    assert abs(k_loss - t_loss) < TOL, (k_loss, t_loss)
    assert worst < TOL * max(1.0, scale), (worst, scale)
    assert scale > 1e-3  # a real gradient, not two zeros

    tokens = float(stats.tokens)
    ours = {
        "entropy": float(entropy),
        "clip_ratio/low_mean": float(stats.clipped_low) / tokens,
        "clip_ratio/high_mean": float(stats.clipped_high) / tokens,
        "clip_ratio/region_mean": float(stats.clipped_low + stats.clipped_high) / tokens,
        "clip_ratio/low_min": float(stats.low_min),
        "clip_ratio/high_max": float(stats.high_max),
    }
    if beta:
        ours["kl"] = float(stats.kl) / tokens
    assert set(ours) <= set(t), sorted(t)
    assert ("kl" in t) == bool(beta)
    for name, value in ours.items():
        assert abs(value - t[name]) < TOL * max(1.0, abs(t[name])), (name, value, t[name])
    if iterations > 1:  # the old log-probabilities put ratios past both bounds
        assert stats.clipped_low > 0 and stats.clipped_high > 0
    else:
        assert stats.clipped_low == 0 and stats.clipped_high == 0
    if beta:
        assert t["kl"] > 1e-3  # the policy really differs from its reference


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_accumulation_and_the_global_token_count(trainers, batch, loss_type):
    """Two accumulated micro-batches per step, four per generation batch, whose tokens (every rank's)
    are three times this micro-batch's: TRL divides grpo, bnpo and dr_grpo by the accumulation steps
    (kubetune's trainer divides by the global step's units instead), and dapo by num_items_in_batch
    ÷ processes × accumulation steps ÷ steps per generation, which ``normalizer`` takes."""
    trainer = trainers["full"]
    _configure(trainer, loss_type, 0.04, True, accumulation=2, steps_per_generation=4)
    try:
        inputs = _trl_inputs(trainer, batch, 0.04, iterations=2)
        inputs["num_items_in_batch"] = 3 * batch["num_items_in_batch"]
        t_loss, _ = _trl(trainer, inputs)
    finally:
        _configure(trainer, loss_type, 0.04, True)
    normalizer = float(inputs["num_items_in_batch"]) * 2 / 4 if loss_type == "dapo" else None
    k_loss, _, _ = _kubetune(trainer, batch, inputs, loss_type, 0.04, True, normalizer=normalizer)
    expected = float(k_loss) if loss_type == "dapo" else float(k_loss) / 2
    assert abs(expected - float(t_loss)) < TOL, (expected, float(t_loss))


# 3 prompts x GROUP completions; the second group all scored the same
MIXED = [0.5, 1.0, 2.5, 3.0, 3.0, 3.0, -1.0, 0.25, 0.0]


@pytest.mark.parametrize(
    "scale_rewards,scores",
    [("group", MIXED), ("batch", MIXED), ("none", MIXED), ("batch", [2.0] * 9), ("group", [2.0] * 9)],
)
def test_advantages_equal_trl(trainers, rewards, scale_rewards, scores):
    trainer = trainers["lora"]
    trainer.scale_rewards = scale_rewards
    rewards.append(scores)
    trainer._metrics["train"].clear()
    out = trainer._generate_and_score_completions([{"prompt": f"review {i // GROUP}"} for i in range(len(scores))])
    assert rewards == []  # TRL scored this very batch
    theirs, share = out["advantages"], trainer._metrics["train"]["frac_reward_zero_std"][-1]

    ours, our_share = grpo.group_advantages(torch.tensor(scores), GROUP, scale_rewards)
    assert ours.shape == theirs.shape
    assert float((ours - theirs).abs().max()) < 1e-6, (ours, theirs)
    assert abs(float(our_share) - share) < 1e-7, (float(our_share), share)
    if scores == MIXED:
        assert float(theirs.abs().max()) > 0.5 and share == pytest.approx(0.0 if scale_rewards == "batch" else 1 / 3)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: grpo.group_advantages(torch.zeros(5), 3, "group"), "5 rewards do not make groups"),
        (lambda: grpo.group_advantages(torch.zeros(6), 3, "std"), "scale_rewards must be one of"),
        (
            lambda: grpo.policy_loss(
                torch.zeros(1, 2), None, None, torch.zeros(1), torch.ones(1, 2), loss_type="ppo",
                epsilon_low=0.2, epsilon_high=0.2, beta=0.0, max_completion_length=2,
            ),
            "loss_type must be one of",
        ),
        (
            lambda: grpo.policy_loss(
                torch.zeros(1, 2), None, None, torch.zeros(1), torch.ones(1, 2), loss_type="grpo",
                epsilon_low=0.2, epsilon_high=0.2, beta=0.1, max_completion_length=2,
            ),
            "needs ref_logps",
        ),
    ],
)  # fmt: skip
def test_refusals(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_padding_that_cannot_be_scored_does_not_poison_the_gradient():
    """A masked position may hold -inf (a model's padding): its ratio and KL would be inf, and masking
    them out afterwards would still leave NaN in the gradient (inf x 0). They are zeroed first."""
    logps = torch.tensor([[-1.0, -2.0, float("-inf")]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -3.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = grpo.policy_loss(
        logps, None, ref, torch.tensor([0.5]), mask, loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2, beta=0.1,
        max_completion_length=3,
    )  # fmt: skip
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logps.grad).all() and logps.grad[0, 2] == 0
    assert float(stats.tokens) == 2
