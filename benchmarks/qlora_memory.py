"""Peak GPU memory and speed of LoRA bf16 against QLoRA 4-bit (and 8-bit) on a Llama-3.2-1B-shaped model.

    python benchmarks/qlora_memory.py --out DIR [--steps 60] [--batch 8]

The model has the shape of meta-llama/Llama-3.2-1B (16 layers, hidden 2048, 32 heads / 8 KV heads,
MLP 8192, vocab 128256, tied embeddings: 1.24B parameters), random-init and saved in bf16, because
no model hub is reachable from the benchmark machines; memory and speed depend on the shape, not
on the weights. The tokenizer is kubetune's tiny-llama one (its ids are a subset of the vocabulary).
Each variant is one `kubetune run` of the same causal-LM chat job (pkg://kubetune/assets/sentiment/sentiment-chat.jsonl,
LoRA r16 on all linear layers, 1 GPU); peak memory is torch.cuda.max_memory_allocated on the rank.
Writes qlora.json and qlora.md under --out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "src" / "kubetune" / "assets" / "tiny-llama"


def make_model(dest: Path, smoke: bool) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    shape = dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    )
    if smoke:
        shape.update(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=4096,
        )
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    config = LlamaConfig(
        **shape,
        max_position_embeddings=2048,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


def spec(model: Path, out: Path, steps: int, batch: int, overrides: dict) -> dict:
    s = {
        "name": "qlora-bench",
        "task": "causal-lm",
        "model": {"uri": str(model)},
        "data": {
            "train": "pkg://kubetune/assets/sentiment/sentiment-chat.jsonl",
            "format": "chat",
            "eval_fraction": 0.05,
            "max_length": 256,
        },
        "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"},
        "training": {
            "max_steps": steps,
            "batch_size": batch,
            "learning_rate": 1e-3,
            "warmup_ratio": 0.05,
            "weight_decay": 0.0,
            "precision": "bf16",
            "log_every": 5,
            "resume": "never",
        },
        "distributed": {"nodes": 1, "procs_per_node": 1},
        "output": {"uri": str(out), "report_baseline": False},
    }
    for key, value in overrides.items():
        node = s
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--only", nargs="*", help="variant names to run")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, LoRA only: check the script on a CPU")
    args = ap.parse_args()

    import torch

    work = Path(tempfile.mkdtemp(prefix="kubetune-qlora-"))
    t0 = time.perf_counter()
    model = make_model(work / "llama-1b-shape", args.smoke)
    print(f"model written in {time.perf_counter() - t0:.0f} s", flush=True)
    variants = {
        "LoRA, bf16 base": {},
        "QLoRA 4-bit NF4": {"lora.quantization": "4bit"},
        "QLoRA 8-bit": {"lora.quantization": "8bit"},
        "LoRA, bf16 base, gradient checkpointing": {"training.gradient_checkpointing": True},
        "QLoRA 4-bit, gradient checkpointing": {"lora.quantization": "4bit", "training.gradient_checkpointing": True},
    }
    if args.only:
        variants = {k: v for k, v in variants.items() if k in args.only}
    if args.smoke or not torch.cuda.is_available():
        variants = {k: v for k, v in variants.items() if "lora.quantization" not in v}
    results = {}
    for name, overrides in variants.items():
        out = work / f"run-{len(results)}"
        path = work / f"spec-{len(results)}.yaml"
        path.write_text(yaml.safe_dump(spec(model, out, args.steps, args.batch, overrides)))
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "kubetune", "run", str(path)], cwd=ROOT, capture_output=True, text=True
        )
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            print(f"{name}: FAILED ({proc.returncode})\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}", flush=True)
            results[name] = {"failed": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
            continue
        m = json.loads((out / "metrics.json").read_text())
        train = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
        losses = [h["loss"] for h in train if h["type"] == "train"]
        results[name] = {
            "peak_gpu_gib": m.get("peak_gpu_memory_gib"),
            "samples_per_s": m["train_samples_per_second"],
            "tokens_per_s": m["train_tokens_per_second"],
            "first_loss": losses[0],
            "last_loss": losses[-1],
            "eval_loss": m["eval_loss"],
            "eval_perplexity": m["eval_perplexity"],
            "wall_s": wall,
            "adapter_files": sorted(p.name for p in (out / "adapter").iterdir()) if (out / "adapter").is_dir() else [],
        }
        print(f"{name}: {json.dumps(results[name])}", flush=True)
        write(Path(args.out), results, args)  # after each variant: a run cut short still leaves its table


def write(dest: Path, results: dict, args) -> None:
    import torch

    meta = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke)",
        "torch": torch.__version__,
        "steps": args.steps,
        "batch": args.batch,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    lines = [
        (
            f"{meta['gpu']}, torch {meta['torch']}; Llama-3.2-1B shape (random init), LoRA r16 all-linear, batch "
            f"{args.batch}, max_length 256, {args.steps} steps, 1 GPU."
        ),
        "",
        "| variant | peak GPU memory (GiB) | samples/s | train loss first → last | eval perplexity |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        if "failed" in r:
            lines.append(f"| {name} | failed: {r['failed']} | | | |")
            continue
        peak = f"{r['peak_gpu_gib']:.2f}" if r["peak_gpu_gib"] is not None else "n/a (CPU)"
        lines.append(
            f"| {name} | {peak} | {r['samples_per_s']:.1f} | {r['first_loss']:.2f} → {r['last_loss']:.2f} | "
            f"{r['eval_perplexity']:.1f} |"
        )
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "qlora.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    (dest / "qlora.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
