"""GRPO's mathematics as pure torch functions, equal to TRL 1.16's GRPOTrainer (checked against it in
``tests/unit/test_grpo_loss_trl.py``): the group-relative advantages of sampled completions, the
log-probabilities of their tokens under a sampling temperature, and the clipped policy-gradient loss
with its KL penalty, its four normalizations and the statistics TRL logs.

Layout: a batch holds B completions, each padded to C tokens; ``completion_mask`` (B, C) marks the
tokens that carry a loss (0 for padding, and for every token of a truncated completion when those
are masked). Nothing here talks to other processes: where TRL reduces over ranks, the functions
return sums and counts (or take the global count) so the caller reduces them once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")

# Added to the reward standard deviation before dividing by it (TRL's value): a group whose
# completions all scored the same gets advantages of 0 instead of 0/0.
STD_EPSILON = 1e-4
# A standard deviation at most this is "zero" in the logged share (torch.isclose(std, 0)'s bound, as TRL).
ZERO_STD = 1e-8
# Completion positions whose fp32 logits exist at once in token_logps and token_entropy: a chunk's
# upcast copy and its softmax (about 8 bytes x LOGITS_CHUNK x vocabulary) are the transient peak.
LOGITS_CHUNK = 512


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion's advantage: its reward minus the mean reward of its prompt's group, divided
    (``scale_rewards``) by the group's standard deviation ("group"), the whole batch's ("batch"), or
    not at all ("none"); the standard deviations are unbiased (n − 1), and ``STD_EPSILON`` is added to
    them before dividing.

    Args:
        rewards: (N,) finite rewards of the whole generation batch (every rank's), the
            ``num_generations`` completions of one prompt next to each other.
        num_generations: completions per prompt (the group size).
        scale_rewards: "group", "batch" or "none".

    Returns:
        The (N,) advantages, and the share of completions (a 0-d tensor) whose standard deviation
        (the one ``scale_rewards`` names; "none" counts the group's) is zero. With "batch" that share
        is therefore 0 or 1, as TRL logs it, not the share of groups that all scored the same.

    Raises:
        ValueError: an unknown ``scale_rewards``, or N not a multiple of ``num_generations``.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, not {scale_rewards!r}")
    if num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not make groups of num_generations={num_generations}")
    groups = rewards.view(-1, num_generations)
    centered = (groups - groups.mean(dim=1, keepdim=True)).view(-1)
    if scale_rewards == "batch":
        std = rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())
        std = std.expand_as(rewards)
    else:  # a group of one completion has no spread (TRL: its standard deviation is 0, not NaN)
        std = groups.std(dim=1) if num_generations > 1 else groups.new_zeros(len(groups))
        std = std.repeat_interleave(num_generations)
    advantages = centered if scale_rewards == "none" else centered / (std + STD_EPSILON)
    return advantages, (std <= ZERO_STD).float().mean()


def token_logps(logits: torch.Tensor, completion_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The log-probability (fp32) of each chosen token under the distribution the completions were
    sampled from: softmax(logits / temperature).

    The fp32 copy of the logits is made ``LOGITS_CHUNK`` positions at a time and, when a gradient is
    needed, recomputed in the backward pass instead of kept (activation checkpointing): a bf16 model's
    logits are never held twice, once more in fp32, for the backward.

    Args:
        logits: (..., V) the logits at the positions that predict the completion tokens (for a
            prompt of P tokens, the model's output positions P − 1 to P + C − 2), any float dtype.
        completion_ids: (...) the tokens whose log-probabilities are wanted.
        temperature: the sampling temperature.

    Returns:
        (...) fp32 log-probabilities, shaped as ``completion_ids``.
    """
    rows, ids = logits.reshape(-1, logits.size(-1)), completion_ids.reshape(-1)
    recompute = torch.is_grad_enabled() and logits.requires_grad
    parts = [
        checkpoint(_chunk_logps, r, i, temperature, use_reentrant=False)
        if recompute
        else _chunk_logps(r, i, temperature)
        for r, i in zip(rows.split(LOGITS_CHUNK), ids.split(LOGITS_CHUNK))
    ]
    return torch.cat(parts).view(completion_ids.shape)


