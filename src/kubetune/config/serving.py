"""The ``serving`` spec section: how `kubetune render --serve` serves a finished job's export on KServe
(an InferenceService on the Hugging Face runtime). Absent from a spec: its defaults."""

from __future__ import annotations

import re
from typing import Literal, Self

from pydantic import Field, field_validator, model_validator

from kubetune.config.base import Section
from kubetune.config.cluster import _quantity

# KServe's InferenceService name (its webhook's IsvcNameFmt, a DNS-1035 label); 52 as for the job name,
# so the objects KServe derives from it ("NAME-predictor-...") stay within 63 characters.
_ISVC_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,50}[a-z0-9])?$")


class ServingSpec(Section):
    """Serving the job's export on KServe (`kubetune render --serve`)."""

    name: str | None = Field(
        default=None,
        description="The InferenceService's name (and the served model's); absent: the job's name. Lowercase "
        "letters, digits and '-', a letter first, at most 52 characters.",
    )
    cpu: str | None = Field(
        default="2", description="CPU per serving replica (pod), a Kubernetes quantity; requests = limits."
    )
    memory: str | None = Field(
        default="8Gi", description="Memory per serving replica (pod), e.g. '8Gi'; requests = limits."
    )
    gpu: int = Field(
        default=0, ge=0, le=16, description="GPUs per serving replica; rendered as the serving.gpu_resource limit."
    )
    gpu_resource: str = Field(default="nvidia.com/gpu", description="Extended resource name for GPUs.")
    deployment_mode: Literal["Standard", "Knative"] = Field(
        default="Standard",
        description="KServe's deployment mode for this InferenceService (its serving.kserve.io/deploymentMode "
        "annotation): Standard = a Deployment and a Service, no Knative needed (what deploy/install.sh --with kserve "
        "sets up); Knative = a Knative Service, which can scale to zero.",
    )
    min_replicas: int = Field(
        default=1,
        ge=0,
        le=1000,
        description="Fewest serving replicas; 0 (deployment_mode Knative only) scales to zero when idle, at the "
        "price of a cold start (model download and load) on the next request.",
    )
    max_replicas: int = Field(default=1, ge=1, le=1000, description="Most serving replicas the autoscaler may run.")
    lora: Literal["merged", "adapter"] = Field(
        default="merged",
        description="For a job with a lora section: merged serves the export's model/ (the adapter merged into the "
        "base); adapter serves the base model (model.uri) with the export's adapter/ on top, through the runtime's "
        "vLLM backend (text generation only, needs serving.gpu). The adapter is served as the model NAME-adapter.",
    )
    max_model_len: int | None = Field(
        default=None,
        ge=8,
        le=1_048_576,
        description="Longest sequence (prompt + completion) the server accepts, in tokens (--max_model_len); "
        "absent: the model's own limit.",
    )
    dtype: Literal["auto", "float16", "bfloat16", "float32"] | None = Field(
        default=None,
        description="Precision the runtime loads the weights in (--dtype); absent: the runtime's default "
        "(float16 on a GPU, float32 on CPU).",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and not _ISVC_NAME.match(v):
            raise ValueError(
                "must be 1-52 lowercase letters, digits or '-', starting with a letter and ending with a letter or "
                "digit (KServe requires a DNS-1035 name), e.g. 'sentiment-minilm'"
            )
        return v

    @field_validator("cpu")
    @classmethod
    def _cpu(cls, v: str | None) -> str | None:
        return _quantity(v, "'2' or '1500m'")

    @field_validator("memory")
    @classmethod
    def _mem(cls, v: str | None) -> str | None:
        return _quantity(v, "'8Gi'")

    @model_validator(mode="after")
    def _order(self) -> Self:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"serving.min_replicas ({self.min_replicas}) must be <= serving.max_replicas ({self.max_replicas})"
            )
        if self.min_replicas == 0 and self.deployment_mode != "Knative":
            raise ValueError(
                "serving.min_replicas 0 (scale to zero) needs serving.deployment_mode: Knative — set min_replicas to "
                "at least 1, or use Knative"
            )
        return self
