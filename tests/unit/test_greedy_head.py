"""The greedy head (``inference.families.greedy.GreedyHead``): a bf16 screen of the vocabulary, then the fp32 logits of the
candidates, gives the argmax of the fp32 logits — also where bf16 cannot tell the top two apart — and steps
aside (None) where it cannot be sure cheaply. Forced on here: on a CPU without bf16 matrix hardware it is off
in the engine, but its arithmetic is the same."""

from __future__ import annotations

import pytest
import torch

from kubetune.inference.families.greedy import GreedyHead
from kubetune.inference.kernels import GEMM_MIN_WEIGHT


def _head(vocabulary: int, hidden: int = 64, seed: int = 0) -> torch.nn.Linear:
    head = torch.nn.Linear(hidden, vocabulary, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocabulary, hidden, generator=torch.Generator().manual_seed(seed)) * 0.02)
    return head


def _hidden(rows: int, hidden: int = 64, seed: int = 1) -> torch.Tensor:
    h = torch.randn(1, rows, hidden, generator=torch.Generator().manual_seed(seed))
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True))  # as after a final RMSNorm


@pytest.mark.parametrize("vocabulary", [5000, 4099], ids=["250-groups", "prime-1-group"])
@pytest.mark.parametrize("rows", [1, 16, 28])
def test_the_greedy_head_gives_the_argmax_of_the_fp32_logits(vocabulary, rows):
    head, h = _head(vocabulary), _hidden(rows)
    assert head.weight.numel() >= GEMM_MIN_WEIGHT
    with torch.no_grad():
        got = GreedyHead(enabled=True).tokens(head, h)
        assert got == head(h)[0].argmax(-1).tolist()


def test_a_tie_in_bf16_is_settled_by_the_fp32_logits():
    """Tokens 7 and 4000 have the same weights in bf16 (so the same bf16 logit, and 7 would win an argmax of the
    bf16 product, as the first), while 4000's fp32 weights lean further towards the hidden state: 4000 wins, as in
    the full fp32 head."""
    head, h = _head(5000), _hidden(1)
    with torch.no_grad():
        top = (h[0, 0] / h[0, 0].norm() * 3).to(torch.bfloat16).float()  # exactly representable in bf16
        head.weight[7] = top
        head.weight[4000] = top + top.abs() * 2.0**-12 * torch.sign(h[0, 0])
        assert torch.equal(head.weight[7].to(torch.bfloat16), head.weight[4000].to(torch.bfloat16))
        full = head(h)[0, 0]
        assert full[4000] > full[7] and int(full.argmax()) == 4000
        assert GreedyHead(enabled=True).tokens(head, h) == [4000]


def test_where_bf16_ranks_the_tokens_wrongly_the_screen_still_gives_the_fp32_argmax():
    """40 tokens whose weights are within bf16's rounding of one another's: the bf16 product ranks them wrongly
    (its argmax is another token), and the screen's bound keeps the fp32 winner among the candidates."""
    g = torch.Generator().manual_seed(0)
    head, h = _head(5000), torch.randn(1, 1, 64, generator=g)
    with torch.no_grad():
        head.weight.copy_(torch.randn(5000, 64, generator=g) * 0.02)
        top = (h[0, 0] / h[0, 0].norm() * 3).to(torch.bfloat16).float()
        near = torch.randperm(5000, generator=g)[:40]
        head.weight[near] = top + torch.randn(40, 64, generator=g) * top.abs() * 2.0**-8
        full = int(head(h)[0, 0].argmax())
        bf16 = torch.nn.functional.linear(h.to(torch.bfloat16), head.weight.to(torch.bfloat16))[0, 0]
        assert int(bf16.float().argmax()) != full
        assert GreedyHead(enabled=True).tokens(head, h) == [full]


def test_the_greedy_head_steps_aside_where_it_cannot_be_sure_cheaply():
    screen = GreedyHead(enabled=True)
    flat = _head(5000)
    with torch.no_grad():
        flat.weight.copy_(flat.weight[:1].expand_as(flat.weight))  # every token's logit the same: all candidates
        assert screen.tokens(flat, _hidden(4)) is None
        h = _hidden(4)
        h[0, 2, 5] = float("inf")
        assert screen.tokens(_head(5000), h) is None
    assert not GreedyHead(enabled=False).fits(_head(5000))
    assert not screen.fits(torch.nn.Linear(64, 5000))  # a bias
    assert not screen.fits(_head(5000).to(torch.bfloat16))
    assert not screen.fits(_head(100))  # too small to matter