def _chunk_logps(rows: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    scaled = rows.float() / temperature
    return scaled.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The entropy (fp32, nats, no gradient) of softmax(logits / temperature) at each position, for
    the logged ``entropy``; the fp32 copy made ``LOGITS_CHUNK`` positions at a time.

    Args:
        logits: (..., V) logits, any float dtype.
        temperature: the sampling temperature.

    Returns:
        (...) entropies, shaped as ``logits`` without its last dimension.
    """
    rows = logits.reshape(-1, logits.size(-1))
    parts = []
    for chunk in rows.split(LOGITS_CHUNK):
        logp = F.log_softmax(chunk.float() / temperature, dim=-1)
        parts.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(parts).view(logits.shape[:-1])


class PolicyStats(NamedTuple):
    """What TRL logs about a batch's loss, as sums and extremes a caller reduces over ranks (sums
    added, ``low_min`` its minimum, ``high_max`` its maximum) before dividing by ``tokens``:
    kl/tokens is TRL's ``kl``, clipped_low/tokens ``clip_ratio/low_mean``, clipped_high/tokens
    ``clip_ratio/high_mean``, and (clipped_low + clipped_high)/tokens ``clip_ratio/region_mean``
    (a ratio is never under both bounds at once, so the two never overlap)."""

    tokens: torch.Tensor  # completion tokens that carry a loss (the mask's sum)
    kl: torch.Tensor | None  # their summed KL term (as the loss weighs it); None when beta is 0 (TRL logs none)
    clipped_low: torch.Tensor  # tokens whose ratio fell under 1 − epsilon_low with a negative advantage
    clipped_high: torch.Tensor  # tokens whose ratio rose over 1 + epsilon_high with a positive advantage
    low_min: torch.Tensor  # the least share of low-clipped tokens in a completion (``clip_ratio/low_min``)
    high_max: torch.Tensor  # the greatest share of high-clipped tokens in a completion (``clip_ratio/high_max``)


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    loss_type: str,
    epsilon_low: float,
    epsilon_high: float,
    beta: float,
    max_completion_length: int,
    use_bias_correction_kl: bool = True,
    normalizer: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, PolicyStats]:
    """GRPO's clipped surrogate loss with the k3 KL penalty, per token:
    −min(r·A, clip(r, 1 − epsilon_low, 1 + epsilon_high)·A) + beta·w·(e^(ref − logp) − (ref − logp) − 1),
    r = e^(logp − old) the token's importance ratio, A its completion's advantage, w = r with
    ``use_bias_correction_kl`` (TRL 1.16's default) else 1; then reduced by ``loss_type``:

    - grpo: each completion's mean over its tokens, summed, / the completions (B);
    - dr_grpo: the tokens' sum / (B × ``max_completion_length``);
    - bnpo, dapo: the tokens' sum / the batch's completion tokens.

    ``normalizer`` replaces that denominator. TRL's dapo divides by the completion tokens of the
    whole generation batch on every rank (÷ processes × gradient-accumulation steps ÷ steps per
    generation), its bnpo by the micro-batch's own: a distributed caller passes the global count for
    dapo, or ``normalizer=1`` for the bare sum when it divides by a whole global step's units itself.

    Args:
        logps: (B, C) the policy's token log-probabilities (``token_logps``), with their gradient.
        old_logps: (B, C) those of the policy that sampled the completions (TRL's
            ``num_iterations`` > 1), or None: then r = e^(logp − logp.detach()), 1 in value whose
            gradient is logp's (the completions were sampled by this very policy).
        ref_logps: (B, C) the reference model's; needed when ``beta`` is not 0, else ignored.
        advantages: (B,) each completion's advantage (``group_advantages``).
        completion_mask: (B, C) 1 for the tokens that carry a loss.
        loss_type: one of ``LOSS_TYPES``.
        epsilon_low, epsilon_high: the clipping range of r (TRL's ``epsilon``, ``epsilon_high``).
        beta: the weight of the KL penalty; 0 for none.
        max_completion_length: dr_grpo's constant length.
        use_bias_correction_kl: weigh each token's KL by its ratio r (DeepSeek-V3.2's unbiased estimate
            of the reverse KL's gradient). It changes the gradient even where r is 1 in value, and the
            logged KL once the policy has moved (``old_logps``).
        normalizer: the denominator instead of the loss type's own (clamped at 1, as TRL's counts).

    Returns:
        The loss (a 0-d fp32 tensor when the log-probabilities are fp32) and its ``PolicyStats``.

    Raises:
        ValueError: an unknown ``loss_type``, or ``beta`` without ``ref_logps``.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, not {loss_type!r}")
    if beta != 0.0 and ref_logps is None:
        raise ValueError("beta is not 0: the KL penalty needs ref_logps")
    mask = completion_mask.bool()
    # A padded position's log-probability can be anything, even -inf: its ratio or KL would be inf,
    # and masking an inf out afterwards still leaves NaN in the gradient (inf x 0). Zeroed first (as
    # TRL's are), every masked position has a ratio of 1 and a KL of 0.
    logps = logps.masked_fill(~mask, 0.0)
    old = logps.detach() if old_logps is None else old_logps.masked_fill(~mask, 0.0)
    ratio = torch.exp(logps - old)
    advantages = advantages.unsqueeze(1)
    clipped = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.min(ratio * advantages, clipped * advantages)
    kl = None
    if beta != 0.0:
        assert ref_logps is not None  # checked above
        log_ref_ratio = ref_logps.masked_fill(~mask, 0.0) - logps
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1  # k3: unbiased, never negative
        if use_bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + beta * kl
    per_token = per_token.masked_fill(~mask, 0.0)

    lengths = mask.sum(dim=1)
    tokens = lengths.sum()
    count: int | torch.Tensor
    if loss_type == "grpo":
        total, count = (per_token.sum(dim=1) / lengths.clamp(min=1)).sum(), len(per_token)
    elif loss_type == "dr_grpo":
        total, count = per_token.sum(), len(per_token) * max_completion_length
    else:  # bnpo, dapo
        total, count = per_token.sum(), tokens
    denominator = torch.as_tensor(count if normalizer is None else normalizer, device=total.device)
    loss = total / denominator.to(total.dtype).clamp(min=1.0)
    return loss, _stats(ratio.detach(), advantages, lengths, kl, epsilon_low, epsilon_high)


@torch.no_grad()
def _stats(ratio, advantages, lengths, kl, epsilon_low, epsilon_high) -> PolicyStats:
    # a masked position's ratio is exactly 1 (its log-probabilities were zeroed): never clipped
    low = (ratio < 1 - epsilon_low) & (advantages < 0)
    high = (ratio > 1 + epsilon_high) & (advantages > 0)
    scored = lengths > 0  # a completion with no token has no share (TRL's NaN, skipped by its nanmin)
    low_share = low.sum(dim=1)[scored] / lengths[scored]
    high_share = high.sum(dim=1)[scored] / lengths[scored]
    nan = ratio.new_tensor(float("nan"))
    return PolicyStats(
        tokens=lengths.sum().float(),
        kl=None if kl is None else kl.sum(),  # 0 at every masked position already
        clipped_low=low.sum().float(),
        clipped_high=high.sum().float(),
        low_min=low_share.min() if len(low_share) else nan,
        high_max=high_share.max() if len(high_share) else nan,
    )
