"""Sharded training (FSDP2) end to end on the shipped tiny Llama, 2 gloo processes: it trains like
DDP (same weights within reduction-order noise), exports a Hugging Face model that transformers
loads, writes DCP checkpoints that resume bit-identically after a SIGKILL, and resumes on another
number of processes with every example trained at the same global step."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, kubetune, kubetune_together, start_run, wait_for_checkpoint, worker_pid, write_spec

pytestmark = pytest.mark.integration
CHAT = "pkg://kubetune/assets/sentiment/sentiment-chat.jsonl"


def _spec(out: Path, strategy: str, procs: int = 2, **training) -> dict:
    return {
        "name": "fsdp-tiny",
        "task": "causal-lm",
        "model": {"uri": "pkg://kubetune/assets/tiny-llama"},
        "data": {"train": CHAT, "format": "chat", "eval_fraction": 0.05, "max_length": 96, "max_train_samples": 160},
        "training": {
            "epochs": 1,
            "max_steps": 10,
            "batch_size": 4,
            "grad_accum": 2,
            "learning_rate": 2e-3,
            "precision": "fp32",
            "log_every": 1,
            "checkpoint_every": 2,
            "eval_batch_size": 2,
            "seed": 3,
            **training,
        },
        "distributed": {"procs_per_node": procs, "strategy": strategy},
        "output": {"uri": str(out)},
    }


def _run(tmp: Path, spec: dict, *args: str) -> tuple[Path, Path]:
    """Run ``spec`` to the end with a row trace; (output, trace directory)."""
    trace = tmp / f"trace-{time.time_ns()}"
    r = kubetune("run", str(write_spec(tmp / "job.yaml", spec)), *args, env={"KUBETUNE_TRACE_DIR": str(trace)})
    assert r.returncode == 0, r.stderr[-3000:]
    return Path(spec["output"]["uri"]), trace


def _run_together(tmp: Path, specs: dict[str, dict]) -> dict[str, tuple[Path, Path]]:
    """_run for independent specs (their own outputs), run at the same time: name -> (output, trace)."""
    calls = {}
    for name, spec in specs.items():
        (tmp / name).mkdir(exist_ok=True)
        calls[name] = (
            ("run", str(write_spec(tmp / name / "job.yaml", spec))),
            {"KUBETUNE_TRACE_DIR": str(tmp / name / "trace")},
        )
    results = kubetune_together(*calls.values())
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    return {name: (Path(spec["output"]["uri"]), tmp / name / "trace") for name, spec in specs.items()}


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights = {}
    for f in sorted((out / "model").glob("*.safetensors")):
        weights.update(load_file(f))
    return weights


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _steps(trace: Path) -> dict[int, set[int]]:
    """global step -> the rows trained in it (every rank, every micro-batch)."""
    steps: dict[int, set[int]] = {}
    for f in trace.glob("rank*.jsonl"):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            steps.setdefault(rec["step"], set()).update(rec["rows"])
    return steps


@pytest.fixture(scope="module")
def reference(tmp_path_factory, request):
    """Uninterrupted 2-process runs, FSDP and DDP, run at the same time (checkpoints at 5 and 10 only:
    that a finished run clears them is asserted, and writing them changes no weight). The SIGKILLed
    FSDP run the resume tests start from runs beside them: each run leaves a core idle while it starts,
    and the kill waits for that run's own checkpoint, whatever the others do."""
    tmp = tmp_path_factory.mktemp("ref")
    if any("killed" in getattr(item, "fixturenames", ()) for item in request.session.items):  # make test-e2e
        request.getfixturevalue("killed").start("fsdp")
    return _run_together(tmp, {s: _spec(tmp / s / "out", s, checkpoint_every=5) for s in ("fsdp", "ddp")})


