"""``transformers.TrainingArguments`` translated into the spec's training, output and distributed
sections by the table :data:`RULES` (fields -> the rule that carries or refuses them). A field the
user set that no row handles is refused by name, unless :data:`IGNORED` lists it (display and logging
settings, and fields HF's Trainer itself does not read)."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable
from typing import Any, NamedTuple

from kubetune.compat.kubeflow.errors import HF_TOKEN_FIX, Problems

# TrainingArguments fields that only change what is displayed or logged, or that HF's Trainer itself
# does not read (do_train/do_eval/do_predict are for user scripts; local_rank is set by the launcher).
IGNORED = {
    "disable_tqdm",
    "log_level",
    "log_level_replica",
    "logging_strategy",
    "logging_first_step",
    "logging_nan_inf_filter",
    "log_on_each_node",
    "logging_dir",
    "run_name",
    "project",
    "trackio_space_id",
    "trackio_bucket_id",
    "trackio_static_space_id",
    "skip_memory_metrics",
    "include_num_input_tokens_seen",
    "do_train",
    "do_eval",
    "do_predict",
    "local_rank",
    "output_dir",
}


def plain(value: Any) -> Any:
    """An enum member's value; any other value as it is."""
    return value.value if isinstance(value, enum.Enum) else value


def changed_fields(obj: Any, reference: Any) -> dict[str, Any]:
    """The init fields of a dataclass whose value differs from ``reference`` (what the user set)."""
    out = {}
    for f in dataclasses.fields(obj):
        if f.init and plain(getattr(obj, f.name, None)) != plain(getattr(reference, f.name, None)):
            out[f.name] = plain(getattr(obj, f.name, None))
    return out


@dataclasses.dataclass
class Translation:
    """One TrainingArguments on its way into a spec: what the user changed, the sections being
    filled, and the fields handled so far (the rest are refused)."""

    args: Any
    field: str
    problems: Problems
    changed: dict[str, Any]
    handled: set[str]
    training: dict[str, Any] = dataclasses.field(default_factory=dict)
    output: dict[str, Any] = dataclasses.field(default_factory=dict)
    distributed: dict[str, Any] = dataclasses.field(default_factory=dict)

    def refuse(self, name: str, fix: str, show: bool = True) -> None:
        """Refuse the field ``name``, showing its value unless ``show`` is False (a secret)."""
        value = self.changed.get(name, plain(getattr(self.args, name, None)))
        self.problems.add(f"{self.field}.{name}", f"{value!r} is not supported" if show else "is not supported", fix)


class Copy(NamedTuple):
    """A row's one field copied as it is to ``training[key]``; with ``changed_only``, only when the
    user set it (else kubetune's default holds)."""

    key: str
    changed_only: bool = False


# ---- the rules of the rows that are more than a copy


def _epochs(t: Translation) -> None:
    args = t.args
    if args.max_steps and args.max_steps > 0:
        # HF: max_steps overrides num_train_epochs. kubetune stops at whichever comes first, and an
        # epoch is at least one optimizer step, so epochs = max_steps always reaches max_steps.
        t.training["epochs"] = int(args.max_steps)
        t.training["max_steps"] = int(args.max_steps)
    elif float(args.num_train_epochs) != int(args.num_train_epochs) or args.num_train_epochs < 1:
        t.refuse("num_train_epochs", "use a whole number of epochs, or max_steps")
    else:
        t.training["epochs"] = int(args.num_train_epochs)


def _max_grad_norm(t: Translation) -> None:
    norm = t.args.max_grad_norm
    t.training["max_grad_norm"] = norm if norm and norm > 0 else None


def _warmup(t: Translation) -> None:
    ratio = float(getattr(t.args, "warmup_ratio", 0) or 0)
    steps = t.args.warmup_steps or 0
    if 0 < steps < 1:  # transformers 5 takes a ratio in warmup_steps
        ratio = float(steps)
    elif steps >= 1:
        if t.args.max_steps and t.args.max_steps > 0:
            ratio = steps / t.args.max_steps  # kubetune warms up round(ratio × total steps) = steps
        else:
            t.refuse(
                "warmup_steps",
                "kubetune warms up a fraction of the steps: pass warmup_steps=0.06 (a ratio), or set max_steps",
            )
    t.training["warmup_ratio"] = ratio


def _logging_steps(t: Translation) -> None:
    if "logging_steps" in t.changed:
        if t.args.logging_steps >= 1:
            t.training["log_every"] = int(t.args.logging_steps)
        else:
            t.refuse("logging_steps", "give a number of steps (kubetune has no fractional logging interval)")


