"""Sequence log-probabilities of a causal LM, computed as its loss is: the next-token cross-entropy over the target
tokens (labels not ``IGNORE``) without the logits of a whole micro-batch (``token_loss``), each target token's
log-probability (``target_logps``) and each row's sum of them (``sequence_logps``). The causal-LM task's loss and
the preference tasks (DPO, KTO, ORPO: a policy and its reference compared) share it."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F

from kubetune.data import Batch
from kubetune.tasks import attention, fused
from kubetune.tasks.common import Targets, batch_targets, head_forward, replaceable_head, unwrap

# Target positions projected onto the vocabulary together: a chunk's logits, their fp32 copy and
# softmax (about 10 bytes x LOSS_CHUNK x vocabulary) are the loss's transient peak.
LOSS_CHUNK = 512


def target_logps(model, batch: Batch, autocast) -> torch.Tensor:
    """The log-probability (fp32) of every target token of a micro-batch (labels not IGNORE), in
    row-major order, computed as the loss is (no full logits): what the DPO task sums per answer."""
    nll, _, _ = _token_loss(model, batch, batch_targets(batch), autocast, per_token=True)
    return -nll


def sequence_logps(model, batch: Batch, autocast) -> torch.Tensor:
    """Each row's summed target-token log-probability (fp32), computed as the loss is: what the preference tasks
    (DPO, KTO) compare between the policy and the reference. Copied into the sequence layout (rows × (positions −
    1)) at the targets' slots and summed per row: deterministic, unlike index_add on a GPU."""
    targets = batch_targets(batch)
    nll, _, _ = _token_loss(model, batch, targets, autocast, per_token=True)
    rows, width = batch.labels.shape
    dense = torch.zeros(rows * max(width - 1, 0), dtype=nll.dtype, device=nll.device)
    return dense.index_copy(0, targets.slots, -nll).view(rows, max(width - 1, 0)).sum(dim=1)


def token_loss(model, batch: Batch, autocast, count_correct: bool = False, per_token: bool = False):
    """The causal token loss, shared by training and evaluation: next-token cross-entropy summed
    over the target tokens (labels not IGNORE), their count, and (``count_correct``, evaluation)
    how many the argmax got right, else None.

    The logits of a whole micro-batch (length x vocabulary: 4 GB in bf16 for 16k tokens and a 128k
    vocabulary) never exist. For this one call the model's output projection is the loss itself
    (``_loss_as_head``): it takes the final hidden states of the positions that predict a target only
    (an index selection with the batch's targets, ``tasks.common.Targets``: built on the host, no sync)
    and projects them onto the vocabulary ``LOSS_CHUNK`` positions at a time, each chunk's logits
    recomputed in the backward pass (activation checkpointing) instead of kept. Inside the model's
    forward, so DDP and FSDP see the projection's weight used where they expect (FSDP gathers it again
    before the backward reaches it). Other models' loss is taken from the target rows of their logits,
    chunked the same way. A packed row's host-built layout goes to the model's packed attention
    (``attention.layout_kwargs``). ``per_token``: the cross-entropy of each target token instead of their sum."""
    return _token_loss(model, batch, batch_targets(batch), autocast, count_correct, per_token)


def _token_loss(model, batch: Batch, targets: Targets, autocast, count_correct: bool = False, per_token: bool = False):
    """``token_loss`` with the batch's ``targets`` given."""
    head = replaceable_head(model)
    packed = "position_ids" in batch.inputs and "attention_mask" not in batch.inputs
    extra = attention.layout_kwargs(_attention_owner(model), batch.layout, batch.inputs.get("position_ids"))
    with autocast, attention.packed_call() if packed else contextlib.nullcontext():
        if head is not None:
            with _loss_as_head(head, targets, count_correct, per_token) as hits:
                total = model(**batch.inputs, **extra).logits
            correct = hits[0]
        else:
            logits = model(**batch.inputs, **extra).logits
            total, correct = _chunked_loss(_select(logits, targets), targets.ids, None, count_correct, per_token)
    return total, targets.count, correct


def _attention_owner(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model whose config names the attention, under its DDP, FSDP or PEFT wrapper."""
    inner: Any = unwrap(model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def _select(states: torch.Tensor, targets: Targets) -> torch.Tensor:
    """The rows of ``states`` (rows, positions, features) at the positions that predict a target, (targets,
    features), row-major: what a boolean selection with the label mask gives, without its sync."""
    return states.flatten(0, 1).index_select(0, targets.positions)


def _chunked_loss(
    states: torch.Tensor,
    chosen: torch.Tensor,
    weight: torch.Tensor | None,
    count_correct: bool,
    per_token: bool = False,
):
    """Summed cross-entropy of ``states`` (logits, or hidden states that ``weight`` projects) against
    ``chosen`` (``per_token``: each row's), ``LOSS_CHUNK`` rows at a time, and how many argmax
    guesses are right (``count_correct``)."""
    parts = []
    correct = torch.zeros((), dtype=torch.long, device=states.device) if count_correct else None
    for rows, ids in zip(states.split(LOSS_CHUNK), chosen.split(LOSS_CHUNK)):
        if torch.is_grad_enabled():
            part, _ = torch.utils.checkpoint.checkpoint(
                _chunk_loss, rows, ids, weight, False, per_token, use_reentrant=False
            )
        else:
            part, hits = _chunk_loss(rows, ids, weight, count_correct, per_token)
            if count_correct:
                correct += hits
        parts.append(part)
    if per_token:
        return (torch.cat(parts) if parts else states.new_zeros(0, dtype=torch.float32)), correct
    total = states.new_zeros((), dtype=torch.float32)
    for part in parts:
        total = total + part
    return total, correct


def _chunk_loss(
    rows: torch.Tensor,
    ids: torch.Tensor,
    weight: torch.Tensor | None,
    count_correct: bool = False,
    per_token: bool = False,
):
    logits = rows if weight is None else F.linear(rows, weight)
    hits = (logits.argmax(-1) == ids).sum() if count_correct else None
    return F.cross_entropy(logits.float(), ids, reduction="none" if per_token else "sum"), hits


@contextlib.contextmanager
def _loss_as_head(head: torch.nn.Linear, targets: Targets, count_correct: bool, per_token: bool = False):
    """For one forward call, the output projection returns the chunked loss of the hidden states it is given (all
    positions: the model keeps all) at the targets' positions against their ids (``head_loss``); yields a list
    that then holds the count of right guesses (or None). Where ``tasks.fused`` marked the head and gradients are
    taken, the loss is Liger's fused linear cross-entropy instead."""
    hits: list[torch.Tensor | None] = []

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        states = _select(hidden, targets)
        if not count_correct and fused.wants_fused_loss(head):  # Liger's kernel on a GPU (training.fast_path.liger)
            total, correct = fused.linear_cross_entropy(states, head.weight, targets.ids, per_token), None
        else:
            total, correct = head_loss(states, targets.ids, head.weight, count_correct, per_token)
        hits.append(correct)
        return total

    with head_forward(head, forward):
        yield hits


def head_loss(
    states: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor, count_correct: bool, per_token: bool = False
):
    """The replaced head's loss: the hidden states of the positions that predict a target (targets × hidden)
    projected by ``weight`` and scored against the target ``ids``: the summed cross-entropy (``per_token``: each
    one's) and how many argmax guesses are right (``count_correct``, else None)."""
    return _chunked_loss(states, ids, weight, count_correct, per_token)
