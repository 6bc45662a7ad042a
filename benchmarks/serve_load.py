"""`kubetune serve` under load, in one run: against `transformers serve --continuous-batching` on the same
model and load, and (``--batches``, ``--before``) kubetune's settings and source trees against each other.

    python benchmarks/serve_load.py [MODEL] [--clients 1,4,16] [--requests 96] [--seconds 10] [--max-tokens 32]
        [--batches 16] [--before SRC] [--no-transformers] [--transformers-args ARGS] [--rounds 1] [--name NAME]

MODEL is a causal LM export or model directory; default: the packaged tiny Llama (random init, so a
greedy completion never ends early: every completion has ``--max-tokens`` tokens under both servers,
checked from each response's ``usage``, and the load is the same for every server).

Servers: `kubetune serve MODEL --max-batch B` for each B of ``--batches`` (``--max-wait-ms 10``,
``--max-queue`` 64 or twice the most clients, ``--timeout 600``); the same again from the source tree
``--before`` names, first on PYTHONPATH (``git archive COMMIT src | tar -x -C DIR``, ``echo COMMIT >
DIR/COMMIT``, ``--before DIR/src``); and, unless ``--no-transformers``, `transformers serve MODEL
--continuous-batching` (the model preloaded, its other settings the CLI's defaults, plus
``--transformers-args``). Each is started fresh on 127.0.0.1 on a free port, as a user starts it, and
warmed: the 8 prompts one at a time (their greedy texts and token counts are recorded, to compare the
servers), then one burst of as many requests as the most clients. Then for each ``--clients`` count C,
C threads send completions (``/v1/completions``, the same body for every server: a raw prompt
``Review: <one of 8 reviews>`` cycling over the reviews, ``max_tokens``, ``temperature 0``), each its
next when the last is answered, until at least ``--requests`` were sent and ``--seconds`` have passed.
The server's process group is stopped before the next server starts. With ``--rounds`` above 1 the
servers take turns, in reverse order every other round.

Reported per server and C: answered (200), refused (429), lost (no answer, or any other status), short
(answered with fewer tokens than asked), completion tokens/s and completions/s over the whole load
(tokens from ``usage.completion_tokens``), p50 and p95 latency, the server's CPU seconds per wall
second and those of every process but the server and this one (from /proc: another's work on the
machine makes a load slow and noisy; rates are the medians of the loads where that stayed under
``--quiet-below``); then each kubetune server's tokens/s ÷ transformers' at each C (without
transformers: ÷ the first server's). Also recorded: versions, the CPU (model name, avx512_bf16, amx),
torch's threads, each server's command, start-up time, CPU use while idle after the warm-up, and peak
RSS. Writes benchmarks/results/<name>.{json,md}; default name: serve-vs-transformers-<cpu>
(serve-<cpu> with ``--no-transformers``).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY_LLAMA = ROOT / "src" / "kubetune" / "assets" / "tiny-llama"
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


@dataclass
class Server:
    label: str  # as the table shows it
    kind: str  # "kubetune" or "transformers"
    cmd: list[str]
    ready_path: str  # answers 200 once the model is loaded
    src: str | None = None  # kubetune's source tree, first on PYTHONPATH; None: the installed one


def kubetune_server(model: str, max_batch: int, a, src: str | None = None) -> Server:
    settings = ["--max-batch", str(max_batch), "--max-wait-ms", "10", "--max-queue", str(max(64, 2 * max(a.clients)))]
    settings += ["--timeout", "600"]
    cmd = [sys.executable, "-m", "kubetune", "serve", model, *settings]
    label = f"kubetune {_commit(src) if src else _here()} --max-batch {max_batch}"
    return Server(label, "kubetune", cmd, "/ready", str(Path(src).resolve()) if src else None)


def _commit(src: str) -> str:
    """The commit a ``--before`` tree came from: its COMMIT file (write one beside ``git archive``'s output), else
    its git HEAD, else its directory's name."""
    for path in (Path(src) / "COMMIT", Path(src).parent / "COMMIT"):
        if path.is_file():
            return path.read_text().strip()[:7]
    git = subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return git.stdout.strip() if git.returncode == 0 else Path(src).resolve().name


def _here() -> str:
    """This checkout's commit, with ``+`` when its src/ differs from it (a ``--before`` tree of the same commit
    then reads apart from it)."""
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "src"], capture_output=True, text=True)
    return _commit(str(ROOT)) + ("+" if dirty.stdout.strip() else "")


