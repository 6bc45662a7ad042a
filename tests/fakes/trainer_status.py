"""A FAKE of Kubeflow Trainer v2.3's TrainJob status server (kubeflow/trainer pkg/statusserver), on
127.0.0.1 over real TLS: no Trainer controller (nor the kube-apiserver it applies to) can run on
this machine.

It does what the upstream server does with a request, in its order: the path must be
``POST /apis/trainer.kubeflow.org/v1alpha1/namespaces/NS/trainjobs/NAME/status`` (404 otherwise);
the ``Authorization: Bearer`` token must be the one in the token file, read at every request (the
file stands for the projected token the kubelet rotates), and the path must name the TrainJob that
token's audience is for (403 otherwise); the body (at most 64 KiB, 413 above) must decode as an
``UpdateTrainJobStatusRequest`` (422 ``Invalid payload`` otherwise: Go's decoder ignores unknown
fields, so does this); no ``trainerStatus`` is a 200 that applies nothing; else the status is
validated as the apiserver's status apply would, against ``status.trainerStatus`` of the v2.3.0
TrainJob CRD with its CEL rule (tests/fakes/crds.py), 422 with the apiserver's message otherwise.
Errors are ``metav1.Status`` bodies. The certificate is signed by a fresh CA written to a file.

A test may script failures (``fail_with``: HTTP codes to answer in order before validating) or make
it hang (``hang``: accept and never answer); every request is recorded.
"""

from __future__ import annotations

import datetime
import json
import re
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from fakes import crds

_PATH = re.compile(r"^/apis/trainer\.kubeflow\.org/v1alpha1/namespaces/([^/]+)/trainjobs/([^/]+)/status$")
# Go's time.RFC3339 layout, as metav1.Time decodes it
_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})$")
MAX_BODY = 1 << 16


def trainer_status_schema() -> dict:
    """``status.trainerStatus`` of the v2.3.0 TrainJob CRD."""
    return crds.crd("trainjobs", "v2.3.0").schema["properties"]["status"]["properties"]["trainerStatus"]


def status_errors(status) -> list[str]:
    """What the apiserver says of ``status.trainerStatus`` (schema, then its CEL rule); [] when valid."""
    schema = trainer_status_schema()
    errors: list[str] = []
    crds._validate(status, schema, "status.trainerStatus", errors)
    if not errors:
        crds._run_rules(status, schema, "status.trainerStatus", errors, None)
    return errors


def _decode_errors(status) -> bool:
    """True where Go's json decoder would fail on ``UpdateTrainJobStatusRequest.trainerStatus``."""
    if status is None:
        return False
    if not isinstance(status, dict):
        return True
    for key in ("progressPercentage", "estimatedRemainingSeconds"):
        value = status.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or abs(value) >= 2**31):
            return True
    time_value = status.get("lastUpdatedTime")
    if time_value is not None and not (isinstance(time_value, str) and _RFC3339.match(time_value)):
        return True
    metrics = status.get("metrics")
    if metrics is not None:
        if not isinstance(metrics, list):
            return True
        for m in metrics:
            if not isinstance(m, dict) or any(
                k in m and not isinstance(m[k], (str, type(None))) for k in ("name", "value")
            ):
                return True
    return False


