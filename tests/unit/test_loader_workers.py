"""How many data-loader worker processes a run gets (``training.build._workers``). An online task (GRPO)
gets none whatever the spec says: its prompt batches carry the live rollouts (the model and its
generation engine), and a worker process pickled a copy of them back to the trainer — on CUDA the first
GPU run failed there, on a CPU the run hung before its first step."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kubetune.training.build import _workers

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _cfg(workers):
    return SimpleNamespace(dataloader_workers=workers)


def test_offline_tasks_get_the_spec_or_the_device_default():
    offline = SimpleNamespace(online=None)
    assert _workers(_cfg(None), offline, CPU) == 0
    assert _workers(_cfg(None), offline, CUDA) == 2
    assert _workers(_cfg(3), offline, CPU) == 3


def test_an_online_task_gets_none_whatever_the_spec_says(caplog):
    online = SimpleNamespace(online=object())
    assert _workers(_cfg(None), online, CUDA) == 0
    with caplog.at_level("INFO", logger="kubetune.training.build"):
        assert _workers(_cfg(2), online, CPU) == 0
    assert "training.dataloader_workers=2: not used by an online task" in caplog.text
