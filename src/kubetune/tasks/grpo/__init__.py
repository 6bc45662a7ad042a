"""GRPO: online RL (Group Relative Policy Optimization) of a causal LM: completions sampled per prompt by
the policy, scored by reward functions, and the policy moved toward the completions that beat their
group. This is the task's spec half (its data section, its own ``grpo:`` section and registry entry);
the training half is ``task.py`` (``TASK``), the rollouts ``rollout.py``, the rewards ``rewards.py``, the
loss ``loss.py``; ``starter.yaml`` is the starter spec `kubetune init grpo` writes."""

from __future__ import annotations

import re
from typing import ClassVar, Literal

from pydantic import Field, field_validator

from kubetune.config.base import DataCommon, Section
from kubetune.config.tasks import KServeRuntime, TaskEntry

BUILTIN_REWARDS = ("exact_match", "regex", "length", "model")


class PromptData(DataCommon):
    """``data`` for task: grpo (prompts; every other column reaches the reward functions by name)."""

    task: Literal["grpo"] = Field("grpo", exclude=True, description="(internal) the job's task, set from `task`")
    format: Literal["auto", "text", "chat"] = Field(
        "auto",
        description="grpo prompt layout. text: the prompt column's string is the prompt as it is, and completions "
        "are strings. chat: a {role, content} message list (or a string, which becomes a user turn) rendered with "
        "the chat template and its generation prompt; completions are one assistant message (TRL's conversational "
        "format). auto: chat when the prompt column holds message lists, else text.",
    )
    prompt_column: str = Field("prompt", description="grpo: the prompt column (string or message list).")
    system_prompt: str | None = Field(
        None, description="grpo chat format: a system message put first in every prompt that has none."
    )
    chat_template: str | None = Field(
        None,
        description="grpo chat format: a Jinja chat template used instead of the tokenizer's (saved with the "
        "exported tokenizer). Absent: the tokenizer's, else kubetune's fallback template (as for causal-lm).",
    )
    max_length: int = Field(
        512,
        ge=8,
        le=32768,
        description="Token limit of a prompt (TRL's max_prompt_length); a longer prompt keeps its end.",
    )


class Reward(Section):
    """One reward function of ``grpo.rewards``: a built-in, or your own ``module:function``."""

    function: str = Field(
        description="exact_match (1 when the completion, or the first group of `pattern` in it, equals the "
        "`column` value, else 0), regex (1 when `pattern` matches the completion, else 0), length (DAPO's soft "
        "overlong penalty: 0 up to `max_tokens` − `cache_tokens` completion tokens, then falling linearly to −1 at "
        "`max_tokens`), model (a trained reward model, `model`: its score of prompt + completion, rendered as it was "
        "trained: the chat template for chat data), or 'module:function' with TRL's signature f(prompts, completions, "
        "completion_ids, **columns) -> list[float | None]. A user function is your code: it runs in every training "
        "process with the job's rights (on Kubernetes the module must be importable in the pod: in the image, or a "
        "directory on the workspace claim named in PYTHONPATH).",
    )
    weight: float = Field(1.0, description="Its weight in the total reward (TRL's reward_weights).")
    name: str | None = Field(None, description="Its name in the metrics (reward_<name>). Absent: the function's.")
    column: str | None = Field(None, description="exact_match: the data column holding the right answer.")
    pattern: str | None = Field(
        None,
        description="regex: the pattern a completion must match (re.search, or re.fullmatch with full: true; "
        "DOTALL). exact_match: the answer is its first group in the completion (absent: the whole completion, "
        "stripped).",
    )
    full: bool = Field(False, description="regex: the whole completion must match `pattern` (re.fullmatch).")
    share: bool = Field(
        False,
        description="regex: the reward is the share (0 to 1) of the completion's non-space characters inside "
        "the matches of `pattern`, instead of 1 or 0 (a dense signal for a required form, e.g. \\d: digits only).",
    )
    model: str | None = Field(
        None,
        description="model: a kubetune reward-model export (its run directory or model/, s3:// or hf://), scored in "
        "every training process, in batches, on the process's device.",
    )
    max_tokens: int | None = Field(None, ge=1, description="length: the completion length penalized to −1.")
    cache_tokens: int | None = Field(None, ge=1, description="length: the soft zone before max_tokens.")

    @field_validator("function")
    @classmethod
    def _function(cls, value: str) -> str:
        if value in BUILTIN_REWARDS or re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", value):
            return value
        raise ValueError(f"{value!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) nor 'module:function'")

    @property
    def label(self) -> str:
        """Its name in the metrics."""
        return self.name or self.function.rsplit(":", 1)[-1]


