"""Preference tuning with DPO (Direct Preference Optimization) of a causal LM: the task's pieces for
the shared trainer (``training/trainer.py``).

Data: pairs of a prompt and a chosen and a rejected answer, in TRL's conventions: strings joined as
they are (text), or message lists rendered with the chat template (chat; the prompt may be implicit:
the turns chosen and rejected share), tokenized as TRL's DPOTrainer does and cached like the other
tasks' tokens. A micro-batch is its pairs' chosen sequences, then their rejected ones; only answer
tokens carry log-probabilities. Model: the causal-LM task's (full fine-tune, LoRA, QLoRA), with
dropout off (TRL's default, so the policy and the reference see the same network). The reference
model is never a second copy: with LoRA it is the model with its adapter disabled, for a full
fine-tune its log-probabilities are computed once, before training, by the model itself, and cached
on disk keyed by the model, the data, the template and the precision (a resumed run reads them).
Loss: sigmoid (DPO, with conservative label smoothing) or IPO, averaged over the global step's
pairs; the rewards, their margin and the reward accuracy are logged in training and evaluation.
Export, ``predict`` and the Hub push are the causal-LM task's.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from kubetune import distributed
from kubetune.config import JobSpec
from kubetune.config.schema import DPOSpec, PreferenceData
from kubetune.data import Batch, tokenized
from kubetune.data.causal import IGNORE, ROLES, RecordFrames, ensure_chat_template, read_rows
from kubetune.data.tables import describe_non_text, short
from kubetune.data.tokenize import cache_key, tokenizer_fingerprint
from kubetune.distributed import DistEnv
from kubetune.errors import KubetuneError
from kubetune.paths import cache_root, set_default_modes
from kubetune.tasks import causal_lm
from kubetune.tasks.base import Prepared, Presentation, Task, rank_batches, tokenize_on_node

log = logging.getLogger(__name__)

# What the training log lines and history.jsonl report beside the loss (means over the pairs since the
# last line); evaluation reports the same with the eval_ prefix. TRL's names: rewards/accuracies,
# rewards/chosen, rewards/rejected, rewards/margins, logps/chosen, logps/rejected.
METRICS = ("reward_accuracy", "reward_chosen", "reward_rejected", "reward_margin", "logps_chosen", "logps_rejected")

# ---------------------------------------------------------------- data


def load_pair_frames(spec: PreferenceData, seed: int) -> RecordFrames:
    """Read, check, normalize and split preference pairs.

    Raises:
        KubetuneError: a missing column, a column without text or messages, malformed messages, no usable pair.
    """
    return RecordFrames(*read_rows(spec, seed, _detect_format, _normalize))


def _detect_format(df: pd.DataFrame, spec: PreferenceData) -> str:
    if spec.format != "auto":
        return spec.format
    if spec.chosen_column not in df.columns:
        return "text"  # _normalize names the missing column
    values = df[spec.chosen_column].dropna()
    return "chat" if len(values) and _as_messages(values.iloc[0]) is not None else "text"


def _as_messages(value) -> list | None:
    """``value`` as a list (of would-be messages) when it is one: a list, an Arrow array, a JSON list."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return value if isinstance(value, list) else None


