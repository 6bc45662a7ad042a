"""Online RL with GRPO (Group Relative Policy Optimization) of a causal LM: the task's pieces for the
shared trainer (``training/trainer.py``).

Data: prompts (text or chat) with any other columns, which reach the reward functions by name
(``data.py``). Each step of the data plan is a set of prompts; ``Rollouts`` (``rollout.py``, the
task's ``Prepared.online``) turns it into completions sampled by the policy, rewards, advantages and
the micro-batches trained on, and keeps them for ``num_iterations`` optimizer steps. Model: the
causal LM (``tasks.causal``: full fine-tune, LoRA, QLoRA) with dropout off. Loss: TRL 1.16's (``loss.py``), its
four normalizations expressed as the trainer's loss units, so a global step's gradient equals TRL's
for equal micro-batches. Evaluation: one greedy completion per held-out prompt, its mean reward.
Export, ``predict`` and the Hub push are the causal LM's (``tasks.causal``); ``completions.jsonl`` holds a sample
of the completions with their rewards.
"""

from __future__ import annotations

import functools
import json
import logging

import numpy as np
import torch

from kubetune import artifacts, distributed
from kubetune.config import JobSpec
from kubetune.data.rows import column
from kubetune.data.tokenize import tokenizer_fingerprint
from kubetune.distributed import DistEnv
from kubetune.errors import AgreedError, KubetuneError
from kubetune.providers import S3Settings
from kubetune.tasks import causal
from kubetune.tasks.base import LossOutput, Prepared, Steps
from kubetune.tasks.common import (
    data_card_line,
    data_rows,
    load_on_node,
    prepare_tokenizer,
    prepared,
    target_mask,
    tokenize_split,
)
from kubetune.tasks.grpo import GRPOSpec, PromptData
from kubetune.tasks.grpo import loss as grpo_loss
from kubetune.tasks.grpo import rewards as reward_fns
from kubetune.tasks.grpo.data import PromptCollate, encode_prompts, load_prompt_frames
from kubetune.tasks.grpo.rollout import RolloutBatch, Rollouts, completion_logps, dense
from kubetune.tasks.reference import Reference

log = logging.getLogger(__name__)


def prepare(spec: JobSpec, env: DistEnv, model_dir, tokenizer) -> Prepared:
    """The shared skeleton (``tasks.common``) around the task's own parts: the reward functions (a
    user's module imported now), and the rollouts that make each step of prompts the step trained on."""
    g = _own(spec)
    if g.beta and spec.lora is None and not g.reference_copy:
        raise KubetuneError(
            f"beta {g.beta} needs a reference model: a full fine-tune keeps none unless asked",
            field="grpo.beta",
            fix="add a lora section (the reference is the model with its adapter disabled), set "
            "grpo.reference_copy: true (a frozen copy of the base model in memory), or set grpo.beta: 0",
        )
    data = spec.data_as(PromptData)
    frames = load_on_node(load_prompt_frames, spec, env)
    # a user's module is imported now, a reward model loaded, not at the first step
    scorers = reward_fns.scorers(g.rewards, chat=frames.format == "chat", s3=S3Settings.from_spec(spec))
    template = prepare_tokenizer(tokenizer, frames.format == "chat", data.chat_template)
    encode = functools.partial(encode_prompts, tokenizer=tokenizer, max_length=data.max_length)
    fingerprint = f"grpo:{data.max_length}:{tokenizer_fingerprint(tokenizer)}"
    tokens = tokenize_split(frames, env, fingerprint, encode)
    rollouts = Rollouts(
        grpo=g,
        tokenizer=tokenizer,
        scorers=scorers,
        seed=spec.training.seed,
        rank=env.rank,
        chat=frames.format == "chat",
        eos_ids=_eos_ids(model_dir, tokenizer),
    )
    collate, collate_eval = (
        PromptCollate(tokens.train, tokenizer.pad_token_id),
        PromptCollate(tokens.eval, tokenizer.pad_token_id),
    )
    collate.context = collate_eval.context = rollouts
    if env.is_local_main:
        lengths = column(tokens.train, "length")
        log.info(
            "data: %d train / %d eval prompts (%s format%s); longest prompt %d tokens, mean %.0f; %d completions "
            "per prompt; rewards %s; tokenization cache %s",
            len(tokens.train),
            len(tokens.eval),
            frames.format,
            f", {template} chat template" if template else "",
            lengths.max(),
            lengths.mean(),
            g.num_generations,
            ", ".join(f"{s.label} ×{s.weight:g}" for s in scorers),
            tokens.cache,
        )
    info = {
        "data_format": frames.format,
        "chat_template": template,
        "grpo_loss": g.loss_type,
        "grpo_num_generations": g.num_generations,
        "grpo_beta": g.beta,
        "grpo_rewards": [s.label for s in scorers],
        "grpo_reference": None if not g.beta else "a frozen copy" if spec.lora is None else "the LoRA adapter disabled",
    }
    return prepared(
        tokens,
        collate=collate,
        collate_eval=collate_eval,
        dropped=dict(frames.dropped),
        info=info,
        raw=tokenizer,
        online=rollouts,
        metric_names=rollouts.metric_names(),
    )


