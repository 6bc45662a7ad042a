"""The job spec: typed schema, YAML loading, command-line overrides."""

from kubetune.config.load import dump_spec, load_spec, parse_spec
from kubetune.config.schema import (
    DATA_SPECS,
    CausalLMData,
    ClassificationData,
    DataSpec,
    DistributedSpec,
    JobSpec,
    LoraSpec,
    ModelSpec,
    OutputSpec,
    TrainSpec,
)

__all__ = [
    "DATA_SPECS",
    "CausalLMData",
    "ClassificationData",
    "DataSpec",
    "DistributedSpec",
    "JobSpec",
    "LoraSpec",
    "ModelSpec",
    "OutputSpec",
    "TrainSpec",
    "dump_spec",
    "load_spec",
    "parse_spec",
]
