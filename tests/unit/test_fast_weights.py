"""bf16 compute weights on one GPU (``training.fast_path.bf16_weights``, issue 65): which strategy
``distributed.strategy: auto`` picks for a one-process run (a pure function of the spec, the world size, the
device type and the precision), and FSDP2 on a world of one, run on the CPU: bf16 weights in the forward, fp32
weights and optimizer state, a DCP checkpoint that resumes bit-identically. training.compile under fsdp is no
longer refused (its equality with eager FSDP: tests/integration/test_fast_weights_compile.py)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from kubetune.config import parse_spec
from kubetune.data import Batch
from kubetune.distributed import DistEnv
from kubetune.tasks.causal_lm import task as causal_lm
from kubetune.training import strategy

ROOT = Path(__file__).resolve().parents[2]
TINY_LLAMA = ROOT / "src" / "kubetune" / "assets" / "tiny-llama"
BF16, FP32, FP16 = torch.bfloat16, torch.float32, torch.float16
REWARD = [{"function": "regex", "pattern": "x"}]


def _spec(task: str = "causal-lm", **over) -> object:
    spec = {
        "name": "s",
        "task": task,
        "model": {"uri": str(TINY_LLAMA)},
        "data": {"train": "train.jsonl"},
        "output": {"uri": "runs/s"},
    }
    for key, value in over.items():
        section, _, name = key.partition("__")
        if section == "fast_path":
            spec.setdefault("training", {}).setdefault("fast_path", {})[name] = value
        else:
            spec.setdefault(section, {})[name] = value
    return parse_spec(spec)


@pytest.mark.parametrize(
    "spec, world, device, dtype, chosen, why",
    [
        (_spec(), 1, "cuda", BF16, True, "bf16 compute weights, fp32 master weights"),
        (_spec(lora__r=4), 1, "cuda", BF16, True, "bf16 compute weights"),
        (_spec(training__compile=True), 1, "cuda", BF16, True, "bf16 compute weights"),
        (_spec(), 1, "cpu", BF16, False, "fp32 weights on cpu"),
        (_spec(), 1, "cuda", FP32, False, "precision float32"),
        (_spec(), 1, "cuda", FP16, False, "precision float16"),
        (_spec(), 2, "cuda", BF16, False, "2 processes"),
        (_spec(fast_path__bf16_weights=False), 1, "cuda", BF16, False, "bf16_weights is false"),
        (_spec(distributed__strategy="ddp"), 1, "cuda", BF16, False, "distributed.strategy is ddp"),
        (_spec(lora__r=4, lora__quantization="4bit"), 1, "cuda", BF16, False, "QLoRA"),
        (_spec("kto"), 1, "cuda", BF16, False, "task kto's full fine-tune keeps a whole frozen copy"),
        (_spec("kto", lora__r=4), 1, "cuda", BF16, True, "bf16 compute weights"),
        (
            _spec("grpo", grpo__reference_copy=True, grpo__beta=0.1, grpo__rewards=REWARD),
            1,
            "cuda",
            BF16,
            False,
            "grpo",
        ),
        (_spec("grpo", grpo__rewards=REWARD), 1, "cuda", BF16, True, "bf16 compute weights"),
        (_spec(evaluation__tasks=["hellaswag"], evaluation__every=5), 1, "cuda", BF16, False, "evaluation.every"),
    ],
)
def test_one_process_fsdp_is_chosen_for_bf16_on_one_gpu_only(spec, world, device, dtype, chosen, why):
    got, reason = strategy.one_process_fsdp(spec, world, device, dtype)
    assert (got, why in reason) == (chosen, True), reason


def test_auto_on_one_process_says_what_it_chose_and_why(caplog):
    """The strategy objects are built without touching the device, so a CUDA device can be named here."""
    one = DistEnv()
    cuda = torch.device("cuda", 0)
    with caplog.at_level(logging.INFO, logger="kubetune.training.strategy"):
        picked = strategy.for_job(_spec(), one, cuda, BF16, lambda where: None)
    assert picked.name == "fsdp" and isinstance(picked, strategy.FSDPStrategy) and picked.mixed_precision
    assert "distributed.strategy auto: fsdp on one process (training.fast_path.bf16_weights" in caplog.text
    assert strategy.for_job(_spec(), one, torch.device("cpu"), BF16, lambda where: None).name == "ddp"
    assert strategy.for_job(_spec(), one, cuda, FP32, lambda where: None).name == "ddp"
    # a checkpoint resumes with the strategy that wrote it, whatever the fast path says
    assert strategy.for_job(_spec(), one, cuda, BF16, lambda where: None, resumed="ddp").name == "ddp"


def test_compile_under_fsdp_validates():
    """Refused before issue 65 ("training.compile under distributed.strategy fsdp is not supported yet")."""
    spec = _spec(distributed__strategy="fsdp", training__compile=True)
    assert spec.training.compile and spec.distributed.strategy == "fsdp"
    env = DistEnv(rank=0, world_size=2, local_rank=0, local_world_size=2)
    assert strategy.for_job(spec, env, torch.device("cpu"), FP32, lambda where: None).name == "fsdp"


def _tiny(where: torch.device) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(where):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_LLAMA), dtype=torch.float32)
    model.config.use_cache = False
    return model


def _batches(n: int) -> list[Batch]:
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 500, (2, 24), generator=g) for _ in range(n)]
    return [Batch({"input_ids": i, "attention_mask": torch.ones_like(i)}, i.clone()) for i in ids]


def _train(steps: list[Batch], resume: Path | None = None, save: Path | None = None, mixed: bool = True) -> dict:
    """FSDP2 on this process alone (a world of one) in bf16 over ``steps``: the losses, the weights' dtypes seen
    by a Linear in the forward and of the optimizer state, and the final full weights."""
    s = strategy.FSDPStrategy(DistEnv(), torch.device("cpu"), BF16, mixed_precision=mixed)
    model = s.build(_tiny)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    seen: set[torch.dtype] = set()
    linear = model.model.layers[0].mlp.down_proj
    hook = linear.register_forward_pre_hook(lambda m, args: seen.add(m.weight.dtype))
    if resume is not None:
        s.load(resume, {"sharded": "dcp"}, optimizer)
    losses = []
    for batch in steps:
        out = causal_lm.loss(model, batch, contextlib.nullcontext())
        (out.loss_sum / out.units).backward()
        s.clip(1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float((out.loss_sum / out.units).detach()))
    if save is not None:
        s.save(save, optimizer)
    hook.remove()
    state = {v.dtype for st in optimizer.state.values() for k, v in st.items() if k != "step"}
    weights = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "forward": seen, "state": state, "weights": weights}


@pytest.fixture
def world_of_one():
    """FSDPStrategy.build joins a process group of one; the worker's teardown destroys it, here this fixture."""
    assert not dist.is_initialized()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.e2e  # five FSDP builds and a DCP round trip: 10-26 s on a shared 2-core CPU
def test_fsdp_on_a_world_of_one_computes_in_bf16_keeps_fp32_and_resumes_bit_identically(tmp_path, world_of_one):
    steps = _batches(4)
    whole = _train(steps)
    assert dist.is_initialized() and dist.get_world_size() == 1  # the group build() made
    assert whole["forward"] == {BF16}  # the Linear computes with bf16 weights...
    assert whole["state"] == {FP32} and {w.dtype for w in whole["weights"].values()} == {FP32}  # ...fp32 masters
    first = _train(steps[:2], save=tmp_path)
    rest = _train(steps[2:], resume=tmp_path)
    assert first["losses"] + rest["losses"] == whole["losses"]
    assert max((whole["weights"][k] - rest["weights"][k]).abs().max().item() for k in whole["weights"]) == 0.0
    plain = _train(steps, mixed=False)  # fp32 weights: the same losses within bf16's rounding, not bit-equal
    assert plain["forward"] == {FP32} and plain["losses"] != whole["losses"]
    assert max(abs(a - b) for a, b in zip(plain["losses"], whole["losses"])) < 0.02 * plain["losses"][0]
