"""A packed training step makes no device->host sync (issue 65): the collate builds the packed row's attention
layout and the loss's targets on the host (``Batch.layout``, ``Batch.targets``), and with them the forward and
backward run no operation that would read a count or a value back from a GPU. Counted on the CPU with a
dispatch mode that records the aten operations which sync on a GPU; the same step without the host-built
pieces (a batch built elsewhere) still syncs, and both give the same loss and gradients, bit for bit: packed
and padded causal-LM batches, and DPO's pairs. The flash variable-length path's argument adaptation across
torch versions is checked with a stand-in for the CUDA kernel (``tests/gpu/test_fast_path_attention.py`` runs
the real one)."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from kubetune.data import Batch
from kubetune.tasks import attention
from kubetune.tasks.causal_lm import task as causal_lm
from kubetune.tasks.causal_lm.data import collate
from kubetune.tasks.common import IGNORE, Targets, label_targets, next_token_targets
from kubetune.tasks.logprobs import sequence_logps
from kubetune.tasks.pair_batches import PairCollate

aten = torch.ops.aten
# Operations that read something back from a CUDA device before they can return (or that a boolean index
# turns into a nonzero, which does): the host then waits for every kernel queued before them.
ALWAYS = {
    aten._local_scalar_dense.default,  # .item(), int(t), bool(t)
    aten.is_nonzero.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.masked_scatter.default,
    aten.equal.default,
    aten._unique2.default,
}


def _syncs(func, args, kwargs) -> bool:
    if func in ALWAYS:
        return True
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
    if func is aten.repeat_interleave.Tensor or func is aten.repeat_interleave.self_Tensor:
        return kwargs.get("output_size") is None
    return False


class SyncCounter(TorchDispatchMode):
    """Records the aten operations run inside it that would sync a GPU."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _syncs(func, args, kwargs):
            self.seen.append(str(func))
        return func(*args, **kwargs)


class Rows:
    """A tokenized dataset's columns, indexed by a list of row ids as a datasets.Dataset is."""

    def __init__(self, **columns):
        self.columns = columns

    def __getitem__(self, rows):
        return {k: [v[i] for i in rows] for k, v in self.columns.items()}


LENGTHS = (13, 3, 29, 7, 1, 18, 11)  # more documents than attention.GROUPS, one of a single token


def _data(vocab: int = 97) -> Rows:
    gen = torch.Generator().manual_seed(5)
    ids = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in LENGTHS]
    # a prompt of a few tokens without a loss in some rows, as a chat's prompt
    labels = [[IGNORE] * min(k, len(s) - 1) + s[min(k, len(s) - 1) :] for k, s in enumerate(ids)]
    return Rows(input_ids=ids, labels=labels)


def _model(checkpointing: bool = False, flash: bool = True):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attention.register(flash=flash))
    model.config.use_cache = False
    if checkpointing:  # the recomputed layers must get the layout too
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _withheld(batch: Batch) -> Batch:
    """The batch as one built elsewhere: no host-built layout or targets."""
    return dataclasses.replace(batch, layout=None, targets=None)


def _step(model, batch: Batch, counter: SyncCounter | None = None):
    model.zero_grad()
    with counter or contextlib.nullcontext():
        loss_sum, count, _ = causal_lm.loss(model, batch, contextlib.nullcontext())
        (loss_sum / count).backward()
    return (loss_sum / count).detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def _same(a, b) -> None:
    (loss_a, ga), (loss_b, gb) = a, b
    assert torch.equal(loss_a, loss_b)
    assert all(torch.equal(ga[k], gb[k]) for k in ga), [k for k in ga if not torch.equal(ga[k], gb[k])]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_packed_training_step_makes_no_sync_with_the_host_layout(checkpointing):
    """Forward and backward of a packed row: 0 syncing operations with the collate's layout and targets, also
    where checkpointed layers are recomputed; the same batch without them syncs (in every layer's attention:
    its lengths, its boolean selections, and in the loss's label mask), with the same loss and gradients."""
    model = _model(checkpointing)
    batch = collate(_data(), np.arange(len(LENGTHS)), pad_id=0, packing=True)
    assert batch.layout is not None and batch.targets is not None
    fast, slow = SyncCounter(), SyncCounter()
    new = _step(model, batch, fast)
    old = _step(model, _withheld(batch), slow)
    print(f"syncing ops in a packed step: {len(fast.seen)} with the host layout, {len(slow.seen)} without")
    assert fast.seen == []
    assert len(slow.seen) >= model.config.num_hidden_layers, slow.seen  # at least one per layer
    _same(new, old)


def test_a_padded_step_and_dpo_pairs_select_their_targets_without_a_sync():
    """Padded causal-LM rows and DPO's pairs carry host-built targets: the loss's own selections make no sync
    (transformers' padding mask may still read the mask back: not counted here, the attention is the model's),
    and the loss and gradients equal those of the label mask's boolean selection, bit for bit."""
    model = _model()
    data = _data()
    padded = collate(data, np.arange(len(LENGTHS)), pad_id=0, packing=False)
    assert padded.layout is None and padded.targets is not None
    _same(_step(model, padded), _step(model, _withheld(padded)))

    pairs = Rows(
        prompt_ids=[s[:3] for s in data.columns["input_ids"]],
        chosen_ids=[s[3:] + [5] for s in data.columns["input_ids"]],
        rejected_ids=[[7, 8] + s[:4] for s in data.columns["input_ids"]],
    )
    batch = PairCollate(pairs, pad_id=0, max_length=24, settings=None)(np.arange(4))
    assert batch.targets is not None
    results = []
    for b in (batch, _withheld(batch)):
        model.zero_grad()
        chosen, rejected = sequence_logps(model, b, contextlib.nullcontext()).chunk(2)
        F.logsigmoid(chosen - rejected).mean().backward()
        results.append(
            (torch.cat([chosen, rejected]).detach(), {k: p.grad.clone() for k, p in model.named_parameters()})
        )
    _same(*results)


