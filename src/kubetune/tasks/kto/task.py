"""KTO (Kahneman-Tversky Optimization) of a causal LM: the task's pieces for the shared trainer
(``training/trainer.py``).

Data: unpaired examples read and tokenized by ``data.py`` (TRL's conventions). A micro-batch is its examples'
prompt + completion, then the same prompts each with the previous example's completion (its KL sequences: TRL's
rotation by one within the batch, ``(x_1, y_n), (x_2, y_1), …``), cut to ``data.max_length`` keeping their start.
Model: the causal LM (``tasks.causal``: full fine-tune, LoRA, QLoRA) with dropout off, as DPO's. The reference
(``tasks.reference``): with LoRA the model with its adapter disabled; for a full fine-tune a frozen copy of the base
model, made before the first step (before a checkpoint's weights replace the base's), because the KL sequences
change with each batch and cannot be precomputed as DPO's answers are. Loss (TRL's KTOTrainer, loss_type kto): z0 =
max(0, the mean over the step's KL sequences, gathered over the processes in training, of log π(y'|x) − log
π_ref(y'|x)) (no gradient); a desirable example's loss is desirable_weight × (1 − σ(β (r − z0))), an undesirable
one's undesirable_weight × (1 − σ(β (z0 − r))), r its completion's summed log-ratio; averaged over the step's
examples. Logged under TRL's names: kl, the rewards (β r) and log-probabilities of the desirable and the undesirable
examples, their margin.
Export, ``predict`` and the Hub push are the causal LM's (``tasks.causal``)."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from kubetune import distributed
from kubetune.config import JobSpec
from kubetune.data import Batch
from kubetune.data.rows import column
from kubetune.data.tokenize import tokenizer_fingerprint
from kubetune.distributed import DistEnv
from kubetune.errors import KubetuneError
from kubetune.tasks import causal, common
from kubetune.tasks.base import LossOutput, Prepared, Steps
from kubetune.tasks.common import IGNORE, load_on_node, prepare_tokenizer, prepared, right_pad, tokenize_split
from kubetune.tasks.kto import KTOData, KTOSpec
from kubetune.tasks.kto.data import encode, load_frames
from kubetune.tasks.logprobs import sequence_logps
from kubetune.tasks.pairs import with_answers
from kubetune.tasks.reference import Reference

log = logging.getLogger(__name__)

# TRL's KTOTrainer logs kl, rewards/chosen, rewards/rejected, rewards/margins, logps/chosen, logps/rejected (chosen:
# the desirable examples, rejected: the undesirable ones): the same, with _ for /. In the training log each is the
# micro-batch's value weighted by its examples (the rows carry the per-kind means, scaled: see _stats).
METRICS = ("kl", "reward_chosen", "reward_rejected", "reward_margin", "logps_chosen", "logps_rejected")


@dataclass
class KTOBatch(Batch):
    """A micro-batch of examples: rows 0..n-1 prompt + completion, rows n..2n-1 the KL sequences; labels are the
    completion tokens (IGNORE elsewhere); ``desirable`` the examples' flags."""

    desirable: torch.Tensor | None = None  # [n] bool
    kto: KTOSpec = field(default_factory=KTOSpec)  # the loss's settings (the trainer passes no spec to the loss)


