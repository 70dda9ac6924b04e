"""`python -m cluster {serve,batch}`: the HTTP service, or an offline batch job."""

from __future__ import annotations

import argparse
import os
import sys

from cluster.cli import add_cluster_flags, add_struct_flags, given
from deploy.ingress import DEFAULT_INGRESS, INGRESS_MODES


def serve_parser() -> tuple[argparse.ArgumentParser, list[str]]:
    from deploy.options import FleetOptions, HTTPOptions

    ap = argparse.ArgumentParser(prog="python -m cluster serve",
                                 description="Serve the OpenAI-compatible API with Ray Serve.")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--http-header-timeout-s", type=float, default=None,
                    help="cut a client whose request line and headers take longer (default 5; new local Ray only)")
    ap.add_argument("--http-body-timeout-s", type=float, default=None,
                    help="cut a client whose request body takes longer (default 30; new local Ray only)")
    ap.add_argument("--ingress", choices=INGRESS_MODES, default=DEFAULT_INGRESS,
                    help="how HTTP reaches the front ends (deploy/ingress.py): haproxy (an HAProxy per node on "
                         "--port, forwarding to the front ends' own HTTP servers), direct (the front ends' own "
                         "ports only, 30000-31000; Serve's proxy stays on --port) or proxy (Serve's proxy actor "
                         "relays every event); default %(default)s; new local Ray only")
    fields = add_struct_flags(ap.add_argument_group("HTTP options"), HTTPOptions)
    fleet = add_struct_flags(ap.add_argument_group(
        "fleet (front-end replicas; a fixed --num-engines, or autoscaling between --min-engines and --max-engines)"),
        FleetOptions)
    cluster, engine = add_cluster_flags(ap)
    return ap, fields + fleet + cluster + engine


def serve_main(argv: list[str]) -> int:
    ap, fields = serve_parser()
    args = ap.parse_args(argv)
    import signal
    import time

    import ray
    from ray import serve

    from cluster.cluster import ensure_ray
    from deploy import http_guard, ingress
    from deploy.app import build_app

    # The proxies and replicas inherit these from the Ray processes this starts (a cluster joined
    # by --address needs them in its own environment).
    os.environ.update(http_guard.environment(args.http_header_timeout_s, args.http_body_timeout_s))
    mode = ingress.available(args.ingress)
    if mode != args.ingress:
        print(f"radixray: no haproxy binary found; serving through Serve's proxy (--ingress {mode})", flush=True)
    os.environ.update(ingress.environment(mode))
    # Request failures and engine tracebacks are printed here, not only in Ray's log files.
    ensure_ray(args.address, log_to_driver=True)
    app = build_app(given(args, fields))  # flat: AppArgs sorts the names into its parts
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(app, name="radixray", route_prefix="/", blocking=False)
    url = f"http://{args.host}:{args.port}"
    if mode == "direct":  # the fast path is each front end's own port; --port is Serve's proxy
        urls = ingress.wait_for_direct_urls("radixray", args.host)
        url = urls[0] if urls else url
        print(f"radixray front ends (direct ingress): {', '.join(urls)}; Serve's proxy: "
              f"http://{args.host}:{args.port}", flush=True)
    if not ingress.wait_until_healthy(url):
        print(f"radixray: {url}/health does not answer 200 yet", flush=True)
    key = ' -H "Authorization: Bearer $RADIXRAY_API_KEY"' if args.api_key else ""
    print(f"radixray is serving on {url} (ingress: {mode}; Ctrl-C to stop)\n"
          f"  curl {url}/v1/completions -H 'Content-Type: application/json'{key} "
          f"-d '{{\"prompt\": \"Once upon a time\", \"max_tokens\": 32}}'", flush=True)

    def stop(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)  # `timeout`, `kill`, a container stop: shut down cleanly
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("radixray: shutting down", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("serve", "batch"):
        print("usage: python -m cluster {serve,batch} [options]   (--help after a command)", file=sys.stderr)
        return 2
    if argv[0] == "batch":
        from cluster.batch import main as batch_main

        return batch_main(argv[1:])
    return serve_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
