"""Checkpoints: everything needed to continue a run exactly, written atomically.

A checkpoint is ``<output>/checkpoints/step-NNNNNNNN/`` holding ``state.pt`` (trainable weights,
optimizer, scheduler, grad scaler, progress, the RNG states of every rank) and ``job.yaml``; under
a sharded strategy the weights and optimizer are every rank's DCP shards in ``shards/`` instead. It is
built under a temporary name and renamed into place after its ``COMPLETE`` marker is written, so a
crash mid-save leaves nothing that looks like a checkpoint. For an s3:// output the same directory
is uploaded with the storage layer's manifest, which is written last and plays the same role.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kubetune.config import JobSpec, dump_spec
from kubetune.errors import AgreedError, KubetuneError
from kubetune.paths import replace_dir
from kubetune.providers import S3Settings
from kubetune.providers.destination import Output

log = logging.getLogger(__name__)
MARKER = "COMPLETE"
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
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
        "python": [version, list(py_state), py_gauss],
    }


def set_rng_state(state: dict) -> None:
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
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if k in trainable}


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
) -> dict:
    """What must match for a checkpoint to continue *this* run: anything that changes the
    data order, the schedule or the model would make the result a different run. ``grad_accum``
    and ``group_unit`` are the run's layout (``layout``), by default the spec's."""
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
        "training": {k: getattr(spec.training, k) for k in _TRAJECTORY},
        "data": {
            **{k: v for k, v in spec.data.model_dump(mode="json").items() if k not in _DATA_LIMITS},
            "train_rows": train_rows,
        },
    }


def _own_section(spec: JobSpec) -> dict:
    """The task's own spec section (e.g. its loss's settings), keyed by the task's name; {} for a
    task without one. None when the spec leaves it out (its defaults)."""
    from kubetune.config.schema import TASK_SECTIONS

    if spec.task not in TASK_SECTIONS:
        return {}
    section = getattr(spec, spec.task)
    return {spec.task: section.model_dump() if section is not None else None}


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
        **({current["task"]: current["task"]} if current.get("task") in current else {}),  # _own_section
        "batch_size": "training.batch_size",
    }
    for section in ("training", "data"):
        for key, value in (current.get(section) or {}).items():
            # A key the checkpoint lacks was not fingerprinted by the kubetune that wrote it: not checked.
            if key in (saved.get(section) or {}) and saved[section][key] != value:
                raise KubetuneError(
                    f"the checkpoint in {where} was written with "
                    f"{section}.{key} {(saved.get(section) or {}).get(key)!r}, this run has {value!r}",
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


def staging(dest: Output, step: int) -> Path:
    """A new temporary directory for checkpoint ``step`` (the writer rank), which a sharded strategy's
    ranks write their shards into before ``save`` completes it. An older checkpoint of the same
    step in an s3:// output stops looking complete first (its manifest goes), because the ranks
    upload their shards there before ``save`` writes the new manifest."""
    import tempfile

    dest.checkpoints.mkdir(parents=True, exist_ok=True)
    if dest.remote_checkpoints:
        from kubetune.providers import s3

        loc = s3.Location.parse(f"{dest.remote_checkpoints}/step-{step:08d}", "output.uri")
        try:
            s3.client(dest.s3).delete_object(Bucket=loc.bucket, Key=loc.join(s3.MANIFEST))
        except Exception as e:
            raise s3.translate(e, loc, "output.uri", "write a checkpoint to", dest.s3) from None
    return Path(tempfile.mkdtemp(prefix=f".step-{step:08d}-", dir=dest.checkpoints))


def upload_shards(dest: Output, staged: Path, step: int, files: list[Path]) -> dict:
    """Every rank: upload the shard ``files`` it wrote under ``staged`` to checkpoint ``step`` of an
    s3:// output (nodes need not share a filesystem). Returns their manifest entries ({} when the
    output is not s3://), which the writer's ``save`` lists in the checkpoint's manifest."""
    if not dest.remote_checkpoints or not files:
        return {}
    from kubetune.providers import s3

    return s3.put_files(
        staged, files, f"{dest.remote_checkpoints}/step-{step:08d}", field="output.uri", settings=dest.s3
    )


