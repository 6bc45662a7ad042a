"""ORPO (Odds Ratio Preference Optimization) of a causal LM: the task's pieces for the shared trainer
(``training/trainer.py``).

Data: preference pairs read by ``tasks.pairs`` (text or chat, any column names) and tokenized as DPO's are
(``tasks.pair_batches.encode_pairs``: TRL's prompt/answer split); a micro-batch is its pairs' chosen sequences, then
their rejected ones (``tasks.pair_batches.PairCollate``, carrying the ``orpo:`` section), cut to ``data.max_length``
keeping their start. Model: the causal LM (``tasks.causal``: full fine-tune, LoRA, QLoRA) with dropout off, as
DPO's. No reference model. Loss (TRL's
ORPOTrainer): the chosen sequences' next-token NLL over every real token (prompt and answer, averaged over the
micro-batch's tokens) minus λ × log σ(log odds ratio), the odds from each answer's mean token log-probability,
log odds = (c − r) − (log(1 − e^c) − log(1 − e^r)); both from one forward pass. Logged under TRL's names: the
rewards (λ × the mean answer log-probabilities), their accuracy and margin, the log-probabilities, nll_loss,
log_odds_ratio, log_odds_chosen. Export, ``predict`` and the Hub push are the causal LM's (``tasks.causal``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch
import torch.nn.functional as F

from kubetune.config import JobSpec
from kubetune.data.rows import column
from kubetune.data.tokenize import tokenizer_fingerprint
from kubetune.distributed import DistEnv
from kubetune.tasks import causal
from kubetune.tasks.base import Prepared
from kubetune.tasks.common import (
    IGNORE,
    data_card_line,
    data_rows,
    load_on_node,
    pair_steps,
    prepare_tokenizer,
    prepared,
    target_mask,
    tokenize_split,
)
from kubetune.tasks.logprobs import target_logps
from kubetune.tasks.orpo import ORPOData, ORPOSpec
from kubetune.tasks.pair_batches import PairBatch, PairCollate, encode_pairs
from kubetune.tasks.pairs import load_pair_frames, with_answers

log = logging.getLogger(__name__)

# TRL's ORPOTrainer logs rewards/accuracies, rewards/chosen, rewards/rejected, rewards/margins, logps/chosen,
# logps/rejected, nll_loss, log_odds_ratio, log_odds_chosen: the same, with _ for /.
METRICS = (
    "reward_accuracy",
    "reward_chosen",
    "reward_rejected",
    "reward_margin",
    "logps_chosen",
    "logps_rejected",
    "nll_loss",
    "log_odds_ratio",
    "log_odds_chosen",
)


def prepare(spec: JobSpec, env: DistEnv, model_dir, tokenizer) -> Prepared:
    """The shared skeleton (``tasks.common``) around DPO's tokens: pairs dropped whose prompt leaves no answer token."""
    data = spec.data_as(ORPOData)
    frames = load_on_node(load_pair_frames, spec, env)
    template = prepare_tokenizer(tokenizer, frames.format == "chat", data.chat_template)
    max_length = data.max_length
    encode = functools.partial(encode_pairs, tokenizer=tokenizer, max_length=max_length)
    tokens = tokenize_split(frames, env, f"orpo:{max_length}:{tokenizer_fingerprint(tokenizer)}", encode)
    dropped = dict(frames.dropped)
    tokens.train = with_answers(tokens.train, dropped, "train_truncated", max_length)
    tokens.eval = with_answers(tokens.eval, dropped, "eval_truncated", max_length)
    own = spec.section(ORPOSpec) or ORPOSpec()
    if env.is_local_main:
        lengths = column(tokens.train, "length")
        log.info(
            "data: %d train / %d eval pairs (%s format%s); longest sequence %d tokens, mean %.0f; tokenization "
            "cache %s",
            len(tokens.train),
            len(tokens.eval),
            frames.format,
            f", {template} chat template" if template else "",
            lengths.max(),
            lengths.mean(),
            tokens.cache,
        )
    collate, collate_eval = (
        PairCollate(ds, tokenizer.pad_token_id, max_length, own) for ds in (tokens.train, tokens.eval)
    )
    info = {"data_format": frames.format, "chat_template": template, "orpo_beta": own.beta}
    return prepared(tokens, collate=collate, collate_eval=collate_eval, dropped=dropped, info=info, raw=tokenizer)


