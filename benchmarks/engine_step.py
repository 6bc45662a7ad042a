"""The generation engine's forward and step on the CPU, without a server (issue 48): where `serve_load.py`'s
numbers come from.

    python benchmarks/engine_step.py MODEL [--rows 1,8,10,12,15,16,28,48,64] [--repeats 20] [--rounds 5]

MODEL is a causal LM directory (benchmarks/README.md, "Serving": the 28M Llama of sft_trl.py's
``make_model``). Prints, in one process:

- the model's forward of T rows (one packed row of T tokens, no cache), ms, with the linear layers on
  ``F.linear`` and with the swapped GEMM (``inference.kernels.swapped_gemm``): median of ``--rounds`` timings of
  ``--repeats`` forwards each, the two taking turns;
- the engine alone: 16 requests of 100 greedy tokens (prompts of 6 to 9 tokens), ms per step, median of
  ``--rounds`` runs after one warm-up run each, with the greedy head (``inference.families.greedy.GreedyHead``)
  on and off, taking turns (on a CPU without bf16 matrix hardware the engine leaves it off; here it is forced on), and
  whether the two made the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def forward_ms(model, rows: int, swapped: bool, repeats: int) -> float:
    from kubetune.inference.kernels import large_linears, swapped_gemm

    ids = torch.randint(3, 1000, (1, rows), generator=torch.Generator().manual_seed(rows))
    linears = large_linears(model) if swapped else []
    with torch.no_grad(), swapped_gemm(torch.device("cpu"), linears):
        model(input_ids=ids, use_cache=False)
        t = time.perf_counter()
        for _ in range(repeats):
            model(input_ids=ids, use_cache=False)
    return (time.perf_counter() - t) / repeats * 1e3


def engine_ms(model, rounds: int) -> tuple[dict[bool, list[float]], bool]:
    from kubetune.inference.families.greedy import GreedyHead
    from kubetune.inference.generation import Engine, Generation

    out, made = {True: [], False: []}, {}
    for r in range(rounds + 1):
        for screened in (True, False):
            engine = Engine(model, eos=set(), slots=16)
            engine._greedy_head = GreedyHead(enabled=screened)
            ids = [[5 + k, 7, 9, 11, 13, 17, 19, 23, 29][: 6 + k % 4] for k in range(16)]
            gens = [Generation(ids=p, max_tokens=100) for p in ids]
            t = time.perf_counter()
            engine.generate(gens)
            if r:  # the first run warms up
                out[screened].append((time.perf_counter() - t) / 100 * 1e3)
            made[screened] = [g.tokens for g in gens]
    return out, made[True] == made[False]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--rows", default="1,8,10,12,15,16,28,48,64")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| rows | F.linear (ms) | swapped GEMM (ms) |\n| --- | --- | --- |")
    for rows in (int(x) for x in a.rows.split(",")):
        times = {False: [], True: []}
        for _ in range(a.rounds):
            for swapped in (False, True):
                times[swapped].append(forward_ms(model, rows, swapped, a.repeats))
        print(f"| {rows} | {statistics.median(times[False]):.2f} | {statistics.median(times[True]):.2f} |")
    steps, same = engine_ms(model, a.rounds)
    for screened, label in ((True, "greedy head on"), (False, "greedy head off")):
        runs = ", ".join(f"{x:.2f}" for x in steps[screened])
        print(f"engine, 16 requests, {label}: {statistics.median(steps[screened]):.2f} ms per step (runs: {runs})")
    print(f"the same tokens on and off: {same}")


if __name__ == "__main__":
    main()
