"""The exceptions of the SDK-compatible front end, the collector that reports every refused argument
in one line, and the fixes shared by the refusals of a credential given as a value."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NoReturn

from kubetune.errors import KubetuneError

HF_TOKEN_FIX = (
    "create a Secret (kubectl create secret generic hf-secrets --from-env-file=.env) and pass env_vars=[V1EnvVar("
    "name='HF_TOKEN', value_from=V1EnvVarSource(secret_key_ref=V1SecretKeySelector(name='hf-secrets', "
    "key='HF_TOKEN')))] (the spec's kubernetes.secrets.hf_token); locally, export HF_TOKEN"
)
S3_KEYS_FIX = (
    "put the keys in a Secret (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) and pass env_vars=[V1EnvFromSource("
    "secret_ref=V1SecretEnvSource(name='minio-credentials'))] (the spec's kubernetes.secrets.s3); locally, export "
    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
)


class UnsupportedParameter(KubetuneError, ValueError):
    """train() arguments that a kubetune spec cannot carry; ``problems`` holds (field, message, fix)
    for each. A ValueError, as the SDK raises for invalid parameters."""

    def __init__(self, problems: list[tuple[str, str, str]]):
        self.problems = problems
        if len(problems) == 1:
            field, message, fix = problems[0]
            super().__init__(message, field=field, fix=fix)
        else:
            super().__init__("; ".join(f"{f}: {m} — {x}" for f, m, x in problems))
            self.field = ", ".join(f for f, _, _ in problems)


class JobError(KubetuneError, RuntimeError):
    """A job could not be created, read or deleted, or it failed (RuntimeError, as in the SDK)."""


class JobTimeout(KubetuneError, TimeoutError):
    """wait_for_job_conditions ran out of time (TimeoutError, as in the SDK)."""


class Problems:
    """The refused arguments of one call, collected so that they are reported together."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str, str]] = []

    def add(self, field: str, message: str, fix: str) -> None:
        self.items.append((field, message, fix))

    def wrong_type(self, field: str, value: object, fix: str) -> None:
        """``value`` is not of the type the SDK's parameter takes (or not one kubetune reads)."""
        self.add(field, f"{type(value).__name__} is not supported", fix)

    def token(self, field: str) -> None:
        """A Hugging Face token given as a value: refused, with the Secret reference to use instead."""
        self.add(field, "a token is never put into a job spec", HF_TOKEN_FIX)

    def raise_any(self) -> None:
        """Raises UnsupportedParameter naming every problem added, if there is one."""
        if self.items:
            raise UnsupportedParameter(self.items)


def refuse(field: str, message: str, fix: str) -> NoReturn:
    """Raises UnsupportedParameter for the one argument ``field``."""
    raise UnsupportedParameter([(field, message, fix)])


def job_error(e: KubetuneError) -> JobError:
    """kubetune's error as the RuntimeError the SDK raises there: same line, same field and fix."""
    err = JobError(str(e))
    err.field, err.fix = e.field, e.fix
    return err


@contextlib.contextmanager
def job_errors() -> Iterator[None]:
    """Within it, a KubetuneError leaves as :func:`job_error` makes it (its context suppressed)."""
    try:
        yield
    except KubetuneError as e:
        raise job_error(e) from None
