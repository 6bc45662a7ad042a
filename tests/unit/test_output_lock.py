"""One live run per output (artifacts/lock.py): a second run is refused in one line while the first holds the
output, whoever it is, and takes it at once when the first has died (kill -9 included)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kubetune.artifacts import lock
from kubetune.artifacts.output import Output
from kubetune.config import parse_spec
from kubetune.errors import KubetuneError

# Another process holding an output as a run's rank 0 does (Output.claim), until it is killed.
_HOLDER = """
import sys
from kubetune.artifacts.output import Output
from kubetune.config import parse_spec
spec = parse_spec({"name": "first", "model": {"uri": "hf://o/m"}, "data": {"train": "t.csv"},
                   "output": {"uri": sys.argv[1]}})
print(Output.for_spec(spec).claim(spec).action, flush=True)
sys.stdin.read()
"""


def _spec(out: Path, name: str = "second"):
    return parse_spec(
        {"name": name, "model": {"uri": "hf://o/m"}, "data": {"train": "t.csv"}, "output": {"uri": str(out)}}
    )


@pytest.fixture
def holder(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "new"
    yield out, proc
    proc.kill()
    proc.wait()


def test_a_second_run_is_refused_in_one_line_while_the_first_holds_the_output(holder, monkeypatch):
    out, proc = holder
    monkeypatch.setattr(lock, "_RETRY_S", 0.3)  # the claim's wait for a probe to pass
    spec = _spec(out)
    calls = (
        lambda: Output.for_spec(spec).check(spec),  # `kubetune run`'s preflight
        lambda: Output.for_spec(spec).claim(spec),  # its rank 0
        lambda: lock.take(out, "second"),  # a run whose preflight passed just before the first took the output
    )
    for call in calls:
        with pytest.raises(KubetuneError) as e:
            call()
        message = str(e.value)
        assert message.startswith(f"output.uri: {out} is in use by another run that is still going (job 'first', ")
        assert f"pid {proc.pid} on " in message and "kill PID" in message and "\n" not in message
    assert sorted(os.listdir(out)) == [".kubetune-lock", ".kubetune-output"]  # the refused claim wrote nothing


def test_the_output_is_free_as_soon_as_its_holder_is_killed(holder):
    out, proc = holder
    proc.send_signal(signal.SIGKILL)  # no chance to clean up: the kernel releases the lock
    proc.wait()
    spec = _spec(out)
    # the first run's marker and nothing to resume: this one starts over there
    assert Output.for_spec(spec).check(spec).action == "restart"
    assert Output.for_spec(spec).claim(spec).action == "restart"
    assert '"job": "second"' in (out / ".kubetune-lock").read_text()


def test_a_probe_never_makes_a_starting_run_fail(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    lock.take(out, "mine")  # this process holds it: its own checks and claims pass
    lock.check(out)
    lock.take(out, "mine")
    spec = _spec(out)
    assert Output.for_spec(spec).claim(spec).action == "new"


def test_a_lock_file_that_is_a_fifo_or_a_link_is_one_line_not_a_hang(tmp_path):
    fifo_out, link_out = tmp_path / "fifo", tmp_path / "link"
    fifo_out.mkdir()
    os.mkfifo(fifo_out / ".kubetune-lock")
    link_out.mkdir()
    (link_out / ".kubetune-lock").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(KubetuneError, match=r"fifo/\.kubetune-lock is not a regular file — remove \.kubetune-lock"):
        lock.check(fifo_out)
    with pytest.raises(KubetuneError, match=r"cannot lock .*link: Too many levels of symbolic links"):
        lock.take(link_out, "x")
    assert not (tmp_path / "elsewhere").exists()


def test_what_a_finished_output_holds_is_said_whoever_holds_it(tmp_path):
    """Four runs at once on a finished run's output: this very job's "nothing to train" and another job's refusal
    are the same whatever else is at it (the lock is looked at only by a run that would write there)."""
    from kubetune.artifacts import output
    from kubetune.config import dump_spec

    out = tmp_path / "out"
    (out / "model").mkdir(parents=True)
    (out / "model" / "config.json").write_text("{}")
    (out / "metrics.json").write_text("{}")
    (out / "job.yaml").write_text(dump_spec(_spec(out, "first")))
    (out / output.MARKER).write_text("{}")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; from kubetune.artifacts import lock; "
         "lock.take(Path(sys.argv[1]), 'another'); print('held', flush=True); sys.stdin.read()", str(out)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        same = _spec(out, "first")
        assert Output.for_spec(same).check(same).action == "done"
        assert Output.for_spec(same).claim(same).action == "done"
        with pytest.raises(KubetuneError, match=r"holds a finished run \(metrics.json, model/\)"):
            Output.for_spec(_spec(out)).check(_spec(out))
        replacing = parse_spec({**_spec(out).model_dump(mode="json"), "output": {"uri": str(out), "overwrite": True}})
        with pytest.raises(KubetuneError, match="is in use by another run that is still going"):
            Output.for_spec(replacing).check(replacing)
    finally:
        holder.kill()
        holder.wait()
