"""Checkpoints: everything needed to continue a run exactly, written atomically.

A checkpoint is ``<output>/checkpoints/step-NNNNNNNN/`` holding ``state.pt`` (trainable weights,
optimizer, scheduler, grad scaler, progress, the RNG states of every rank) and ``job.yaml``; under
a sharded strategy the weights and optimizer are every rank's DCP shards in ``shards/`` instead. It is
built under a temporary name and renamed into place after its ``COMPLETE`` marker is written, so a
crash mid-save leaves nothing that looks like a checkpoint; with ``training.checkpoint_async`` a background thread
writes it (``writer``) while training goes on, the same way. For an s3:// output the same directory
is uploaded with the storage layer's manifest, which is written last and plays the same role.
"""

from __future__ import annotations

import json
import logging
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kubetune.config import JobSpec
from kubetune.errors import AgreedError, KubetuneError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
MARKER = "COMPLETE"
# A key of the state a strategy's ``save`` returns under ``training.checkpoint_async``: the state is a snapshot that
# ``CheckpointStore.save`` writes in the background, after calling this entry (a callable that returns once what the
# ranks write themselves, a sharded strategy's shards, is written). Never written into ``state.pt``.
PENDING = "pending"
_NAME = re.compile(r"^step-(\d{8})$")
_TMP = re.compile(r"^\.step-\d{8}-")  # replace_dir's temporary name for a checkpoint being written


@dataclass(frozen=True)
class Found:
    """A complete checkpoint: its step and a local directory holding it."""

    step: int
    path: Path


def rng_state() -> dict:
    """This process's random states (torch CPU and CUDA, numpy, python), as tensors and plain
    lists so that checkpoints load with ``weights_only=True`` (no arbitrary unpickling)."""
    import torch  # here: the output's checks (kubetune render, preflight) need no torch

    state = np.random.get_state()
    assert isinstance(state, tuple)  # the legacy form, numpy's default: (name, keys, pos, has_gauss, gauss)
    name, keys, pos, has_gauss, gauss = state
    version, py_state, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
        "python": [version, list(py_state), py_gauss],
    }


def set_rng_state(state: dict) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, py_state, py_gauss = state["python"]
    random.setstate((version, tuple(py_state), py_gauss))


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Only what training changes: all weights for a full fine-tune, adapter + head for LoRA."""
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    # one copy into host memory (a CPU tensor cloned): the checkpoint holds it while training goes on
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items() if k in trainable}


_TRAJECTORY = (
    "seed",
    "learning_rate",
    "warmup_ratio",
    "weight_decay",
    "max_grad_norm",
    "epochs",
    "max_steps",
    "group_by_length",
    "precision",
)
# The recipe's choices, and the value every run trained with before they were choices. A choice at that value
# is not fingerprinted, so a run at the defaults fingerprints as the kubetune before them did; a checkpoint
# without one was trained with that value (``check_compatible``), so it resumes at the defaults only.
_RECIPE_BEFORE = {"optimizer": "adamw", "lr_scheduler": "linear"}
# The fields only one choice reads, fingerprinted with it: decay_ratio under a linear schedule changes nothing.
_CHOICE_FIELDS = {("optimizer", "sgd"): ("momentum",), ("lr_scheduler", "wsd"): ("decay_ratio",)}
# Data settings that only bound what a run accepts (limits): a run that passes them trains on the same
# data. Every other key of the task's data section is in the fingerprint, so a new field is checked.
_DATA_LIMITS = ("max_classes", "max_input_mb")


def fingerprint(
    spec: JobSpec,
    labels: list[str],
    world_size: int,
    train_rows: int = 0,
    grad_accum: int | None = None,
    group_unit: int | None = None,
    strategy: str = "ddp",
    content: str = "",
) -> dict:
    """What must match for a checkpoint to continue *this* run: anything that changes the
    data order, the schedule or the model would make the result a different run. ``grad_accum``
    and ``group_unit`` are the run's layout (``layout``), by default the spec's; ``content`` a key
    of the training rows' content (``Prepared.content``; empty: not checked)."""
    return {
        "model": spec.model.uri,
        "task": spec.task,
        "labels": list(labels),
        "lora": spec.lora.model_dump() if spec.lora else None,
        **_own_section(spec),
        "world_size": world_size,
        "batch_size": spec.training.batch_size,
        "grad_accum": grad_accum or spec.training.grad_accum,
        # the length-grouping unit of the data order (epoch_order): the global micro-batch of the run's start
        "group_unit": group_unit or spec.training.batch_size * world_size,
        # what wrote the model state (``distributed.strategy: auto`` resumes with the same); not compared
        "strategy": strategy,
        "training": {**{k: getattr(spec.training, k) for k in _TRAJECTORY}, **_recipe(spec.training)},
        "data": {
            **{k: v for k, v in spec.data.model_dump(mode="json").items() if k not in _DATA_LIMITS},
            "train_rows": train_rows,
            **({"content": content} if content else {}),
        },
    }