class GRPOSpec(Section):
    """Online RL of task: grpo (the names of TRL's GRPOConfig). training.batch_size counts prompts: each
    micro-batch holds batch_size × num_generations completions (TRL's per_device_train_batch_size counts
    completions)."""

    # Bounds of the run, not of its trajectory: a checkpoint resumes whatever they were (checkpoint._own_section).
    RESUME_FREE: ClassVar[tuple[str, ...]] = ("reward_timeout_s",)

    rewards: list[Reward] = Field(
        min_length=1, description="The reward functions; a completion's reward is their weighted sum."
    )
    reward_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=86400,
        description="How long one call of a reward function may take (a call scores one process's completions "
        "of a step); a longer call stops the run with an error naming the function. It also bounds how long a "
        "stop signal (eviction, preemption) waits: a process that got the signal gives its call up at once, the "
        "others finish theirs within this, then every process writes the checkpoint of the last completed step. "
        "Keep it well below the pods' grace period after SIGTERM (Kubernetes' default 30 s; "
        "kubernetes.termination_grace_period_seconds); raise both for slow rewards (code execution, a judge model).",
    )
    num_generations: int = Field(default=8, ge=2, le=1024, description="Completions sampled per prompt (the group).")
    max_completion_length: int = Field(default=256, ge=1, le=32768, description="Token limit of a completion.")
    temperature: float = Field(
        default=1.0, gt=0, description="Sampling temperature (also used for the log-probabilities)."
    )
    top_p: float = Field(
        default=1.0, gt=0, le=1, description="Nucleus sampling: the smallest token set with this mass."
    )
    top_k: int = Field(default=0, ge=0, description="Sample among the top_k tokens only; 0: all.")
    num_iterations: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Optimizer steps per generation (TRL's μ): each generation is trained on this many times, "
        "with the clipped ratio to the policy that sampled it.",
    )
    epsilon: float = Field(default=0.2, gt=0, lt=1, description="Lower clipping bound of the importance ratio (1 − ε).")
    epsilon_high: float | None = Field(
        default=None, gt=0, description="Upper clipping bound (1 + ε_high); absent: epsilon."
    )
    beta: float = Field(
        default=0.0,
        ge=0,
        description="Weight of the KL penalty to the reference model (k3 estimate); 0: none and no reference.",
    )
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo"] = Field(
        default="dapo",
        description="How the per-token loss is averaged: dapo (TRL's default: over the global step's completion "
        "tokens), grpo (each completion's mean, then over completions), dr_grpo (over completions × "
        "max_completion_length), bnpo (over each micro-batch's tokens).",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Advantages divided by the group's reward std, the whole batch's, or nothing."
    )
    mask_truncated_completions: bool = Field(
        False, description="Completions that hit max_completion_length without an end token carry no loss."
    )
    reference_copy: bool = Field(
        default=False,
        description="Full fine-tune with beta > 0: keep a frozen copy of the base model as the reference (one "
        "more model in memory). With LoRA the reference is the model with its adapter disabled.",
    )
    log_completions: int = Field(
        default=4,
        ge=0,
        le=1024,
        description="Completions per generation written to completions.jsonl (rank 0's first ones, with their "
        "rewards); the file keeps the last 1,000.",
    )


