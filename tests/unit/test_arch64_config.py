"""The job spec's typed base (issue 64, item 2): ``JobSpec`` declares every common section for a type checker,
a task's own section is reached typed through ``JobSpec.section``, and the registered part (``spec_model``) is
built on first use, so importing the config needs no installed entry points."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kubetune.config import DataCommon, JobSpec, parse_spec, spec_model
from kubetune.config.cluster import KubernetesSpec, ResourcesSpec
from kubetune.config.schema import (
    DistributedSpec,
    EvaluationSpec,
    LoraSpec,
    ModelSpec,
    OutputSpec,
    S3Spec,
    TrackingSpec,
    TrainSpec,
)
from kubetune.config.serving import ServingSpec
from kubetune.config.tasks import TASK_SECTIONS, entries
from kubetune.config.tune import TuneSpec

ROOT = Path(__file__).resolve().parents[2]
BASE = {"name": "t", "model": {"uri": "hf://org/model"}, "data": {"train": "train.csv"}, "output": {"uri": "out"}}

# The common fields and the model each holds, as a type checker reads them off the base (a union's models).
COMMON = {
    "name": [str],
    "task": [str],
    "model": [ModelSpec],
    "data": [DataCommon],
    "lora": [LoraSpec, type(None)],
    "training": [TrainSpec],
    "distributed": [DistributedSpec],
    "output": [OutputSpec],
    "evaluation": [EvaluationSpec, type(None)],
    "tune": [TuneSpec, type(None)],
    "tracking": [TrackingSpec],
    "s3": [S3Spec],
    "resources": [ResourcesSpec],
    "kubernetes": [KubernetesSpec],
    "serving": [ServingSpec],
}


def test_the_typed_base_declares_every_common_field_and_no_task_section():
    import typing

    hints = typing.get_type_hints(JobSpec)
    assert set(hints) == set(COMMON) == set(JobSpec.model_fields)
    for name, models in COMMON.items():
        assert list(typing.get_args(hints[name]) or [hints[name]]) == models, name
    assert not set(TASK_SECTIONS) & set(JobSpec.model_fields)


def test_the_registered_model_adds_the_task_sections_between_lora_and_training():
    fields = list(spec_model().model_fields)
    own = list(TASK_SECTIONS)
    assert own and fields == ["name", "task", "model", "data", "lora", *own, *list(COMMON)[5:]]
    assert issubclass(spec_model(), JobSpec) and spec_model() is spec_model()


def test_section_returns_the_typed_section_or_none():
    from kubetune.tasks.dpo import DPOSpec
    from kubetune.tasks.grpo import GRPOSpec
    from kubetune.tasks.kto import KTOSpec

    spec = parse_spec({**BASE, "task": "dpo", "data": {"train": "t.jsonl"}, "dpo": {"beta": 0.3}})
    own = spec.section(DPOSpec)
    assert isinstance(own, DPOSpec) and own.beta == 0.3
    assert spec.section(KTOSpec) is None  # a registered task's section that this spec does not have
    grpo = parse_spec({**BASE, "task": "grpo", "grpo": {"rewards": [{"function": "regex", "pattern": "x"}]}})
    assert isinstance(grpo.section(GRPOSpec), GRPOSpec) and grpo.section(DPOSpec) is None
    # absent from the spec: None (the task's defaults), not a default section
    assert parse_spec({**BASE, "task": "dpo"}).section(DPOSpec) is None


def test_section_refuses_a_model_no_task_registers():
    spec = parse_spec(BASE)
    for model in (TrainSpec, JobSpec, DataCommon):
        with pytest.raises(KeyError, match=f"no registered task has a section of model {model.__name__}"):
            spec.section(model)


def test_data_as_returns_the_data_section_as_the_task_model_or_refuses_another():
    from kubetune.config.base import StreamingData
    from kubetune.tasks.causal_lm import CausalLMData
    from kubetune.tasks.dpo import PreferenceData

    spec = parse_spec({**BASE, "task": "causal-lm", "data": {"train": "t.jsonl", "packing": True}})
    data = spec.data_as(CausalLMData)
    assert data is spec.data and data.packing
    assert spec.data_as(StreamingData) is spec.data and spec.data_as(DataCommon) is spec.data  # its bases too
    with pytest.raises(TypeError, match="the spec's data section is a CausalLMData, not a PreferenceData"):
        spec.data_as(PreferenceData)


def test_the_typed_base_alone_refuses_to_validate():
    with pytest.raises(TypeError, match="validate with parse_spec or spec_model"):
        JobSpec.model_validate(BASE)


def test_a_spec_pickles_and_copies_as_the_registered_model():
    import copy

    spec = parse_spec({**BASE, "task": "dpo", "dpo": {"beta": 0.2}, "training": {"epochs": 3}})
    for again in (pickle.loads(pickle.dumps(spec)), copy.deepcopy(spec), copy.copy(spec)):
        assert type(again) is spec_model() and again == spec
        assert again.model_fields_set == spec.model_fields_set  # what the user set stays known (parse_spec)


# A process where kubetune's entry points (an installed distribution's metadata) are not there: a source
# checkout on PYTHONPATH that was never pip-installed.
_HIDDEN = textwrap.dedent(
    """
    import importlib.metadata as metadata

    real = metadata.entry_points
    metadata.entry_points = lambda **kw: metadata.EntryPoints(()) if kw.get("group") == "kubetune.tasks" else real(**kw)
    """
)


def _run_hidden(body: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _HIDDEN + textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_the_config_imports_without_entry_points_and_validating_then_says_what_is_missing():
    done = _run_hidden(
        """
        import kubetune.config
        from kubetune.config import JobSpec, load_spec, parse_spec
        from kubetune.config.load import json_schema
        from kubetune.errors import KubetuneError

        for call in (lambda: parse_spec({"name": "t"}), lambda: load_spec("examples/sentiment-minilm.yaml"), json_schema):
            try:
                call()
            except KubetuneError as e:
                print("ERROR", type(e).__name__, e)
            else:
                print("no error")
        """
    )
    assert done.returncode == 0, done.stderr
    expected = (
        "ERROR KubetuneError no kubetune task is registered (entry points of kubetune.tasks): kubetune is not "
        "installed — pip install -e . (or pip install kubetune)"
    )
    assert done.stdout.splitlines() == [expected] * 3


def test_the_cli_says_it_in_one_line_without_entry_points():
    done = _run_hidden(
        """
        import sys
        from kubetune.cli import main

        sys.argv = ["kubetune", "validate", "examples/sentiment-minilm.yaml"]
        main()
        """
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no kubetune task is registered" in lines[0], done.stderr


def test_the_registry_is_read_on_first_use_not_on_import():
    done = _run_hidden(
        """
        import kubetune.config, kubetune.config.schema, kubetune.config.load
        from kubetune.config.tasks import entries
        print(entries.cache_info().currsize)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0"]
    assert entries()  # this process: installed
