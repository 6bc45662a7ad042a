"""What the tasks share, plain functions: the attention kernel and loading a model or tokenizer, and
the pieces several tasks use (one public module, so no task imports another's private names): the
label mask, the replaceable output head, chat messages, the tokenizer's chat template and pad token,
the state of a record normalizer (``RecordNormalizer``), the ``prepare`` skeleton (tables read on each node,
tokenized and cached, made ``Prepared``), and the report and card lines on the data (``data_rows``,
``data_card_line``)."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from kubetune.data import Carried
from kubetune.data.columns import NonText, check_table
from kubetune.data.rows import tokenized_rows
from kubetune.data.tables import short
from kubetune.distributed import DistEnv
from kubetune.errors import KubetuneError
from kubetune.inference.model import quiet_transformers
from kubetune.inference.scoring import PLAIN_HEAD
from kubetune.providers import S3Settings
from kubetune.tasks.base import LossOutput, Prepared, Steps, on_node_first

log = logging.getLogger(__name__)


def attention_kwargs(device: torch.device, dtype: torch.dtype) -> dict:
    """from_pretrained arguments for the attention kernel. bf16 on a CPU: eager attention, whose
    backward is plain matmuls on the bf16 units; a MiniLM training step (dropout on) is 9% faster
    than with SDPA's CPU kernels (benchmarks/README.md). Everywhere else: the default (SDPA)."""
    return {"attn_implementation": "eager"} if device.type == "cpu" and dtype == torch.bfloat16 else {}


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    quiet_transformers()
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        raise KubetuneError(
            f"no usable tokenizer in {model_dir}: {str(e).splitlines()[0]}",
            field="model.uri",
            fix="point it at a directory saved with save_pretrained (config + tokenizer files)",
        ) from None


# from_pretrained arguments that go to the model class; the rest go to its config.
_MODEL_KWARGS = ("dtype", "attn_implementation")


def load_pretrained(auto_cls, model_dir: Path, where: torch.device | None = None, **kwargs):
    """The pretrained model; with ``where`` on the meta device, the same modules without weights
    (built from the config: no file is read beyond it, no memory is taken)."""
    quiet_transformers()
    try:
        if where is not None and where.type == "meta":
            from transformers import AutoConfig

            model_kwargs = {k: kwargs.pop(k) for k in _MODEL_KWARGS if k in kwargs}
            config = AutoConfig.from_pretrained(model_dir, **kwargs)
            with torch.device("meta"):
                return auto_cls.from_config(config, **model_kwargs)
        return auto_cls.from_pretrained(model_dir, **kwargs)
    except (OSError, ValueError) as e:
        raise KubetuneError(
            f"cannot load a model from {model_dir}: {str(e).splitlines()[0]}",
            field="model.uri",
            fix="point it at a Hugging Face model directory or hf://ORG/NAME",
        ) from None


# ---------------------------------------------------------------- what several tasks share
# A task imports what another task also uses from here, never another task's private names
# (tests/unit/test_task_closure.py checks it).

# ---- labels: which tokens carry a loss

IGNORE = -100  # the label of a token without a loss (cross-entropy's ignore_index)


def target_mask(labels: torch.Tensor) -> torch.Tensor:
    """(rows, positions − 1): the positions whose next token is a target (its label is not IGNORE);
    position t predicts token t + 1."""
    return labels[:, 1:] != IGNORE


