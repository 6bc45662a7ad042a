"""The trainer is built, not self-assembling: ``training.build.build_trainer`` makes it from its
parts in this process (world size 1, no process group, no launcher), and one ``train_step()`` is
a public call that moves the run's named state forward."""

from __future__ import annotations

import torch
from conftest import tiny_spec

from kubetune import tasks
from kubetune.artifacts.output import Output
from kubetune.config import parse_spec
from kubetune.distributed import DistEnv
from kubetune.training.build import build_trainer
from kubetune.training.trainer import Trainer


def test_a_trainer_built_in_process_runs_train_step(small_csv, tmp_path):
    spec = parse_spec(
        tiny_spec(small_csv, tmp_path / "out", distributed={"nodes": 1, "procs_per_node": 1}, training__max_steps=3)
    )
    env, device = DistEnv(), torch.device("cpu")
    dest = Output.for_spec(spec)
    assert dest.claim(spec).action == "new"
    trainer = build_trainer(spec, env, tasks.get(spec.task), dest, device)
    assert isinstance(trainer, Trainer) and trainer.dest is dest and trainer.layout.total_steps == 3
    state = trainer.state
    assert (state.global_step, state.tokens_real, float(state.loss_units)) == (0, 0.0, 0.0)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}

    step = next(iter(trainer.epoch_batches(0)))
    stats = trainer.train_step(step)

    assert state.global_step == 1 and state.step_in_epoch == 1 and state.samples_seen == spec.training.batch_size
    assert stats["units"] == spec.training.batch_size and float(state.loss_units) == spec.training.batch_size
    assert float(state.loss_sum) > 0 and state.tokens_real > 0 and state.tokens_computed >= state.tokens_real
    changed = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed, "one optimizer step changed no weight"
    # the accumulators are what a checkpoint carries for this rank, by name
    assert state.accumulated().tolist()[:2] == [float(state.loss_sum), float(state.loss_units)]
    trainer.bar.close()
    trainer.events.close()
