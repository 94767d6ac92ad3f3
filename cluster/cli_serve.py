"""`tpserve serve`: run the Serve application on a local Ray (default) or an existing cluster."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path

from cluster.cli_generate import add_engine_arguments, engine_config

logger = logging.getLogger(__name__)

# Ray's placement group strategies, for --placement-strategy (here: the CLI imports no Ray).
PLACEMENT_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="serve a model with an OpenAI-compatible API")
    add_engine_arguments(parser)
    add_serve_arguments(parser)
    parser.add_argument("--address", default=None,
                        help="join this Ray cluster instead of starting a local one")
    parser.add_argument("--grpc-port", type=int, default=9000,
                        help="gRPC API port, on every interface (default 9000; 0: none); with "
                             "--config, the file's grpc_options")
    parser.add_argument("--config", type=Path, default=None,
                        help="a Serve config file (deploy/ray/serve.yaml): its application's args "
                             "and http_options replace the other options (only --address mixes)")
    parser.set_defaults(func=run, seed=None)
    parser.set_defaults(option_defaults=vars(parser.parse_args([])))


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `serve` beyond the engine's (also the keys of a Serve config file's args)."""
    parser.add_argument("--groups", default="1", help="TP groups: N, or MIN:MAX to autoscale")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP host (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    parser.add_argument("--kv-target-occupancy", type=float, default=0.70,
                        help="router's KV occupancy target per group (default 0.70)")
    parser.add_argument("--api-key", default=os.environ.get("TPSERVE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default $TPSERVE_API_KEY)")
    parser.add_argument("--served-model-name", default=None, help="model name in the API")
    parser.add_argument("--max-migrations", type=int, default=3,
                        help="re-sends of a request to another group when its group fails "
                             "while serving it (the stream continues; 0: fail it)")
    parser.add_argument("--placement", choices=("auto", "plan", "serve"), default="auto",
                        help="who places each TP group: the topology plan (probes every node) "
                             "or Serve; auto: the plan on GPU clusters for a fixed --groups N, "
                             "Serve for --groups MIN:MAX (its placement groups are demand "
                             "Ray's autoscaler sees) (default)")
    parser.add_argument("--placement-strategy", default=None, choices=PLACEMENT_STRATEGIES,
                        help="how Serve places a group's ranks (Ray's placement group "
                             "strategy), where Serve places the groups: PACK (default, as Ray "
                             "Serve LLM: one node where one has room, else across nodes), "
                             "STRICT_PACK (one node, or wait), SPREAD, STRICT_SPREAD")
    parser.add_argument("--max-queued-requests", type=int, default=None,
                        help="requests each ingress lets wait for a busy TP group; beyond "
                             "them 429 with Retry-After (default: one more round of the "
                             "groups' capacity)")
    parser.add_argument("--max-request-body-mb", type=float, default=4.0,
                        help="largest request body in MiB; larger ones get 413 (default 4)")
    parser.add_argument("--request-timeout-s", type=float, default=600.0,
                        help="a request still running after this is aborted with 504; a "
                             "client may ask for less with X-Request-Timeout (default 600)")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="accept chat templates sent in requests (chat_template, "
                             "chat_template_kwargs.chat_template): Jinja the ingress runs, "
                             "bounded in time and size; without it they get 400")


def run(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from cluster.app import build_app, check_serve_config
    from cluster.grpc_service import grpc_options
    from cluster.serve_config import plan_from_cli, plan_from_file

    if args.config is not None:
        plan = plan_from_file(args.config, changed_options(args))
    else:
        plan = replace(plan_from_cli(args, engine_config(args)),
                       grpc_options=grpc_options(args.grpc_port))
    check_serve_config(plan.config)  # before Ray starts: a bad configuration never deploys
    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False)
    try:
        serve.start(http_options={"host": plan.host, "port": plan.port},
                    grpc_options=plan.grpc_options)
        try:
            serve.run(build_app(plan.config, ray.cluster_resources()), name=plan.app_name,
                      route_prefix=plan.route_prefix)
        except RuntimeError as exc:  # Serve gave up on a deployment (its replicas kept failing)
            print(f"tpserve serve: error: the application failed to deploy: {exc}",
                  file=sys.stderr)
            return 1
        grpc = plan.grpc_options or {}
        also = f" and gRPC on port {grpc['port']}" if grpc.get("grpc_servicer_functions") else ""
        print(f"tpserve: serving on {plan.base_url}{also} (Ctrl-C stops)", flush=True)
        return _serve_until_stopped(plan.app_name)
    finally:
        from cluster.group_allocator import kill_group_allocator
        from cluster.metrics import kill_metrics_store

        serve.shutdown()
        kill_metrics_store()  # detached, so it would outlive the app on a shared cluster
        kill_group_allocator()  # and so would the plan's placement groups
        ray.shutdown()


def changed_options(args: argparse.Namespace) -> list:
    """The options given a value other than their default (refused beside --config)."""
    defaults = args.option_defaults
    return sorted(name for name, default in defaults.items()
                  if name not in ("config", "address", "func", "seed", "option_defaults")
                  and getattr(args, name) != default)


def _serve_until_stopped(app_name: str, check_every_s: float = 5.0) -> int:
    """Until SIGINT or SIGTERM (exit 0), or until Serve reports that the application failed to
    deploy (exit 1, saying why); a group replaced after a failure is not a deploy failure."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(check_every_s):
        app = serve.status().applications.get(app_name)
        if app is not None and app.status == ApplicationStatus.DEPLOY_FAILED:
            print(f"tpserve serve: error: the application failed to deploy: {app.message}",
                  file=sys.stderr)
            return 1
    return 0