def _checks(data: PromptData, section: GRPOSpec | None) -> list[str]:
    if section is None:
        return ["task grpo needs a grpo section with at least one reward: grpo: {rewards: [{function: ...}]}"]
    out = []
    for i, r in enumerate(section.rewards):
        where = f"grpo.rewards[{i}]"
        if r.function == "exact_match" and not r.column:
            out.append(f"{where}: exact_match needs `column`, the data column holding the right answer")
        if r.function == "regex" and not r.pattern:
            out.append(f"{where}: regex needs `pattern`")
        if r.function == "model" and not r.model:
            out.append(f"{where}: model needs `model`, the reward model (a reward-model run's output, s3:// or hf://)")
        if r.function == "length" and (r.max_tokens is None or r.cache_tokens is None):
            out.append(f"{where}: length needs max_tokens and cache_tokens (the soft zone before max_tokens)")
        elif (
            r.function == "length"
            and r.cache_tokens is not None
            and r.max_tokens is not None
            and (r.cache_tokens >= r.max_tokens)
        ):
            out.append(f"{where}: cache_tokens {r.cache_tokens} must be below max_tokens {r.max_tokens}")
        for key in ("column", "pattern", "max_tokens", "cache_tokens", "model"):
            if getattr(r, key) is not None and key not in _USES.get(r.function, ()):
                out.append(f"{where}.{key} does not apply to function {r.function} — remove it")
        if (r.full or r.share) and r.function != "regex":
            out.append(f"{where}: full and share apply to function regex — remove them")
        if r.full and r.share:
            out.append(f"{where}: full and share exclude each other — keep one")
        if r.pattern is not None:
            try:
                re.compile(r.pattern)
            except re.error as e:
                out.append(f"{where}.pattern {r.pattern!r} is not a regular expression: {e}")
    labels = [r.label for r in section.rewards]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        out.append(f"grpo.rewards: the names {dupes} repeat — give each a distinct `name`")
    return out


def _in_image(module: str) -> bool:
    """Whether ``module`` comes with the trainer image: the standard library, kubetune, or a distribution
    kubetune depends on (directly or not), as installed here."""
    import sys
    from importlib import metadata

    top = module.split(".")[0]
    if top in sys.stdlib_module_names or top == "kubetune":
        return True
    wanted, seen = ["kubetune"], set()
    while wanted:  # kubetune's requirements, closed over theirs (markers and extras aside)
        name = wanted.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen.add(key)
        try:
            reqs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        wanted += [re.split(r"[ ;<>=!~\[(]", r, maxsplit=1)[0] for r in reqs if "extra ==" not in r]
    owners = metadata.packages_distributions().get(top, [])
    return any(re.sub(r"[-_.]+", "-", d).lower() in seen for d in owners)


def _render_warnings(spec) -> list[str]:
    """A user's reward function must be importable in the pods: said for each module the default trainer
    image does not hold; and a reward timeout that leaves a stopped pod too little of its grace period."""
    own = spec.section(GRPOSpec)
    if own is None:
        return []
    out = []
    grace = spec.kubernetes.termination_grace_period_seconds
    if own.reward_timeout_s > grace / 2:  # the other half: the checkpoint after the call
        out.append(
            f"grpo.reward_timeout_s: {own.reward_timeout_s:g} s is over half of "
            f"kubernetes.termination_grace_period_seconds {grace}: after a stop signal a pod waits for its running "
            "reward call, and may be killed before it writes its checkpoint — raise the grace period, or lower the "
            "timeout"
        )
    if spec.kubernetes.image:  # an image of the user's own may hold the reward modules
        return out
    return out + [
        f"grpo.rewards[{i}].function: module {r.function.split(':')[0]!r} must be importable in the pods, and the "
        "trainer image holds kubetune and its dependencies only — build kubernetes.image FROM the trainer image "
        "with your module installed"
        for i, r in enumerate(own.rewards)
        if ":" in r.function and not _in_image(r.function.split(":")[0])
    ]


_USES = {
    "exact_match": ("column", "pattern"),
    "regex": ("pattern",),
    "length": ("max_tokens", "cache_tokens"),
    "model": ("model",),
}


ENTRY = TaskEntry(
    data=PromptData,
    summary="online RL of a causal LM from rewards you can verify: Group Relative Policy Optimization",
    runtime="kubetune.tasks.grpo.task:TASK",
    starter="kubetune.tasks.grpo:starter.yaml",
    section=GRPOSpec,
    checks=_checks,
    order=3,
    kserve=KServeRuntime("text_generation", adapters=True),
    language_model=True,
    render_warnings=_render_warnings,
)
