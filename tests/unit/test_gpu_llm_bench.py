"""benchmarks/gpu_llm.py's arithmetic (the steady state, MFU) and its plumbing on a CPU (--smoke, e2e)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_llm import mfu  # noqa: E402
from gpu_llm_runs import steady_state  # noqa: E402


@pytest.mark.parametrize(
    ("points", "warm", "expected"),
    [
        # the first 10 steps (start-up, warm-up) leave the clock: 5,000 tokens in 5 s after them
        ([(10, 1000, 30.0), (20, 3500, 32.5), (30, 6000, 35.0)], 10, (5000, 5.0)),
        ([(10, 1000, 30.0), (20, 3500, 32.5), (30, 6000, 35.0)], 15, (2500, 2.5)),
        ([(10, 1000, 30.0)], 10, (0, 0.0)),  # one point: no interval to time
        ([], 10, (0, 0.0)),
    ],
)
def test_steady_state_leaves_the_warm_up_out(points, warm, expected):
    assert steady_state(points, warm) == expected


def test_mfu_counts_the_head_only_on_target_tokens_and_lora_at_four_n():
    sizes = {"body": 1000, "vocab": 100, "hidden": 10, "layers": 2}
    stats = {"target_fraction": 0.5, "s2_per_token": 4.0}
    res = {"steady_tokens": 10, "steady_s": 1.0}
    # full: (6·1000 + 6·100·10·0.5 + 6·2·10·4) · 10 tokens / 1 s / peak
    assert mfu(res, "full", sizes, stats, 1e5) == pytest.approx((6000 + 3000 + 480) * 10 / 1e5)
    assert mfu(res, "lora", sizes, stats, 1e5) == pytest.approx((4000 + 2000 + 480) * 10 / 1e5)
    assert mfu(res, "dpo", sizes, {}, 1e5) is None  # preference rows: no count
    assert mfu({"steady_tokens": 0, "steady_s": 0.0}, "full", sizes, stats, 1e5) is None


@pytest.mark.e2e
def test_gpu_llm_smoke_runs_every_kind_of_row_on_a_cpu(tmp_path):
    """kubetune with the fast path on and off, TRL, and the profiler trace: a row each, on a tiny shape."""
    rows = "kubetune 1B full: fast path on,kubetune 1B full: fast path off,TRL 1B full,profile kubetune 1B full: fast path on"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_llm.py"), "--smoke", "--steps", "6", "--systems", rows]
    cmd += ["--work", str(tmp_path / "work"), "--out", str(tmp_path / "out")]
    subprocess.run(cmd, check=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}, timeout=600)
    results = json.loads((tmp_path / "out" / "gpu-llm.json").read_text())["results"]
    assert list(results) == rows.split(",")
    for label, r in results.items():
        assert "error" not in r, (label, r)
        if not label.startswith("profile"):
            assert r["steps"] == 6 and r["steady_tokens"] > 0 and r["steady_s"] > 0, (label, r)
    assert (tmp_path / "out" / "profile-on.json.gz").stat().st_size > 0
    assert "train_step" in (tmp_path / "out" / "profile-on.txt").read_text()
    assert "| TRL 1B full | 6 |" in (tmp_path / "out" / "gpu-llm.md").read_text()
