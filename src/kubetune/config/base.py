"""The base of every spec section, and the checks every section's fields share."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, field_validator

# The largest integer any spec field takes. Why: a count sizes memory or a loop, and Python's
# integers have no bound of their own: `epochs: 10**30` validated and ended in an OverflowError
# inside the trainer. Fields that need less say so with their own `le`.
MAX_SPEC_INT = 2**31 - 1

_USERINFO = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/?#@]*@")


def userinfo_problem(value: str) -> str | None:
    """Why ``value``, a URL, may not stand in a spec: it names a user (and likely a password),
    which would be written into job.yaml, the ConfigMap, the report and the logs."""
    if _USERINFO.match(value.strip()):
        return (
            "holds a user name or password (user:password@); credentials never go in the spec — give them in "
            "the environment (MLFLOW_TRACKING_USERNAME/PASSWORD, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, HF_TOKEN) "
            "or, on Kubernetes, kubernetes.secrets"
        )
    return None


def _no_userinfo(value: str | None) -> str | None:
    if value is not None and (problem := userinfo_problem(value)):
        raise ValueError(problem)
    return value


# Every field that holds a URL or a URI: refuses credentials in it (tests/unit/test_hostile_spec.py
# checks that every such field of the spec uses it).
Uri = Annotated[str, AfterValidator(_no_userinfo)]


class Section(BaseModel):
    """Base of every spec section: unknown keys are errors, assignments are validated."""

    # allow_inf_nan: `.inf` / `.nan` are valid YAML floats; `weight_decay: .inf` trained and exported an all-NaN model.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _bounded_int(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_SPEC_INT:
            raise ValueError(f"must be at most {MAX_SPEC_INT:,} (2^31 - 1)")
        return value
