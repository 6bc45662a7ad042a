"""The job spec: typed schema, YAML loading, command-line overrides.

Importing it reads no task registry (``schema.spec_model`` is built on first use), so a task's spec half may
import ``config.base`` and ``config.tasks`` while the registry is being read.
"""

from __future__ import annotations

from kubetune.config.base import DataCommon
from kubetune.config.load import dump_spec, load_spec, parse_spec
from kubetune.config.schema import (
    DATA_SPECS,
    DataSpec,
    DistributedSpec,
    JobSpec,
    LoraSpec,
    ModelSpec,
    OutputSpec,
    TrainSpec,
    spec_model,
)

__all__ = [
    "DATA_SPECS",
    "DataCommon",
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
    "spec_model",
]