def _recipe(training) -> dict:
    """The recipe's choices that differ from the one before them (``_RECIPE_BEFORE``), with the fields they read."""
    out = {}
    for key, before in _RECIPE_BEFORE.items():
        value = getattr(training, key)
        if value != before:
            out[key] = value
            out.update({f: getattr(training, f) for f in _CHOICE_FIELDS.get((key, value), ())})
    return out


def _own_section(spec: JobSpec) -> dict:
    """The task's own spec section (e.g. its loss's settings), keyed by the task's name; {} for a
    task without one. None when the spec leaves it out (its defaults)."""
    from kubetune.config.schema import TASK_SECTIONS

    if spec.task not in TASK_SECTIONS:
        return {}
    section = getattr(spec, spec.task)
    # A section's RESUME_FREE fields bound the run (a reward's timeout), not its trajectory: not fingerprinted.
    free = set(getattr(type(section), "RESUME_FREE", ()))
    return {spec.task: section.model_dump(exclude=free) if section is not None else None}


def layout(saved: dict | None, world_size: int, batch_size: int, grad_accum: int, where: str) -> tuple[int, int]:
    """This run's (grad_accum, length-grouping unit). A run resumed on another number of processes
    keeps the global batch by adjusting grad_accum, and the grouping of the run's start, so every
    example is trained at the same global step as without the interruption.

    Raises:
        KubetuneError: the global batch cannot be split over this many processes, or the spec's
            grad_accum is neither the checkpoint's nor the adjusted one.
    """
    if saved is None:
        return grad_accum, batch_size * world_size
    saved_ws, saved_ga = saved["world_size"], saved["grad_accum"]
    unit = saved.get("group_unit") or saved["batch_size"] * saved_ws
    if saved_ws == world_size or saved["batch_size"] != batch_size:
        return grad_accum, unit  # check_compatible names what differs
    micro = saved_ws * saved_ga  # micro-batches of batch_size in one global step
    if micro % world_size:
        fits = ", ".join(str(n) for n in range(1, micro + 1) if micro % n == 0)
        raise AgreedError(
            f"the checkpoint in {where} was written by {saved_ws} processes × grad_accum {saved_ga}; its "
            f"{micro} micro-batches per step cannot be split evenly over {world_size} processes, so the global "
            "batch would change",
            field="distributed",
            fix=f"resume on {fits} processes, use another output.uri, or pass --no-resume (training.resume: never)",
        )
    adjusted = micro // world_size
    if grad_accum not in (saved_ga, adjusted):
        raise AgreedError(
            f"the checkpoint in {where} was written with grad_accum {saved_ga} on {saved_ws} processes; on "
            f"{world_size} processes the same global batch needs grad_accum {adjusted}, and this run has {grad_accum}",
            field="training.grad_accum",
            fix=f"set training.grad_accum to {saved_ga} or {adjusted}, or pass --no-resume (training.resume: never)",
        )
    if adjusted != grad_accum:
        log.info(
            "resuming a %d-process checkpoint on %d processes: grad_accum %d keeps the global batch "
            "(%d micro-batches per step)",
            saved_ws,
            world_size,
            adjusted,
            micro,
        )
    return adjusted, unit