def _normalize(
    df: pd.DataFrame, spec: PreferenceData, fmt: str, field_name: str, dropped: dict[str, int], which: str
) -> pd.DataFrame:
    source = getattr(spec, field_name.split(".")[1])
    needed = {"chosen_column": spec.chosen_column, "rejected_column": spec.rejected_column}
    if fmt == "text" or spec.prompt_column in df.columns:  # chat: the prompt may be implicit
        needed = {"prompt_column": spec.prompt_column, **needed}
    for key, col in needed.items():
        if col not in df.columns:
            hint = f" (data.format {'auto-detected as ' if spec.format == 'auto' else ''}{fmt})"
            raise KubetuneError(
                f"column '{short(col, 40)}' not found in {short(source)}{hint}; "
                f"columns are {[short(c, 40) for c in df.columns[:20]]}",
                field=f"data.{key}",
                fix=f"set data.{key} to the column that holds the "
                + {"prompt_column": "prompt", "chosen_column": "preferred answer"}.get(key, "dispreferred answer"),
            )
    if len(df) == 0:
        raise KubetuneError(f"{source} has no rows", field=field_name, fix="point it at data with at least one row")
    if fmt == "text":
        for key, col in needed.items():
            what = describe_non_text(df[col])
            if what:
                raise KubetuneError(
                    f"column '{short(col, 40)}' of {short(source)} holds {what}, not text",
                    field=f"data.{key}",
                    fix=f"set data.{key} to a text column, or data.format: chat for message lists",
                )
    records, reasons = [], {"missing": 0, "same": 0}
    for i, row in enumerate(df.to_dict("records")):
        record = _text_record(row, spec) if fmt == "text" else _chat_record(row, spec, source, i)
        if record is not None and record["chosen"] == record["rejected"]:
            reasons["same"] += 1  # no preference to learn: its loss is constant
            record = None
        elif record is None:
            reasons["missing"] += 1
        records.append(record)
    n_drop = sum(reasons.values())
    if n_drop:
        dropped[which] = n_drop
        log.warning(
            "%s: dropped %d of %d pairs (%d with a missing or empty prompt or answer, %d whose chosen and rejected "
            "answers are the same)",
            field_name,
            n_drop,
            len(df),
            reasons["missing"],
            reasons["same"],
        )
    if n_drop == len(df):
        raise KubetuneError(
            f"no usable preference pairs in {source} (format {fmt})",
            field=field_name,
            fix="check the data and the data.*_column settings",
        )
    return pd.DataFrame({"record": [json.dumps(r) for r in records if r is not None]})


def _text(value) -> str | None:
    return value if isinstance(value, str) and value.strip() else None


def _text_record(row: dict, spec: PreferenceData) -> dict | None:
    prompt = row[spec.prompt_column]
    chosen, rejected = _text(row[spec.chosen_column]), _text(row[spec.rejected_column])
    if not _text(prompt) or not chosen or not rejected:  # an empty prompt is dropped, as the warning says
        return None
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _chat_record(row: dict, spec: PreferenceData, source: str, i: int) -> dict | None:
    """{prompt, chosen, rejected} message lists. Strings become a user turn (prompt) or an assistant
    turn (answers). Answers that start with a turn not the assistant's hold the whole conversation:
    the prompt is then the turns they share (TRL's implicit prompt), else the prompt column's."""
    chosen = _messages(row[spec.chosen_column], "assistant", "data.chosen_column", spec.chosen_column, source, i)
    rejected = _messages(
        row[spec.rejected_column], "assistant", "data.rejected_column", spec.rejected_column, source, i
    )
    if not chosen or not rejected:
        return None
    if chosen[0]["role"] != "assistant" or rejected[0]["role"] != "assistant":
        n = min(_shared_prefix(chosen, rejected), len(chosen) - 1, len(rejected) - 1)
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    elif spec.prompt_column in row:
        prompt = _messages(row[spec.prompt_column], "user", "data.prompt_column", spec.prompt_column, source, i)
        if prompt is None:
            return None
    else:
        raise KubetuneError(
            f"row {i} of {short(source)}: the answers hold no prompt and there is no column '{spec.prompt_column}'",
            field="data.prompt_column",
            fix="set data.prompt_column, or store whole conversations (prompt turns first) in the answer columns",
        )
    if not any(_text(m.get("content")) for m in prompt):  # an empty prompt is dropped, as the warning says
        return None
    if spec.system_prompt and (not prompt or prompt[0]["role"] != "system"):
        prompt = [{"role": "system", "content": spec.system_prompt}, *prompt]
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _messages(value, role: str, key: str, col: str, source: str, i: int) -> list[dict] | None:
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return None
    messages = _as_messages(value)
    if messages is None:
        text = _text(value)
        return [{"role": role, "content": text}] if text else None
    if not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise KubetuneError(
            f"row {i} of {short(source)}: '{short(col, 40)}' must be text or a list of {{role, content}} objects, "
            f"got {short(value, 60)!r}",
            field=key,
            fix='store a list like [{"role": "assistant", "content": "..."}], or plain text',
        )
    out = []
    for m in messages:
        if str(m["role"]) not in ROLES:
            raise KubetuneError(
                f"row {i} of {short(source)}: unknown message role {short(m['role'], 30)!r} in '{short(col, 40)}'",
                field=key,
                fix=f"use one of {list(ROLES)}",
            )
        if not isinstance(m["content"], str):
            return None
        out.append({"role": str(m["role"]), "content": m["content"]})
    return out