def transformers_server(model: str, extra: str) -> Server:
    exe = Path(sys.executable).with_name("transformers")
    cli = str(exe) if exe.exists() else shutil.which("transformers") or "transformers"
    cmd = [cli, "serve", model, "--continuous-batching", *shlex.split(extra)]
    return Server(" ".join(["transformers --continuous-batching", extra]).strip(), "transformers", cmd, "/health")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> tuple[int, dict]:
    """(HTTP status, JSON body); status 0 where no answer came (refused connection, reset, timeout)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read())
        except ValueError:
            return e.code, {}
    except (OSError, ValueError):
        return 0, {}


def _cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system, every thread) the process has used; None off Linux."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _rss_mib(pid: int) -> dict:
    """The process's resident memory now and at its peak (VmRSS, VmHWM), MiB; empty off Linux."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in lines) if k in ("VmRSS", "VmHWM")}
    return {"rss_mib": kb.get("VmRSS", 0) / 1024, "peak_rss_mib": kb.get("VmHWM", 0) / 1024}


def _busy_s() -> float | None:
    """CPU seconds every core of the machine has spent busy since boot (/proc/stat); None off Linux."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


def _body(k: int, max_tokens: int) -> dict:
    return {"prompt": f"Review: {REVIEWS[k % len(REVIEWS)]}", "max_tokens": max_tokens, "temperature": 0}


def one(url: str, k: int, max_tokens: int) -> dict:
    """One completion: status, latency, and what usage and the text say."""
    t = time.perf_counter()
    status, out = _post(url + "/v1/completions", _body(k, max_tokens))
    usage = out.get("usage") or {}
    choices = out.get("choices") or [{}]
    return {
        "status": status,
        "latency_s": time.perf_counter() - t,
        "tokens": usage.get("completion_tokens", 0) if status == 200 else 0,
        "prompt_tokens": usage.get("prompt_tokens"),
        "text": choices[0].get("text"),
        "finish_reason": choices[0].get("finish_reason"),
    }


def run_load(url: str, pid: int, clients: int, a) -> dict:
    """``clients`` threads at once, each sending its next completion when the last is answered, until at
    least ``a.requests`` were sent and ``a.seconds`` have passed; then the answers still due are awaited."""
    lock, sent, results = threading.Lock(), [0], []

    def client() -> None:
        while True:
            with lock:
                if sent[0] >= a.requests and time.perf_counter() - t0 >= a.seconds:
                    return
                k, sent[0] = sent[0], sent[0] + 1
            r = one(url, k, a.max_tokens)
            with lock:
                results.append(r)

    cpu0, busy0, own0, t0 = _cpu_s(pid), _busy_s(), time.process_time(), time.perf_counter()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    cpu1, busy1, own1 = _cpu_s(pid), _busy_s(), time.process_time()
    server_cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
    ok = [r for r in results if r["status"] == 200]
    lat = sorted(r["latency_s"] for r in ok)
    return {
        "clients": clients,
        "requests": len(results),
        "answered": len(ok),
        "refused_429": sum(r["status"] == 429 for r in results),
        "lost": sum(r["status"] not in (200, 429) for r in results),
        "statuses": dict(collections.Counter(str(r["status"]) for r in results)),
        "short": sum(r["tokens"] < a.max_tokens for r in ok),
        "completion_tokens": sum(r["tokens"] for r in ok),
        "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
        "completions_per_s": len(ok) / wall,
        "p50_s": statistics.median(lat) if lat else None,
        "p95_s": lat[int(0.95 * (len(lat) - 1))] if lat else None,
        "wall_s": wall,
        "server_cpu_per_s": server_cpu / wall if server_cpu is not None else None,
        "client_cpu_per_s": (own1 - own0) / wall,
        # anything else on the machine (other people's work): what makes a run noisy
        "other_cpu_per_s": (busy1 - busy0 - server_cpu - (own1 - own0)) / wall
        if server_cpu is not None and busy0 is not None
        else None,
    }


def start(server: Server, model: str, log: Path) -> tuple[subprocess.Popen, str, float]:
    """Start the server on a free port, in its own process group; wait until it answers its readiness path."""
    port = _port()
    env = dict(os.environ)
    if Path(model).is_dir():
        env.setdefault("HF_HUB_OFFLINE", "1")  # a local directory: no hub look-up
    if server.src:
        env["PYTHONPATH"] = os.pathsep.join([server.src, *filter(None, [env.get("PYTHONPATH")])])
    cmd = server.cmd + ["--host", "127.0.0.1", "--port", str(port)]
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    while time.perf_counter() - t0 < 600:
        if proc.poll() is not None:
            raise RuntimeError(f"{server.label} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + server.ready_path, timeout=2):
                return proc, url, time.perf_counter() - t0
        except OSError:
            time.sleep(0.2)
    stop(proc)
    raise RuntimeError(f"{server.label} not ready after 600 s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 30 s: nothing is left behind."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        try:  # the leader is gone; a child it left in the group is not
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break


def measure(server: Server, model: str, a, logs: Path) -> dict:
    """One fresh server: start, warm up, one load per clients count, stop."""
    proc, url, ready_s = start(server, model, logs / f"{server.kind}-{len(list(logs.iterdir()))}.log")
    try:
        t = time.perf_counter()
        first = [one(url, k, a.max_tokens) for k in range(len(REVIEWS))]  # the first pays any lazy setup
        burst = max(a.clients)
        with concurrent.futures.ThreadPoolExecutor(burst) as pool:
            warm = list(pool.map(lambda k: one(url, k, a.max_tokens), range(burst)))
        warmup_s = time.perf_counter() - t
        cpu0 = _cpu_s(proc.pid)
        time.sleep(2.0)
        cpu1 = _cpu_s(proc.pid)
        loads = []
        for c in a.clients:
            loads.append(run_load(url, proc.pid, c, a))
            print(server.label, json.dumps(loads[-1]), flush=True)
        memory = _rss_mib(proc.pid)
    finally:
        stop(proc)
    return {
        "server": server.label,
        "kind": server.kind,
        "command": server.cmd,
        "ready_s": ready_s,
        "warmup_s": warmup_s,
        "warmup_first_latency_s": first[0]["latency_s"],
        "warmup_statuses": [r["status"] for r in first + warm],
        "idle_cpu_per_s": (cpu1 - cpu0) / 2.0 if cpu0 is not None and cpu1 is not None else None,
        **memory,
        "greedy": [{k: r[k] for k in ("text", "tokens", "prompt_tokens", "finish_reason")} for r in first],
        "loads": loads,
    }


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def machine() -> dict:
    """The CPU (lscpu's model name and the flags that decide bf16), thread counts and versions."""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        lscpu = ""
    info = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    flags = set(info.get("Flags", "").split())
    import torch

    git = ["git", "-C", str(ROOT)]
    commit = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(git + ["status", "--porcelain", "--", "src"], capture_output=True, text=True).stdout
    return {
        "cpu_model": info.get("Model name", platform.processor()).strip(),
        "cores": os.cpu_count(),
        "avx2": "avx2" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "amx": sorted(f for f in flags if f.startswith("amx")),
        "torch_threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "cuda": torch.cuda.is_available(),
        "load_average_at_start": os.getloadavg(),
        "versions": {d: _version(d) for d in ("kubetune", "torch", "transformers", "fastapi", "uvicorn", "accelerate")},
        "python": platform.python_version(),
        "kubetune_commit": commit + (" (src/ modified)" if dirty.strip() else ""),
    }


def cpu_slug(m: dict) -> str:
    """e.g. 2core-xeon-avx512bf16: the cores, the CPU family and its bf16 instructions."""
    words = m["cpu_model"].lower().replace("(r)", " ").split()
    family = next((w for w in ("xeon", "epyc", "ryzen", "core", "neoverse", "graviton") if w in words), None)
    bf16 = "amx" if m["amx"] else "avx512bf16" if m["avx512_bf16"] else "avx2" if m["avx2"] else None
    return "-".join(x for x in (f"{m['cores']}core", family or platform.machine(), bf16) if x)


def summarize(rounds: list[list[dict]], quiet_below: float) -> list[dict]:
    """One row per server and clients count: counts summed over rounds; rates and latencies the medians of the
    quiet rounds' loads (other processes used under ``quiet_below`` CPU s/s), of every round's where none was
    quiet (``contended``); ``ratio``: tokens/s ÷ the reference's (transformers where it ran, else the first
    server) at that count."""
    cells: dict[tuple[str, int], list[dict]] = collections.defaultdict(list)
    kinds = {}
    for run in (r for rnd in rounds for r in rnd):
        kinds[run["server"]] = run["kind"]
        for load in run["loads"]:
            cells[run["server"], load["clients"]].append(load)
    servers = list(kinds)
    ref = next((s for s in servers if kinds[s] == "transformers"), servers[0])
    rows = []
    for (server, clients), loads in cells.items():
        row = {"server": server, "kind": kinds[server], "clients": clients, "rounds": len(loads)}
        for k in ("requests", "answered", "refused_429", "lost", "short", "completion_tokens"):
            row[k] = sum(x[k] for x in loads)
        quiet = [x for x in loads if x["other_cpu_per_s"] is not None and x["other_cpu_per_s"] < quiet_below]
        row["rounds_used"], row["contended"] = len(quiet or loads), not quiet
        for k in ("tokens_per_s", "completions_per_s", "p50_s", "p95_s", "server_cpu_per_s", "other_cpu_per_s"):
            vals = [x[k] for x in quiet or loads if x[k] is not None]
            row[k] = statistics.median(vals) if vals else None
        rows.append(row)
    for row in rows:
        base = next(r for r in rows if r["server"] == ref and r["clients"] == row["clients"])
        row["reference"] = ref
        row["ratio"] = row["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else None
    return sorted(rows, key=lambda r: (r["clients"], servers.index(r["server"])))


def _f(x, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def markdown(rows: list[dict], rounds: list[list[dict]], m: dict, a, command: str) -> str:
    ref = rows[0]["reference"]
    table = [
        f"| {r['clients']} | {r['server']} | {r['answered']} | {r['lost']} | {r['refused_429']} | {r['short']} | "
        f"{r['rounds_used']}{' (contended)' if r['contended'] else ''} | "
        f"{r['tokens_per_s']:.0f} | {r['completions_per_s']:.2f} | {_f(r['p50_s'], '.3f')} | {_f(r['p95_s'], '.3f')} "
        f"| {_f(r['server_cpu_per_s'], '.2f')} | {_f(r['other_cpu_per_s'], '.2f')} | "
        + ("—" if r["server"] == ref else f"**{r['ratio']:.2f}×**")
        + " |"
        for r in rows
    ]
    first = rounds[0]
    texts = [[g["text"] for g in run["greedy"]] for run in first]
    same = sum(len({t[i] for t in texts}) == 1 for i in range(len(REVIEWS)))
    servers = [
        f"- {run['server']}: `{' '.join(Path(c).name if i == 0 else c for i, c in enumerate(run['command']))}`; "
        f"ready {run['ready_s']:.1f} s after start, warm-up {run['warmup_s']:.1f} s (first request "
        f"{run['warmup_first_latency_s']:.2f} s), idle CPU after it {_f(run['idle_cpu_per_s'], '.2f')} s/s, "
        f"peak RSS {_f(run.get('peak_rss_mib'), ',.0f')} MiB; "
        f"greedy completion tokens {sorted({g['tokens'] for g in run['greedy']})}, prompt tokens "
        f"{[g['prompt_tokens'] for g in run['greedy']]}"
        for run in first
    ]
    v = m["versions"]
    return "\n".join(
        [
            f"# kubetune serve under load ({time.strftime('%Y-%m-%d %H:%M')})",
            "",
            f"{m['cpu_model']}, {m['cores']} cores (avx512_bf16: {'yes' if m['avx512_bf16'] else 'no'}, amx: "
            f"{', '.join(m['amx']) or 'no'}), torch {v['torch']} ({m['torch_threads']} threads), transformers "
            f"{v['transformers']}, kubetune {v['kubetune']} at {m['kubetune_commit']}, python {m['python']}. "
            f"Model: {Path(a.model).name}.",
            "",
            f"`{command}`: per clients count, greedy `/v1/completions` of {a.max_tokens} tokens (prompts cycling "
            f"over {len(REVIEWS)} reviews) for at least {a.seconds:g} s and {a.requests} requests, after a warm-up; "
            f"{len(rounds)} round(s). Counts are sums over the rounds; rates and latencies medians over the rounds "
            f"where other processes used under {a.quiet_below:g} CPU s/s (the rounds used; all of them where none "
            "was: contended).",
            "",
            "| clients | server | answered | lost | refused (429) | short | rounds used | completion tokens/s "
            f"| completions/s | p50 (s) | p95 (s) | server CPU s/s | others' CPU s/s | ÷ {ref} (tokens/s) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *table,
            "",
            *servers,
            f"- Greedy texts of the {len(REVIEWS)} prompts the same under every server: {same} of {len(REVIEWS)}.",
            "",
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=str(TINY_LLAMA))
    ap.add_argument("--requests", type=int, default=96, help="completions per clients count, at least")
    ap.add_argument("--seconds", type=float, default=10.0, help="how long each clients count's load lasts, at least")
    ap.add_argument("--clients", default="1,4,16", help="concurrent clients, one load each")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batches", default="16", help="kubetune serve --max-batch settings, one server each")
    ap.add_argument("--no-transformers", action="store_true", help="kubetune's settings only")
    ap.add_argument(
        "--transformers-args",
        action="append",
        help="options for one transformers serve (e.g. '--cb-num-blocks 64'); repeated: one server each",
    )
    ap.add_argument("--before", help="also kubetune serve from this source tree (its src/), in the same rounds")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--quiet-below", type=float, default=0.25, help="others' CPU s/s under which a load is quiet")
    ap.add_argument("--name", default=None)
    a = ap.parse_args()
    a.clients = [int(x) for x in a.clients.split(",")]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped benchmark stops its server too
    command = shlex.join(["python", "benchmarks/serve_load.py", *sys.argv[1:]])
    m = machine()
    trees = ([a.before] if a.before else []) + [None]  # None: the kubetune installed here
    servers = [kubetune_server(a.model, int(b), a, src) for src in trees for b in a.batches.split(",") if b]
    if not a.no_transformers:
        servers += [transformers_server(a.model, extra) for extra in a.transformers_args or [""]]
    rounds = []
    with tempfile.TemporaryDirectory(prefix="serve-load-") as logs:
        for k in range(a.rounds):
            order = servers if k % 2 == 0 else servers[::-1]
            runs = [measure(s, a.model, a, Path(logs)) for s in order]
            rounds.append(sorted(runs, key=lambda r: [s.label for s in servers].index(r["server"])))
    rows = summarize(rounds, a.quiet_below)
    name = a.name or ("serve-" if a.no_transformers else "serve-vs-transformers-") + cpu_slug(m)
    md = markdown(rows, rounds, m, a, command)
    dest = ROOT / "benchmarks" / "results"
    (dest / f"{name}.md").write_text(md)
    record = {"command": command, "args": vars(a), "machine": m, "summary": rows, "rounds": rounds}
    (dest / f"{name}.json").write_text(json.dumps(record, indent=1))
    print(md)


if __name__ == "__main__":
    main()
