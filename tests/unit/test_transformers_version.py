"""The oldest transformers kubetune runs on (``inference.model.MIN_TRANSFORMERS``, 5.21: ``logits_to_keep``
as a 2-D boolean mask). The first GPU run found the GPU machine's transformers 5.17 indexing with that mask
and failing deep in Llama's forward; now an older version is one line before anything loads, and the
package's own requirement says the same."""

from __future__ import annotations

import pytest
import tomllib
import transformers
from conftest import ROOT
from packaging.requirements import Requirement
from packaging.version import Version

from kubetune.errors import KubetuneError
from kubetune.inference.model import MIN_TRANSFORMERS, check_transformers


def test_an_older_transformers_is_one_line_naming_the_version_and_the_fix(monkeypatch):
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    with pytest.raises(KubetuneError) as e:
        check_transformers()
    assert "transformers 5.17.0" in str(e.value) and f"transformers>={MIN_TRANSFORMERS}" in e.value.fix
    monkeypatch.setattr(transformers, "__version__", MIN_TRANSFORMERS + ".0")
    check_transformers()


def test_the_installed_transformers_has_the_boolean_mask_and_pyproject_requires_it():
    import torch
    from transformers.modeling_utils import slice_logits_to_keep  # what 5.21 added

    hidden = torch.arange(12.0).reshape(1, 4, 3)
    keep = torch.tensor([[True, False, True, False]])
    assert slice_logits_to_keep(hidden, keep).tolist() == [[0.0, 1.0, 2.0], [6.0, 7.0, 8.0]]
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(Requirement(d).specifier for d in deps if Requirement(d).name == "transformers")
    assert not spec.contains("5.20.0") and spec.contains(MIN_TRANSFORMERS + ".0")
    assert Version(transformers.__version__) >= Version(MIN_TRANSFORMERS)
