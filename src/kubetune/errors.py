"""User-facing errors: one line naming the field, the value and the fix; exit code 2."""

from __future__ import annotations

import os
import re
import sys

USER_ERROR_EXIT = 2

# scheme://user:password@ in a URL anywhere in a text (a message, a log line). Greedy up to the authority's
# last '@' (RFC 3986: the host follows the last one), so a password holding '@' is masked whole.
_CREDENTIALS = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)[^/?#\s'\"]+@")


def redact(text: str) -> str:
    """``text`` with the user name and password of every URL in it replaced by ``***``: what
    kubetune prints, logs or records never holds credentials, whichever input carried them."""
    return _CREDENTIALS.sub(r"\1***@", text)


def short(value: object, limit: int = 100) -> str:
    """``str(value)`` cut to ``limit`` characters, so that a message stays one short line whatever the input."""
    text = " ".join(str(value).split("\n"))
    return text if len(text) <= limit else text[: limit - 3] + "..."


class KubetuneError(Exception):
    """An error caused by the user's input (spec, data, credentials, cluster).

    The CLI prints ``str(err)`` on one line of stderr and exits with ``USER_ERROR_EXIT``;
    it never prints a traceback for these.
    """

    def __init__(self, message: str, *, field: str | None = None, fix: str | None = None):
        self.field = field
        self.fix = fix
        text = f"{field}: {message}" if field else message
        if fix:
            text = f"{text} — {fix}"
        super().__init__(redact(" ".join(text.split("\n"))))


class AgreedError(KubetuneError):
    """A KubetuneError every rank raises together, from the same facts: said once, by rank 0."""

    agreed = True


class SpecError(KubetuneError):
    """The job spec is invalid; carries every problem found, one per line."""

    MAX_SHOWN = 20

    def __init__(self, problems: list[str], source: str = "spec"):
        # one line per problem, whatever the input held; a spec with thousands of bad keys shows
        # the first MAX_SHOWN and a count
        lines = [redact(" ".join(str(p).splitlines())) for p in problems]
        if len(lines) > self.MAX_SHOWN:
            lines = lines[: self.MAX_SHOWN] + [
                f"spec: ... and {len(lines) - self.MAX_SHOWN} more problems — fix the ones above first"
            ]
        self.problems = lines
        self.source = source
        head = lines[0] if len(problems) == 1 else f"{len(problems)} problems in {redact(source)}"
        Exception.__init__(self, head)

    def lines(self) -> list[str]:
        return list(self.problems)


def exit_now(code: int) -> None:
    """Flush the standard streams and leave with ``code`` without the interpreter's finalization
    (``os._exit``); the caller runs what must run first (the CLI: the atexit handlers; a worker:
    logging's shutdown only, see ``kubetune.pod.worker``)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
