"""training.compile under FSDP2 (issue 65; refused before it): two real gloo processes shard the shipped tiny
Llama one unit per block, as ``FSDPStrategy`` does, and compile every block in place as the trainer does
(``compile_blocks``, backend aot_eager as in tests/unit/test_causal_data.py: the graph capture around FSDP2's
hooks is what is tested, inductor's code generation is torch's). Over three optimizer steps of packed rows of
different lengths, with two micro-batches each, the compiled run's losses equal eager FSDP's within 1e-5."""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [pytest.mark.integration, pytest.mark.e2e]  # two processes compiling: ~40 s
ROOT = Path(__file__).resolve().parents[2]
TINY_LLAMA = ROOT / "src" / "kubetune" / "assets" / "tiny-llama"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny(where: torch.device) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    from kubetune.tasks import attention

    torch.manual_seed(0)
    with torch.device(where):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(TINY_LLAMA), attn_implementation=attention.register(), dtype=torch.float32
        )
    model.config.use_cache = False
    return model


def _steps(rank: int) -> list[list]:
    """Three steps of two packed micro-batches each, of different lengths per step and per rank."""
    from kubetune.data import Batch

    g = torch.Generator().manual_seed(10 + rank)
    steps = []
    for lengths in ((20, 13, 9), (31, 7), (11, 16, 5, 8)):
        micro = []
        for _ in range(2):
            docs = [torch.randint(1, 500, (n,), generator=g) for n in lengths]
            ids = torch.cat(docs)[None]
            positions = torch.cat([torch.arange(n) for n in lengths])[None]
            labels = torch.cat([torch.cat([torch.tensor([-100]), d[1:]]) for d in docs])[None]
            micro.append(Batch({"input_ids": ids, "position_ids": positions}, labels))
        steps.append(micro)
    return steps


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from kubetune.distributed import DistEnv
    from kubetune.tasks.causal_lm import task as causal_lm
    from kubetune.training import runtime, strategy

    env = DistEnv(rank=rank, local_rank=rank, world_size=2, local_world_size=2)
    losses: dict[str, list[float]] = {}
    for mode in ("eager", "compiled"):
        torch._dynamo.reset()
        s = strategy.FSDPStrategy(env, torch.device("cpu"), torch.float32)
        model = s.build(_tiny)
        if mode == "compiled":  # after sharding, in place, as build._model does
            assert runtime.compile_blocks(model, backend="aot_eager") == 2
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[mode] = []
        for micro in _steps(rank):
            total = 0.0
            for i, batch in enumerate(micro):
                with s.no_sync(last=i == len(micro) - 1):
                    result = causal_lm.loss(model, batch, contextlib.nullcontext())
                    (result.loss_sum / result.units).backward()
                    total += float(result.loss_sum.detach() / result.units)
            s.clip(1.0)
            optimizer.step()
            optimizer.zero_grad()
            losses[mode].append(total)
    torch.save(losses, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()
    os._exit(0)  # as kubetune's worker leaves (worker._exit_now): no finalization racing gloo's threads


def test_compiled_blocks_under_fsdp2_train_like_eager_fsdp(tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        losses = torch.load(tmp_path / f"rank{rank}.pt")
        assert len(losses["eager"]) == 3
        print(f"rank {rank}: eager {losses['eager']}, compiled {losses['compiled']}")
        worst = max(abs(a - b) for a, b in zip(losses["eager"], losses["compiled"]))
        assert worst < 1e-5, (worst, losses)
        assert losses["eager"][0] != losses["eager"][2]  # the weights moved: the later steps ran on updated shards
