"""The training recipe's builders, picked by spec fields (``training/recipe.py``): each optimizer and
schedule builds from a spec and follows transformers' curve, a bad choice is one line naming the field,
the defaults build exactly the optimizer and schedule every run had before the choices; the recipe's
fingerprint lets a checkpoint of that time resume; and a checkpoint's contents are declared once
(``training/state.py``), in the layout checkpoints had before."""

from __future__ import annotations

import pytest
import torch
import transformers

from kubetune import checkpoint
from kubetune.config import parse_spec
from kubetune.config.load import field_reference
from kubetune.distributed import DistEnv
from kubetune.errors import KubetuneError, SpecError
from kubetune.training import recipe
from kubetune.training.guard import FiniteGuard
from kubetune.training.state import TrainState, contents

CPU = torch.device("cpu")
BASE = {"name": "r", "model": {"uri": "m"}, "data": {"train": "t.csv"}, "output": {"uri": "runs/r"}}


def _spec(**training):
    return parse_spec({**BASE, "training": {"learning_rate": 1e-2, "warmup_ratio": 0.2, **training}})


class _Tiny(torch.nn.Module):
    """Weights (decayed), a bias and a norm (not decayed), and a frozen weight (left out)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.frozen = torch.nn.Linear(4, 4)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.norm(self.proj(x) + self.frozen(x))


def _before(model, cfg, total_steps):
    """The optimizer and schedule every run had before training.optimizer and training.lr_scheduler
    (tasks/common.py's build_optimizer, as it was)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, fused=True)
    warmup = int(round(cfg.warmup_ratio * total_steps))
    return optimizer, transformers.get_linear_schedule_with_warmup(optimizer, warmup, total_steps)


def _train(model, optimizer, scheduler, steps: int) -> list[float]:
    torch.manual_seed(1)
    lrs = []
    for _ in range(steps):
        model(torch.randn(3, 4)).pow(2).sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        lrs.append(scheduler.get_last_lr()[0])
    return lrs


def test_the_defaults_are_the_fused_adamw_in_two_groups_and_the_linear_schedule_bit_for_bit():
    cfg = _spec().training
    assert (cfg.optimizer, cfg.lr_scheduler) == ("adamw", "linear")
    model, twin = _Tiny(), _Tiny()
    optimizer, scheduler = recipe.build_optimizer(model, cfg, 10, CPU)
    old_optimizer, old_scheduler = _before(twin, cfg, 10)
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"] is True
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0.0]
    names = {id(p): n for n, p in model.named_parameters()}
    assert [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups] == [
        ["proj.weight"],
        ["proj.bias", "norm.weight", "norm.bias"],
    ]
    assert {k: v for k, v in optimizer.defaults.items()} == old_optimizer.defaults
    assert _train(model, optimizer, scheduler, 10) == _train(twin, old_optimizer, old_scheduler, 10)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))
    assert optimizer.state_dict()["state"].keys() == old_optimizer.state_dict()["state"].keys()


@pytest.mark.parametrize(
    "choice, kind, flags",
    [
        ({"optimizer": "adamw"}, torch.optim.AdamW, {"fused": True, "lr": 1e-2}),
        ({"optimizer": "adamw_foreach"}, torch.optim.AdamW, {"fused": None, "foreach": True, "lr": 1e-2}),
        ({"optimizer": "sgd"}, torch.optim.SGD, {"fused": True, "momentum": 0.9, "lr": 1e-2}),
        ({"optimizer": "sgd", "momentum": 0.0}, torch.optim.SGD, {"momentum": 0.0}),
    ],
)
def test_each_optimizer_builds_from_the_spec_and_steps(choice, kind, flags):
    model = _Tiny()
    optimizer, scheduler = recipe.build_optimizer(model, _spec(**choice).training, 6, CPU)
    assert type(optimizer) is kind
    assert {k: optimizer.defaults[k] for k in flags} == flags
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0.0]
    before = model.proj.weight.detach().clone()
    _train(model, optimizer, scheduler, 2)
    assert not torch.equal(before, model.proj.weight)


