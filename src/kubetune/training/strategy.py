"""Parallelism strategies: how the model is built, wrapped, synchronized, clipped, checkpointed
and exported. The trainer calls only this protocol; ``for_job`` picks one from the spec."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from kubetune import checkpoint, distributed
from kubetune.artifacts.output import Output
from kubetune.checkpoint.writer import snapshot
from kubetune.config import JobSpec
from kubetune.distributed import DistEnv
from kubetune.errors import KubetuneError
from kubetune.training.runtime import join_world_of_one, transformer_blocks

if TYPE_CHECKING:  # imported where used: the fsdp package is loaded only by a run that shards
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy

log = logging.getLogger(__name__)

# make(where): the task's model with its weights on ``where`` (the meta device: the modules alone)
MakeModel = Callable[[torch.device], torch.nn.Module]
META = torch.device("meta")
# sync(input_ids): the row-sparse all-reduce of a trainable input embedding (distributed.row_sparse_embedding_sync)
EmbeddingSync = Callable[[list[torch.Tensor]], None]


class Strategy(Protocol):
    name: str
    sharded: bool  # every rank writes its part of a checkpoint (into the directory the writer stages)

    def build(self, make: MakeModel) -> torch.nn.Module:
        """The model with this rank's weights (the whole model, or its shard)."""

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module the forward and backward passes run on."""

    def no_sync(self, last: bool) -> contextlib.AbstractContextManager[None]:
        """Context for one micro-batch's backward: gradients are reduced only on the last."""

    def after_backward(self, input_ids: list[torch.Tensor]) -> None:
        """Gradient work after the step's last backward (before clipping)."""

    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients to ``max_norm``; returns the total norm before clipping (every rank)."""

    def grad_norm(self) -> torch.Tensor:
        """The total gradient norm (every rank), without clipping."""

    def save(self, directory: Path | None, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """All ranks: the model and optimizer state of a checkpoint. Returns what the writer puts
        into the checkpoint's ``state.pt``; a sharded strategy writes its shards under ``directory``. Saving
        asynchronously, the state returned is a copy the next steps do not change, with ``checkpoint.PENDING``
        (what the writer calls before it completes the checkpoint in the background: the shards are written)."""

    def shard_files(self, directory: Path) -> list[Path]:
        """The files this rank wrote under ``directory`` in ``save`` (none unless sharded; none yet while they are
        written in the background)."""

    def wait_saved(self) -> None:
        """Until this rank's part of the checkpoint in flight is written (at once unless sharded and asynchronous)."""

    def load(self, directory: Path, saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        """All ranks: restore the model and optimizer from a checkpoint (``saved``: its ``state.pt``)."""

    def export_model(self) -> torch.nn.Module | None:
        """The whole, unwrapped model on the writing rank, None elsewhere (collective where sharded)."""

    @property
    def is_writer(self) -> bool:
        """Whether this rank writes checkpoints and artifacts."""


def for_job(
    spec: JobSpec,
    env: DistEnv,
    device: torch.device,
    dtype: torch.dtype,
    make: MakeModel,
    resumed: str | None = None,
) -> Strategy:
    """The strategy ``distributed.strategy`` names; ``auto``: the one that wrote the checkpoint
    this run resumes (``resumed``); on one process, fsdp where ``one_process_fsdp`` says so (bf16
    compute weights on one GPU), else ddp; on more, fsdp when the training state DDP would keep on
    every process (fp32 weights, gradients and two AdamW moments for what trains, the stored bytes of
    what is frozen) exceeds half of one device's memory (the GPU's, or on a CPU the host memory per
    process); otherwise ddp."""
    kind: str = spec.distributed.strategy
    quantized = bool(spec.lora and spec.lora.quantization)
    if kind == "auto" and resumed:
        kind = resumed
        log.info("distributed.strategy auto: %s, as the checkpoint it resumes", kind)
    elif kind == "auto" and env.world_size == 1:
        chosen, why = one_process_fsdp(spec, env.world_size, device.type, dtype)
        kind = "fsdp" if chosen else "ddp"
        log.info("distributed.strategy auto: %s on one process (%s)", kind, why)
    elif kind == "auto":
        kind = "ddp"
        if not quantized:
            need, budget = ddp_bytes(meta_model(make)), device_bytes(device, env)
            if need > budget / 2:
                kind = "fsdp"
            log.info(
                "distributed.strategy auto: %s (the training state takes %.1f GiB per process under ddp; "
                "this device has %.1f GiB)",
                kind,
                need / 2**30,
                budget / 2**30,
            )
    if kind == "ddp":
        return DDPStrategy(env, device, async_save=spec.training.checkpoint_async)
    if quantized:
        raise KubetuneError(
            "QLoRA (lora.quantization) under distributed.strategy fsdp is not supported yet",
            field="distributed.strategy",
            fix="use distributed.strategy: ddp (every GPU holds the quantized base, which is what QLoRA saves)",
        )
    return FSDPStrategy(
        env,
        device,
        dtype,
        spec.distributed.fsdp.reshard_after_forward,
        spec.distributed.fsdp.cpu_offload,
        # each rank uploads its own shards to an s3:// output as soon as ``save`` returns: they must be written
        async_save=spec.training.checkpoint_async and Output.for_spec(spec).scheme != "s3",
    )


def one_process_fsdp(spec: JobSpec, world_size: int, device_type: str, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether ``distributed.strategy: auto`` trains a one-process run under fsdp on a world of one, and why
    (the reason the log line gives). Yes on one CUDA GPU in bf16 with ``training.fast_path.bf16_weights``: FSDP2's
    ``MixedPrecisionPolicy`` then computes with bf16 weights (no re-cast in every Linear, a bf16 residual stream)
    while the optimizer steps the fp32 master weights, as under fsdp on several GPUs; a world of one gathers
    nothing. No wherever fsdp does not apply: QLoRA's quantized base, a task that keeps a whole frozen copy of the
    model as its reference (a full fine-tune of a task with ``fsdp_needs_lora``, or ``reference_copy``),
    ``evaluation.every`` (the harness scores the whole model); and where nothing would change: fp32 or fp16, a
    CPU (today's path, bit for bit), more than one process (``for_job``'s memory rule)."""
    from kubetune.config.tasks import registered

    entry = registered()[spec.task]
    own = spec.section(entry.section) if entry.section else None  # the task's own section (None: absent)
    reasons = [
        (spec.distributed.strategy != "auto", f"distributed.strategy is {spec.distributed.strategy}"),
        (world_size != 1, f"{world_size} processes"),
        (not spec.training.fast_path.bf16_weights, "training.fast_path.bf16_weights is false"),
        (device_type != "cuda", f"fp32 weights on {device_type}: bf16 compute weights apply on a CUDA GPU"),
        (dtype != torch.bfloat16, f"precision {str(dtype).removeprefix('torch.')}: bf16 compute weights need bf16"),
        (bool(spec.lora and spec.lora.quantization), "QLoRA (lora.quantization) keeps its quantized base"),
        (
            spec.lora is None and (entry.fsdp_needs_lora or bool(getattr(own, "reference_copy", False))),
            f"task {spec.task}'s full fine-tune keeps a whole frozen copy of the model as its reference",
        ),
        (bool(spec.evaluation and spec.evaluation.every), "evaluation.every scores the whole, unsharded model"),
    ]
    why = next((reason for applies, reason in reasons if applies), None)
    if why is not None:
        return False, why
    return True, "training.fast_path.bf16_weights: bf16 compute weights, fp32 master weights in the optimizer"


def meta_model(make: MakeModel) -> torch.nn.Module:
    """``make(META)`` without moving any random generator: transformers and peft draw numbers even
    for weights they do not materialize, and a fresh head or LoRA A must come out as under DDP."""
    saved = checkpoint.rng_state()
    try:
        return make(META)
    finally:
        checkpoint.set_rng_state(saved)


def ddp_bytes(model: torch.nn.Module) -> int:
    """Bytes one DDP process keeps for ``model`` (built on the meta device): 16 per trainable
    parameter (fp32 weight, gradient, two AdamW moments), the stored size of every frozen one."""
    return sum(16 * p.numel() if p.requires_grad else p.numel() * p.element_size() for p in model.parameters())


def device_bytes(device: torch.device, env: DistEnv) -> int:
    """Memory of one process's device: the GPU's, or the host memory over the processes on this node."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, env.local_world_size)


class DDPStrategy:
    """Data parallel: every rank holds the whole model; gradients are all-reduced in buckets,
    except a trainable input embedding, whose touched rows alone are averaged (row-sparse sync)."""

    name = "ddp"
    sharded = False

    def __init__(
        self,
        env: DistEnv,
        device: torch.device,
        *,
        bucket_view: bool = True,
        sparse_embedding: bool = True,
        async_save: bool = False,
    ):
        """``bucket_view`` and ``sparse_embedding`` exist to measure them (benchmarks/step_ablation.py).
        ``async_save``: ``save`` returns a copy of the state in host memory, which the writer writes in the
        background while the next steps change the live one (``checkpoint.PENDING``); False: the optimizer's live
        state, written before the next step."""
        self.env, self.device = env, device
        self.async_save = async_save
        self.bucket_view, self.sparse_embedding = bucket_view, sparse_embedding
        self.model: torch.nn.Module | None = None  # set by wrap()
        self.wrapped: torch.nn.Module | None = None
        self._ddp: DDP | None = None  # ``wrapped`` where it is DDP (a distributed run): its no_sync
        self._embedding_sync: EmbeddingSync | None = None

    def build(self, make: MakeModel) -> torch.nn.Module:
        return make(self.device)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        self.model = model
        # before DDP: it takes the embedding out of DDP's buckets
        self._embedding_sync = distributed.row_sparse_embedding_sync(model, self.env) if self.sparse_embedding else None
        if self.env.distributed:
            # gradient_as_bucket_view: gradients live in DDP's all-reduce buckets, saving a copy of every gradient
            # each step.
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self._ddp = DDP(model, device_ids=device_ids, gradient_as_bucket_view=self.bucket_view)
            self.wrapped = self._ddp
        else:
            self.wrapped = model
        return self.wrapped

    def _model(self) -> torch.nn.Module:
        if self.model is None:
            raise RuntimeError("DDPStrategy: the model is used before wrap()")
        return self.model

    def no_sync(self, last: bool) -> contextlib.AbstractContextManager[None]:
        # _ddp is set exactly when the run is distributed; wrap() sets it
        if last or not self.env.distributed:
            return contextlib.nullcontext()
        if self._ddp is None:
            raise RuntimeError("DDPStrategy: no_sync before wrap()")
        return self._ddp.no_sync()

    def after_backward(self, input_ids: list[torch.Tensor]) -> None:
        if self._embedding_sync:
            self._embedding_sync(input_ids)

    def clip(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self._model().parameters(), max_norm)

    def grad_norm(self) -> torch.Tensor:
        return torch.nn.utils.get_total_norm([p.grad for p in self._model().parameters() if p.grad is not None])

    def save(self, directory: Path | None, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if not self.is_writer:
            return {}
        model = checkpoint.trainable_state(self._model())  # a copy already
        if not self.async_save:
            return {"model": model, "optimizer": optimizer.state_dict()}
        # the optimizer's tensors are the live ones, which the next step updates in place
        return {"model": model, "optimizer": snapshot(optimizer.state_dict()), checkpoint.PENDING: _nothing}

    def shard_files(self, directory: Path) -> list[Path]:
        return []

    def wait_saved(self) -> None:
        pass  # the writer rank's whole checkpoint is the store's (``CheckpointStore.wait``)

    def load(self, directory: Path, saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        if saved.get("sharded"):
            raise KubetuneError(
                f"checkpoint {directory} was written by distributed.strategy fsdp",
                field="distributed.strategy",
                fix="resume it with distributed.strategy: fsdp (or auto), or pass --no-resume",
            )
        model = self._model()
        missing = set(checkpoint.trainable_state(model)) - set(saved.get("model") or {})
        if missing:
            raise KubetuneError(
                f"checkpoint {directory} lacks {len(missing)} trainable tensors, e.g. {sorted(missing)[0]}",
                field="output.uri",
                fix="pass --no-resume",
            )
        model.load_state_dict(saved["model"], strict=False)
        optimizer.load_state_dict(saved["optimizer"])

    def export_model(self) -> torch.nn.Module | None:
        return self.model if self.is_writer else None

    @property
    def is_writer(self) -> bool:
        return self.env.is_main


class _ShardOptions(TypedDict, total=False):
    """The keywords of every ``fully_shard`` call of one model (``FSDPStrategy._shard``)."""

    reshard_after_forward: bool
    offload_policy: OffloadPolicy
    mp_policy: MixedPrecisionPolicy  # absent: fully_shard's default (no mixed precision)


class FSDPStrategy:
    """Sharded data parallel (FSDP2, ``torch.distributed.fsdp.fully_shard``): each transformer
    block is one unit whose weights, gradients and AdamW state are split over the ranks and gathered
    for its forward and backward only; the rest of the model is the root unit.

    The model is built on the meta device everywhere; rank 0 alone builds it with weights (on the
    CPU) and broadcasts them tensor by tensor, each rank keeping its shard: a rank's host memory
    never holds the whole model except rank 0's once, while loading. LoRA adapters are sharded with
    their block (one all-gather per block carries base and adapter; they are a small fraction of
    its bytes). Checkpoints are ``torch.distributed.checkpoint`` (DCP) shards, which load on any
    number of ranks.
    """

    name = "fsdp"
    sharded = True
    SHARDS = "shards"  # the DCP directory inside a checkpoint

    def __init__(
        self,
        env: DistEnv,
        device: torch.device,
        dtype: torch.dtype,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        mixed_precision: bool | None = None,
        async_save: bool = False,
    ):
        """``mixed_precision``: compute with weights in ``dtype`` and reduce gradients in fp32 (FSDP2's
        ``MixedPrecisionPolicy``); None: on a CUDA device with a ``dtype`` other than fp32 (a test sets True on a
        CPU, where torch computes with bf16 weights as well). ``async_save``: ``save`` copies the shards into host
        memory and writes them in the background (DCP's ``async_save``)."""
        if cpu_offload and device.type != "cuda":
            raise KubetuneError(
                f"FSDP CPU offload moves GPU state to the host, and this worker trains on {device.type}",
                field="distributed.fsdp.cpu_offload",
                fix="remove distributed.fsdp.cpu_offload, or run on GPU nodes (resources.gpu)",
            )
        self.env, self.device, self.dtype = env, device, dtype
        self.reshard_after_forward, self.cpu_offload = reshard_after_forward, cpu_offload
        if mixed_precision is None:
            mixed_precision = device.type == "cuda" and dtype != torch.float32
        self.mixed_precision = mixed_precision
        self.async_save = async_save
        self._saving: Future[Any] | None = None  # this rank's shards of the checkpoint in flight (async_save)
        self._save_group: Any = None  # the gloo group of DCP's background collectives (made at the first save)
        self.model: torch.nn.Module | None = None  # set by build()
        self._root: FSDPModule | None = None  # the same object as ``model``, as fully_shard returns it
        self.make: MakeModel | None = None

    def build(self, make: MakeModel) -> torch.nn.Module:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        self.make = make
        join_world_of_one(self.device)
        model = meta_model(make)
        # rank 0 reads the weights (and makes the fresh head and adapters, from the same seed as DDP)
        full = make(torch.device("cpu")) if self.env.is_main else None
        root = self._shard(model)
        model.to_empty(device="cpu" if self.cpu_offload else self.device)
        set_model_state_dict(
            model,
            full.state_dict() if full is not None else {},
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )
        # Buffers are not sharded and not all in the state dict (rotary frequencies): rank 0's, to all.
        source = dict(full.named_buffers()) if full is not None else {}
        for name, buf in model.named_buffers():
            if full is not None:
                buf.copy_(source[name])
            if self.env.distributed:
                torch.distributed.broadcast(buf, 0)
        del full, source
        self.model, self._root = model, root
        return model

    def _shard(self, model: torch.nn.Module) -> FSDPModule:
        """Shard every transformer block, then the root; returns the root (``model`` itself, now an FSDPModule)."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        kwargs: _ShardOptions = {
            "reshard_after_forward": self.reshard_after_forward,
            "offload_policy": CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy(),
        }
        if self.mixed_precision:
            # compute in the autocast dtype, reduce gradients in fp32 (the sharded weights stay fp32)
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
        for block in transformer_blocks(model):
            fully_shard(block, **kwargs)
        return fully_shard(model, **kwargs)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model  # sharded in build(): the hooks are on the model itself

    def _model(self) -> torch.nn.Module:
        if self.model is None:
            raise RuntimeError("FSDPStrategy: the model is used before build()")
        return self.model

    @contextlib.contextmanager
    def no_sync(self, last: bool) -> Iterator[None]:
        if self._root is None:
            raise RuntimeError("FSDPStrategy: no_sync before build()")
        # Accumulate unsharded gradients locally; the last micro-batch reduce-scatters their sum once.
        self._root.set_requires_gradient_sync(last)
        yield

    def after_backward(self, input_ids: list[torch.Tensor]) -> None:
        pass

    def clip(self, max_norm: float) -> torch.Tensor:
        return _full(torch.nn.utils.clip_grad_norm_(self._model().parameters(), max_norm))

    def grad_norm(self) -> torch.Tensor:
        return _full(torch.nn.utils.get_total_norm([p.grad for p in self._model().parameters() if p.grad is not None]))

    def _state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        # frozen weights (a LoRA base) are not part of the checkpoint: they come from model.uri
        model_sd, optim_sd = get_state_dict(
            self._model(), optimizer, options=StateDictOptions(ignore_frozen_params=True)
        )
        return {"model": model_sd, "optimizer": optim_sd}

    def save(self, directory: Path | None, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        if directory is None:  # only an unsharded strategy is given none (the trainer stages a directory for shards)
            raise ValueError("FSDPStrategy.save writes its shards into a directory, and none was given")
        self.wait_saved()
        if not self.async_save:
            dcp.save(self._state(optimizer), checkpoint_id=directory / self.SHARDS)
            return {"sharded": "dcp"}
        if self._save_group is None:
            # DCP's background thread gathers the ranks' write results while the training thread runs the step's
            # collectives: two threads must not share a group (their calls would pair across ranks in any order)
            self._save_group = dist.new_group(backend="gloo")
        # Copies every shard into host memory (DCP's default stager) before it returns; a thread writes them.
        saving = dcp.async_save(
            self._state(optimizer), checkpoint_id=directory / self.SHARDS, process_group=self._save_group
        )
        if not isinstance(saving, Future):  # an AsyncSaveResponse: only with a stager that stages in the background
            raise RuntimeError(f"dcp.async_save returned {type(saving).__name__}, not a Future")
        self._saving = saving
        return {"sharded": "dcp", checkpoint.PENDING: lambda: self._written(saving, directory)}

    def _written(self, saving: Future[Any], directory: Path) -> None:
        """The writer's background thread: until DCP's save is done (every rank's shards and the metadata, which the
        coordinator writes last), then that every file the metadata names is there: a rank that wrote to another
        node's disk leaves a checkpoint that must not be completed."""
        import torch.distributed.checkpoint as dcp

        saving.result()
        shards = directory / self.SHARDS
        names = {info.relative_path for info in dcp.FileSystemReader(shards).read_metadata().storage_data.values()}
        lost = sorted(n for n in names if not (shards / n).exists())
        if lost:
            raise KubetuneError(
                f"the checkpoint shards {lost} are not in {shards}: their ranks write to another node's disk",
                field="output.uri",
                fix="on several nodes, put the output on storage every node shares (a ReadWriteMany PVC) or s3://",
            )

    def shard_files(self, directory: Path) -> list[Path]:
        if self.async_save:
            return []  # still being written: the writer checks them once they are (``_written``)
        # DCP's file writer names each rank's files __<rank>_<n>.distcp; .metadata is the coordinator's
        return sorted((directory / self.SHARDS).glob(f"__{self.env.rank}_*.distcp"))

    def wait_saved(self) -> None:
        saving, self._saving = self._saving, None
        if saving is not None:
            saving.result()

    def load(self, directory: Path, saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        if saved.get("sharded") != "dcp":
            raise KubetuneError(
                f"checkpoint {directory} was written by distributed.strategy ddp",
                field="distributed.strategy",
                fix="resume it with distributed.strategy: ddp (or auto), or pass --no-resume",
            )
        state = self._state(optimizer)
        dcp.load(state, checkpoint_id=directory / self.SHARDS)
        set_state_dict(
            self._model(),
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=StateDictOptions(ignore_frozen_params=True),
        )

    def export_model(self) -> torch.nn.Module | None:
        """Gathers the full state dict (collective) into a fresh, unsharded model on rank 0's CPU."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sharded = self._model()
        full = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.is_writer:
            return None
        if self.make is None:
            raise RuntimeError("FSDPStrategy: export_model before build()")
        model = meta_model(self.make)
        model.load_state_dict(full, assign=True)
        buffers = dict(sharded.named_buffers())
        for name, buf in list(model.named_buffers()):
            module, _, attr = name.rpartition(".")
            owner = model.get_submodule(module) if module else model
            owner._buffers[attr] = buffers[name].detach().cpu().clone()
        # a transformers model's method (Module's own __getattr__ types any attribute as a Tensor or Module)
        tie_weights: Callable[[], object] | None = getattr(model, "tie_weights", None)
        if tie_weights is not None:
            tie_weights()  # assign=True replaced tied parameters one by one
        return model.train(False)

    @property
    def is_writer(self) -> bool:
        return self.env.is_main


def _nothing() -> None:
    """The ``checkpoint.PENDING`` of a checkpoint whose whole state the writer holds: nothing to wait for."""


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t
