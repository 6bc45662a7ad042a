"""GRPO's rollouts: one step of prompts (this rank's micro-batches) turned into the step trained on.

Every rank samples ``num_generations`` completions for each of its own prompts with the current policy
(the generation engine, ``inference.generation``: every completion of the step in flight at once, a group's
prompt prefilled once, its KV cache written in place; LoRA with its adapter on; a sharded model with every
rank in step, so no rank gathers the whole model), scores them (``rewards``), and
gathers every rank's rewards for the batch's statistics; a group never leaves its rank, so its
advantages are computed where it was sampled. The sampling RNG is a pure function of (seed, step,
rank): a resumed run draws what the uninterrupted one drew. With ``num_iterations`` > 1 the step's
rollouts (and the sampling policy's log-probabilities) are kept for the next steps, and go into the
checkpoint. A stop signal during the step's generation or a reward call gives the step up on every rank
(``StepAbandoned``), leaving nothing of it (the random state included), so the trainer checkpoints the step
before: a generation is given up at its next forward, a reward call at once.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from kubetune import checkpoint, distributed
from kubetune.data import Batch, StepBatch
from kubetune.errors import AgreedError, KubetuneError
from kubetune.inference.generation import Engine, Generation
from kubetune.tasks.common import IGNORE, head_forward, next_token_targets, replaceable_head, target_mask
from kubetune.tasks.grpo import GRPOSpec
from kubetune.tasks.grpo import loss as grpo_loss
from kubetune.tasks.grpo import rewards as reward_fns
from kubetune.tasks.grpo.data import PromptBatch
from kubetune.tasks.reference import Reference

log = logging.getLogger(__name__)
# completions.jsonl keeps the newest records up to this many (a bounded file, however long the run)
MAX_SAMPLES = 1000


@dataclass
class RolloutBatch(Batch):
    """A micro-batch of completions: each row its prompt then its completion, right-padded; labels are
    the completion tokens that carry a loss (IGNORE elsewhere). Log-probabilities are flat, one per
    label token in row-major order (as ``completion_logps`` returns them)."""

    advantages: torch.Tensor | None = None  # (rows,)
    old_logps: torch.Tensor | None = None  # the sampling policy's (num_iterations > 1)
    ref_logps: torch.Tensor | None = None  # the reference model's (beta > 0)
    stats: torch.Tensor | None = None  # the step's rollout statistics (``Rollouts.rollout_metrics``)
    grpo: GRPOSpec | None = None
    units: float = 0.0  # this micro-batch's loss units (completions, or dapo's tokens)

    def state(self) -> dict:
        """Plain tensors and numbers (a checkpoint is loaded with weights_only)."""
        assert self.advantages is not None and self.stats is not None  # a rollout's batch has both
        return {
            "input_ids": self.inputs["input_ids"].cpu(),
            "attention_mask": self.inputs["attention_mask"].cpu(),
            "labels": self.labels.cpu(),
            "weight": self.weight,
            "index": self.index,
            "advantages": self.advantages.cpu(),
            "old_logps": None if self.old_logps is None else self.old_logps.cpu(),
            "ref_logps": None if self.ref_logps is None else self.ref_logps.cpu(),
            "stats": self.stats.cpu(),
            "units": self.units,
        }

    @classmethod
    def from_state(cls, s: dict, grpo: GRPOSpec) -> RolloutBatch:
        inputs = {"input_ids": s["input_ids"], "attention_mask": s["attention_mask"]}
        return cls(
            inputs,
            s["labels"],
            s["weight"],
            s["index"],
            s["advantages"],
            s["old_logps"],
            s["ref_logps"],
            s["stats"],
            grpo,
            s["units"],
        )


# ---------------------------------------------------------------- log-probabilities


def _chunk(rows: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor, temperature: float):
    logits = rows @ weight.t()
    logps = grpo_loss._chunk_logps(logits, ids, temperature)
    with torch.no_grad():
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
    return logps, entropy


@contextlib.contextmanager
def _head_as_logps(head: torch.nn.Linear, chosen: torch.Tensor, temperature: float, entropy: list):
    """For one forward call, the output projection returns the log-probabilities of ``chosen`` under
    softmax(logits / temperature) at the positions it is given (their entropies into ``entropy``),
    ``LOGITS_CHUNK`` positions at a time, each chunk's logits recomputed in the backward pass instead of
    kept: the causal LM's chunked head (``tasks.logprobs``: its loss in place of the projection) with GRPO's
    temperature."""

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        parts, ents = [], []
        for rows, ids in zip(hidden.split(grpo_loss.LOGITS_CHUNK), chosen.split(grpo_loss.LOGITS_CHUNK)):
            if torch.is_grad_enabled():
                lp, ent = torch.utils.checkpoint.checkpoint(
                    _chunk, rows, ids, head.weight, temperature, use_reentrant=False
                )
            else:
                lp, ent = _chunk(rows, ids, head.weight, temperature)
            parts.append(lp)
            ents.append(ent.detach())
        entropy.append(torch.cat(ents) if ents else hidden.new_zeros(0, dtype=torch.float32))
        return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)

    with head_forward(head, forward):
        yield


def completion_logps(model, batch: Batch, temperature: float, autocast) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probability (fp32) and the entropy (no gradient) of every label token of ``batch``, in
    row-major order, under softmax(logits / temperature); the full logits of the batch never exist
    for a model whose output projection is a plain linear layer."""
    mask, chosen, keep = next_token_targets(batch.labels)
    head = replaceable_head(model)
    with autocast:
        if head is not None:
            entropy: list = []
            with _head_as_logps(head, chosen, temperature, entropy):
                logps = model(**batch.inputs, logits_to_keep=keep).logits
            return logps, entropy[0]
        logits = model(**batch.inputs).logits[:, :-1][mask]
        return grpo_loss.token_logps(logits, chosen, temperature), grpo_loss.token_entropy(logits, temperature)