def _lrs(make, steps: int) -> list[float]:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-2)
    scheduler = make(optimizer)
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize(
    "choice, expected",
    [
        ({}, lambda o: transformers.get_linear_schedule_with_warmup(o, 4, 20)),
        ({"lr_scheduler": "cosine"}, lambda o: transformers.get_cosine_schedule_with_warmup(o, 4, 20)),
        ({"lr_scheduler": "constant"}, lambda o: transformers.get_constant_schedule_with_warmup(o, 4)),
        (
            {"lr_scheduler": "wsd"},
            lambda o: transformers.get_wsd_schedule(o, 4, num_decay_steps=2, num_training_steps=20),
        ),
        (
            {"lr_scheduler": "wsd", "decay_ratio": 0.5},
            lambda o: transformers.get_wsd_schedule(o, 4, num_decay_steps=10, num_training_steps=20),
        ),
        # 25 steps: 8 of warmup (7.5 rounded) and 18 of decay (17.5) would be one past the run: the decay gets
        # what the warmup leaves
        (
            {"lr_scheduler": "wsd", "warmup_ratio": 0.3, "decay_ratio": 0.7},
            lambda o: transformers.get_wsd_schedule(o, 8, num_decay_steps=17, num_training_steps=25),
        ),
    ],
)
def test_each_schedule_follows_transformers_curve(choice, expected):
    cfg = _spec(**choice).training
    total = 25 if cfg.decay_ratio == 0.7 else 20
    got = _lrs(lambda o: recipe.SCHEDULES[cfg.lr_scheduler](o, int(round(cfg.warmup_ratio * total)), total, cfg), total)
    assert got == _lrs(expected, total)
    assert got[0] == 0.0 and max(got) == pytest.approx(1e-2)


def test_every_choice_of_the_spec_has_a_builder():
    fields = type(_spec().training).model_fields
    assert set(fields["optimizer"].annotation.__args__) == set(recipe.OPTIMIZERS)
    assert set(fields["lr_scheduler"].annotation.__args__) == set(recipe.SCHEDULES)
    keys = {row[0] for row in field_reference()}  # what `kubetune explain training` lists
    assert {"training.optimizer", "training.momentum", "training.lr_scheduler", "training.decay_ratio"} <= keys


@pytest.mark.parametrize(
    "training, start",
    [
        ({"optimizer": "adam"}, "training.optimizer: Input should be 'adamw', 'adamw_foreach', 'sgd' or 'adamw_8bit'"),
        ({"lr_scheduler": "poly"}, "training.lr_scheduler: Input should be 'linear', 'cosine', 'constant' or 'wsd'"),
        ({"momentum": 1.5}, "training.momentum: "),
        ({"decay_ratio": 0}, "training.decay_ratio: "),
        # a cross check: said as the other cross-field problems are
        ({"lr_scheduler": "wsd", "warmup_ratio": 0.5, "decay_ratio": 0.6}, "spec: training.decay_ratio 0.6 and "),
    ],
)
def test_a_bad_choice_is_one_line_naming_the_field(training, start):
    with pytest.raises(SpecError) as e:
        parse_spec({**BASE, "training": training})
    assert len(e.value.problems) == 1, e.value.problems
    line = e.value.problems[0]
    assert line.startswith(start) and "\n" not in line, line


def test_a_wsd_warmup_and_decay_that_fill_the_run_are_accepted():
    assert _spec(lr_scheduler="wsd", warmup_ratio=0.5, decay_ratio=0.5).training.decay_ratio == 0.5
    assert _spec(warmup_ratio=0.5, decay_ratio=0.9).training.lr_scheduler == "linear"  # ignored unless wsd


