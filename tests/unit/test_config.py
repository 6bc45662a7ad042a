"""The job spec: every shipped example validates; every bad input gives a precise message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kubetune.config import JobSpec, dump_spec, load_spec, parse_spec, spec_model
from kubetune.errors import SpecError

ROOT = Path(__file__).resolve().parents[2]
BASE = {
    "name": "t",
    "model": {"uri": "hf://org/model"},
    "data": {"train": "train.csv"},
    "output": {"uri": "out"},
}


def _with(**changes):
    spec = yaml.safe_load(yaml.safe_dump(BASE))
    for dotted, value in changes.items():
        node = spec
        *parents, last = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return spec


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_validates(path):
    spec = load_spec(path)
    assert isinstance(spec, JobSpec)


def test_defaults_and_public_keys():
    spec = parse_spec(BASE)
    assert spec.task == "sequence-classification"
    assert spec.lora is None  # absent = full fine-tune
    assert (spec.training.batch_size, spec.training.grad_accum, spec.training.precision) == (16, 1, "auto")
    assert spec.distributed.world_size == 1
    # The public contract names exist.
    for section, key in [
        ("model", "uri"),
        ("data", "eval_fraction"),
        ("data", "text_pair_column"),
        ("data", "max_length"),
        ("training", "warmup_ratio"),
        ("training", "max_steps"),
        ("distributed", "procs_per_node"),
        ("output", "uri"),
    ]:
        assert key in type(getattr(spec, section)).model_fields


def test_every_field_has_help_text():
    from kubetune.config.load import _submodels

    seen = []

    def walk(model, prefix=""):
        for name, field in model.model_fields.items():
            seen.append(prefix + name)
            assert field.description, f"{prefix}{name} has no help text"
            for sub in _submodels(field.annotation):  # the data section: every task's model
                walk(sub, f"{prefix}{name}.")

    walk(spec_model())  # the registered model: the tasks' data models and sections too
    assert {"lora.r", "data.text_pair_column", "data.packing", "training.precision", "distributed.nodes"} <= set(seen)


@pytest.mark.parametrize(
    "raw, expected",
    [
        (
            _with(training__learnign_rate=1e-4),
            "training.learnign_rate: unknown key — did you mean 'training.learning_rate'?",
        ),
        (_with(modle={"uri": "x"}), "modle: unknown key — did you mean 'model'?"),
        (_with(training__epochs="two"), "training.epochs: Input should be a valid integer"),
        (
            _with(training__precision="fp8"),
            "training.precision: Input should be 'auto', 'fp32', 'bf16' or 'fp16' (got 'fp8')",
        ),
        (_with(data__eval_fraction=1.5), "data.eval_fraction: Input should be less than 1 (got 1.5)"),
        (
            _with(distributed__procs_per_node=0),
            "distributed.procs_per_node: Input should be greater than or equal to 1 (got 0)",
        ),
        (_with(name="My_Job"), "name: must be 1-52 lowercase letters"),
        ({k: v for k, v in BASE.items() if k != "output"}, "output: required but missing — add it"),
        (_with(data__label_column="text"), "data.label_column must differ from the text columns"),
        (_with(lora={"r": 0}), "lora.r: Input should be greater than or equal to 1 (got 0)"),
        (
            _with(task="causal-lm", data__packing=True, data__max_length=512, data__max_tokens_per_batch=256),
            "data.max_tokens_per_batch 256 is below data.max_length 512: raise it to at least data.max_length",
        ),
        (
            _with(task="causal-lm", data__max_tokens_per_batch=4096),
            "data.max_tokens_per_batch needs data.packing: true",
        ),
    ],
)
def test_bad_spec_messages(raw, expected):
    with pytest.raises(SpecError) as e:
        parse_spec(raw)
    assert any(expected in line for line in e.value.lines()), e.value.lines()
    assert all("\n" not in line for line in e.value.lines())


def test_all_errors_reported_together():
    raw = _with(training__learnign_rate=1, training__epochs=-1, data__max_length="long")
    del raw["output"]
    with pytest.raises(SpecError) as e:
        parse_spec(raw)
    fields = sorted(line.split(":")[0] for line in e.value.lines())
    assert fields == ["data.max_length", "output", "training.epochs", "training.learnign_rate"]


def test_cross_field_problems_are_reported_with_field_errors():
    """A problem between sections is not hidden by a field error elsewhere (pydantic stops before
    the cross checks): both come in one report, and two cross problems come on two lines."""
    raw = _with(task="causal-lm", training__epochs=0, data__max_tokens_per_batch=256, data__max_length=512)
    with pytest.raises(SpecError) as e:
        parse_spec(raw)
    lines = e.value.lines()
    assert any(line.startswith("training.epochs:") for line in lines), lines
    assert any("data.max_tokens_per_batch needs data.packing: true" in line for line in lines), lines
    assert any("data.max_tokens_per_batch 256 is below data.max_length 512" in line for line in lines), lines
    with pytest.raises(SpecError) as e:  # without a field error: both cross problems, one per line
        parse_spec(_with(task="causal-lm", data__max_tokens_per_batch=256, data__max_length=512))
    assert len([line for line in e.value.lines() if "max_tokens_per_batch" in line]) == 2, e.value.lines()
    with pytest.raises(SpecError) as e:  # an unknown key with no near match points at explain
        parse_spec(_with(training__zzz=1))
    assert e.value.lines() == [
        "training.zzz: unknown key — remove it (`kubetune explain training` lists the valid keys)"
    ]


@pytest.mark.parametrize(
    "overrides, check",
    [
        (["training.epochs=3"], lambda s: s.training.epochs == 3),
        (["training.learning_rate=2e-5"], lambda s: s.training.learning_rate == 2e-5),
        (
            ["distributed.procs_per_node=1", "training.seed=1"],
            lambda s: (s.distributed.procs_per_node, s.training.seed) == (1, 1),
        ),
        (["lora.r=4"], lambda s: s.lora is not None and s.lora.r == 4),
        (["data.text_pair_column=hypothesis"], lambda s: s.data.text_pair_column == "hypothesis"),
        (["data.train=a=b.csv"], lambda s: s.data.train == "a=b.csv"),
        (["output.report_baseline=false"], lambda s: s.output.report_baseline is False),
    ],
)
def test_overrides(overrides, check):
    assert check(parse_spec(BASE, overrides))


@pytest.mark.parametrize(
    "override, expected",
    [
        ("training.epochs", "expected KEY=VALUE"),
        ("name.first=x", "'name' is a value, not a section"),
        ("training.epoch=2", "training.epoch: unknown key — did you mean 'training.epochs'?"),
    ],
)
def test_bad_overrides(override, expected):
    with pytest.raises(SpecError) as e:
        parse_spec(BASE, [override])
    assert any(expected in line for line in e.value.lines()), e.value.lines()


def test_broken_yaml_names_line(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("name: t\nmodel:\n  uri: [unclosed\n")
    with pytest.raises(SpecError) as e:
        load_spec(path)
    assert "line 4" in str(e.value) or "line 3" in str(e.value)
    assert "fix the YAML syntax" in str(e.value)


def test_missing_spec_file(tmp_path):
    with pytest.raises(SpecError, match="not found"):
        load_spec(tmp_path / "nope.yaml")


def test_dump_roundtrip():
    spec = parse_spec(_with(lora={"r": 4, "target_modules": ["query", "value"]}))
    again = parse_spec(yaml.safe_load(dump_spec(spec)))
    assert again == spec


def test_the_json_schema_accepts_every_example_and_refuses_what_validate_refuses(tmp_path):
    """`kubetune schema` (what yaml-language-server validates job.yaml with in an editor): every
    shipped example passes; an unknown key, a wrong type and a value out of range do not."""
    import jsonschema
    import yaml
    from typer.testing import CliRunner

    from kubetune.cli import app

    result = CliRunner().invoke(app, ["schema", "-o", str(tmp_path / "schema.json")])
    assert result.exit_code == 0, result.output
    validator = jsonschema.Draft202012Validator(json.loads((tmp_path / "schema.json").read_text()))
    examples = sorted((ROOT / "examples").glob("*.yaml"))
    assert len(examples) >= 5
    for path in examples:
        assert not list(validator.iter_errors(yaml.safe_load(path.read_text()))), path.name
    base = yaml.safe_load((ROOT / "examples" / "sentiment-minilm.yaml").read_text())
    for key, value in (("learnign_rate", 1e-4), ("epochs", "two"), ("epochs", -1)):
        bad = {**base, "training": {**base.get("training", {}), key: value}}
        assert list(validator.iter_errors(bad)), (key, value)
        with pytest.raises(SpecError):
            parse_spec(bad)
