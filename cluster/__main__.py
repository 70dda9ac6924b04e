"""`python -m cluster {serve,batch}`: the HTTP service, or an offline batch job."""

from __future__ import annotations

import argparse
import os
import sys

from engine import EngineConfig


def add_engine_flags(ap: argparse.ArgumentParser) -> None:
    """Every EngineConfig field as a --flag (same names, dashes for underscores)."""
    g = ap.add_argument_group("engine options (EngineConfig)")
    skip = {"model_path", "device", "torch_threads"}
    for name, default in zip(EngineConfig.__struct_fields__, EngineConfig.__struct_defaults__):
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            g.add_argument(flag, dest=name, action="store_true", default=None)
        else:
            kind = type(default) if default is not None else (
                float if name.endswith(("fraction_static", "ratio")) else
                str if name in ("schedule_policy", "attention_backend", "linear_backend", "dtype") else int)
            g.add_argument(flag, dest=name, type=kind, default=None)


def engine_overrides(args: argparse.Namespace) -> dict:
    skip = {"model_path", "device", "torch_threads"}
    return {k: getattr(args, k) for k in EngineConfig.__struct_fields__
            if k not in skip and getattr(args, k, None) is not None}


def serve_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m cluster serve",
                                 description="Serve the OpenAI-compatible API with Ray Serve.")
    ap.add_argument("--model", default=None, help="HF checkpoint folder (default: the built-in noise model)")
    ap.add_argument("--engines", type=int, default=1)
    ap.add_argument("--routing", default="cache_aware", choices=["round_robin", "least_load", "cache_aware"])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--cpus-per-engine", type=float, default=1.0)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=None, help="require this bearer token (or set RADIXRAY_API_KEY)")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--dp-attention", action="store_true")
    ap.add_argument("--dp-group-size", type=int, default=None)
    ap.add_argument("--address", default=None, help="Ray address (default: RAY_ADDRESS or a new local cluster)")
    ap.add_argument("--request-timeout-s", type=float, default=None, help="end a request after this long")
    ap.add_argument("--http-header-timeout-s", type=float, default=None,
                    help="cut a client whose request line and headers take longer (default 5; new local Ray only)")
    ap.add_argument("--http-body-timeout-s", type=float, default=None,
                    help="cut a client whose request body takes longer (default 30; new local Ray only)")
    add_engine_flags(ap)
    return ap


def serve_main(argv: list[str]) -> int:
    args = serve_parser().parse_args(argv)
    import signal
    import time

    import ray
    from ray import serve

    from cluster.cluster import ensure_ray
    from deploy import http_guard
    from deploy.app import build_app

    app_args = {"model_path": args.model, "num_engines": args.engines, "routing": args.routing,
                "device": args.device, "cpus_per_engine": args.cpus_per_engine, "api_key": args.api_key,
                "served_model_name": args.served_model_name, "dp_attention": args.dp_attention,
                "dp_group_size": args.dp_group_size, "engine": engine_overrides(args)}
    if args.request_timeout_s is not None:
        app_args["request_timeout_s"] = args.request_timeout_s
    app = build_app(app_args)
    # The proxies inherit these from the Ray processes this starts (a cluster joined by
    # --address needs them in its own environment).
    os.environ.update(http_guard.environment(args.http_header_timeout_s, args.http_body_timeout_s))
    # Request failures and engine tracebacks are printed here, not only in Ray's log files.
    ensure_ray(args.address, log_to_driver=True)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(app, name="radixray", route_prefix="/", blocking=False)
    url = f"http://{args.host}:{args.port}"
    key = ' -H "Authorization: Bearer $RADIXRAY_API_KEY"' if args.api_key else ""
    print(f"radixray is serving on {url}  (Ctrl-C to stop)\n"
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