@pytest.mark.parametrize(
    "device, missing",
    [
        ("cpu", "adamw_8bit (bitsandbytes' 8-bit AdamW) needs a CUDA GPU and this worker runs on cpu"),
        ("cuda", "adamw_8bit needs bitsandbytes, which is not installed"),  # this environment has none
    ],
)
def test_adamw_8bit_without_its_needs_is_one_line_naming_the_fix(device, missing):
    """Refused when the trainer is built (before the data and the model), on the worker that lacks it."""
    try:
        import bitsandbytes  # noqa: F401

        pytest.skip("bitsandbytes is installed here")
    except ImportError:
        pass
    cfg = _spec(optimizer="adamw_8bit").training
    with pytest.raises(KubetuneError) as e:
        recipe.build_optimizer(_Tiny(), cfg, 10, torch.device(device))  # a cuda device object needs no GPU
    line = str(e.value)
    assert line.startswith(f"training.optimizer: {missing} — ") and "\n" not in line, line
    assert "training.optimizer: adamw" in line  # the fix names what runs without it


def test_the_guard_hands_found_inf_only_to_a_fused_optimizer():
    """A non-fused kernel asserts that found_inf is None: the guard must not set it there."""
    for choice, skips in (("adamw", True), ("sgd", True), ("adamw_foreach", False)):
        model = _Tiny()
        optimizer, _ = recipe.build_optimizer(model, _spec(optimizer=choice, warmup_ratio=0).training, 4, CPU)
        guard = FiniteGuard(optimizer, CPU, enabled=True)
        model(torch.randn(2, 4)).sum().backward()
        before = model.proj.weight.detach().clone()
        guard.after_backward(torch.tensor(float("nan")), None, 1)
        optimizer.step()
        assert guard.skips is skips and int(guard.first_bad) == 1
        assert torch.equal(before, model.proj.weight) is skips  # fused: the non-finite step skipped on the device


# ---- the recipe in the checkpoint's fingerprint ----
def _fp(**training) -> dict:
    return checkpoint.fingerprint(_spec(**training), ["a", "b"], 2)


def _older(fp: dict) -> dict:
    """The fingerprint a kubetune before training.optimizer and training.lr_scheduler wrote."""
    keys = set(checkpoint._TRAJECTORY)
    return {**fp, "training": {k: v for k, v in fp["training"].items() if k in keys}}


def test_a_run_at_the_default_recipe_fingerprints_as_before_and_resumes_an_older_checkpoint():
    current = _fp()
    assert current == _older(current)  # nothing new in it: the marker of a default run is the one written before
    checkpoint.check_compatible(_older(_fp()), current, "out/checkpoints/step-00000003")
    # and spelled out at their defaults, the choices change nothing
    spelled = _fp(optimizer="adamw", lr_scheduler="linear", momentum=0.5, decay_ratio=0.3)
    checkpoint.check_compatible(_older(_fp()), spelled, "ckpt")


@pytest.mark.parametrize(
    "saved, current, message",
    [
        ({}, {"optimizer": "sgd"}, "training.optimizer: the checkpoint in ckpt was written with training.optimizer "),
        ({"optimizer": "sgd"}, {}, "training.optimizer: the checkpoint in ckpt was written with training.optimizer "),
        ({"optimizer": "sgd"}, {"optimizer": "sgd", "momentum": 0.5}, "training.momentum: "),
        ({}, {"lr_scheduler": "cosine"}, "training.lr_scheduler: the checkpoint in ckpt was written with "),
        ({"lr_scheduler": "wsd"}, {"lr_scheduler": "wsd", "decay_ratio": 0.2}, "training.decay_ratio: "),
        ({"lr_scheduler": "wsd"}, {}, "training.lr_scheduler: "),
    ],
)
def test_another_recipe_refuses_the_resume_in_one_line(saved, current, message):
    with pytest.raises(KubetuneError) as e:
        checkpoint.check_compatible(_fp(**saved), _fp(**current), "ckpt")
    line = str(e.value)
    assert line.startswith(message) and "--no-resume" in line and "\n" not in line, line


def test_an_older_checkpoint_is_refused_under_another_recipe():
    with pytest.raises(KubetuneError, match=r"training\.optimizer 'adamw', this run has 'sgd'"):
        checkpoint.check_compatible(_older(_fp()), _fp(optimizer="sgd"), "ckpt")