def _shared_prefix(a: list, b: list) -> int:
    """How many leading items ``a`` and ``b`` share (os.path.commonprefix orders its items, which
    message dicts cannot be)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def encode_pairs(frame: pd.DataFrame, tokenizer, max_length: int) -> dict[str, list]:
    """Token ids of each pair as TRL's DPOTrainer makes them: the prompt, and prompt + answer (text:
    joined as strings, the answer ending with EOS; chat: the template, the prompt with the generation
    prompt); each answer starts where its tokens leave the prompt's. Columns prompt_ids, chosen_ids,
    rejected_ids, length (the longer sequence, up to ``max_length``)."""
    cols: dict[str, list] = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": [], "length": []}
    eos = tokenizer.eos_token or ""
    for rec in frame["record"]:
        r = json.loads(rec)
        if isinstance(r["prompt"], str):
            prompt_ids = tokenizer(r["prompt"])["input_ids"]
            full = [
                tokenizer(r["prompt"] + (a if a.endswith(eos) else a + eos))["input_ids"]
                for a in (r["chosen"], r["rejected"])
            ]
        else:
            prompt_ids = _chat_ids(tokenizer, r["prompt"], add_generation_prompt=True)
            full = [_chat_ids(tokenizer, r["prompt"] + r[k]) for k in ("chosen", "rejected")]
        n = min(_shared_prefix(prompt_ids, ids) for ids in full)
        cols["prompt_ids"].append(prompt_ids[:n])
        cols["chosen_ids"].append(full[0][n:])
        cols["rejected_ids"].append(full[1][n:])
        cols["length"].append(min(max_length, max(len(full[0]), len(full[1]))))
    return cols


def _chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=True
    )
    return list(out["input_ids"])


# ---------------------------------------------------------------- batches


@dataclass
class PairBatch(Batch):
    """A micro-batch of pairs: rows 0..n-1 the chosen sequences, rows n..2n-1 the rejected ones;
    labels are the answer tokens (IGNORE elsewhere)."""

    reference: torch.Tensor | None = None  # [pairs, 2] the reference log-probabilities, when precomputed
    dpo: DPOSpec = field(default_factory=DPOSpec)  # the loss's settings (the trainer passes no spec to the loss)

    def to(self, device: torch.device) -> PairBatch:
        if device.type == "cpu":
            return self
        moved = super().to(device)
        ref = self.reference.to(device, non_blocking=True) if self.reference is not None else None
        return PairBatch(moved.inputs, moved.labels, self.weight, self.index, ref, self.dpo)

    def pin_memory(self) -> PairBatch:
        pinned = super().pin_memory()
        ref = self.reference.pin_memory() if self.reference is not None else None
        return PairBatch(pinned.inputs, pinned.labels, self.weight, self.index, ref, self.dpo)


class Collate:
    """Dataset row ids -> a ``PairBatch``: prompt + answer cut to ``max_length`` (TRL's keep_start),
    right-padded. ``reference``: the precomputed reference log-probabilities of every row (set by
    ``setup`` before training; None: the reference is computed on the fly)."""

    def __init__(self, ds, pad_id: int, max_length: int, dpo: DPOSpec, key: str):
        self.ds, self.pad_id, self.max_length, self.dpo = ds, pad_id, max_length, dpo
        self.key = key  # what the reference log-probabilities of these rows depend on (their cache's key)
        self.reference: np.ndarray | None = None

    def __call__(self, indices: np.ndarray) -> PairBatch:
        weight = 1.0
        if len(indices) == 0:  # a rank's empty share of the last step: computed, weighs nothing
            indices, weight = np.zeros(1, dtype=np.int64), 0.0
        rows = self.ds[[int(i) for i in indices]]
        seqs, answers = [], []
        for key in ("chosen_ids", "rejected_ids"):
            for prompt, answer in zip(rows["prompt_ids"], rows[key]):
                seqs.append((prompt + answer)[: self.max_length])
                answers.append(min(len(answer), max(self.max_length - len(prompt), 0)))
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        labels = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
        for k, (seq, n) in enumerate(zip(seqs, answers)):
            ids[k, : len(seq)] = torch.tensor(seq)
            mask[k, : len(seq)] = 1
            labels[k, len(seq) - n : len(seq)] = ids[k, len(seq) - n : len(seq)]
        ref = torch.as_tensor(self.reference[indices], dtype=torch.float32) if self.reference is not None else None
        return PairBatch(
            {"input_ids": ids, "attention_mask": mask},
            labels,
            weight,
            torch.as_tensor(indices, dtype=torch.long),
            ref,
            self.dpo,
        )


# ---------------------------------------------------------------- prepare and model


def prepare(spec: JobSpec, env: DistEnv, model_dir, tokenizer) -> Prepared:
    frames = load_pair_frames(spec.data, spec.training.seed)
    template = None
    if frames.format == "chat":
        if spec.data.chat_template:
            tokenizer.chat_template, template = spec.data.chat_template, "data.chat_template"
        else:
            template = "fallback" if ensure_chat_template(tokenizer) else "tokenizer"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out; any id will do
    max_length = spec.data.max_length

    encode = functools.partial(encode_pairs, tokenizer=tokenizer, max_length=max_length)

    def build(create: bool):
        train_ds, hit = tokenized(frames.train, tokenizer, max_length, build=create, mode="dpo", encode=encode)
        eval_ds, _ = tokenized(frames.eval, tokenizer, max_length, build=create, mode="dpo", encode=encode)
        return train_ds, eval_ds, hit

    train_ds, eval_ds, hit = tokenize_on_node(env, build)
    dropped = dict(frames.dropped)
    # A pair whose prompt alone fills data.max_length keeps no answer token (TRL drops it too).
    train_ds = _with_answers(train_ds, dropped, "train_truncated", max_length)
    eval_ds = _with_answers(eval_ds, dropped, "eval_truncated", max_length)
    dpo = spec.dpo or DPOSpec()
    info = {
        "data_format": frames.format,
        "chat_template": template,
        "dpo_loss": dpo.loss_type,
        "dpo_beta": dpo.beta,
        "dpo_label_smoothing": dpo.label_smoothing,
        "dpo_reference": "the base model (LoRA adapter disabled)" if spec.lora else "precomputed (full fine-tune)",
    }
    if env.is_local_main:
        lengths = np.asarray(train_ds["length"])
        log.info(
            "data: %d train / %d eval pairs (%s format%s); longest sequence %d tokens, mean %.0f; "
            "tokenization cache %s",
            len(train_ds),
            len(eval_ds),
            frames.format,
            f", {template} chat template" if template else "",
            lengths.max(),
            lengths.mean(),
            "hit" if hit else "miss (tokenized and cached)",
        )
    pad_id, model = tokenizer.pad_token_id, _model_identity(spec, model_dir)
    tok = tokenizer_fingerprint(tokenizer)
    collate, collate_eval = (
        Collate(ds, pad_id, max_length, dpo, f"{model}:{cache_key(frame, tok, max_length, 'dpo')}")
        for ds, frame in ((train_ds, frames.train), (eval_ds, frames.eval))
    )
    return Prepared(
        train_ds=train_ds,
        eval_ds=eval_ds,
        collate=collate,
        collate_eval=collate_eval,
        train_rows=len(train_ds),
        eval_rows=len(eval_ds),
        dropped=dropped,
        info=info,
        raw=tokenizer,
    )


def _with_answers(ds, dropped: dict, key: str, max_length: int):
    prompt_lengths = np.asarray([len(p) for p in ds["prompt_ids"]])
    keep = np.flatnonzero(prompt_lengths < max_length)
    if len(keep) == len(ds):
        return ds
    dropped[key] = len(ds) - len(keep)
    split = key.split("_")[0]  # train | eval
    log.warning(
        "%d %s pairs have prompts of data.max_length %d tokens or more; they are skipped",
        dropped[key],
        split,
        max_length,
    )
    if len(keep) == 0:
        raise KubetuneError(
            f"every prompt of the {len(ds)} {split} pairs takes {max_length} tokens or more, which leaves no "
            "answer token",
            field="data.max_length",
            fix="raise data.max_length, or check data.prompt_column"
            + (", or give data.eval pairs with shorter prompts" if split == "eval" else ""),
        )
    return ds.select(keep)


def build_model(spec: JobSpec, model_dir, data: Prepared, device: torch.device, dtype: torch.dtype, where=None):
    """The causal-LM task's model (full, LoRA or QLoRA) with every dropout off: the policy's and the
    reference's log-probabilities come from the same network (TRL's disable_dropout, on by default)."""
    model = causal_lm.build_model(spec, model_dir, data, device, dtype, where)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


# ---------------------------------------------------------------- the reference, once (full fine-tune)


def setup(spec: JobSpec, model, data: Prepared, env: DistEnv, device, autocast, lockstep: bool) -> None:
    """Full fine-tune: the reference log-probabilities of every train and eval pair, from the model
    before its first step, read from the cache or computed (each pair on one rank, then gathered;
    local rank 0 caches them). With LoRA the reference is the adapter-less model, on the fly."""
    if spec.lora is not None:
        return
    collates = (data.collate, data.collate_eval)
    key = f"{data.collate.key}:{data.collate_eval.key}:{spec.training.precision}:{device.type}"
    path = cache_root() / "reference" / hashlib.sha256(key.encode()).hexdigest()[:32]
    names = ("train", "eval")
    (missing,) = distributed.any_rank(not all((path / f"{n}.npy").exists() for n in names), device=device)
    if missing:
        size = spec.training.eval_batch_size or 2 * spec.training.batch_size
        values = [_reference_pass(model, c, env, device, autocast, size, lockstep) for c in collates]
        if env.is_local_main:
            _write_cache(path, dict(zip(names, values)))
        how = "computed and cached"
    else:
        values = [np.load(path / f"{n}.npy") for n in names]
        how = "read from the cache"
    for c, v in zip(collates, values):
        c.reference = v
    if env.is_main:
        log.info("dpo reference log-probabilities of %d + %d pairs %s: %s", len(values[0]), len(values[1]), how, path)


def _model_identity(spec: JobSpec, model_dir) -> str:
    """What names the base model's weights: its URI, its config and its weight files (name, size,
    modification time: a new download changes them), without reading the weights."""
    h = hashlib.sha256(f"kubetune-dpo-reference-v1:{spec.model.uri}@{spec.model.revision}".encode())
    for f in sorted(Path(model_dir).iterdir()):
        if f.name == "config.json":
            h.update(f.read_bytes())
        elif f.suffix in (".safetensors", ".bin") and f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


@torch.no_grad()
def _reference_pass(model, collate: Collate, env: DistEnv, device, autocast, batch_size: int, lockstep: bool):
    """[rows, 2] log-probabilities (chosen, rejected) of ``collate``'s dataset under ``model``."""
    batches, extra = rank_batches(collate.ds["length"], env, batch_size, lockstep)
    model.eval()
    parts = [
        _sequence_logps(model, collate(rows).to(device), autocast).view(2, -1).T.double().cpu().numpy()
        for rows in batches
    ]
    for _ in range(extra):
        _sequence_logps(model, collate(np.zeros(1, dtype=np.int64)).to(device), autocast)
    model.train()
    mine = np.concatenate(batches) if batches else np.zeros(0, dtype=np.int64)
    out = np.zeros((len(collate.ds), 2), dtype=np.float64)
    for rows, vals in distributed.all_gather_object((mine, np.concatenate(parts) if parts else np.zeros((0, 2)))):
        out[rows] = vals
    return out


