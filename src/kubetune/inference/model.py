"""An exported model folder, found, checked and loaded for inference, whatever the task: where it is
(a job's output, its ``model/``, s3:// or hf://), its config.json, weights and tokenizer checked before
transformers opens them, the task of the run that exported it, and the model and tokenizer loaded.

Everything a user hands ``predict`` or ``serve`` is checked before transformers sees it (config.json,
weights, tokenizer, the texts), so a bad input is one ``KubetuneError`` line, never a traceback. Weights
load from safetensors only: kubetune never unpickles a file. What a model does with them (generate,
classify, score) is its task's inference (``seam.Inference``), built on ``causal`` or ``classifier``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from kubetune import providers
from kubetune.artifacts import MAX_CONFIG_BYTES
from kubetune.artifacts.pull import pull
from kubetune.errors import KubetuneError

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


def model_path(uri: str, s3: providers.S3Settings = providers.S3Settings()) -> Path:
    """Accept a job's output (uses its ``model/``) or a model directory itself; s3:// (reached with
    ``s3``) and hf:// artifacts are downloaded (and verified) first.

    Returns:
        The model directory, checked by ``check_model``.

    Raises:
        KubetuneError: no exported model there, or one ``predict`` cannot load (see ``check_model``).
    """
    path = locate(uri, s3)
    check_model(path)
    return path


def locate(uri: str, s3: providers.S3Settings = providers.S3Settings()) -> Path:
    """``model_path`` without the check, for a command that checks the directory once itself (`kubetune serve`:
    ``tasks.for_model`` checks it while finding its task).

    Raises:
        KubetuneError: no exported model there (no config.json, no model/config.json), or it cannot be fetched.
    """
    path = pull(uri, s3=s3)
    if (path / "model" / "config.json").exists():
        path = path / "model"
    elif not (path / "config.json").exists():
        raise KubetuneError(
            f"{short(uri)!r} holds no exported model (no config.json, no model/config.json)",
            field="MODEL",
            fix="pass a job's output.uri or its model/ directory",
        )
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


def check_model(path: Path) -> dict:
    """Check that ``path`` holds a model inference can load: a config transformers knows, naming its
    architectures, safetensors weights (never only a pickle), and a tokenizer.

    Returns:
        The config (config.json's object): a task's inference tells by it whether the model is its kind.

    Raises:
        KubetuneError: names the directory and what is wrong with it.
    """
    from kubetune.artifacts import check_model_files, check_model_weights

    check_model_files(path, field="MODEL")  # before transformers opens any of them
    config = read_config(path)
    check_model_weights(path, short(str(path)), field="MODEL")
    if not any(p.name.endswith(".safetensors") for p in path.iterdir()):
        raise KubetuneError(
            f"{short(str(path))!r} holds no weights (no model.safetensors)",
            field="MODEL",
            fix="export the model with save_pretrained into that directory",
        )
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        # transformers would build an empty tokenizer from the config and map every word to [UNK]
        raise KubetuneError(
            f"{short(str(path))!r} holds no tokenizer (no tokenizer.json or tokenizer_config.json)",
            field="MODEL",
            fix="save the tokenizer beside the model: tokenizer.save_pretrained(dir)",
        )
    return config


def read_config(path: Path) -> dict:
    """The config.json of the model in ``path``, checked: a JSON object transformers knows (its
    ``model_type``), naming its architectures, with fields transformers accepts.

    Raises:
        KubetuneError: config.json unreadable, not JSON, not an object, no or unknown ``model_type``,
            no architectures, or fields transformers refuses.
    """
    from kubetune.artifacts import MODEL_FILE_FIX
    from kubetune.paths import read_regular

    shown = short(str(path / "config.json"))

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

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise bad("has no model_type")
    if model_type not in CONFIG_MAPPING:
        raise bad(
            f"has model_type {short(model_type, 60)!r}, which transformers {transformers.__version__} does not know",
            "export it with a transformers version that has it, or upgrade transformers",
        )
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        raise bad("names no architectures, so it is unclear whether the model classifies or generates")
    try:
        AutoConfig.from_pretrained(path)
    except load_errors() as e:
        raise bad(f"is not a valid {short(model_type, 60)} config: {describe(e)}") from None
    return config


def read_texts(file: Path) -> list[str]:
    """The non-blank lines of a UTF-8 text file (a leading byte-order mark is dropped).

    Raises:
        KubetuneError: the file cannot be read, is larger than ``MAX_TEXT_FILE_BYTES``, is binary
            or is not UTF-8 (names the byte offset), or holds no text.
    """
    shown = short(str(file))
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


def quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    quiet_transformers()
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except load_errors() as e:
        raise KubetuneError(
            f"cannot load the tokenizer in {short(str(path))}: {describe(e)}",
            field="MODEL",
            fix="save the tokenizer beside the model: tokenizer.save_pretrained(dir)",
        ) from None


# The oldest transformers kubetune runs on: training, GRPO's log-probabilities and the generation engine
# pass ``logits_to_keep`` as a 2-D boolean mask (the positions that predict a target), which transformers
# reads as a mask from 5.21 on (``slice_logits_to_keep``); older versions index with it and fail deep in
# the model's forward (IndexError: too many indices for tensor of dimension 3). pyproject.toml says the same.
MIN_TRANSFORMERS = "5.21"


def check_transformers() -> None:
    """One line naming the installed version and the fix when transformers is older than
    ``MIN_TRANSFORMERS``; nothing otherwise."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise KubetuneError(
            f"transformers {transformers.__version__} is installed; kubetune needs {MIN_TRANSFORMERS} or newer "
            "(it passes logits_to_keep as a boolean mask)",
            field="transformers",
            fix=f"pip install 'transformers>={MIN_TRANSFORMERS}'",
        )


