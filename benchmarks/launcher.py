"""What `kubetune run`'s own process (the launcher) costs while its workers train: its resident memory once it only
waits, its peak, the heavy libraries it holds mapped while it waits, the CPU time it spent (its imports and checks;
with the children it waited for, i.e. the checks' child) and how long it takes from its start to its first worker's
start; on the tiny causal example (LoRA, the packaged chat rows, 1 process, 4 steps).

    python benchmarks/launcher.py [--rounds 3] [--before SRC] [--name launcher]

``--before SRC`` runs the kubetune whose package is in SRC too (e.g. ``git worktree add /tmp/old main``, then
``--before /tmp/old/src``), alternating with this checkout's in every round. Writes benchmarks/results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "causal-tiny-chat.yaml"


def _rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
    except OSError:
        return []


def _is_worker(pid: int) -> bool:
    try:
        return b"kubetune.pod.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def one_run(src: str, out: Path) -> dict:
    """One `kubetune run` of the example with ``src`` first on the path: the launcher's RSS sampled every 0.1 s."""
    env = {**os.environ, "PYTHONPATH": src, "HF_HUB_OFFLINE": "1"}
    sets = ["training.max_steps=4", f"output.uri={out}", "distributed.procs_per_node=1"]
    cmd = [sys.executable, "-m", "kubetune", "run", str(EXAMPLE), *[a for s in sets for a in ("--set", s)]]
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    peak, waiting, first_worker, cpu, libs = 0, [], None, (0.0, 0.0), []
    while proc.poll() is None:
        rss = _rss_kib(proc.pid)
        peak = max(peak, rss)
        if first_worker is None and any(_is_worker(c) for c in _children(proc.pid)):
            first_worker, cpu = time.time() - t0, _cpu_s(proc.pid)
            libs = _heavy_libraries(proc.pid)
        elif first_worker is not None and rss:
            waiting.append(rss)
        time.sleep(0.1)
    err = proc.stderr.read() if proc.stderr else ""
    assert proc.returncode == 0, err[-3000:]
    return {
        "wall_s": time.time() - t0,
        "to_first_worker_s": first_worker,
        "waiting_rss_mib": statistics.median(waiting) / 1024 if waiting else None,
        "peak_rss_mib": peak / 1024,
        "cpu_s": cpu[0],
        "cpu_with_children_s": cpu[1],
        "libraries": libs,
    }


HEAVY = {
    "torch": "torch/lib/libtorch_cpu",
    "pandas": "pandas/_libs",
    "pyarrow": "pyarrow/lib",
    "tokenizers": "tokenizers/tokenizers",
}


def _heavy_libraries(pid: int) -> list[str]:
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return []
    return [name for name, lib in HEAVY.items() if lib in maps]


def _cpu_s(pid: int) -> tuple[float, float]:
    """The process's own CPU seconds (user + system), and with its waited-for children's."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    own = (int(fields[11]) + int(fields[12])) / tick
    return own, own + (int(fields[13]) + int(fields[14])) / tick


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before")
    ap.add_argument("--name", default="launcher")
    a = ap.parse_args()
    systems = {"this": str(ROOT / "src"), **({"before": str(Path(a.before).resolve())} if a.before else {})}
    results: dict[str, list] = {s: [] for s in systems}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for name in list(systems) if r % 2 == 0 else list(systems)[::-1]:
                res = one_run(systems[name], Path(tmp) / f"r{r}-{name}")
                results[name].append(res)
                print(f"round {r} {name}: {res}", flush=True)
    keys = ("waiting_rss_mib", "peak_rss_mib", "cpu_s", "cpu_with_children_s", "to_first_worker_s", "wall_s")
    med = {
        s: {k: statistics.median(r[k] for r in runs if r[k] is not None) for k in keys} for s, runs in results.items()
    }
    lines = [
        f"# The launcher of a `kubetune run` ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"{os.cpu_count()} cores (shared with other work while measured). `python benchmarks/launcher.py --rounds "
        f"{a.rounds}{' --before SRC' if a.before else ''}`: examples/causal-tiny-chat.yaml, 1 process, 4 steps; "
        "medians, the systems alternating.",
        "",
        "| kubetune | RSS while waiting (MiB) | peak RSS (MiB) | libraries held while waiting | CPU before the first "
        "worker (s) | with the checks' child (s) | start to first worker (s) | whole run (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s, m in med.items():
        lines.append(
            f"| {s} | {m['waiting_rss_mib']:.0f} | {m['peak_rss_mib']:.0f} | {', '.join(results[s][-1]['libraries'])} "
            f"| {m['cpu_s']:.1f} | {m['cpu_with_children_s']:.1f} | {m['to_first_worker_s']:.1f} | {m['wall_s']:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    dest = ROOT / "benchmarks" / "results"
    (dest / f"{a.name}.md").write_text(text)
    (dest / f"{a.name}.json").write_text(json.dumps({"results": results, "medians": med}, indent=1))


if __name__ == "__main__":
    main()
