"""Asynchronous checkpoints (training.checkpoint_async): the background writer, the snapshot the step hands it,
a checkpoint absent until its writer completes it, pruning after the commit, errors raised where it is waited
for, and the strategies' copies (DDP's optimizer state, FSDP's DCP async save on a world of one)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from kubetune import checkpoint
from kubetune.artifacts.output import Output
from kubetune.checkpoint.writer import Writer, snapshot
from kubetune.config import parse_spec
from kubetune.distributed import DistEnv
from kubetune.training import strategy

SPEC = parse_spec({"name": "c", "model": {"uri": "m"}, "data": {"train": "t.csv"}, "output": {"uri": "o"}})


def _state(step: int, pending=None) -> dict:
    state = {
        "model": {"w": torch.full((2,), float(step))},
        "fingerprint": checkpoint.fingerprint(SPEC, ["a", "b"], 2),
        "progress": {"global_step": step},
    }
    if pending is not None:
        state[checkpoint.PENDING] = pending
    return state


def test_writer_runs_one_job_at_a_time_and_raises_its_error_at_the_wait():
    w, order, gate = Writer(), [], threading.Event()
    w.submit(lambda: (gate.wait(5), order.append(1)), name="a")
    assert w.in_flight
    gate.set()
    w.submit(lambda: order.append(2), name="b")  # waits for the first
    w.wait()
    assert order == [1, 2] and not w.in_flight

    def fail() -> None:
        raise OSError("disk full")

    w.submit(fail, name="c")
    with pytest.raises(OSError, match="disk full"):
        w.wait()
    w.wait()  # raised once


def test_snapshot_shares_no_tensor_and_no_container():
    live = {"a": [torch.zeros(2), (torch.ones(1), 3)], "b": {"c": torch.zeros(1)}, "d": "x"}
    copy = snapshot(live)
    live["a"][0].add_(1), live["a"][1][0].add_(1), live["b"]["c"].add_(1)
    live["a"].append(9), live["b"].update(e=1)
    assert copy["a"][0].tolist() == [0.0, 0.0] and copy["a"][1][0].tolist() == [1.0] and copy["a"][1][1] == 3
    assert copy["b"]["c"].tolist() == [0.0] and len(copy["a"]) == 2 and set(copy["b"]) == {"c"} and copy["d"] == "x"


def test_a_background_checkpoint_is_absent_until_complete_and_prunes_after(tmp_path):
    store = Output.resolve(str(tmp_path)).checkpoints
    store.save(_state(3), SPEC, 3, keep=1)  # synchronous: no PENDING entry
    (tmp_path / "history.jsonl").write_text("before\n")
    gate = threading.Event()
    path = store.save(_state(6, pending=lambda: gate.wait(5)), SPEC, 6, keep=1)
    (tmp_path / "history.jsonl").write_text("before\nafter\n")  # the checkpoint's copy is the history at the save
    # in flight: the previous checkpoint is whole, the new one not there, nothing pruned
    assert store.local_steps() == [3] and not path.exists() and store.latest().step == 3
    gate.set()
    store.wait()
    assert store.local_steps() == [6] and (path / "history.jsonl").read_text() == "before\n"
    saved = checkpoint.load(store.latest())
    assert saved["model"]["w"].tolist() == [6.0, 6.0] and checkpoint.PENDING not in saved


def test_a_failed_background_write_leaves_the_previous_checkpoint_and_raises_at_the_wait(tmp_path):
    store = Output.resolve(str(tmp_path)).checkpoints
    store.save(_state(3), SPEC, 3, keep=2)

    def lost() -> None:
        raise OSError("shards lost")

    store.save(_state(6, pending=lost), SPEC, 6, keep=2)
    with pytest.raises(OSError, match="shards lost"):
        store.wait()
    assert store.local_steps() == [3]
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]  # no temporary left


def test_the_next_save_and_clear_wait_for_the_one_in_flight(tmp_path):
    store = Output.resolve(str(tmp_path)).checkpoints
    gate = threading.Event()
    store.save(_state(3, pending=lambda: gate.wait(5)), SPEC, 3, keep=2)
    threading.Timer(0.2, gate.set).start()
    store.save(_state(6), SPEC, 6, keep=2)  # waits for step 3, then writes step 6
    assert store.local_steps() == [3, 6]
    gate.clear()
    store.save(_state(9, pending=lambda: gate.wait(5)), SPEC, 9, keep=2)
    threading.Timer(0.2, gate.set).start()
    store.clear()  # a checkpoint completed after the clear would outlive the run
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("async_save", [False, True])
def test_ddp_save_copies_the_optimizer_state_only_when_asynchronous(async_save):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    s = strategy.DDPStrategy(DistEnv(), torch.device("cpu"), async_save=async_save)
    s.wrap(model)
    saved = s.save(None, opt)
    before = saved["optimizer"]["state"][0]["exp_avg"].clone()
    model(torch.ones(1, 2)).sum().backward()
    opt.step()  # updates the live moments in place
    assert (checkpoint.PENDING in saved) is async_save
    assert torch.equal(saved["optimizer"]["state"][0]["exp_avg"], before) is async_save


@pytest.fixture
def world_of_one():
    assert not dist.is_initialized()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_fsdp_async_save_writes_the_state_of_its_step_while_training_goes_on(tmp_path, world_of_one):
    def make(where: torch.device) -> torch.nn.Module:
        torch.manual_seed(0)
        with torch.device(where):
            return torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)]))

    s = strategy.FSDPStrategy(DistEnv(), torch.device("cpu"), torch.float32, async_save=True)
    model = s.build(make)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)

    def step() -> None:
        x = torch.ones(1, 4)
        for layer in model[0]:
            x = layer(x)
        x.sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    at_save = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    entries = s.save(tmp_path, opt)
    assert s.shard_files(tmp_path) == []  # written in the background: the writer checks them (_written)
    step()  # changes the live weights while the shards are written
    entries[checkpoint.PENDING]()  # what the checkpoint's writer calls before it completes the checkpoint
    s.wait_saved()
    assert entries["sharded"] == "dcp" and (tmp_path / "shards" / ".metadata").exists()
    # a fresh model from the shards has the weights of the save's step
    loaded = strategy.FSDPStrategy(DistEnv(), torch.device("cpu"), torch.float32)
    fresh = loaded.build(make)
    loaded.load(tmp_path, {"sharded": "dcp"}, torch.optim.AdamW(fresh.parameters(), lr=0.1))
    got = {k: v.full_tensor() for k, v in fresh.state_dict().items()}
    assert got.keys() == at_save.keys() and all(torch.equal(got[k], at_save[k]) for k in got)
