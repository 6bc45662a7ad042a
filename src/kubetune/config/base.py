"""The base of every spec section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every spec section: unknown keys are errors, assignments are validated."""

    # allow_inf_nan: `.inf` / `.nan` are valid YAML floats; `weight_decay: .inf` trained and exported an all-NaN model.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
