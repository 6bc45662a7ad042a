"""FSDP against DDP on this machine: per-rank peak host memory and seconds per step of a full
fine-tune of Llama-shaped models (random init), at 1 and 2 processes.

    python benchmarks/fsdp_memory.py [--limit-gib 19.5] [--steps 3] [--name fsdp-memory]

Every run is ``kubetune run`` (task causal-lm, full fine-tune, fp32, batch 1 × 128 tokens, AdamW)
with ``distributed.strategy`` ddp or fsdp, in a memory cgroup of ``--limit-gib`` (cgroup v1, as
root), so that a run that does not fit is killed alone instead of the machine's other processes.
DDP runs twice: as it trains by default, and as ``ddp+heap``, with glibc told through its
environment to give freed blocks of 1 MiB or more back (what FSDP sets for itself on a CPU), so
that the comparison holds on either allocator policy. Two sizes: a small model every configuration
fits, and a large one sized so that DDP at 2 processes needs more than the limit (16 bytes per
parameter on each rank) while FSDP at 2 processes does not.

Reported per run: every rank's peak RSS (``metrics.json``: peak_host_memory_gib), seconds per
optimizer step, and the bytes per parameter per rank (peak difference between the two sizes over the
parameter difference). From these: the largest model that fits one 80 GB device for DDP and FSDP at
2, 8 and 16 devices, full fine-tune and LoRA. Writes benchmarks/results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT  # noqa: E402

PY = sys.executable
ASSETS = ROOT / "src" / "kubetune" / "assets"
SIZES = {  # name -> (hidden, intermediate, layers)
    "small": (1024, 2816, 8),
    "large": (2048, 5632, 16),
}


def make_model(root: Path, hidden: int, intermediate: int, layers: int) -> tuple[Path, int]:
    """A random-init Llama of this shape with the packaged tiny Llama's tokenizer; its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = root / f"llama-{hidden}x{layers}"
    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=hidden // 128,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    if not path.exists():
        tmp = path.with_name(path.name + ".partial")  # renamed when complete: an interrupted run leaves no half model
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(ASSETS / "tiny-llama" / name, tmp / name)
        tmp.rename(path)
    return path, params


class MemoryCgroup:
    """A cgroup v1 memory group with a hard limit that the benchmark's runs are started in (None
    when the machine has no writable memory controller: then the runs that would not fit are skipped)."""

    def __init__(self, limit: int):
        self.path = Path(f"/sys/fs/cgroup/memory/kubetune-bench-{os.getpid()}")
        try:
            self.path.mkdir()
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
            (self.path / "memory.memsw.limit_in_bytes").exists() and (
                self.path / "memory.memsw.limit_in_bytes"
            ).write_text(str(limit))
            self.ok = True
        except OSError:
            self.ok = False

    def enter(self) -> None:  # preexec_fn of the child
        (self.path / "tasks").write_text(str(os.getpid()))

    def reset(self) -> None:
        if self.ok:
            (self.path / "memory.failcnt").write_text("0")

    def hit_limit(self) -> bool:
        """Whether an allocation failed at the limit since ``reset`` (the OOM killer then ran in the group)."""
        return self.ok and int((self.path / "memory.failcnt").read_text()) > 0

    def close(self) -> None:
        if self.ok:
            self.path.rmdir()


# The allocator setting FSDP makes on a CPU (training.runtime.return_freed_memory), given to DDP
# through glibc's environment so that the two are compared on the same allocator policy too.
HEAP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
STRATEGIES = ("ddp", "ddp+heap", "fsdp")


