"""Bit-identical check for refactors: run the examples (the demo cut to 30 steps, the tiny causal chat
example, the DPO example on its model and KTO on the same pairs and model, GRPO cut to 8 steps), a demo
run stopped by SIGTERM after a checkpoint (kept, to resume later), `kubetune predict` and `kubetune serve` on
each export; then compare two such captures.

    python scripts/equivalence.py capture DIR            # on the code before the change (e.g. a worktree's src
                                                          # on PYTHONPATH), then on the code after it
    python scripts/equivalence.py resume BEFORE DIR      # after the change: resume BEFORE's stopped run in DIR
    python scripts/equivalence.py compare BEFORE AFTER   # max |diff| of every exported tensor, histories,
                                                          # metrics (timings left out), predict/serve outputs

Why a script and not a test: it runs each example in full (minutes) and compares against a capture made by
another checkout of the code, which a test of one checkout cannot have."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path.cwd()  # the checkout whose examples run (the code: whatever `python -m kubetune` imports)
KUBETUNE = [sys.executable, "-m", "kubetune"]
TIMING = ("seconds", "time", "per_s", "per_sec", "throughput", "peak", "memory", "mfu", "started", "finished", "rss")

RUNS = {
    "sentiment": ("examples/sentiment-minilm.yaml", ["training.max_steps=30"]),
    "causal": ("examples/causal-tiny-chat.yaml", []),
    "dpo": ("examples/dpo-tiny-chat.yaml", []),
    # KTO on the DPO example's pairs (each pair: a desirable and an undesirable completion), from the same SFT model
    "kto": ("examples/dpo-tiny-chat.yaml", ["task=kto", "dpo=null", "name=kto-tiny-chat"]),
    "grpo": ("examples/grpo-tiny-digits.yaml", ["training.max_steps=8"]),
}
PROMPTS = {
    "sentiment": ["I love how smooth this ride is", "I would never trust a self-driving car with my kids"],
    "causal": ["What is the sentiment of this review? I love this car", "What is the sentiment of this review? awful"],
}
PROMPTS["dpo"] = PROMPTS["kto"] = PROMPTS["grpo"] = PROMPTS["causal"]


def _run(args: list[str], log: Path, **kw) -> subprocess.CompletedProcess:
    with log.open("w") as f:
        return subprocess.run(KUBETUNE + args, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, check=True, **kw)


def _sets(out: Path, name: str) -> list[str]:
    spec, extra = RUNS[name]
    sets = [f"output.uri={out / name}", *extra]
    if name in ("dpo", "kto"):
        sets.append(f"model.uri={out / 'causal' / 'model'}")
    return [spec] + [a for s in sets for a in ("--set", s)]


def _predict(out: Path, name: str) -> list:
    args = ["predict", str(out / name), *PROMPTS[name], "--json"]
    if name != "sentiment":
        args += ["--max-new-tokens", "16"]
    return json.loads(subprocess.run(KUBETUNE + args, capture_output=True, text=True, cwd=ROOT, check=True).stdout)


def _post(port: int, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _serve(out: Path, name: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        KUBETUNE + ["serve", str(out / name), "--port", str(port), "--name", "m"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2)
                break
            except OSError:
                time.sleep(0.2)
        texts = PROMPTS[name]
        if name == "sentiment":
            return {
                "v1": _post(port, "/v1/models/m:predict", {"instances": texts}),
                "v2": _post(
                    port,
                    "/v2/models/m/infer",
                    {"inputs": [{"name": "text", "shape": [len(texts)], "datatype": "BYTES", "data": texts}]},
                ),
            }
        chat = _post(
            port,
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": texts[0]}], "max_tokens": 16},
        )
        completion = _post(port, "/v1/completions", {"model": "m", "prompt": texts[1], "max_tokens": 16})
        return {
            "chat": [c["message"] for c in chat["choices"]],
            "completion": [c["text"] for c in completion["choices"]],
            "usage": [chat["usage"], completion["usage"]],
        }
    finally:
        proc.terminate()
        proc.wait(30)


def _stopped(out: Path) -> None:
    """The demo (30 steps, a checkpoint every 10) stopped by SIGTERM once its first checkpoint is complete."""
    run = out / "stopped"
    args = _sets(out, "sentiment") + ["--set", f"output.uri={run}", "--set", "training.checkpoint_every=10"]
    with (out / "stopped.log").open("w") as log:
        proc = subprocess.Popen(KUBETUNE + ["run", *args], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        while proc.poll() is None and not any((run / "checkpoints").glob("*/COMPLETE")):
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(300)
    if code != 143:
        raise SystemExit(f"the stopped run exited {code}, not 143 (see {out / 'stopped.log'})")


def capture(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    record = {}
    for name in RUNS:
        start = time.monotonic()
        _run(["run", *_sets(out, name)], out / f"{name}.log")
        record[name] = {"seconds": round(time.monotonic() - start, 1), "predict": _predict(out, name)}
        record[name]["serve"] = _serve(out, name)
        print(name, record[name]["seconds"], "s", flush=True)
    _stopped(out)
    (out / "capture.json").write_text(json.dumps(record, indent=1))


def resume(before: Path, out: Path) -> None:
    """Copy BEFORE's stopped run into OUT and let this code finish it."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "stopped", ignore_errors=True)
    shutil.copytree(before / "stopped", out / "stopped")
    args = _sets(out, "sentiment") + ["--set", f"output.uri={out / 'stopped'}", "--set", "training.checkpoint_every=10"]
    _run(["run", *args], out / "resumed.log")


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    found = {}
    for path in sorted(folder.rglob("*.safetensors")):
        for key, value in load_file(path).items():
            found[f"{path.relative_to(folder)}:{key}"] = value
    return found