def saved_fingerprint(found: Found) -> dict:
    """A checkpoint's fingerprint, from its marker (without loading the state)."""
    return json.loads((found.path / MARKER).read_text())["fingerprint"]


def check_compatible(saved: dict, current: dict, where: str) -> None:
    """Raise a one-line error when the checkpoint came from an incompatible job."""
    fields = {
        "model": "model.uri",
        "task": "task",
        "labels": "data.label_column",
        "lora": "lora",
        "batch_size": "training.batch_size",
    }
    own = current.get("task") if current.get("task") in current else None  # _own_section
    if own and not (isinstance(saved.get(own), dict) and isinstance(current[own], dict)):
        fields[own] = own  # present in one and absent in the other: compared whole
    for section in ("training", "data", *([own] if own and own not in fields else [])):
        written, now = saved.get(section) or {}, current.get(section) or {}
        if section == "training":  # a recipe choice left out is the one before the choice (either side)
            written, now = {**_RECIPE_BEFORE, **written}, {**_RECIPE_BEFORE, **now}
        for key, value in now.items():
            # A key the checkpoint lacks was not fingerprinted by the kubetune that wrote it: not checked.
            if key in written and written[key] != value:
                if key == "content":
                    raise KubetuneError(
                        f"data.train changed since the checkpoint in {where} was written: its rows (or their "
                        "tokens) differ, so resuming would not continue the same run",
                        field="data.train",
                        fix="restore the data the run started with, use another output.uri, "
                        "or pass --no-resume (training.resume: never)",
                    )
                raise KubetuneError(
                    f"the checkpoint in {where} was written with "
                    f"{section}.{key} {written[key]!r}, this run has {value!r}",
                    field=f"{section}.{key}" if key != "train_rows" else "data.train",
                    fix="restore the original setting, use another output.uri, "
                    "or pass --no-resume (training.resume: never)",
                )
    for key, field in fields.items():
        if saved.get(key) != current.get(key):
            raise KubetuneError(
                f"the checkpoint in {where} was written with {key} {saved.get(key)!r}, "
                f"this run has {current.get(key)!r}",
                field=field,
                fix="restore the original setting, use another output.uri, "
                "or pass --no-resume (training.resume: never)",
            )
    # The data order and the schedule depend on the global batch and the grouping unit, not on the
    # number of processes itself (``layout`` adjusts grad_accum to keep them).
    saved_micro, micro = saved["world_size"] * saved["grad_accum"], current["world_size"] * current["grad_accum"]
    if saved_micro != micro or saved.get("group_unit", current["group_unit"]) != current["group_unit"]:
        same = saved["world_size"] == current["world_size"]
        raise KubetuneError(
            f"the checkpoint in {where} was written by {saved['world_size']} processes × grad_accum "
            f"{saved['grad_accum']}, this run has {current['world_size']} × {current['grad_accum']}; the data order "
            "and global batch depend on them, so resuming would not continue the same run",
            field="training.grad_accum" if same else "distributed",
            fix="restore the original setting, use another output.uri, or pass --no-resume (training.resume: never)",
        )


def complete_steps(root: Path) -> list[int]:
    if not root.exists():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _NAME.match(p.name)) and (p / MARKER).exists())


def load(found: Found) -> dict:
    # weights_only: a checkpoint may come from a bucket others can write to; never unpickle code.
    import torch

    return torch.load(found.path / "state.pt", map_location="cpu", weights_only=True)