def run(work: Path, model: Path, variant: str, procs: int, steps: int, group: MemoryCgroup) -> dict:
    strategy = variant.split("+")[0]
    out = work / f"out-{model.name}-{strategy}-{procs}"
    spec = {
        "name": f"bench-{strategy}-{procs}",
        "task": "causal-lm",
        "model": {"uri": str(model)},
        "data": {
            "train": str(ASSETS / "sentiment" / "sentiment-chat.jsonl"),
            "format": "chat",
            "eval_fraction": 0.01,
            "max_length": 128,
        },
        "training": {
            "max_steps": steps,
            "batch_size": 1,
            "learning_rate": 1e-5,
            "precision": "fp32",
            "log_every": 1,
            "eval_batch_size": 4,
        },
        "distributed": {"procs_per_node": procs, "strategy": strategy, "threads_per_proc": max(1, 2 // procs)},
        "output": {"uri": str(out)},
    }
    path = work / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if variant.endswith("+heap"):
        env.update(HEAP_ENV)
    group.reset()
    proc = subprocess.run(
        [PY, "-m", "kubetune", "run", str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        preexec_fn=group.enter if group.ok else None,
    )
    if proc.returncode != 0:
        # killed at the group's limit, or by the kernel's own OOM killer first (a worker SIGKILLed)
        if not (group.hit_limit() or "(SIGKILL)" in proc.stderr):
            raise RuntimeError(f"{spec['name']} failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
        shutil.rmtree(out, ignore_errors=True)
        return {"fits": False, "exit": proc.returncode}
    m = json.loads((out / "metrics.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    return {
        "fits": True,
        "peak_gib": m["peak_host_memory_gib"],
        "s_per_step": m["train_runtime_s"] / m["global_step"],
        "ran": m["strategy"],  # what metrics.json says the run used
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit-gib", type=float, default=19.5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--name", default="fsdp-memory")
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="kt-fsdp-bench-"))
    group = MemoryCgroup(int(args.limit_gib * 2**30))
    results: dict = {"limit_gib": args.limit_gib if group.ok else None, "models": {}, "runs": []}
    try:
        for size, shape in SIZES.items():
            path, params = make_model(work, *shape)
            results["models"][size] = {"params": params, "shape": shape}
            for strategy in STRATEGIES:
                for procs in (1, 2):
                    if not group.ok and size == "large" and strategy.startswith("ddp") and procs == 2:
                        continue  # without a cgroup it would take the machine down, not just itself
                    r = run(work, path, strategy, procs, args.steps, group)
                    results["runs"].append({"size": size, "params": params, "strategy": strategy, "procs": procs, **r})
                    print(json.dumps(results["runs"][-1]), flush=True)
    finally:
        group.close()
    results["derived"] = derive(results)
    out = ROOT / "benchmarks" / "results"
    (out / f"{args.name}.json").write_text(json.dumps(results, indent=1))
    (out / f"{args.name}.md").write_text(markdown(results))
    print(markdown(results))


def _run_of(results: dict, size: str, strategy: str, procs: int) -> dict | None:
    return next((r for r in results["runs"] if (r["size"], r["strategy"], r["procs"]) == (size, strategy, procs)), None)


def derive(results: dict) -> dict:
    """Bytes per parameter per rank (the slope between the two sizes, the busiest rank) and the
    largest models that fit one 80 GB device."""
    small, large = results["models"]["small"]["params"], results["models"]["large"]["params"]
    slopes = {}
    for strategy in STRATEGIES:
        for procs in (1, 2):
            a, b = _run_of(results, "small", strategy, procs), _run_of(results, "large", strategy, procs)
            if a and b and a["fits"] and b["fits"]:
                slopes[f"{strategy}-{procs}"] = (max(b["peak_gib"]) - max(a["peak_gib"])) * 2**30 / (large - small)
    out = {"bytes_per_param": slopes}
    if "ddp-1" in slopes and "fsdp-2" in slopes:
        # DDP keeps everything per rank; FSDP's state divides by the ranks except what is gathered
        # at a time (one block) and the loading copy on rank 0 (which an 80 GB GPU does not hold).
        ddp = slopes["ddp-1"]
        sharded = slopes["fsdp-2"] * 2  # state bytes per parameter over the whole job
        device = 80e9 * 0.9  # leave 10% for the allocator, CUDA context and activations
        lora_frozen = 2.0  # a bf16 frozen base; the adapters are a rounding error
        table = {"ddp": {"full": device / ddp, "lora": device / lora_frozen}}
        for n in (2, 8, 16):
            table[f"fsdp-{n}"] = {"full": device / (sharded / n), "lora": device / (lora_frozen / n)}
        out["largest_params_80gb"] = table
    # The goal: FSDP's per-rank peak at 2 processes against DDP's. DDP at 2 processes does
    # not fit the large model here; its per-rank peak is at least DDP's at 1 (the same state, plus
    # the communication buckets), so that one is the denominator, an upper bound of the ratio.
    for ddp in ("ddp", "ddp+heap"):
        f2, d = _run_of(results, "large", "fsdp", 2), _run_of(results, "large", ddp, 2)
        d = d if d and d["fits"] else _run_of(results, "large", ddp, 1)
        if f2 and f2["fits"] and d and d["fits"]:
            out[f"fsdp-2 / {ddp}-{d['procs']} (large, busiest rank)"] = max(f2["peak_gib"]) / max(d["peak_gib"])
    return out


def markdown(results: dict) -> str:
    lines = [
        f"Memory cgroup limit: {results['limit_gib']} GiB. Models: "
        + ", ".join(f"{k} {v['params'] / 1e9:.2f}B parameters" for k, v in results["models"].items()),
        "",
        "| model | strategy | procs | peak RSS per rank (GiB) | s / step |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in results["runs"]:
        if r["fits"]:
            peak = " / ".join(f"{p:.2f}" for p in r["peak_gib"])
            lines.append(f"| {r['size']} | {r['strategy']} | {r['procs']} | {peak} | {r['s_per_step']:.1f} |")
        else:
            lines.append(f"| {r['size']} | {r['strategy']} | {r['procs']} | does not fit (exit {r['exit']}) | — |")
    d = results["derived"]
    lines += ["", "Bytes per parameter per rank (slope between the sizes, busiest rank):", ""]
    lines += [f"- {k}: {v:.1f}" for k, v in d["bytes_per_param"].items()]
    ratios = {k: v for k, v in d.items() if k.startswith("fsdp-2 /")}
    if ratios:
        lines += ["", "Per-rank peak, FSDP at 2 processes against DDP (goal: at most 0.6):", ""]
        lines += [f"- {k}: {v:.2f}" for k, v in ratios.items()]
    if "largest_params_80gb" in d:
        lines += ["", "| largest model on 80 GB devices | full fine-tune | LoRA (bf16 base) |", "| --- | --- | --- |"]
        for k, v in d["largest_params_80gb"].items():
            lines.append(f"| {k} | {v['full'] / 1e9:.1f}B | {v['lora'] / 1e9:.1f}B |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
