"""The runs of benchmarks/gpu_llm.py, each in its own process: kubetune as a user runs it (``kubetune run``),
TRL's trainers at their best, and one ``torch.profiler`` trace of a few of kubetune's own training steps.

Every run returns the same record: ``tokens`` and ``train_s`` over the whole run, ``steady_tokens`` and
``steady_s`` over the steps after the first ``warm`` (the steady state), ``steps``, ``peak_gpu_gib`` and the
last logged ``loss``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAIRS = ROOT / "src" / "kubetune" / "assets" / "sentiment" / "sentiment-preferences.jsonl"
LR = {"full": 1e-5, "lora": 2e-4}
LORA = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}
PIECES = ("flash_attention", "liger", "bf16_weights")  # training.fast_path's keys


@dataclass(frozen=True)
class Plan:
    """What one row trains: ``kind`` (full, lora, dpo, orpo, kto), ``data`` (chat, docs, pairs), the token
    budget of a micro-batch (``micro_tokens``; pairs: ``micro_pairs``) × ``accum`` micro-batches a step,
    ``steps`` optimizer steps of which the first ``warm`` are warm-up, and the model and data under ``work``."""

    work: Path
    kind: str
    data: str
    steps: int
    warm: int
    micro_tokens: int
    accum: int
    micro_pairs: int = 8
    bf16: bool = True
    model_dir: str = ""  # the model's directory (default: work/model)

    @property
    def model(self) -> Path:
        return Path(self.model_dir) if self.model_dir else self.work / "model"

    @property
    def lr(self) -> float:
        return LR["full" if self.kind == "full" else "lora"]


def steady_state(points: list[tuple[int, int, float]], warm: int) -> tuple[int, float]:
    """(tokens, seconds) from the first point at or after step ``warm`` to the last point.

    Args:
        points: (step, tokens trained so far, seconds so far), in step order.
        warm: the warm-up steps left out (the first point at or after it starts the clock).

    Returns:
        The tokens and seconds of the steady state; (0, 0.0) when fewer than two points qualify.
    """
    after = [p for p in points if p[0] >= warm]
    if len(after) < 2:
        return 0, 0.0
    return after[-1][1] - after[0][1], after[-1][2] - after[0][2]


# ------------------------------------------------------------------ kubetune, as a user runs it


def kubetune_spec(plan: Plan, out: Path, fast: dict[str, bool]) -> dict:
    """The job spec of a kubetune row; ``fast`` sets training.fast_path's pieces (all off: today's path)."""
    training = {
        "max_steps": plan.steps,
        "learning_rate": plan.lr,
        "precision": "bf16" if plan.bf16 else "fp32",
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "warmup_ratio": 0.05,
        "log_every": plan.warm,  # one log step ends the warm-up; the others time the steady state
        "seed": 0,
        "resume": "never",
        "fast_path": dict(fast),
    }
    spec = {
        "name": f"gpu-llm-{plan.kind}",
        "model": {"uri": str(plan.model)},
        "distributed": {"nodes": 1, "procs_per_node": 1},
        "output": {"uri": str(out), "report_baseline": False},
    }
    if plan.kind != "full":
        spec["lora"] = LORA
    if plan.data == "pairs":
        spec["task"] = plan.kind
        spec["data"] = {"train": str(PAIRS), "eval_fraction": 0.02, "max_length": 512}
        training.update(batch_size=plan.micro_pairs, grad_accum=plan.accum)
    else:
        spec["task"] = "causal-lm"
        spec["data"] = {
            "train": str(plan.work / f"{plan.data}.jsonl"),
            "eval": str(plan.work / "eval.jsonl"),
            "format": "chat" if plan.data == "chat" else "text",
            "max_length": min(4096, plan.micro_tokens),  # kubetune: a micro-batch holds the longest example
            "packing": True,
            "max_tokens_per_batch": plan.micro_tokens,
        }
        # the token budget, not the example count, cuts each micro-batch: accum × micro_tokens tokens a step
        training.update(batch_size=1024, grad_accum=plan.accum)
    spec["training"] = training
    return spec


def run_kubetune(plan: Plan, out: Path, fast: dict[str, bool]) -> dict:
    """``kubetune run`` of the row's spec. The steady state comes from the run's own events: the cumulative
    tokens of each ``train`` event (events.jsonl) and the rate of each ``progress`` event line (its log, with
    the event lines on), which the progress logger times at each log step."""
    import yaml

    from kubetune.training.events import LOG_EVENTS_ENV, Event, events_in_log

    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(kubetune_spec(plan, out, fast)))
    env = {**os.environ, LOG_EVENTS_ENV: "1"}
    cmd = [sys.executable, "-m", "kubetune", "run", str(path), "--overwrite"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    sys.stdout.write(proc.stdout[-3000:] + proc.stderr[-3000:])
    if proc.returncode != 0:
        raise RuntimeError(f"kubetune run exited {proc.returncode}: {(proc.stderr or proc.stdout)[-300:]}")
    m = json.loads((out / "metrics.json").read_text())
    trained = [Event.from_json(line) for line in (out / "events.jsonl").read_text().splitlines()]
    tokens = {e.step: int(e.context["tokens"]) for e in trained if e and e.kind == "train" and "tokens" in e.context}
    logged = events_in_log((proc.stdout + proc.stderr).splitlines())
    rates = {e.step: e.context.get("tokens_per_s") for e in logged if e.kind == "progress"}
    points, seconds, previous = [], 0.0, (0, 0)
    for step in sorted(tokens):
        rate = rates.get(step)
        if rate:  # each log step's interval: its tokens over the rate the progress logger measured for it
            seconds += (tokens[step] - previous[1]) / rate
            points.append((step, tokens[step], seconds))
        previous = (step, tokens[step])
    steady_tokens, steady_s = steady_state(points, plan.warm)
    return {
        "train_s": m["train_runtime_s"],
        "tokens": m["train_tokens"],  # DPO-like tasks: every token of both answers and their prompts
        "steady_tokens": steady_tokens,
        "steady_s": steady_s,
        "steps": m["global_step"],
        "peak_gpu_gib": m.get("peak_gpu_memory_gib"),
        "loss": m.get("train_loss"),
    }


def profile_kubetune(plan: Plan, out: Path, fast: dict[str, bool], warm: int = 3, steps: int = 3) -> dict:
    """``steps`` of kubetune's own ``Trainer.train_step`` under ``torch.profiler`` after ``warm`` more, in this
    process as a world of one: the trace (``out``.json.gz, Chrome format) and the top kernels as text
    (``out``.txt). Returns the paths and the profiled steps' seconds."""
    import contextlib
    import gzip
    import shutil
    import socket

    import torch
    from torch.profiler import ProfilerActivity, profile

    from kubetune import distributed, tasks
    from kubetune.artifacts.output import Output
    from kubetune.config import parse_spec
    from kubetune.training.build import build_trainer

    with socket.socket() as s:  # a free port for the world of one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    spec = parse_spec(kubetune_spec(Plan(**{**plan.__dict__, "steps": warm + steps}), out.parent / "profiled", fast))
    env = distributed.read_env()
    device = distributed.pick_device(env)
    control = distributed.setup(env, device, spec.distributed.backend, spec.distributed.timeout_minutes)
    dest = Output.for_spec(spec)
    dest.claim(spec)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with contextlib.ExitStack() as cleanup:
        trainer = build_trainer(spec, env, tasks.get(spec.task), dest, device, control_group=control, cleanup=cleanup)
        trainer.wrapped.train()
        batches = iter(trainer.epoch_batches(0))
        for _ in range(warm):
            trainer.train_step(next(batches))
        todo = [next(batches) for _ in range(steps)]  # built before the profiler starts: only the steps in it
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profile(activities=activities) as prof:
            for step in todo:
                trainer.train_step(step)
            if cuda:
                torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    distributed.teardown()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70)
    out.with_suffix(".txt").write_text(f"{steps} steps of kubetune's train_step, {seconds:.3f} s; by {key}\n{table}\n")
    raw = out.with_suffix(".raw.json")
    prof.export_chrome_trace(str(raw))
    with open(raw, "rb") as src, gzip.open(out.with_suffix(".json.gz"), "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    return {"trace": out.with_suffix(".json.gz").name, "table": out.with_suffix(".txt").name, "seconds": seconds}


# ------------------------------------------------------------------ TRL, in a child process


def _trl_args(plan: Plan, out: Path) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    args = dict(
        output_dir=str(out),
        max_steps=plan.steps,
        learning_rate=plan.lr,
        warmup_steps=0.05,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="linear",
        logging_steps=plan.warm,
        save_strategy="no",
        report_to=[],
        seed=0,
        bf16=plan.bf16 and cuda,
        gradient_checkpointing=False,
        disable_tqdm=True,
        gradient_accumulation_steps=plan.accum,
        use_cpu=not cuda,
    )
    if plan.kind in ("full", "lora") and cuda and _liger():  # TRL at its best: Liger's fused kernels and loss
        args["use_liger_kernel"] = True
    return args


def _liger() -> bool:
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _timed(trainer, plan: Plan, counts: list[int]) -> dict:
    """Trains; the clock of the steady state starts at the end of step ``plan.warm`` (after a device sync)."""
    import torch
    from transformers import TrainerCallback

    marks: dict[str, float] = {}

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    class Mark(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == plan.warm:
                sync()
                marks["warm"] = time.perf_counter()

    trainer.add_callback(Mark())
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    trainer.train()
    sync()
    end = time.perf_counter()
    accum = trainer.args.gradient_accumulation_steps
    done = trainer.state.global_step
    tokens = sum(counts[: done * accum])  # the loader may have collated one more micro-batch than it trained
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {
        "train_s": end - t,
        "tokens": tokens,
        "steady_tokens": tokens - sum(counts[: plan.warm * accum]) if "warm" in marks else 0,
        "steady_s": end - marks["warm"] if "warm" in marks else 0.0,
        "steps": done,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "loss": losses[-1] if losses else None,
    }


def run_trl(plan: Plan, out: Path) -> dict:
    """TRL's trainer of the row's kind on the same model, data, steps and tokens per step."""
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(plan.model)
    tok.pad_token = tok.pad_token or tok.eos_token
    # as kubetune loads it: fp32 master weights for a full fine-tune, the frozen base in bf16 otherwise
    dtype = torch.float32 if plan.kind == "full" or not plan.bf16 else torch.bfloat16
    # sdpa: with padding-free rows (position_ids, no mask) transformers masks each document off the others
    model = AutoModelForCausalLM.from_pretrained(plan.model, dtype=dtype, attn_implementation="sdpa")
    if torch.cuda.is_available():
        model = model.cuda()
    lora = (
        None
        if plan.kind == "full"
        else LoraConfig(task_type="CAUSAL_LM", r=16, lora_alpha=32, target_modules="all-linear")
    )
    counts: list[int] = []
    if plan.data == "pairs":
        trainer = _preference_trainer(plan, out, model, tok, lora)
        key = "attention_mask"  # chosen and rejected, prompts included
    else:
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(
            **_trl_args(plan, out),
            max_length=plan.micro_tokens,
            packing=True,
            padding_free=True,
            per_device_train_batch_size=1,
        )
        name = "prompt_completion" if plan.data == "chat" else plan.data
        ds = load_dataset("json", data_files=str(plan.work / f"{name}.jsonl"), split="train")
        trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, peft_config=lora)
        key = "input_ids"  # flattened: every id is a real token
    collate = trainer.data_collator

    def counted(features):
        batch = collate(features)
        counts.append(int(batch[key].sum() if key == "attention_mask" else batch[key].numel()))
        return batch

    trainer.data_collator = counted
    return _timed(trainer, plan, counts)


def _preference_trainer(plan: Plan, out: Path, model, tok, lora):
    """TRL's DPOTrainer, ORPOTrainer or KTOTrainer (the last two from trl.experimental where they moved)."""
    from datasets import load_dataset

    ds = load_dataset("json", data_files=str(PAIRS), split="train")
    common = dict(**_trl_args(plan, out), per_device_train_batch_size=plan.micro_pairs, max_length=512)
    if plan.kind == "dpo":
        from trl import DPOConfig as Config
        from trl import DPOTrainer as Trainer
    elif plan.kind == "orpo":
        from trl.experimental.orpo import ORPOConfig as Config
        from trl.experimental.orpo import ORPOTrainer as Trainer
    else:
        from trl import KTOConfig as Config
        from trl import KTOTrainer as Trainer

        # KTO learns from single completions marked desirable or not: each pair gives one of each
        rows = [
            {"prompt": r["prompt"], "completion": r[k], "label": k == "chosen"}
            for r in ds
            for k in ("chosen", "rejected")
        ]
        ds = ds.from_list(rows)
    return Trainer(model=model, args=Config(**common), train_dataset=ds, processing_class=tok, peft_config=lora)


def trl_child(plan_json: str, out: str) -> None:
    """The entry of a TRL row's own process: runs it and writes its record beside ``out``."""
    raw = json.loads(plan_json)
    plan = Plan(**{**raw, "work": Path(raw["work"])})
    Path(out + ".json").write_text(json.dumps(run_trl(plan, Path(out))))