def _evaluation(t: Translation) -> None:
    args = t.args
    strategy = plain(getattr(args, "eval_strategy", None) or getattr(args, "evaluation_strategy", None) or "no")
    if strategy == "steps":
        every = args.eval_steps or args.logging_steps
        if every >= 1:
            t.training["eval_every"] = int(every)
        else:
            t.refuse("eval_steps", "give a number of steps")
    # "no" and "epoch" need nothing: kubetune evaluates the held-out data at the end of every epoch.


def _saving(t: Translation) -> None:
    save = plain(t.args.save_strategy)
    if save == "steps" and "save_steps" in t.changed:
        if t.args.save_steps >= 1:
            t.training["checkpoint_every"] = int(t.args.save_steps)
        else:
            t.refuse("save_steps", "give a number of steps")
    elif save not in ("steps", "no"):
        t.refuse(
            "save_strategy",
            "use 'steps' with save_steps (kubetune checkpoints every N steps, and always on SIGTERM), or 'no'",
        )


def _keep_checkpoints(t: Translation) -> None:
    if t.args.save_total_limit is not None:
        t.training["keep_checkpoints"] = t.args.save_total_limit


def _precision(t: Translation) -> None:
    if t.args.bf16 or t.args.fp16:
        t.training["precision"] = "bf16" if t.args.bf16 else "fp16"


def _checkpointing(t: Translation) -> None:
    # transformers 5 renamed gradient_checkpointing to activation_checkpointing; the old name mirrors it.
    if getattr(t.args, "activation_checkpointing", False) or getattr(t.args, "gradient_checkpointing", False):
        t.training["gradient_checkpointing"] = True
    if "activation_checkpointing_kwargs" in t.changed:
        t.handled.add("gradient_checkpointing_kwargs")  # the same setting under its old name: refuse it once


def _compile(t: Translation) -> None:
    if t.args.torch_compile:
        t.training["compile"] = True
        if plain(getattr(t.args, "torch_compile_backend", None)) == "inductor":
            # what torch_compile=True fills in: torch.compile's default, as kubetune's
            t.handled.add("torch_compile_backend")


# HF's optim names -> training.optimizer (and its momentum: HF's sgd is torch's SGD at its defaults, no momentum)
OPTIMIZERS: dict[str, dict[str, str | float]] = {
    "adamw_torch": {},
    "adamw_torch_fused": {},
    "sgd": {"optimizer": "sgd", "momentum": 0.0},
    "adamw_bnb_8bit": {"optimizer": "adamw_8bit"},
    "adamw_8bit": {"optimizer": "adamw_8bit"},
}
# HF's lr_scheduler_type -> training.lr_scheduler (each after the warmup the arguments give)
SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant_with_warmup": "constant"}


def _optim(t: Translation) -> None:
    if "optim" not in t.changed:
        return
    chosen = OPTIMIZERS.get(plain(t.changed["optim"]))
    if chosen is None:
        t.refuse("optim", f"kubetune trains with {', '.join(OPTIMIZERS)}: use one of them")
    else:
        t.training.update(chosen)


def _scheduler(t: Translation) -> None:
    chosen = SCHEDULES.get(plain(t.args.lr_scheduler_type))
    if chosen is None:
        t.refuse("lr_scheduler_type", f"kubetune schedules with {', '.join(map(repr, SCHEDULES))}: use one of them")
    elif chosen != "linear":
        t.training["lr_scheduler"] = chosen


def _report_to(t: Translation) -> None:
    report_to = t.args.report_to if isinstance(t.args.report_to, list) else [t.args.report_to]
    if any(r != "tensorboard" for r in report_to if r not in (None, "none")):
        t.refuse(
            "report_to", "kubetune writes TensorBoard events and history.jsonl: use report_to='tensorboard' or 'none'"
        )


def _sampling(t: Translation) -> None:
    sampling = plain(getattr(t.args, "train_sampling_strategy", "random"))
    if sampling == "group_by_length" or getattr(t.args, "group_by_length", False):
        t.training["group_by_length"] = True
    elif sampling != "random":
        t.refuse("train_sampling_strategy", "use 'random' or 'group_by_length'")


def _ddp_backend(t: Translation) -> None:
    if "ddp_backend" in t.changed:
        if t.changed["ddp_backend"] in ("gloo", "nccl"):
            t.distributed["backend"] = t.changed["ddp_backend"]
        else:
            t.refuse("ddp_backend", "use gloo or nccl")


def _ddp_timeout(t: Translation) -> None:
    if "ddp_timeout" in t.changed:
        t.distributed["timeout_minutes"] = max(1, math.ceil(t.args.ddp_timeout / 60))


