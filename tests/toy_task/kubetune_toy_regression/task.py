"""The toy regression task's training half, written against kubetune's public task seam only:
``kubetune.tasks.base`` (Task, Prepared, LossOutput, tokenize_on_node), ``kubetune.data``
(tables, the tokenization cache, Batch), ``kubetune.artifacts`` (replace_dir, Presentation),
``kubetune.providers`` (S3Settings, which ``load_frames`` takes for s3:// data) and
``kubetune.inference`` (its model loaders and the seam: ``Inference``, the KServe routes), through which
`kubetune predict` and `kubetune serve` take its export with no line of src/ naming it."""

from __future__ import annotations

import functools

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from kubetune import artifacts
from kubetune.artifacts.presentation import Presentation
from kubetune.data import Batch, tokenized
from kubetune.data.splits import read_rows
from kubetune.errors import KubetuneError
from kubetune.inference.model import load_model, load_tokenizer
from kubetune.inference.seam import KSERVE, Inference
from kubetune.providers import S3Settings
from kubetune.tasks.base import LossOutput, Prepared, Task, tokenize_on_node
from kubetune.tasks.common import load_pretrained

INPUTS = ("input_ids", "attention_mask", "token_type_ids")
# The task's own artifact file, beside kubetune's (``Task.artifact_files``): each held-out row's residual.
RESIDUALS = "residuals.csv"


def load_frames(data, seed: int, s3: S3Settings = S3Settings(), scale: float = 1.0):
    def detect(table: pd.DataFrame, spec) -> str:
        for key in ("text_column", "target_column"):
            if getattr(spec, key) not in table.columns:
                raise KubetuneError(
                    f"column {getattr(spec, key)!r} not found; columns are {list(table.columns)}",
                    field=f"data.{key}",
                    fix=f"set data.{key}",
                )
        return "text"

    def normalize(table: pd.DataFrame, spec, fmt: str, field: str, dropped: dict, which: str) -> pd.DataFrame:
        out = pd.DataFrame(
            {
                "text": table[spec.text_column].astype(str),
                "label": pd.to_numeric(table[spec.target_column], errors="coerce").astype("float64") * scale,
            }
        )
        bad = out["label"].isna()
        if bad.any():
            dropped[f"{which}_no_target"] = int(bad.sum())
        return out[~bad].reset_index(drop=True)

    train, evald, _, dropped = read_rows(data, seed, detect, normalize, s3=s3)
    return train, evald, dropped


def _encode(frame: pd.DataFrame, tokenizer, max_length: int) -> dict:
    enc = tokenizer(list(frame["text"]), truncation=True, max_length=max_length)
    enc["length"] = [len(ids) for ids in enc["input_ids"]]
    return enc


def _collate(ds, indices: np.ndarray, tokenizer) -> Batch:
    weight = 1.0
    if len(indices) == 0:
        indices, weight = np.zeros(1, dtype=np.int64), 0.0
    rows = ds[[int(i) for i in indices]]
    inputs = tokenizer.pad({k: rows[k] for k in INPUTS if k in rows}, return_tensors="pt")
    labels = torch.as_tensor(rows["label"], dtype=torch.float32)
    return Batch(dict(inputs.items()), labels, weight, torch.as_tensor(indices, dtype=torch.long))


def prepare(spec, env, model_dir, tokenizer) -> Prepared:
    own = spec.regression  # the task's own section (None: its defaults)
    train, evald, dropped = load_frames(
        spec.data, spec.training.seed, S3Settings.from_spec(spec), own.target_scale if own else 1.0
    )
    encode = functools.partial(_encode, tokenizer=tokenizer, max_length=spec.data.max_length)

    def build(create: bool):
        n = spec.data.max_length
        train_ds, hit = tokenized(train, tokenizer, n, build=create, mode="toy-regression", encode=encode)
        eval_ds, _ = tokenized(evald, tokenizer, n, build=create, mode="toy-regression", encode=encode)
        return train_ds, eval_ds, hit

    train_ds, eval_ds, _ = tokenize_on_node(env, build)
    return Prepared(
        train_ds=train_ds,
        eval_ds=eval_ds,
        collate=functools.partial(_collate, train_ds, tokenizer=tokenizer),
        collate_eval=functools.partial(_collate, eval_ds, tokenizer=tokenizer),
        train_rows=len(train),
        eval_rows=len(evald),
        dropped=dropped,
        info={"target_mean": float(train["label"].mean())},
        raw=tokenizer,
    )


def build_model(spec, model_dir, data: Prepared, device, dtype, where=None):
    from transformers import AutoModelForSequenceClassification

    model = load_pretrained(
        AutoModelForSequenceClassification, model_dir, where or device, num_labels=1, problem_type="regression"
    )
    return model.to(where or device)