def write_ca_and_cert(directory: Path) -> tuple[Path, Path, Path]:
    """A fresh CA (``ca.crt``) and a certificate for 127.0.0.1 and localhost it signed
    (``tls.crt``, ``tls.key``), as the controller's cert rotator makes for its Service."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubetune-test-ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    import ipaddress

    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    paths = directory / "ca.crt", directory / "tls.crt", directory / "tls.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


@dataclass
class Received:
    """One request as the server saw it: when, the path, the body, and the code it answered."""

    at: float
    path: str
    body: dict | None
    code: int
    token_ok: bool


@dataclass
class TrainerStatusServer:
    """The fake status server for the TrainJob ``namespace``/``name``; ``token_file`` holds the token
    it accepts (rewrite it to rotate). Use as a context manager; ``url`` is the job's status URL."""

    directory: Path
    namespace: str = "team-a"
    name: str = "tiny"
    fail_with: list[int] = field(default_factory=list)  # codes to answer first, in order (after auth)
    hang: bool = False
    received: list[Received] = field(default_factory=list)
    applied: dict | None = None  # the TrainJob's status.trainerStatus as the last good request left it

    def __post_init__(self) -> None:
        self.ca_file, self.cert_file, self.key_file = write_ca_and_cert(self.directory)
        self.token_file = self.directory / "token"
        self.rotate("token-0-" + "x" * 40)
        self.lock = threading.Lock()
        self.release = threading.Event()  # ends a hang

    def rotate(self, token: str) -> None:
        """Replace the token atomically, as the kubelet swaps a projected volume's files."""
        tmp = self.token_file.with_suffix(".new")
        tmp.write_text(token + "\n")
        tmp.replace(self.token_file)

    @property
    def token(self) -> str:
        return self.token_file.read_text().strip()

    def url_for(self, namespace: str, name: str) -> str:
        return (
            f"https://127.0.0.1:{self.httpd.server_address[1]}"
            f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{namespace}/trainjobs/{name}/status"
        )

    @property
    def url(self) -> str:
        return self.url_for(self.namespace, self.name)

    def env(self) -> dict[str, str]:
        """The variables the Trainer controller injects into a trainer container."""
        return {
            "KUBEFLOW_TRAINER_SERVER_URL": self.url,
            "KUBEFLOW_TRAINER_SERVER_CA_CERT": str(self.ca_file),
            "KUBEFLOW_TRAINER_SERVER_TOKEN": str(self.token_file),
        }

    def __enter__(self) -> TrainerStatusServer:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert_file, self.key_file)
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.httpd.daemon_threads = True
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def bodies(self, code: int = 200) -> list[dict]:
        """The trainerStatus of each request answered ``code``, in order."""
        with self.lock:
            return [r.body["trainerStatus"] for r in self.received if r.code == code and r.body]

    # ---- the request path ----
    def answer(self, method: str, path: str, headers, raw: bytes | None) -> tuple[int, dict]:
        match = _PATH.match(path)
        if method != "POST" or match is None:
            return _status(404, "Not found", "NotFound")
        scheme, _, token = (headers.get("Authorization") or "").strip().partition(" ")
        token_ok = scheme.lower() == "bearer" and token.strip() == self.token
        # the token's audience is this one TrainJob: any other path is forbidden to it
        if not token_ok or match.groups() != (self.namespace, self.name):
            self._record(path, None, 403, token_ok)
            return _status(403, "Forbidden", "Forbidden")
        if raw is None:
            return _status(413, "Payload too large", "RequestEntityTooLarge")
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict) or _decode_errors(body.get("trainerStatus")):
            self._record(path, body if isinstance(body, dict) else None, 422, True)
            return _status(422, "Invalid payload", "Invalid")
        with self.lock:
            code = self.fail_with.pop(0) if self.fail_with else None
        if code is not None:
            self._record(path, body, code, True)
            return _status(code, "Internal error" if code >= 500 else "Forbidden", "InternalError")
        status = body.get("trainerStatus")
        if status is None:
            self._record(path, body, 200, True)
            return 200, body
        errors = status_errors(status)
        if errors:
            self._record(path, body, 422, True)
            message = f'TrainJob.trainer.kubeflow.org "{self.name}" is invalid: ' + "; ".join(errors)
            return _status(422, message, "Invalid")
        with self.lock:
            self.applied = status
        self._record(path, body, 200, True)
        return 200, body

    def _record(self, path: str, body: dict | None, code: int, token_ok: bool) -> None:
        with self.lock:
            self.received.append(Received(time.monotonic(), path, body, code, token_ok))


def _status(code: int, message: str, reason: str) -> tuple[int, dict]:
    return code, {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _handler(server: TrainerStatusServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *args) -> None:
            pass

        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length <= MAX_BODY else None
            if server.hang:
                server.release.wait(60)
                return
            code, body = server.answer(self.command, self.path, self.headers, raw)
            payload = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_POST = do_GET = do_PUT = _serve

    return Handler
