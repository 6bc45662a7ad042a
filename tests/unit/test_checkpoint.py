"""Checkpoint files: atomic (no marker, no checkpoint), newest wins, pruning, RNG round trip."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kubetune import checkpoint
from kubetune.artifacts.output import Output
from kubetune.config import parse_spec
from kubetune.errors import KubetuneError

SPEC = parse_spec({"name": "c", "model": {"uri": "m"}, "data": {"train": "t.csv"}, "output": {"uri": "o"}})


def _state(step: int) -> dict:
    return {
        "model": {"w": torch.full((2,), float(step))},
        "fingerprint": checkpoint.fingerprint(SPEC, ["a", "b"], 2),
        "progress": {"global_step": step},
    }


def test_save_latest_and_prune(tmp_path):
    for step in (3, 6, 9):
        Output.resolve(str(tmp_path)).checkpoints.save(_state(step), SPEC, step, keep=2)
    assert checkpoint.complete_steps(tmp_path / "checkpoints") == [6, 9]
    found = Output.resolve(str(tmp_path)).checkpoints.latest()
    assert found.step == 9 and checkpoint.load(found)["model"]["w"].tolist() == [9.0, 9.0]


def test_incomplete_checkpoints_are_ignored(tmp_path):
    Output.resolve(str(tmp_path)).checkpoints.save(_state(3), SPEC, 3, keep=5)
    # A crash while writing step 6 leaves a temporary directory and a directory without its marker.
    (tmp_path / "checkpoints" / ".step-00000006-abc").mkdir()
    (tmp_path / "checkpoints" / "step-00000006").mkdir()
    (tmp_path / "checkpoints" / "step-00000006" / "state.pt").write_bytes(b"half")
    assert Output.resolve(str(tmp_path)).checkpoints.latest().step == 3


def test_rng_state_round_trip():
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    state = checkpoint.rng_state()
    a = (torch.rand(3).tolist(), np.random.rand(), random.random())
    torch.manual_seed(99), np.random.seed(99), random.seed(99)
    checkpoint.set_rng_state(state)
    assert (torch.rand(3).tolist(), np.random.rand(), random.random()) == a


@pytest.mark.parametrize(
    "change, field",
    [
        ({"labels": ["a", "c"]}, "data.label_column"),
        ({"world_size": 4}, "distributed"),
        ({"model": "other"}, "model.uri"),
        ({"task": "x"}, "task"),
    ],
)
def test_incompatible_fingerprints(change, field):
    saved = checkpoint.fingerprint(SPEC, ["a", "b"], 2)
    with pytest.raises(KubetuneError) as e:
        checkpoint.check_compatible(saved, {**saved, **change}, "out/checkpoints/step-00000003")
    assert str(e.value).startswith(f"{field}: the checkpoint in out/checkpoints/step-00000003")
    assert "--no-resume" in str(e.value)


def test_history_travels_with_the_checkpoint(tmp_path):
    import json

    from kubetune.artifacts import History

    out = tmp_path / "run"
    out.mkdir()
    h = History(out)
    for step in (1, 2, 3, 4):
        h.write({"type": "train", "step": step, "loss": 1.0 / step})
    h.close()
    found = checkpoint.Found(3, Output.resolve(str(out)).checkpoints.save(_state(3), SPEC, 3, keep=2))
    (out / "history.jsonl").unlink()  # a new machine: only the checkpoint's copy is left
    History(out, resume_step=3, saved=found.path / "history.jsonl").close()
    assert [json.loads(line)["step"] for line in (out / "history.jsonl").read_text().splitlines()] == [1, 2, 3]
