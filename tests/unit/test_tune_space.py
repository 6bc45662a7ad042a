"""The ``tune`` section checked against the spec before any trial starts (one line naming the field, the value
and the fix), the trials' specs, and the samplers' grids — without running a trial."""

from __future__ import annotations

import os
import time

import pytest

from kubetune.config.load import parse_spec
from kubetune.errors import KubetuneError, SpecError
from kubetune.tune import space


def _raw(**tune) -> dict:
    return {
        "name": "search",
        "task": "sequence-classification",
        "model": {"uri": "/models/minilm"},
        "data": {"train": "/data/reviews.csv"},
        "training": {"eval_every": 10},
        "distributed": {"procs_per_node": 1},
        "output": {"uri": "/tmp/study"},
        "tune": {
            "space": {
                "training.learning_rate": {"type": "float", "low": 1e-5, "high": 1e-3, "log": True},
                "lora.r": {"type": "choice", "values": [4, 8]},
            },
            "objective": "eval_accuracy",
            **tune,
        },
    }


def _check(raw: dict, gpus: list[str] | None = None) -> None:
    space.check(parse_spec(raw), gpus or [])


def test_a_valid_section_passes_and_a_trial_spec_is_the_users_with_the_values_in():
    raw = _raw()
    _check(raw)
    trial = space.trial_spec(raw, {"training.learning_rate": 3e-4, "lora.r": 8}, "/tmp/study/trials/trial-000")
    spec = parse_spec(trial)
    assert spec.tune is None and spec.output.uri == "/tmp/study/trials/trial-000"
    assert spec.training.learning_rate == 3e-4 and spec.lora.r == 8 and spec.training.eval_every == 10
    assert raw["tune"] and "lora" not in raw  # the user's spec is not changed


@pytest.mark.parametrize(
    "change, field, says",
    [
        ({"space": {"training.learnin_rate": {"type": "float", "low": 1e-5, "high": 1e-3}}}, "tune.space", "learnin"),
        ({"space": {"training.warmup_ratio": {"type": "float", "low": 0.1, "high": 1.5}}}, "tune.space", "1.5"),
        ({"space": {"lora.r": {"type": "choice", "values": [8, 0]}}}, "tune.space.lora.r", "lora.r = 0"),
        ({"space": {"output.uri": {"type": "choice", "values": ["/a"]}}}, "tune.space.output.uri", "kubetune's"),
        ({"objective": "eval_acuracy"}, "tune.objective", "eval_accuracy"),
        ({"algorithm": "cmaes"}, "tune.algorithm", "choice"),
        ({"algorithm": "grid"}, "tune.space.training.learning_rate", "continuous"),
        ({"parallel": (os.cpu_count() or 1) + 1}, "tune.parallel", "cores"),
    ],
)
def test_what_cannot_run_is_one_line_before_any_trial(change, field, says):
    with pytest.raises(KubetuneError) as e:
        _check(_raw(**change))
    text = str(e.value)
    assert e.value.field.startswith(field) and says in text and "\n" not in text, (e.value.field, text)


def test_early_stopping_needs_evaluations_during_training():
    raw = _raw(early_stopping={"min_trials": 2})
    raw["training"] = {}
    with pytest.raises(KubetuneError) as e:
        _check(raw)
    assert e.value.field == "tune.early_stopping" and "eval_every" in str(e.value)


def test_the_section_itself_is_checked_by_the_spec():
    with pytest.raises(SpecError) as e:
        parse_spec(_raw(space={"training.learning_rate": {"type": "float", "low": 0, "high": 1e-3, "log": True}}))
    assert "log scale needs low above 0" in str(e.value)
    with pytest.raises(SpecError):
        parse_spec(_raw(space={"lora.r": {"type": "choice"}}))


def test_a_grid_lists_every_value_and_the_samplers_are_optunas():
    spec = parse_spec(_raw(space={"lora.r": {"type": "int", "low": 4, "high": 16, "step": 4}}, algorithm="grid"))
    assert spec.tune.space["lora.r"].grid() == [4, 8, 12, 16]
    assert type(space.sampler(spec.tune)).__name__ == "GridSampler"
    assert spec.tune.minimize() is False  # accuracy: maximized
    assert parse_spec(_raw(objective="eval_loss")).tune.minimize() is True