# ---------------------------------------------------------------- the loss


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − e^x) for x < 0, stable on both sides of −ln 2 (as TRL computes it)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def pair_terms(chosen: torch.Tensor, rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's odds-ratio loss, −λ log σ(log odds), and its statistics (the first 6 of ``METRICS``, then
    log_odds_ratio and log_odds_chosen; nll_loss is added by the caller) from the answers' mean token
    log-probabilities (fp32)."""
    log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    rc, rr = beta * chosen.detach(), beta * rejected.detach()
    stats = torch.stack(
        [(rc > rr).float(), rc, rr, rc - rr, chosen.detach(), rejected.detach(), ratio.detach(), log_odds.detach()],
        dim=1,
    )
    return -beta * ratio, stats


def _forward(model, batch: PairBatch[ORPOSpec], autocast):
    """One forward pass over the pairs: the answers' mean token log-probabilities (chosen, rejected) and the chosen
    sequences' summed NLL over every real token with their count."""
    ids, mask = batch.inputs["input_ids"], batch.inputs["attention_mask"]
    n = ids.shape[0] // 2
    # the targets: every real token of the chosen sequences (the NLL covers prompt and answer), the rejected
    # sequences' answers (their mean log-probability) only
    every = torch.cat([ids[:n].masked_fill(mask[:n] == 0, IGNORE), batch.labels[n:]])
    logps = target_logps(model, dataclasses.replace(batch, labels=every), autocast)
    on = target_mask(every)
    dense = torch.zeros(on.shape, dtype=logps.dtype, device=logps.device).masked_scatter(on, logps)
    answer = target_mask(batch.labels)
    mean = (dense * answer).sum(dim=1) / answer.sum(dim=1).clamp(min=1)
    return mean[:n], mean[n:], -dense[:n].sum(), on[:n].sum()


def _pairs(model, batch: PairBatch[ORPOSpec], autocast) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch's summed loss (n × its token-mean NLL + the pairs' odds-ratio losses: TRL's micro-batch loss
    times n) and its per-pair statistics with nll_loss."""
    chosen, rejected, nll_sum, tokens = _forward(model, batch, autocast)
    odds_losses, stats = pair_terms(chosen, rejected, (batch.settings or ORPOSpec()).beta)
    n = len(chosen)
    nll = nll_sum / tokens.clamp(min=1)
    total = n * nll + odds_losses.sum()
    stats = torch.cat([stats[:, :6], nll.detach().expand(n, 1), stats[:, 6:]], dim=1)
    return total, stats


STEPS = pair_steps(METRICS, _pairs)
loss, eval_step, eval_totals, eval_metrics = STEPS


# ---------------------------------------------------------------- how the results read


def _report_rows(m: dict) -> list[tuple[str, object]]:
    return [
        ("eval reward accuracy (chosen answer likelier than rejected)", m.get("eval_reward_accuracy")),
        ("eval reward margin (λ × mean log-probability)", m.get("eval_reward_margin")),
        ("eval log odds ratio (log σ)", m.get("eval_log_odds_ratio")),
        ("eval NLL of the chosen sequences", m.get("eval_nll_loss")),
        ("eval pairs", m.get("eval_pairs")),
        ("orpo λ (beta)", m.get("orpo_beta")),
        *data_rows(m, "none (text pairs)"),
    ]


def _card_about(m: dict) -> list[str]:
    return [
        f"Preference-tuned with ORPO (λ {m.get('orpo_beta')}; no reference model). On {m.get('eval_pairs')} held-out "
        f"pairs the chosen answer is the likelier one {m.get('eval_reward_accuracy', float('nan')):.2%} of the time.",
        data_card_line(m),
    ]


TASK = causal.generation_task(
    load_frames=load_pair_frames,
    prepare=prepare,
    steps=STEPS,
    headline=("eval_reward_accuracy", "eval_reward_margin"),
    present=causal.presentation(
        report_rows=_report_rows,
        card_about=_card_about,
        headline=causal.reward_accuracy_headline,
        summary=causal.pair_summary,
        step_plots=(
            causal.REWARD_ACCURACY_PLOT,
            ("Reward margin and log odds", ("reward_margin", "eval_reward_margin", "log_odds_chosen")),
        ),
        loss_label="ORPO loss (NLL − λ log σ(log odds))",
    ),
    train_metrics=METRICS,
)
