"""The inferences most tasks' exports need, ready to name in a task's ``Task.inference``: ``CAUSAL_LM``
(`kubetune predict` generates, `kubetune serve` speaks the OpenAI API; a LoRA adapter served on its base)
and ``TEXT_CLASSIFIER`` (the top label and its score; KServe's v1 and v2). A task whose export is another
kind writes its own ``seam.Inference`` (the toy task of tests/ does)."""

from __future__ import annotations

from pathlib import Path

from kubetune.inference import causal, classifier
from kubetune.inference.seam import KSERVE, OPENAI, Inference


def _generate(path: str, prompts: list[str], options: dict, warn) -> list[dict]:
    return causal.generate(
        path,
        prompts,
        max_new_tokens=options.get("max_new_tokens", 64),
        temperature=options.get("temperature") or 0.0,
        chat=options.get("chat"),
        seed=options.get("seed") or 0,
        warn=warn,
        checked=True,  # the predict seam gets the directory `kubetune predict` checked (tasks.for_model)
    )


def _serve(path: Path, adapter: Path | None) -> causal.Generator:
    return causal.Generator(path, adapter=adapter)


# The inference of a task whose export is a causal LM (with, for a LoRA run, its adapter beside it):
# `kubetune predict` generates, `kubetune serve` speaks the OpenAI API.
CAUSAL_LM = Inference(
    noun="causal LM",
    claims=causal.is_causal_lm,
    predict=_generate,
    predict_options=("max_new_tokens", "temperature", "chat", "seed"),
    show=lambda r: f">>> {r['prompt']}\n{r['completion']}\n",
    serve=_serve,
    routes=OPENAI,
    adapters=True,
)


def _is_label_classifier(config: dict) -> bool:
    # a regression head (num_labels 1, problem_type regression) is a sequence classifier that has no labels
    return classifier.is_sequence_classifier(config) and config.get("problem_type") != "regression"


# The inference of a task whose export labels texts: `kubetune predict` and `kubetune serve` (KServe's v1
# and v2) answer the top label and its score.
TEXT_CLASSIFIER = Inference(
    noun="text classifier",
    claims=_is_label_classifier,
    predict=lambda path, texts, options, warn: classifier.classify(path, texts, checked=True),
    show=lambda r: f"{r['label']}\t{r['score']:.4f}\t{r['text']}",
    serve=lambda path, adapter: classifier.Classifier(path),
    routes=KSERVE,
)
