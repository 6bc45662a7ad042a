"""Classification with a sequence classifier export: ``classify`` (what `kubetune predict` runs for a task
whose export labels texts) and ``Classifier``, the engine `kubetune serve` batches texts into (KServe's v1
and v2 routes, ``server.kserve_routes``), labeling as ``classify`` does; ``is_sequence_classifier`` tells
such a model by its config."""

from __future__ import annotations

import threading
from pathlib import Path

from kubetune.inference import model as M
from kubetune.inference.model import check_vocab, context_length, load_model, load_tokenizer

# KServe v2's outputs of a classifier: the top label and its score, per text
OUTPUTS = {"label": "BYTES", "score": "FP32"}


def is_sequence_classifier(config: dict) -> bool:
    """Does the model of ``config`` (a checked config.json) classify sequences: an architecture
    ``*ForSequenceClassification`` or one transformers maps as one?"""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    archs = config.get("architectures") or []
    return any(
        a.endswith("ForSequenceClassification") or a in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.values()
        for a in archs
    )


def classify(uri: str, texts: list[str], batch_size: int = 32, checked: bool = False) -> list[dict]:
    """Classify ``texts``; returns ``[{text, label, score}]`` in input order. Each text is cut to
    the model's context (its first tokens are kept). ``checked``: ``uri`` is a local model directory its caller
    checked and found a sequence classifier (`kubetune predict`, through ``tasks.for_model``): not checked again.

    Raises:
        KubetuneError: the model is not a sequence classifier or cannot be loaded.
    """
    import torch
    from transformers import AutoModelForSequenceClassification, pipeline

    path = Path(uri) if checked else M.locate(uri)
    if not checked:
        M.expect(path, is_sequence_classifier, "text classifier")  # the check (``model_path``'s), once
    tokenizer = load_tokenizer(path)
    model = load_model(AutoModelForSequenceClassification, path)
    check_vocab(model, tokenizer, path)
    clf = pipeline(
        "text-classification", model=model, tokenizer=tokenizer, device=0 if torch.cuda.is_available() else -1
    )
    # An explicit bound: a tokenizer saved without model_max_length does not truncate at all, and the
    # position embeddings then fail on a long text.
    results = clf(
        texts, batch_size=batch_size, truncation=True, max_length=context_length(model.config, tokenizer) or 512
    )
    return [{"text": t, "label": r["label"], "score": float(r["score"])} for t, r in zip(texts, results)]


class Classifier:
    """A sequence classifier export, labeling texts as ``predict`` does (the top label and its score)."""

    outputs = OUTPUTS

    def __init__(self, path: Path):
        """``path``: a checked model directory holding a sequence classifier (`kubetune serve` checks it once,
        ``tasks.for_model``, and builds this through the task's inference, ``seam``)."""
        import torch
        from transformers import AutoModelForSequenceClassification, pipeline

        self.path = path
        tokenizer = load_tokenizer(path)
        model = load_model(AutoModelForSequenceClassification, path)
        check_vocab(model, tokenizer, path)
        self.context = context_length(model.config, tokenizer) or 512
        self.pipe = pipeline(
            "text-classification", model=model, tokenizer=tokenizer, device=0 if torch.cuda.is_available() else -1
        )
        self.labels = [model.config.id2label[i] for i in sorted(model.config.id2label)]
        self._lock = threading.Lock()

    def run(self, texts: list[str]) -> list[dict | Exception]:
        """The top label and its score for each text, in one call of the pipeline; where that call fails,
        each text alone, so that a text the model cannot take fails its own request only (its entry is
        the exception)."""
        try:
            return self._label(texts)
        except Exception as e:  # noqa: BLE001 - whose text it was is found out below
            if len(texts) == 1:
                return [e]
        out: list[dict | Exception] = []
        for text in texts:
            try:
                out.extend(self._label([text]))
            except Exception as e:  # noqa: BLE001 - this text's own error, answered to its request
                out.append(e)
        return out

    def _label(self, texts: list[str]) -> list[dict | Exception]:
        with self._lock:
            out = self.pipe(texts, batch_size=len(texts), truncation=True, max_length=self.context)
        return [{"label": r["label"], "score": float(r["score"])} for r in out]