def load_model(auto_class, path: Path):
    check_transformers()
    quiet_transformers()
    shown = short(str(path))
    try:
        # use_safetensors=True: never fall back to a pickle, even one that appears after the check.
        # Mismatched shapes are reported below rather than as transformers' multi-line report.
        model, info = auto_class.from_pretrained(
            path, use_safetensors=True, trust_remote_code=False, ignore_mismatched_sizes=True, output_loading_info=True
        )
    except load_errors() as e:
        raise KubetuneError(
            f"cannot load the model in {shown}: {describe(e)}",
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
            f"in shape (e.g. {short(key, 80)} is {tuple(stored)} in the weights, {tuple(expected)} by config.json)",
            field="MODEL",
            fix=fix,
        )
    if missing:
        raise KubetuneError(
            f"the weights in {shown} lack {_count(len(missing), 'tensor')} its config.json asks for "
            f"(e.g. {short(missing[0], 80)})",
            field="MODEL",
            fix=fix,
        )
    return model


def check_vocab(model, tokenizer, path: Path) -> None:
    """A tokenizer larger than the model's embedding table makes ids the model cannot look up."""
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise KubetuneError(
            f"the tokenizer in {short(str(path))} has {len(tokenizer):,} tokens "
            f"and the model's embeddings only {rows:,}",
            field="MODEL",
            fix="save the tokenizer the model was trained with beside it",
        )


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def load_errors() -> tuple[type[BaseException], ...]:
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


def context_length(config, tokenizer) -> int | None:
    """Positions the model can attend over: its config's bound, else the tokenizer's, else unknown."""
    for name in CONTEXT_ATTRS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return min(value, tokenizer.model_max_length) if 0 < tokenizer.model_max_length < value else value
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < 1_000_000 else None


def describe(err: BaseException) -> str:
    """One short line for an exception from a library: its type and its text, cut short."""
    text = " ".join(str(err).split())
    return short(f"{type(err).__name__}: {text}" if text else type(err).__name__, 200)


def short(text: str, limit: int = 160) -> str:
    """``text`` on one line and at most ``limit`` characters (user-supplied values can be anything)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def expect(path: Path, is_kind: Callable[[dict], bool], noun: str) -> dict:
    """Check the model in ``path`` (``check_model``) and that ``is_kind`` takes its config.

    Returns:
        The config.

    Raises:
        KubetuneError: the model cannot be loaded, or it is not a ``noun``.
    """
    config = check_model(path)
    if not is_kind(config):
        archs = config.get("architectures") or ["?"]
        raise KubetuneError(
            f"{short(str(path))!r} holds a {short(archs[0], 60)}, not a {noun}",
            field="MODEL",
            fix=f"pass a {noun} exported by kubetune (a job's output or its model/ directory)",
        )
    return config


def adapter_beside(path: Path) -> tuple[Path, Path]:
    """A LoRA export served as its base model plus ``adapter/``: the base model's directory (as the
    adapter's adapter_config.json names it, resolved as a model URI and checked) and the adapter's.

    Raises:
        KubetuneError: no adapter beside ``path``, or one that names no base model.
    """
    adapter_dir = path.parent / "adapter"
    if not (adapter_dir / "adapter_config.json").is_file():
        raise KubetuneError(
            f"no LoRA adapter beside {short(str(path))} (no adapter/adapter_config.json)",
            field="--adapter",
            fix="use the merged model (drop --adapter); only a LoRA run exports an adapter",
        )
    return model_path(_adapter_base(adapter_dir)), adapter_dir


def _adapter_base(adapter_dir: Path) -> str:
    """The base model the adapter's adapter_config.json names (``base_model_name_or_path``), read as a bounded
    regular file and checked to be a JSON object naming one.

    Raises:
        KubetuneError: unreadable, not UTF-8 JSON, not an object, or no base model named.
    """
    from kubetune.paths import read_regular

    shown = f"{short(str(adapter_dir))}/adapter_config.json"
    fix = "use the merged model (drop --adapter), or export the adapter again with save_pretrained"
    try:
        data = read_regular(adapter_dir / "adapter_config.json", field="--adapter", limit=MAX_CONFIG_BYTES, fix=fix)
        config = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise KubetuneError(f"{shown} is not UTF-8 text (byte offset {e.start})", field="--adapter", fix=fix) from None
    except json.JSONDecodeError as e:
        raise KubetuneError(
            f"{shown} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})", field="--adapter", fix=fix
        ) from None
    except RecursionError:
        raise KubetuneError(
            f"{shown} is nested too deeply to be an adapter config", field="--adapter", fix=fix
        ) from None
    except OSError as e:
        raise KubetuneError(
            f"{shown} cannot be read ({e.strerror or type(e).__name__})", field="--adapter", fix=fix
        ) from None
    if not isinstance(config, dict):
        raise KubetuneError(f"{shown} holds a JSON {type(config).__name__}, not an object", field="--adapter", fix=fix)
    name = config.get("base_model_name_or_path")
    if not isinstance(name, str) or not name.strip():
        raise KubetuneError(f"{shown} names no base model (base_model_name_or_path)", field="--adapter", fix=fix)
    return name