def test_trials_side_by_side_share_the_cores():
    cores = os.cpu_count() or 1
    assert space.threads_per_trial(parse_spec(_raw())) is None  # one at a time: the run takes them all
    assert space.threads_per_trial(parse_spec(_raw(parallel=2))) == max(1, cores // 2)
    raw = _raw(parallel=2)
    raw["distributed"]["threads_per_proc"] = 1
    assert space.threads_per_trial(parse_spec(raw)) is None  # the spec's own setting stands


def test_on_gpus_trials_at_once_get_devices_of_their_own():
    """A machine with 4 GPUs (a list of their names stands in for CUDA, which this CPU machine lacks): 2 trials of 2
    processes fit, 3 do not; each running trial leases its own, returned when it ends."""
    import threading

    from kubetune.tune import devices

    gpus = ["0", "1", "2", "3"]
    _check({**_raw(parallel=2), "distributed": {"procs_per_node": 2}}, gpus)
    with pytest.raises(KubetuneError) as e:
        _check({**_raw(parallel=3), "distributed": {"procs_per_node": 2}}, gpus)
    assert e.value.field == "tune.parallel" and "need 6 GPUs" in str(e.value) and "at most 2" in e.value.fix

    pool = devices.GpuPool(["0", "1", "2", "3"], per_trial=2)
    with pool.lease() as a, pool.lease() as b:
        assert sorted(a + b) == ["0", "1", "2", "3"]
        got: list[list[str]] = []
        third = threading.Thread(target=lambda: got.append(pool.lease().__enter__()))
        third.start()
        third.join(timeout=0.3)
        assert third.is_alive() and got == []  # waits while every GPU is leased
    third.join(timeout=5)
    assert not third.is_alive() and len(got[0]) == 2 and set(got[0]) <= {"0", "1", "2", "3"}


def test_kubetune_tune_without_a_tune_section_is_one_line(tmp_path):
    from pathlib import Path

    from typer.testing import CliRunner

    from kubetune.cli import app

    spec = Path(__file__).resolve().parents[2] / "examples" / "sentiment-minilm.yaml"
    for extra in ([], ["--status"]):
        result = CliRunner().invoke(app, ["tune", str(spec), *extra])
        assert result.exit_code != 0 and result.stdout == ""
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith("error: ") and "no tune section" in line and "tune:" in line, line


def test_a_study_on_gpus_starts_each_trial_on_gpus_no_other_running_trial_has(tmp_path, monkeypatch):
    """The study itself (Search over Optuna, 2 trials at once on 4 GPUs, 2 processes each): every trial's run is
    started with a CUDA_VISIBLE_DEVICES of its own while they overlap (a stand-in for `kubetune run` records it)."""
    import threading

    import optuna

    from kubetune.tune import study

    started: list[tuple[float, float, str]] = []
    lock = threading.Lock()

    class Run:  # `kubetune run` as the study sees it: running a while, then failed (no metrics to read)
        def __init__(self, argv, env, **_):
            self.t0, self.gpus, self.pid, self.returncode = time.monotonic(), env["CUDA_VISIBLE_DEVICES"], 0, None

        def poll(self):
            if time.monotonic() - self.t0 < 0.6:
                return None
            with lock:
                started.append((self.t0, time.monotonic(), self.gpus))
            self.returncode = 1
            return 1

    monkeypatch.setattr(study.subprocess, "Popen", Run)
    monkeypatch.setattr(study, "POLL_S", 0.05)
    raw = {**_raw(parallel=2), "distributed": {"procs_per_node": 2}, "output": {"uri": str(tmp_path)}}
    spec = parse_spec(raw)
    for sub in ("trials", "specs", "logs"):
        (tmp_path / sub).mkdir()
    search = study.Search(raw, spec, tmp_path, ["0", "1", "2", "3"])
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optuna.create_study().optimize(search._objective, n_trials=4, n_jobs=2, catch=(study.TrialFailed,))
    assert len(started) == 4 and all(len(g.split(",")) == 2 for _, _, g in started)
    overlapping = [(a, b) for a in started for b in started if a is not b and a[0] < b[1] and b[0] < a[1]]
    assert overlapping  # two at once did run
    for a, b in overlapping:
        assert not set(a[2].split(",")) & set(b[2].split(",")), started