def next_token_targets(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A micro-batch's label mask (``target_mask``), its target token ids in row-major order, and the
    positions that predict one as transformers' ``logits_to_keep`` takes them, (rows, positions): the
    last position predicts nothing."""
    mask = target_mask(labels)
    keep = torch.cat([mask, mask.new_zeros(mask.shape[0], 1)], dim=1)
    return mask, labels[:, 1:][mask], keep


@dataclass
class Targets(Carried):
    """A micro-batch's loss targets as integer indices (``label_targets``), which select without reading a count
    back from the device, unlike a boolean mask. Built on the host by a collate, they travel with the batch
    (``Batch.targets``) for the ``labels`` they were built from.

    ``positions``: the flat indices, into (rows × positions), of the positions that predict a target, row-major;
    ``slots``: the same positions as flat indices into ``target_mask``'s (rows × (positions − 1));
    ``ids``: the target token ids in that order; ``count``: how many (a 0-dim int64 tensor, as ``mask.sum()``)."""

    labels: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    ids: torch.Tensor
    count: torch.Tensor


def label_targets(labels: torch.Tensor) -> Targets:
    """The ``Targets`` of ``labels`` (rows, positions): what ``next_token_targets`` selects, as indices. Built by a
    collate on the host; on a device its boolean selection reads the count back (a sync)."""
    mask = target_mask(labels)
    width = labels.shape[1]
    slots = mask.flatten().nonzero().flatten()
    # slot r·(width − 1) + t is position r·width + t of the row-major (rows × width) grid
    positions = slots + torch.div(slots, max(width - 1, 1), rounding_mode="floor")
    return Targets(labels, positions, slots, labels[:, 1:][mask], mask.sum())


def batch_targets(batch: Any) -> Targets:
    """The micro-batch's host-built ``Targets`` where it carries them for its own labels (``Batch.targets``), else
    built from its labels (a batch made elsewhere, or whose labels were replaced)."""
    carried = batch.targets
    if isinstance(carried, Targets) and carried.labels is batch.labels:
        return carried
    return label_targets(batch.labels)


# ---- the replaceable head: a causal LM's output projection computed by the task instead

# ``PLAIN_HEAD`` (inference.scoring, which scores served prompts the same way): causal LMs whose forward is
# ``lm_head(hidden_states[logits_to_keep])`` and nothing after it, so the projection can be replaced by what the
# task computes from the hidden states (the loss, the log-probabilities). Others scale or soft-cap their logits
# after the head (Gemma 2, Cohere, Granite), so the task reads their logits.


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside its DDP wrapper (the wrapper's ``module``), or ``model`` itself: what a task reaches into
    (a LoRA adapter to disable, a reference attached by ``tasks.reference``), never the wrapper's own attributes."""
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    return inner


def replaceable_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The output projection of a ``PLAIN_HEAD`` causal LM under its DDP, FSDP or PEFT wrapper, when
    it is a bias-free linear layer (not LoRA-adapted: the task projects with its weight alone); else None."""
    inner: Any = unwrap(model)  # a transformers or PEFT model: methods nn.Module does not declare
    if hasattr(inner, "get_base_model"):  # PEFT passes logits_to_keep through to the base model
        inner = inner.get_base_model()
    if getattr(getattr(inner, "config", None), "model_type", None) not in PLAIN_HEAD:
        return None
    head = inner.get_output_embeddings()
    return head if type(head) is torch.nn.Linear and head.bias is None else None


@contextlib.contextmanager
def head_forward(head: torch.nn.Linear, forward: Callable[[torch.Tensor], torch.Tensor]):
    """Inside the block, ``head`` returns ``forward(hidden states)`` instead of projecting them (inside
    the model's forward, so DDP and FSDP see its weight used where they expect)."""
    setattr(head, "forward", forward)  # an instance attribute shadows the class's forward; removed below
    try:
        yield
    finally:
        del head.forward


# ---- chat rows: messages in TRL's conventions, a task's normalized rows

ROLES = ("system", "user", "assistant", "tool")
RECORD_SCHEMA = pa.schema([("record", pa.string())])  # a task's normalized rows: the JSON text of each


def as_messages(value) -> list | None:
    """``value`` as a list (of would-be messages) when it is one: a list, an Arrow array, a JSON list."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    return value if isinstance(value, list) else None


def cell_messages(value, role: str, key: str, col: str, source: str, i: int) -> list[dict] | None:
    """The messages of one cell (row ``i`` of ``source``, column ``col``, set by the spec's ``key``):
    a list of {role, content} as it is, text as one turn of ``role``; None when the cell is missing or
    empty, or a message's content is not text.

    Raises:
        KubetuneError: a list that is not of {role, content} objects, or an unknown role.
    """
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return None
    messages = as_messages(value)
    if messages is None:
        text = value if isinstance(value, str) and value.strip() else None
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


# ---- the tokenizer: its chat template and pad token

# Used when the tokenizer brings no chat template (documented in the README). It is saved with the
# exported tokenizer, so `kubetune predict` renders prompts exactly as training did.
FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def ensure_chat_template(tokenizer) -> bool:
    """Give the tokenizer ``FALLBACK_CHAT_TEMPLATE`` when it has none; True when it did."""
    if getattr(tokenizer, "chat_template", None):
        return False
    tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
    return True


def prepare_tokenizer(tokenizer, chat: bool, chat_template: str | None = None) -> str | None:
    """The tokenizer of a task whose rows render as chat (``chat``) or as they are: with
    ``data.chat_template`` if given, else its own or the fallback; a pad token (padding is masked out, so
    the EOS will do). Returns which template renders the rows (None for text), for the log and metrics."""
    template = None
    if chat:
        if chat_template:
            tokenizer.chat_template, template = chat_template, "data.chat_template"
        else:
            template = "fallback" if ensure_chat_template(tokenizer) else "tokenizer"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return template


# ---- the prepare skeleton: a task's tables read on each node, tokenized and cached, made ``Prepared``


def load_on_node(load_frames: Callable[..., Any], spec, env: DistEnv):
    """The task's checked tables, ``load_frames(spec.data, seed, S3Settings)``, read on local rank 0
    first; the node's other ranks then find its normalized rows in the cache. Collective."""
    return on_node_first(env, lambda: load_frames(spec.data, spec.training.seed, S3Settings.from_spec(spec)))


@dataclass
class Tokens:
    """A task's rows tokenized (``tokenize_split``): its training and evaluation datasets, which the
    task may cut further (e.g. rows left without a target), and their cache keys."""

    train: Any  # None under data.streaming: the training rows come from a ``Feed``
    eval: Any
    hit: bool  # the training rows' tokens were in the cache
    train_key: str  # the training rows' tokens' cache key: ``Prepared.content`` (a resume checks it)
    eval_key: str

    @property
    def cache(self) -> str:
        """The log's word for where the training tokens came from."""
        return "hit" if self.hit else "miss (tokenized and cached)"


def tokenize_split(frames, env: DistEnv, fingerprint: str, encode: Callable, train: bool = True) -> Tokens:
    """The training rows (unless not ``train``: a stream brings them), then the evaluation rows, of a
    task's ``frames`` (a ``data.rows.RowSplit``) tokenized by ``encode`` on every process of the node
    and cached under ``fingerprint`` (the task's mode and all else its tokens depend on: part of the
    cache key). Collective."""
    train_ds, hit, train_key = (
        tokenized_rows(frames.rows, frames.train_ids, env=env, fingerprint=fingerprint, encode=encode, what="train")
        if train
        else (None, False, "")
    )
    eval_ds, _, eval_key = tokenized_rows(
        frames.eval_rows, frames.eval_ids, env=env, fingerprint=fingerprint, encode=encode, what="eval"
    )
    return Tokens(train_ds, eval_ds, hit, train_key, eval_key)


def prepared(tokens: Tokens, **parts) -> Prepared:
    """The ``Prepared`` of ``tokens`` (its datasets, their sizes, the training rows' content key) and of
    the task's own ``parts`` (collate, dropped, info, ...)."""
    return Prepared(
        train_ds=tokens.train,
        eval_ds=tokens.eval,
        train_rows=0 if tokens.train is None else len(tokens.train),
        eval_rows=len(tokens.eval),
        content=tokens.train_key,
        **parts,
    )


# ---- the steps of a task that learns from pairs (DPO, ORPO, reward models)


def pair_steps(
    names: tuple[str, ...], pairs: Callable[[torch.nn.Module, Any, torch.autocast], tuple[torch.Tensor, torch.Tensor]]
) -> Steps:
    """A pair task's ``loss``, ``eval_step``, ``eval_totals`` and ``eval_metrics`` (``Task`` fields) from ``pairs``:
    (model, batch, autocast) -> (the micro-batch's summed loss, one row per pair of the metrics ``names``). The loss
    unit is the pair; the evaluation reports means over the held-out pairs, ``eval_<name>``, with ``eval_loss``,
    ``eval_pairs`` and ``eval_samples``."""

    def loss(model, batch, autocast) -> LossOutput:
        total, stats = pairs(model, batch, autocast)
        return LossOutput(total, torch.tensor(float(len(stats)), device=total.device), stats.sum(dim=0))

    def eval_step(model, batch, autocast) -> dict:
        total, stats = pairs(model, batch, autocast)
        return {"loss": total.detach(), "pairs": len(stats), "stats": stats.sum(dim=0)}

    def eval_totals(stats: list[dict], data: Prepared, device) -> dict[str, torch.Tensor]:
        totals = {
            "loss": torch.zeros((), device=device, dtype=torch.float64),
            "pairs": torch.zeros((), device=device, dtype=torch.float64),
            "metrics": torch.zeros(len(names), device=device, dtype=torch.float64),
        }
        for st in stats:
            totals["loss"] += st["loss"].double()
            totals["pairs"] += st["pairs"]
            totals["metrics"] += st["stats"].double()
        return totals

    def eval_metrics(totals: dict, data: Prepared) -> dict:
        n = max(float(totals["pairs"]), 1.0)
        out = {"eval_loss": float(totals["loss"]) / n}
        out.update({f"eval_{k}": float(v) / n for k, v in zip(names, totals["metrics"])})
        out["eval_pairs"] = int(totals["pairs"])
        out["eval_samples"] = data.eval_rows
        return out

    return Steps(loss, eval_step, eval_totals, eval_metrics)


def right_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id sequences as one right-padded batch: (input_ids, attention_mask)."""
    width = max(len(q) for q in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for k, q in enumerate(seqs):
        ids[k, : len(q)] = torch.tensor(q, dtype=torch.long)
        mask[k, : len(q)] = 1
    return ids, mask


# ---- a sequence classifier's model and export (classification, reward models)


def without_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Every dropout of ``model`` off (TRL's ``disable_dropout``, on by default in its DPO and reward trainers):
    a pair's two answers, and a policy and its reference, are then scored by the same network."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def sequence_classifier(spec, model_dir: Path, device: torch.device, dtype: torch.dtype, where=None, **head):
    """The pretrained model with a fresh sequence-classification head (``head``: num_labels, id2label, ...), wrapped
    with LoRA when the spec asks (peft's SEQ_CLS: the head trained whole, as modules_to_save); on ``where``
    (default: the training device; meta: the modules without weights)."""
    from transformers import AutoModelForSequenceClassification

    where = where or device
    model = load_pretrained(
        AutoModelForSequenceClassification, model_dir, where, **attention_kwargs(device, dtype), **head
    )
    if spec.lora is None:
        return model.to(where)
    from peft import LoraConfig, TaskType, get_peft_model

    config = LoraConfig(
        task_type=TaskType.SEQ_CLS,
        r=spec.lora.r,
        lora_alpha=spec.lora.alpha,
        lora_dropout=spec.lora.dropout,
        target_modules=spec.lora.target_modules,
    )
    return get_peft_model(model, config).to(where)


def export_merged(spec, model, tokenizer, out: Path) -> None:
    """``model/`` (merged for LoRA; what transformers.pipeline loads) with its tokenizer, and ``adapter/`` for LoRA."""
    from kubetune import artifacts

    if spec.lora is not None:
        artifacts.replace_dir(lambda d: model.save_pretrained(d), out / "adapter")
        model = model.merge_and_unload()

    def save(d: Path) -> None:
        model.save_pretrained(d, max_shard_size=artifacts.SHARD_SIZE)  # safetensors
        tokenizer.save_pretrained(d)

    artifacts.replace_dir(save, out / "model")


class RecordNormalizer:
    """What the record normalizers (``data.rows.Normalizer``: causal LM, preference pairs, KTO, GRPO prompts)
    share: the table read (``source``, the value of data.train or data.eval named by ``field_name``), its format
    (data.train's, handed to data.eval as ``train_facts``; None: detected on the first chunk), the rows read and
    the text columns' contents (``non_text``, by spec key), checked over the whole table by ``check_read``."""

    schema = RECORD_SCHEMA

    def __init__(self, spec, field_name: str, train_facts: dict | None):
        self.spec, self.field_name = spec, field_name
        self.source = getattr(spec, field_name.split(".")[1])
        self.fmt: str | None = train_facts["format"] if train_facts else None
        self.rows = 0
        self.non_text: dict[str, NonText] = {}  # text column key -> what it holds when no chunk held text

    def check_read(self, text_fix: str) -> None:
        """``data.columns.check_table`` over what was read: some rows, text in each text column
        (``text_fix``: the fix of one that held none, naming its key as ``{key}``)."""
        check_table(
            self.rows,
            self.non_text,
            self.spec,
            self.source,
            self.field_name,
            rows_fix="point it at data with at least one row",
            text_fix=text_fix,
        )


def data_rows(m: dict, no_template: str) -> list[tuple[str, object]]:
    """The report's rows on the data: its format and its chat template (``no_template`` without one)."""
    return [("data format", m.get("data_format")), ("chat template", m.get("chat_template") or no_template)]


def data_card_line(m: dict) -> str:
    """The model card's line on the data: its format and its chat template."""
    return f"Data format: {m.get('data_format')}; chat template: {m.get('chat_template') or 'none'}."