class Collate:
    """Dataset row ids -> a ``KTOBatch``: prompt + completion cut to ``max_length`` (TRL's keep_start), right-padded."""

    def __init__(self, ds, pad_id: int, max_length: int, kto: KTOSpec):
        self.ds, self.pad_id, self.max_length, self.kto = ds, pad_id, max_length, kto

    def __call__(self, indices: np.ndarray) -> KTOBatch:
        weight = 1.0
        if len(indices) == 0:  # a rank's empty share of the last step: computed, weighs nothing
            indices, weight = np.zeros(1, dtype=np.int64), 0.0
        rows = self.ds[[int(i) for i in indices]]
        prompts, completions = rows["prompt_ids"], rows["completion_ids"]
        kl_completions = completions[-1:] + completions[:-1]
        seqs, answers = [], []
        for answer_list in (completions, kl_completions):
            for prompt, answer in zip(prompts, answer_list):
                seqs.append((prompt + answer)[: self.max_length])
                answers.append(min(len(answer), max(self.max_length - len(prompt), 0)))
        ids, mask = right_pad(seqs, self.pad_id)
        labels = torch.full(ids.shape, IGNORE, dtype=torch.long)
        for k, (seq, n) in enumerate(zip(seqs, answers)):
            labels[k, len(seq) - n : len(seq)] = ids[k, len(seq) - n : len(seq)]
        return KTOBatch(
            {"input_ids": ids, "attention_mask": mask},
            labels,
            weight,
            torch.as_tensor(indices, dtype=torch.long),
            torch.tensor([bool(x) for x in rows["label"]]),
            self.kto,
        )


def prepare(spec: JobSpec, env: DistEnv, model_dir, tokenizer) -> Prepared:
    """The shared skeleton (``tasks.common``): examples dropped whose prompt leaves no completion token.

    Raises:
        KubetuneError: training.batch_size 1, where each example's KL sequence would be itself (TRL refuses it too).
    """
    if spec.training.batch_size < 2:
        raise KubetuneError(
            "1: KTO estimates its KL term from each prompt paired with another example's completion in the same "
            "micro-batch, and a micro-batch of one has no other",
            field="training.batch_size",
            fix="set training.batch_size to 2 or more (grad_accum keeps the global batch where you want it)",
        )
    data = spec.data_as(KTOData)
    frames = load_on_node(load_frames, spec, env)
    template = prepare_tokenizer(tokenizer, frames.format == "chat", data.chat_template)
    max_length = data.max_length
    tokens = tokenize_split(
        frames,
        env,
        f"kto:{max_length}:{tokenizer_fingerprint(tokenizer)}",
        functools.partial(encode, tokenizer=tokenizer, max_length=max_length),
    )
    dropped = dict(frames.dropped)
    tokens.train = with_answers(tokens.train, dropped, "train_truncated", max_length)
    tokens.eval = with_answers(tokens.eval, dropped, "eval_truncated", max_length)
    own = spec.section(KTOSpec) or KTOSpec()
    desirable = int(column(tokens.train, "label").sum())
    if env.is_local_main:
        lengths = column(tokens.train, "length")
        log.info(
            "data: %d train (%d desirable, %d undesirable) / %d eval examples (%s format%s); longest sequence %d "
            "tokens, mean %.0f; tokenization cache %s",
            len(tokens.train),
            desirable,
            len(tokens.train) - desirable,
            len(tokens.eval),
            frames.format,
            f", {template} chat template" if template else "",
            lengths.max(),
            lengths.mean(),
            tokens.cache,
        )
    collate, collate_eval = (Collate(ds, tokenizer.pad_token_id, max_length, own) for ds in (tokens.train, tokens.eval))
    info = {
        "data_format": frames.format,
        "chat_template": template,
        "kto_beta": own.beta,
        "kto_desirable_weight": own.desirable_weight,
        "kto_undesirable_weight": own.undesirable_weight,
        "kto_train_desirable": desirable,
        "kto_train_undesirable": len(tokens.train) - desirable,
        "kto_reference": "the base model (LoRA adapter disabled)" if spec.lora else "a frozen copy of the base model",
    }
    return prepared(tokens, collate=collate, collate_eval=collate_eval, dropped=dropped, info=info, raw=tokenizer)


# ---------------------------------------------------------------- the reference


def setup(
    spec: JobSpec,
    model: torch.nn.Module,
    data: Prepared,
    env: DistEnv,
    device: torch.device,
    autocast: torch.autocast,
    lockstep: bool,
) -> None:
    """Full fine-tune: a frozen copy of the base model (called before a checkpoint's weights are loaded), attached
    to the model (``tasks.reference``: the optimizer, DDP, checkpoints and the export never see it). With LoRA the
    reference is the adapter-disabled model, on the fly."""
    if spec.lora is not None:
        return
    Reference.frozen_copy(model).attach(model)