def _write_cache(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Written into a temporary sibling, then renamed: a crash never leaves half a cache entry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    for name, values in arrays.items():
        np.save(tmp / f"{name}.npy", values)
    set_default_modes(tmp)
    try:
        os.replace(tmp, path)
    except OSError:  # another node's process sharing this cache won the race: its values are the same
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- the loss


def _sequence_logps(model, batch: PairBatch, autocast) -> torch.Tensor:
    """Each sequence's summed answer-token log-probability (fp32), computed as the causal-LM loss is."""
    per_token = causal_lm.target_logps(model, batch, autocast)
    mask = batch.labels[:, 1:] != IGNORE
    # Scattered into the sequence layout and summed per row: deterministic, unlike index_add on a GPU.
    dense = torch.zeros(mask.shape, dtype=per_token.dtype, device=per_token.device)
    return dense.masked_scatter(mask, per_token).sum(dim=1)


def _inner(model):
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _reference_logps(model, batch: PairBatch, autocast) -> tuple[torch.Tensor, torch.Tensor]:
    if batch.reference is not None:
        return batch.reference[:, 0], batch.reference[:, 1]
    inner = _inner(model)
    if not hasattr(inner, "disable_adapter"):
        raise RuntimeError("dpo: no reference log-probabilities (full fine-tune without the setup pass)")
    with torch.no_grad(), inner.disable_adapter():
        ref = _sequence_logps(inner, batch, autocast)
    return ref.chunk(2)


def pair_losses(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    dpo: DPOSpec,
    answer_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair loss and the statistics of ``METRICS`` (one row per pair) from the summed answer
    log-probabilities. sigmoid: −(1−ε) log σ(βΔ) − ε log σ(−βΔ), Δ the chosen minus the rejected
    log-ratio; ipo: (Δ' − 1/(2β))², Δ' with each log-ratio divided by its answer's tokens, as TRL."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    beta = dpo.beta
    if dpo.loss_type == "ipo":
        n_chosen, n_rejected = answer_tokens.chunk(2)
        delta = chosen_ratio / n_chosen.clamp(min=1.0) - rejected_ratio / n_rejected.clamp(min=1.0)
        losses = (delta - 1 / (2 * beta)) ** 2
    else:
        delta = chosen_ratio - rejected_ratio
        losses = -F.logsigmoid(beta * delta) * (1 - dpo.label_smoothing)
        if dpo.label_smoothing:
            losses = losses - F.logsigmoid(-beta * delta) * dpo.label_smoothing
    reward_chosen, reward_rejected = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    stats = torch.stack(
        [
            (reward_chosen > reward_rejected).float(),
            reward_chosen,
            reward_rejected,
            reward_chosen - reward_rejected,
            chosen.detach(),
            rejected.detach(),
        ],
        dim=1,
    )
    return losses, stats


def _pairs(model, batch: PairBatch, autocast) -> tuple[torch.Tensor, torch.Tensor]:
    ref_chosen, ref_rejected = _reference_logps(model, batch, autocast)  # first: no graph is held meanwhile
    chosen, rejected = _sequence_logps(model, batch, autocast).chunk(2)
    answer_tokens = (batch.labels != IGNORE).sum(dim=1).float()  # IPO's length normalization
    return pair_losses(chosen, rejected, ref_chosen, ref_rejected, batch.dpo, answer_tokens)


def loss(model, batch: PairBatch, autocast):
    """The pairs' summed loss, their count, and the sums of ``METRICS``."""
    losses, stats = _pairs(model, batch, autocast)
    return losses.sum(), torch.tensor(float(len(losses)), device=losses.device), stats.sum(dim=0)


def eval_step(model, batch: PairBatch, autocast) -> dict:
    losses, stats = _pairs(model, batch, autocast)
    return {"loss": losses.sum(), "pairs": len(losses), "stats": stats.sum(dim=0)}


def eval_totals(stats: list[dict], data: Prepared, device) -> torch.Tensor:
    totals = torch.zeros(2 + len(METRICS), device=device, dtype=torch.float64)  # loss sum, pairs, METRICS sums
    for st in stats:
        totals[0] += st["loss"].double()
        totals[1] += st["pairs"]
        totals[2:] += st["stats"].double()
    return totals


def eval_metrics(totals: np.ndarray, data: Prepared) -> dict:
    """Means over the held-out pairs: the loss, the reward accuracy, the rewards and their margin."""
    n = max(float(totals[1]), 1.0)
    out = {"eval_loss": float(totals[0]) / n}
    out.update({f"eval_{k}": float(v) / n for k, v in zip(METRICS, totals[2:])})
    out["eval_pairs"] = int(totals[1])
    out["eval_samples"] = data.eval_rows
    return out


# ---------------------------------------------------------------- how the results read


def _report_rows(m: dict) -> list[tuple[str, object]]:
    return [
        ("eval reward accuracy (chosen reward > rejected)", m.get("eval_reward_accuracy")),
        ("eval reward margin (mean)", m.get("eval_reward_margin")),
        ("eval rewards chosen / rejected", f"{m.get('eval_reward_chosen'):.4f} / {m.get('eval_reward_rejected'):.4f}"),
        ("eval pairs", m.get("eval_pairs")),
        (
            "dpo loss, beta, label smoothing",
            f"{m.get('dpo_loss')}, {m.get('dpo_beta')}, {m.get('dpo_label_smoothing')}",
        ),
        ("reference model", m.get("dpo_reference")),
        ("data format", m.get("data_format")),
        ("chat template", m.get("chat_template") or "none (text pairs)"),
    ]


def _card_about(m: dict) -> list[str]:
    return [
        f"Preference-tuned with DPO ({m.get('dpo_loss')} loss, beta {m.get('dpo_beta')}); the reference model is "
        f"{m.get('dpo_reference')}. On {m.get('eval_pairs')} held-out pairs the reward accuracy is "
        f"{m.get('eval_reward_accuracy', float('nan')):.4f} and the mean reward margin "
        f"{m.get('eval_reward_margin', float('nan')):.4f}.",
        f"Data format: {m.get('data_format')}; chat template: {m.get('chat_template') or 'none'}.",
    ]


def _summary(m: dict) -> str:
    return (
        f"reward accuracy {m['eval_reward_accuracy']:.4f}, margin {m['eval_reward_margin']:.4f}, "
        f"eval loss {m['eval_loss']:.4f} on {m['eval_pairs']} held-out pairs"
    )


TASK = Task(
    load_frames=load_pair_frames,
    prepare=prepare,
    build_model=build_model,
    loss=loss,
    eval_step=eval_step,
    eval_totals=eval_totals,
    eval_metrics=eval_metrics,
    export=causal_lm.export,
    headline=("eval_reward_accuracy", "eval_reward_margin"),
    present=Presentation(
        pipeline_tag="text-generation",
        report_rows=_report_rows,
        eval_curves=(),  # the step plots show the evaluations beside the training values
        eval_log_scale=False,
        card_usage=causal_lm.TASK.present.card_usage,
        card_about=_card_about,
        headline=lambda m: f"reward accuracy {m.get('eval_reward_accuracy', float('nan')):.4f}",
        summary=_summary,
        step_plots=(
            ("Reward accuracy", ("reward_accuracy", "eval_reward_accuracy")),
            ("Rewards", ("reward_chosen", "reward_rejected", "reward_margin", "eval_reward_margin")),
        ),
        loss_label="DPO loss",
    ),
    train_metrics=METRICS,
    setup=setup,
)
