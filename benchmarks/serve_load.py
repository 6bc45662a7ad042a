"""`kubetune serve` under load: dynamic batching against one request at a time, in one run.

    python benchmarks/serve_load.py [MODEL] [--requests 200] [--clients 16] [--max-tokens 32] [--name serve-cpu]

MODEL is a causal LM export or model directory; default: the packaged tiny Llama (random init, so it
never ends a completion early: every completion has ``--max-tokens`` tokens and the load is the same
for every setting). For each setting the server is started fresh on 127.0.0.1 (`kubetune
serve`, its queue large enough that nothing is refused), warmed with 4 requests, then ``--requests``
completions (``/v1/completions``, greedy, ``--max-tokens`` each, raw prompts cycling over 8 reviews) are sent from
``--clients`` threads at once. Reported per setting: answered and refused (429) requests, p50 and p95
latency, completions per second and completion tokens per second over the whole load. Settings:
``--max-batch 1`` (one request at a time) and ``--max-batch 8`` / ``16`` (dynamic batching, 10 ms wait).
Writes benchmarks/results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REVIEWS = [
    "The crew was lovely",
    "My flight was delayed for six hours",
    "The car has four wheels",
    "Best ride I have ever had",
    "The app crashed twice on the way",
    "Seats were fine, nothing special",
    "I will never book with them again",
    "Quiet, smooth and on time",
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def load(model: str, max_batch: int, a) -> dict:
    port = _port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kubetune", "serve", model, "--port", str(port), "--max-batch", str(max_batch)]
        + ["--max-queue", str(a.requests + 16)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/ready", timeout=2)
                break
            except OSError:
                time.sleep(0.2)

        def one(k: int):
            body = {"prompt": f"Review: {REVIEWS[k % 8]}", "max_tokens": a.max_tokens, "temperature": 0}
            t = time.perf_counter()
            status, out = _post(url + "/v1/completions", body)
            tokens = out.get("usage", {}).get("completion_tokens", 0) if status == 200 else 0
            return status, time.perf_counter() - t, tokens

        for k in range(4):
            one(k)  # warm-up
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(a.clients) as pool:
            results = list(pool.map(one, range(a.requests)))
        wall = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    ok = [r for r in results if r[0] == 200]
    lat = sorted(r[1] for r in ok)
    return {
        "max_batch": max_batch,
        "answered": len(ok),
        "refused_429": sum(r[0] == 429 for r in results),
        "other": sum(r[0] not in (200, 429) for r in results),
        "p50_s": statistics.median(lat) if lat else None,
        "p95_s": lat[int(0.95 * (len(lat) - 1))] if lat else None,
        "completions_per_s": len(ok) / wall,
        "tokens_per_s": sum(r[2] for r in ok) / wall,
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=str(ROOT / "src" / "kubetune" / "assets" / "tiny-llama"))
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--name", default="serve-cpu")
    a = ap.parse_args()
    runs = []
    for b in (int(x) for x in a.batches.split(",")):
        r = load(a.model, b, a)
        runs.append(r)
        print(json.dumps(r), flush=True)
    base = runs[0]["completions_per_s"]
    rows = [
        f"| {r['max_batch']} | {r['answered']} | {r['refused_429']} | {r['other']} | {r['p50_s']:.3f} | "
        f"{r['p95_s']:.3f} | {r['completions_per_s']:.2f} | {r['tokens_per_s']:.0f} | "
        f"{r['completions_per_s'] / base:.2f}× |"
        for r in runs
    ]
    md = "\n".join(
        [
            f"# kubetune serve under load ({time.strftime('%Y-%m-%d %H:%M')})",
            "",
            f"{platform.machine()}, {os.cpu_count()} cores. `python benchmarks/serve_load.py {a.model} --requests "
            f"{a.requests} --clients {a.clients} --max-tokens {a.max_tokens}`: greedy /v1/completions.",
            "",
            "| --max-batch | answered | 429 | other | p50 (s) | p95 (s) | completions/s | tokens/s "
            "| vs one at a time |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *rows,
            "",
        ]
    )
    dest = ROOT / "benchmarks" / "results"
    (dest / f"{a.name}.md").write_text(md)
    (dest / f"{a.name}.json").write_text(json.dumps({"runs": runs, "args": vars(a)}, indent=1))
    print(md)


if __name__ == "__main__":
    main()