def _rollouts(data: Prepared) -> Rollouts:
    assert isinstance(data.online, Rollouts)  # prepare made them
    return data.online


def _own(spec: JobSpec) -> GRPOSpec:
    g = spec.section(GRPOSpec)
    assert g is not None, "a grpo spec has its grpo section (its rewards are required)"
    return g


def _eos_ids(model_dir, tokenizer) -> list[int]:
    """The tokens that end a completion: the tokenizer's end token and the model's generation config's."""
    from transformers import GenerationConfig

    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    return list(dict.fromkeys(ids))


def setup(spec: JobSpec, model, data: Prepared, env: DistEnv, device, autocast, lockstep: bool) -> None:
    """The rollouts on this rank's device; with grpo.reference_copy, the frozen reference (the base
    weights: a checkpoint has not been loaded yet)."""
    rollouts = _rollouts(data)
    rollouts.device, rollouts.lockstep = device, lockstep
    if _own(spec).beta and spec.lora is None:
        if lockstep:
            raise KubetuneError(
                "grpo.reference_copy keeps a whole copy of the model on every process, which a sharded model avoids",
                field="grpo.reference_copy",
                fix="use a lora section (the reference is the adapter disabled), or grpo.beta: 0",
            )
        rollouts.reference = Reference.frozen_copy(model)


# ---------------------------------------------------------------- the loss


def _policy(model, batch: RolloutBatch, autocast):
    g = batch.grpo
    assert g is not None and batch.advantages is not None  # a rollout's batch has both
    logps, entropy = completion_logps(model, batch, g.temperature, autocast)
    labels = batch.labels
    mask = target_mask(labels)
    loss_sum, st = grpo_loss.policy_loss(
        dense(logps, labels),
        None if batch.old_logps is None else dense(batch.old_logps, labels),
        None if batch.ref_logps is None else dense(batch.ref_logps, labels),
        batch.advantages,
        mask,
        loss_type=g.loss_type,
        epsilon_low=g.epsilon,
        epsilon_high=g.epsilon_high if g.epsilon_high is not None else g.epsilon,
        beta=g.beta,
        max_completion_length=g.max_completion_length,
        # the sum the trainer divides by the global step's units (``Rollouts._micro_batches``)
        normalizer=g.max_completion_length if g.loss_type == "dr_grpo" else 1.0,
    )
    if g.loss_type == "bnpo":  # TRL: each micro-batch's token mean, then averaged over micro-batches
        loss_sum = loss_sum * len(labels) / st.tokens.clamp(min=1.0)
    tokens = st.tokens.clamp(min=1.0)
    kl = [st.kl / tokens] if g.beta and st.kl is not None else []  # beta: kl is there
    policy = torch.stack(
        [
            *kl,
            entropy.sum() / tokens,
            st.clipped_low / tokens,
            st.clipped_high / tokens,
            (st.clipped_low + st.clipped_high) / tokens,
        ]
    )
    return loss_sum, policy


def loss(model, batch: RolloutBatch, autocast) -> LossOutput:
    """The micro-batch's loss sum over its units, and its metrics' sums (each a value × the units, so the
    logged mean over units is the value)."""
    loss_sum, policy = _policy(model, batch, autocast)
    assert batch.stats is not None  # a rollout's batch has them
    units = torch.tensor(batch.units, device=loss_sum.device, dtype=torch.float64)
    metrics = torch.cat([policy.detach().double(), batch.stats.to(policy.device, torch.float64)]) * units
    return LossOutput(loss_sum, units, metrics)


# ---------------------------------------------------------------- evaluation


def eval_step(model, batch, autocast) -> dict:
    return batch.context.evaluate(model, batch, autocast)


