"""`tpserve serve`: run the Serve application on a local Ray (default) or an existing cluster."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from cluster.cli_generate import add_engine_arguments, engine_config

logger = logging.getLogger(__name__)

APP_NAME = "tpserve"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="serve a model with an OpenAI-compatible API")
    add_engine_arguments(parser)
    parser.add_argument("--groups", default="1", help="TP groups: N, or MIN:MAX to autoscale")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP host (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    parser.add_argument("--kv-target-occupancy", type=float, default=0.70,
                        help="router's KV occupancy target per group (default 0.70)")
    parser.add_argument("--api-key", default=os.environ.get("TPSERVE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default $TPSERVE_API_KEY)")
    parser.add_argument("--served-model-name", default=None, help="model name in the API")
    parser.add_argument("--address", default=None,
                        help="join this Ray cluster instead of starting a local one")
    parser.add_argument("--max-queued-requests", type=int, default=None,
                        help="requests each ingress lets wait for a busy TP group; beyond "
                             "them 429 with Retry-After (default: one more round of the "
                             "groups' capacity)")
    parser.add_argument("--max-request-body-mb", type=float, default=4.0,
                        help="largest request body in MiB; larger ones get 413 (default 4)")
    parser.add_argument("--request-timeout-s", type=float, default=600.0,
                        help="a request still running after this is aborted with 504; a "
                             "client may ask for less with X-Request-Timeout (default 600)")
    parser.set_defaults(func=run, seed=None)


def run(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from cluster.app import ServeConfig, build_app, check_serve_config, parse_groups

    min_groups, max_groups = parse_groups(args.groups)
    config = ServeConfig(engine=engine_config(args), min_groups=min_groups,
                         max_groups=max_groups, kv_target_occupancy=args.kv_target_occupancy,
                         api_key=args.api_key, served_model_name=args.served_model_name,
                         max_queued_requests=args.max_queued_requests,
                         max_request_body_mb=args.max_request_body_mb,
                         request_timeout_s=args.request_timeout_s)
    check_serve_config(config)  # before Ray starts: a bad configuration never deploys
    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        try:
            serve.run(build_app(config, ray.cluster_resources()), name=APP_NAME,
                      route_prefix="/")
        except RuntimeError as exc:  # Serve gave up on a deployment (its replicas kept failing)
            print(f"tpserve serve: error: the application failed to deploy: {exc}",
                  file=sys.stderr)
            return 1
        print(f"tpserve: serving on http://{args.host}:{args.port}/v1 (Ctrl-C stops)", flush=True)
        return _serve_until_stopped()
    finally:
        from cluster.metrics import kill_metrics_store

        serve.shutdown()
        kill_metrics_store()  # detached, so it would outlive the app on a shared cluster
        ray.shutdown()


def _serve_until_stopped(check_every_s: float = 5.0) -> int:
    """Until SIGINT or SIGTERM (exit 0), or until Serve reports that the application failed to
    deploy (exit 1, saying why); a group replaced after a failure is not a deploy failure."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(check_every_s):
        app = serve.status().applications.get(APP_NAME)
        if app is not None and app.status == ApplicationStatus.DEPLOY_FAILED:
            print(f"tpserve serve: error: the application failed to deploy: {app.message}",
                  file=sys.stderr)
            return 1
    return 0
