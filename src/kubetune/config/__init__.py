"""The job spec: typed schema, YAML loading, command-line overrides."""

from kubetune.config.load import dump_spec, load_spec, parse_spec
from kubetune.config.schema import (
    DataSpec,
    DistributedSpec,
    JobSpec,
    LoraSpec,
    ModelSpec,
    OutputSpec,
    TrainSpec,
)

__all__ = [
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
