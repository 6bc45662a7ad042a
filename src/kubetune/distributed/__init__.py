"""The distributed environment, read once; process-group set-up; rank-0 discipline."""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kubetune.errors import redact


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job (from torchrun / the Training Operator's environment)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the only process that logs progress and writes artifacts."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """Local rank 0: the process that prepares node-local caches."""
        return self.local_rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def read_env(environ: dict[str, str] | None = None) -> DistEnv:
    """Read RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE (as torchrun sets them)."""
    e = os.environ if environ is None else environ
    world = int(e.get("WORLD_SIZE", 1))
    return DistEnv(
        rank=int(e.get("RANK", 0)),
        local_rank=int(e.get("LOCAL_RANK", 0)),
        world_size=world,
        local_world_size=int(e.get("LOCAL_WORLD_SIZE", world)),
    )


def pick_device(env: DistEnv) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", env.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def setup(
    env: DistEnv, device: torch.device, backend: str = "auto", timeout_minutes: int = 60
) -> dist.ProcessGroup | None:
    """Join the process group (gloo on CPU, NCCL on GPU unless ``backend`` says otherwise).

    Returns:
        The group for small control messages (``any_rank``'s ``group``): a gloo group when training
        runs over NCCL, else None (the default group serves).
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not env.distributed or dist.is_initialized():
        return None
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    from datetime import timedelta

    dist.init_process_group(
        backend=backend, timeout=timedelta(minutes=timeout_minutes), device_id=device if backend == "nccl" else None
    )
    # Per-step agreement (stop? checkpoint?) goes over gloo on the CPU: over NCCL it would need a
    # GPU tensor and a device sync every step, stalling the queue of GPU work the CPU runs ahead of.
    return dist.new_group(backend="gloo") if backend == "nccl" else None


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _this_gpu() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _all_reduce(t: torch.Tensor, op) -> torch.Tensor:
    """``t`` reduced over all ranks, in place. A CPU tensor under NCCL (which reduces only GPU tensors:
    "No backend type associated with device type cpu") goes through a copy on this rank's GPU."""
    if not dist.is_initialized():
        return t
    if t.device.type == "cpu" and dist.get_backend() == "nccl":
        on_gpu = t.to(_this_gpu(), copy=True)
        dist.all_reduce(on_gpu, op=op)
        return t.copy_(on_gpu)
    dist.all_reduce(t, op=op)
    return t


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over all ranks (in place, on any device; a no-op when not distributed)."""
    return _all_reduce(t, dist.ReduceOp.SUM)


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """Maximum of a tensor over all ranks (in place, on any device; a no-op when not distributed)."""
    return _all_reduce(t, dist.ReduceOp.MAX)


def all_gather_object(obj) -> list:
    """Every rank's ``obj``, indexed by rank (``[obj]`` when not distributed)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj):
    """Rank 0's ``obj`` on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def any_rank(*flags: bool, device: torch.device, group: dist.ProcessGroup | None = None) -> tuple[bool, ...]:
    """For each flag: is it set on any rank? One small all-reduce, over ``group`` (``setup``'s
    control group; None: the default group, on ``device`` unless that group is gloo)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:  # a world of one (FSDP on one GPU): no sync
        return tuple(bool(f) for f in flags)
    on_cpu = group is not None or dist.get_backend() == "gloo"
    t = torch.tensor([float(f) for f in flags], device="cpu" if on_cpu else device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return tuple(bool(v > 0) for v in t.tolist())


EXIT_PREEMPTED = 143  # a worker's "stopped after a checkpoint" (128 + SIGTERM)


class StepAbandoned(Exception):
    """Every rank gave the running optimizer step up together on a stop signal, before the step changed
    anything (weights, optimizer, counters): the trainer checkpoints the step before it and stops. Raised
    where waiting for the step to end could outlast the grace period a stopped pod gets (GRPO's reward
    calls)."""

    def __init__(self, step: int):
        super().__init__(f"step {step} given up on a stop signal")
        self.step = step


def install_signal_handlers() -> threading.Event:
    """SIGTERM (eviction, preemption) and SIGINT (Ctrl-C) ask for a checkpoint and a clean stop.

    Returns:
        The event the handlers set, for the training loop to check at every step boundary.
    """
    stop = threading.Event()

    def handler(signum, frame):
        if not stop.is_set():
            logging.getLogger(__name__).warning(
                "received %s: finishing the current step (or giving it up where it would outlast the grace period), "
                "then writing a checkpoint",
                signal.Signals(signum).name,
            )
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _redacted(record: logging.LogRecord) -> bool:
    """No log line shows a URL's user name or password, whichever library logged it."""
    message = record.getMessage()
    clean = redact(message)
    if clean != message:
        record.msg, record.args = clean, None
    return True


def setup_logging(env: DistEnv, level: int = logging.INFO) -> None:
    """Every log line says its rank; ranks other than 0 log warnings and errors only."""
    # Stamp the rank on every record (not on a handler), so handlers swapped in later
    # (e.g. tqdm's logging redirect) keep it.
    factory = logging.getLogRecordFactory()

    def with_rank(*args, **kwargs):
        record = factory(*args, **kwargs)
        record.rank = env.rank
        return record

    logging.setLogRecordFactory(with_rank)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s [rank %(rank)d] %(levelname)s %(message)s", "%H:%M:%S"))
    handler.addFilter(_redacted)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level if env.is_main else logging.WARNING)
    for noisy in ("httpx", "urllib3", "filelock", "datasets", "huggingface_hub", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def row_sparse_embedding_sync(model: torch.nn.Module, env: DistEnv):
    """Take a trainable input embedding out of DDP's all-reduce and return ``sync(input_ids)``,
    which all-reduces only the rows the step's tokens touched (None when not applicable).

    Why our own: the embedding's gradient is dense in memory but zero outside the rows of the
    tokens in the batch (a few hundred of MiniLM's 30,522), yet it is half of MiniLM's parameters,
    so DDP spends half of every step's all-reduce on zeros. Averaging just the union of touched
    rows gives the same gradient. Not applicable when the embedding is frozen (LoRA) or tied to
    an output layer, whose gradient is dense.
    """
    # a transformers model's accessors (a plain Module has none)
    get_input, get_output = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    emb = get_input() if get_input is not None else None
    if not env.distributed or emb is None or not emb.weight.requires_grad:
        return None
    out = get_output() if get_output is not None else None
    if out is not None and out.weight is emb.weight:
        return None
    weight = emb.weight
    name = next(n for n, p in model.named_parameters() if p is weight)
    # DDP's documented hook for parameters it must leave alone (it neither broadcasts nor reduces them).
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, [name])

    def sync(input_ids: list[torch.Tensor]) -> None:
        touched = torch.zeros(weight.shape[0], dtype=torch.uint8, device=weight.device)
        for ids in input_ids:
            touched[ids.to(weight.device).reshape(-1)] = 1
        dist.all_reduce(touched, op=dist.ReduceOp.MAX)  # the union of every rank's rows
        rows = touched.nonzero().squeeze(1)
        if weight.grad is None:  # this rank saw no token (cannot happen with a non-empty batch, but stay in step)
            weight.grad = torch.zeros_like(weight)
        part = weight.grad.index_select(0, rows)
        dist.all_reduce(part, op=dist.ReduceOp.SUM)
        weight.grad.index_copy_(0, rows, part / env.world_size)  # DDP averages over ranks; so do we

    return sync