def eval_totals(stats: list[dict], data: Prepared, device) -> dict[str, torch.Tensor]:
    """The reward sums (total and per function), prompts, completion tokens and truncated completions; a
    reward function's failure on any rank stops every rank."""
    errors = [e for e in distributed.all_gather_object(next((s["error"] for s in stats if s["error"]), None)) if e]
    if errors:
        raise AgreedError(errors[0])
    n_fn = len(_rollouts(data).scorers)
    totals = {
        k: torch.zeros((), device=device, dtype=torch.float64) for k in ("reward", "prompts", "tokens", "truncated")
    }
    totals["rewards"] = torch.zeros(n_fn, device=device, dtype=torch.float64)
    for st in stats:
        for k in ("reward", "prompts", "tokens", "truncated"):
            totals[k] += st[k] if not torch.is_tensor(st[k]) else st[k].to(device)
        totals["rewards"] += st["rewards"].to(device)
    return totals


def eval_metrics(totals: dict[str, np.ndarray], data: Prepared) -> dict:
    """Means over the held-out prompts of one greedy completion each."""
    n = max(float(totals["prompts"]), 1.0)
    out = {"eval_reward": float(totals["reward"]) / n}
    scorers = _rollouts(data).scorers
    if len(scorers) > 1:
        out.update({f"eval_reward_{s.label}": float(v) / n for s, v in zip(scorers, totals["rewards"])})
    out["eval_completion_length"] = float(totals["tokens"]) / n
    out["eval_completion_truncated"] = float(totals["truncated"]) / n
    out["eval_prompts"] = int(totals["prompts"])
    out["eval_samples"] = data.eval_rows
    return out


# ---------------------------------------------------------------- export


def export(spec: JobSpec, model, tokenizer, data: Prepared, out, metrics: dict) -> None:
    """The causal LM's export (``tasks.causal``), and ``completions.jsonl``: the newest sampled completions (rank 0's)
    with their rewards."""
    causal.export(spec, model, tokenizer, data, out, metrics)
    lines = "".join(json.dumps(r) + "\n" for r in _rollouts(data).samples)
    artifacts.write_atomic(out / "completions.jsonl", lines)


# ---------------------------------------------------------------- how the results read


def _report_rows(m: dict) -> list[tuple[str, object]]:
    rows = [("eval mean reward (greedy, one completion per prompt)", m.get("eval_reward"))]
    rows += [(f"eval reward {k.removeprefix('eval_reward_')}", v) for k, v in m.items() if k.startswith("eval_reward_")]
    return rows + [
        (
            "eval completion length (tokens), truncated share",
            f"{m.get('eval_completion_length', 0):.1f}, {m.get('eval_completion_truncated', 0):.3f}",
        ),
        ("eval prompts", m.get("eval_prompts")),
        ("rewards", ", ".join(m.get("grpo_rewards") or [])),
        (
            "grpo loss, completions per prompt, beta",
            f"{m.get('grpo_loss')}, {m.get('grpo_num_generations')}, {m.get('grpo_beta')}",
        ),
        ("reference model", m.get("grpo_reference") or "none (beta 0)"),
        *data_rows(m, "none (text prompts)"),
    ]


def _card_about(m: dict) -> list[str]:
    return [
        f"Trained with GRPO (online RL; {m.get('grpo_loss')} loss, {m.get('grpo_num_generations')} completions per "
        f"prompt, rewards: {', '.join(m.get('grpo_rewards') or [])}). On {m.get('eval_prompts')} held-out prompts "
        f"the mean reward of a greedy completion is {m.get('eval_reward', float('nan')):.4f}.",
        data_card_line(m),
    ]


def _summary(m: dict) -> str:
    return f"mean reward {m['eval_reward']:.4f} on {m['eval_prompts']} held-out prompts (greedy)"


TASK = causal.generation_task(
    load_frames=load_prompt_frames,
    prepare=prepare,
    steps=Steps(loss, eval_step, eval_totals, eval_metrics),
    headline=("eval_reward",),
    export=export,
    artifact_files=("completions.jsonl",),  # what export writes beside the causal-LM export
    present=causal.presentation(
        report_rows=_report_rows,
        card_about=_card_about,
        headline=lambda m: f"mean reward {m.get('eval_reward', float('nan')):.4f}",
        summary=_summary,
        step_plots=(
            ("Reward", ("reward", "eval_reward")),
            ("Completion length (tokens)", ("completion_length", "eval_completion_length")),
            ("Policy", ("kl", "entropy", "clip_ratio_region")),
        ),
        loss_label="GRPO loss",
        card_metrics=("eval_reward", "train_loss"),
    ),
    setup=setup,
)
