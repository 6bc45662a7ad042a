"""`kubetune eval` against lm-evaluation-harness itself: on the tiny chat example's export (and, in make
test-e2e, the DPO export), a multiple-choice (log-likelihood) task and a generation task in the harness's
own YAML over the packaged sentiment data, the CLI's per-example answers and scores equal
`lm_eval.simple_evaluate(model="hf")`'s on the same model and settings exactly, on 1 process and on 2 (each
scoring its share, rank 0 gathering). Bad input is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import kubetune, lm_eval_tasks

pytestmark = pytest.mark.integration
TASKS = ["kubetune_sentiment_mc", "kubetune_sentiment_gen"]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """The harness task YAML of tests/data/lm_eval_tasks over the first 12 reviews."""
    return lm_eval_tasks(tmp_path_factory.mktemp("lm-eval-tasks"), 12)


def _per_example(samples: dict) -> dict:
    """task -> [(doc_id, the filtered answers: each choice's (log-likelihood, greedy) or the text)], JSON-shaped."""
    return {
        task: sorted((s["doc_id"], json.loads(json.dumps(s["filtered_resps"]))) for s in rows)
        for task, rows in samples.items()
    }


def _harness(model_args: str, task_dir: Path) -> dict:
    """The harness's own scoring (`lm_eval --model hf`) of TASKS: the reference kubetune eval must equal."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model="hf",
        model_args=f"{model_args},dtype=float32,device=cpu",
        tasks=TASKS,
        task_manager=TaskManager(include_path=str(task_dir)),
        batch_size=1,
        apply_chat_template=True,
        log_samples=True,
        random_seed=0,
    )


def _same_as_the_harness(model: Path, task_dir: Path, tmp_path: Path) -> None:
    want = _harness(f"pretrained={model}", task_dir)
    for procs in (1, 2):
        out = tmp_path / f"eval-{procs}.json"
        r = kubetune(
            "eval", str(model), "--tasks", ",".join(TASKS), "--include-path", str(task_dir), "--chat",
            "--procs", str(procs), "--output", str(out), "--log-samples",
        )  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        got = json.loads(out.read_text())
        print(procs, {t: got["results"][t] for t in TASKS})
        for task in TASKS:
            assert got["results"][task] == json.loads(json.dumps(want["results"][task])), task
        assert _per_example(got["samples"]) == _per_example(want["samples"])
    texts = [answer[0] for _, answer in _per_example(want["samples"])[TASKS[1]]]
    assert sum(bool(t.strip()) for t in texts) >= len(texts) // 2, texts  # the model answers: texts, not ""


def test_eval_equals_the_harness_on_the_tiny_chat_export_on_one_and_two_processes(tiny_chat_sft, task_dir, tmp_path):
    _same_as_the_harness(tiny_chat_sft[0] / "model", task_dir, tmp_path)


@pytest.mark.e2e  # make test: the tiny chat export above (the same path)
def test_eval_equals_the_harness_on_the_dpo_export(dpo_example, task_dir, tmp_path):
    _same_as_the_harness(dpo_example[0] / "model", task_dir, tmp_path)


def test_bad_input_is_one_line(minilm_run, task_dir):
    r = kubetune("eval", str(minilm_run[0]), "--tasks", "kubetune_sentimnt_mc", "--include-path", str(task_dir))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "closest: kubetune_sentiment_mc" in r.stderr, r.stderr
    r = kubetune("eval", str(minilm_run[0]), "--tasks", TASKS[0], "--include-path", str(task_dir))
    assert r.returncode == 2 and "causal LM" in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    r = kubetune("eval", str(minilm_run[0]), "--tasks", TASKS[0], "--include-path", str(task_dir / "none"))
    assert r.returncode == 2 and "is not a directory" in r.stderr, r.stderr


@pytest.mark.e2e  # make test: the merged export above (the same path, the model loaded otherwise)
def test_eval_of_a_lora_adapter_unmerged_equals_the_harness_with_peft(tiny_chat_sft, task_dir, tmp_path):
    """`--adapter`: the base model plus adapter/ as PEFT applies it, equal to the harness's own `peft=`."""
    from kubetune.inference.model import adapter_beside

    base, adapter = adapter_beside(tiny_chat_sft[0] / "model")
    want = _harness(f"pretrained={base},peft={adapter},tokenizer={adapter}", task_dir)
    out = tmp_path / "adapter.json"
    r = kubetune(
        "eval", str(tiny_chat_sft[0]), "--adapter", "--tasks", ",".join(TASKS), "--include-path", str(task_dir),
        "--chat", "--output", str(out), "--log-samples",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    for task in TASKS:
        assert got["results"][task] == json.loads(json.dumps(want["results"][task])), task
    assert _per_example(got["samples"]) == _per_example(want["samples"])