def test_fsdp_trains_like_ddp_and_exports_a_model_transformers_loads(reference):
    from transformers import AutoModelForCausalLM

    (fsdp, _), (ddp, _) = reference["fsdp"], reference["ddp"]
    mf, md = (json.loads((o / "metrics.json").read_text()) for o in (fsdp, ddp))
    assert (mf["strategy"], md["strategy"]) == ("fsdp", "ddp")
    assert len(mf["peak_host_memory_gib"]) == 2 and min(mf["peak_host_memory_gib"]) > 0
    # The same maths over the same rows; only the order of the reductions differs. The tied
    # embedding and output projection differ most: most of its vocabulary rows get only the
    # softmax's tiny probabilities as gradient, and AdamW turns their reduction-order noise into
    # updates of lr's size (1.6e-5 here; 8.4e-6 when the loss took all the logits at once, every
    # other tensor below 1e-6 in both). 5e-5 is 2.5 % of one step's lr.
    wf, wd = _weights(fsdp), _weights(ddp)
    tied = "model.embed_tokens.weight"
    rest = _max_diff({k: v for k, v in wf.items() if k != tied}, {k: v for k, v in wd.items() if k != tied})
    embedding = _max_diff({tied: wf[tied]}, {tied: wd[tied]})
    print(f"fsdp vs ddp, 2 processes, uninterrupted: max |diff| {rest:.3g}, tied embedding {embedding:.3g}")
    assert rest < 1e-5, rest
    assert embedding < 5e-5, embedding
    assert abs(mf["eval_loss"] - md["eval_loss"]) < 1e-4
    assert not (fsdp / "checkpoints").exists()  # a finished run clears its checkpoints
    model = AutoModelForCausalLM.from_pretrained(fsdp / "model").eval()
    # tied input and output embeddings stay tied in the export
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[0, 5, 9, 11]])
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()
    r = kubetune("predict", str(fsdp), "What is the sentiment of this review? great seats", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "completion" in json.loads(r.stdout)[0]


@pytest.mark.e2e  # make test: FSDP against DDP above (full fine-tune); LoRA under DDP in test_causal_lm.py
def test_lora_with_activation_checkpointing_under_fsdp_matches_ddp_and_exports_adapter_and_merged_model(tmp_path):
    from safetensors.torch import load_file

    specs = {}
    for strategy in ("fsdp", "ddp"):
        spec = _spec(tmp_path / strategy / "out", strategy, max_steps=4, checkpoint_every=None)
        spec["lora"] = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}
        # activation checkpointing per block under FSDP (recomputing changes no number)
        spec["training"]["gradient_checkpointing"] = strategy == "fsdp"
        specs[strategy] = spec
    outs = {strategy: run[0] for strategy, run in _run_together(tmp_path, specs).items()}
    adapters = [load_file(outs[s] / "adapter" / "adapter_model.safetensors") for s in ("fsdp", "ddp")]
    assert len(adapters[0]) == 2 * 2 * 7  # A and B of 7 linear layers in each of the 2 blocks
    assert _max_diff(*adapters) < 1e-5
    assert _max_diff(_weights(outs["fsdp"]), _weights(outs["ddp"])) < 1e-5  # merged
    base = load_file(ROOT / "src/kubetune/assets/tiny-llama/model.safetensors")
    merged = _weights(outs["fsdp"])
    assert (merged["model.layers.0.mlp.up_proj.weight"] - base["model.layers.0.mlp.up_proj.weight"]).abs().max() > 0


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """strategy -> a 2-process run whose rank 1 was SIGKILLed after its step-4 checkpoint: the
    output (holding its checkpoints), its trace, and the newest complete checkpoint's step."""

    def kill(strategy: str) -> tuple[Path, Path, int]:
        tmp = tmp_path_factory.mktemp(f"killed-{strategy}")
        out, trace = tmp / "out", tmp / "trace"
        proc = start_run(write_spec(tmp / "job.yaml", _spec(out, strategy)), {"KUBETUNE_TRACE_DIR": str(trace)})
        wait_for_checkpoint(out, 4, proc, timeout=240)
        os.kill(worker_pid(proc.pid, 1), signal.SIGKILL)
        proc.communicate(timeout=120)
        assert proc.returncode != 0
        steps = [int(p.name[5:]) for p in (out / "checkpoints").glob("step-*") if (p / "COMPLETE").exists()]
        assert 4 <= max(steps) < 10
        return out, trace, max(steps)

    return _Killed(kill)


