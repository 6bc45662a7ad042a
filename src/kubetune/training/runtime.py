"""What a training process sets up around its strategy: a process group of its own for a one-process FSDP run
(``join_world_of_one``), the allocator's policy for the chosen strategy (``allocator_policy``), the model's
repeated transformer blocks (``transformer_blocks``: FSDP's units, what ``compile_blocks`` compiles). Kept apart
from ``training.strategy``, which uses them, so that the strategies stay one module of their own size."""

from __future__ import annotations

import ctypes

import torch


def join_world_of_one(device: torch.device) -> bool:
    """Make this process a process group of its own where it has none: FSDP2 shards over a device mesh, which
    needs the default group, and a one-process run has none (``distributed.setup`` joins one for several
    processes only). The group is in memory (a ``HashStore``: no address, no port) and has torch's default
    backends (gloo for CPU tensors, NCCL for CUDA ones); the worker's ``distributed.teardown`` destroys it.
    Returns whether it made one."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


# glibc's M_MMAP_THRESHOLD (malloc.h); a fixed value also turns off the threshold's growth
M_MMAP_THRESHOLD = -3
HEAP_LIMIT = 1 << 20


def allocator_policy(strategy: str, device: torch.device) -> bool:
    """Set the process's allocator policy for the chosen strategy, once, where the run chooses it
    (the trainer), not in a strategy's constructor: FSDP on a CPU gives freed blocks back to the
    system (``return_freed_memory``); anything else keeps glibc's default. Returns whether it changed."""
    return strategy == "fsdp" and device.type == "cpu" and return_freed_memory()


def return_freed_memory() -> bool:
    """Make glibc give every freed block of 1 MiB or more back to the system (False without glibc).

    glibc serves a large allocation from its own mapping, but raises that threshold to the size of
    each such block freed, so later blocks of that size (up to 32 MiB) come from the heap and stay in
    the process after they are freed. FSDP allocates and frees a block's gathered weights and
    gradients at every layer call, so on a CPU, where host memory is the device's, its resident peak
    grew by about 0.5 GiB on a 0.4B-parameter Llama (benchmarks/fsdp_memory.py). Not set for DDP:
    there it costs about 6% of the step time (more page faults) for 0.1 GiB on the demo."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False  # musl or another libc: its own policy
    return bool(libc.mallopt(M_MMAP_THRESHOLD, HEAP_LIMIT))


def compile_blocks(model: torch.nn.Module, backend: str = "inductor") -> int:
    """``torch.compile`` every transformer block in place (``nn.Module.compile``: parameter names and
    the exported state dict stay unchanged); the whole model when it has no repeated blocks. Returns
    how many modules were compiled.

    Per block, not the whole model: one block's graph is compiled once and reused by every layer,
    and the embedding, the chunked loss and the packed attention's data-dependent layout (compiled
    out: ``attention.packed_attention`` is ``torch.compiler.disable``d) stay outside it. Dynamic
    shapes, not length buckets: packed and length-grouped batches change their length every step,
    and a dynamic graph compiles once for all of them (the test counts the graphs); padding rows up to
    a bucket of 256 measured slower (benchmarks/README.md, compiled blocks)."""
    blocks = transformer_blocks(model)
    for module in blocks or [model]:
        module.compile(dynamic=True, backend=backend)
    return len(blocks) or 1


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a transformer: the ModuleList of same-typed modules holding the most
    parameters (``model.layers`` of a Llama, ``encoder.layer`` of a BERT)."""
    lists = [
        m
        for m in model.modules()
        if isinstance(m, torch.nn.ModuleList) and len(m) > 0 and len({type(c) for c in m}) == 1
    ]
    if not lists:
        return []
    biggest = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    return list(biggest)
