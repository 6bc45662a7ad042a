"""The GPUs of a study on this machine: trials that run at once each get their own (``CUDA_VISIBLE_DEVICES`` of
the trial's run), so that parallel trials never share a device. Without a GPU, trials share the cores instead
(``space.threads_per_trial``)."""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable, Iterator

from kubetune.errors import KubetuneError


def check_processes(need: int, what: str, field: str, fix: Callable[[int], str], gpus: list[str] | None = None) -> None:
    """Refuse ``need`` processes at once on this machine (``what`` says whose: "2 trials at once of 2 processes
    each") beyond one GPU each where there are GPUs (``gpus``: ``visible_gpus()`` unless given), else one core
    each: more share a device, or the cores, until each goes many times slower and holds its own model.

    Raises:
        KubetuneError: naming ``field``; ``fix(have)`` says what to set, given the GPUs or cores there are.
    """
    gpus = visible_gpus() if gpus is None else gpus
    have, unit = (len(gpus), "GPUs (one per process)") if gpus else (os.cpu_count() or 1, "cores")
    if need > have:
        raise KubetuneError(f"{what} need {need} {unit}, and this machine has {have}", field=field, fix=fix(have))


def visible_gpus() -> list[str]:
    """The GPUs the trials may use, as ``CUDA_VISIBLE_DEVICES`` names them: its entries where it is set, else
    every device torch sees; none without CUDA. Counted without initialising CUDA in this process (the trials use
    the GPUs, not the study)."""
    import torch

    count = torch.cuda.device_count()
    if not count:
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None and listed.strip():
        return [d.strip() for d in listed.split(",") if d.strip()][:count]
    return [str(i) for i in range(count)]


class GpuPool:
    """``per_trial`` GPUs for each trial while it runs, out of ``gpus``; a trial's lease is released when its run
    ends. The study's checks keep trials at once × per_trial within the GPUs, so a lease does not wait."""

    def __init__(self, gpus: list[str], per_trial: int):
        if per_trial > len(gpus):
            raise ValueError(f"{per_trial} GPUs per trial out of {len(gpus)}")
        self.per_trial = per_trial
        self._free: queue.Queue[str] = queue.Queue()
        for gpu in gpus:
            self._free.put(gpu)
        self._taking = threading.Lock()  # one lease taken at a time: two half-filled leases never wait on each other

    @contextlib.contextmanager
    def lease(self) -> Iterator[list[str]]:
        with self._taking:
            taken = [self._free.get() for _ in range(self.per_trial)]
        try:
            yield taken
        finally:
            for gpu in taken:
                self._free.put(gpu)
