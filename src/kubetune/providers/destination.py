"""The output location of a run, resolved once from ``output.uri`` and passed down to everything
that writes there (the staging directory, the checkpoint store, the publisher), with the S3
settings an s3:// output is reached with, so that nothing else parses the URI. What may be
written there is ``artifacts/output.py``'s decision."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from kubetune.errors import KubetuneError
from kubetune.paths import cache_root
from kubetune.providers.base import S3Settings, parse_uri

REMOTE = ("s3", "hf")  # outputs written to a local staging directory, then uploaded


@dataclass(frozen=True)
class Output:
    uri: str  # output.uri as the spec gives it
    scheme: str  # file | s3 | hf
    local: Path  # where this machine writes: output.uri itself, or the staging directory of a remote output
    s3: S3Settings = S3Settings()  # how an s3:// output is reached (the job's s3: section)

    @classmethod
    def for_spec(cls, spec) -> Output:
        """The output of a job spec: its ``output.uri``, reached with its ``s3:`` settings (see ``resolve``)."""
        return cls.resolve(spec.output.uri, S3Settings.from_spec(spec))

    @classmethod
    def resolve(cls, uri: str, s3: S3Settings = S3Settings()) -> Output:
        """Parse ``uri`` (not touching the filesystem or the network); ``s3``: how to reach an s3://
        output (the default leaves it all to the environment).

        Raises:
            KubetuneError: an output scheme kubetune cannot write to.
        """
        parsed = parse_uri(uri)
        if parsed.scheme in REMOTE:
            local = cache_root() / "outputs" / hashlib.sha256(uri.encode()).hexdigest()[:16]
        elif parsed.scheme == "file":
            local = Path(parsed.body).expanduser()
        else:
            raise KubetuneError(
                f"output scheme '{parsed.scheme}://' is not supported",
                field="output.uri",
                fix="use a local directory, s3://BUCKET/PREFIX or hf://ORG/REPO",
            )
        return cls(uri, parsed.scheme, local, s3)

    @property
    def remote(self) -> bool:
        """Written to a local staging directory, then uploaded (s3://, hf://)."""
        return self.scheme in REMOTE

    def pod_path(self, workspace: str) -> str | None:
        """Where a pod writes a local output: an absolute path as given, a relative one under the
        pod's working directory ``workspace`` (None for a remote output)."""
        if self.remote:
            return None
        body = parse_uri(self.uri).body
        return body if body.startswith("/") else f"{workspace}/{body}"

    @property
    def prefix(self) -> str:
        """The URI without a trailing slash, for building object keys under it."""
        return self.uri.rstrip("/")

    @property
    def checkpoints(self) -> Path:
        return self.local / "checkpoints"

    @property
    def remote_checkpoints(self) -> str | None:
        """The s3:// prefix checkpoints are uploaded to (None: local only; an hf:// output keeps them local)."""
        return f"{self.prefix}/checkpoints" if self.scheme == "s3" else None