class _Killed:
    """strategy -> its killed run, made once: ``start`` begins it in the background, a call waits for it
    (and raises what its making raised)."""

    def __init__(self, kill):
        self.kill, self.made = kill, {}

    def start(self, strategy: str) -> None:
        if strategy not in self.made:
            pool = concurrent.futures.ThreadPoolExecutor(1)
            self.made[strategy] = pool.submit(self.kill, strategy)
            pool.shutdown(wait=False)

    def __call__(self, strategy: str) -> tuple[Path, Path, int]:
        self.start(strategy)
        return self.made[strategy].result()


def _copy(killed_run: tuple[Path, Path, int], tmp: Path) -> Path:
    out = tmp / "out"
    shutil.copytree(killed_run[0], out)
    return out


# e2e, the three below: make test's resume is test_mlflow.py's SIGTERM + resume (DDP); the sharded (DCP)
# checkpoint's save and load are unit-tested (test_strategy.py)
@pytest.mark.e2e
def test_a_sigkilled_rank_resumes_from_its_sharded_checkpoint_bit_identically(reference, killed, tmp_path):
    run = killed("fsdp")
    step = run[0] / "checkpoints" / f"step-{run[2]:08d}"
    # every rank wrote its shard; the state file holds no weights
    assert sorted(p.name for p in (step / "shards").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert "model" not in torch.load(step / "state.pt", weights_only=True)
    out = _copy(run, tmp_path)
    again = kubetune("run", str(write_spec(tmp_path / "job.yaml", _spec(out, "fsdp"))))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from checkpoint step {run[2]} " in again.stderr
    assert _max_diff(_weights(out), _weights(reference["fsdp"][0])) == 0.0


@pytest.mark.parametrize(
    "strategy, procs, grad_accum",
    [
        ("fsdp", 1, 4),
        pytest.param("fsdp", 4, 1, marks=pytest.mark.slow),  # the same path as 2 -> 1, plus lockstep evaluation
        pytest.param("ddp", 1, 4, marks=pytest.mark.slow),  # the same layout path, DDP's state.pt
    ],
)
@pytest.mark.e2e
def test_resume_on_another_number_of_processes_keeps_every_rows_step(
    reference, killed, tmp_path, strategy, procs, grad_accum
):
    ref_out, ref_trace = reference[strategy]
    run = killed(strategy)
    out = _copy(run, tmp_path)
    resumed, trace = _run(tmp_path, _spec(out, strategy, procs))
    metrics = json.loads((resumed / "metrics.json").read_text())
    assert (metrics["world_size"], metrics["global_step"]) == (procs, 10)
    # Every step after the checkpoint trains exactly the rows the uninterrupted 2-process run trained in it.
    after, ref = _steps(trace), _steps(ref_trace)
    assert sorted(after) == list(range(run[2] + 1, 11))
    assert all(after[s] == ref[s] for s in after), [s for s in after if after[s] != ref[s]]
    assert all(len(ref[s]) == 16 for s in range(1, 10))  # the global batch: 4 × 2 × 2
    # With no dropout, the weights are the uninterrupted run's up to the order of the reductions.
    diff = _max_diff(_weights(resumed), _weights(ref_out))
    print(f"{strategy} 2 -> {procs} processes (grad_accum {grad_accum}): max |diff| {diff:.3g}")
    assert diff < 1e-5, diff


@pytest.mark.e2e
def test_a_global_batch_that_cannot_be_kept_is_one_line(killed, tmp_path):
    out = _copy(killed("fsdp"), tmp_path)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    spec = write_spec(tmp_path / "job.yaml", _spec(out, "fsdp", procs=3))
    r = kubetune("run", str(spec))
    assert r.returncode == 2, r.stderr[-3000:]
    line = next(line for line in r.stderr.splitlines() if "error:" in line)
    # 2 processes × grad_accum 2 = 4 micro-batches per step: not divisible by 3
    assert "error: distributed: the checkpoint in" in line and "resume on 1, 2, 4 processes" in line
    assert "Traceback" not in r.stderr
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # nothing touched