def _hub_token(t: Translation) -> None:
    if getattr(t.args, "hub_token", None):
        t.refuse("hub_token", HF_TOKEN_FIX, show=False)


def _hub(t: Translation) -> None:
    args = t.args
    if args.push_to_hub:
        if args.hub_model_id and args.hub_model_id.count("/") == 1:
            t.output["uri"] = f"hf://{args.hub_model_id}"  # kubetune pushes model, tokenizer and card in one commit
            if args.hub_private_repo is not None:
                t.output["hf_private"] = bool(args.hub_private_repo)
        else:
            t.refuse("hub_model_id", "with push_to_hub=True, name the repo as hub_model_id='ORG/NAME'")
    elif "hub_model_id" in t.changed or "hub_private_repo" in t.changed:
        t.refuse(
            "hub_model_id" if "hub_model_id" in t.changed else "hub_private_repo",
            "set push_to_hub=True to push, or remove it",
        )


def _overwrite(t: Translation) -> None:
    if getattr(t.args, "overwrite_output_dir", False):
        t.output["overwrite"] = True


Rule = Callable[[Translation], None]

# TrainingArguments fields -> how they reach the spec, in the order the spec's keys and the refusals
# come out. The recipe (to warmup) is carried whatever its value, HF's defaults included, so the job
# trains what the SDK's trainer would (HF's defaults differ from kubetune's: 3 epochs, batch 8, no
# weight decay); the operational settings after it are carried when the user changed them, else
# kubetune's defaults hold.
RULES: tuple[tuple[tuple[str, ...], Copy | Rule], ...] = (
    (("num_train_epochs", "max_steps"), _epochs),
    (("per_device_train_batch_size",), Copy("batch_size")),
    (("gradient_accumulation_steps",), Copy("grad_accum")),
    (("learning_rate",), Copy("learning_rate")),
    (("weight_decay",), Copy("weight_decay")),
    (("max_grad_norm",), _max_grad_norm),
    (("seed",), Copy("seed")),
    (("warmup_steps", "warmup_ratio"), _warmup),
    (("logging_steps",), _logging_steps),
    (("eval_strategy", "evaluation_strategy", "eval_steps"), _evaluation),
    (("save_strategy", "save_steps"), _saving),
    (("save_total_limit",), _keep_checkpoints),
    (("per_device_eval_batch_size",), Copy("eval_batch_size", changed_only=True)),
    (("bf16", "fp16"), _precision),
    (("gradient_checkpointing", "activation_checkpointing"), _checkpointing),
    (("torch_compile",), _compile),
    (("dataloader_num_workers",), Copy("dataloader_workers", changed_only=True)),
    (("optim",), _optim),
    (("lr_scheduler_type",), _scheduler),
    (("report_to",), _report_to),
    (("train_sampling_strategy", "group_by_length"), _sampling),
    (("ddp_backend",), _ddp_backend),
    (("ddp_timeout",), _ddp_timeout),
    (("hub_token",), _hub_token),
    (("push_to_hub", "hub_model_id", "hub_private_repo"), _hub),
    (("overwrite_output_dir",), _overwrite),
)


def training_arguments(args: Any, field: str, problems: Problems) -> tuple[dict, dict, dict]:
    """The spec's training, output and distributed sections for ``args``; every field the user set
    that no rule carries, and every value a rule cannot carry, is added to ``problems``.

    Returns:
        (training, output, distributed); output's ``uri`` is ``args.output_dir`` unless pushed to the Hub.
    """
    import transformers

    if not isinstance(args, transformers.TrainingArguments):
        problems.wrong_type(field, args, "pass transformers.TrainingArguments")
        return {}, {"uri": ""}, {}
    # What the user set = what differs from the same class built with only the same output_dir
    # (several defaults are derived from output_dir and from each other in __post_init__).
    changed = changed_fields(args, type(args)(output_dir=args.output_dir))
    handled = IGNORED | {name for names, _ in RULES for name in names}
    t = Translation(args, field, problems, changed, handled, output={"uri": str(args.output_dir)})
    for names, rule in RULES:
        if not isinstance(rule, Copy):
            rule(t)
        elif not rule.changed_only or names[0] in changed:
            t.training[rule.key] = getattr(args, names[0])
    for name in sorted(set(changed) - t.handled):
        t.refuse(
            name,
            (
                "remove it (kubetune has no equivalent), or write a kubetune job spec; `kubetune explain` lists "
                "what a spec carries"
            ),
        )
    return t.training, t.output, t.distributed
