"""``distributed.all_reduce_sum`` / ``all_reduce_max`` on a CPU tensor under NCCL: NCCL reduces GPU tensors
only, and GRPO's per-step counts (its loss units, whether any rank still generates) are CPU tensors, so a
multi-GPU GRPO run failed at its first step. Such a tensor is reduced as a copy on the rank's GPU and the
result lands back in it. No NCCL runs here (no GPU): the process group's calls are replaced, which is
what this test checks — the tensor handed to NCCL is the copy, never the CPU tensor itself; the GPU
suite (tests/gpu) runs the real thing."""

from __future__ import annotations

import torch
import torch.distributed as dist

from kubetune import distributed


def _fake_group(monkeypatch, backend: str) -> list[torch.Tensor]:
    reduced: list[torch.Tensor] = []

    def all_reduce(t, op=None):
        reduced.append(t)
        t.mul_(3)  # three ranks with the same value

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda: backend)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(distributed, "_this_gpu", lambda: torch.device("cpu"))  # the copy's device, here
    return reduced


def test_a_cpu_tensor_under_nccl_is_reduced_as_a_copy_and_comes_back(monkeypatch):
    reduced = _fake_group(monkeypatch, "nccl")
    t = torch.tensor([2.0, 5.0])
    assert distributed.all_reduce_sum(t) is t
    assert t.tolist() == [6.0, 15.0]
    assert len(reduced) == 1 and reduced[0] is not t
    u = torch.tensor([1.0])
    distributed.all_reduce_max(u)
    assert u.tolist() == [3.0] and reduced[1] is not u


def test_under_gloo_the_tensor_itself_is_reduced(monkeypatch):
    reduced = _fake_group(monkeypatch, "gloo")
    t = torch.tensor([2.0])
    distributed.all_reduce_sum(t)
    assert reduced == [t] and reduced[0] is t and t.tolist() == [6.0]
