"""Parallelism strategies: how the model is wrapped, synchronized, clipped, checkpointed and
exported. The trainer calls only this protocol, so a sharded strategy (FSDP2) slots in without
touching the loop."""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from kubetune import checkpoint, distributed
from kubetune.distributed import DistEnv


class Strategy(Protocol):
    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module the forward and backward passes run on."""

    def no_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-batch's backward: gradients are reduced only on the last."""

    def after_backward(self, input_ids: list[torch.Tensor]) -> None:
        """Gradient work after the step's last backward (before clipping)."""

    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients to ``max_norm``; returns the total norm before clipping."""

    def model_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint saves of the model (collective where sharded)."""

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None: ...

    def export_model(self) -> torch.nn.Module:
        """The whole, unwrapped model for export on the writing rank (collective where sharded)."""

    @property
    def is_writer(self) -> bool:
        """Whether this rank writes checkpoints and artifacts."""


class DDPStrategy:
    """Data parallel: every rank holds the whole model; gradients are all-reduced in buckets,
    except a trainable input embedding, whose touched rows alone are averaged (row-sparse sync)."""

    def __init__(self, env: DistEnv, device: torch.device, *, bucket_view: bool = True, sparse_embedding: bool = True):
        """``bucket_view`` and ``sparse_embedding`` exist to measure them (benchmarks/step_ablation.py)."""
        self.env, self.device = env, device
        self.bucket_view, self.sparse_embedding = bucket_view, sparse_embedding
        self.model: torch.nn.Module | None = None
        self.wrapped: torch.nn.Module | None = None
        self._embedding_sync = None

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        self.model = model
        # before DDP: it takes the embedding out of DDP's buckets
        self._embedding_sync = distributed.row_sparse_embedding_sync(model, self.env) if self.sparse_embedding else None
        if self.env.distributed:
            # gradient_as_bucket_view: gradients live in DDP's all-reduce buckets, saving a copy of every gradient
            # each step.
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self.wrapped = DDP(model, device_ids=device_ids, gradient_as_bucket_view=self.bucket_view)
        else:
            self.wrapped = model
        return self.wrapped

    def no_sync(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if (last or not self.env.distributed) else self.wrapped.no_sync()

    def after_backward(self, input_ids: list[torch.Tensor]) -> None:
        if self._embedding_sync:
            self._embedding_sync(input_ids)

    def clip(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def model_state(self) -> dict[str, torch.Tensor]:
        return checkpoint.trainable_state(self.model)

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state, strict=False)

    def export_model(self) -> torch.nn.Module:
        return self.model

    @property
    def is_writer(self) -> bool:
        return self.env.is_main
