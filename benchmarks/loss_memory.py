"""Peak host memory of the causal-LM loss, before and after it kept only the target positions'
logits and took the fp32 softmax in checkpointed chunks (``kubetune.tasks.causal_lm.task.loss``).

    python benchmarks/loss_memory.py [--vocab 131072] [--tokens 4096 16384] [--dtype fp32|bf16] [--limit-gib 19.5]

A Llama with a 128k vocabulary (Llama 3's, untied) and one small block (hidden 256), so that the
output projection and the loss dominate everything else; one packed micro-batch of ``tokens``
tokens (examples of 512 tokens, position ids restarting), forward and backward, in fp32 or under bf16
autocast (the GPU's precision; on a CPU without bf16 instructions about 30 times slower).
Two shares of target tokens: every token (continued pre-training: the worst case for keeping only
the targets, where only the chunking helps) and half (a chat SFT set whose responses are half of
its tokens). "before" is the computation kubetune had until this change (every position's logits,
the targets' rows upcast to fp32 in one cross-entropy), copied below.

Each case runs alone in a fresh process inside a memory cgroup (cgroup v1, as root), so a case that
does not fit is killed alone. Reported: the resident peak during forward + backward minus the
resident memory just before it (the model and its inputs), the loss (equal before and after), and
the seconds taken. Writes benchmarks/results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT  # noqa: E402
from fsdp_memory import MemoryCgroup  # noqa: E402

EXAMPLE = 512  # tokens per packed example


def rss_gib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 2**20


def before(model, inputs: dict, labels):
    """The loss as kubetune computed it before this change."""
    import torch.nn.functional as F

    from kubetune.tasks.causal_lm.data import IGNORE

    logits = model(**inputs).logits
    targets = labels[:, 1:]
    mask = targets != IGNORE
    return F.cross_entropy(logits[:, :-1][mask].float(), targets[mask], reduction="sum")


def child(mode: str, tokens: int, share: float, vocab: int, dtype: str) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kubetune.data import Batch
    from kubetune.tasks.causal_lm import task as causal_lm
    from kubetune.tasks.causal_lm.data import IGNORE

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=EXAMPLE,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, vocab, (1, tokens))
    positions = (torch.arange(tokens) % EXAMPLE)[None]
    labels = ids.clone()
    labels[positions < EXAMPLE * (1 - share)] = IGNORE  # each example's first part is its prompt
    labels[positions == 0] = IGNORE  # and a packed example's first token has no context
    inputs = {"input_ids": ids, "position_ids": positions}
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")
    base = rss_gib()
    start = time.perf_counter()
    if mode == "before":
        with autocast:
            loss = before(model, inputs, labels)
    else:
        loss = causal_lm.loss(model, Batch(inputs, labels), autocast).loss_sum
    loss.backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"loss_gib": peak - base, "loss": loss.item(), "targets": int((labels[:, 1:] != IGNORE).sum()), "s": seconds}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=131072)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--shares", type=float, nargs="+", default=[1.0, 0.5])
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--limit-gib", type=float, default=19.5)
    ap.add_argument("--name", default="loss-memory")
    ap.add_argument("--child", nargs=3, metavar=("MODE", "TOKENS", "SHARE"))
    args = ap.parse_args()
    if args.child:
        mode, tokens, share = args.child
        print(json.dumps(child(mode, int(tokens), float(share), args.vocab, args.dtype)))
        return
    group = MemoryCgroup(int(args.limit_gib * 2**30))
    rows = []
    try:
        for tokens in args.tokens:
            for share in args.shares:
                for mode in ("before", "after"):
                    group.reset()
                    cmd = [
                        sys.executable,
                        __file__,
                        "--vocab",
                        str(args.vocab),
                        "--child",
                        mode,
                        str(tokens),
                        str(share),
                    ]
                    proc = subprocess.run(
                        cmd,
                        capture_output=True,
                        text=True,
                        preexec_fn=group.enter if group.ok else None,
                        env=os.environ,
                    )
                    row = {"tokens": tokens, "share": share, "mode": mode}
                    if proc.returncode == 0:
                        row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
                    elif group.hit_limit() or proc.returncode == -9:
                        row["fits"] = False
                    else:
                        raise RuntimeError(f"{row} failed: {proc.stderr[-3000:]}")
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        group.close()
    results = {
        "vocab": args.vocab,
        "dtype": args.dtype,
        "limit_gib": args.limit_gib if group.ok else None,
        "rows": rows,
    }
    out = ROOT / "benchmarks" / "results"
    (out / f"{args.name}.json").write_text(json.dumps(results, indent=1))
    (out / f"{args.name}.md").write_text(markdown(results))
    print(markdown(results))


def markdown(results: dict) -> str:
    lines = [
        f"Vocabulary {results['vocab']}, {results['dtype']}, forward + backward of one packed micro-batch; "
        f"memory cgroup limit {results['limit_gib']} GiB.",
        "",
        "| tokens | targets | before: peak (GiB) | after: peak (GiB) | after / before | loss before / after |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    by = {(r["tokens"], r["share"], r["mode"]): r for r in results["rows"]}
    for tokens, share in sorted({(r["tokens"], r["share"]) for r in results["rows"]}):
        b, a = by[(tokens, share, "before")], by[(tokens, share, "after")]
        fits = "fits" not in b
        cell_b = f"{b['loss_gib']:.2f}" if fits else f"does not fit in {results['limit_gib']} GiB"
        cell_a = f"{a['loss_gib']:.2f}" if "fits" not in a else "does not fit"
        ratio = f"{a['loss_gib'] / b['loss_gib']:.2f}" if fits and "fits" not in a else "—"
        losses = f"{b['loss']:.2f} / {a['loss']:.2f}" if fits and "fits" not in a else "—"
        lines.append(f"| {tokens} | {a.get('targets', '?')} ({share:.0%}) | {cell_b} | {cell_a} | {ratio} | {losses} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
