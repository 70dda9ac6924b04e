"""Read timeouts for slow clients (deploy/http_guard.py) on a real uvicorn server, both HTTP
protocol implementations: a dribbled request line, headers or body gets a 408 and is closed
within the configured time; normal and keep-alive requests are untouched."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn

from deploy import http_guard


async def echo_app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(params=["httptools", "h11"], scope="module")
def server(request):
    pytest.importorskip(request.param)
    mp = pytest.MonkeyPatch()
    mp.setenv(http_guard.HEADER_TIMEOUT_ENV, "1.0")
    mp.setenv(http_guard.BODY_TIMEOUT_ENV, "1.5")
    protocol = http_guard._httptools_class() if request.param == "httptools" else http_guard._h11_class()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(echo_app, host="127.0.0.1", port=port, http=protocol, log_level="error",
                                        lifespan="off"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield port
    srv.should_exit = True
    thread.join(5)
    mp.undo()


def _read_all(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Bytes until the server closes; and how long that took."""
    sock.settimeout(limit_s)
    t0, data = time.monotonic(), b""
    while True:
        chunk = sock.recv(4096)
        if not chunk:
            return data, time.monotonic() - t0
        data += chunk


def test_normal_and_keep_alive_requests_pass(server):
    with socket.create_connection(("127.0.0.1", server)) as s:
        for body in (b"hello", b"again"):
            s.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            s.settimeout(5)
            reply = s.recv(4096)
            assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(body)
            time.sleep(1.2)  # idle between requests longer than the header timeout: still open


@pytest.mark.parametrize("prefix,dribble", [
    (b"", b""),  # connects, sends nothing
    (b"POST / HTTP/1.1\r\nhost: x\r\n", b"x-slow: 1\r\n"),  # headers never end
    (b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n", b"ab"),  # body never ends
])
def test_dribbling_client_is_cut_with_408(server, prefix, dribble):
    with socket.create_connection(("127.0.0.1", server)) as s:
        s.sendall(prefix)
        t0 = time.monotonic()
        closed, data = False, b""
        while time.monotonic() - t0 < 6 and not closed:
            try:
                if dribble:
                    s.sendall(dribble)
                s.settimeout(0.3)
                data = s.recv(4096)
            except TimeoutError:
                continue
            except OSError:  # reset by the server: cut, but without the 408 we want
                break
            closed = True
        elapsed = time.monotonic() - t0
        assert closed, "the dribbling connection was never cut"
        assert data.startswith(b"HTTP/1.1 408"), data
        assert elapsed < 4.0


def test_environment_names_the_callback():
    env = http_guard.environment(2, 3)
    assert env[http_guard.CALLBACK_ENV] == "deploy.http_guard:install"
    assert env[http_guard.HEADER_TIMEOUT_ENV] == "2" and env[http_guard.BODY_TIMEOUT_ENV] == "3"


def test_install_points_uvicorn_at_the_guard():
    from uvicorn import config

    saved = dict(config.HTTP_PROTOCOLS)
    try:
        assert http_guard.install() == []
        cfg = uvicorn.Config(echo_app)
        cfg.load()
        assert issubclass(cfg.http_protocol_class, http_guard._ReadDeadline)
    finally:
        config.HTTP_PROTOCOLS.clear()
        config.HTTP_PROTOCOLS.update(saved)