def save(
    state: dict,
    spec: JobSpec,
    dest: Output,
    step: int,
    keep: int,
    staged: Path | None = None,
    uploaded: dict | None = None,
) -> Path:
    """Write checkpoint ``step`` (rank 0 only) under ``dest`` and prune to the newest ``keep``. A
    copy of ``history.jsonl`` goes along, so a resumed run on a new machine keeps its curves.
    ``staged``: the ``staging`` directory already holding the ranks' shards, completed in place;
    ``uploaded``: the manifest entries of the shards the ranks put into an s3:// output."""
    root, remote, local_out = dest.checkpoints, dest.remote_checkpoints, dest.local
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"

    def build(tmp: Path) -> None:
        torch.save(state, tmp / "state.pt")
        if (local_out / "history.jsonl").exists():
            shutil.copyfile(local_out / "history.jsonl", tmp / "history.jsonl")
        (tmp / "job.yaml").write_text(dump_spec(spec))
        (tmp / MARKER).write_text(json.dumps({"step": step, "fingerprint": state["fingerprint"]}) + "\n")

    # Steps above this one belong to an older run at the same output (e.g. after --no-resume);
    # they must not outrank, or prune away, the checkpoints of this run.
    for newer in [st for st in complete_steps(root) if st > step]:
        shutil.rmtree(root / f"step-{newer:08d}", ignore_errors=True)
    replace_dir(build, final, tmp=staged)
    if remote:
        from kubetune.providers import s3

        s3.upload_dir(final, f"{remote}/{final.name}", field="output.uri", settings=dest.s3, uploaded=uploaded)
    for old in complete_steps(root)[:-keep]:
        shutil.rmtree(root / f"step-{old:08d}", ignore_errors=True)
    if remote:  # prune by the remote listing: a re-created pod's local copy holds only what it downloaded
        steps = remote_steps(remote, dest.s3)
        for old in [st for st in steps if st > step] + [st for st in steps if st <= step][:-keep]:
            _delete_remote(f"{remote}/step-{old:08d}", dest.s3)
    return final


def clear(dest: Output) -> None:
    """Remove every checkpoint of this output (local and remote): a finished run, or --no-resume.
    Only what kubetune wrote goes: ``step-NNNNNNNN`` directories and its own temporary ones
    locally, and remotely exactly the objects each checkpoint's manifest lists."""
    root, remote = dest.checkpoints, dest.remote_checkpoints
    if root.is_dir():
        for entry in root.iterdir():
            if _NAME.match(entry.name) or (_TMP.match(entry.name) and entry.is_dir()):
                shutil.rmtree(entry, ignore_errors=True)
        with contextlib.suppress(OSError):
            root.rmdir()  # only when nothing else is left in it
    if remote:
        for step in remote_steps(remote, dest.s3):
            _delete_remote(f"{remote}/step-{step:08d}", dest.s3)


def complete_steps(root: Path) -> list[int]:
    if not root.exists():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _NAME.match(p.name)) and (p / MARKER).exists())


def latest(dest: Output) -> Found | None:
    """The newest complete checkpoint (downloaded first when output.uri is s3://)."""
    root, remote = dest.checkpoints, dest.remote_checkpoints
    if remote:
        step = _latest_remote(remote, dest.s3)
        if step is None:
            return None
        from kubetune.providers import s3

        path = root / f"step-{step:08d}"
        s3.download(f"{remote}/step-{step:08d}/", path, field="output.uri", settings=dest.s3, require_manifest=True)
        return Found(step, path)
    steps = complete_steps(root)
    return Found(steps[-1], root / f"step-{steps[-1]:08d}") if steps else None


def load(found: Found) -> dict:
    # weights_only: a checkpoint may come from a bucket others can write to; never unpickle code.
    return torch.load(found.path / "state.pt", map_location="cpu", weights_only=True)


def _latest_remote(prefix: str, settings: S3Settings) -> int | None:
    steps = remote_steps(prefix, settings)
    return max(steps) if steps else None


def remote_steps(prefix: str, settings: S3Settings) -> list[int]:
    """Steps of the complete checkpoints under an s3:// prefix (those with a manifest)."""
    from kubetune.providers import s3

    loc = s3.Location.parse(prefix, "output.uri")
    client = s3.client(settings)
    steps = []
    try:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=loc.bucket, Prefix=loc.key.rstrip("/") + "/")
        for page in pages:
            for obj in page.get("Contents", []):
                parts = obj["Key"][len(loc.key.rstrip("/")) + 1 :].split("/")
                if len(parts) == 2 and parts[1] == s3.MANIFEST and (m := _NAME.match(parts[0])):
                    steps.append(int(m.group(1)))
    except Exception as e:
        raise s3.translate(e, loc, "output.uri", "list checkpoints in", settings) from None
    return sorted(steps)


def _delete_remote(prefix: str, settings: S3Settings) -> None:
    from kubetune.providers import s3

    # Manifest first (a half-deleted checkpoint must not look complete), then exactly the keys it
    # lists: never whatever else a listing of the prefix shows.
    s3.delete_artifact(prefix, field="output.uri", settings=settings)
