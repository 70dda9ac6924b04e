"""Read timeouts for slow HTTP clients, installed into Ray Serve's proxy.

Uvicorn, which Serve's proxy runs, times out idle keep-alive connections but never a client
that dribbles its request line, headers or body: each such connection is held for good. Serve
calls the function named by RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH in every proxy process
before the proxy's server starts, and in every ingress replica before its own server starts
under direct ingress (deploy/ingress.py; with HAProxy in front, HAProxy holds a client that
dribbles its headers: it forwards a request once its headers are complete); `install` points uvicorn's "auto" HTTP protocol at a subclass
that arms a timer while a request is being read: the headers must arrive within
RADIXRAY_HTTP_HEADER_TIMEOUT_S of the first byte (or of the connection opening), the body within
RADIXRAY_HTTP_BODY_TIMEOUT_S of the headers. Past either, the client gets a 408 and the
connection is closed. Generation time is not limited here (the request timeout does that).

The proxy only sees these variables if they are in the environment of the Ray processes:
`python -m cluster serve` sets them before it starts Ray; with `ray start`, export them first.
"""

from __future__ import annotations

import asyncio
import os

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK_PATH = "deploy.http_guard:install"
HEADER_TIMEOUT_ENV = "RADIXRAY_HTTP_HEADER_TIMEOUT_S"
BODY_TIMEOUT_ENV = "RADIXRAY_HTTP_BODY_TIMEOUT_S"
DEFAULT_HEADER_TIMEOUT_S = 5.0
DEFAULT_BODY_TIMEOUT_S = 30.0
_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                     b"content-length: %d\r\n\r\n%s")
_TIMEOUT_BODY = (b'{"error": {"message": "the request was not received in time", "type": '
                 b'"invalid_request_error", "param": null, "code": "request_timeout"}}')


def environment(header_timeout_s: float | None = None, body_timeout_s: float | None = None) -> dict[str, str]:
    """The variables that enable the guard in the proxies of a Ray cluster started after this."""
    env = {CALLBACK_ENV: CALLBACK_PATH}
    if header_timeout_s is not None:
        env[HEADER_TIMEOUT_ENV] = str(header_timeout_s)
    if body_timeout_s is not None:
        env[BODY_TIMEOUT_ENV] = str(body_timeout_s)
    return env


def _timeouts() -> tuple[float, float]:
    return (float(os.environ.get(HEADER_TIMEOUT_ENV, DEFAULT_HEADER_TIMEOUT_S)),
            float(os.environ.get(BODY_TIMEOUT_ENV, DEFAULT_BODY_TIMEOUT_S)))


class _ReadDeadline:
    """A mixin over a uvicorn HTTP protocol: one timer while a request is being read."""

    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    _read_timer: asyncio.TimerHandle | None = None

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(seconds, self._read_timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        flow = getattr(self, "flow", None)
        if flow is not None and flow.read_paused:  # the server stopped reading, not the client
            self._arm(_timeouts()[1])
            return
        cycle = getattr(self, "cycle", None)
        if cycle is None or not cycle.response_started:
            self.transport.write(_TIMEOUT_RESPONSE % (len(_TIMEOUT_BODY), _TIMEOUT_BODY))
        self.transport.close()


def _httptools_class() -> type:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedHttpToolsProtocol(_ReadDeadline, HttpToolsProtocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm(_timeouts()[0])  # a connection that never sends a request is cut too

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm(_timeouts()[0])

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._arm(_timeouts()[1])

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._disarm()

    return GuardedHttpToolsProtocol


def _h11_class() -> type:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(_ReadDeadline, H11Protocol):
        _phase: str | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._phase = "headers"
            self._arm(_timeouts()[0])

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._phase is None and self.conn.their_state is h11.IDLE:  # a new request begins
                self._phase = "headers"
                self._arm(_timeouts()[0])
            super().data_received(data)
            state = self.conn.their_state
            if state is h11.SEND_BODY and self._phase != "body":
                self._phase = "body"
                self._arm(_timeouts()[1])
            elif state is not h11.IDLE and state is not h11.SEND_BODY:
                self._phase = None
                self._disarm()

    return GuardedH11Protocol


def guarded_protocol() -> type:
    """The guarded form of what uvicorn's "auto" would pick (httptools if installed, else h11)."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        return _h11_class()
    return _httptools_class()


def install() -> list:
    """Serve's proxy callback: point uvicorn's "auto" protocol at the guarded one; no middlewares."""
    from uvicorn import config

    config.HTTP_PROTOCOLS["auto"] = f"{__name__}:GuardedProtocol"
    return []


def __getattr__(name: str) -> type:  # uvicorn imports "deploy.http_guard:GuardedProtocol"
    if name == "GuardedProtocol":
        return guarded_protocol()
    raise AttributeError(name)