def dense(flat: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Flat per-label-token values laid out as (rows, positions − 1), 0 elsewhere."""
    mask = target_mask(labels)
    return torch.zeros(mask.shape, dtype=flat.dtype, device=flat.device).masked_scatter(mask, flat)


# ---------------------------------------------------------------- the rollouts


@dataclass
class Sampled:
    """One rank's completions of a step (or an evaluation), on the CPU."""

    prompt_ids: list[list[int]]  # per completion
    completion_ids: list[list[int]]  # up to and including the first end token
    truncated: np.ndarray  # (N,) bool: no end token within max_completion_length
    texts: list[str]
    prompts: list  # per completion: the prompt as the reward functions see it
    columns: dict[str, list]  # per completion: the data's other columns
    given_up: bool = False  # a stop signal came during the generation: the completions are unfinished


@dataclass
class Rollouts:
    """The run's rollout machinery, made by ``task.prepare`` and bound to a device by ``task.setup``."""

    grpo: GRPOSpec
    tokenizer: Any
    scorers: list[reward_fns.Scorer]
    seed: int
    rank: int
    chat: bool
    eos_ids: list[int]
    device: torch.device = torch.device("cpu")
    lockstep: bool = False  # a sharded model: every rank's generation makes as many forwards
    reference: Reference | None = None  # a frozen copy (grpo.reference_copy); None: the adapter disabled
    cache: list[RolloutBatch] = field(default_factory=list)  # the generation num_iterations reuses
    cache_units: float = 0.0
    samples: collections.deque = field(default_factory=lambda: collections.deque(maxlen=MAX_SAMPLES))
    said_no_reward: bool = False  # a step without any reward was reported (once a run)
    # the run's stop signal, as the trainer hands it to each ``step``: a step's generation gives up at it
    stop: threading.Event | None = None

    @property
    def repeat(self) -> int:
        return self.grpo.num_iterations

    def metric_names(self) -> tuple[str, ...]:
        """The training metrics: the policy's (``policy_metrics``), then the rollouts'."""
        return (*self.policy_metrics(), *self.rollout_metrics())

    def policy_metrics(self) -> tuple[str, ...]:
        kl = ("kl",) if self.grpo.beta else ()
        return (*kl, "entropy", "clip_ratio_low", "clip_ratio_high", "clip_ratio_region")

    def rollout_metrics(self) -> tuple[str, ...]:
        per_fn = [f"reward_{s.label}" for s in self.scorers] if len(self.scorers) > 1 else []
        return (
            "reward",
            "reward_std",
            *per_fn,
            "frac_reward_zero_std",
            "completion_length",
            "completion_length_min",
            "completion_length_max",
            "completion_truncated",
        )

    # ---- one training step ----
    def step(
        self, model, step: StepBatch, global_step: int, autocast, stop: threading.Event | None = None
    ) -> StepBatch:
        """The step trained on at ``global_step`` (every rank): new rollouts at the first of every
        ``num_iterations`` steps, else the kept ones.

        Raises:
            StepAbandoned: ``stop`` (a stop signal) was set on some rank while its generation or its reward call
                ran: every rank gives the step up together, before it changed anything.
        """
        if global_step % self.repeat and self.cache:
            return StepBatch(cast("list[Batch]", self.cache), step.global_count, step.indices, self.cache_units)
        g = self.grpo
        self.stop = stop
        sampled = self._sample(model, step.micro, global_step)
        prompts = cast("list[PromptBatch]", step.micro)  # the plan's steps of this task's prompts
        real = np.concatenate([np.full(len(m.records or ()) * g.num_generations, m.weight > 0) for m in prompts])
        rng = checkpoint.rng_state()
        try:
            per_fn, total = self._score(sampled, global_step, stop)
        except distributed.StepAbandoned:
            # a given-up step changes nothing: what a reward function drew (its random numbers) is the
            # resumed step's to draw again
            checkpoint.set_rng_state(rng)
            raise
        advantages, stats = self._statistics(total, per_fn, sampled, real, global_step)
        micro = self._micro_batches(step.micro, sampled, advantages, stats)
        self._log_probabilities(model, micro, autocast)
        units = float(distributed.all_reduce_sum(torch.tensor([sum(m.units * m.weight for m in micro)])).item())
        self._keep_samples(sampled, per_fn, total, advantages, real, global_step)
        self.cache, self.cache_units = (micro, units) if self.repeat > 1 else ([], 0.0)
        return StepBatch(micro, step.global_count, step.indices, units)

    def _sample(self, model, prompts: list, global_step: int | None) -> Sampled:
        """Every prompt of ``prompts`` (PromptBatches) ``num_generations`` times (``global_step`` None:
        evaluation, one greedy completion each), on the generation engine: every completion of the step in
        flight at once, a group's prompt prefilled once."""
        g = self.grpo
        n = 1 if global_step is None else g.num_generations
        prompt_ids, records = [], []
        for m in prompts:
            for ids, mask, rec in zip(m.inputs["input_ids"], m.inputs["attention_mask"], m.records):
                prompt_ids += [ids[mask.bool()].tolist()] * n
                records += [rec] * n
        gens = self._generate(model, prompt_ids, global_step)
        given_up = any(x.cancelled.is_set() for x in gens)
        # a completion keeps its end token (the policy learns to end)
        completion_ids = [x.tokens + ([x.end_token] if x.end_token is not None else []) for x in gens]
        names = list(dict.fromkeys(k for r in records for k in r["columns"]))
        return Sampled(
            prompt_ids=prompt_ids,
            completion_ids=completion_ids,
            truncated=np.array([x.end_token is None for x in gens]),
            texts=self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True),
            prompts=[r["prompt"] for r in records],
            columns={k: [r["columns"].get(k) for r in records] for k in names},
            given_up=given_up,
        )

    @torch.no_grad()
    def _generate(self, model, prompt_ids: list[list[int]], global_step: int | None) -> list[Generation]:
        g = self.grpo
        sample = global_step is not None
        generator = None
        if global_step is not None:  # a pure function of (seed, step, rank): a resumed run samples what this one did
            generator = torch.Generator(device=self.device)
            generator.manual_seed(int(np.random.SeedSequence([self.seed, global_step, self.rank]).generate_state(1)[0]))
        gens = [
            Generation(
                ids,
                g.max_completion_length,
                temperature=g.temperature if sample else 0.0,
                top_p=g.top_p if sample else 1.0,
                top_k=(g.top_k or 0) if sample else 0,
                generator=generator,
            )
            for ids in prompt_ids
        ]
        # a step's generation is given up at a stop signal (evaluation's is not: it is short, and its record is kept)
        signal = self.stop if sample else None
        lockstep, stop = None, (signal.is_set if signal is not None else None)
        if self.lockstep:  # every rank's forwards are collective: they agree on a stop in the same all-reduce
            agreed = threading.Event()
            lockstep, stop = functools.partial(_any_rank_busy, signal, agreed), agreed.is_set
        was_training = model.training
        model.eval()
        try:
            Engine(model, set(self.eos_ids), slots=len(gens)).generate(gens, lockstep=lockstep, stop=stop)
        finally:
            model.train(was_training)
        return gens

    def _score(self, s: Sampled, global_step: int, stop: threading.Event | None) -> tuple[np.ndarray, np.ndarray]:
        """Every completion's rewards (N, functions) and total; a function's failure on any rank stops
        every rank, with that rank's message, and a stop signal during the generation or a call on any rank
        gives the step up on every rank (``StepAbandoned``)."""
        per_fn, error, stopped = np.zeros((len(s.texts), len(self.scorers))), None, None
        if s.given_up:
            stopped = "the generation"
        else:
            try:
                per_fn = self._rewards(s, global_step + 1, stop)
            except KubetuneError as e:
                error = str(e)
            except reward_fns.Abandoned as e:
                stopped = f"a call of reward function {e}"  # the function's label
        outcomes = distributed.all_gather_object((error, stopped))
        errors = [e for e, _ in outcomes if e]
        if errors:  # a function's own failure would come back after a resume: said rather than stopped on
            raise AgreedError(errors[0])
        stopped = next((st for _, st in outcomes if st), None)
        if stopped is not None:
            if self.rank == 0:
                log.warning(
                    "stop signal during %s at step %d: every process gives the step up", stopped, global_step + 1
                )
            raise distributed.StepAbandoned(global_step + 1)
        return per_fn, reward_fns.total(per_fn, self.scorers)

    def _rewards(self, s: Sampled, step: int, stop: threading.Event | None) -> np.ndarray:
        """``rewards.score`` of ``s``, each call bounded by grpo.reward_timeout_s (``step`` -1: evaluation)."""
        completions = [[{"role": "assistant", "content": t}] for t in s.texts] if self.chat else s.texts
        device = self.device
        return reward_fns.score(
            self.scorers,
            s.prompts,
            completions,
            s.completion_ids,
            s.columns,
            step,
            timeout_s=self.grpo.reward_timeout_s,
            stop=stop,
            # the current CUDA device is per thread: a reward model on "cuda" goes to this rank's device
            thread_setup=(lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None,
        )

    def _statistics(self, total: np.ndarray, per_fn: np.ndarray, s: Sampled, real: np.ndarray, global_step: int):
        """Advantages of this rank's completions, and the step's statistics over every rank's real ones
        (``rollout_metrics``, in order)."""
        g = self.grpo
        lengths = np.asarray([len(c) for c in s.completion_ids], dtype=np.float64)
        mine = (total[real], per_fn[real], lengths[real], s.truncated[real])
        parts = distributed.all_gather_object(mine)
        every, every_fn, every_len, every_trunc = (np.concatenate([p[i] for p in parts]) for i in range(4))
        if not np.isfinite(every_fn).any():
            self._no_reward(global_step)
        rewards = torch.as_tensor(total, dtype=torch.float32)
        if g.scale_rewards == "batch":  # the whole batch's std: every rank's real completions
            groups = rewards.view(-1, g.num_generations)
            centered = (groups - groups.mean(dim=1, keepdim=True)).view(-1)
            std = float(np.std(every, ddof=1)) if len(every) > 1 else 0.0
            advantages = centered / (std + grpo_loss.STD_EPSILON)
            zero = float(std <= grpo_loss.ZERO_STD)
        else:
            advantages, _ = grpo_loss.group_advantages(rewards, g.num_generations, g.scale_rewards)
            group_std = every.reshape(-1, g.num_generations).std(axis=1, ddof=1)
            zero = float(np.mean(group_std <= grpo_loss.ZERO_STD))
        fn_means = [float(np.nanmean(c)) if np.isfinite(c).any() else 0.0 for c in every_fn.T]
        stats = [
            float(every.mean()),
            float(np.std(every, ddof=1)) if len(every) > 1 else 0.0,
            *(fn_means if len(self.scorers) > 1 else []),
            zero,
            float(every_len.mean()),
            float(every_len.min()),
            float(every_len.max()),
            float(every_trunc.mean()),
        ]
        return advantages, torch.tensor(stats, dtype=torch.float64)

    def _no_reward(self, global_step: int) -> None:
        """Said once a run (rank 0): a step whose every completion, on every rank, got None from every
        function. It is not an error (TRL trains on it, and a function may rightly not apply to a whole
        step), but every step like it teaches nothing, which a run of them makes easy to miss."""
        if self.said_no_reward:
            return
        self.said_no_reward = True
        if self.rank == 0:
            log.warning(
                "grpo.rewards: no reward function returned a number for any completion of step %d (every value was "
                "None): the step's advantages are all 0 and it trains on nothing — return a number for the "
                "completions a function applies to (said once; later steps like it are not reported)",
                global_step + 1,
            )

    def _micro_batches(self, prompts: list, s: Sampled, advantages: torch.Tensor, stats: torch.Tensor):
        """The step's micro-batches of completions, as its prompt micro-batches were."""
        g, pad = self.grpo, self.tokenizer.pad_token_id
        out, start = [], 0
        for m in prompts:
            rows = range(start, start + len(m.records) * g.num_generations)
            start = rows.stop
            seqs = [s.prompt_ids[k] + s.completion_ids[k] for k in rows]
            width = max(len(q) for q in seqs)
            ids = torch.full((len(seqs), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            labels = torch.full_like(ids, IGNORE)
            for j, (k, q) in enumerate(zip(rows, seqs)):
                ids[j, : len(q)], mask[j, : len(q)] = torch.tensor(q), 1
                if not (g.mask_truncated_completions and s.truncated[k]):
                    n = len(s.completion_ids[k])
                    labels[j, len(q) - n : len(q)] = ids[j, len(q) - n : len(q)]
            tokens = float((labels != IGNORE).sum())
            units = tokens if g.loss_type == "dapo" else float(len(seqs))
            index = m.index.repeat_interleave(g.num_generations)
            adv = advantages[rows.start : rows.stop].float()
            batch = RolloutBatch(
                {"input_ids": ids, "attention_mask": mask}, labels, m.weight, index, adv, stats=stats, grpo=g
            )
            batch.units = units
            out.append(batch)
        return out

    @torch.no_grad()
    def _log_probabilities(self, model, micro: list[RolloutBatch], autocast) -> None:
        """The sampling policy's log-probabilities (kept for num_iterations > 1) and the reference's
        (beta > 0), each micro-batch on every rank (a sharded model's forwards are collective)."""
        g = self.grpo
        for m in micro:
            b = m.to(self.device)
            if g.num_iterations > 1:
                m.old_logps = completion_logps(model, b, g.temperature, autocast)[0].cpu()
            if g.beta:
                m.ref_logps = self.reference_logps(model, b, autocast).cpu()

    def reference_logps(self, model, batch: Batch, autocast) -> torch.Tensor:
        t = self.grpo.temperature
        reference = self.reference or Reference.adapter()
        return reference.run(model, lambda network: completion_logps(network, batch, t, autocast)[0])

    def _keep_samples(self, s: Sampled, per_fn, total, advantages, real, global_step: int) -> None:
        if self.rank != 0 or not self.grpo.log_completions:
            return
        for k in np.flatnonzero(real)[: self.grpo.log_completions]:
            prompt = s.prompts[k]
            self.samples.append(
                {
                    "step": global_step + 1,
                    "prompt": prompt if isinstance(prompt, str) else prompt[-1]["content"],
                    "completion": s.texts[k],
                    "rewards": {sc.label: _finite(per_fn[k, j]) for j, sc in enumerate(self.scorers)},
                    "reward": float(total[k]),
                    "advantage": float(advantages[k]),
                    "tokens": len(s.completion_ids[k]),
                    "truncated": bool(s.truncated[k]),
                }
            )

    # ---- evaluation ----
    @torch.no_grad()
    def evaluate(self, model, batch, autocast) -> dict:
        """One greedy completion per held-out prompt: reward sums (the total and per function), completion
        tokens and truncated completions, and this rank's reward error if any (``task.eval_totals``
        agrees on it)."""
        s = self._sample(model, [batch], None)
        try:
            per_fn = self._rewards(s, -1, None)
            error = None
        except KubetuneError as e:
            per_fn, error = np.zeros((len(s.texts), len(self.scorers))), str(e)
        total = reward_fns.total(per_fn, self.scorers)
        return {
            "reward": torch.tensor(float(total.sum()), dtype=torch.float64),
            "rewards": torch.tensor(np.nansum(per_fn, axis=0), dtype=torch.float64),
            "prompts": len(total),
            "tokens": float(sum(len(c) for c in s.completion_ids)),
            "truncated": float(s.truncated.sum()),
            "error": error,
        }

    # ---- checkpoints ----
    def state_dict(self) -> dict:
        """This rank's: the kept rollouts (num_iterations > 1), and rank 0's completion samples."""
        return {
            "cache": [m.state() for m in self.cache],
            "cache_units": self.cache_units,
            "samples": [json.dumps(r) for r in self.samples],
        }

    def load_state_dict(self, states: list[dict] | None, world_size: int, global_step: int) -> None:
        """Every rank: its own state from a checkpoint's ``states`` (one per rank). Kept rollouts need the
        same world size (a group never leaves the rank that sampled it).

        Raises:
            KubetuneError: kept rollouts and another world size.
        """
        if not states:
            return
        if len(states) != world_size and any(st["cache"] for st in states) and global_step % self.repeat:
            raise KubetuneError(
                f"the checkpoint of step {global_step} is inside a generation of grpo.num_iterations "
                f"{self.repeat}, sampled by {len(states)} processes, and this run has {world_size}",
                field="distributed",
                fix=f"resume on {len(states)} processes, or from a checkpoint at a step that is a multiple of "
                f"{self.repeat}",
            )
        mine: dict[str, Any] = (
            states[self.rank] if self.rank < len(states) else {"cache": [], "cache_units": 0.0, "samples": []}
        )
        if len(states) == world_size:
            self.cache = [RolloutBatch.from_state(s, self.grpo) for s in mine["cache"]]
            self.cache_units = mine["cache_units"]
        self.samples.extend(json.loads(r) for r in states[0]["samples"] if self.rank == 0)


def _any_rank_busy(signal: threading.Event | None, agreed: threading.Event, busy: bool) -> bool:
    """Whether any rank's generation is still going (a sharded model's forwards are collective); in the same
    all-reduce, whether any rank has a stop ``signal``, which sets ``agreed`` on every rank at once."""
    stopping = signal is not None and signal.is_set()
    busy_ranks, stopping_ranks = distributed.all_reduce_sum(torch.tensor([float(busy), float(stopping)])).tolist()
    if stopping_ranks > 0:
        agreed.set()
    return busy_ranks > 0


def _finite(x: float) -> float | None:
    return float(x) if np.isfinite(x) else None
