"""Where a 2-process CPU DDP step spends its time (the figures behind the scaling section).

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/ddp_profile.py

The packaged MiniLM in training mode, fp32, 16 × 40 random tokens per rank, 1 thread per process.
Prints, from rank 0, the median wall time and CPU time (the process's, gloo's threads included)
of 20 forward + backward (+ gradient all-reduce) steps for each of these (taking turns, 4 steps
at a time, so the VM's drift affects them alike):

- no DDP (two processes side by side, never communicating);
- DDP under ``no_sync`` (DDP's bookkeeping without communication);
- plain DDP (all 91 MB of gradients all-reduced, overlapped with backward);
- DDP as kubetune runs it: the input embedding's gradient left out of DDP and only its touched
  rows all-reduced after backward (``kubetune.distributed.row_sparse_embedding_sync``), 45 MB;
- the same with ``broadcast_buffers=False`` (no buffer broadcast before each forward), and with
  one 100 MB bucket instead of DDP's 25 MB ones (fewer all-reduces, less overlap): two DDP
  settings tried and not kept;
- plain DDP with every bucket's all-reduce deferred to after the backward pass (a comm hook
  that returns the bucket unreduced);

then a 45 MB all-reduce on its own: gloo, and a shared-memory version (each rank copies its tensor
into a /dev/shm slot, sums its half of the slots, and copies the result back) written here only
to measure whether gloo's TCP loopback is the cost; kubetune does not use it.

CPU time above "no DDP" is work the all-reduce adds to each process; with one compute thread per
core it cannot hide behind the backward pass, because there is no idle core to run it on.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import model_path  # noqa: E402

from kubetune.distributed import read_env, row_sparse_embedding_sync  # noqa: E402
from kubetune.training.strategy import DDPStrategy  # noqa: E402

STEPS = 20
KUBETUNE = "DDP, embedding rows apart (kubetune)"
MODES = (
    "no DDP",
    "DDP, no_sync",
    "DDP",
    KUBETUNE,
    f"{KUBETUNE}, broadcast_buffers=False",
    f"{KUBETUNE}, one 100 MB bucket",
    "DDP, all-reduce after backward",
)


def stepper(mode: str):
    """A function running one forward + backward (+ all-reduce) + AdamW step of ``mode``; it
    returns the wall and CPU seconds of everything but the optimizer step."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(model_path(), num_labels=3).train()
    if mode == KUBETUNE:  # kubetune's own strategy, wrapped and synced as the trainer does
        strategy = DDPStrategy(read_env(), torch.device("cpu"))
        net, sync = strategy.wrap(model), strategy.after_backward
    else:  # the variants tried and not kept: the same pieces with other DDP settings
        sync = row_sparse_embedding_sync(model, read_env()) if mode.startswith(KUBETUNE) else None
        options = {
            "broadcast_buffers": "broadcast_buffers=False" not in mode,
            "bucket_cap_mb": 100 if "100 MB" in mode else 25,
        }
        net = model if mode == "no DDP" else DDP(model, gradient_as_bucket_view=True, **options)
    pending: list[tuple[int, torch.Tensor]] = []
    if mode == "DDP, all-reduce after backward":

        def deferred(_, bucket):
            pending.append((bucket.index(), bucket.buffer()))
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        net.register_comm_hook(None, deferred)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids, labels = torch.randint(1000, 20000, (16, 40)), torch.randint(0, 3, (16,))

    def step() -> tuple[float, float]:
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        with net.no_sync() if mode == "DDP, no_sync" else contextlib.nullcontext():
            net(input_ids=ids, labels=labels).loss.backward()
        for _, buf in sorted(pending, key=lambda p: p[0]):  # as DDP's default hook: divide, then sum
            buf.div_(dist.get_world_size())
            dist.all_reduce(buf)
        pending.clear()
        if sync:
            sync([ids])
        took = time.perf_counter() - t0, time.process_time() - c0
        opt.step()
        opt.zero_grad(set_to_none=True)
        return took

    return step


def allreduce_times(numel: int = 45_000_000 // 4) -> tuple[float, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(numel)

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        return (time.perf_counter() - t0) / 10

    path = f"/dev/shm/kubetune-ddp-profile-{os.environ.get('TORCHELASTIC_RUN_ID', 'x')}"
    if rank == 0:
        with open(path, "wb") as f:
            f.truncate((world + 1) * numel * 4)
    dist.barrier()
    shared = torch.from_file(path, shared=True, size=(world + 1) * numel, dtype=torch.float32)
    slots, result = shared[: world * numel].view(world, numel), shared[world * numel :]
    lo, hi = rank * numel // world, (rank + 1) * numel // world

    def shm_all_reduce() -> None:
        slots[rank].copy_(x)
        dist.barrier()
        torch.sum(slots[:, lo:hi], dim=0, out=result[lo:hi])
        dist.barrier()
        x.copy_(result)
        dist.barrier()  # nobody overwrites a slot before everyone has read the result

    try:
        return timed(lambda: dist.all_reduce(x)), timed(shm_all_reduce)
    finally:
        dist.barrier()
        if rank == 0:
            os.unlink(path)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    # Modes take turns, a few steps each, so this VM's drift over minutes affects them alike.
    steppers = {mode: stepper(mode) for mode in MODES}
    times: dict[str, list[tuple[float, float]]] = {mode: [] for mode in MODES}
    for turn in range(STEPS // 4 + 1):
        for mode, step in steppers.items():
            for _ in range(4):
                took = step()
                if turn:  # the first turn warms up
                    times[mode].append(took)
    for mode, took in times.items():
        t, c = statistics.median(w for w, _ in took), statistics.median(c for _, c in took)
        if dist.get_rank() == 0:
            print(
                f"{mode:62s} forward + backward (+ all-reduce): {t * 1e3:6.0f} ms wall, {c * 1e3:6.0f} ms CPU",
                flush=True,
            )
    gloo, shm = allreduce_times()
    if dist.get_rank() == 0:
        print(f"45 MB all-reduce alone: gloo {gloo * 1e3:.1f} ms, shared memory {shm * 1e3:.1f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
