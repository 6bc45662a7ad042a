"""Baseline (a): the seed 001 training loop, as written there: every text padded to 128 tokens,
fp32, DistributedSampler + plain DDP, AdamW with a linear schedule. Run under torchrun:

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/seed_loop.py --train T --eval E --out R.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Result, model_path  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--eval", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=32, help="global batch")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--eval-every", type=int, default=15)
    args = ap.parse_args()

    from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(42)
    path = model_path()
    tok = AutoTokenizer.from_pretrained(path)
    train, evald = pd.read_csv(args.train), pd.read_csv(args.eval)

    def encode(df):
        enc = tok(df["text"].tolist(), padding="max_length", truncation=True, max_length=128, return_tensors="pt")
        return TensorDataset(enc["input_ids"], enc["attention_mask"], torch.tensor(df["label"].to_numpy()))

    train_ds, eval_ds = encode(train), encode(evald)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=3)
    ddp = DDP(model)
    per_rank = args.batch // world
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=42)
    loader = DataLoader(train_ds, batch_size=per_rank, sampler=sampler)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    steps = len(loader)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.06 * steps), steps)
    res = Result(system="seed-loop (pad 128, fp32, DDP)", world_size=world, threads=torch.get_num_threads())

    def evaluate() -> float:
        model.eval()
        correct = 0
        with torch.no_grad():
            for ids, mask, labels in DataLoader(eval_ds, batch_size=64):
                correct += (model(input_ids=ids, attention_mask=mask).logits.argmax(-1) == labels).sum().item()
        model.train()
        return correct / len(eval_ds)

    train_s, samples, real, padded, lengths = 0.0, 0, 0, 0, []
    ddp.train()
    sampler.set_epoch(0)
    t0 = time.perf_counter()
    for step, (ids, mask, labels) in enumerate(loader, 1):
        loss = ddp(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        samples += len(labels) * world
        real += int(mask.sum())
        padded += mask.numel()
        lengths += mask.sum(1).tolist()
        if step % args.eval_every == 0 or step == steps:
            train_s += time.perf_counter() - t0
            if rank == 0:
                res.evals.append({"train_s": train_s, "samples": samples, "accuracy": evaluate()})
            dist.barrier()
            t0 = time.perf_counter()
    counts = torch.tensor([real, padded], dtype=torch.float64)
    dist.all_reduce(counts)
    all_lengths = [None] * world
    dist.all_gather_object(all_lengths, lengths)
    if rank == 0:
        res.samples, res.train_s = samples, train_s
        res.real_tokens, res.padded_tokens = int(counts[0]), int(counts[1])
        res.token_lengths = [x for part in all_lengths for x in part]
        res.final_accuracy = res.evals[-1]["accuracy"]
        res.save(Path(args.out))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
