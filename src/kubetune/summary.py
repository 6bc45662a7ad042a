"""Print a short summary of a finished job: ``python -m kubetune.summary OUTPUT_DIR``."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def summary(out: Path) -> str:
    from kubetune import tasks
    from kubetune.config.tasks import default_task

    m = json.loads((out / "metrics.json").read_text())
    # metrics.json has named its task since the second task landed; older ones are the default task's.
    present = tasks.get(m.get("task") or default_task()).present
    lines = [
        present.summary(m),
        (
            f"trained on {m['train_samples']} samples in {m['train_runtime_s']:.0f} s "
            f"({m['train_samples_per_second']:.1f} samples/s, world size {m['world_size']})"
        ),
    ]
    lines += present.reference_summary(m)
    lines.append(f"report: {out / 'report.html'}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/sentiment-minilm")))
