"""examples/notebooks/finetune.ipynb executes top to bottom on the local backend with a tiny
budget (a real 2-process training run on the packaged MiniLM, offline) and predicts."""

from __future__ import annotations

import re

import pytest
from deploy_support import ROOT

pytestmark = pytest.mark.integration
NOTEBOOK = ROOT / "examples" / "notebooks" / "finetune.ipynb"
LABELS = {"negative", "neutral", "positive"}


def _text(cell) -> str:
    out = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream":
            out.append(o["text"])
        elif "data" in o:
            out.append(o["data"].get("text/plain", ""))
    return "".join(out)


def test_notebook_is_committed_without_outputs():
    import nbformat

    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code")


@pytest.mark.e2e  # make test: the same local backend and predict through the CLI and the Python client
def test_notebook_runs_on_the_local_backend_and_predicts(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    # CI budget: 4 optimizer steps on 400 rows, 2 CPU processes; the HF cache is conftest's
    # offline one (the kernel inherits this process's environment).
    for key, value in {
        "KUBETUNE_BACKEND": "local",
        "KUBETUNE_MAX_STEPS": "4",
        "KUBETUNE_MAX_TRAIN_SAMPLES": "400",
        "KUBETUNE_MAX_EVAL_SAMPLES": "100",
        "HF_HUB_OFFLINE": "1",
    }.items():
        monkeypatch.setenv(key, value)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    nbformat.write(nb, tmp_path / "executed.ipynb")  # kept for a look when this fails

    outputs = {i: _text(c) for i, c in enumerate(nb.cells) if c.cell_type == "code"}
    everything = "\n".join(outputs.values())
    assert "backend=local max_steps=4 max_train_samples=400" in everything
    assert re.search(r"\d[\d,]* rows; columns \[.*'sentiment'.*'text'.*\]", everything)
    assert "Succeeded" in everything
    assert re.search(r"\[rank 0\] INFO done: eval_accuracy", everything)
    assert "eval_accuracy" in everything and "baseline_accuracy" in everything

    predict_cell = next(c for c in nb.cells if "predictions" in c.get("metadata", {}).get("tags", []))
    rows = [line.split(maxsplit=2) for line in _text(predict_cell).splitlines() if line.strip()]
    assert len(rows) == 3
    for label, score, _text_ in rows:
        assert label in LABELS and 0.0 <= float(score) <= 1.0
    # the model the notebook trained is where the job said it would be
    assert (tmp_path / "runs" / "sentiment-minilm-notebook" / "model" / "config.json").exists()
