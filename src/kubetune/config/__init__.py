"""The job spec: typed schema, YAML loading, command-line overrides.

The names below load on first use (PEP 562): a task's spec half imports ``config.base`` and
``config.tasks`` while the registry is being read, before ``config.schema`` (which reads it) exists.
"""

from __future__ import annotations

import importlib

_WHERE = {
    "dump_spec": "load",
    "load_spec": "load",
    "parse_spec": "load",
    "DATA_SPECS": "schema",
    "DataSpec": "schema",
    "DistributedSpec": "schema",
    "JobSpec": "schema",
    "LoraSpec": "schema",
    "ModelSpec": "schema",
    "OutputSpec": "schema",
    "TrainSpec": "schema",
    "DataCommon": "base",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
