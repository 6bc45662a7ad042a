"""Sequence log-probabilities of a causal LM, computed as its loss is: the next-token cross-entropy over the target
tokens (labels not ``IGNORE``) without the logits of a whole micro-batch (``token_loss``), each target token's
log-probability (``target_logps``) and each row's sum of them (``sequence_logps``). The causal-LM task's loss and
the preference tasks (DPO, KTO, ORPO: a policy and its reference compared) share it."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from kubetune.data import Batch
from kubetune.tasks import attention
from kubetune.tasks.common import head_forward, next_token_targets, replaceable_head, target_mask

# Target positions projected onto the vocabulary together: a chunk's logits, their fp32 copy and
# softmax (about 10 bytes x LOSS_CHUNK x vocabulary) are the loss's transient peak.
LOSS_CHUNK = 512


def target_logps(model, batch: Batch, autocast) -> torch.Tensor:
    """The log-probability (fp32) of every target token of a micro-batch (labels not IGNORE), in
    row-major order, computed as the loss is (no full logits): what the DPO task sums per answer."""
    nll, _, _ = token_loss(model, batch, autocast, per_token=True)
    return -nll


def sequence_logps(model, batch: Batch, autocast) -> torch.Tensor:
    """Each row's summed target-token log-probability (fp32), computed as the loss is: what the preference tasks
    (DPO, KTO) compare between the policy and the reference. Scattered into the sequence layout and summed per row:
    deterministic, unlike index_add on a GPU."""
    per_token = target_logps(model, batch, autocast)
    mask = target_mask(batch.labels)
    dense = torch.zeros(mask.shape, dtype=per_token.dtype, device=per_token.device)
    return dense.masked_scatter(mask, per_token).sum(dim=1)


def token_loss(model, batch: Batch, autocast, count_correct: bool = False, per_token: bool = False):
    """The causal token loss, shared by training and evaluation: next-token cross-entropy summed
    over the target tokens (labels not IGNORE), their count, and (``count_correct``, evaluation)
    how many the argmax got right, else None.

    The logits of a whole micro-batch (length x vocabulary: 4 GB in bf16 for 16k tokens and a 128k
    vocabulary) never exist. The model keeps the final hidden states of the positions that predict
    a target only (``logits_to_keep`` as a boolean mask, transformers' own argument), and for this
    one call its output projection is the loss itself (``_loss_as_head``): it projects those states
    onto the vocabulary ``LOSS_CHUNK`` positions at a time, each chunk's logits recomputed in the
    backward pass (activation checkpointing) instead of kept. Inside the model's forward, so DDP
    and FSDP see the projection's weight used where they expect (FSDP gathers it again before the
    backward reaches it). Other models' loss is taken from the target rows of their logits, chunked
    the same way. ``per_token``: the cross-entropy of each target token instead of their sum."""
    mask, chosen, keep = next_token_targets(batch.labels)  # position t predicts token t + 1
    head = replaceable_head(model)
    packed = "position_ids" in batch.inputs and "attention_mask" not in batch.inputs
    with autocast, attention.packed_call() if packed else contextlib.nullcontext():
        if head is not None:
            with _loss_as_head(head, chosen, count_correct, per_token) as hits:
                total = model(**batch.inputs, logits_to_keep=keep).logits
            correct = hits[0]
        else:
            total, correct = _chunked_loss(model(**batch.inputs).logits[keep], chosen, None, count_correct, per_token)
    return total, mask.sum(), correct


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
def _loss_as_head(head: torch.nn.Linear, chosen: torch.Tensor, count_correct: bool, per_token: bool = False):
    """For one forward call, the output projection returns the chunked loss of the hidden states it
    is given against ``chosen``; yields a list that then holds the count of right guesses (or None)."""
    hits: list[torch.Tensor | None] = []

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        total, correct = _chunked_loss(hidden, chosen, head.weight, count_correct, per_token)
        hits.append(correct)
        return total

    with head_forward(head, forward):
        yield hits
