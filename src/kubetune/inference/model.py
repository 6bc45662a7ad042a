"""Inference on an exported model: text classification, or generation for a causal LM.

Everything a user hands ``predict`` is checked before transformers sees it (config.json, weights,
tokenizer, the texts), so a bad input is one ``KubetuneError`` line, never a traceback. Weights
load from safetensors only: kubetune never unpickles a file.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from pathlib import Path

from kubetune import providers
from kubetune.artifacts import MAX_CONFIG_BYTES
from kubetune.errors import KubetuneError

# What a model does, as the transformers pipeline that serves it (a task's Presentation.pipeline_tag).
GENERATOR = "text-generation"
CLASSIFIER = "text-classification"
NOUNS = {GENERATOR: "causal LM", CLASSIFIER: "text classifier"}

# A model config is a few KB; a --file of texts is read whole, so both are bounded.
MAX_TEXT_FILE_BYTES = 64 << 20
# Files of which at least one is in any tokenizer directory save_pretrained writes.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.txt",
    "vocab.json",
    "spiece.model",
    "sentencepiece.bpe.model",
)
# Config attributes that hold the number of positions a model was trained with.
CONTEXT_ATTRS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def pull(uri: str, dest: Path | None = None, s3: providers.S3Settings = providers.S3Settings()) -> Path:
    """Download and verify an exported artifact (s3:// needs its complete manifest, and is reached
    with ``s3``; hf:// a repo).

    Returns:
        The local directory.
    """
    scheme = providers.parse_uri(uri).scheme
    if scheme == "s3":
        from kubetune.paths import cache_root
        from kubetune.providers.s3 import Location, download

        loc = Location.parse(uri, "MODEL")
        dest = dest or cache_root() / "pulled" / loc.bucket / loc.key.strip("/")
        return download(uri.rstrip("/") + "/", dest, field="MODEL", settings=s3, require_manifest=True)
    if scheme == "hf" and dest is not None:
        from kubetune.artifacts import hub

        return hub.pull(uri, dest)
    if dest is not None:
        raise KubetuneError(f"{uri!r} is already local", field="URI", fix="pull takes s3:// or hf:// URIs")
    return providers.resolve(uri, kind="model", field="MODEL", s3=s3)


def model_path(uri: str, s3: providers.S3Settings = providers.S3Settings()) -> Path:
    """Accept a job's output (uses its ``model/``) or a model directory itself; s3:// (reached with
    ``s3``) and hf:// artifacts are downloaded (and verified) first.

    Returns:
        The model directory, checked by ``check_model``.

    Raises:
        KubetuneError: no exported model there, or one ``predict`` cannot load (see ``check_model``).
    """
    path = pull(uri, s3=s3)
    if (path / "model" / "config.json").exists():
        path = path / "model"
    elif not (path / "config.json").exists():
        raise KubetuneError(
            f"{_short(uri)!r} holds no exported model (no config.json, no model/config.json)",
            field="MODEL",
            fix="pass a job's output.uri or its model/ directory",
        )
    check_model(path)
    return path


def run_task(path: Path) -> str | None:
    """The task of the job that exported the model in ``path`` (a job output's ``model/``), from the
    job's metrics.json beside it; None when there is none or it does not say."""
    from kubetune.paths import BrokenRecord, read_bounded_json

    if path.name != "model":
        return None
    try:
        metrics = read_bounded_json(path.parent / "metrics.json", limit=MAX_CONFIG_BYTES, constants=True)
    except (OSError, BrokenRecord):
        return None
    task = metrics.get("task") if isinstance(metrics, dict) else None
    return task if isinstance(task, str) else None


def check_model(path: Path) -> str:
    """Check that ``path`` holds a model ``predict`` can load: a config transformers knows naming a
    sequence classifier or a causal LM, safetensors weights (never only a pickle), and a tokenizer.

    Returns:
        ``GENERATOR`` or ``CLASSIFIER`` (the pipeline that serves it).

    Raises:
        KubetuneError: names the directory and what is wrong with it.
    """
    from kubetune.artifacts import check_model_files, check_model_weights

    check_model_files(path, field="MODEL")  # before transformers opens any of them
    kind = model_kind(path)
    check_model_weights(path, _short(str(path)), field="MODEL")
    if not any(p.name.endswith(".safetensors") for p in path.iterdir()):
        raise KubetuneError(
            f"{_short(str(path))!r} holds no weights (no model.safetensors)",
            field="MODEL",
            fix="export the model with save_pretrained into that directory",
        )
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        # transformers would build an empty tokenizer from the config and map every word to [UNK]
        raise KubetuneError(
            f"{_short(str(path))!r} holds no tokenizer (no tokenizer.json or tokenizer_config.json)",
            field="MODEL",
            fix="save the tokenizer beside the model: tokenizer.save_pretrained(dir)",
        )
    return kind


def model_kind(path: Path) -> str:
    """What the model in ``path`` does, read from its config.json (which is checked).

    Returns:
        ``GENERATOR`` (architectures ``*ForCausalLM`` and the like) or ``CLASSIFIER``
        (``*ForSequenceClassification``).

    Raises:
        KubetuneError: config.json unreadable, not JSON, not an object, no or unknown ``model_type``,
            fields transformers refuses, or an architecture that neither classifies nor generates.
    """
    from kubetune.artifacts import MODEL_FILE_FIX
    from kubetune.paths import read_regular

    shown = _short(str(path / "config.json"))

    def bad(problem: str, fix: str = "export the model again with save_pretrained") -> KubetuneError:
        return KubetuneError(f"{shown} {problem}", field="MODEL", fix=fix)

    try:
        size = (path / "config.json").stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise bad(f"is {size:,} bytes; a model config is a few KB")
        # a regular file, read at most to the bound (a FIFO, or /dev/zero with its size of 0, is one line)
        data = read_regular(path / "config.json", field="MODEL", limit=MAX_CONFIG_BYTES, fix=MODEL_FILE_FIX)
        config = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise bad(f"is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None
    except json.JSONDecodeError as e:
        raise bad(f"is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise bad("is nested too deeply to be a model config") from None
    except OSError as e:
        raise bad(f"cannot be read ({e.strerror or type(e).__name__})", "check the path and its permissions") from None
    if not isinstance(config, dict):
        raise bad(f"holds a JSON {type(config).__name__}, not an object")
    # imported once config.json is known to be a file (transformers with torch: seconds)
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    )

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise bad("has no model_type")
    if model_type not in CONFIG_MAPPING:
        raise bad(
            f"has model_type {_short(model_type, 60)!r}, which transformers {transformers.__version__} does not know",
            "export it with a transformers version that has it, or upgrade transformers",
        )
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        raise bad("names no architectures, so it is unclear whether the model classifies or generates")
    # by name: GPT2LMHeadModel generates too
    if any(a.endswith("ForCausalLM") or a in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for a in archs):
        kind = GENERATOR
    elif any(
        a.endswith("ForSequenceClassification") or a in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.values()
        for a in archs
    ):
        kind = CLASSIFIER
    else:
        # e.g. a base encoder: the pipeline would add a random classification head and print noise
        raise bad(
            f"describes a {_short(archs[0], 60)}, neither a sequence classifier nor a causal LM",
            "pass a model kubetune exported (a job's output or its model/ directory)",
        )
    try:
        AutoConfig.from_pretrained(path)
    except _load_errors() as e:
        raise bad(f"is not a valid {_short(model_type, 60)} config: {_describe(e)}") from None
    return kind


def read_texts(file: Path) -> list[str]:
    """The non-blank lines of a UTF-8 text file (a leading byte-order mark is dropped).

    Raises:
        KubetuneError: the file cannot be read, is larger than ``MAX_TEXT_FILE_BYTES``, is binary
            or is not UTF-8 (names the byte offset), or holds no text.
    """
    shown = _short(str(file))
    try:
        with file.open("rb") as f:
            data = f.read(MAX_TEXT_FILE_BYTES + 1)
    except OSError as e:
        raise KubetuneError(
            f"cannot read {shown}: {e.strerror or type(e).__name__}", field="--file", fix="check the path"
        ) from None
    if len(data) > MAX_TEXT_FILE_BYTES:
        raise KubetuneError(
            f"{shown} is larger than {MAX_TEXT_FILE_BYTES >> 20} MiB", field="--file", fix="split it into smaller files"
        )
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise KubetuneError(
            f"{shown} is UTF-16 text (it starts with a UTF-16 byte-order mark)", field="--file", fix="save it as UTF-8"
        )
    if b"\x00" in data:
        raise KubetuneError(
            f"{shown} is a binary file (NUL byte at offset {data.index(0)})",
            field="--file",
            fix="pass a UTF-8 text file, one text per line",
        )
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        offset = e.start + (3 if data.startswith(b"\xef\xbb\xbf") else 0)
        raise KubetuneError(
            f"{shown} is not UTF-8 text (byte 0x{data[offset]:02x} at offset {offset})",
            field="--file",
            fix="save it as UTF-8, e.g. iconv -f latin1 -t utf-8",
        ) from None
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise KubetuneError(f"{shown} holds no text (only blank lines)", field="--file", fix="write one text per line")
    return lines


def generate(
    uri: str,
    prompts: list[str],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    chat: bool | None = None,
    seed: int = 0,
    warn: Callable[[str], None] | None = None,
) -> list[dict]:
    """Continue each prompt with a causal LM; returns ``[{prompt, completion}]`` in input order.

    A prompt longer than the model's context less ``max_new_tokens`` keeps its last tokens (the
    end of a prompt is what the continuation follows); ``warn`` gets one line saying so.

    Args:
        chat: render each prompt as a user turn with the tokenizer's chat template (the template the
            model was trained with, saved beside it); default: when the tokenizer has one.
        temperature: 0 = greedy decoding; above 0 samples (seeded by ``seed``).
        warn: called with one line when prompts were cut; default: the ``kubetune.inference.model`` logger.

    Raises:
        KubetuneError: the model is not a causal LM or cannot be loaded, ``--chat`` without a chat
            template, a non-finite temperature, or ``max_new_tokens`` that leaves no room for a prompt.
    """
    import torch
    from transformers import AutoModelForCausalLM

    if not math.isfinite(temperature) or temperature < 0:
        raise KubetuneError(
            f"{temperature} is not a finite number >= 0", field="--temperature", fix="pass e.g. 0 (greedy) or 0.7"
        )
    path = model_path(uri)
    _expect(path, GENERATOR)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = _tokenizer(path)
    model = _model(AutoModelForCausalLM, path)
    _check_vocab(model, tokenizer, path)
    model = model.to(device).eval()
    use_chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
    if use_chat and not getattr(tokenizer, "chat_template", None):
        raise KubetuneError(
            f"the tokenizer in {_short(str(path))} has no chat template",
            field="--chat",
            fix="drop --chat to complete the raw prompt",
        )
    context = _context(model.config, tokenizer)
    if context is not None and max_new_tokens >= context:
        raise KubetuneError(
            f"{max_new_tokens:,} new tokens leave no room for a prompt in the model's {context}-token context",
            field="--max-new-tokens",
            fix=f"pass at most {context - 1}",
        )
    budget = None if context is None else context - max_new_tokens

    render = functools.partial(_render, tokenizer, use_chat, path)
    results, cut = [], []
    for number, prompt in enumerate(prompts, 1):
        ids, kept, total = _fit(tokenizer, render, prompt, budget)
        if kept is not None:
            cut.append((number, kept, total))
        enc = torch.tensor([ids], device=device)
        torch.manual_seed(seed)
        sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        with torch.no_grad():
            out = model.generate(
                input_ids=enc,
                attention_mask=torch.ones_like(enc),
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                **sampling,
            )
        completion = tokenizer.decode(out[0, enc.shape[1] :], skip_special_tokens=True)
        results.append({"prompt": prompt, "completion": completion})
    if cut:
        (warn or _log_warning)(_cut_line(cut, context, max_new_tokens))
    return results


def _render(tokenizer, use_chat: bool, path: Path, text: str) -> list[int]:
    """A prompt's token ids: as a user turn in the chat template (which holds BOS), or as it is."""
    if use_chat:
        from jinja2 import TemplateError

        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        except TemplateError as e:
            raise KubetuneError(
                f"the chat template in {_short(str(path))} fails: {_describe(e)}",
                field="--chat",
                fix="fix chat_template in tokenizer_config.json, or pass --no-chat",
            ) from None
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(text)["input_ids"]


def _cut_line(cut: list[tuple[int, int, int]], context: int | None, max_new_tokens: int) -> str:
    """One line about the prompts cut to fit the context: (prompt number, tokens kept, tokens it had)."""
    if len(cut) == 1:
        which = f"prompt {cut[0][0]} has {cut[0][2]:,} tokens"
    else:
        which = (
            f"{len(cut)} prompts ({', '.join(str(c[0]) for c in cut[:5])}{', ...' if len(cut) > 5 else ''}) "
            f"have up to {max(c[2] for c in cut):,} tokens"
        )
    return (
        f"{which}, more than the model's {context}-token context leaves beside --max-new-tokens {max_new_tokens}; "
        f"kept the last {min(c[1] for c in cut):,} tokens of the text"
    )


def predict(uri: str, texts: list[str], batch_size: int = 32) -> list[dict]:
    """Classify ``texts``; returns ``[{text, label, score}]`` in input order. Each text is cut to
    the model's context (its first tokens are kept).

    Raises:
        KubetuneError: the model is not a sequence classifier or cannot be loaded.
    """
    import torch
    from transformers import AutoModelForSequenceClassification, pipeline

    path = model_path(uri)
    _expect(path, CLASSIFIER)
    tokenizer = _tokenizer(path)
    model = _model(AutoModelForSequenceClassification, path)
    _check_vocab(model, tokenizer, path)
    clf = pipeline(
        "text-classification", model=model, tokenizer=tokenizer, device=0 if torch.cuda.is_available() else -1
    )
    # An explicit bound: a tokenizer saved without model_max_length does not truncate at all, and the
    # position embeddings then fail on a long text.
    results = clf(texts, batch_size=batch_size, truncation=True, max_length=_context(model.config, tokenizer) or 512)
    return [{"text": t, "label": r["label"], "score": float(r["score"])} for t, r in zip(texts, results)]


def _expect(path: Path, kind: str) -> None:
    found = check_model(path)
    if found != kind:
        raise KubetuneError(
            f"{_short(str(path))!r} is a {NOUNS[found]}, not a {NOUNS[kind]}",
            field="MODEL",
            fix="generate() takes a causal LM, predict() a classifier",
        )


def _quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    _quiet_transformers()
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except _load_errors() as e:
        raise KubetuneError(
            f"cannot load the tokenizer in {_short(str(path))}: {_describe(e)}",
            field="MODEL",
            fix="save the tokenizer beside the model: tokenizer.save_pretrained(dir)",
        ) from None


def _model(auto_class, path: Path):
    _quiet_transformers()
    shown = _short(str(path))
    try:
        # use_safetensors=True: never fall back to a pickle, even one that appears after the check.
        # Mismatched shapes are reported below rather than as transformers' multi-line report.
        model, info = auto_class.from_pretrained(
            path, use_safetensors=True, trust_remote_code=False, ignore_mismatched_sizes=True, output_loading_info=True
        )
    except _load_errors() as e:
        raise KubetuneError(
            f"cannot load the model in {shown}: {_describe(e)}",
            field="MODEL",
            fix="export the model again with save_pretrained",
        ) from None
    # transformers fills a missing or mismatched tensor with random values and only logs it: the
    # model would then print confident noise
    missing, mismatched = sorted(info.get("missing_keys") or []), list(info.get("mismatched_keys") or [])
    fix = "export the model again with save_pretrained (config.json and the weights must come from the same model)"
    if mismatched:
        key, stored, expected = mismatched[0][:3]  # (name, shape in the weights, shape the config makes)
        raise KubetuneError(
            f"the weights in {shown} do not fit its config.json: "
            f"{_count(len(mismatched), 'tensor')} differ{'s' if len(mismatched) == 1 else ''} "
            f"in shape (e.g. {_short(key, 80)} is {tuple(stored)} in the weights, {tuple(expected)} by config.json)",
            field="MODEL",
            fix=fix,
        )
    if missing:
        raise KubetuneError(
            f"the weights in {shown} lack {_count(len(missing), 'tensor')} its config.json asks for "
            f"(e.g. {_short(missing[0], 80)})",
            field="MODEL",
            fix=fix,
        )
    return model


def _check_vocab(model, tokenizer, path: Path) -> None:
    """A tokenizer larger than the model's embedding table makes ids the model cannot look up."""
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise KubetuneError(
            f"the tokenizer in {_short(str(path))} has {len(tokenizer):,} tokens "
            f"and the model's embeddings only {rows:,}",
            field="MODEL",
            fix="save the tokenizer the model was trained with beside it",
        )


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _load_errors() -> tuple[type[BaseException], ...]:
    """What transformers, safetensors and huggingface_hub raise on a damaged model directory."""
    from huggingface_hub import errors as hf_errors
    from safetensors import SafetensorError

    strict = getattr(hf_errors, "StrictDataclassError", None)
    return (
        OSError,
        ValueError,
        TypeError,
        KeyError,
        AttributeError,
        IndexError,
        ArithmeticError,
        RuntimeError,
        SafetensorError,
        *([strict] if strict else []),
    )


def _context(config, tokenizer) -> int | None:
    """Positions the model can attend over: its config's bound, else the tokenizer's, else unknown."""
    for name in CONTEXT_ATTRS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return min(value, tokenizer.model_max_length) if 0 < tokenizer.model_max_length < value else value
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < 1_000_000 else None


def _fit(
    tokenizer, render: Callable[[str], list[int]], prompt: str, budget: int | None
) -> tuple[list[int], int | None, int]:
    """Token ids of ``prompt`` as rendered, at most ``budget`` long: a longer prompt keeps its end.

    Returns:
        The ids; the number of the prompt's own tokens kept when it was cut, else None; its length in tokens.
    """
    if budget is None:
        ids = render(prompt)
        return ids, None, len(ids)
    content = tokenizer(prompt, add_special_tokens=False)["input_ids"]  # tokenized once, however long
    overhead = len(render(""))
    if len(content) + overhead <= budget:
        ids = render(prompt)
        if len(ids) <= budget:
            return ids, None, len(content)
    keep = budget - overhead
    if keep <= 0:
        raise KubetuneError(
            f"the prompt template alone takes {overhead} of the {budget} tokens left by --max-new-tokens",
            field="--max-new-tokens",
            fix="pass a smaller --max-new-tokens",
        )
    for _ in range(4):  # decoding and encoding again may merge tokens differently at the cut
        ids = render(tokenizer.decode(content[-keep:]))
        if len(ids) <= budget:
            return ids, keep, len(content)
        keep -= len(ids) - budget
        if keep <= 0:
            break
    return ids[-budget:], max(keep, 0), len(content)


def _log_warning(line: str) -> None:
    import logging

    logging.getLogger(__name__).warning(line)


def _describe(err: BaseException) -> str:
    """One short line for an exception from a library: its type and its text, cut short."""
    text = " ".join(str(err).split())
    return _short(f"{type(err).__name__}: {text}" if text else type(err).__name__, 200)


def _short(text: str, limit: int = 160) -> str:
    """``text`` on one line and at most ``limit`` characters (user-supplied values can be anything)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
