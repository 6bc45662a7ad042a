"""Issue 45, rows 6 and 7: rank 0's TrainJob status sender given a status URL it must not use as is.

Row 6: a URL with a user name and password: no line shows them (the worker's log filter masks
``scheme://user:pw@`` but not a bare ``user:pw@host``, which the failure warning printed).
Row 7: a URL that is not https: the bearer token went in clear over http://, and file:// "sent" to a
local file (counted as accepted). Now: one warning at start, nothing sent.

Against the FAKE status server of tests/fakes/trainer_status.py (real TLS on 127.0.0.1; no Trainer
controller can run here) and a plain HTTP listener that records what reaches it."""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from fakes.trainer_status import TrainerStatusServer

from kubetune.training.trainer_status import ENV_URL, Endpoint, StatusReporter

pytestmark = pytest.mark.integration
RECORD = {"phase": "training", "step": 3, "total_steps": 10, "loss": 1.5}
PASSWORD = "s3cr3t-PW"


@pytest.fixture
def server(tmp_path):
    with TrainerStatusServer(tmp_path / "status") as s:
        yield s


class PlainHTTP:
    """An http:// listener on 127.0.0.1 that answers 200 and keeps each request's Authorization header."""

    def __init__(self):
        seen = self.authorizations = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                seen.append(self.headers.get("Authorization"))
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/apis/trainer.kubeflow.org/v1alpha1/x/status"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _report(endpoint: Endpoint, caplog) -> StatusReporter:
    """Start a reporter, give it two records, close it (which sends what is pending, at once)."""
    with caplog.at_level(logging.INFO, logger="kubetune.trainer_status"):
        reporter = StatusReporter(endpoint, interval_s=60).start()
        reporter.update(RECORD)
        reporter.update({**RECORD, "step": 4}, final=True)
        reporter.close(wait_s=10)
    return reporter


def test_credentials_in_the_status_url_are_masked_in_every_line(server, caplog):
    url = server.url.replace("https://", f"https://alice:{PASSWORD}@")
    reporter = _report(Endpoint(url, str(server.ca_file), str(server.token_file)), caplog)
    lines = [r.getMessage() for r in caplog.records]
    assert not any(PASSWORD in line or "alice" in line for line in lines), lines
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [
        f"trainer status: {ENV_URL} ({url.replace(f'alice:{PASSWORD}@', '***@')}) holds a user name or password: "
        "the status server takes the bearer token only, so no progress is sent — remove the user:password@ part; "
        "training goes on without it"
    ]
    assert reporter.sent == 0 and server.received == []


@pytest.mark.parametrize("scheme", ["http", "file"])
def test_a_status_url_that_is_not_https_is_one_warning_at_start_and_nothing_is_sent(server, tmp_path, caplog, scheme):
    if scheme == "http":
        plain = PlainHTTP()
        url = plain.url
    else:
        (tmp_path / "status").mkdir(exist_ok=True)
        (tmp_path / "status" / "post").write_text("{}")
        url = (tmp_path / "status" / "post").as_uri()
    try:
        reporter = _report(Endpoint(url, str(server.ca_file), str(server.token_file)), caplog)
    finally:
        if scheme == "http":
            plain.close()
    if scheme == "http":
        assert plain.authorizations == []  # the token never went in clear
    assert reporter.sent == 0  # file:// was "accepted"
    assert [r.getMessage() for r in caplog.records] == [
        f"trainer status: {ENV_URL} is {url!r}, not an https URL with a host: the bearer token is sent over "
        "https only, so no progress is sent — set it to the https URL the Trainer controller injects, or unset it; "
        "training goes on without it"
    ]
    assert server.token not in caplog.text


def test_the_https_status_url_still_gets_its_updates(server, caplog):
    """The control: the same reporter with the controller's own URL sends, says where, and warns nothing."""
    reporter = _report(Endpoint(server.url, str(server.ca_file), str(server.token_file)), caplog)
    assert reporter.sent >= 1 and [b["progressPercentage"] for b in server.bodies()][-1] == 40
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert server.url in caplog.text and server.token not in caplog.text