# ---------------------------------------------------------------- the loss


def _half(batch: KTOBatch, second: bool) -> Batch:
    """The examples' rows (or, ``second``, the KL sequences') of ``batch``, as a plain batch."""
    n = batch.labels.shape[0] // 2
    part = slice(n, None) if second else slice(0, n)
    inputs = {k: v[part] for k, v in batch.inputs.items()}
    width = int(inputs["attention_mask"].sum(dim=1).max())  # right-padded: the half's own width
    return Batch({k: v[:, :width] for k, v in inputs.items()}, batch.labels[part, :width], batch.weight)


def example_losses(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor,
    kto: KTOSpec,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each example's loss (TRL's, loss_type kto) and its log-ratio's reward β r, from the completions' summed
    log-probabilities under the policy and the reference and the step's KL estimate ``kl`` (already ≥ 0)."""
    ratio = logps - ref_logps
    chosen = kto.desirable_weight * (1 - torch.sigmoid(kto.beta * (ratio - kl)))
    rejected = kto.undesirable_weight * (1 - torch.sigmoid(kto.beta * (kl - ratio)))
    return torch.where(desirable, chosen, rejected), kto.beta * ratio.detach()


def _forward(model, batch: KTOBatch, autocast, gather: bool):
    """The examples' losses and the rows of statistics (``_stats``); ``gather``: the KL estimate's mean over the
    processes (training; every rank computes as many micro-batches)."""
    # both halves in one forward; first: no graph is held meanwhile
    ref, ref_kl = Reference.attached(model).logps(model, batch, autocast).chunk(2)
    examples, kl_rows = _half(batch, False), _half(batch, True)
    with torch.no_grad():
        kl_logps = sequence_logps(model, kl_rows, autocast)
    logps = sequence_logps(model, examples, autocast)
    kl = (kl_logps - ref_kl).mean().detach()
    if gather and torch.distributed.is_initialized():
        kl = distributed.all_reduce_sum(kl.clone()) / torch.distributed.get_world_size()
    kl = kl.clamp(min=0)
    assert batch.desirable is not None  # the collate sets it
    desirable = batch.desirable.to(logps.device)
    losses, rewards = example_losses(logps, ref, desirable, kl, batch.kto)
    return losses, rewards, logps.detach(), desirable, kl


def _stats(rewards, logps, desirable, kl) -> torch.Tensor:
    """One row per example whose column means over the micro-batch are ``METRICS``: kl, and the desirable and the
    undesirable examples' mean reward and log-probability (each kind's values scaled by n / its count, so the
    micro-batch's sum over n is that kind's mean; 0 for a kind the micro-batch lacks)."""
    n = len(rewards)
    d = desirable.double()
    u = 1 - d
    cd, cu = n / d.sum().clamp(min=1), n / u.sum().clamp(min=1)
    rc, ru = rewards.double() * d * cd, rewards.double() * u * cu
    return torch.stack(
        [kl.double().expand(n), rc, ru, rc - ru, logps.double() * d * cd, logps.double() * u * cu], dim=1
    )


def loss(model, batch: KTOBatch, autocast) -> LossOutput:
    losses, rewards, logps, desirable, kl = _forward(model, batch, autocast, gather=True)
    stats = _stats(rewards, logps, desirable, kl)
    return LossOutput(losses.sum(), torch.tensor(float(len(losses)), device=losses.device), stats.sum(dim=0))


# evaluation: exact means over the held-out examples of each kind (sums and counts, summed over the ranks)
EVAL_SUMS = ("loss", "examples", "desirable", "reward_desirable", "reward_undesirable", "logps_desirable",
             "logps_undesirable", "kl_batches", "kl")  # fmt: skip