def _max_diff(a: Path, b: Path) -> float:
    ta, tb = _tensors(a), _tensors(b)
    if ta.keys() != tb.keys() or not ta:
        raise SystemExit(f"{a} and {b} hold different tensors: {sorted(ta.keys() ^ tb.keys())[:5]}")
    return max(float((ta[k].double() - tb[k].double()).abs().max()) for k in ta)


def _untimed(value):
    if isinstance(value, dict):
        return {
            k: _untimed(v) for k, v in value.items() if not (any(t in k.lower() for t in TIMING) or k.endswith("_s"))
        }
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


def _records(run: Path) -> list[dict]:
    """history.jsonl's records (every train and eval line), their timings left out."""
    return [_untimed(json.loads(line)) for line in (run / "history.jsonl").read_text().splitlines()]


def compare(before: Path, after: Path) -> int:
    bad = 0
    cb, ca = json.loads((before / "capture.json").read_text()), json.loads((after / "capture.json").read_text())
    pairs = [(name, name) for name in RUNS] + [("sentiment", "stopped")]
    for name, other in pairs:
        b, a = before / name, after / other
        diff = _max_diff(b, a)
        same_history = _records(b) == _records(a)
        mb, ma = (
            _untimed(json.loads((b / "metrics.json").read_text())),
            _untimed(json.loads((a / "metrics.json").read_text())),
        )
        if other == "stopped":  # its own output.uri and checkpoint_every; the resume adds its facts
            same_metrics = all(mb.get(k) == ma.get(k) for k in ("eval_loss", "eval_accuracy", "eval_f1_macro"))
            same_history = [r for r in _records(b) if r["type"] == "eval"] == [
                r for r in _records(a) if r["type"] == "eval"
            ]
        else:
            same_metrics = mb == ma
        line = f"{name:>9} vs {other:<9} max|diff| {diff:g}  history {'same' if same_history else 'DIFFERENT'}"
        line += f"  metrics {'same' if same_metrics else 'DIFFERENT'}"
        if other == name:
            same_predict = cb[name]["predict"] == ca[name]["predict"]
            same_serve = cb[name]["serve"] == ca[name]["serve"]
            line += (
                f"  predict {'same' if same_predict else 'DIFFERENT'}  serve {'same' if same_serve else 'DIFFERENT'}"
            )
            bad += not (same_predict and same_serve)
            if not same_metrics:
                print(json.dumps({k: (mb.get(k), ma.get(k)) for k in mb.keys() | ma.keys() if mb.get(k) != ma.get(k)}))
        bad += diff != 0 or not same_history or not same_metrics
        print(line)
    return 1 if bad else 0


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    command, *paths = sys.argv[1:]
    if command == "capture":
        capture(Path(paths[0]).resolve())
    elif command == "resume":
        resume(Path(paths[0]).resolve(), Path(paths[1]).resolve())
    elif command == "compare":
        sys.exit(compare(Path(paths[0]).resolve(), Path(paths[1]).resolve()))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