@pytest.mark.parametrize(
    "saved, current",
    [
        ({"momentum": 0.1}, {"momentum": 0.5}),  # read by sgd only
        ({"decay_ratio": 0.1}, {"decay_ratio": 0.5}),  # read by wsd only
        ({"optimizer": "sgd", "decay_ratio": 0.1}, {"optimizer": "sgd", "decay_ratio": 0.5}),
    ],
)
def test_a_field_the_recipe_does_not_read_does_not_refuse_the_resume(saved, current):
    checkpoint.check_compatible(_fp(**saved), _fp(**current), "ckpt")


# ---- a checkpoint's contents, declared once ----
class _Strategy:
    """What ``Contents`` asks of a strategy on load; records the order it was asked in."""

    def __init__(self, calls):
        self.calls = calls

    def load(self, directory, saved, optimizer):
        self.calls.append("model")


def _run_parts(fingerprint: dict, where: str = "ckpt"):
    model = _Tiny()
    optimizer, scheduler = recipe.build_optimizer(model, _spec().training, 10, CPU)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    state = TrainState.fresh(CPU, 1)
    return state, scheduler, contents(state, scheduler, scaler, fingerprint, DistEnv(), where=where)


def test_the_contents_write_the_entries_checkpoints_always_had_in_their_order():
    state, scheduler, parts = _run_parts(_fp())
    state.global_step, state.loss_sum = 3, torch.tensor(2.0, dtype=torch.float64)
    written = parts.state_dict()
    assert list(written) == ["scheduler", "scaler", "progress", "rng", "fingerprint"]
    assert written["scheduler"] == scheduler.state_dict() and written["fingerprint"] == _fp()
    assert written["progress"]["global_step"] == 3 and written["progress"]["log_loss"] == [[2.0, 0.0, 0.0]]
    assert len(written["rng"]) == 1 and set(written["rng"][0]) == {"torch", "cuda", "numpy", "python"}


def test_a_checkpoint_in_the_layout_written_before_loads_fingerprint_first():
    """The state.pt the trainer wrote before the contents were declared (its keys spelled out here) loads
    through them: the fingerprint checked before the model, the rest restored."""
    _, scheduler, parts = _run_parts(_fp())
    for _ in range(4):
        scheduler.optimizer.step()
        scheduler.step()
    written_before = {
        "model": {},
        "optimizer": {},
        "scheduler": scheduler.state_dict(),
        "scaler": torch.amp.GradScaler("cpu", enabled=False).state_dict(),
        "progress": {
            "epoch": 0,
            "step_in_epoch": 4,
            "global_step": 4,
            "samples_seen": 64,
            "train_time": 1.5,
            "logged_losses": [0.7],
            "log_loss": [[1.0, 2.0, 3.0]],
            "tokens": [[10.0, 12.0]],
            "logger_runs": {},
        },
        "rng": [checkpoint.rng_state()],
        "fingerprint": _older(_fp()),
    }
    expected = torch.rand(2)
    state, resumed_scheduler, resumed = _run_parts(_fp())
    calls = []
    resumed.load_state_dict(written_before, _Strategy(calls), "ckpt", None)
    assert calls == ["model"]
    assert (state.global_step, state.step_in_epoch, state.samples_seen, state.train_time) == (4, 4, 64, 1.5)
    assert state.accumulated().tolist() == [1.0, 2.0, 3.0] and (state.tokens_real, state.tokens_computed) == (10, 12)
    assert resumed_scheduler.state_dict() == written_before["scheduler"]
    assert torch.equal(torch.rand(2), expected)  # the RNG continues where the checkpoint took it
    # another run's checkpoint: refused before the model is touched
    other = {**written_before, "fingerprint": _fp(optimizer="sgd")}
    calls.clear()
    with pytest.raises(KubetuneError, match=r"^training\.optimizer: the checkpoint in ckpt"):
        _run_parts(_fp())[2].load_state_dict(other, _Strategy(calls), "ckpt", None)
    assert calls == []
