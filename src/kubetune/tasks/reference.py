"""The reference model of the tasks that compare a policy with it (DPO, KTO, GRPO), in one of three modes, chosen
by the task:

- **adapter**: with LoRA, the model itself with its adapter disabled, on the fly (no memory beyond the model);
- **copy**: a frozen copy of the base model, made once before the first step (before a checkpoint's weights
  replace the base's), for what cannot be precomputed (KTO's KL sequences change with each batch; GRPO's
  completions are sampled at each step);
- **precomputed**: the reference log-probabilities of every training and evaluation row, computed once by the
  model before its first step and cached on disk keyed by the model, the data and the precision (DPO's full
  fine-tune: a resumed run reads them).

A ``Reference`` (adapter or copy) is a plain object, not a ``torch.nn.Module``: attached to the model
(``attach``) it is an ordinary attribute, which the optimizer (``parameters()``), ``state_dict()`` and so the
checkpoints and the export, DDP's broadcast and FSDP's sharding never see. A copy is refused with a sharded model
(each process would hold a whole one); the tasks say so at validation."""

from __future__ import annotations

import copy
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal, TypeVar

import numpy as np
import torch

from kubetune import distributed
from kubetune.config import JobSpec
from kubetune.data import Batch
from kubetune.data.rows import column
from kubetune.distributed import DistEnv
from kubetune.paths import cache_root, set_default_modes
from kubetune.tasks.base import rank_batches
from kubetune.tasks.common import unwrap
from kubetune.tasks.logprobs import sequence_logps
from kubetune.tasks.pair_batches import PairCollate

T = TypeVar("T")
ATTRIBUTE = "kubetune_reference"  # the model's attribute that holds its attached reference


class Reference:
    """A reference model on the fly: ``Reference.adapter()`` (the model with its LoRA adapter disabled) or
    ``Reference.frozen_copy(model)`` (a copy, in eval mode, without gradients)."""

    def __init__(self, mode: Literal["adapter", "copy"], model: torch.nn.Module | None = None):
        self.mode = mode
        self.model = model  # the frozen copy (mode copy), held as a plain attribute: no module owns it

    @classmethod
    def adapter(cls) -> Reference:
        """The model with its adapter disabled (it must have one: a PEFT model)."""
        return cls("adapter")

    @classmethod
    def frozen_copy(cls, model: torch.nn.Module) -> Reference:
        """A copy of ``model`` (unwrapped from DDP) as it is now, in eval mode, every parameter frozen."""
        return cls("copy", copy.deepcopy(unwrap(model)).eval().requires_grad_(False))

    def run(self, model: torch.nn.Module, fn: Callable[[torch.nn.Module], T]) -> T:
        """``fn`` of the reference network, without gradients: the copy, or ``model`` (the policy, DDP-wrapped or
        not) with its adapter disabled.

        Raises:
            RuntimeError: adapter mode and a model without an adapter (a full fine-tune whose task set no copy up).
        """
        with torch.no_grad():
            if self.model is not None:
                return fn(self.model)
            inner = unwrap(model)
            disable = getattr(inner, "disable_adapter", None)
            if disable is None:
                raise RuntimeError("no reference model: a full fine-tune without its reference set up")
            with disable():
                return fn(inner)

    def logps(self, model: torch.nn.Module, batch: Batch, autocast: torch.autocast) -> torch.Tensor:
        """Each row's summed target-token log-probability under the reference (``logprobs.sequence_logps``)."""
        return self.run(model, lambda reference: sequence_logps(reference, batch, autocast))

    def attach(self, model: torch.nn.Module) -> None:
        """Held by ``model`` (unwrapped) as a plain attribute, where ``attached`` finds it from a loss function."""
        setattr(unwrap(model), ATTRIBUTE, self)

    @staticmethod
    def attached(model: torch.nn.Module) -> Reference:
        """The reference ``attach`` gave ``model`` (DDP-wrapped or not); none attached: the adapter disabled."""
        found = getattr(unwrap(model), ATTRIBUTE, None)
        return found if isinstance(found, Reference) else Reference.adapter()


# ---------------------------------------------------------------- precomputed: once, before training, cached


def model_identity(spec: JobSpec, model_dir: Path) -> str:
    """What names the base model's weights: its URI, its config and its weight files (name, size, modification
    time: a new download changes them), without reading the weights; part of a precomputed reference's key."""
    h = hashlib.sha256(f"kubetune-dpo-reference-v1:{spec.model.uri}@{spec.model.revision}".encode())
    for f in sorted(Path(model_dir).iterdir()):
        if f.name == "config.json":
            h.update(f.read_bytes())
        elif f.suffix in (".safetensors", ".bin") and f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


def precompute(
    spec: JobSpec,
    model: torch.nn.Module,
    collates: Sequence[PairCollate[object]],
    env: DistEnv,
    device: torch.device,
    autocast: torch.autocast,
    lockstep: bool,
) -> tuple[Path, list[np.ndarray], str]:
    """The reference log-probabilities (chosen, rejected) of every pair of ``collates`` (train, eval: each a
    [rows, 2] array, set as its ``reference``) under ``model`` before its first step: read from the cache, or
    computed (each pair on one rank, then gathered; local rank 0 caches them). Collective: every rank calls it.
    Returns the cache entry, the values and how they were had ("computed and cached" or "read from the cache")."""
    key = ":".join(c.key for c in collates) + f":{spec.training.precision}:{device.type}"
    path = cache_root() / "reference" / hashlib.sha256(key.encode()).hexdigest()[:32]
    names = ("train", "eval")
    (missing,) = distributed.any_rank(not all((path / f"{n}.npy").exists() for n in names), device=device)
    if missing:
        size = spec.training.eval_batch_size or 2 * spec.training.batch_size
        values = [reference_pass(model, c, env, device, autocast, size, lockstep) for c in collates]
        if env.is_local_main:
            _write_cache(path, dict(zip(names, values)))
        how = "computed and cached"
    else:
        values = [np.load(path / f"{n}.npy") for n in names]
        how = "read from the cache"
    for c, v in zip(collates, values):
        c.reference = v
    return path, values, how


@torch.no_grad()
def reference_pass(
    model: torch.nn.Module,
    collate: PairCollate[object],
    env: DistEnv,
    device: torch.device,
    autocast: torch.autocast,
    batch_size: int,
    lockstep: bool,
) -> np.ndarray:
    """[rows, 2] log-probabilities (chosen, rejected) of ``collate``'s dataset under ``model``."""
    batches, extra = rank_batches(column(collate.ds, "length"), env, batch_size, lockstep)
    model.eval()
    parts = [
        sequence_logps(model, collate(rows).to(device), autocast).view(2, -1).T.double().cpu().numpy()
        for rows in batches
    ]
    for _ in range(extra):
        sequence_logps(model, collate(np.zeros(1, dtype=np.int64)).to(device), autocast)
    model.train()
    mine = np.concatenate(batches) if batches else np.zeros(0, dtype=np.int64)
    out = np.zeros((len(collate.ds), 2), dtype=np.float64)
    for rows, vals in distributed.all_gather_object((mine, np.concatenate(parts) if parts else np.zeros((0, 2)))):
        out[rows] = vals
    return out


def _write_cache(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Written into a temporary sibling, then renamed: a crash never leaves half a cache entry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    for name, values in arrays.items():
        np.save(tmp / f"{name}.npy", values)
    set_default_modes(tmp)
    try:
        os.replace(tmp, path)
    except OSError:  # another node's process sharing this cache won the race: its values are the same
        shutil.rmtree(tmp, ignore_errors=True)