def eval_step(model, batch: KTOBatch, autocast) -> dict:
    losses, rewards, logps, desirable, kl = _forward(model, batch, autocast, gather=False)
    d = desirable.double()
    u = 1 - d
    r, lp = rewards.double(), logps.double()
    values = [losses.double().sum(), float(len(losses)), d.sum(), (r * d).sum(), (r * u).sum(), (lp * d).sum(),
              (lp * u).sum(), 1.0, kl.double()]  # fmt: skip
    return {"sums": torch.stack([torch.as_tensor(v, dtype=torch.float64, device=losses.device) for v in values])}


def eval_totals(stats: list[dict], data: Prepared, device) -> dict[str, torch.Tensor]:
    total = torch.zeros(len(EVAL_SUMS), device=device, dtype=torch.float64)
    for st in stats:
        total += st["sums"].to(device)
    return {"sums": total}


def eval_metrics(totals: dict, data: Prepared) -> dict:
    s = dict(zip(EVAL_SUMS, (float(v) for v in totals["sums"])))
    n, nd = max(s["examples"], 1.0), s["desirable"]
    nu = s["examples"] - nd
    chosen = s["reward_desirable"] / nd if nd else float("nan")
    rejected = s["reward_undesirable"] / nu if nu else float("nan")
    return {
        "eval_loss": s["loss"] / n,
        "eval_kl": s["kl"] / max(s["kl_batches"], 1.0),
        "eval_reward_chosen": chosen,
        "eval_reward_rejected": rejected,
        "eval_reward_margin": chosen - rejected,
        "eval_logps_chosen": s["logps_desirable"] / nd if nd else float("nan"),
        "eval_logps_rejected": s["logps_undesirable"] / nu if nu else float("nan"),
        "eval_examples": int(s["examples"]),
        "eval_samples": data.eval_rows,
    }


# ---------------------------------------------------------------- how the results read


def _report_rows(m: dict) -> list[tuple[str, object]]:
    rewards = f"{m.get('eval_reward_chosen'):.4f} / {m.get('eval_reward_rejected'):.4f}"
    counts = f"{m.get('kto_train_desirable')} / {m.get('kto_train_undesirable')}"
    return [
        ("eval reward margin (desirable − undesirable, β × log-ratio)", m.get("eval_reward_margin")),
        ("eval rewards desirable / undesirable", rewards),
        ("eval KL estimate", m.get("eval_kl")),
        ("eval examples", m.get("eval_examples")),
        ("kto beta, desirable / undesirable weight",
         f"{m.get('kto_beta')}, {m.get('kto_desirable_weight')} / {m.get('kto_undesirable_weight')}"),
        ("train examples desirable / undesirable", counts),
        ("reference model", m.get("kto_reference")),
        *common.data_rows(m, "none (text)"),
    ]  # fmt: skip


def _card_about(m: dict) -> list[str]:
    return [
        f"Preference-tuned with KTO (beta {m.get('kto_beta')}) on unpaired answers flagged desirable or not; the "
        f"reference model is {m.get('kto_reference')}. On {m.get('eval_examples')} held-out examples the reward "
        f"margin (desirable − undesirable) is {m.get('eval_reward_margin', float('nan')):.4f}.",
        common.data_card_line(m),
    ]


def _summary(m: dict) -> str:
    return (
        f"reward margin {m['eval_reward_margin']:.4f}, kl {m['eval_kl']:.4f}, eval loss {m['eval_loss']:.4f} on "
        f"{m['eval_examples']} held-out examples"
    )


TASK = causal.generation_task(
    load_frames=load_frames,
    prepare=prepare,
    steps=Steps(loss, eval_step, eval_totals, eval_metrics),
    headline=("eval_reward_margin", "eval_kl"),
    present=causal.presentation(
        report_rows=_report_rows,
        card_about=_card_about,
        headline=lambda m: f"reward margin {m.get('eval_reward_margin', float('nan')):.4f}",
        summary=_summary,
        step_plots=(
            causal.REWARDS_PLOT,
            ("KL estimate", ("kl", "eval_kl")),
        ),
        loss_label="KTO loss",
    ),
    train_metrics=METRICS,
    setup=setup,
)
