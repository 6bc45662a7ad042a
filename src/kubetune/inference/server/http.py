"""The HTTP server under ``kubetune serve``: uvicorn with its h11 protocol, plus a bound on the time a
client may take to send a request's headers (``Limits.header_timeout_s``); a connection past it is closed.

Why our own bit: uvicorn has no header read timeout. Its keep-alive timer is armed only after a response
and cancelled by every byte received, so a connection that sends nothing, or trickles header bytes, is
held for ever (a slowloris); each holds a socket and a protocol object. This subclass of uvicorn's own
h11 protocol, passed as its documented ``http`` option, arms one timer while a request's headers are
awaited and closes the connection if they have not all come when it fires. The header block's size is
bounded by h11 already (uvicorn's h11_max_incomplete_event_size, 16 KiB by default)."""

from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class _HeaderTimeoutProtocol(H11Protocol):
    header_timeout_s = 10.0
    _header_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._watch()

    def handle_events(self) -> None:
        super().handle_events()
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def _awaiting_headers(self) -> bool:
        """No request in progress, and the next one's request line and headers not all in."""
        return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

    def _watch(self) -> None:
        # armed once per request, never re-armed by the bytes that trickle in: the whole header block is bounded
        if self._awaiting_headers() and not self.transport.is_closing():
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)
        else:
            self._stop_timer()

    def _stop_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self._awaiting_headers():
            self.transport.close()


def protocol(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol closing a connection whose request headers take over ``header_timeout_s``."""
    return type("KubetuneH11Protocol", (_HeaderTimeoutProtocol,), {"header_timeout_s": header_timeout_s})


def serve(app, host: str, port: int, header_timeout_s: float) -> None:
    """Serve ``app`` on ``host:port`` until interrupted."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="warning", http=protocol(header_timeout_s))
