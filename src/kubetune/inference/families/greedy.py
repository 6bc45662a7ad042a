"""The greedy head (``GreedyHead``): a greedy step's tokens from a bf16 screen of the vocabulary, then the fp32
logits of the few candidates it leaves. The head is the largest matrix of a small LLM (58 % of the 28M Llama's
weights), and a CPU decode step mostly waits for weights to arrive from memory: for a step whose every request
is greedy, a bf16 copy of the head (half the bytes) ranks the vocabulary; a bound on its error leaves a few
candidates a row, whose fp32 logits decide. A fast path of a family whose flat forward stops before its head
(``families.base.Family``): the engine screens only there."""

from __future__ import annotations

import functools

import torch

from kubetune.inference import kernels

# The greedy head's screen (``GreedyHead``): a bound on |bf16 product - fp32 product| as a share of |x|·|w|:
# rounding x and w to bf16 (unit roundoff 2^-8 each), the bf16 output's rounding (2^-8), fp32 accumulation
# over the hidden size (under 2^-15 for 512) and the fp32 product's own accumulation; 2^-6 (4 x 2^-8) covers them
# with room for the threshold's own fp32 arithmetic.
SCREEN_BOUND = 2.0**-6
SCREEN_MAX = 64  # candidates per row, on average, beyond which the full head is cheaper


def bf16_matmul() -> bool:
    """Whether this CPU has bf16 matrix instructions (AVX512-BF16 or AMX), where oneDNN's bf16 product is fast.
    (``torch.ops.mkldnn._is_mkldnn_bf16_supported`` also answers yes on AVX-512 cores without them, where it
    converts; the greedy head is unmeasured there.)"""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):
        return False


class GreedyHead:
    """Greedy tokens from a linear head without its full fp32 product on the CPU: the head's largest matrix (a
    32k vocabulary by 512 is 58 % of the 28M Llama's weights) is what a decode step mostly waits for, read from
    memory at every step. A bf16 copy (half the bytes) screens the vocabulary: with ``a`` its product and ``B`` the
    bound on ``|a - z|`` (``SCREEN_BOUND`` x |x| x the largest row norm of the head), every token whose ``a`` is
    below ``max(a) - 2B`` is beaten by the top one, whatever the exact values; the others' fp32 products are
    computed (their weight rows gathered) and the largest wins, the first of equal ones, as ``argmax``. So the
    token is the argmax of fp32 logits: each is its row's dot product in fp32, as the full head's, though not
    bitwise the same sum (a near-tie may break the other way, as between the CPU's two GEMM forms). Why not
    transformers' or torch's: neither has an exact greedy head from a low-precision screen.

    ``tokens`` answers None (the caller runs the full head) where it does not apply: not a CPU fp32 bias-free
    head, a CPU without bf16 matrix hardware, a head below ``GEMM_MIN_WEIGHT`` elements, values not finite, or
    a flat distribution leaving more than ``SCREEN_MAX`` candidates a row on average. The bf16 copy (half the
    head's fp32 size, kept while the engine lives) is remade when the head's weight changes: its storage, its
    version (an in-place update, a training step between two generations) or a sample of its values (a write
    through ``.data``, which leaves the version as it was)."""

    def __init__(self, enabled: bool | None = None):
        self.enabled = bf16_matmul() if enabled is None else enabled
        self._key: tuple | None = None
        self._sample: torch.Tensor | None = None
        self._low: torch.Tensor | None = None
        self._norm = 0.0

    def fits(self, head) -> bool:
        """Whether ``tokens`` may screen ``head``: enabled, and a bias-free CPU fp32 linear layer of
        ``GEMM_MIN_WEIGHT`` elements and more."""
        w = getattr(head, "weight", None)
        return (
            self.enabled
            and type(head) is torch.nn.Linear
            and head.bias is None
            and type(w) is torch.nn.Parameter
            and w.device.type == "cpu"
            and w.dtype == torch.float32
            and w.numel() >= kernels.GEMM_MIN_WEIGHT
        )

    def tokens(self, head: torch.nn.Linear, hidden: torch.Tensor) -> list[int] | None:
        """The argmax token of each row of ``head(hidden)`` (``hidden``: [..., hidden size]), or None where the
        screen does not apply (see the class)."""
        if not self.fits(head):
            return None
        w = head.weight.detach()
        h = hidden.reshape(-1, hidden.shape[-1])
        found = self.candidates(w, h)
        if found is None:
            return None
        v, r = found
        z = (w[v] * h[r]).sum(-1)  # the candidates' fp32 logits
        best = torch.full((h.shape[0],), float("-inf")).scatter_reduce(0, r, z, "amax")
        at = z == best[r]
        tokens = torch.full((h.shape[0],), w.shape[0]).scatter_reduce(0, r[at], v[at], "amin").tolist()
        return None if w.shape[0] in tokens else tokens  # a row whose candidates' logits all overflowed to NaN

    def candidates(self, w: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (token, row) pairs whose bf16 logit (of ``w`` [vocabulary, hidden] and ``h`` [rows, hidden]) is at
        least its row's largest less twice the bound: the tokens that may be the row's fp32 argmax. None: too
        many, or values not finite."""
        self._refresh(w)
        rows, vocabulary = h.shape[0], w.shape[0]
        # the bf16 product, [vocabulary, rows], seen as [groups, classes]: class c holds the tokens v = g x width + c
        # // rows of row c % rows. Why: torch's CPU reductions over a matrix's first dimension are fast only for wide
        # rows (the max of [32000, 16] took 0.3-0.5 ms; of the same values as [250, 2048], then [128, 16], 0.09; a
        # 32k vocabulary runs as [256, 2000], then [125, 16]) and the candidates are found from each class's
        # largest value (0.15 ms against 0.6 for a compare and ``nonzero`` of all)
        groups = self._groups(vocabulary)
        low = self._low
        assert low is not None  # made by ``_refresh``
        a = torch.mm(low, h.to(torch.bfloat16).t()).view(groups, -1)
        best_of_class = a.amax(0)
        top = best_of_class.view(-1, rows).amax(0).float()
        floor = top - 2 * SCREEN_BOUND * self._norm * torch.linalg.vector_norm(h, dim=1)
        if not bool(torch.isfinite(floor).all()):
            return None
        floors = floor.repeat(vocabulary // groups)  # each class's row's floor
        classes = (best_of_class >= floors).nonzero()[:, 0]
        g, k = (a[:, classes] >= floors[classes]).nonzero(as_tuple=True)
        if g.numel() > SCREEN_MAX * rows:
            return None
        flat = g * a.shape[1] + classes[k]
        return flat // rows, flat % rows

    def _refresh(self, w: torch.Tensor) -> None:
        """The bf16 copy and the largest row norm of ``w``, remade if ``w`` is not the weight they were made from."""
        try:
            version = w._version
        except RuntimeError:  # a tensor made under ``torch.inference_mode`` has no version counter
            version = None
        key = (w.data_ptr(), version, tuple(w.shape))
        flat = w.reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)]  # about 4,096 values: a few microseconds to compare
        if key != self._key or self._sample is None or not torch.equal(sample, self._sample):
            self._low, self._norm = w.to(torch.bfloat16), float(torch.linalg.vector_norm(w, dim=1).max())
            self._key, self._sample = key, sample.clone()

    @staticmethod
    @functools.cache
    def _groups(vocabulary: int) -> int:
        """The largest divisor of ``vocabulary`` up to 256 (256 for 32,000 and for 128,256; 128 for 151,936)."""
        return max(d for d in range(1, 257) if vocabulary % d == 0)