def test_label_targets_are_the_label_masks_selection():
    """The targets' indices select what the boolean label mask selects, in its order, for rows of any width."""
    labels = torch.tensor([[IGNORE, 4, 5, IGNORE, 6], [7, IGNORE, IGNORE, 8, 9], [IGNORE] * 5])
    mask, chosen, keep = next_token_targets(labels)
    t = label_targets(labels)
    states = torch.arange(labels.numel()).view(*labels.shape, 1)
    assert t.ids.tolist() == chosen.tolist() == [4, 5, 6, 8, 9]
    assert torch.equal(states.flatten(0, 1)[t.positions], states[keep])
    assert t.slots.tolist() == mask.flatten().nonzero().flatten().tolist() and int(t.count) == 5
    assert label_targets(torch.tensor([[3]])).positions.numel() == 0  # one position predicts nothing


def test_the_host_layout_moves_and_pickles_with_its_batch_and_a_replaced_input_drops_it():
    """DataLoader workers pickle a batch and pin it; the layout and the targets travel with it and keep referring
    to the batch's own position ids and labels; a batch whose labels are replaced (ORPO scores every token)
    falls back to its own labels' targets, and a model whose attention is not kubetune's gets no layout."""
    from kubetune.tasks.common import batch_targets

    batch = collate(_data(), np.arange(len(LENGTHS)), pad_id=0, packing=True)
    back = pickle.loads(pickle.dumps(batch))
    assert back.layout.position_ids is back.inputs["position_ids"] and back.targets.labels is back.labels
    moved = batch._map(lambda t: t.clone())  # what pin_memory and to(device) do, tensor by tensor
    assert moved.layout.position_ids is moved.inputs["position_ids"] and moved.targets.labels is moved.labels
    assert moved.layout.cu_seqlens.dtype == torch.int32 and moved.layout.max_length == max(LENGTHS)
    assert moved.layout.cu_seqlens.tolist() == np.cumsum((0, *LENGTHS)).tolist()
    assert isinstance(batch_targets(moved), Targets) and batch_targets(moved) is moved.targets
    every = torch.where(batch.labels == IGNORE, batch.inputs["input_ids"], batch.labels)
    replaced = dataclasses.replace(batch, labels=every)
    assert batch_targets(replaced) is not batch.targets and int(batch_targets(replaced).count) > int(
        batch.targets.count
    )
    model = _model()
    given = attention.layout_kwargs(model, batch.layout, batch.inputs["position_ids"])
    assert given[attention.LAYOUT_KWARG] is batch.layout and given["attention_mask"].shape == (1, 1, 0, 0)
    assert attention.layout_kwargs(model, batch.layout, batch.inputs["position_ids"].clone()) == {}
    model.config._attn_implementation = "sdpa"
    assert attention.layout_kwargs(model, batch.layout, batch.inputs["position_ids"]) == {}


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
    """A stand-in for the CUDA kernel: causal SDPA document by document over (tokens, heads, dim)."""
    assert cu_q.dtype == torch.int32 and max_q == max_k == max(LENGTHS) and cu_q is cu_k
    outs = []
    for a, b in zip(cu_q.tolist(), cu_q[1:].tolist()):
        qd, kd, vd = (t[a:b].transpose(0, 1) for t in (q, k, v))
        if kd.shape[0] != qd.shape[0]:
            kd, vd = (t.repeat_interleave(qd.shape[0] // t.shape[0], dim=0) for t in (kd, vd))
        outs.append(
            F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=kwargs.get("scale")).transpose(0, 1)
        )
    return torch.cat(outs)


def _varlen_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                 window_size=(-1, -1), enable_gqa=False):  # fmt: skip
    assert window_size == (-1, 0)
    assert enable_gqa == (key.shape[1] != query.shape[1])
    return _reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale)


def _varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    assert is_causal and key.shape[1] == query.shape[1]  # no GQA: the kv heads come repeated
    return _reference_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k)


@pytest.mark.parametrize("kernel", [_varlen_2_13, _varlen_2_10])
def test_the_flash_path_adapts_to_each_varlen_signature(kernel, monkeypatch):
    """Where flash's varlen kernel runs (CUDA, half precision; here a stand-in on the CPU), packed attention calls
    it with the host-built cumulative lengths and the causal and GQA arguments its signature takes, and the
    forward equals the gather path's; with training.fast_path.flash_attention off it is never called."""
    import torch.nn.attention.varlen as varlen

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    counted.__signature__ = inspect.signature(kernel)  # type: ignore[attr-defined]  # what _varlen inspects
    monkeypatch.setattr(varlen, "varlen_attn", counted)
    attention._varlen.cache_clear()
    monkeypatch.setattr(attention, "_half_dtype", lambda q: q.dtype)  # fp32 stands in for bf16 on the CPU
    monkeypatch.setattr(attention, "_FLASH_DEVICES", ("cpu",))
    batch = collate(_data(), np.arange(len(LENGTHS)), pad_id=0, packing=True)
    outs = {}
    try:
        for flash in (True, False):
            model = _model(flash=flash).eval()
            with torch.no_grad():
                outs[flash] = model(
                    **batch.inputs, **attention.layout_kwargs(model, batch.layout, batch.inputs["position_ids"])
                ).logits
    finally:
        monkeypatch.undo()
        attention._varlen.cache_clear()
    assert len(calls) == 3  # every layer, with flash on only
    assert torch.allclose(outs[True], outs[False], atol=1e-5)
