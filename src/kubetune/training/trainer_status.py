"""Rank 0's progress in the TrainJob's own status: Kubeflow Trainer v2.3's TrainJobStatus (KEP-2779,
feature gate ``TrainJobStatus``).

With the gate on, the Trainer controller gives every trainer container three variables: the https
URL of its status server for this TrainJob, the CA that signs that server's certificate and a
projected service-account token (per-job audience, rotated hourly), both as file paths. Rank 0
POSTs ``{"trainerStatus": {progressPercentage, estimatedRemainingSeconds, metrics: [{name, value}],
lastUpdatedTime}}`` there; the controller applies it to ``status.trainerStatus``, where dashboards,
the Kubeflow SDK and ``kubetune status`` read it.

``trainer_status`` turns a progress record (what ``ProgressLogger`` writes to progress.json) into
that object and ``progress_of`` reads one back; ``StatusReporter`` sends from a thread of its own,
so a slow or failing server never holds a training step. Nothing here imports torch.
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import re
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from email.message import Message
from typing import IO, Any
from urllib.parse import urlsplit

from kubetune.errors import redact
from kubetune.paths import MAX_TOKEN_BYTES, RefusedFile, read_regular

log = logging.getLogger("kubetune.trainer_status")
Record = dict[str, Any]  # a progress record (``loggers.ProgressLogger``'s), or the JSON of a trainerStatus

ENV_URL = "KUBEFLOW_TRAINER_SERVER_URL"
ENV_CA = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
ENV_TOKEN = "KUBEFLOW_TRAINER_SERVER_TOKEN"
MAX_METRICS = 256  # the CRD's maxItems
MAX_CHARS = 64  # the CRD's maxLength of a metric's name and value
REQUEST_TIMEOUT_S = 5.0  # upstream's own example client waits 5 s
MAX_CA_BYTES = 1 << 20  # the controller's CA is one certificate (a system bundle is about 200 KB)
# RFC 6750's b64token (a projected token is a JWT): nothing that could break the header, or make
# http.client quote the header, token included, in an error that would then be logged.
_BEARER = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
_INT32 = 2**31 - 1

# Progress record key -> metric name, in the order sent (and read back by progress_of).
_COUNTS = (("step", "step"), ("total_steps", "total_steps"), ("epoch", "epoch"), ("epochs", "epochs"))
_RATES = (
    ("loss", "loss"),
    ("lr", "learning_rate"),
    ("samples_per_s", "samples_per_second"),
    ("tokens_per_s", "tokens_per_second"),
)
EVAL_STEP = "eval_step"
LM_EVAL_STEP = "lm_eval_step"  # the step of the lm-evaluation-harness scores (lm_eval/<task>/<metric>)


@dataclass(frozen=True)
class Endpoint:
    """Where rank 0 sends its status: the URL, and the files of the CA and of the (rotating) token."""

    url: str
    ca_file: str
    token_file: str

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Endpoint | None:
        """The endpoint the Trainer controller injected, or None unless all three variables are set."""
        values = [environ.get(k, "").strip() for k in (ENV_URL, ENV_CA, ENV_TOKEN)]
        return cls(*values) if all(values) else None

    def url_problem(self) -> str | None:
        """Why nothing may be sent to ``url`` (the reason and its fix, credentials masked); None
        when it is an https URL with a host and no user name or password."""
        try:
            parts = urlsplit(self.url)
            parts.port  # noqa: B018 (raises on a port that is not a number)
        except ValueError:
            parts = None
        shown = _shown(self.url)
        if parts is None or parts.scheme.lower() != "https" or not parts.hostname:
            return (
                f"{ENV_URL} is {shown!r}, not an https URL with a host: the bearer token is sent over https "
                f"only, so no progress is sent — set it to the https URL the Trainer controller injects, or unset it"
            )
        if parts.username is not None or parts.password is not None:
            return (
                f"{ENV_URL} ({shown}) holds a user name or password: the status server takes the bearer "
                f"token only, so no progress is sent — remove the user:password@ part"
            )
        return None


# ---------------------------------------------------------------------------------- the request body


def metric_value(value: object) -> str | None:
    """``value`` as a metric value of 1 to 64 characters: a float as its shortest round-trip text
    (``repr``: at most 24 characters, so a reader gets the very number back), anything else as
    ``str`` cut to 64; None for None, a bool or an empty text."""
    if value is None or isinstance(value, bool):
        return None
    text = repr(float(value)) if isinstance(value, float) else str(value)
    return text[:MAX_CHARS] or None


def _metrics(record: Record) -> list[dict[str, str]]:
    """The record's counts, rates and last evaluation as ``[{name, value}]``: at most 256, names
    and values of 1 to 64 characters, each name once."""
    pairs = [(name, record.get(key)) for key, name in (*_COUNTS, *_RATES)]
    last_eval = record.get("last_eval") or {}
    if last_eval:
        pairs.append((EVAL_STEP, last_eval.get("step")))
        # eval_loss first: what any task reports, kept if the 256 cut ever bites
        names = sorted((k for k in last_eval if k != "step"), key=lambda k: k != "eval_loss")
        pairs += [(k, last_eval[k]) for k in names]
    harness = record.get("lm_eval") or {}
    if harness:  # lm-evaluation-harness's scores, as lm_eval/<task>/<metric>
        pairs.append((LM_EVAL_STEP, harness.get("step")))
        pairs += [(f"lm_eval/{k}", v) for k, v in harness.items() if k != "step"]
    out, seen = [], set()
    for name, value in pairs:
        name, text = str(name)[:MAX_CHARS], metric_value(value)
        if name and text is not None and name not in seen:
            seen.add(name)
            out.append({"name": name, "value": text})
    return out[:MAX_METRICS]


def trainer_status(record: Record, now: datetime | None = None) -> Record:
    """The ``trainerStatus`` of a progress record, valid for the v2.3.0 CRD: the percentage of
    steps done (100 once the run succeeded; at most 99 before, while the export still runs), the
    ETA in whole seconds, the metrics, and the time of this update."""
    step, total = record.get("step"), record.get("total_steps")
    out: Record = {}
    if record.get("phase") == "succeeded":
        out["progressPercentage"], out["estimatedRemainingSeconds"] = 100, 0
    else:
        if isinstance(step, int) and isinstance(total, int) and total > 0:
            out["progressPercentage"] = max(0, min(99, step * 100 // total))
        eta = record.get("eta_s")
        if isinstance(eta, (int, float)) and math.isfinite(eta):
            out["estimatedRemainingSeconds"] = max(0, min(_INT32, round(eta)))
    metrics = _metrics(record)
    if metrics:
        out["metrics"] = metrics
    out["lastUpdatedTime"] = (now or datetime.now(timezone.utc)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return out


# ------------------------------------------------------------------------------------ reading it back


def _number(text: Any) -> float | None:  # any JSON value: what float() refuses is None
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _count(text: object) -> int | None:
    value = _number(text)
    return int(value) if value is not None and value == int(value) and 0 <= value < 2**63 else None


def progress_of(status: object) -> Record | None:
    """The progress record (as ``ProgressLogger`` writes it, plus ``percent`` and ``source``) of a
    TrainJob's ``status.trainerStatus``, read field by field (any trainer may have written it);
    None when there is none."""
    if not isinstance(status, dict) or not status:
        return None
    percent = status.get("progressPercentage")
    rec: Record = {"source": "trainerStatus"}
    if type(percent) is int and 0 <= percent <= 100:
        rec["percent"] = percent
    rec["phase"] = "succeeded" if rec.get("percent") == 100 else "training"
    values = {}
    for m in (status.get("metrics") or [])[:MAX_METRICS]:
        if isinstance(m, dict) and isinstance(m.get("name"), str):
            values[m["name"][:MAX_CHARS]] = m.get("value")
    for key, name in _COUNTS:
        if _count(values.get(name)) is not None:
            rec[key] = _count(values[name])
    for key, name in _RATES:
        if _number(values.get(name)) is not None:
            rec[key] = _number(values[name])
    if "step" in rec and "total_steps" not in rec:  # the progress line needs both
        del rec["step"]
    if "epoch" in rec and "epochs" not in rec:
        del rec["epoch"]
    eta = status.get("estimatedRemainingSeconds")
    if type(eta) is int and 0 <= eta <= _INT32 and rec["phase"] != "succeeded":
        rec["eta_s"] = float(eta)
    evals = {k: _number(v) for k, v in values.items() if k.startswith("eval_") and k != EVAL_STEP}
    evals = {k: v for k, v in evals.items() if v is not None}
    eval_step = _count(values.get(EVAL_STEP))
    if evals and eval_step is not None:
        rec["last_eval"] = {"step": eval_step, **evals}
        if rec["phase"] == "succeeded":
            rec["metrics"] = evals
    harness = {k.removeprefix("lm_eval/"): _number(v) for k, v in values.items() if k.startswith("lm_eval/")}
    harness = {k: v for k, v in harness.items() if v is not None}
    harness_step = _count(values.get(LM_EVAL_STEP))
    if harness and harness_step is not None:
        rec["lm_eval"] = {"step": harness_step, **harness}
    updated = status.get("lastUpdatedTime")
    if isinstance(updated, str):
        try:
            rec["updated"] = datetime.fromisoformat(updated.replace("Z", "+00:00")).timestamp()
        except ValueError:
            pass
    return rec


# ----------------------------------------------------------------------------------------- the sender


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is an error: the bearer token goes to the status server and nowhere else."""

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: IO[bytes],
        code: int,
        msg: str,
        headers: Message,
        newurl: str,
    ) -> urllib.request.Request | None:
        return None


