"""Issue 63, row 8: a reward model's margin column. Numbers (the documented form) are taken for text pairs as for
chat pairs; a margin beyond float32's range (the loss's), which would end as a non-finite loss (1e39) or silently
zero a pair (-1e39), is refused in one line naming the column, the row and the value."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kubetune.errors import KubetuneError
from kubetune.tasks.reward_model import RewardData
from kubetune.tasks.reward_model.task import load_frames

MARGINS = [0.5, 2, -1.25, 3.4e38, 0, 7]  # every one finite in float32 (3.4e38 is just below its largest)


def _pairs(path, fmt: str, margins: list) -> str:
    rows = []
    for i, m in enumerate(margins):
        if fmt == "text":
            rows.append({"prompt": f"question {i}", "chosen": f"good {i}", "rejected": f"bad {i}", "margin": m})
        else:
            rows.append(
                {
                    "prompt": [{"role": "user", "content": f"question {i}"}],
                    "chosen": [{"role": "assistant", "content": f"good {i}"}],
                    "rejected": [{"role": "assistant", "content": f"bad {i}"}],
                    "margin": m,
                }
            )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _margins(frames) -> dict[str, float]:
    """answer -> margin of every pair kept, train and eval."""
    out = {}
    for part in (frames.train, frames.eval):
        for rec in part["record"]:
            r = json.loads(rec)
            chosen = r["chosen"] if isinstance(r["chosen"], str) else r["chosen"][0]["content"]
            out[chosen] = r["margin"]
    return out


@pytest.mark.parametrize("fmt,declared", [("text", "auto"), ("text", "text"), ("chat", "auto"), ("chat", "chat")])
def test_numeric_margins_are_taken_for_text_and_chat_pairs(tmp_path, fmt, declared):
    train = _pairs(tmp_path / "pairs.jsonl", fmt, MARGINS)
    frames = load_frames(RewardData(train=train, format=declared, margin_column="margin", eval_fraction=0.34), 0)
    assert frames.format == fmt
    assert _margins(frames) == {f"good {i}": float(m) for i, m in enumerate(MARGINS)}
    # each margin is finite where the loss computes it
    assert np.isfinite(np.asarray(list(_margins(frames).values()), dtype=np.float32)).all()


@pytest.mark.parametrize("fmt", ["text", "chat"])
@pytest.mark.parametrize(
    "bad,shown",
    [
        (1e39, "1e+39"),  # inf in float32: a non-finite loss, blamed on the learning rate
        (-1e39, "-1e+39"),  # -inf in float32: the pair's loss silently 0
        ("1e39", "'1e39'"),  # a number as text, read as one
        (-3.5e38, "-3.5e+38"),
    ],
)
def test_a_margin_beyond_float32_is_one_line_naming_column_row_and_value(tmp_path, fmt, bad, shown):
    margins = [1.0, 2.0, bad, 1.0, 0.5, 0.25]
    train = _pairs(tmp_path / "pairs.jsonl", fmt, margins)
    with pytest.raises(KubetuneError) as e:
        load_frames(RewardData(train=train, margin_column="margin", eval_fraction=0.34), 0)
    line = str(e.value)
    assert "\n" not in line and e.value.field == "data.margin_column", line
    assert f"row 2 of {train}: column 'margin' holds {shown}, beyond float32's range" in line, line
    assert "give numbers within ±3.403e+38 in 'margin'" in line, line


def test_a_text_column_of_numbers_is_still_refused_beside_a_margin(tmp_path):
    """Only the margin column may hold numbers: a prompt column of numbers is still the wrong column."""
    path = tmp_path / "pairs.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": i, "chosen": f"a{i}", "rejected": f"b{i}", "margin": i}) + "\n" for i in range(6))
    )
    with pytest.raises(KubetuneError) as e:
        load_frames(RewardData(train=str(path), format="text", margin_column="margin"), 0)
    assert e.value.field == "data.prompt_column" and "holds numbers (int64), not text" in str(e.value)
