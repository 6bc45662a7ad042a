"""The swapped GEMM: a CPU fp32 linear layer's product computed as ``(W @ x.T).T`` on the row counts where MKL's
``x @ W.T`` is slow (``GEMM_ROWS``). Generic over any ``torch.nn.Linear``: the engine runs every model's forward
under it on a CPU (``swapped_gemm``), and a family's flat forward calls ``swapped_linear`` directly
(``families.llama``). The choice changes the result's last bits, so predict and serve take it the same way."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

import torch

# Rows per forward where, on a CPU, MKL's fp32 GEMM of ``x @ W.T`` (what ``F.linear`` runs) is slow: from 10 to 48
# rows ``(W @ x.T).T`` — the same product, the operands swapped — made the 28M Llama's whole forward 1.1x (10-12
# rows) to 1.3x (15-16 rows) faster on a 2-core Xeon (AVX-512), and no faster or slower at 8 and at 64 rows
# (benchmarks/engine_step.py; benchmarks/README.md "Serving"). 16 is serve's default slot count, so a full decode
# step is there, and so is one with a prompt or two packed in. A fixed range, not a timing taken at start-up: the
# choice changes the result's last bits, and predict and serve must agree.
GEMM_ROWS = (10, 48)
GEMM_MIN_WEIGHT = 1 << 18  # elements: smaller weights cost too little to matter (the tiny test models' all do)


def large_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The linear layers whose product ``swapped_gemm`` may swap: fp32 weights of ``GEMM_MIN_WEIGHT`` elements
    and more (looked at again at each step: a weight may be sharded or cast since)."""
    return [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.numel() >= GEMM_MIN_WEIGHT]


def swapped_linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``, as ``(W @ x.T).T`` for a CPU fp32 weight of ``GEMM_MIN_WEIGHT`` elements and more on
    ``GEMM_ROWS`` rows (decided per call, by this call's own rows), else ``F.linear``."""
    w, rows = layer.weight, x.numel() // x.shape[-1]
    if (
        type(w) is not torch.nn.Parameter
        or w.device.type != "cpu"
        or w.dtype != torch.float32
        or w.numel() < GEMM_MIN_WEIGHT
        or not GEMM_ROWS[0] <= rows <= GEMM_ROWS[1]
    ):
        return torch.nn.functional.linear(x, w, layer.bias)
    out = torch.mm(w, x.reshape(rows, x.shape[-1]).t()).t()
    if layer.bias is not None:
        out = out + layer.bias
    return out.reshape(*x.shape[:-1], w.shape[0])


@contextlib.contextmanager
def swapped_gemm(device: torch.device, linears: list[torch.nn.Linear]) -> Iterator[None]:
    """For a forward on the CPU: ``linears`` compute as ``swapped_linear`` during it (their instances' ``forward``,
    removed after). Not a ``TorchFunctionMode``: a mode sends every torch call of the forward through Python,
    which cost about 1.5 ms of a 13 ms step."""
    if device.type != "cpu":
        yield
        return
    for m in linears:
        setattr(m, "forward", types.MethodType(swapped_linear, m))  # the instance's own forward, deleted after
    try:
        yield
    finally:
        for m in linears:
            del m.forward