def test_the_bf16_copy_follows_the_weights_when_they_change():
    """A training step between two generations changes the head in place: the screen's copy is remade."""
    head, h, screen = _head(5000), _hidden(8), GreedyHead(enabled=True)
    with torch.no_grad():
        before = screen.tokens(head, h)
        head.weight.copy_(_head(5000, seed=3).weight)
        after = screen.tokens(head, h)
        assert after == head(h)[0].argmax(-1).tolist() and after != before
        head.weight.data.copy_(_head(5000, seed=4).weight)  # through ``.data``: the version stays as it was
        assert screen.tokens(head, h) == head(h)[0].argmax(-1).tolist() != after


def test_a_head_made_under_inference_mode_is_screened_too():
    """Inference tensors have no version counter (reading it raises): the copy is keyed without it."""
    with torch.inference_mode():
        head, h = _head(5000), _hidden(4)
        assert GreedyHead(enabled=True).tokens(head, h) == head(h)[0].argmax(-1).tolist()


@pytest.mark.parametrize("vocabulary", [5000, 4099], ids=["250-groups", "prime-1-group"])
@pytest.mark.parametrize("rows", [1, 16, 28])
def test_the_candidates_are_every_token_within_twice_the_bound_of_its_rows_top(vocabulary, rows):
    """The grouped search (class maxima, then their groups) finds exactly the pairs a plain compare of the whole
    bf16 product finds."""
    from kubetune.inference.families.greedy import SCREEN_BOUND

    head, h = _head(vocabulary, seed=rows), _hidden(rows)[0]
    w = head.weight.detach()
    v, r = GreedyHead(enabled=True).candidates(w, h)
    a = torch.mm(w.to(torch.bfloat16), h.to(torch.bfloat16).t())  # [vocabulary, rows]
    floor = a.amax(0).float() - 2 * SCREEN_BOUND * float(w.norm(dim=1).max()) * h.norm(dim=1)
    want = {(int(i), int(j)) for i, j in (a >= floor).nonzero()}
    assert {(int(i), int(j)) for i, j in zip(v, r)} == want
    assert {j for _, j in want} == set(range(rows))  # every row has its top


@pytest.mark.parametrize("hidden", [64, 512, 4096])
def test_the_bound_holds_where_the_products_terms_cancel(hidden):
    """|bf16 logit - fp32 logit| <= SCREEN_BOUND x |h| x |w| — the screen's premise — on rows built to make the
    bf16 rounding count: a large component orthogonal to the hidden state (its terms cancel, so the logit is small
    against |h| |w|) plus a small one along it, and on plain random rows."""
    from kubetune.inference.families.greedy import SCREEN_BOUND

    g = torch.Generator().manual_seed(hidden)
    h = torch.randn(8, hidden, generator=g)
    plain = torch.randn(2000, hidden, generator=g)
    ortho = torch.randn(2000, hidden, generator=g) * 100
    d = h[0] / h[0].norm()
    ortho = ortho - (ortho @ d)[:, None] * d + d * torch.rand(2000, 1, generator=g)
    for w in (plain, ortho):
        a = torch.mm(w.to(torch.bfloat16), h.to(torch.bfloat16).t()).float()
        z = torch.mm(w.double(), h.double().t())
        share = ((a - z).abs() / (w.norm(dim=1)[:, None] * h.norm(dim=1)[None, :]).double()).max()
        print(f"hidden {hidden}: largest |bf16 - exact| is {float(share) / SCREEN_BOUND:.1%} of the bound")
        assert 0 < share <= SCREEN_BOUND / 2  # half the bound: room for the fp32 side's own rounding


def test_a_row_whose_candidates_have_no_finite_logit_steps_aside(monkeypatch):
    """Every candidate's fp32 logit NaN (a weight row of NaN the screen let through): None, not the placeholder
    token past the vocabulary that the next step would embed."""
    head, h = _head(5000), _hidden(2)
    with torch.no_grad():
        head.weight[9] = float("nan")
    monkeypatch.setattr(GreedyHead, "candidates", lambda self, w, h: (torch.tensor([9, 3]), torch.tensor([0, 1])))
    assert GreedyHead(enabled=True).tokens(head, h) is None
