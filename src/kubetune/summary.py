"""Print a short summary of a finished job: ``python -m kubetune.summary OUTPUT_DIR``."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def summary(out: Path) -> str:
    from kubetune import tasks

    m = json.loads((out / "metrics.json").read_text())
    lines = [
        tasks.get(m.get("task", "sequence-classification")).present.summary(m),
        (
            f"trained on {m['train_samples']} samples in {m['train_runtime_s']:.0f} s "
            f"({m['train_samples_per_second']:.1f} samples/s, world size {m['world_size']})"
        ),
    ]
    base = m.get("baseline")
    if base:
        lines.append(
            f"baseline {base['method']}: accuracy {base['accuracy']:.4f}, macro-F1 {base['f1_macro']:.4f} "
            f"-> fine-tuned model {'beats' if m['eval_accuracy'] > base['accuracy'] else 'does NOT beat'} it by "
            f"{100 * (m['eval_accuracy'] - base['accuracy']):+.1f} points"
        )
    lines.append(f"report: {out / 'report.html'}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/sentiment-minilm")))