class StatusReporter:
    """Sends rank 0's latest progress to the TrainJob status server from a daemon thread.

    ``update`` only replaces the record to send (the latest wins: nothing queues up) and wakes the
    thread; the thread sends at most one request per ``interval_s``, the first at once and the last
    (``final``) without waiting for the interval. A failed send (an HTTP error, a timeout, TLS, no
    token) is logged once per kind with its fix and retried on the next tick with the newest record.
    The token file is read before every request (the kubelet rotates it); the CA is the one file
    given (no system store, no proxy: the server is the controller's Service inside the cluster).
    Both are read as regular files of bounded size. An endpoint that is not https (the token would go
    in clear, or ``file://`` would "send" to a local file) or that holds credentials is said once at
    ``start`` and nothing is ever sent; no line logged here shows a URL's user name or password.
    """

    def __init__(self, endpoint: Endpoint, interval_s: float, timeout_s: float = REQUEST_TIMEOUT_S):
        self.endpoint, self.interval_s, self.timeout_s = endpoint, interval_s, timeout_s
        self._cond = threading.Condition()
        self._record: Record | None = None
        self._final = False  # the record is the last one: send it without waiting for the interval
        self._closing = False
        self._last_sent = -math.inf
        self._reported: set[str] = set()  # the failure kinds already logged
        self._failing = False
        self._refused = False  # the endpoint is not one to send a token to: nothing is sent
        self._thread = threading.Thread(target=self._run, name="trainer-status", daemon=True)
        self.sent = 0  # requests the server accepted

    def start(self) -> StatusReporter:
        problem = self.endpoint.url_problem()
        if problem:
            self._refused = True
            log.warning("trainer status: %s; training goes on without it", problem)
            return self
        log.info(
            "trainer status: sending progress to %s at most every %g s (Kubeflow Trainer TrainJobStatus)",
            _shown(self.endpoint.url),
            self.interval_s,
        )
        self._thread.start()
        return self

    def update(self, record: Record, final: bool = False) -> None:
        """Make ``record`` (a progress record) the next one to send; never blocks on the network."""
        if self._refused:
            return
        with self._cond:
            self._record = dict(record)
            self._final = self._final or final
            self._cond.notify()

    def close(self, wait_s: float = REQUEST_TIMEOUT_S) -> None:
        """Send what is pending once more (however long since the last request), then stop; waits
        at most ``wait_s`` for it, so a hanging server delays the end of a run by that much at most."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(wait_s)
            if self._thread.is_alive():
                log.warning(
                    "trainer status: the last update was not sent within %g s; the run goes on without it", wait_s
                )

    # ---- the thread ----
    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    due = self._last_sent + self.interval_s
                    if self._record is not None and (self._final or self._closing or time.monotonic() >= due):
                        break
                    if self._closing:
                        return
                    self._cond.wait(None if self._record is None else max(0.0, due - time.monotonic()))
                record, final, closing = self._record, self._final, self._closing
                self._record, self._final = None, False
            ok = self._send(record)
            with self._cond:
                self._last_sent = time.monotonic()
                if not ok and self._record is None and not closing:
                    self._record, self._final = record, final  # the next tick tries again
                if closing and self._record is None:
                    return

    def _token(self) -> str:
        """The token, read now (the kubelet rotates it). Raises ValueError: what is wrong, in words."""
        path = self.endpoint.token_file
        try:
            text = read_regular(path, field=ENV_TOKEN, limit=MAX_TOKEN_BYTES, fix=_FIXES["token"]).decode("utf-8")
        except RefusedFile as e:
            raise ValueError(f"the token file {e.problem}") from None
        except OSError as e:
            raise ValueError(f"cannot read the token file {path} ({e.strerror})") from None
        except UnicodeDecodeError:
            raise ValueError(f"the token file {path} is not UTF-8 text") from None
        token = text.strip()
        if not token:
            raise ValueError(f"the token file {path} is empty")
        if not _BEARER.fullmatch(token):
            raise ValueError(f"the token file {path} holds characters a bearer token cannot have")
        return token

    def _opener(self) -> urllib.request.OpenerDirector:
        """An opener for https alone, trusting only the CA file, read now (the controller rotates
        its certificates). Raises ValueError: what is wrong with the CA file, in words."""
        path = self.endpoint.ca_file
        try:
            pem = read_regular(path, field=ENV_CA, limit=MAX_CA_BYTES, fix=_FIXES["ca"]).decode("ascii")
            context = ssl.create_default_context(cadata=pem)
        except RefusedFile as e:
            raise ValueError(f"the CA file {e.problem}") from None
        except UnicodeDecodeError:
            raise ValueError(f"cannot read the CA file {path} (not a PEM file)") from None
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"cannot read the CA file {path} ({_reason(e)})") from None
        # urllib and ssl (the standard library, nothing to install in the image): a context that
        # trusts only this CA and checks the hostname. Built by hand, not by build_opener, whose
        # defaults would also open http:// (the token in clear), file:// and ftp://, and take a proxy
        # from the environment; no redirect either (requests would follow proxies and netrc).
        opener = urllib.request.OpenerDirector()
        for handler in (
            urllib.request.HTTPSHandler(context=context),
            _NoRedirect(),
            urllib.request.HTTPDefaultErrorHandler(),
            urllib.request.HTTPErrorProcessor(),
            urllib.request.UnknownHandler(),
        ):
            opener.add_handler(handler)
        return opener

    def _send(self, record: Record) -> bool:
        try:
            token = self._token()
        except ValueError as e:
            return self._failed("token", str(e))
        try:
            opener = self._opener()
        except ValueError as e:
            return self._failed("ca", str(e))
        body = json.dumps({"trainerStatus": trainer_status(record)}).encode()
        request = urllib.request.Request(
            self.endpoint.url,
            data=body,
            method="POST",
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        try:
            with opener.open(request, timeout=self.timeout_s) as response:
                response.read(1 << 16)
        except urllib.error.HTTPError as e:
            return self._http_failed(e)
        except (ssl.SSLError, ssl.CertificateError) as e:
            return self._failed("tls", f"TLS with {_host(self.endpoint.url)} failed ({_reason(e)})")
        except (TimeoutError, OSError, http.client.HTTPException, ValueError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, ssl.SSLError):
                return self._failed("tls", f"TLS with {_host(self.endpoint.url)} failed ({_reason(reason)})")
            if isinstance(reason, TimeoutError) or "timed out" in str(reason):
                return self._failed("timeout", f"{_host(self.endpoint.url)} did not answer within {self.timeout_s:g} s")
            return self._failed("network", f"cannot reach {_host(self.endpoint.url)} ({_reason(reason)})")
        except Exception as e:  # whatever it is, it must not end the thread, let alone training
            return self._failed("error", f"sending to {_host(self.endpoint.url)} failed ({type(e).__name__})")
        self.sent += 1
        if self._failing:
            self._failing = False
            log.info("trainer status: %s accepts the updates again", _host(self.endpoint.url))
        return True

    def _http_failed(self, e: urllib.error.HTTPError) -> bool:
        code = e.code
        try:
            message = json.loads(e.read(1 << 16) or b"{}").get("message") or ""
        except (ValueError, AttributeError, OSError):
            message = ""
        said = f": {str(message)[:200]}" if message else ""
        if code == 403:
            return self._failed("403", f"the status server refused the token (HTTP 403{said})", _FIXES["403"])
        if code == 404:
            return self._failed("404", f"the status server does not know this TrainJob (HTTP 404{said})", _FIXES["404"])
        if code in (400, 413, 422):
            return self._failed(str(code), f"the status server rejected the update (HTTP {code}{said})", _FIXES["422"])
        kind = "5xx" if code >= 500 else str(code)
        return self._failed(kind, f"the status server answered HTTP {code}{said}", _FIXES["5xx"])

    def _failed(self, kind: str, what: str, fix: str | None = None) -> bool:
        self._failing = True
        if kind not in self._reported:
            self._reported.add(kind)
            fix = fix or _FIXES.get(kind, _FIXES["5xx"])
            log.warning(
                "trainer status: %s — %s; training goes on, and the update is tried again every %g s "
                "(this is said once)",
                redact(what),
                fix,
                self.interval_s,
            )
        return False


_FIXES = {
    "403": (
        f"the token in {ENV_TOKEN} must be the projected token the Trainer controller mounts for this TrainJob; "
        "check that the pod's token volume is the controller's and that the TrainJob was not recreated"
    ),
    "404": f"check that {ENV_URL} names this TrainJob and that it still exists",
    "422": "this is a kubetune bug: report it with the message",
    "5xx": "check the Trainer controller's logs (kubeflow-system/kubeflow-trainer-controller-manager)",
    "timeout": "check the Trainer controller's logs and its Service (kubeflow-system, port 10443)",
    "network": "check the Trainer controller's Service (kubeflow-system, port 10443) and any NetworkPolicy",
    "ca": f"the Trainer controller mounts the CA that {ENV_CA} names: check the pod's volumes",
    "error": "report it as a kubetune bug",
    "tls": f"the server's certificate must be signed by the CA in {ENV_CA} (the controller's webhook CA)",
    "token": f"the Trainer controller mounts the token that {ENV_TOKEN} names: check the pod's volumes",
}


def _shown(url: str) -> str:
    """``url`` as a log line may show it: its user name and password as ``***`` (``errors.redact``, up to
    the authority's last ``@``), at most 200 characters."""
    return redact(url)[:200]


def _host(url: str) -> str:
    """The host and port of ``url``, never its user name or password."""
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return redact(url)
    if not host:
        return redact(url)
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{port}" if port else host


def _reason(e: BaseException) -> str:
    said: str = getattr(e, "reason", None) or getattr(e, "strerror", None) or str(e) or type(e).__name__
    return said[:200]