def loss(model, batch: Batch, autocast) -> LossOutput:
    with autocast:
        predicted = model(**batch.inputs).logits.float().squeeze(-1)
    errors = F.mse_loss(predicted, batch.labels, reduction="none")
    return LossOutput(errors.sum(), torch.tensor(float(len(errors)), device=errors.device))


def eval_step(model, batch: Batch, autocast) -> dict:
    with autocast:
        predicted = model(**batch.inputs).logits.float().squeeze(-1)
    return {
        "sq": ((predicted - batch.labels) ** 2).sum().double(),
        "abs": (predicted - batch.labels).abs().sum().double(),
        "n": len(predicted),
    }


def eval_totals(stats: list[dict], data: Prepared, device) -> dict[str, torch.Tensor]:
    totals = {name: torch.zeros((), device=device, dtype=torch.float64) for name in ("squared", "absolute", "rows")}
    for st in stats:
        totals["squared"] += st["sq"]
        totals["absolute"] += st["abs"]
        totals["rows"] += st["n"]
    return totals


def eval_metrics(totals: dict[str, np.ndarray], data: Prepared) -> dict:
    n = max(float(totals["rows"]), 1.0)
    mse = float(totals["squared"]) / n
    return {
        "eval_loss": mse,
        "eval_mse": mse,
        "eval_mae": float(totals["absolute"]) / n,
        "eval_samples": int(totals["rows"]),
    }


def export(spec, model, tokenizer, data: Prepared, out, metrics: dict) -> None:
    def save(d):
        model.save_pretrained(d)
        tokenizer.save_pretrained(d)

    artifacts.replace_dir(save, out / "model")
    artifacts.write_atomic(out / RESIDUALS, _residuals(model, data))


@torch.no_grad()
def _residuals(model, data: Prepared) -> str:
    """The held-out rows' targets, predictions and residuals, as CSV."""
    device, lines = next(model.parameters()).device, ["row,target,predicted,residual"]
    model.eval()
    for start in range(0, data.eval_rows, 32):
        batch = data.collate_eval(np.arange(start, min(start + 32, data.eval_rows))).to(device)
        predicted = model(**batch.inputs).logits.float().squeeze(-1)
        for row, target, value in zip(batch.index.tolist(), batch.labels.tolist(), predicted.tolist()):
            lines.append(f"{row},{target:.6g},{value:.6g},{value - target:.6g}")
    return "\n".join(lines) + "\n"


class Scorer:
    """The toy task's engine for `kubetune serve`: a number per text, over KServe's v1 and v2 (one FP32
    output, ``value``), loaded with kubetune's checked loaders (``kubetune.inference.model``)."""

    outputs = {"value": "FP32"}

    def __init__(self, path):
        from transformers import AutoModelForSequenceClassification

        self.path = path
        self.tokenizer = load_tokenizer(path)
        self.model = load_model(AutoModelForSequenceClassification, path).eval()

    def run(self, texts: list[str]) -> list[dict]:
        with torch.no_grad():
            enc = self.tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
            values = self.model(**enc).logits.squeeze(-1)
        return [{"value": float(v)} for v in values.reshape(-1)]


def predict(path: str, texts: list[str], options: dict, warn) -> list[dict]:
    return [{"text": t, **r} for t, r in zip(texts, Scorer(path).run(texts))]


INFERENCE = Inference(
    noun="regression model",
    claims=lambda config: config.get("problem_type") == "regression",
    predict=predict,
    show=lambda r: f"{r['value']:.4f}\t{r['text']}",
    serve=lambda path, adapter: Scorer(path),
    routes=KSERVE,
)


TASK = Task(
    load_frames=load_frames,
    prepare=prepare,
    build_model=build_model,
    loss=loss,
    eval_step=eval_step,
    eval_totals=eval_totals,
    eval_metrics=eval_metrics,
    export=export,
    artifact_files=(RESIDUALS,),
    headline=("eval_mse", "eval_mae"),
    inference=INFERENCE,
    present=Presentation(
        pipeline_tag="text-classification",
        report_rows=lambda m: [("eval MSE", m.get("eval_mse")), ("eval MAE", m.get("eval_mae"))],
        eval_curves=("eval_mse", "eval_mae"),
        eval_log_scale=True,
        card_usage=lambda repo: [f'reg = pipeline("text-classification", model="{repo}", function_to_apply="none")'],
        card_about=lambda m: [f"Target mean in training: {m.get('target_mean')}."],
        headline=lambda m: f"eval MSE {m.get('eval_mse', float('nan')):.4f}",
        summary=lambda m: f"eval MSE {m['eval_mse']:.4f}, MAE {m['eval_mae']:.4f} on {m['eval_rows']} held-out rows",
        loss_label="squared error",
        card_metrics=("eval_mse", "eval_mae", "train_loss"),
    ),
)
